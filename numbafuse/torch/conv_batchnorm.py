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
  It is numbafuse's tape-free core, :func:`numbafuse.ops.conv_batchnorm.forward` and
  :func:`~numbafuse.ops.conv_batchnorm.backward` (``recompute=True``), its residuals saved as
  torch tensors. In inference the batch norm is folded into the conv (that core's rule).
* ``conv_batchnorm_add_relu``: x, w, weight, the float64 mean and invstd, and the packed 1-bit
  mask of ``y > 0`` (``numbafuse.ops.batchnorm.mask_nbytes``). It is
  :func:`numbafuse.ops.conv_batchnorm.add_forward` and ``add_backward`` the same way: forward
  ``h = conv(x, w)`` with its statistics, ``y = relu(weight * xhat + bias + z)`` with its mask
  (one pass over h); backward ``h = conv(x, w)`` again, the batch-norm backward gated by the
  mask (``dh, dweight, dbias, dz``), then the conv's backward of ``dh``. The unfused chain keeps
  x, h and y (or y's mask) besides; this keeps x and the mask only.

``recompute=False`` (both): the forward keeps h too and the backward runs no conv forward.
``recompute="auto"``: False where h is cheap to keep and dear to recompute (C/groups * R * S
at least :data:`KEEP_H_MIN_MACS`, this module's line) or has at most half x's values (a
strided 1x1 downsample), else True.

Where a Conv-BN-ReLU keeps h, the next fused Conv-BN(-Add)-ReLU does not keep its input (that
output) but the producer's h, mean, invstd, weight and bias, and rebuilds it in its backward
by the batch-norm apply that made it (an elementwise pass, the same bits): y is freed after
the forward.

Both take torch tensors (CPU or CUDA, contiguous or channels_last: numbafuse's NHWC kernels,
zero-copy, the outputs channels_last too; float32, float64 or half precision (float16;
bfloat16 on the CPU: ``bfloat16.py``; float32 batch-norm parameters allowed); a grouped or
depthwise conv with ``groups``) and return one, differentiable by ``torch.autograd`` (once).
Running statistics are updated in place.
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd.function import once_differentiable

from .. import backend, validate
from ..kernels.conv import weights as _weights
from ..ops import batchnorm as _bn
from ..ops import conv_batchnorm as _cbn
from . import prepared as _prepared
from .bfloat16 import widened
from .bridge import (FLOAT_DTYPES, LAYOUT, Unrecorded, as_array, as_tensor, as_weight_grad,
                     capturing, check_tensors, conv_args, conv_geometry, launch_order, needs_grad,
                     run_captured, updated_in_place)

def _check(op, tensors, conv, training, momentum, eps):
    """Validate everything before anything is written: (device, geometry, momentum, eps).

    ``tensors``: x, w, z (or None), weight, bias, running_mean, running_var by name; ``conv``:
    stride, padding, dilation, groups. A channels_last x gives an NHWC geometry. A signature
    checked before returns what its checks returned (``prepared.CHECKED``: nothing read from
    a value); momentum is no part of it but checked at every call (a cumulative average's
    ``1/n`` is no new signature)."""
    device, geometry, _, eps = _prepared.checked(
        op, tensors.values(), (training, eps, *conv.values()),
        lambda: _checks(op, tensors, conv, training, momentum, eps))
    return device, geometry, validate.check_momentum(
        op, momentum, training and tensors["running_mean"] is not None), eps


def _checks(op, tensors, conv, training, momentum, eps):
    device = check_tensors(op, **tensors)
    x, w, z = tensors["x"], tensors["w"], tensors["z"]
    for name in ("x", "w", "weight", "bias"):
        if tensors[name] is None:
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got None")
    geometry = conv_geometry(op, x, w, conv["stride"], conv["padding"], conv["dilation"],
                             conv["groups"])
    y_shape = (geometry.N, geometry.K, geometry.P, geometry.Q)                 # torch's order
    if z is not None and tuple(z.shape) != y_shape:
        raise ValueError(f"{op}: z has shape {tuple(z.shape)}, the conv's output {y_shape}")
    validate.check_vector(op, "weight", tensors["weight"], geometry.K)
    validate.check_vector(op, "bias", tensors["bias"], geometry.K)
    for name in ("running_mean", "running_var"):
        if tensors[name] is not None and tensors[name].requires_grad:
            raise ValueError(f"{op}: {name} requires grad; running statistics are buffers "
                             f"updated in place (pass {name}.detach() or a buffer)")
    momentum, eps = validate.running_stats(op, geometry.K,
                                           geometry.N * geometry.P * geometry.Q,
                                           tensors["running_mean"], tensors["running_var"],
                                           training, momentum, eps, static=capturing())
    return device, geometry, momentum, eps


def ops_params(op_class, geometry, training, momentum, eps, running_mean=None,
               running_var=None, recompute=True, **params):
    """The ``Params`` of numbafuse's ``op_class``
    (:class:`~numbafuse.ops.conv_batchnorm.ConvBatchNormReLU`, with ``relu=`` in ``params``,
    or :class:`~numbafuse.ops.conv_batchnorm.ConvBatchNormAddReLU`) for ``geometry`` (its
    layout, padding resolved, groups), on torch's running statistics; "auto" resolved by
    this module's line, :data:`KEEP_H_MIN_MACS`."""
    g = geometry
    if recompute == "auto":
        recompute = _cbn.recomputes(recompute, g, KEEP_H_MIN_MACS)
    return op_class.Params(running_mean=as_array(running_mean),
                           running_var=as_array(running_var), training=training,
                           momentum=momentum, eps=eps, stride=(g.sh, g.sw),
                           padding=(g.pw, g.pw_end, g.ph, g.ph_end), dilation=(g.dh, g.dw),
                           groups=g.groups, layout=g.layout, recompute=recompute, comm=None,
                           **params)


def save(ctx, p, call, saved, tensors, device):
    """Keep a core forward's ``saved`` arrays on ``ctx`` as torch tensors (the inputs' own
    tensors where a residual is an input: ``tensors`` by residual name), with its params
    ``p`` and ``call``, for :func:`restore`. (An :class:`Unrecorded` ctx keeps no tensor:
    none is made.) An x that :func:`rebuilt_from` can rebuild is kept as its
    :data:`SOURCE` (the tensors its producer keeps anyway), not as itself. Returns the
    tensors kept by name (none for an Unrecorded ctx)."""
    kept = {}
    if not isinstance(ctx, Unrecorded):
        kept = {n: tensors[n] if n in tensors else as_tensor(a, device)
                for n, a in saved.items()}
        source = rebuilt_from(ctx, tensors.get("x"), p.layout) if "x" in kept else None
        if source is not None:
            del kept["x"]
            kept.update({f"x:{n}": getattr(source, n) for n in _SOURCE_PARTS})
        ctx.save_for_backward(*kept.values())
    ctx.p, ctx.call, ctx.device = p, call, device
    ctx.names = tuple(kept) if kept else tuple(saved)
    return kept


# Where a Conv-BN-ReLU keeps h (recompute False, or where "auto"'s rule keeps it), its output y is
# relu(gamma * (h - mean) * invstd + beta) of tensors its own backward keeps: the next fused
# conv, whose backward needs y as its input x, keeps those instead of y (no more memory than
# the producer's own) and its backward rebuilds x from them by the same batch-norm apply that
# made y (the same kernel on the same values: the same bits). So y itself is freed after the
# forward (PyTorch's unfused chain keeps h and y; recompute keeps x and runs the conv again).
# y holds its source weakly (``weakref.ref``): the producer's ctx holds it until the
# producer's backward, so a y kept after the step (a logged feature map) keeps no h alive.
SOURCE = "_numbafuse_source"           # the attribute of such a y: a weakref to a _Source
_SOURCE_PARTS = ("h", "mean", "invstd", "gamma", "beta")


class _Source:
    __slots__ = ("h", "mean", "invstd", "gamma", "beta", "layout", "version", "__weakref__")

    def __init__(self, h, mean, invstd, gamma, beta, layout, version):
        self.h, self.mean, self.invstd, self.gamma, self.beta = h, mean, invstd, gamma, beta
        self.layout, self.version = layout, version


def _recorded(ctx):
    """Whether ``ctx`` is autograd's own (a Function called through ``apply``): not an
    :class:`Unrecorded` one nor the custom ops' (``library._Ctx``)."""
    return isinstance(ctx, torch.autograd.function.FunctionCtx)


def with_source(ctx, y, kept, p, weight, bias):
    """``y`` (the tensor a Conv-BN-ReLU forward returns) marked with its :data:`SOURCE` where
    its backward keeps h (``kept``: :func:`save`'s tensors) and it is float32 or float64."""
    if (_recorded(ctx) and p.training and p.relu and "h" in kept
            and y.dtype in (torch.float32, torch.float64)):
        ctx.source = _Source(kept["h"], kept["mean"], kept["invstd"], weight, bias,
                             p.layout, y._version)
        setattr(y, SOURCE, weakref.ref(ctx.source))
    return y


def rebuilt_from(ctx, x, layout):
    """The :class:`_Source` of a conv input ``x`` its consumer may keep instead of x: x marked
    by :func:`with_source`, unchanged since (its version), in this conv's ``layout``, and
    ``ctx`` autograd's own; else None."""
    ref = getattr(x, SOURCE, None)
    source = ref() if ref is not None else None
    if (source is None or not _recorded(ctx) or source.layout != layout
            or x._version != source.version):
        return None
    return source


# recompute="auto" here: keep h where a value of it costs at least this many multiply-adds to
# compute again (C/groups * R * S), as numbafuse.ops.conv_batchnorm.KEEP_H_MIN_MACS (1024) does,
# but lower: a Conv-BN-ReLU's kept h stands in for its output in the next fused conv (SOURCE), so
# keeping it costs little memory. At 256 every ResNet conv keeps h but the stem and the 1x1
# convs of fewer than 256 input channels, and of those the strided ones keep it too (h half
# x's size or less: ``ops.conv_batchnorm.recomputes``; 2026-12-01, ResNet-18's downsample
# forwards 1.75 -> 0.75 ms a step at 64x64, 10.9 -> 5.7 at 224x224). Activations kept at
# batch 16, 64x64 (benchmarks/fuse_saved_bytes.py --recompute auto): ResNet-18 0.52 of
# PyTorch's (0.49 before the strided 1x1s kept h, 0.41 at 1024), ResNet-50 0.54 (0.44);
# issue 34 asks <= 0.6. At 224x224: 0.52 and 0.54.
# Machine F (AVX2, 2 cores), one process a step case, alternating, best / median of 5-6 processes
# of 4-5 steps, two runs (ms, 1024 against 256): ResNet-18 226.9 / 242.3 against 175.1 / 226.7
# and 215.1 / 224.7 against 194.7 / 217.9; ResNet-50 577.8 / 588.8 against 537.9 / 568.0 and
# 547.1 / 646.1 against 583.5 / 643.5 (within that machine's spread).
KEEP_H_MIN_MACS = 256


def _checked(device, geometry, p):
    """What the core's forward would validate, validated by :func:`_check` already: (its
    backend, the geometry, the momentum in ``p``), so that the core does not check again.
    The public functions pass it to their Function's forward (``checked=``); the custom ops
    (``library.py``, whose tensors were checked as fake tensors while torch captured) pass
    nothing, and the core validates."""
    return (backend.CUDA if device.type == "cuda" else backend.CPU, geometry, p.momentum)


def vouched(w_array, w, p, *bn):
    """``kernels.conv.weights.vouch`` of w's array: the arrays the conv derives from w (its
    transposes, Winograd taps) are cached while w is unchanged, and in inference (``p``'s
    ``training`` False, the batch norm folded into w) while the batch norm's tensors ``bn``
    are too. Training's backward: w's version alone, as the forward's."""
    return _weights.vouch(w_array, w, *(() if p.training else bn))


def restore(ctx):
    """The ``saved`` arrays of :func:`save` by name (x in its layout; an x kept as its
    :data:`SOURCE` rebuilt: ``relu(gamma * (h - mean) * invstd + beta)``), and the tensor w
    (``ctx.saved_tensors`` read once: each read unpacks and checks every saved tensor)."""
    layout, tensors = ctx.p.layout, ctx.saved_tensors
    out = {n: as_array(t, layout if n == "x" else LAYOUT) for n, t in zip(ctx.names, tensors)}
    if "x:h" in out:
        s = {n: out.pop(f"x:{n}") for n in _SOURCE_PARTS}
        with launch_order(ctx.device):
            out["x"] = _bn.bn_apply(s["h"], s["mean"], s["invstd"], s["gamma"], s["beta"],
                                    relu=True, layout=layout)
    return out, tensors[ctx.names.index("w")]


def unrecorded_inference(device, training, tensors):
    """Whether a checked call runs :func:`inference`: eval, on CPU float32 or float64
    tensors, not recorded by autograd (``tensors``: the inputs that could require grad)."""
    return (not training and device.type == "cpu" and tensors[0].dtype in FLOAT_DTYPES
            and not needs_grad(*tensors))


def inference(x, w, z, weight, bias, running_mean, running_var, geometry, eps, relu=True):
    """y of an eval call that :func:`unrecorded_inference` admits: the ops layer's
    inference kernels straight (``ops.conv_batchnorm.inference``: the Function's y, the same
    bits, without its params, residuals and mask; 119 -> 83 us a Conv-BN-ReLU call at
    (2, 8, 4, 4) on machine F)."""
    layout = geometry.layout
    wa = as_array(w)
    with _weights.vouch(wa, w, weight, bias, running_mean, running_var):
        y = _prepared.core(x.device, x.dtype, _cbn.inference, backend.CPU,
                           as_array(x, layout), wa, as_array(weight), as_array(bias),
                           as_array(running_mean), as_array(running_var), eps, geometry, relu,
                           as_array(z, layout))
    return as_tensor(y, None, layout)


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
    def forward(ctx, x, w, weight, bias, running_mean, running_var, p, geometry, device,
                checked=None):
        # p: ConvBatchNormReLU.Params (ops_params) on running_mean's and running_var's arrays
        layout = geometry.layout
        wa = as_array(w)
        with launch_order(device), vouched(wa, w, p, weight, bias, running_mean, running_var):
            y, call, saved = _prepared.core(device, x.dtype, _cbn.forward, _cbn.OP, p,
                                            as_array(x, layout), wa, as_array(weight),
                                            as_array(bias), checked)
        kept = save(ctx, p, call, saved, dict(x=x, w=w, gamma=weight, beta=bias), device)
        if p.training and running_mean is not None:
            updated_in_place(running_mean, running_var)
        return with_source(ctx, as_tensor(y, device, layout), kept, p, weight, bias)

    # bwd :: (residuals, dy) -> (dx, dw, dweight, dbias)
    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        ctx.source = None        # (its consumers, done before this, keep what they need)
        d, layout = ctx.device, ctx.p.layout
        saved, w = restore(ctx)
        with launch_order(d), vouched(saved["w"], w, ctx.p):
            dx, dw, dweight, dbias = _prepared.core(d, dy.dtype, _cbn.backward, ctx.p,
                                                    ctx.call, saved, as_array(dy, layout),
                                                    tuple(ctx.needs_input_grad[:4]))
        return (as_tensor(dx, d, layout), as_weight_grad(dw, w, d), as_tensor(dweight, d),
                as_tensor(dbias, d)) + (None,) * 6


@widened(check_tensors)
def conv_batchnorm_relu(x, w, weight, bias, running_mean=None, running_var=None, training=True,
                        momentum=0.1, eps=1e-5, stride=1, padding=0, dilation=1, relu=True,
                        groups=1, recompute=True):
    """Fused ``relu(batch_norm(conv2d(x, w)))`` on torch tensors, trained with recompute.

    Computes ``F.batch_norm(F.conv2d(x, w, None, stride, padding, dilation, groups),
    running_mean, running_var, weight, bias, training, momentum, eps)``, then ``.relu()`` when
    ``relu``.

    Parameters
    ----------
    x : torch.Tensor (N, C, H, W), contiguous or channels_last (then y and dx are too),
        float32, float64 or half (float16; bfloat16 on the CPU), CPU or CUDA
    w : torch.Tensor (K, C/groups, R, S) (a conv without bias)
    weight, bias : torch.Tensor (K,): the batch norm's scale and shift
    running_mean, running_var : torch.Tensor (K,) or None: updated in place in training
        (unbiased variance, torch's rule); required in inference, where batch norm is folded
        into the conv.
    training : bool;  momentum : float in [0, 1];  eps : float >= 0
    stride, padding, dilation : as ``torch.nn.functional.conv2d``
    relu : bool (False: conv -> batch norm, the ResNet downsample branch)
    groups : int (``F.conv2d``'s: a grouped conv; ``groups == C``: depthwise)
    recompute : True, False or "auto" (True: backward recomputes h; False: the training
        forward keeps h and, with the ReLU, a 1-bit mask, and the backward runs no conv
        forward: faster, and less memory than PyTorch's unfused chain where the next op is a
        fused conv, which keeps this h instead of y; "auto": False where a value of h costs
        at least :data:`KEEP_H_MIN_MACS` multiply-adds (C/groups * R * S: in a CNN all but
        the first and the narrowest layers) or where h has at most half x's values (a
        strided 1x1), else True; inference folds the batch norm either way)

    Returns
    -------
    y : torch.Tensor (N, K, P, Q). Backward keeps x, w, weight, (bias) and two K-vectors
        (``recompute=False``: x, w, weight, h, the mask and two K-vectors).

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
    recompute = validate.check_recompute(op, recompute)
    if capturing():
        return run_captured("conv_batchnorm_relu", x, w, weight, bias, running_mean,
                            running_var, bool(training), eps, conv_args(geometry), bool(relu),
                            running_mean=running_mean, running_var=running_var,
                            training=bool(training), momentum=momentum, eps=eps,
                            count=geometry.N * geometry.P * geometry.Q)
    if unrecorded_inference(device, training, (x, w, weight, bias)):
        return inference(x, w, None, weight, bias, running_mean, running_var, geometry, eps,
                         bool(relu))
    p = ops_params(_cbn.ConvBatchNormReLU, geometry, bool(training), momentum, eps,
                   running_mean, running_var, recompute, relu=bool(relu))
    args = (x, w, weight, bias, running_mean, running_var, p, geometry, device,
            _checked(device, geometry, p))
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

    # fwd :: (x, w, z, weight, bias) -> (y, residuals=(x, w, weight, mean, invstd, mask, [h]))
    @staticmethod
    def forward(ctx, x, w, z, weight, bias, running_mean, running_var, p, geometry, device,
                checked=None):
        # p: ConvBatchNormAddReLU.Params (ops_params) on the running statistics' arrays
        layout = geometry.layout                      # NHWC for a channels_last x
        wa = as_array(w)
        with launch_order(device), vouched(wa, w, p, weight, bias, running_mean, running_var):
            y, call, saved = _prepared.core(device, x.dtype, _cbn.add_forward,
                                            _cbn.ConvBatchNormAddReLU.name, p,
                                            as_array(x, layout), wa, as_array(z, layout),
                                            as_array(weight), as_array(bias), checked)
        save(ctx, p, call, saved, dict(x=x, w=w, gamma=weight), device)
        if p.training and running_mean is not None:
            updated_in_place(running_mean, running_var)
        return as_tensor(y, device, layout)

    # bwd :: (residuals, dy) -> (dx, dw, dz, dweight, dbias)
    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        d, layout = ctx.device, ctx.p.layout
        saved, w = restore(ctx)
        with launch_order(d), vouched(saved["w"], w, ctx.p):
            dx, dw, dz, dweight, dbias = _prepared.core(d, dy.dtype, _cbn.add_backward,
                                                        ctx.p, ctx.call, saved,
                                                        as_array(dy, layout),
                                                        tuple(ctx.needs_input_grad[:5]))
        return (as_tensor(dx, d, layout), as_weight_grad(dw, w, d), as_tensor(dz, d, layout),
                as_tensor(dweight, d), as_tensor(dbias, d)) + (None,) * 6


@widened(check_tensors)
def conv_batchnorm_add_relu(x, w, z, weight, bias, running_mean=None, running_var=None,
                            training=True, momentum=0.1, eps=1e-5, stride=1, padding=0,
                            dilation=1, groups=1, recompute=True):
    """Fused ``relu(batch_norm(conv2d(x, w)) + z)`` on torch tensors, trained with recompute.

    Computes ``(F.batch_norm(F.conv2d(x, w, None, stride, padding, dilation), running_mean,
    running_var, weight, bias, training, momentum, eps) + z).relu()``.

    Parameters
    ----------
    x : torch.Tensor (N, C, H, W), contiguous or channels_last (then y, dx and dz are too),
        float32, float64 or half (float16; bfloat16 on the CPU), CPU or CUDA
    w : torch.Tensor (K, C/groups, R, S) (a conv without bias)
    z : torch.Tensor (N, K, P, Q): the residual, the conv output's shape (in x's memory
        format, else read through a copy)
    weight, bias, running_mean, running_var, training, momentum, eps : as
        :func:`conv_batchnorm_relu`
    stride, padding, dilation, groups : as ``torch.nn.functional.conv2d``
    recompute : True, False or "auto" (True: backward recomputes h; False: the forward keeps
        h too and the backward runs no conv forward; "auto": as :func:`conv_batchnorm_relu`'s)

    Returns
    -------
    y : torch.Tensor (N, K, P, Q). Backward keeps x, w, weight, two K-vectors and a 1-bit mask
        (and h with ``recompute=False``).

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
    recompute = validate.check_recompute(op, recompute)
    if capturing():
        return run_captured("conv_batchnorm_add_relu", x, w, z, weight, bias, running_mean,
                            running_var, bool(training), eps, conv_args(geometry),
                            running_mean=running_mean, running_var=running_var,
                            training=bool(training), momentum=momentum, eps=eps,
                            count=geometry.N * geometry.P * geometry.Q)
    if unrecorded_inference(device, training, (x, w, z, weight, bias)):
        return inference(x, w, z, weight, bias, running_mean, running_var, geometry, eps)
    p = ops_params(_cbn.ConvBatchNormAddReLU, geometry, bool(training), momentum, eps,
                   running_mean, running_var, recompute)
    args = (x, w, z, weight, bias, running_mean, running_var, p, geometry, device,
            _checked(device, geometry, p))
    if not needs_grad(x, w, z, weight, bias):
        return ConvBatchNormAddReLUFunction.forward(Unrecorded(), *args)
    return ConvBatchNormAddReLUFunction.apply(*args)
