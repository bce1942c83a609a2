r"""Conv -> BatchNorm (-> ReLU) trained with recompute, and batch-norm folding for inference.

Notation: N batch, C input channels, H/W input size, K output channels (= batch-norm
channels), R/S filter size, P/Q output size, M = N*P*Q values per batch-norm channel.
``h = conv2d(x, w)`` (no bias) is the batch-norm input; ``xhat = (h - mean) * invstd``.
With ``groups`` the conv is grouped (w is (K, C/groups, R, S); ``groups == C``: depthwise);
the batch norm is per output channel as ever.

Training (``training=True``)::

    forward   h = conv(x, w);  mean, var = batch stats of h;  invstd = 1/sqrt(var + eps)
              y = [relu](gamma * xhat + beta);  running stats updated in place
    saved     x, w, gamma, mean, invstd   (+ beta when relu: the mask is the sign of
              gamma*xhat + beta)          -- NOT h, NOT y: O(K) besides the inputs
    backward  h = conv(x, w) again; the ReLU gate is [gamma*xhat + beta > 0] of that h, decided
              inside the batch-norm backward's kernels (the same arithmetic as the forward's,
              so the same bits; no y is built);
              (dconv, dgamma, dbeta) = batch-norm backward;  (dx, dw) = conv backward of dconv

``beta`` (K values) is kept only with the ReLU: the mask is the sign of gamma*xhat + beta, so it
cannot be rebuilt without it. The Function (not the public function, whose signature is fixed)
also takes ``recompute=False``: keep h and a packed 1-bit ReLU mask instead of recomputing the
conv - faster, but then the op keeps about what the unfused chain keeps.

Inference (``training=False``): one conv with bias (and ReLU) runs, the batch norm folded
into it, ``w' = w * s[k]``, ``b' = beta - running_mean * s``, ``s = gamma / sqrt(running_var +
eps)`` (:func:`fold_batchnorm`), or where the backend's conv can, ``s`` applied to its sums in
its epilogue instead of to w (``numbafuse.ops.fold``). Its backward recomputes the unfolded
chain with the running statistics as constants.

The work is done by the array-level helpers of the conv and batch-norm families
(``numbafuse.ops.conv`` / ``numbafuse.ops.batchnorm``), which dispatch to the Numba CPU
kernels for NumPy arrays and to the numba.cuda kernels for device arrays, so this module has
no kernels of its own and results stay on the device.
"""
from __future__ import annotations

import dataclasses
import types
from typing import NamedTuple

import numpy as np

from .. import autograd, backend, kernels, reference, validate
from ..autograd import Function
from . import batchnorm as _bn
from . import conv as _conv
from .fold import fold_batchnorm, inference_forward as _inference_forward  # noqa: F401
from .fold import inference_add_forward as _inference_add
from . import precision
from .batchnorm import BatchNormParams
from .spec import OpSpec

OP = "conv_batchnorm_relu"


# --------------------------------------------------------------------------- recompute

# recompute="auto": a training forward keeps h (as recompute=False) where each value of h costs at
# least this many multiply-adds to compute again, C/groups * R * S, and recomputes it (as
# recompute=True) where it costs fewer. In a CNN the channels grow as the maps shrink, so the layers
# this keeps h for are the deep ones, whose h is small and whose conv is the slowest to repeat: in
# ResNet-18 the 3x3 convs of 128, 256 and 512 input channels (1152, 2304 and 4608 per value) and no
# others. ResNet-18 / ResNet-50 training step, batch 16, 64x64, machine E (numbafuse.torch.fuse, one
# run each): every h recomputed 90-92 / 294 ms, activations kept 16.1 / 55.1 MB; this rule (at 2048)
# 82-84 / 275 ms, 17.4 / 57.4 MB; no h recomputed 82-87 / 252 ms, 29.3 / 113.8 MB (PyTorch keeps
# 29.1 / 112.8 MB). At 1024 (since 2026-11-30) it also keeps the 3x3 convs' h of 128 input channels
# and the 1x1 convs' of 1024: activations kept 13.2 / 55.9 MB against 11.4 / 51.3 at 2048, 10.1 /
# 49.0 with every h recomputed and PyTorch's 29.1 / 112.8 (0.46 / 0.50 of PyTorch's: issue 34 asks
# <= 0.6; 512 would be 0.62 / 0.57), and it skips recomputed forwards that took ~33 ms of a
# ResNet-50 step on machine F (their in-step times, profile_resnet.py --model resnet50 --layers; ~14
# ms of ResNet-18's at the same shapes); the steps themselves were too noisy there to show it
# (docs/benchmarks.md, "ResNet-50 on machine F"). numbafuse.torch, whose next fused conv keeps a
# Conv-BN-ReLU's h instead of its output, draws its own line (numbafuse.torch.conv_batchnorm).
KEEP_H_MIN_MACS = 1024


