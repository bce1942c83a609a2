r"""The bridge between torch tensors and numbafuse's arrays, and the fused layers
Conv-Bias-ReLU and BatchNorm-Add-ReLU (functions and modules).

    conv_bias_relu(x, w, b=None, stride=1, padding=0, dilation=1, groups=1)
    batchnorm_add_relu(x, z, weight, bias, running_mean=None, running_var=None,
                       training=True, momentum=0.1, eps=1e-5)
    ConvBiasReLU2d(in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                   bias=True, device=None, dtype=None, *, groups=1)
                                        # the state_dict of torch.nn.Conv2d
    BatchNormAddReLU2d(num_features, eps=1e-5, momentum=0.1, device=None, dtype=None)
                                        # m(x, z); the state_dict of torch.nn.BatchNorm2d

torch tensors in (CPU or CUDA, contiguous or ``torch.channels_last``, float32, float64 or half
precision (float16; bfloat16 on the CPU: ``bfloat16.py``), all of one dtype (a half x's
batch-norm parameters and running statistics may be float32) and on one device), torch
tensors out, differentiable by ``torch.autograd``: each function is a ``torch.autograd.Function``
whose forward and backward are numbafuse's fused kernels. While torch captures a graph
(:func:`capturing`: ``torch.compile``, ``torch.jit.trace``) the functions call their
``torch.library`` custom ops instead (``numbafuse.torch.library``), which wrap the same Functions.

Zero-copy both ways. A CPU tensor is read as the NumPy view ``t.detach().numpy()`` and an output
comes back as ``torch.from_numpy(array)``, which keeps numbafuse's array alive; a CUDA tensor is
read through ``__cuda_array_interface__`` as a numba device array and an output comes back as
``torch.as_tensor(device_array, device=...)`` (``__cuda_array_interface__`` again; the tensor
keeps the device array alive). Running statistics are updated in place in the torch buffers.

Memory formats. An activation in ``torch.channels_last`` (N, C, H, W shape, strides of an
N, H, W, C array) runs numbafuse's NHWC kernels: ``x.permute(0, 2, 3, 1)`` is a C-contiguous
NHWC view of the same memory (no copy), and the NHWC output comes back as
``y.permute(0, 3, 1, 2)``, a channels_last tensor, as torch's own layers return (forward and
backward: dx is channels_last too). :func:`layout_of` decides per call from the input ``x``: a
tensor contiguous in both formats (C = 1, or H = W = 1) runs NCHW. Weights are (K, C, R, S)
in either format; a channels_last weight (``model.to(memory_format=torch.channels_last)``
converts them too) is read through a contiguous copy, and a residual ``z`` or gradient ``dy``
in the other format than ``x`` is copied into ``x``'s.

CUDA streams. numbafuse launches on numba's default stream, the legacy default stream, also
PyTorch's default: nothing to synchronize there. Neither side's ``__cuda_array_interface__``
carries a stream the other waits on (torch's is version 2), so on another current torch stream
:func:`launch_order` orders the work on the device (``Stream.wait_stream`` both ways, no host
synchronization). Tensors on another CUDA device than numba's current one are refused. **The
CUDA path is untested on a GPU** (its dispatch is tested with fakes); the CPU path against torch's.

Inference calls of ``batchnorm_add_relu`` whose checks passed before skip them (``prepared.py``).

What backward keeps (the numbafuse ops' residuals, not the pre-activations):

* conv_bias_relu: x, w and y; the ReLU mask is read from y (``g = dy * (y > 0)``; the next
  layer often keeps y anyway: torch shares one saved tensor).
* batchnorm_add_relu: x, weight, the float64 mean and invstd, and a packed 1-bit ReLU mask
  (``numbafuse.ops.batchnorm.mask_nbytes``: 1/32 of a float32 y), not y.

Examples
--------
>>> import torch
>>> from numbafuse.torch import ConvBiasReLU2d, BatchNormAddReLU2d
>>> conv, bn = ConvBiasReLU2d(3, 3, 3, padding=1), BatchNormAddReLU2d(3)
>>> x = torch.randn(2, 3, 8, 8, requires_grad=True)
>>> y = bn(conv(x), x)                # relu(bn(relu(conv(x) + b)) + x)
>>> y.sum().backward()
>>> x.grad.shape, int(bn.num_batches_tracked)
(torch.Size([2, 3, 8, 8]), 1)
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

import torch
from torch.autograd.function import once_differentiable

from .. import backend, validate
from ..kernels.conv import weights as _weights
from ..ops import batchnorm as _bn
from ..ops import conv as _conv
from . import prepared as _prepared
from .bfloat16 import NUMPY_BF16, numpy_dtype, widened

FLOAT_DTYPES = (torch.float32, torch.float64)
# half precision: float16 everywhere, bfloat16 on the CPU (bfloat16.py: NumPy's where
# ml_dtypes is importable, else float32 copies made by torch); numbafuse computes in float32
HALF_DTYPES = (torch.float16, torch.bfloat16)
TENSOR_DTYPES = FLOAT_DTYPES + HALF_DTYPES
NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                torch.float16: np.dtype(np.float16),
                **({torch.bfloat16: NUMPY_BF16} if NUMPY_BF16 is not None else {})}
# batch-norm parameters and running statistics: float32 with a half x (PyTorch's rule)
PARAMETERS = ("weight", "bias", "running_mean", "running_var")
DEVICE_TYPES = ("cpu", "cuda")
LAYOUT = "NCHW"                    # torch's default layout (channels_last tensors run "NHWC")


def layout_of(t):
    """numbafuse's layout for the activation ``t``: ``"NHWC"`` for a 4-d
    ``torch.channels_last`` tensor (that is not also NCHW-contiguous), else ``"NCHW"``."""
    if (t.dim() == 4 and not t.is_contiguous()
            and t.is_contiguous(memory_format=torch.channels_last)):
        return "NHWC"
    return LAYOUT


def shape_in(layout, t):
    """The shape of the 4-d tensor ``t`` as numbafuse's ``layout`` sees it."""
    N, C, H, W = t.shape
    return (N, C, H, W) if layout == "NCHW" else (N, H, W, C)


