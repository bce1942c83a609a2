r"""Conv -> BatchNorm (-> ReLU) and Conv -> BatchNorm -> Add -> ReLU on torch tensors, trained
with recompute: backward keeps the conv's input, not the conv's output.

    conv_batchnorm_relu(x, w, weight, bias, running_mean=None, running_var=None, training=True,
                        momentum=0.1, eps=1e-5, stride=1, padding=0, dilation=1, relu=True,
                        groups=1)
    conv_batchnorm_add_relu(x, w, z, weight, bias, running_mean=None, running_var=None,
                            training=True, momentum=0.1, eps=1e-5, stride=1, padding=0,
                            dilation=1, groups=1)

Notation as in :mod:`numbafuse.ops.conv_batchnorm`: ``h = conv2d(x, w)`` (no bias) is the batch
norm's input, K its channels, M = N*P*Q the values per channel, ``xhat = (h - mean) * invstd``.

What each keeps for backward (``torch.autograd.graph.saved_tensors_hooks`` sees exactly these):

* ``conv_batchnorm_relu``: x, w, weight, (bias, with the ReLU: the gate is the sign of
  ``weight * xhat + bias``) and the float64 mean and invstd (K each). Backward recomputes h.
  It is :class:`numbafuse.ops.conv_batchnorm.ConvBatchNormReLU` (``recompute=True``) driven
  without numbafuse's tape: its forward, its residuals saved as torch tensors, its backward.
  In inference the batch norm is folded into the conv (that Function's rule).
* ``conv_batchnorm_add_relu``: x, w, weight, the float64 mean and invstd, and the packed 1-bit
  mask of ``y > 0`` (``numbafuse.ops.batchnorm.mask_nbytes``). numbafuse has no single kernel
  for this chain: it is composed here from the conv and batch-norm families' array helpers,
  forward ``h = conv(x, w)``, statistics, ``y = relu(weight * xhat + bias + z)`` with its mask
  (one pass over h); backward ``h = conv(x, w)`` again, the batch-norm backward gated by the
  mask (``dh, dweight, dbias, dz``), then the conv's backward of ``dh``. The unfused chain keeps
  x, h and y (or y's mask) besides; this keeps x and the mask only.

Both take torch tensors (CPU or CUDA, contiguous or channels_last: numbafuse's NHWC kernels,
zero-copy, the outputs channels_last too; float32 or float64; a grouped or depthwise conv with
``groups``) and return one,
differentiable by ``torch.autograd`` (once). Running statistics are updated in place.
"""
from __future__ import annotations

import types

import torch
from torch.autograd.function import once_differentiable

from .. import validate
from ..ops import batchnorm as _bn
from ..ops import conv as _conv
from ..ops import conv_batchnorm as _cbn
from .layers import (LAYOUT, Unrecorded, as_array, as_tensor, capturing, check_tensors,
                     conv_args, launch_order, layout_of, needs_grad, run_captured, shape_in,
                     updated_in_place)

# ConvBatchNormReLU's residual names that are views of its inputs (saved as those tensors)
_INPUT_RESIDUALS = ("x", "w", "gamma", "beta")


def _check(op, tensors, conv, training, momentum, eps):
    """Validate everything before anything is written: (device, geometry, momentum, eps).

    ``tensors``: x, w, z (or None), weight, bias, running_mean, running_var by name; ``conv``:
    stride, padding, dilation, groups. A channels_last x gives an NHWC geometry."""
    device = check_tensors(op, **tensors)
    x, w, z = tensors["x"], tensors["w"], tensors["z"]
    for name in ("x", "w", "weight", "bias"):
        if tensors[name] is None:
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got None")
    if isinstance(conv["padding"], str) and conv["padding"] == "same" and validate.pair(
            op, "stride", conv["stride"], 1) != (1, 1):
        raise ValueError(f"{op}: padding='same' needs stride 1 (as torch), got "
                         f"{conv['stride']!r}")
    validate.check_ndim(op, "x", x, 4, "N, C, H, W")
    layout = layout_of(x)
    geometry = validate.conv_geometry(op, shape_in(layout, x), tuple(w.shape), conv["stride"],
                                      conv["padding"], conv["dilation"], layout, conv["groups"])
    y_shape = (geometry.N, geometry.K, geometry.P, geometry.Q)                 # torch's order
    if z is not None and tuple(z.shape) != y_shape:
        raise ValueError(f"{op}: z has shape {tuple(z.shape)}, the conv's output {y_shape}")
    validate.check_vector(op, "weight", tensors["weight"], geometry.K)
    validate.check_vector(op, "bias", tensors["bias"], geometry.K)
    for name in ("running_mean", "running_var"):
        if tensors[name] is not None and tensors[name].requires_grad:
            raise ValueError(f"{op}: {name} requires grad; running statistics are buffers "
                             f"updated in place (pass {name}.detach() or a buffer)")
    if not capturing():      # (the custom op checks them when it runs: fake tensors here)
        momentum, eps = validate.running_stats(op, geometry.K,
                                               geometry.N * geometry.P * geometry.Q,
                                               tensors["running_mean"], tensors["running_var"],
                                               training, momentum, eps)
    return device, geometry, momentum, eps