def recomputes(recompute, geometry, line=None):
    """Whether a training backward recomputes h: ``recompute`` itself (True or False), or
    for "auto" the rule of ``KEEP_H_MIN_MACS`` (or ``line``) on ``geometry``'s conv, and
    never where h has at most half as many values as x, which the backward keeps anyway (a
    strided 1x1 downsample: keeping h costs at most half of that)."""
    if isinstance(recompute, str):                       # "auto" (validated)
        g = geometry
        line = KEEP_H_MIN_MACS if line is None else line
        return (g.C // g.groups * g.R * g.S < line
                and 2 * g.K * g.P * g.Q > g.C * g.H * g.W)
    return bool(recompute)


# --------------------------------------------------------------------------- validation

def _validate(op, x, w, gamma, beta, p, relu, z=None, updates=True):
    """Everything checked before anything is computed or written: (backend, geometry,
    momentum). ``z``: the residual of the add op (the conv output's shape), else None."""
    validate.check_given(op, x=x, w=w, gamma=gamma, beta=beta)
    arrays = dict(x=x, w=w, gamma=gamma, beta=beta) if z is None else \
        dict(x=x, w=w, z=z, gamma=gamma, beta=beta)
    which = backend.backend_of(op, **arrays, running_mean=p.running_mean,
                               running_var=p.running_var)
    # x, w (and z) one dtype, half precision too; the batch-norm parameters and running
    # statistics that dtype or, for a half x, float32 (PyTorch's rule, as batch norm's)
    dtype = validate.check_half_dtypes(op, which, x=x, w=w, z=z)
    validate.check_param_dtypes(op, dtype, gamma=gamma, beta=beta,
                                running_mean=p.running_mean, running_var=p.running_var)
    synced = p.comm is not None and p.training
    # N = 0 (an empty batch, or a rank without samples) passes: empty y, nothing updated
    geometry = validate.conv_geometry(op, tuple(x.shape), tuple(w.shape), p.stride, p.padding,
                                      p.dilation, p.layout, p.groups)
    validate.check_vector(op, "gamma", gamma, geometry.K)
    validate.check_vector(op, "beta", beta, geometry.K)
    if z is not None and tuple(z.shape) != geometry.y_shape:
        raise ValueError(f"{op}: z has shape {tuple(z.shape)}, the conv's output "
                         f"{geometry.y_shape}")
    validate.check_flag(op, "relu", relu)
    validate.check_recompute(op, p.recompute)
    momentum, _ = validate.running_stats(op, geometry.K, geometry.N * geometry.P * geometry.Q,
                                         p.running_mean, p.running_var, p.training,
                                         p.momentum, p.eps, synced=synced, updates=updates)
    _bn.check_comm(op, p.comm, x, geometry.K, geometry.layout, p.training, p.eps, momentum,
                   p.running_mean is not None, relu)
    return which, geometry, momentum


class _Half:
    """Half precision at the op's boundary (``ops/precision.py``'s rule): the arithmetic in
    float32 on converted x, w, z (and half parameters or running statistics), y and dx, dw,
    dz back in x's dtype, dgamma and dbeta in the parameters' (float32 or x's). A no-op for
    float32 and float64. The residuals keep x and w as given (a half x stays half)."""

    def __init__(self, x, gamma, param_dtype=None):
        self.dtype = x.dtype
        self.param_dtype = gamma.dtype if param_dtype is None else param_dtype

    def store(self, a):
        return precision.store(a, self.dtype)

    def param(self, a):
        return precision.store(a, self.param_dtype)

    @staticmethod
    def params(p):
        """``p`` with float32 copies of half running statistics (else ``p`` itself)."""
        rm, rv = (precision.compute(a) for a in (p.running_mean, p.running_var))
        if rm is p.running_mean and rv is p.running_var:
            return p
        return dataclasses.replace(p, running_mean=rm, running_var=rv)

    @staticmethod
    def store_running(original, p):
        """The updated float32 copies written back into half running statistics."""
        for kept, updated in ((original.running_mean, p.running_mean),
                              (original.running_var, p.running_var)):
            precision.store_into(kept, updated)

    @staticmethod
    def residuals(saved):
        """The ``saved`` arrays (by name) as attributes, x and w in their compute dtype."""
        if not validate.is_half(saved["x"].dtype):
            return types.SimpleNamespace(**saved)
        return types.SimpleNamespace(**{**saved, "x": precision.compute(saved["x"]),
                                        "w": precision.compute(saved["w"])})