def memory_format(layout):
    """torch's memory format of numbafuse's ``layout``."""
    return torch.channels_last if layout == "NHWC" else torch.contiguous_format


# --------------------------------------------------------------------------- the bridge

def check_tensors(op, **tensors):
    """The one ``torch.device`` of the non-``None`` ``tensors``, after checking each is a
    floating torch tensor of the first one's dtype, on a CPU or CUDA device shared by all, and
    contiguous (4-d: NCHW or channels_last). With a half first tensor (float16, or bfloat16 on
    the CPU) the batch-norm :data:`PARAMETERS` may be float32 instead, all of one dtype.
    Raises ``TypeError``/``ValueError`` naming ``op`` and the argument."""
    device = dtype = first = None
    params = param_first = None           # the batch-norm parameters' dtype and first name
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in TENSOR_DTYPES:
            raise TypeError(f"{op}: {name} must be float32 or float64 (or float16, bfloat16), "
                            f"got {t.dtype}")
        if t.device.type not in DEVICE_TYPES:
            raise ValueError(f"{op}: {name} is on {t.device}; numbafuse runs on CPU and CUDA "
                             f"tensors")
        if t.dtype == torch.bfloat16 and t.device.type == "cuda":
            raise TypeError(f"{op}: {name} is a CUDA bfloat16 tensor; numba.cuda has no "
                            f"bfloat16 (float16 runs on CUDA, bfloat16 on the CPU)")
        if device is None:
            device, dtype, first = t.device, t.dtype, name
        elif t.device != device:
            # host and device mixed: TypeError (numbafuse's rule); two GPUs: ValueError
            error = TypeError if t.device.type != device.type else ValueError
            raise error(f"{op}: {name} is on {t.device} but {first} is on {device}; all "
                        f"tensors of one call must be on one device")
        elif name in PARAMETERS and dtype in HALF_DTYPES and t.dtype in (dtype, torch.float32):
            if params is None:
                params, param_first = t.dtype, name
            elif t.dtype != params:
                raise TypeError(f"{op}: {name} is {t.dtype} but {param_first} is {params}; "
                                f"batch-norm parameters and running statistics must share one "
                                f"dtype")
        elif t.dtype != dtype:
            raise TypeError(f"{op}: {name} is {t.dtype} but {first} is {dtype}; all tensors "
                            f"of one call must share one dtype"
                            + (" (or, for the batch-norm parameters, float32)"
                               if name in PARAMETERS and dtype in HALF_DTYPES else ""))
        if not t.is_contiguous() and not (
                t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)):
            raise ValueError(f"{op}: {name} is not contiguous (strides {tuple(t.stride())}); "
                             f"call {name}.contiguous()")
    if device is not None and device.type == "cuda":
        _check_cuda_device(op, device)
    return device