def ops_function(geometry, relu, training, momentum, eps, running_mean=None, running_var=None):
    """numbafuse's :class:`~numbafuse.ops.conv_batchnorm.ConvBatchNormReLU` (recompute) for
    ``geometry`` (its layout, padding resolved, groups), on torch's running statistics."""
    g = geometry
    return _cbn.ConvBatchNormReLU(
        running_mean=as_array(running_mean), running_var=as_array(running_var),
        training=training, momentum=momentum, eps=eps, stride=(g.sh, g.sw),
        padding=(g.pw, g.pw_end, g.ph, g.ph_end), dilation=(g.dh, g.dw), groups=g.groups,
        relu=relu, layout=g.layout, recompute=True, comm=None)


# --------------------------------------------------------------------------- conv_batchnorm_relu

class ConvBatchNormReLUFunction(torch.autograd.Function):
    r"""``y = [relu](weight * xhat + bias)``, ``xhat`` the batch norm of ``h = conv2d(x, w)``,
    by numbafuse's :class:`~numbafuse.ops.conv_batchnorm.ConvBatchNormReLU` (recompute).

    .. math::
        \mu_k, \sigma_k^2 = \text{batch statistics of } h, \quad
        y = [\max](\gamma_k \hat h + \beta_k,\ 0), \quad g = dy \cdot [y > 0], \\
        d\beta_k = \sum g, \quad d\gamma_k = \sum g \hat h, \quad
        dh = \frac{\gamma_k\,\mathrm{invstd}_k}{M}(M g - d\beta_k - \hat h\, d\gamma_k), \quad
        dw = \mathrm{correlate}(x, dh), \quad dx = \mathrm{conv\_transpose}(dh, w)

    Residuals: x, w, weight, [bias], mean, invstd; h is recomputed in backward.
    """

    # fwd :: (x, w, weight, bias) -> (y, residuals=(x, w, weight, [bias], mean, invstd))
    @staticmethod
    def forward(ctx, x, w, weight, bias, running_mean, running_var, training, momentum, eps,
                geometry, relu, device):
        fn = ops_function(geometry, relu, training, momentum, eps, running_mean, running_var)
        layout = geometry.layout
        with launch_order(device):
            y = fn.forward(as_array(x, layout), as_array(w), as_array(weight), as_array(bias))
        if training and running_mean is not None:
            updated_in_place(running_mean, running_var)
        inputs = dict(zip(_INPUT_RESIDUALS, (x, w, weight, bias)))
        names = tuple(vars(fn.saved))
        ctx.save_for_backward(*(inputs[n] if n in inputs else as_tensor(a, device)
                                for n, a in vars(fn.saved).items()))
        fn.saved = types.SimpleNamespace()        # torch holds the residuals now
        ctx.fn, ctx.names, ctx.device = fn, names, device
        return as_tensor(y, device, layout)

    # bwd :: (residuals, dy) -> (dx, dw, dweight, dbias)
    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        fn = ctx.fn
        layout = fn.params.layout                                 # x's, dy's and dx's
        fn.saved = types.SimpleNamespace(**{n: as_array(t, layout if n == "x" else LAYOUT)
                                            for n, t in zip(ctx.names, ctx.saved_tensors)})
        fn.needs_input_grad = tuple(ctx.needs_input_grad[:4])
        try:
            with launch_order(ctx.device):
                dx, dw, dweight, dbias = fn.backward(as_array(dy, layout))
        finally:
            fn.saved = types.SimpleNamespace()
        return (as_tensor(dx, ctx.device, layout), as_tensor(dw, ctx.device),
                as_tensor(dweight, ctx.device), as_tensor(dbias, ctx.device)) + (None,) * 8