def _conv_forward(which, x, w, b, geometry, relu):
    """The conv (an empty output for an empty batch, ``conv_forward``'s rule)."""
    return _conv.conv_forward(x, w, b, geometry, relu)


def _conv_and_stats(which, x, w, geometry, eps):
    """(h, mean, var, invstd) with the statistics made by the conv's own chunks, where the
    backend's conv has that epilogue for this geometry (``forward_stats``), else None (the
    statistics pass after the conv)."""
    if geometry.N == 0:
        return None
    return kernels.conv_kernels(which, geometry.groups).forward_stats(x, w, geometry, eps)


def _training_forward(op, which, x, w, geometry, p, momentum):
    """(h, mean, invstd, count) of a training forward: h = conv(x, w) and its batch
    statistics (from the conv's own chunks where the backend can; all ranks' with ``p.comm``),
    the running statistics updated; count: the values per channel they are over."""
    count = geometry.N * geometry.P * geometry.Q
    fused = _conv_and_stats(which, x, w, geometry, p.eps) if p.comm is None else None
    if fused is not None:
        h, mean, var, invstd = fused
    else:
        h = _conv_forward(which, x, w, None, geometry, False)             # (N,K,P,Q) | NHWC
        if p.comm is None:
            mean, var, invstd = _bn.stats_and_update(                     # (K,) each
                kernels.batchnorm_kernels(which), h, geometry.layout, p.eps,
                p.running_mean, p.running_var, momentum)
            return h, mean, invstd, count
        mean, var, invstd, count = _bn.synced_stats(                      # all ranks' h
            op, kernels.module("batchnorm", which), h, geometry.layout, p.eps, geometry.K,
            p.comm)
    if p.running_mean is not None:
        _bn.update_running(p.running_mean, p.running_var, mean, var, count, momentum)
    return h, mean, invstd, count


def _recompute_and_sums(which, dy, s, geometry, relu):
    """(h, g, sums): the conv recomputed with the batch-norm backward's first pass made by its
    chunks (``forward_bn_sums``: g = dy gated by the ReLU, the two sums), or None where the
    backend's conv has no such epilogue."""
    if geometry.N == 0:
        return None
    return kernels.conv_kernels(which, geometry.groups).forward_bn_sums(
        s.x, s.w, geometry, dy, s.mean, s.invstd, s.gamma, s.beta if relu else None)


def _conv_backward(which, dconv, x, w, geometry, need, dx_addend=None):
    """(dx, dw) of the conv; an empty batch (or a rank without samples) gives dw = 0;
    ``dx_addend``: added into dx by the conv's kernel (``conv.adds_into_dx``)."""
    return _conv.conv_backward(dconv, x, w, geometry, None, (need[0], need[1], False),
                               dx_addend=dx_addend)[:2]


# --------------------------------------------------------------------------- the cores

class Call(NamedTuple):
    """What a backward needs of its forward besides the saved arrays."""
    geometry: object     # validate.ConvGeometry: the layout, padding resolved, groups
    count: int           # values per channel the statistics are over (all ranks' with comm)
    param_dtype: object  # gamma's dtype as given: dgamma's and dbeta's


def _running_stats(pc):
    """(mean, invstd) (K,) float64 of inference from ``pc``'s running statistics (float32
    copies of half ones: :meth:`_Half.params`)."""
    return _bn.bn_inference_stats(kernels.contiguous(pc.running_mean),
                                  kernels.contiguous(pc.running_var), eps=pc.eps)


def _backward_inputs(call, saved, dy):
    """(which, half, s, dy) of a core backward: dy's backend, the call's half-precision rule,
    the ``saved`` arrays as attributes in their compute dtype, dy contiguous in it."""
    dy = kernels.contiguous(dy)
    half = _Half(dy, saved["gamma"], call.param_dtype)
    return backend.backend_of_array(dy), half, half.residuals(saved), precision.compute(dy)