def _check_cuda_device(op, device):
    from .. import cuda   # numba-cuda, imported only for CUDA tensors
    index = torch.cuda.current_device() if device.index is None else device.index
    if index != cuda.current_device_id():
        raise ValueError(f"{op}: the tensors are on {device} but numbafuse's kernels run on "
                         f"numba's current device cuda:{cuda.current_device_id()} (select it "
                         f"with numba.cuda.select_device)")


def as_array(t, layout=LAYOUT):
    """The numbafuse array viewing tensor ``t``: ``t.detach().numpy()`` on the CPU, a numba
    device array through ``__cuda_array_interface__`` on CUDA; ``None`` stays None. A 4-d
    ``t`` is seen in ``layout`` (``"NHWC"``: ``t.permute(0, 2, 3, 1)``); no copy where ``t`` is
    contiguous in that layout, else a contiguous copy."""
    if t is None:
        return None
    t = t.detach() if t.requires_grad else t    # (detach: a third of this call's time)
    if layout == "NHWC" and t.dim() == 4:
        t = t.permute(0, 2, 3, 1)                                 # (N, H, W, C)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.device.type == "cuda":
        return backend.as_device_array(t)
    if t.dtype == torch.bfloat16:          # NumPy's bfloat16 is ml_dtypes': the same bits
        return t.view(torch.int16).numpy().view(numpy_dtype())
    return t.numpy()


def as_tensor(a, device, layout=LAYOUT):
    """The torch tensor viewing numbafuse's array ``a`` (no copy), on ``device``; a 4-d NHWC
    ``a`` (``layout="NHWC"``) as the channels_last tensor of shape (N, C, H, W)."""
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        bf16 = NUMPY_BF16 is not None and a.dtype == NUMPY_BF16   # (== None: float64's)
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(a)
    else:
        t = torch.as_tensor(a, device=device)
    return t.permute(0, 3, 1, 2) if layout == "NHWC" and t.dim() == 4 else t


def launch_order(device, _cpu=contextlib.nullcontext()):
    """Order numbafuse's kernels (on the legacy default stream) after the work queued on
    torch's current CUDA stream, and that stream's later work after them (device-side waits,
    no host synchronization). Nothing to do on the CPU (``_cpu``: one reusable no-op block)
    or on the default stream."""
    return _cpu if device is None or device.type != "cuda" else _cuda_launch_order(device)


@contextlib.contextmanager
def _cuda_launch_order(device):
    current, default = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if current.cuda_stream == default.cuda_stream:
        yield
        return
    default.wait_stream(current)        # numbafuse's kernels start after the queued torch work
    try:
        yield
    finally:
        current.wait_stream(default)    # later torch work starts after numbafuse's kernels