def conv_batchnorm_relu(x, w, weight, bias, running_mean=None, running_var=None, training=True,
                        momentum=0.1, eps=1e-5, stride=1, padding=0, dilation=1, relu=True,
                        groups=1):
    """Fused ``relu(batch_norm(conv2d(x, w)))`` on torch tensors, trained with recompute.

    Computes ``F.batch_norm(F.conv2d(x, w, None, stride, padding, dilation, groups),
    running_mean, running_var, weight, bias, training, momentum, eps)``, then ``.relu()`` when
    ``relu``.

    Parameters
    ----------
    x : torch.Tensor (N, C, H, W), contiguous or channels_last (then y and dx are too),
        float32 or float64, CPU or CUDA
    w : torch.Tensor (K, C/groups, R, S) (a conv without bias)
    weight, bias : torch.Tensor (K,): the batch norm's scale and shift
    running_mean, running_var : torch.Tensor (K,) or None: updated in place in training
        (unbiased variance, torch's rule); required in inference, where batch norm is folded
        into the conv.
    training : bool;  momentum : float in [0, 1];  eps : float >= 0
    stride, padding, dilation : as ``torch.nn.functional.conv2d``
    relu : bool (False: conv -> batch norm, the ResNet downsample branch)
    groups : int (``F.conv2d``'s: a grouped conv; ``groups == C``: depthwise)

    Returns
    -------
    y : torch.Tensor (N, K, P, Q). Backward keeps x, w, weight, (bias) and two K-vectors.

    Examples
    --------
    >>> import torch
    >>> from numbafuse.torch import conv_batchnorm_relu
    >>> x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    >>> rm, rv = torch.zeros(4), torch.ones(4)
    >>> y = conv_batchnorm_relu(x, w, torch.ones(4), torch.zeros(4), rm, rv, padding=1)
    >>> y.shape, bool((y >= 0).all()), bool((rm != 0).all())
    (torch.Size([2, 4, 6, 6]), True, True)
    """
    op = "numbafuse.torch.conv_batchnorm_relu"
    device, geometry, momentum, eps = _check(
        op, dict(x=x, w=w, z=None, weight=weight, bias=bias, running_mean=running_mean,
                 running_var=running_var),
        dict(stride=stride, padding=padding, dilation=dilation, groups=groups), training,
        momentum, eps)
    validate.check_flag(op, "relu", relu)
    if capturing():
        return run_captured("conv_batchnorm_relu", x, w, weight, bias, running_mean,
                            running_var, bool(training), eps, conv_args(geometry), bool(relu),
                            running_mean=running_mean, running_var=running_var,
                            training=bool(training), momentum=momentum, eps=eps,
                            count=geometry.N * geometry.P * geometry.Q)
    args = (x, w, weight, bias, running_mean, running_var, bool(training), momentum, eps,
            geometry, bool(relu), device)
    if not needs_grad(x, w, weight, bias):
        return ConvBatchNormReLUFunction.forward(Unrecorded(), *args)
    return ConvBatchNormReLUFunction.apply(*args)


# --------------------------------------------------------------------------- + add + relu

class ConvBatchNormAddReLUFunction(torch.autograd.Function):
    r"""``y = relu(weight * xhat + bias + z)``, ``xhat`` the batch norm of ``h = conv2d(x, w)``:
    the tail of a ResNet block in one op, h recomputed in backward.

    .. math::
        y = \max(\gamma_k \hat h + \beta_k + z,\ 0), \quad g = dy \cdot [y > 0], \quad dz = g,
        \\ d\beta_k = \sum g, \quad d\gamma_k = \sum g \hat h, \quad
        dh = \frac{\gamma_k\,\mathrm{invstd}_k}{M}(M g - d\beta_k - \hat h\, d\gamma_k), \quad
        dw = \mathrm{correlate}(x, dh), \quad dx = \mathrm{conv\_transpose}(dh, w)

    (inference: the running statistics, ``dh = gamma * invstd * g``). Residuals: x, w, weight,
    mean, invstd and the packed 1-bit mask of ``y > 0``.
    """

    # fwd :: (x, w, z, weight, bias) -> (y, residuals=(x, w, weight, mean, invstd, mask))
    @staticmethod
    def forward(ctx, x, w, z, weight, bias, running_mean, running_var, training, momentum, eps,
                geometry, keep_mask, device):
        layout = geometry.layout                      # NHWC for a channels_last x
        x_a, w_a = as_array(x, layout), as_array(w)
        with launch_order(device):
            h = _conv.conv_forward(x_a, w_a, None, geometry, False)        # (N, K, P, Q) | NHWC
            if training:
                mean, var, invstd = _bn.bn_stats(h, eps, layout)            # (K,) float64
                if running_mean is not None:
                    _bn.update_running(as_array(running_mean), as_array(running_var), mean,
                                       var, geometry.N * geometry.P * geometry.Q, momentum)
            else:
                mean, invstd = _bn.bn_inference_stats(as_array(running_mean),
                                                      as_array(running_var), eps)
            applied = _bn.bn_apply(h, mean, invstd, as_array(weight), as_array(bias),
                                   as_array(z, layout), relu=True, layout=layout,
                                   with_mask=keep_mask)
        del h                                                               # never kept
        if training and running_mean is not None:
            updated_in_place(running_mean, running_var)
        y, mask = applied if keep_mask else (applied, None)
        ctx.geometry, ctx.training, ctx.device = geometry, training, device
        if keep_mask:
            ctx.save_for_backward(x, w, weight, as_tensor(mean, device),
                                  as_tensor(invstd, device), as_tensor(mask, device))
        return as_tensor(y, device, layout)

    # bwd :: (residuals=(x, w, weight, mean, invstd, mask), dy) -> (dx, dw, dz, dweight, dbias)
    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        layout = ctx.geometry.layout
        x, w, weight, mean, invstd, mask = (as_array(t, layout if i == 0 else LAYOUT)
                                            for i, t in enumerate(ctx.saved_tensors))
        need_x, need_w, need_z, need_weight, need_bias = ctx.needs_input_grad[:5]
        dx = dw = None
        with launch_order(ctx.device):
            h = _conv.conv_forward(x, w, None, ctx.geometry, False)        # recomputed
            dh, dweight, dbias, dz = _bn.bn_backward(
                as_array(dy, layout), h, mean, invstd, weight, mask, layout,
                need=(need_x or need_w, need_weight, need_bias, need_z), training=ctx.training)
            del h
            if need_x or need_w:
                dx, dw, _ = _conv.conv_backward(dh, x, w, ctx.geometry, None,
                                                (need_x, need_w, False))
        return (as_tensor(dx, ctx.device, layout), as_tensor(dw, ctx.device),
                as_tensor(dz, ctx.device, layout), as_tensor(dweight, ctx.device),
                as_tensor(dbias, ctx.device)) + (None,) * 8