def forward(op, p, x, w, gamma, beta, checked=None):
    """Conv -> batch norm [-> ReLU] without a tape: ``(y, call, saved)``, ``saved`` the arrays
    :func:`backward` reads by name (x and w as given, a half x stays half; gamma, [beta], the
    float64 mean and invstd; with ``p.recompute`` False in training h and the packed 1-bit
    ReLU mask, ``relu_state``, instead of beta). ``p``: :class:`ConvBatchNormReLU.Params`.
    Everything is validated before anything is written; the running statistics are updated
    in place in training (a half one written back). ``checked``: the call's ``(backend,
    geometry, momentum)`` where the caller has checked everything already
    (``numbafuse.torch`` checks its tensors itself, with its own argument names), else
    :func:`_validate` here."""
    which, geometry, momentum = checked or _validate(op, x, w, gamma, beta, p, p.relu)
    x, w, gamma, beta = (kernels.contiguous(a) for a in (x, w, gamma, beta))
    half = _Half(x, gamma)
    x_kept, w_kept = x, w                        # saved as given: a half x stays half
    x, w, gamma, beta = (precision.compute(a) for a in (x, w, gamma, beta))
    pc = half.params(p)                          # float32 copies of half running stats
    count = geometry.N * geometry.P * geometry.Q
    if p.training:
        h, mean, invstd, count = _training_forward(op, which, x, w, geometry, pc, momentum)
        half.store_running(p, pc)
        keep_h = not recomputes(p.recompute, geometry)
        y = _bn.bn_apply(h, mean, invstd, gamma, beta, relu=p.relu, layout=geometry.layout,
                         with_mask=keep_h and p.relu)
        if keep_h:   # trade memory for speed: keep h and a 1-bit ReLU mask, no recompute
            y, mask = y if p.relu else (y, None)
            saved = dict(x=x_kept, w=w_kept, gamma=gamma, h=h, relu_state=mask, mean=mean,
                         invstd=invstd)
            return half.store(y), Call(geometry, count, half.param_dtype), saved
        del h                                                             # never kept
    else:
        mean, invstd = _running_stats(pc)
        y = _inference_forward(which, x, w, gamma, beta, mean, invstd, geometry, p.relu,
                               pc.eps)
    shift = dict(beta=beta) if p.relu else {}    # the ReLU's gate needs beta
    saved = dict(x=x_kept, w=w_kept, gamma=gamma, **shift, mean=mean, invstd=invstd)
    return half.store(y), Call(geometry, count, half.param_dtype), saved


def backward(p, call, saved, dy, need, dx_addend=None):
    """``(dx, dw, dgamma, dbeta)`` of :func:`forward` from its ``call`` and ``saved`` arrays
    (by name); ``need``: four flags, an unneeded gradient is None. h is recomputed unless
    ``saved`` has it (then with ``relu_state``, the mask or y whose sign is the gate).
    ``dx_addend``: dx comes back plus it (only where ``conv.adds_into_dx`` said so)."""
    geometry = call.geometry
    need_x, need_w, need_gamma, need_beta = need
    which, half, s, dy = _backward_inputs(call, saved, dy)
    sums = fused = None
    kept_h = "h" in saved
    if not kept_h and p.training and p.comm is None:
        fused = _recompute_and_sums(which, dy, s, geometry, p.relu)
    if fused is not None:               # recomputed, with the batch norm's first pass
        h, dy, sums = fused                 # dy: gated by the ReLU already
        relu_state = None
    elif kept_h:
        h, relu_state = s.h, s.relu_state
    else:
        h = _conv_forward(which, s.x, s.w, None, geometry, False)         # recompute
        if not p.relu:
            relu_state = None
        elif _bn.supports_affine_gate(which):   # the gate re-derived from h in the backward
            relu_state = _bn.AffineGate(s.beta)
        else:                                   # y rebuilt: its sign is the mask
            relu_state = _bn.bn_apply(h, s.mean, s.invstd, s.gamma, s.beta, relu=True,
                                      layout=geometry.layout)
    dconv, dgamma, dbeta, _ = _bn.bn_backward(
        dy, h, s.mean, s.invstd, s.gamma, relu_state, layout=geometry.layout,
        need=(need_x or need_w, need_gamma, need_beta, False), training=p.training,
        comm=p.comm, count=call.count, sums=sums)
    del h, relu_state
    dx = dw = None
    if need_x or need_w:
        dx, dw = _conv_backward(which, dconv, s.x, s.w, geometry, (need_x, need_w), dx_addend)
    return half.store(dx), half.store(dw), half.param(dgamma), half.param(dbeta)


