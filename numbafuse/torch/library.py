"""numbafuse's fused ops as PyTorch custom ops (``torch.library``), for graph capture.

    torch.ops.numbafuse.conv_bias_relu(x, w, b, conv) -> y
    torch.ops.numbafuse.batchnorm_add_relu(x, z, weight, bias, running_mean, running_var,
                                           training, momentum, eps) -> (y, mean, invstd, mask)
    torch.ops.numbafuse.conv_batchnorm_relu(x, w, weight, bias, running_mean, running_var,
                                            training, eps, conv, relu) -> (y, mean, invstd)
    torch.ops.numbafuse.conv_batchnorm_add_relu(x, w, z, weight, bias, running_mean,
                                                running_var, training, eps,
                                                conv) -> (y, mean, invstd, mask)

and a ``*_backward`` op for each (the gradients asked for; an empty tensor for the others).
``conv`` is the conv's geometry as one int list, ``[stride_h, stride_w, left, right, top,
bottom, dilation_h, dilation_w, groups]`` (padding resolved; ``bridge.conv_args``). A
channels_last ``x`` runs numbafuse's NHWC kernels (``bridge.layout_of``) and the outputs of x's
shape are channels_last, in the fake rules too. The running statistics are updated by
``update_running_stats``, the one op that mutates (``mutates_args``). Each op has a fake-tensor
rule (shapes only), so ``torch.compile`` (any backend) treats it as one opaque op without a
graph break and never hands fake tensors to numbafuse's kernels, and ``torch.jit.trace`` records
it. Autograd is registered per op (``register_autograd``); its backward is the ``*_backward``
op, opaque too.

The public functions (``numbafuse.torch.conv_bias_relu``...) call these ops while torch is
capturing a graph (:func:`capturing`: ``torch.compile``, ``torch.jit.trace``) and their
``torch.autograd.Function`` otherwise (fewer microseconds of dispatch per call). The ops call
the same Functions' ``forward`` and ``backward``: one implementation.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import validate
from ..ops import batchnorm as _bn
from ..ops import conv_batchnorm as _ops
from . import bridge as _bridge
from . import conv_batchnorm as _cbn
from . import layers as _layers

LIBRARY = "numbafuse"
_EMPTY = (0,)          # the shape of a gradient not asked for


class _Ctx:
    """A ``torch.autograd.Function`` ctx for calling a Function's forward or backward
    directly (saved tensors and attributes kept, nothing recorded)."""

    def __init__(self, saved=(), needs_input_grad=(), **attributes):
        self.saved_tensors = tuple(saved)
        self.needs_input_grad = tuple(needs_input_grad)
        self.__dict__.update(attributes)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _geometry(op, x, w, conv):
    """The validated geometry of the conv of ``x`` (its layout: channels_last runs NHWC) by
    ``w`` with ``conv`` (``bridge.conv_args``'s list)."""
    layout = _bridge.layout_of(x)
    sh, sw, left, right, top, bottom, dh, dw, groups = conv
    return validate.conv_geometry(op, _bridge.shape_in(layout, x), tuple(w.shape), (sh, sw),
                                  (left, right, top, bottom), (dh, dw), layout, groups)


def _call(geometry, weight):
    """The core backward's :class:`~numbafuse.ops.conv_batchnorm.Call` of a forward over
    ``geometry`` with batch-norm scale ``weight`` (no ranks: the count is this batch's)."""
    return _ops.Call(geometry, geometry.N * geometry.P * geometry.Q,
                     _bridge.as_array(weight).dtype)


def _y_shape(x_shape, w_shape, conv):
    """The conv's output shape (N, K, P, Q), from sizes that may be symbolic (fake-tensor
    rules: no validation, which wants plain ints; the real op validates)."""
    N, _, H, W = x_shape
    K, _, R, S = w_shape
    sh, sw, left, right, top, bottom, dh, dw, _ = conv
    P = (H + top + bottom - dh * (R - 1) - 1) // sh + 1
    Q = (W + left + right - dw * (S - 1) - 1) // sw + 1
    return (N, K, P, Q)


def _empty_like_layout(x, shape):
    """An empty (fake) tensor of ``shape`` in x's memory format (channels_last where x is)."""
    return torch.empty(shape, dtype=x.dtype, device=x.device,
                       memory_format=_bridge.memory_format(_bridge.layout_of(x)))


def _or_empty(g, like):
    return like.new_empty(_EMPTY) if g is None else g


def _grads(outputs, needs):
    """The backward op's outputs as autograd's gradients (None where not asked for)."""
    return tuple(g if need else None for g, need in zip(outputs, needs))


def _mask_numel(shape):
    return (math.prod(shape) + 7) // 8


def _like(dy, x):
    """``dy`` contiguous in x's memory format (the layout the backward op runs in)."""
    return dy.contiguous(memory_format=_bridge.memory_format(_bridge.layout_of(x)))


# --------------------------------------------------------------------------- conv_bias_relu

@torch.library.custom_op(f"{LIBRARY}::conv_bias_relu", mutates_args=())
def conv_bias_relu(x: Tensor, w: Tensor, b: Tensor | None, conv: list[int]) -> Tensor:
    geometry = _geometry("numbafuse::conv_bias_relu", x, w, conv)
    device = _bridge.check_tensors("numbafuse::conv_bias_relu", x=x, w=w, b=b)
    return _layers.ConvBiasReLUFunction.forward(_Ctx(), x, w, b, geometry, device)


@conv_bias_relu.register_fake
def _(x, w, b, conv):
    return _empty_like_layout(x, _y_shape(x.shape, w.shape, conv))


@torch.library.custom_op(f"{LIBRARY}::conv_bias_relu_backward", mutates_args=())
def conv_bias_relu_backward(dy: Tensor, x: Tensor, w: Tensor, y: Tensor, has_bias: bool,
                            conv: list[int], need: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    geometry = _geometry("numbafuse::conv_bias_relu_backward", x, w, conv)
    ctx = _Ctx((x, w, y), need, geometry=geometry, device=x.device, has_bias=has_bias)
    dx, dw, db = _layers.ConvBiasReLUFunction.backward(ctx, dy)[:3]
    return _or_empty(dx, x), _or_empty(dw, w), _or_empty(db, w)


@conv_bias_relu_backward.register_fake
def _(dy, x, w, y, has_bias, conv, need):
    return (_empty_like_layout(x, x.shape) if need[0] else x.new_empty(_EMPTY),
            w.new_empty(w.shape if need[1] else _EMPTY),
            w.new_empty((w.shape[0],) if need[2] and has_bias else _EMPTY))


def _conv_bias_relu_setup(ctx, inputs, output):
    x, w, b, conv = inputs
    ctx.save_for_backward(x, w, output)
    ctx.args = (b is not None, conv)


def _conv_bias_relu_grad(ctx, dy):
    x, w, y = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    grads = torch.ops.numbafuse.conv_bias_relu_backward(_like(dy, x), x, w, y, *ctx.args,
                                                        list(needs))
    return _grads(grads, needs) + (None,)


conv_bias_relu.register_autograd(_conv_bias_relu_grad, setup_context=_conv_bias_relu_setup)


# --------------------------------------------------------------------------- batchnorm_add_relu

@torch.library.custom_op(f"{LIBRARY}::batchnorm_add_relu", mutates_args=())
def batchnorm_add_relu(x: Tensor, z: Tensor, weight: Tensor, bias: Tensor,
                       running_mean: Tensor | None, running_var: Tensor | None, training: bool,
                       eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    op = "numbafuse::batchnorm_add_relu"
    device = _bridge.check_tensors(op, x=x, z=z, weight=weight, bias=bias,
                                   running_mean=running_mean, running_var=running_var)
    C = x.shape[1]
    validate.running_stats(op, C, x.numel() // C, running_mean, running_var, training, 0.0, eps)
    ctx = _Ctx()
    y = _layers.BatchNormAddReLUFunction.forward(ctx, x, z, weight, bias, running_mean,
                                                 running_var, training, 0.0, eps, True,
                                                 device)
    _, _, mean, invstd, mask = ctx.saved_tensors
    return y, mean, invstd, mask


@batchnorm_add_relu.register_fake
def _(x, z, weight, bias, running_mean, running_var, training, eps):
    C = x.shape[1]
    return (_empty_like_layout(x, x.shape), x.new_empty((C,), dtype=torch.float64),
            x.new_empty((C,), dtype=torch.float64),
            x.new_empty((_mask_numel(x.shape),), dtype=torch.uint8))


@torch.library.custom_op(f"{LIBRARY}::batchnorm_add_relu_backward", mutates_args=())
def batchnorm_add_relu_backward(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor,
                                invstd: Tensor, mask: Tensor, training: bool,
                                need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ctx = _Ctx((x, weight, mean, invstd, mask), need, device=x.device, training=training,
               layout=_bridge.layout_of(x))
    dx, dz, dweight, dbias = _layers.BatchNormAddReLUFunction.backward(ctx, dy)[:4]
    return (_or_empty(dx, x), _or_empty(dz, x), _or_empty(dweight, weight),
            _or_empty(dbias, weight))


@batchnorm_add_relu_backward.register_fake
def _(dy, x, weight, mean, invstd, mask, training, need):
    return tuple((_empty_like_layout(x, x.shape) if i < 2 else x.new_empty(weight.shape))
                 if n else x.new_empty(_EMPTY) for i, n in enumerate(need))


def _batchnorm_add_relu_setup(ctx, inputs, output):
    x, _, weight = inputs[:3]
    _, mean, invstd, mask = output
    ctx.save_for_backward(x, weight, mean, invstd, mask)
    ctx.training = inputs[6]


def _batchnorm_add_relu_grad(ctx, dy, *_):
    x, weight, mean, invstd, mask = ctx.saved_tensors
    needs = ctx.needs_input_grad[:4]
    grads = torch.ops.numbafuse.batchnorm_add_relu_backward(
        _like(dy, x), x, weight, mean, invstd, mask, ctx.training, list(needs))
    return _grads(grads, needs) + (None,) * 4


batchnorm_add_relu.register_autograd(_batchnorm_add_relu_grad,
                                     setup_context=_batchnorm_add_relu_setup)


# --------------------------------------------------------------------------- conv_batchnorm_relu

@torch.library.custom_op(f"{LIBRARY}::conv_batchnorm_relu", mutates_args=())
def conv_batchnorm_relu(x: Tensor, w: Tensor, weight: Tensor, bias: Tensor,
                        running_mean: Tensor | None, running_var: Tensor | None,
                        training: bool, eps: float, conv: list[int],
                        relu: bool) -> tuple[Tensor, Tensor, Tensor]:
    op = "numbafuse::conv_batchnorm_relu"
    geometry = _geometry(op, x, w, conv)
    device = _bridge.check_tensors(op, x=x, w=w, weight=weight, bias=bias,
                                   running_mean=running_mean, running_var=running_var)
    ctx = _Ctx()
    p = _cbn.ops_params(_ops.ConvBatchNormReLU, geometry, training, 0.0, eps, running_mean,
                        running_var, relu=relu)
    y = _cbn.ConvBatchNormReLUFunction.forward(ctx, x, w, weight, bias, running_mean,
                                               running_var, p, geometry, device)
    saved = dict(zip(ctx.names, ctx.saved_tensors))
    return y, saved["mean"], saved["invstd"]


@conv_batchnorm_relu.register_fake
def _(x, w, weight, bias, running_mean, running_var, training, eps, conv, relu):
    y_shape = _y_shape(x.shape, w.shape, conv)
    return (_empty_like_layout(x, y_shape), x.new_empty((y_shape[1],), dtype=torch.float64),
            x.new_empty((y_shape[1],), dtype=torch.float64))


@torch.library.custom_op(f"{LIBRARY}::conv_batchnorm_relu_backward", mutates_args=())
def conv_batchnorm_relu_backward(dy: Tensor, x: Tensor, w: Tensor, weight: Tensor,
                                 bias: Tensor, mean: Tensor, invstd: Tensor, training: bool,
                                 eps: float, conv: list[int], relu: bool,
                                 need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    geometry = _geometry("numbafuse::conv_batchnorm_relu_backward", x, w, conv)
    p = _cbn.ops_params(_ops.ConvBatchNormReLU, geometry, training, 0.0, eps, relu=relu)
    names = ("x", "w", "gamma", "beta", "mean", "invstd") if relu else \
        ("x", "w", "gamma", "mean", "invstd")
    saved = (x, w, weight, bias, mean, invstd) if relu else (x, w, weight, mean, invstd)
    ctx = _Ctx(saved, need, p=p, call=_call(geometry, weight), names=names, device=x.device)
    dx, dw, dweight, dbias = _cbn.ConvBatchNormReLUFunction.backward(ctx, dy)[:4]
    return (_or_empty(dx, x), _or_empty(dw, w), _or_empty(dweight, weight),
            _or_empty(dbias, weight))


@conv_batchnorm_relu_backward.register_fake
def _(dy, x, w, weight, bias, mean, invstd, training, eps, conv, relu, need):
    return (_empty_like_layout(x, x.shape) if need[0] else x.new_empty(_EMPTY),
            *(x.new_empty(s if n else _EMPTY)
              for s, n in zip((w.shape, weight.shape, weight.shape), need[1:])))


def _conv_batchnorm_relu_setup(ctx, inputs, output):
    x, w, weight, bias = inputs[:4]
    _, mean, invstd = output
    ctx.save_for_backward(x, w, weight, bias, mean, invstd)
    training, eps, conv, relu = inputs[6:]
    ctx.args = (training, eps, conv, relu)


def _conv_batchnorm_relu_grad(ctx, dy, *_):
    needs = ctx.needs_input_grad[:4]
    x = ctx.saved_tensors[0]
    grads = torch.ops.numbafuse.conv_batchnorm_relu_backward(
        _like(dy, x), *ctx.saved_tensors, *ctx.args, list(needs))
    return _grads(grads, needs) + (None,) * 6


conv_batchnorm_relu.register_autograd(_conv_batchnorm_relu_grad,
                                      setup_context=_conv_batchnorm_relu_setup)


# --------------------------------------------------------------------------- + add + relu

@torch.library.custom_op(f"{LIBRARY}::conv_batchnorm_add_relu", mutates_args=())
def conv_batchnorm_add_relu(x: Tensor, w: Tensor, z: Tensor, weight: Tensor, bias: Tensor,
                            running_mean: Tensor | None, running_var: Tensor | None,
                            training: bool, eps: float,
                            conv: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    op = "numbafuse::conv_batchnorm_add_relu"
    geometry = _geometry(op, x, w, conv)
    device = _bridge.check_tensors(op, x=x, w=w, z=z, weight=weight, bias=bias,
                                   running_mean=running_mean, running_var=running_var)
    validate.running_stats(op, geometry.K, geometry.N * geometry.P * geometry.Q, running_mean,
                           running_var, training, 0.0, eps)
    ctx = _Ctx()
    p = _cbn.ops_params(_ops.ConvBatchNormAddReLU, geometry, training, 0.0, eps, running_mean,
                        running_var)
    y = _cbn.ConvBatchNormAddReLUFunction.forward(ctx, x, w, z, weight, bias, running_mean,
                                                  running_var, p, geometry, device)
    saved = dict(zip(ctx.names, ctx.saved_tensors))
    return y, saved["mean"], saved["invstd"], saved["relu_state"]


@conv_batchnorm_add_relu.register_fake
def _(x, w, z, weight, bias, running_mean, running_var, training, eps, conv):
    y_shape = _y_shape(x.shape, w.shape, conv)
    return (_empty_like_layout(x, y_shape), x.new_empty((y_shape[1],), dtype=torch.float64),
            x.new_empty((y_shape[1],), dtype=torch.float64),
            x.new_empty((_mask_numel(y_shape),), dtype=torch.uint8))


@torch.library.custom_op(f"{LIBRARY}::conv_batchnorm_add_relu_backward", mutates_args=())
def conv_batchnorm_add_relu_backward(
        dy: Tensor, x: Tensor, w: Tensor, weight: Tensor, mean: Tensor, invstd: Tensor,
        mask: Tensor, training: bool, conv: list[int],
        need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    geometry = _geometry("numbafuse::conv_batchnorm_add_relu_backward", x, w, conv)
    p = _cbn.ops_params(_ops.ConvBatchNormAddReLU, geometry, training, 0.0, 0.0)
    ctx = _Ctx((x, w, weight, mean, invstd, mask), need, p=p, call=_call(geometry, weight),
               names=("x", "w", "gamma", "mean", "invstd", "relu_state"), device=x.device)
    dx, dw, dz, dweight, dbias = _cbn.ConvBatchNormAddReLUFunction.backward(ctx, dy)[:5]
    return (_or_empty(dx, x), _or_empty(dw, w), _or_empty(dz, dy), _or_empty(dweight, weight),
            _or_empty(dbias, weight))


@conv_batchnorm_add_relu_backward.register_fake
def _(dy, x, w, weight, mean, invstd, mask, training, conv, need):
    return (_empty_like_layout(x, x.shape) if need[0] else x.new_empty(_EMPTY),
            x.new_empty(w.shape if need[1] else _EMPTY),
            _empty_like_layout(x, dy.shape) if need[2] else x.new_empty(_EMPTY),
            *(x.new_empty(weight.shape if n else _EMPTY) for n in need[3:]))


def _conv_batchnorm_add_relu_setup(ctx, inputs, output):
    x, w, _, weight = inputs[:4]
    _, mean, invstd, mask = output
    ctx.save_for_backward(x, w, weight, mean, invstd, mask)
    training, _, conv = inputs[7:]
    ctx.args = (training, conv)


def _conv_batchnorm_add_relu_grad(ctx, dy, *_):
    needs = ctx.needs_input_grad[:5]
    x = ctx.saved_tensors[0]
    grads = torch.ops.numbafuse.conv_batchnorm_add_relu_backward(
        _like(dy, x), *ctx.saved_tensors, *ctx.args, list(needs))
    return _grads(grads, needs) + (None,) * 5


conv_batchnorm_add_relu.register_autograd(_conv_batchnorm_add_relu_grad,
                                          setup_context=_conv_batchnorm_add_relu_setup)


# --------------------------------------------------------------------------- running statistics

@torch.library.custom_op(f"{LIBRARY}::update_running_stats",
                         mutates_args=("running_mean", "running_var"))
def update_running_stats(running_mean: Tensor, running_var: Tensor, mean: Tensor,
                         invstd: Tensor, eps: float, count: int, momentum: float) -> None:
    """``r = (1 - momentum) r + momentum * batch`` in place (the unbiased variance, torch's
    rule), the batch's ``var = invstd**-2 - eps``: the functional ops above leave the running
    statistics alone (autograd needs functional ops), this updates them."""
    var = invstd.reciprocal().square_().sub_(eps)
    _bn.update_running(_bridge.as_array(running_mean), _bridge.as_array(running_var),
                       _bridge.as_array(mean), _bridge.as_array(var), count, momentum)


@update_running_stats.register_fake
def _(running_mean, running_var, mean, invstd, eps, count, momentum):
    return None