def conv_batchnorm_add_relu(x, w, z, weight, bias, running_mean=None, running_var=None,
                            training=True, momentum=0.1, eps=1e-5, stride=1, padding=0,
                            dilation=1, groups=1):
    """Fused ``relu(batch_norm(conv2d(x, w)) + z)`` on torch tensors, trained with recompute.

    Computes ``(F.batch_norm(F.conv2d(x, w, None, stride, padding, dilation), running_mean,
    running_var, weight, bias, training, momentum, eps) + z).relu()``.

    Parameters
    ----------
    x : torch.Tensor (N, C, H, W), contiguous or channels_last (then y, dx and dz are too),
        float32 or float64, CPU or CUDA
    w : torch.Tensor (K, C/groups, R, S) (a conv without bias)
    z : torch.Tensor (N, K, P, Q): the residual, the conv output's shape (in x's memory
        format, else read through a copy)
    weight, bias, running_mean, running_var, training, momentum, eps : as
        :func:`conv_batchnorm_relu`
    stride, padding, dilation, groups : as ``torch.nn.functional.conv2d``

    Returns
    -------
    y : torch.Tensor (N, K, P, Q). Backward keeps x, w, weight, two K-vectors and a 1-bit mask.

    Examples
    --------
    >>> import torch
    >>> from numbafuse.torch import conv_batchnorm_add_relu
    >>> x, w = torch.randn(2, 3, 6, 6), torch.randn(3, 3, 3, 3)
    >>> y = conv_batchnorm_add_relu(x, w, x, torch.ones(3), torch.zeros(3), padding=1)
    >>> y.shape, bool((y >= 0).all())
    (torch.Size([2, 3, 6, 6]), True)
    """
    op = "numbafuse.torch.conv_batchnorm_add_relu"
    if z is None:
        raise TypeError(f"{op}: z must be a torch.Tensor, got None")
    device, geometry, momentum, eps = _check(
        op, dict(x=x, w=w, z=z, weight=weight, bias=bias, running_mean=running_mean,
                 running_var=running_var),
        dict(stride=stride, padding=padding, dilation=dilation, groups=groups), training,
        momentum, eps)
    if capturing():
        return run_captured("conv_batchnorm_add_relu", x, w, z, weight, bias, running_mean,
                            running_var, bool(training), eps, conv_args(geometry),
                            running_mean=running_mean, running_var=running_var,
                            training=bool(training), momentum=momentum, eps=eps,
                            count=geometry.N * geometry.P * geometry.Q)
    args = (x, w, z, weight, bias, running_mean, running_var, bool(training), momentum, eps,
            geometry)
    if not needs_grad(x, w, z, weight, bias):
        return ConvBatchNormAddReLUFunction.forward(Unrecorded(), *args, False, device)
    return ConvBatchNormAddReLUFunction.apply(*args, True, device)