def add_forward(op, p, x, w, z, gamma, beta, checked=None):
    """Conv -> batch norm -> + z -> ReLU without a tape: ``(y, call, saved)``, ``saved`` x
    and w as given, gamma, the float64 mean and invstd, the packed 1-bit mask of ``y > 0``
    (``relu_state``) and, with ``p.recompute`` False, h. ``p``:
    :class:`ConvBatchNormAddReLU.Params`. Validation (``checked`` too) and running statistics
    as :func:`forward`'s."""
    if checked is None:
        validate.check_given(op, z=z)
    which, geometry, momentum = checked or _validate(op, x, w, gamma, beta, p, True, z=z)
    x, w, z, gamma, beta = (kernels.contiguous(a) for a in (x, w, z, gamma, beta))
    half = _Half(x, gamma)
    x_kept, w_kept = x, w                        # saved as given: a half x stays half
    x, w, z, gamma, beta = (precision.compute(a) for a in (x, w, z, gamma, beta))
    pc = half.params(p)
    count = geometry.N * geometry.P * geometry.Q
    if p.training:
        h, mean, invstd, count = _training_forward(op, which, x, w, geometry, pc, momentum)
        half.store_running(p, pc)
    else:
        mean, invstd = _running_stats(pc)
        y = (_inference_add(which, x, w, gamma, beta, mean, invstd, geometry, z)
             if recomputes(p.recompute, geometry) else None)
        if y is not None:     # one pass, as inference() makes it (the same bits); the mask
            saved = dict(x=x_kept, w=w_kept, gamma=gamma, mean=mean, invstd=invstd,
                         relu_state=_packed_mask(y))
            return half.store(y), Call(geometry, count, half.param_dtype), saved
        h = _conv_forward(which, x, w, None, geometry, False)
    y, mask = _bn.bn_apply(h, mean, invstd, gamma, beta, z=z, relu=True,
                           layout=geometry.layout, with_mask=True)
    kept = {} if recomputes(p.recompute, geometry) else dict(h=h)
    saved = dict(x=x_kept, w=w_kept, gamma=gamma, mean=mean, invstd=invstd, relu_state=mask,
                 **kept)
    return half.store(y), Call(geometry, count, half.param_dtype), saved


def _packed_mask(y):
    """The packed 1-bit mask of ``y > 0`` (``ops.batchnorm.mask_nbytes``: bit j of byte i is
    element 8i + j of y in memory order), of a host y (the one-pass inference is the CPU's)."""
    return np.packbits(y.reshape(-1) > 0, bitorder="little")


def inference(which, x, w, gamma, beta, running_mean, running_var, eps, geometry, relu=True,
              z=None):
    """y of an inference call whose y has no backward (nothing saved), on contiguous arrays of
    one dtype, float32 or float64 (no half copies), checked by the caller: :func:`forward`'s
    inference y (``z`` None; ``relu``), or :func:`add_forward`'s (``relu(... + z)``), the same
    kernels on the same values without the residuals and the mask (``numbafuse.torch``'s
    eval calls that autograd does not record)."""
    mean, invstd = _bn.bn_inference_stats(running_mean, running_var, eps=eps)
    if z is None:
        return _inference_forward(which, x, w, gamma, beta, mean, invstd, geometry, relu, eps)
    y = _inference_add(which, x, w, gamma, beta, mean, invstd, geometry, z)
    if y is not None:                       # the batch norm and z in the conv's epilogue
        return y
    h = _conv_forward(which, x, w, None, geometry, False)
    return _bn.bn_apply(h, mean, invstd, gamma, beta, z=z, relu=True, layout=geometry.layout)


