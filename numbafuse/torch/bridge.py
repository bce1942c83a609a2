r"""The bridge between torch tensors and numbafuse's arrays, shared by every fused function of
``numbafuse.torch`` (``layers``, ``conv_batchnorm``, ``library``): the checks of torch
arguments, the views both ways, memory formats, CUDA stream order, and whether torch
captures a graph or autograd records a call.

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
"""
from __future__ import annotations

import contextlib

import numpy as np

import torch

from .. import backend, validate
from ..kernels.conv import weights as _weights
from ..kernels.cpu.transpose import transposed_images
from .bfloat16 import NUMPY_BF16, numpy_dtype

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


def conv_geometry(op, x, w, stride, padding, dilation, groups):
    """The ``validate.ConvGeometry`` of ``op``'s conv of the 4-d tensor ``x`` (an NHWC one
    for a channels_last x) by ``w``, after torch's own checks of the arguments:
    ``padding='same'`` with stride 1 only, x 4-d."""
    if isinstance(padding, str) and padding == "same" and validate.pair(
            op, "stride", stride, 1) != (1, 1):
        raise ValueError(f"{op}: padding='same' needs stride 1 (as torch), got {stride!r}")
    validate.check_ndim(op, "x", x, 4, "N, C, H, W")
    layout = layout_of(x)
    return validate.conv_geometry(op, shape_in(layout, x), tuple(w.shape), stride, padding,
                                  dilation, layout, groups)


def memory_format(layout):
    """torch's memory format of numbafuse's ``layout``."""
    return torch.channels_last if layout == "NHWC" else torch.contiguous_format



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
    if t.requires_grad:
        t = t.detach()                      # (a third of this call's time)
    if layout == "NHWC" and t.dim() == 4:
        t = t.permute(0, 2, 3, 1)                                 # (N, H, W, C)
    if not t.is_contiguous():
        if t.dim() == 4 and t.dtype in FLOAT_DTYPES and not t.is_cuda \
                and t.is_contiguous(memory_format=torch.channels_last):
            return _from_channels_last(t)
        t = t.contiguous()
    if t.is_cuda:                           # (not t.device.type: a device object a call)
        return backend.as_device_array(t)
    if t.dtype is torch.bfloat16:           # NumPy's bfloat16 is ml_dtypes': the same bits
        return t.view(torch.int16).numpy().view(numpy_dtype())
    return t.numpy()


def _from_channels_last(t):
    """The NCHW array (a copy) of a 4-d CPU float32/float64 channels_last tensor ``t`` (a
    conv weight of a model made channels_last, ``model.to(memory_format=torch.channels_last)``:
    every call of its fused op reads w as (K, C, R, S)), by ``transposed_images``' 8 x 8 tiles
    on the pool, each (R*S, C) block to (C, R*S): machine A, (512, 512, 3, 3) 0.24 ms against
    ``t.contiguous()``'s 0.67, (256, 256, 3, 3) 0.047 against 0.17."""
    N, C, H, W = t.shape
    a = t.permute(0, 2, 3, 1).numpy()                            # (N, H, W, C), in order
    out = np.empty((N, C, H * W), a.dtype)
    transposed_images(a.reshape(N, H * W, C), out)
    return out.reshape(N, C, H, W)


def as_weight_grad(dw, w, device):
    """:func:`as_tensor` of a conv's weight gradient ``dw`` (K, C, R, S), in the memory format
    of its weight ``w``: channels_last where w is (and R*S > 1; a 1x1's two formats are one),
    which autograd's AccumulateGrad then keeps as it is; given a contiguous dw it copies it
    into w's strides, a permuting copy of every 3x3 gradient a step (a channels_last
    ResNet-50, machine A: ~25 ms a step of such copies, with the weights' own, before)."""
    t = as_tensor(dw, device)
    if (not isinstance(dw, np.ndarray) or dw.ndim != 4 or w is None or w.is_contiguous()
            or t.dtype not in FLOAT_DTYPES
            or not w.is_contiguous(memory_format=torch.channels_last)):
        return t
    K, C, R, S = dw.shape
    hwc = np.empty((K, R * S, C), dw.dtype)
    transposed_images(np.ascontiguousarray(dw).reshape(K, C, R * S), hwc)
    return torch.from_numpy(hwc).view(K, R, S, C).permute(0, 3, 1, 2)


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