def updated_in_place(*tensors):
    """Tell autograd that ``tensors`` changed (bump their version counters), as torch's own
    in-place batch norm does, where this torch can."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    for t in tensors:
        if bump is not None and t is not None and not t.is_inference():
            bump(t)


def capturing():
    """Is torch capturing a graph (``torch.compile``'s dynamo, ``torch.jit.trace``)? Then the
    fused ops run as their ``torch.library`` custom ops (``numbafuse.torch.library``: opaque,
    with fake-tensor shape rules), else as their ``torch.autograd.Function``s."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def run_captured(name, *args, running_mean, running_var, training, momentum, eps, count):
    """y of the custom op ``torch.ops.numbafuse.<name>(*args, running_mean or None,
    running_var or None, training, eps, ...)``: the functional op, then in training the running
    statistics' update (``update_running_stats``, the one op that mutates). ``args`` has the
    running statistics in place already; in training they are given to the op as None."""
    if training:
        args = tuple(None if a is running_mean or a is running_var else a for a in args)
    outputs = getattr(torch.ops.numbafuse, name)(*args)
    if training and running_mean is not None:
        torch.ops.numbafuse.update_running_stats(running_mean, running_var, outputs[1],
                                                 outputs[2], eps, count, momentum)
    return outputs[0]


def conv_args(geometry):
    """``geometry`` as the custom ops take it: one int list ``[stride_h, stride_w, left,
    right, top, bottom, dilation_h, dilation_w, groups]`` (padding resolved)."""
    g = geometry
    return [g.sh, g.sw, g.pw, g.pw_end, g.ph, g.ph_end, g.dh, g.dw, g.groups]


def weight_cache(enabled=True):
    """Context manager: inside it (this thread), the fused conv ops on CPU tensors keep the
    arrays they derive from a weight (its transposes, Winograd taps; in inference the batch
    norm folded into it) between calls, and reuse them while the weight's tensor (and the
    batch norm's) keep their ``_version``: an eval forward of ResNet-18 at batch 16, 64x64 on
    machine A took 36.5 ms against 49.4. Use it only where weights change in ways the version
    counter sees (optimizer steps, in-place ops, ``load_state_dict``, ``nn.init``): writes
    through ``param.data`` or a NumPy view do not bump it, and the cache would serve the old
    weights' arrays. Up to ``numbafuse.kernels.conv.weights.MAX_BYTES`` (256 MB) are held;
    ``numbafuse.kernels.conv.weights.clear()`` drops them."""
    return _weights.enabled(enabled)


def needs_grad(*tensors):
    """Will autograd record this call? (Inside ``Function.forward`` grad mode is off.)"""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class Unrecorded:
    """The ``ctx`` of a Function's ``forward`` called directly, where autograd would record
    nothing (inference, ``torch.no_grad()``, no input requiring grad): it keeps what
    ``forward`` sets and saves no tensor. ``Function.apply`` costs ~9 us a call in PyTorch's
    own Python (a digits-size ``BatchNormAddReLU2d`` in ``eval()``: 66 -> 57 us a call)."""

    def save_for_backward(self, *tensors):
        pass


# --------------------------------------------------------------------------- conv_bias_relu

class ConvBiasReLUFunction(torch.autograd.Function):
    r"""Fused ``y = relu(conv2d(x, w) + b)`` on torch tensors (numbafuse's kernels).

    .. math::
        y = \max(\mathrm{conv}(x, w) + b,\ 0), \qquad g = dy \cdot [y > 0], \\
        db_k = \sum_{n,p,q} g_{nkpq}, \quad dw = \mathrm{correlate}(x, g), \quad
        dx = \mathrm{conv\_transpose}(g, w)

    Residuals: x, w and y (its sign is the ReLU mask; the pre-activation is never kept).
    """

    # fwd :: (x, w, b) -> (y, residuals=(x, w, y))
    @staticmethod
    def forward(ctx, x, w, b, geometry, device):
        layout = geometry.layout                      # x's: NCHW, or NHWC for channels_last
        wa = as_array(w)
        with launch_order(device), _weights.vouch(wa, w):     # w's transposes cached
            y = _conv.conv_forward(as_array(x, layout), wa, as_array(b), geometry, True)
        y = as_tensor(y, device, layout)
        ctx.geometry, ctx.device, ctx.has_bias = geometry, device, b is not None
        ctx.save_for_backward(x, w, y)
        return y

    # bwd :: (residuals=(x, w, y), dy) -> (dx, dw, db)
    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w, y = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        layout = ctx.geometry.layout
        wa = as_array(w)
        with launch_order(ctx.device), _weights.vouch(wa, w):
            dx, dw, db = _conv.conv_backward(
                as_array(dy, layout), as_array(x, layout), wa, ctx.geometry,
                as_array(y, layout), (need_x, need_w, need_b and ctx.has_bias))
        return (as_tensor(dx, ctx.device, layout), as_tensor(dw, ctx.device),
                as_tensor(db, ctx.device), None, None)


@widened(check_tensors)
def conv_bias_relu(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """Fused ``relu(conv2d(x, w) + b)`` on torch tensors, differentiable by torch.autograd.

    Parameters
    ----------
    x : torch.Tensor (N, C, H, W), contiguous or channels_last, float32, float64 or half, CPU
        or CUDA
    w : torch.Tensor (K, C/groups, R, S);  b : torch.Tensor (K,) or None
    stride, dilation : int or (int, int)
    padding : int, (int, int), "valid" or "same" ("same" with stride 1 only, as torch)
    groups : int (``torch.nn.functional.conv2d``'s; ``groups == C``: depthwise)

    Returns
    -------
    y : torch.Tensor (N, K, P, Q) on x's device, channels_last where x is;
    ``torch.nn.functional.conv2d(x, w, b, stride, padding, dilation, groups).relu()`` up to
    rounding.

    Examples
    --------
    >>> import torch
    >>> from numbafuse.torch import conv_bias_relu
    >>> x = torch.arange(9.0).reshape(1, 1, 3, 3)
    >>> conv_bias_relu(x, torch.ones(1, 1, 2, 2), torch.tensor([-10.0])).flatten()
    tensor([ 0.,  2., 10., 14.])
    """
    op = "numbafuse.torch.conv_bias_relu"
    device = check_tensors(op, x=x, w=w, b=b)
    for name, t in (("x", x), ("w", w)):
        if t is None:
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got None")
    if isinstance(padding, str) and padding == "same" and validate.pair(
            op, "stride", stride, 1) != (1, 1):
        raise ValueError(f"{op}: padding='same' needs stride 1 (as torch), got {stride!r}")
    validate.check_ndim(op, "x", x, 4, "N, C, H, W")
    layout = layout_of(x)
    geometry = validate.conv_geometry(op, shape_in(layout, x), tuple(w.shape), stride, padding,
                                      dilation, layout, groups)
    validate.check_vector(op, "b", b, geometry.K)
    if capturing():
        return torch.ops.numbafuse.conv_bias_relu(x, w, b, conv_args(geometry))
    if not needs_grad(x, w, b):
        return ConvBiasReLUFunction.forward(Unrecorded(), x, w, b, geometry, device)
    return ConvBiasReLUFunction.apply(x, w, b, geometry, device)


# --------------------------------------------------------------------------- batchnorm_add_relu

BATCHNORM_OP = "numbafuse.torch.batchnorm_add_relu"


class BatchNormAddReLUFunction(torch.autograd.Function):
    r"""Fused ``y = relu(weight * xhat + bias + z)`` on torch tensors (numbafuse's kernels).

    .. math::
        \hat x = (x - \mu_c)\,\mathrm{invstd}_c, \quad y = \max(w_c \hat x + b_c + z,\ 0),
        \quad g = dy \cdot [y > 0], \\
        dz = g, \quad db_c = \sum g, \quad dw_c = \sum g \hat x, \quad
        dx = \frac{w_c\,\mathrm{invstd}_c}{M}\,(M g - db_c - \hat x\,dw_c)

    (training: batch statistics, M = N*H*W; inference: the running ones, ``dx = w invstd g``).
    Residuals: x, weight, mean, invstd (float64, C each) and the packed 1-bit ReLU mask.
    Forward and backward are numbafuse's own, without its tape: ``ops.batchnorm.forward``
    (validation, statistics, running update, apply; one pass on CUDA in inference) and
    ``ops.batchnorm.bn_backward``, as the ops Function and the custom op run them.
    """

    # fwd :: (x, z, weight, bias) -> (y, residuals=(x, weight, mean, invstd, mask))
    @staticmethod
    def forward(ctx, x, z, weight, bias, running_mean, running_var, training, momentum, eps,
                keep_mask, device):
        layout = layout_of(x)                         # NHWC for a channels_last x
        p = _bn.BatchNormParams(running_mean=as_array(running_mean),
                                running_var=as_array(running_var), training=training,
                                momentum=momentum, eps=eps, layout=layout, comm=None)
        C = x.shape[1]
        args = validate.BatchNormArgs(   # checked by the callers (check_tensors and the rest)
            backend.CUDA if x.is_cuda else backend.CPU, NUMPY_DTYPES[x.dtype], layout, C,
            x.numel() // C, eps, momentum, NUMPY_DTYPES[weight.dtype])
        with launch_order(device):      # numbafuse's own forward (ops.batchnorm.forward)
            out = _bn.forward(BATCHNORM_OP, as_array(x, layout), as_array(z, layout),
                              as_array(weight), as_array(bias), p, relu=True,
                              with_mask=keep_mask, save="mask", args=args)
        if training and running_mean is not None:
            updated_in_place(running_mean, running_var)
        ctx.device, ctx.training, ctx.layout = device, training, layout
        if keep_mask:
            ctx.save_for_backward(x, weight, as_tensor(out.mean, device),
                                  as_tensor(out.invstd, device), as_tensor(out.mask, device))
        return as_tensor(out.y, device, layout)

    # bwd :: (residuals=(x, weight, mean, invstd, mask), dy) -> (dx, dz, dweight, dbias)
    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, mean, invstd, mask = ctx.saved_tensors
        need_x, need_z, need_weight, need_bias = ctx.needs_input_grad[:4]
        layout = ctx.layout
        with launch_order(ctx.device):
            dx, dweight, dbias, dz = _bn.bn_backward(
                as_array(dy, layout), as_array(x, layout), as_array(mean), as_array(invstd),
                as_array(weight), as_array(mask), layout,
                need=(need_x, need_weight, need_bias, need_z), training=ctx.training)
        return (as_tensor(dx, ctx.device, layout), as_tensor(dz, ctx.device, layout),
                as_tensor(dweight, ctx.device), as_tensor(dbias, ctx.device)) + (None,) * 7


@widened(check_tensors)
def batchnorm_add_relu(x, z, weight, bias, running_mean=None, running_var=None, training=True,
                       momentum=0.1, eps=1e-5):
    """Fused ``torch.relu(torch.nn.functional.batch_norm(x, running_mean, running_var, weight,
    bias, training, momentum, eps) + z)`` in one pass (and one backward pass), differentiable.

    Parameters
    ----------
    x, z : torch.Tensor (N, C, H, W), contiguous or channels_last, float32, float64 or half, CPU or
        CUDA (y, dx and dz in x's memory format)
    weight, bias : torch.Tensor (C,)
    running_mean, running_var : torch.Tensor (C,) or None (both or neither; not requiring
        grad). Training: updated in place, ``r = (1 - momentum) r + momentum * batch`` with the
        unbiased variance (torch's rule). Inference (``training=False``): required and read.
    training : bool;  momentum : float in [0, 1];  eps : float >= 0

    Returns y: torch.Tensor, x's shape, on x's device.

    Examples
    --------
    >>> import torch
    >>> from numbafuse.torch import batchnorm_add_relu
    >>> x = torch.arange(8.0).reshape(2, 1, 2, 2); rm, rv = torch.zeros(1), torch.ones(1)
    >>> y = batchnorm_add_relu(x, torch.zeros_like(x), torch.ones(1), torch.zeros(1), rm, rv)
    >>> int((y > 0).sum()), rm
    (4, tensor([0.3500]))
    """
    sig = _prepared.signature(training, x, z, weight, bias, running_mean, running_var, eps)
    layout = _prepared.VALIDATED.get(sig)          # checked before (inference, CPU): run
    if layout is not None:
        return _prepared.batchnorm_add_relu(layout, x, z, weight, bias, running_mean,
                                            running_var, eps)
    op = BATCHNORM_OP
    device = check_tensors(op, x=x, z=z, weight=weight, bias=bias, running_mean=running_mean,
                           running_var=running_var)
    for name, t in (("x", x), ("z", z), ("weight", weight), ("bias", bias)):
        if t is None:
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got None")
    validate.check_ndim(op, "x", x, 4, LAYOUT)
    if min(x.shape) < 1:
        raise ValueError(f"{op}: x must have no empty dimension, got shape {tuple(x.shape)}")
    validate.check_same_shape(op, "z", z, "x", x)
    C = x.shape[1]
    validate.check_vector(op, "weight", weight, C)
    validate.check_vector(op, "bias", bias, C)
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{op}: {name} requires grad; running statistics are buffers "
                             f"updated in place (pass {name}.detach() or a buffer)")
    momentum, eps = validate.running_stats(op, C, x.numel() // C, running_mean, running_var,
                                           training, momentum, eps, static=capturing())
    args = (x, z, weight, bias, running_mean, running_var, bool(training), momentum, eps)
    if capturing():
        return run_captured("batchnorm_add_relu", x, z, weight, bias, running_mean,
                            running_var, bool(training), eps, running_mean=running_mean,
                            running_var=running_var, training=bool(training),
                            momentum=momentum, eps=eps, count=x.numel() // C)
    if not needs_grad(x, z, weight, bias):
        y = BatchNormAddReLUFunction.forward(Unrecorded(), *args, False, device)
        _prepared.keep(_prepared.VALIDATED, sig, layout_of(x))    # (sig None: nothing)
        return y
    return BatchNormAddReLUFunction.apply(*args, True, device)


# --------------------------------------------------------------------------- modules

def factory_kwargs(layer, device, dtype):
    """torch's ``{"device": ..., "dtype": ...}`` for a numbafuse module's parameters and
    buffers, after checking that numbafuse runs them: dtype float32, float64 or half (None: torch's
    default dtype), device a CPU or (where torch has CUDA) a CUDA device, or ``"meta"``
    (shapes only, for deferred initialisation: ``to_empty`` then moves the module to a device
    numbafuse runs on). Errors name ``layer`` and the argument."""
    resolved = torch.get_default_dtype() if dtype is None else dtype
    if resolved not in TENSOR_DTYPES:
        raise TypeError(f"{layer}: dtype must be torch.float32 or torch.float64 (or "
                        f"{' or '.join(map(str, HALF_DTYPES))}), got {resolved}")
    if device is not None:
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{layer}: device {device!r} is not a torch device") from exc
        if kind not in DEVICE_TYPES + ("meta",):
            raise ValueError(f"{layer}: device {device!r}: numbafuse runs on 'cpu' and 'cuda'")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{layer}: device {device!r}: this torch has no CUDA device")
    return {"device": device, "dtype": dtype}


def _pair(name, value):
    """An int or pair as a pair (torch.nn.Conv2d keeps pairs); a padding string as it is."""
    return value if isinstance(value, str) else validate.pair("ConvBiasReLU2d", name, value, 0)


class ConvBiasReLU2d(torch.nn.Module):
    """``relu(conv2d(x, weight) + bias)`` fused, with the parameters, ``state_dict`` and default
    initialisation of ``torch.nn.Conv2d(in_channels, out_channels, kernel_size, stride,
    padding, dilation, groups=groups, bias=bias, device=device, dtype=dtype)`` (zero padding):
    a ``Conv2d`` followed by a ``ReLU`` can be swapped for it and load the ``Conv2d``'s
    checkpoint as it is. ``dtype`` float32, float64 or half, ``device`` CPU or CUDA (else an error
    naming the argument); channels_last inputs give channels_last outputs.

    It is not a subclass of ``torch.nn.Conv2d``, so tools that rewrite ``Conv2d`` modules
    (conv-bn folding, quantization fusers) do not mistake it for one without its ReLU.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 bias=True, device=None, dtype=None, *, groups=1):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"ConvBiasReLU2d: groups={groups} must divide in_channels="
                             f"{in_channels} and out_channels={out_channels}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = _pair("kernel_size", kernel_size)
        self.stride, self.padding = _pair("stride", stride), _pair("padding", padding)
        self.dilation = _pair("dilation", dilation)
        like = factory_kwargs("ConvBiasReLU2d", device, dtype)
        self.weight = torch.nn.Parameter(torch.empty(out_channels, in_channels // groups,
                                                     *self.kernel_size, **like))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(out_channels, **like))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        """torch.nn.Conv2d's: ``kaiming_uniform_(a=sqrt(5))`` weight, ``U(+-1/sqrt(fan_in))``
        bias, drawn in that order (the same seed gives the same values as ``Conv2d``)."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight[0].numel()
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x):
        return conv_bias_relu(x, self.weight, self.bias, self.stride, self.padding,
                              self.dilation, self.groups)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"groups={self.groups}, bias={self.bias is not None}")


class BatchNormAddReLU2d(torch.nn.Module):
    """``relu(batch_norm(x) + z)`` fused, called as ``m(x, z)``, with the parameters, buffers,
    ``state_dict`` (version 2 metadata included) and initialisation (weight 1, bias 0, running
    statistics 0 and 1, ``num_batches_tracked`` 0) of ``torch.nn.BatchNorm2d(num_features,
    eps, momentum)``. As its forward: in training ``num_batches_tracked += 1`` and the running
    statistics move by ``momentum`` (None: the cumulative average, ``1 / num_batches_tracked``);
    in ``eval()`` they are used. A residual block's tail ``relu(bn2(out) + identity)`` becomes
    ``bn_add_relu(out, identity)`` with ``bn2``'s checkpoint loaded as it is.

    Not a subclass of ``torch.nn.BatchNorm2d``: ``SyncBatchNorm.convert_sync_batchnorm`` and
    conv-bn fusers would otherwise replace it by a module without the add and the ReLU.
    """

    _version = 2    # torch.nn.BatchNorm2d's state-dict version (with num_batches_tracked)

    def __init__(self, num_features, eps=1e-5, momentum=0.1, device=None, dtype=None):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        like = factory_kwargs("BatchNormAddReLU2d", device, dtype)
        self.weight = torch.nn.Parameter(torch.empty(num_features, **like))
        self.bias = torch.nn.Parameter(torch.empty(num_features, **like))
        self.register_buffer("running_mean", torch.zeros(num_features, **like))
        self.register_buffer("running_var", torch.ones(num_features, **like))
        self.register_buffer("num_batches_tracked",
                             torch.tensor(0, dtype=torch.long, device=device))
        self.reset_parameters()

    def reset_running_stats(self):
        self.running_mean.zero_()
        self.running_var.fill_(1)
        self.num_batches_tracked.zero_()

    def reset_parameters(self):
        self.reset_running_stats()
        torch.nn.init.ones_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, x, z):
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training:
            if self.momentum is not None:   # checked where used, before anything is written
                validate.check_scalar("BatchNormAddReLU2d", "momentum", self.momentum, 0.0, 1.0)
            self.num_batches_tracked.add_(1)
            if self.momentum is None:                   # cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        return batchnorm_add_relu(x, z, self.weight, self.bias, self.running_mean,
                                  self.running_var, self.training, momentum, self.eps)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # as torch's _BatchNorm: a checkpoint older than version 2 has no num_batches_tracked
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        if (version is None or version < 2) and key not in state_dict:
            state_dict[key] = self.num_batches_tracked.clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


__all__ = ["conv_bias_relu", "batchnorm_add_relu", "ConvBiasReLU2d", "BatchNormAddReLU2d",
           "ConvBiasReLUFunction", "BatchNormAddReLUFunction"]