def add_backward(p, call, saved, dy, need):
    """``(dx, dw, dz, dgamma, dbeta)`` of :func:`add_forward` from its ``call`` and
    ``saved`` arrays; ``need``: five flags. h is recomputed unless ``saved`` has it."""
    geometry = call.geometry
    need_x, need_w, need_z, need_gamma, need_beta = need
    which, half, s, dy = _backward_inputs(call, saved, dy)
    h = s.h if "h" in saved else _conv_forward(which, s.x, s.w, None, geometry, False)
    dconv, dgamma, dbeta, dz = _bn.bn_backward(
        dy, h, s.mean, s.invstd, s.gamma, s.relu_state, layout=geometry.layout,
        need=(need_x or need_w, need_gamma, need_beta, need_z), training=p.training,
        comm=p.comm, count=call.count)
    del h
    dx = dw = None
    if need_x or need_w:
        dx, dw = _conv_backward(which, dconv, s.x, s.w, geometry, (need_x, need_w))
    return (half.store(dx), half.store(dw), half.store(dz), half.param(dgamma),
            half.param(dbeta))


# --------------------------------------------------------------------------- the Functions

class ConvBatchNormReLU(Function):
    r"""Fused conv (no bias) -> batch norm [-> ReLU], recomputing the conv in backward: the
    tape's wrapper of :func:`forward` and :func:`backward`.

    Forward (training), per output channel k over the M = N*P*Q values of h = conv(x, w):

    .. math::

        \mu_k = \frac{1}{M}\sum h, \quad \sigma_k^2 = \frac{1}{M}\sum (h - \mu_k)^2, \quad
        \hat h = (h - \mu_k)\,\mathrm{invstd}_k, \quad
        y = \mathrm{relu}(\gamma_k \hat h + \beta_k)

    Backward, with :math:`g = \partial L/\partial y \cdot [y > 0]` (the mask recomputed from
    the recomputed :math:`\gamma\hat h + \beta`):

    .. math::

        \partial\beta_k = \sum g, \quad \partial\gamma_k = \sum g\,\hat h, \quad
        \partial h = \frac{\gamma_k\,\mathrm{invstd}_k}{M}
                     (M g - \partial\beta_k - \hat h\,\partial\gamma_k), \\
        \partial w = \mathrm{correlate}(x, \partial h), \quad
        \partial x = \mathrm{conv\_transpose}(\partial h, w)

    In inference the statistics are the running ones (constants), folded into the conv, and
    :math:`\partial h = \gamma_k\,\mathrm{invstd}_k\, g`.
    """

    name = OP

    @dataclasses.dataclass(frozen=True)
    class Params(BatchNormParams):
        stride: object
        padding: object
        dilation: object
        relu: bool
        recompute: bool          # False: keep h and a 1-bit mask instead of recomputing;
        #                          "auto": as recomputes() decides for the conv
        groups: int = 1          # a grouped conv: w is (K, C/groups, R, S)

    # fwd :: (x, w, gamma, beta) -> (y, residuals=(x, w, gamma, [beta], mean, invstd))
    #        recompute=False, training: residuals=(x, w, gamma, h, relu_state, mean, invstd)
    def forward(self, x, w, gamma, beta):
        y, self.call, saved = forward(self.name, self.params, x, w, gamma, beta)
        self.save_for_backward(**saved)
        return y

    # bwd :: (residuals, dy) -> (dx, dw, dgamma, dbeta)
    def backward(self, dy):
        return backward(self.params, self.call, vars(self.saved), dy, self.needs_input_grad)

    # bwd, with the tape's gradient of x so far added into dx by the conv's kernel where it
    # can (a residual block's input: the skip's gradient is there first)
    def backward_adding(self, dy, addends):
        geometry, need = self.call.geometry, self.needs_input_grad
        addend = addends[0] if _conv.adds_into_dx(geometry, dy, addends[0], need[0]) else None
        grads = backward(self.params, self.call, vars(self.saved), dy, need, addend)
        return grads, (() if addend is None else (0,))


