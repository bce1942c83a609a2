r"""The fused layers Conv-Bias-ReLU and BatchNorm-Add-ReLU on torch tensors (functions and
modules).

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

The tensors are checked and viewed as numbafuse's arrays by ``bridge.py`` (zero-copy both
ways; channels_last tensors run numbafuse's NHWC kernels; CUDA stream order). **The CUDA
path is untested on a GPU** (its dispatch is tested with fakes); the CPU path against torch's.

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

import math

import torch
from torch.autograd.function import once_differentiable

from .. import backend, validate
from ..kernels.conv import weights as _weights
from ..ops import batchnorm as _bn
from ..ops import conv as _conv
from . import prepared as _prepared
from .bfloat16 import widened
from .bridge import (DEVICE_TYPES, FLOAT_DTYPES, HALF_DTYPES, LAYOUT, NUMPY_DTYPES,
                     TENSOR_DTYPES, Unrecorded, as_array, as_tensor, as_weight_grad, capturing,
                     check_tensors, conv_args, conv_geometry, launch_order, layout_of, needs_grad,
                     run_captured, updated_in_place)


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
        return (as_tensor(dx, ctx.device, layout), as_weight_grad(dw, w, ctx.device),
                as_tensor(db, ctx.device), None, None)


CONV_OP = "numbafuse.torch.conv_bias_relu"


def _conv_checks(op, x, w, b, stride, padding, dilation, groups):
    """(device, geometry) after every check of a ``conv_bias_relu`` call; nothing read from a
    value, so a call with a signature checked before (``prepared.checks_signature``) takes
    them from ``prepared.CHECKED``."""
    device = check_tensors(op, x=x, w=w, b=b)
    for name, t in (("x", x), ("w", w)):
        if t is None:
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got None")
    geometry = conv_geometry(op, x, w, stride, padding, dilation, groups)
    validate.check_vector(op, "b", b, geometry.K)
    return device, geometry


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
    op = CONV_OP
    device, geometry = _prepared.checked(
        op, (x, w, b), (stride, padding, dilation, groups),
        lambda: _conv_checks(op, x, w, b, stride, padding, dilation, groups))
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
        if not x.is_cuda and x.dtype in FLOAT_DTYPES and x.numel():   # the kernels straight
            out = _bn.cpu_forward(
                as_array(x, layout), as_array(z, layout), as_array(weight), as_array(bias),
                as_array(running_mean), as_array(running_var), training, momentum, eps,
                layout, keep_mask)
            return BatchNormAddReLUFunction._done(ctx, x, weight, (running_mean, running_var),
                                                  training, device, layout, keep_mask, out)
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
        return BatchNormAddReLUFunction._done(ctx, x, weight, (running_mean, running_var),
                                              training, device, layout, keep_mask,
                                              (out.y, out.mask, out.mean, out.invstd))

    @staticmethod
    def _done(ctx, x, weight, running, training, device, layout, keep_mask, out):
        # the forward's end, either way (out: y, mask, mean, invstd): the running statistics'
        # versions bumped, the residuals kept, y as a tensor
        y, mask, mean, invstd = out
        if training and running[0] is not None:
            updated_in_place(*running)
        ctx.device, ctx.training, ctx.layout = device, training, layout
        if keep_mask:
            ctx.save_for_backward(x, weight, as_tensor(mean, device), as_tensor(invstd, device),
                                  as_tensor(mask, device))
        return as_tensor(y, device, layout)

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


def _batchnorm_checks(op, x, z, weight, bias, running_mean, running_var, training, momentum,
                      eps):
    """(device, eps) after every check of a ``batchnorm_add_relu`` call (momentum's too:
    the caller checks it again at every call, so a cumulative average's ``1/n`` is no new
    signature); nothing read from a value, so a call with a signature checked before
    (``prepared.checks_signature``) takes them from ``prepared.CHECKED``."""
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
    _, eps = validate.running_stats(op, C, x.numel() // C, running_mean, running_var, training,
                                    momentum, eps, static=capturing())
    return device, eps


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
    ready = _prepared.signature(training, x, z, weight, bias, running_mean, running_var, eps)
    layout = _prepared.VALIDATED.get(ready)        # checked before (inference, CPU): run
    if layout is not None:
        return _prepared.batchnorm_add_relu(layout, x, z, weight, bias, running_mean,
                                            running_var, eps)
    op = BATCHNORM_OP
    tensors = (x, z, weight, bias, running_mean, running_var)
    device, eps = _prepared.checked(op, tensors, (training, eps),      # momentum: below
                                    lambda: _batchnorm_checks(op, *tensors, training,
                                                              momentum, eps))
    C = x.shape[1]
    momentum = validate.check_momentum(op, momentum, training and running_mean is not None)
    args = (x, z, weight, bias, running_mean, running_var, bool(training), momentum, eps)
    if capturing():
        return run_captured("batchnorm_add_relu", x, z, weight, bias, running_mean,
                            running_var, bool(training), eps, running_mean=running_mean,
                            running_var=running_var, training=bool(training),
                            momentum=momentum, eps=eps, count=x.numel() // C)
    if not needs_grad(x, z, weight, bias):
        y = BatchNormAddReLUFunction.forward(Unrecorded(), *args, False, device)
        _prepared.keep(_prepared.VALIDATED, ready, layout_of(x))  # (None: nothing kept)
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