class ConvBatchNormAddReLU(Function):
    r"""Fused conv (no bias) -> batch norm -> + z -> ReLU: the tail of a ResNet block in one op;
    the tape's wrapper of :func:`add_forward` and :func:`add_backward`.

    .. math::

        y = \max(\gamma_k \hat h + \beta_k + z,\ 0), \quad g = \partial L/\partial y
        \cdot [y > 0], \quad \partial z = g, \quad \partial\beta_k = \sum g, \quad
        \partial\gamma_k = \sum g\,\hat h, \\
        \partial h = \frac{\gamma_k\,\mathrm{invstd}_k}{M}
                     (M g - \partial\beta_k - \hat h\,\partial\gamma_k), \quad
        \partial w = \mathrm{correlate}(x, \partial h), \quad
        \partial x = \mathrm{conv\_transpose}(\partial h, w)

    (inference: the running statistics, :math:`\partial h = \gamma_k\,\mathrm{invstd}_k\,
    g`). The ReLU's input has z in it, so its gate cannot be rebuilt from h: the forward keeps
    the packed 1-bit mask of ``y > 0``. Residuals: x, w, gamma, mean, invstd (float64, K each)
    and the mask; the backward recomputes h (``recompute=False``: h is kept too, and no conv
    runs twice). Statistics as :class:`ConvBatchNormReLU`'s (from the conv's own chunks where
    the backend can; synchronized with ``comm``).
    """

    name = "conv_batchnorm_add_relu"

    @dataclasses.dataclass(frozen=True)
    class Params(BatchNormParams):
        stride: object
        padding: object
        dilation: object
        recompute: bool          # False: keep h besides the mask instead of recomputing it;
        #                          "auto": as recomputes() decides for the conv
        groups: int = 1          # a grouped conv: w is (K, C/groups, R, S)

    # fwd :: (x, w, z, gamma, beta) -> (y, residuals=(x, w, gamma, mean, invstd, relu_state,
    #                                                  [h] (recompute=False)))
    def forward(self, x, w, z, gamma, beta):
        y, self.call, saved = add_forward(self.name, self.params, x, w, z, gamma, beta)
        self.save_for_backward(**saved)
        return y

    # bwd :: (residuals, dy) -> (dx, dw, dz, dgamma, dbeta)
    def backward(self, dy):
        return add_backward(self.params, self.call, vars(self.saved), dy,
                            self.needs_input_grad)


# --------------------------------------------------------------------------- public functions

def conv_batchnorm_relu(x, w, gamma, beta, *, running_mean=None, running_var=None,
                        training=True, momentum=0.1, eps=1e-5, stride=1, padding=0,
                        dilation=1, relu=True, layout="NCHW", comm=None, groups=1):
    """``relu(batchnorm(conv2d(x, w)))`` fused; trained with recompute, folded in inference.

    Parameters
    ----------
    x : array or Tensor (N, C, H, W) (or NHWC)
    w : array or Tensor (K, C/groups, R, S)
    gamma, beta : arrays or Tensors (K,)
    running_mean, running_var : arrays or Tensors (K,), or None
        Updated in place in training (PyTorch's convention, unbiased variance); required in
        inference, where batch norm is folded into the conv.
    training : bool
    momentum, eps : float
        ``momentum`` is read only in training with running statistics (see
        :func:`~numbafuse.ops.batchnorm.batchnorm_add_relu`; ``None`` is a layer option).
    stride, padding, dilation : int, pair, or ``"same"``/``"valid"`` (padding)
        ``padding`` may also be a 4-tuple ``(left, right, top, bottom)`` (``F.pad``'s order,
        see :func:`~numbafuse.ops.conv.conv_bias_relu`).
    relu : bool
        ``False`` leaves the ReLU out (a conv -> batch norm pair).
    layout : {"NCHW", "NHWC"}

    comm : numbafuse.distributed.Communicator, optional
        Synchronized batch norm in training (as :func:`batchnorm_add_relu`).
    groups : int
        A grouped conv (:func:`~numbafuse.ops.conv.conv2d`'s ``groups``; ``groups == C``:
        depthwise, as in MobileNet's Conv(dw)-BN-ReLU).

    Returns
    -------
    y : array or Tensor (N, K, P, Q) (or NHWC). With Tensors the op saves for backward only
        x, w, gamma, (beta), and the per-channel mean and invstd; backward recomputes the conv.
        An empty batch (N = 0) gives an empty y and updates nothing (PyTorch's rule).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 3, 5, 5)); w = rng.standard_normal((4, 3, 3, 3))
    >>> y = nf.conv_batchnorm_relu(x, w, np.ones(4), np.zeros(4), padding=1)
    >>> y.shape, bool((y >= 0).all())
    ((2, 4, 5, 5), True)
    """
    return ConvBatchNormReLU(running_mean=autograd.unwrap(running_mean),
                             running_var=autograd.unwrap(running_var), training=training,
                             momentum=momentum, eps=eps, stride=stride, padding=padding,
                             dilation=dilation, relu=relu, layout=layout, recompute=True,
                             comm=comm, groups=groups).apply(x, w, gamma, beta)


def conv_batchnorm_relu_backward(dy, x, w, gamma, beta, *, running_mean=None, running_var=None,
                                 training=True, eps=1e-5, stride=1, padding=0, dilation=1,
                                 relu=True, layout="NCHW", need=(True, True, True, True),
                                 groups=1):
    """``(dx, dw, dgamma, dbeta)`` of :func:`conv_batchnorm_relu`, NumPy style (no tape).

    Recomputes the conv and the batch statistics from ``x`` (training) or uses the running
    statistics (inference), exactly as the tape's backward does. Nothing is written to the
    running statistics. ``need`` flags which of the four gradients to compute (the others
    are ``None``).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 3, 5, 5)); w = rng.standard_normal((4, 3, 3, 3))
    >>> dy = np.ones((2, 4, 3, 3))
    >>> dx, dw, dgamma, dbeta = nf.conv_batchnorm_relu_backward(dy, x, w, np.ones(4),
    ...                                                         np.zeros(4))
    >>> dx.shape, dw.shape, dgamma.shape
    ((2, 3, 5, 5), (4, 3, 3, 3), (4,))
    """
    op = "conv_batchnorm_relu_backward"
    dy, x, w, gamma, beta, running_mean, running_var = (
        autograd.unwrap(a) for a in (dy, x, w, gamma, beta, running_mean, running_var))
    p = ConvBatchNormReLU(running_mean=running_mean, running_var=running_var,
                          training=training, momentum=0.0, eps=eps, stride=stride,
                          padding=padding, dilation=dilation, relu=relu, layout=layout,
                          recompute=False, comm=None, groups=groups).params
    validate.check_given(op, dy=dy)
    _, geometry, _ = _validate(op, x, w, gamma, beta, p, relu, updates=False)
    backend.backend_of(op, dy=dy, x=x)
    dtype = validate.check_float_dtypes(op, half=True, dy=dy, x=x)
    if tuple(dy.shape) != geometry.y_shape:
        raise ValueError(f"{op}: dy has shape {tuple(dy.shape)}, expected {geometry.y_shape}")
    if not isinstance(need, (tuple, list)) or len(need) != 4:
        raise ValueError(f"{op}: need must be four booleans (dx, dw, dgamma, dbeta), "
                         f"got {need!r}")
    call = Call(geometry, geometry.N * geometry.P * geometry.Q, gamma.dtype)
    x, w, gamma, beta, dy = (precision.compute(kernels.contiguous(a))     # half: float32
                             for a in (x, w, gamma, beta, dy))
    # the one conv, with the batch statistics from its own chunks where it can (the
    # forward's epilogue), else a statistics pass
    which = backend.backend_of_array(x)
    fused = _conv_and_stats(which, x, w, geometry, eps) if training else None
    h = fused[0] if fused else _conv.conv_forward(x, w, None, geometry, False)
    if fused:
        mean, invstd = fused[1], fused[3]                                 # (K,) float64
    elif training:
        mean, _, invstd = _bn.bn_stats(h, eps=eps, layout=geometry.layout)
    else:
        mean, invstd = _bn.bn_inference_stats(
            *(precision.compute(kernels.contiguous(a)) for a in (running_mean, running_var)),
            eps=eps)
    gate = relu and _bn.supports_affine_gate(which)   # the gate re-derived from h, else y's sign
    relu_state = (_bn.AffineGate(beta) if gate else None if not relu else
                  _bn.bn_apply(h, mean, invstd, gamma, beta, relu=True, layout=geometry.layout))
    saved = dict(x=x, w=w, gamma=gamma, h=h, relu_state=relu_state, mean=mean, invstd=invstd)
    dx, dw, dgamma, dbeta = backward(p, call, saved, dy,       # dgamma, dbeta: gamma's dtype
                                     tuple(bool(n) for n in need))
    return precision.store(dx, dtype), precision.store(dw, dtype), dgamma, dbeta


SPECS = (
    OpSpec("conv_batchnorm_relu", conv_batchnorm_relu, ConvBatchNormReLU,
           reference=reference.conv_batchnorm_relu, backward=conv_batchnorm_relu_backward,
           fuses=("conv2d", "batchnorm", "relu"), half=True, half_params=_bn.HALF_PARAMS),
)
