r"""Batch norm, and the fused BatchNorm -> Add -> ReLU, forward and backward, CPU and CUDA.

Notation: N batch, C channels, H, W spatial, M = N*H*W (values per channel), ``layout`` is
"NCHW" or "NHWC". ``mean``/``invstd`` are per-channel float64 vectors (C,) on the backend of x.

Public ops
----------
``batchnorm_add_relu(x, z, gamma, beta, *, running_mean=None, running_var=None, training=True,
momentum=0.1, eps=1e-5, layout="NCHW", save="output")`` (Function :class:`BatchNormAddReLU`),
``batchnorm_add_relu_backward(...)`` (NumPy style, no tape) and the unfused
``batchnorm(x, gamma, beta, ...)`` (Function :class:`BatchNorm`, name ``"batchnorm"``; the
unfused chain is ``relu(add(batchnorm(x), z))``).

Array-level helpers (for other fused ops, e.g. Conv -> BatchNorm with recompute)
-------------------------------------------------------------------------------
They take NumPy arrays (CPU kernels) or CUDA device arrays (CUDA kernels; results stay on the
device), already validated and C-contiguous in ``layout``, and do no autograd:

(Validation is ``validate.batchnorm_args`` and ``validate.running_stats``.)

``bn_stats(x, eps=1e-5, layout="NCHW") -> (mean, var, invstd)``
    Batch statistics, float64 (C,); var is biased; shifted float64 accumulation.
``bn_inference_stats(running_mean, running_var, eps=1e-5) -> (mean, invstd)``
    The same vectors from the running statistics (inference).
``bn_apply(x, mean, invstd, gamma, beta, z=None, relu=True, layout="NCHW", with_mask=False)``
    ``y = [relu](gamma * (x - mean) * invstd + beta [+ z])`` in one pass writing y once;
    returns y, or ``(y, mask)`` with ``with_mask`` (mask: packed bits of y > 0, see below).
``bn_backward(dy, x, mean, invstd, gamma, relu_state, layout="NCHW", need=(True,)*4,
training=True) -> (dx, dgamma, dbeta, dz)``
    Two passes: reduce ``dbeta = sum g``, ``dgamma = sum g*xhat`` with ``g = dy * (relu open)``,
    then write ``dx`` and ``dz = g``. ``relu_state`` is y (same shape/dtype as x), a packed mask
    (uint8, from ``bn_apply(..., with_mask=True)``) or None (no ReLU: ``g = dy``). ``need``
    says which of (dx, dgamma, dbeta, dz) to compute (the others are None). ``training=False``:
    mean/invstd are constants (``dx = gamma * invstd * g``).
``update_running(running_mean, running_var, mean, var, count, momentum)``
    In place, PyTorch's rule: ``r_mean = (1-m) r_mean + m mean``,
    ``r_var = (1-m) r_var + m var * count / (count - 1)``.
``mask_nbytes(size)``: bytes of the packed mask of ``size`` elements (``ceil(size / 8)``).

Half precision (float16; bfloat16 on the CPU): half parameters are converted to float32
(``ops/precision.py``); x, z, dy and y go to the CUDA kernels as they are (they load and
store half, computing in float32: ``HALF_KERNELS``) and to the CPU kernels converted to
float32, y, dx, dz converted back; dgamma and dbeta come back in gamma's dtype, half running
statistics are updated in float32 and written back. The array helpers above (``bn_stats``,
``bn_apply``) take float32/float64 arrays only.

Packed ReLU mask: a 1-d uint8 array of ``ceil(size/8)`` bytes; bit ``j % 8`` of byte ``j // 8``
is set where ``y.reshape(-1)[j] > 0`` (flat index in x's own layout): 32x smaller than a
float32 y, 64x than a float64 one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from .. import autograd, backend, kernels, reference, validate
from ..autograd import Function, is_recording
from ..kernels.batchnorm import math as bn_math
from . import precision
from .spec import OpSpec

_kernels = functools.partial(kernels.module, "batchnorm")   # _kernels(which): the module
# Backends whose batch-norm kernels load and store float16 activations themselves (float32
# math inside, float32 parameters: kernels/batchnorm/cuda.py); elsewhere they are converted.
HALF_KERNELS = (backend.CUDA,)


def _as_is(a):
    return a


def _activations(which):
    """How x, z, dy and y reach backend ``which``'s kernels: as they are where the kernels
    take half (:data:`HALF_KERNELS`), else in their compute dtype (``precision.compute``)."""
    return _as_is if which in HALF_KERNELS else precision.compute
mask_nbytes = bn_math.mask_nbytes   # bytes of the packed ReLU mask of ``size`` elements


@dataclasses.dataclass(frozen=True)
class BatchNormParams:
    """The non-array arguments of a batch norm (see :func:`batchnorm`); the running
    statistics are arrays updated in place, not tape inputs."""
    running_mean: object
    running_var: object
    training: bool
    momentum: float
    eps: float
    layout: str
    comm: object                # a distributed.Communicator: synchronized batch norm, or None


@dataclasses.dataclass(frozen=True)
class BatchNormAddReLUParams(BatchNormParams):
    save: str                   # the ReLU state kept for backward: "output" (y) or "mask"


# --------------------------------------------------------------------------- array helpers

def bn_stats(x, eps=1e-5, layout="NCHW"):
    """(mean, var, invstd) of C-contiguous ``x``: float64 (C,), var biased, on x's backend
    (zeros for an empty batch, see :func:`_no_stats`)."""
    if x.size == 0:
        return _no_stats(x, layout)
    return _kernels(backend.backend_of("bn_stats", x=x)).stats(x, layout, eps)


def bn_inference_stats(running_mean, running_var, eps=1e-5):
    """(mean, invstd) float64 (C,) from the running statistics, on their backend."""
    which = backend.backend_of("bn_inference_stats", running_mean=running_mean,
                                 running_var=running_var)
    return _kernels(which).inference_stats(running_mean, running_var, eps)


def bn_apply(x, mean, invstd, gamma, beta, z=None, relu=True, layout="NCHW", with_mask=False):
    """``y = [relu](gamma*(x - mean)*invstd + beta [+ z])``, and the packed mask if asked."""
    which = backend.backend_of("bn_apply", x=x, z=z, gamma=gamma, beta=beta)
    if x.size == 0:                               # a rank without samples (synchronized)
        y = backend.empty(which, x.shape, x.dtype)
        mask = backend.empty(which, (0,), np.uint8)
    else:
        y, mask = _kernels(which).apply(x, mean, invstd, gamma, beta, z, relu, layout,
                                        with_mask)
    return (y, mask) if with_mask else y


class AffineGate:
    """A ReLU state for :func:`bn_backward`: the ReLU's input was ``gamma*xhat + beta`` of the
    backward's own ``x`` (no add), with the same mean, invstd, gamma and this ``beta``. The
    kernels re-derive the gate from x, as the forward decided it, and no y is kept or rebuilt
    (Conv-BatchNorm-ReLU's recompute). Only where :func:`supports_affine_gate`."""
    __slots__ = ("beta",)

    def __init__(self, beta):
        self.beta = beta


def supports_affine_gate(which):
    """Whether backend ``which``'s batch-norm backward takes an :class:`AffineGate` state."""
    return bool(kernels.batchnorm_kernels(which).AFFINE_GATE)


def _state_kind(relu_state):
    if relu_state is None:
        return bn_math.STATE_NONE
    if isinstance(relu_state, AffineGate):
        return bn_math.STATE_AFFINE
    return bn_math.STATE_MASK if np.dtype(relu_state.dtype) == np.uint8 else \
        bn_math.STATE_Y


def bn_backward(dy, x, mean, invstd, gamma, relu_state, layout="NCHW", need=(True,) * 4,
                training=True, comm=None, count=None, sums=None):
    """(dx, dgamma, dbeta, dz) of ``[relu](batchnorm(x) [+ z])``; unneeded ones are None.

    With ``comm`` (synchronized batch norm, training) the two per-channel sums of the backward
    are all-reduced over the ranks and dx uses them with the global ``count``; dgamma and
    dbeta stay this rank's own contribution (their sum over ranks is the global gradient).
    ``sums``: the backward's first pass made elsewhere (CPU, no ``comm``: the partials of
    ``kernels/conv/cpu.forward_bn_sums``).
    """
    which = backend.backend_of("bn_backward", dy=dy, x=x, gamma=gamma)
    dtype, param_dtype = dy.dtype, gamma.dtype       # dx, dz: dy's; dgamma, dbeta: gamma's
    sync = None
    if comm is not None and training:
        def sync(sums):                                   # (2, C) float64, host
            return comm.allreduce_sum(sums), count
    if x.size == 0 and sync is None:            # an empty batch: sums over no values
        C = gamma.shape[0]
        need_x, need_gamma, need_beta, need_z = need
        zeros = precision.store(kernels.zeros(which, (C,), validate.compute_dtype(param_dtype)),
                                param_dtype)
        return (backend.empty(which, x.shape, dtype) if need_x else None,
                zeros if need_gamma else None,
                backend.copy(zeros) if need_beta else None,
                backend.empty(which, x.shape, dtype) if need_z else None)
    kind = _state_kind(relu_state)
    state = relu_state.beta if kind == bn_math.STATE_AFFINE else relu_state
    first_pass = dict(sync=sync) if sums is None else dict(sums=sums)   # (CUDA: no sums)
    # half precision: float32 parameters; activations as the backend's kernels take them
    act = _activations(which)
    dy, x, gamma = act(dy), act(x), precision.compute(gamma)
    if kind == bn_math.STATE_Y:
        state = act(state)
    elif kind == bn_math.STATE_AFFINE:
        state = precision.compute(state)                    # beta: a parameter
    dx, dgamma, dbeta, dz = _kernels(which).backward(dy, x, mean, invstd, gamma, kind, state,
                                                     layout, bool(training), tuple(need),
                                                     **first_pass)
    return (precision.store(dx, dtype), precision.store(dgamma, param_dtype),
            precision.store(dbeta, param_dtype), precision.store(dz, dtype))


def synced_stats(op, impl, x, layout, eps, C, comm):
    r"""(mean, var, invstd, count) of the batch spread over ``comm``'s ranks, this rank's part
    being ``x`` (it may be empty): every rank's count, mean and M2 = var * count are all-gathered
    and merged with Chan's parallel formula, rank by rank in rank order, in float64.

    .. math::
        n = n_a + n_b, \quad \delta = \bar x_b - \bar x_a, \quad
        \bar x = \bar x_a + \delta\, n_b / n, \quad
        M_2 = M_{2,a} + M_{2,b} + \delta^2\, n_a n_b / n

    Raises ``ValueError`` on every rank when the global batch has fewer than two values per
    channel. The results are on ``x``'s backend.
    """
    n = x.size // C if C else 0
    if n:
        mean, var, _ = impl.stats(x, layout, eps)
        mean, var = backend.to_host(mean), backend.to_host(var)
    else:
        mean = var = np.zeros(C)
    everyone = comm.allgather(np.concatenate([[float(n)], mean, var * n]))  # (P, 1 + 2C)
    count, g_mean, g_m2 = 0.0, np.zeros(C), np.zeros(C)
    for row in everyone:
        n_b = row[0]
        if n_b == 0:
            continue
        total = count + n_b
        delta = row[1:1 + C] - g_mean
        g_mean = g_mean + delta * (n_b / total)
        g_m2 = g_m2 + row[1 + C:] + delta * delta * (count * n_b / total)
        count = total
    if count < 2:
        raise ValueError(f"{op}: training needs more than one value per channel to normalise "
                         f"over, got {int(count)} in the batch of all {comm.size} ranks")
    var = g_m2 / count
    invstd = 1.0 / np.sqrt(var + eps)
    to = functools.partial(backend.to_backend, backend.backend_of_array(x))
    return to(g_mean), to(var), to(invstd), count


def stats_and_update(impl, x, layout, eps, running_mean, running_var, momentum):
    """(mean, var, invstd) of ``x`` with the running statistics (if given) updated in place
    by the backend's ``stats_update`` (one launch on CUDA)."""
    if x.size == 0:                     # an empty batch: no statistics, nothing updated
        return _no_stats(x, layout)
    return impl.stats_update(x, layout, eps, running_mean, running_var, momentum)


def _no_stats(x, layout):
    """(mean, var, invstd) of a batch without values (M = 0), as PyTorch treats one: no
    statistics and nothing to normalise, so zeros (float64, (C,), on x's backend); y is
    empty, the running statistics are left as they are, and the backward's sums over no
    values are zeros."""
    C = x.shape[validate.channel_axis(layout)]
    which = backend.backend_of_array(x)
    return tuple(kernels.zeros(which, (C,), np.float64) for _ in range(3))


def update_running(running_mean, running_var, mean, var, count, momentum):
    """Update the running statistics in place (PyTorch's momentum rule, unbiased var)."""
    which = backend.backend_of("update_running", running_mean=running_mean,
                                 running_var=running_var)
    _kernels(which).update_running(running_mean, running_var, mean, var, count, momentum)


def check_comm(op, comm, x, C, layout, training, eps, momentum, has_running, relu):
    """Every rank must make the same call (bar the batch size): else a ValueError on every
    rank, before any collective that would hang on it."""
    if comm is not None and comm.size > 1:
        comm.check_same(op, (C, tuple(x.shape[2:] if layout == "NCHW" else x.shape[1:3]),
                             str(np.dtype(x.dtype)), layout, bool(training), float(eps),
                             float(momentum), bool(has_running), bool(relu)))


class Forward(NamedTuple):
    """What :func:`forward` returns: y, and what :func:`bn_backward` reads."""
    y: object           # x's shape and dtype
    mask: object        # the packed 1-bit mask of y > 0 (``with_mask``), else None
    x: object           # x as the kernels read it: C-contiguous, x's own dtype
    mean: object        # (C,) float64, on x's backend
    invstd: object      # (C,) float64
    layout: str
    count: int          # values per channel the statistics are over (all ranks' with comm)


def cpu_forward(x, z, gamma, beta, running_mean, running_var, training, momentum, eps, layout,
                with_mask):
    """(y, mask or None, mean, invstd) of ``relu(gamma * xhat + beta [+ z])``, the running
    statistics updated in training: the kernel calls :func:`forward` makes for CPU float32 or
    float64 arrays of a non-empty x without ``comm`` (C-contiguous in ``layout``, everything
    checked by the caller: ``momentum`` and ``eps`` floats), nothing else (numbafuse.torch's
    batch norm on CPU tensors, and its calls whose checks passed before:
    ``numbafuse.torch.prepared``; the params, arguments and half-precision steps skipped)."""
    impl = _kernels(backend.CPU)
    if not training:
        y, mask, mean, invstd = impl.apply_running(x, running_mean, running_var, eps, gamma,
                                                   beta, z, True, layout, with_mask)
        return y, mask, mean, invstd
    mean, _, invstd = impl.stats_update(x, layout, eps, running_mean, running_var, momentum)
    y, mask = impl.apply(x, mean, invstd, gamma, beta, z, True, layout, with_mask)
    return y, mask, mean, invstd


def forward(op, x, z, gamma, beta, p, relu, with_mask, save="output", args=None):
    """The batch-norm forward without a tape, shared by every caller (the ops Functions, the
    PyTorch Function and custom op): validate, the statistics, the running ones updated in
    place, apply ``[relu](gamma * xhat + beta [+ z])``. ``p``: :class:`BatchNormParams` (the
    running statistics, training, momentum, eps, layout, comm); ``save`` is validated only.
    ``args``: the call's ``validate.BatchNormArgs`` where the caller has checked everything
    already (``numbafuse.torch`` checks its tensors itself, with its own argument names).

    Half precision: float32 parameters (``precision``), x and z as the backend's kernels take
    them (:func:`_activations`), y back in x's dtype, half running statistics written back.
    Inference with a non-empty x is one call of the backend's ``apply_running`` (one pass on
    CUDA); training with one process is ``stats_update`` (one launch on CUDA), then ``apply``.
    """
    synced = p.comm is not None and p.training
    if args is None:
        args = validate.batchnorm_args(
            op, dict(x=x, z=z, gamma=gamma, beta=beta, running_mean=p.running_mean,
                     running_var=p.running_var), training=p.training, momentum=p.momentum,
            eps=p.eps, layout=p.layout, save=save, synced=synced)
    check_comm(op, p.comm, x, args.C, args.layout, p.training, args.eps, args.momentum,
               p.running_mean is not None, relu)
    x_kept = kernels.contiguous(x)
    act = _activations(args.backend)                 # half: as the kernels take it
    x, z = act(x_kept), None if z is None else act(kernels.contiguous(z))
    gamma, beta = (precision.compute(kernels.contiguous(a)) for a in (gamma, beta))
    kept_stats = (p.running_mean, p.running_var)
    running_mean, running_var = (precision.compute(a) for a in kept_stats)
    impl = _kernels(args.backend)
    count = args.M
    if synced:                      # the statistics of all ranks' batch (Chan's merge)
        mean, var, invstd, count = synced_stats(op, impl, x, args.layout, args.eps, args.C,
                                                p.comm)
        if running_mean is not None:
            impl.update_running(running_mean, running_var, mean, var, count, args.momentum)
    elif p.training:
        mean, var, invstd = stats_and_update(impl, x, args.layout, args.eps, running_mean,
                                             running_var, args.momentum)
    elif x.size:                                    # stats + apply (one pass on CUDA)
        y, mask, mean, invstd = impl.apply_running(x, running_mean, running_var, args.eps,
                                                   gamma, beta, z, relu, args.layout,
                                                   with_mask)
        return Forward(precision.store(y, args.dtype), mask, x_kept, mean, invstd, args.layout,
                       count)
    else:
        mean, invstd = impl.inference_stats(running_mean, running_var, args.eps)
    if p.training:
        for kept, updated in zip(kept_stats, (running_mean, running_var)):
            precision.store_into(kept, updated)         # a half running statistic, updated
    if x.size:
        y, mask = impl.apply(x, mean, invstd, gamma, beta, z, relu, args.layout, with_mask)
    else:                                             # a rank without samples
        y = backend.empty(args.backend, x.shape, x.dtype)
        mask = backend.empty(args.backend, (0,), np.uint8) if with_mask else None
    return Forward(precision.store(y, args.dtype), mask, x_kept, mean, invstd, args.layout,
                   count)


# --------------------------------------------------------------------------- fused op

class BatchNormAddReLU(Function):
    r"""``y = relu(gamma * xhat + beta + z)``: batch norm, residual add and ReLU in one pass.

    Forward (training; inference uses the running statistics for ``mean`` and ``var``):

    .. math::

        \mu_c = \frac1M \sum_{n,h,w} x_{nchw}, \quad
        \sigma^2_c = \frac1M \sum_{n,h,w} (x_{nchw} - \mu_c)^2, \quad
        \hat x = (x - \mu_c)\,(\sigma^2_c + \epsilon)^{-1/2}, \quad
        y = \max(\gamma_c \hat x + \beta_c + z,\ 0)

    Backward, with :math:`g = \partial L/\partial y \cdot [y > 0]`:

    .. math::

        \frac{\partial L}{\partial z} = g, \quad
        \frac{\partial L}{\partial \beta_c} = \sum g, \quad
        \frac{\partial L}{\partial \gamma_c} = \sum g\,\hat x, \quad
        \frac{\partial L}{\partial x} = \frac{\gamma_c\,\mathrm{invstd}_c}{M}
            \Big(M g - \frac{\partial L}{\partial \beta_c}
                 - \hat x\,\frac{\partial L}{\partial \gamma_c}\Big)

    (inference: :math:`\partial L/\partial x = \gamma_c\,\mathrm{invstd}_c\,g`). Saved: x,
    mean, invstd (float64, C each), gamma and the ReLU state: y itself (``save="output"``) or a
    packed 1-bit mask (``save="mask"``). Running statistics are parameters updated in place,
    not tape inputs.
    """
    name = "batchnorm_add_relu"
    Params = BatchNormAddReLUParams

    # fwd :: (x, z, gamma, beta) -> (y, residuals=(x, mean, invstd, gamma, y | mask))
    def forward(self, x, z, gamma, beta):
        p = self.params
        validate.check_given(self.name, x=x, z=z)
        needs_grad = any(self.needs_input_grad) and is_recording()
        with_mask = needs_grad and p.save == "mask"
        out = forward(self.name, x, z, gamma, beta, p, relu=True, with_mask=with_mask,
                      save=p.save)
        self.layout, self.count = out.layout, out.count
        relu_state = out.mask if p.save == "mask" else out.y
        self.save_for_backward(x=out.x, mean=out.mean, invstd=out.invstd,
                               gamma=kernels.contiguous(gamma),
                               **{"mask" if p.save == "mask" else "y": relu_state})
        return out.y

    # bwd :: (residuals, dy) -> (dx, dz, dgamma, dbeta)
    def backward(self, dy):
        s = self.saved
        relu_state = s.mask if self.params.save == "mask" else s.y
        need_x, need_z, need_gamma, need_beta = self.needs_input_grad
        dx, dgamma, dbeta, dz = bn_backward(
            kernels.contiguous(dy), s.x, s.mean, s.invstd, s.gamma, relu_state, self.layout,
            need=(need_x, need_gamma, need_beta, need_z), training=self.params.training,
            comm=self.params.comm, count=self.count)
        return dx, dz, dgamma, dbeta


class BatchNorm(Function):
    r"""Unfused batch norm ``y = gamma * xhat + beta`` (the first op of the unfused chain).

    .. math::

        y = \gamma_c (x - \mu_c)\,\mathrm{invstd}_c + \beta_c, \qquad
        \frac{\partial L}{\partial x} = \frac{\gamma_c\,\mathrm{invstd}_c}{M}
            \Big(M g - \sum g - \hat x \sum g\,\hat x\Big)

    with :math:`g = \partial L/\partial y`; batch or running statistics as in
    :class:`BatchNormAddReLU`. Saved: x, mean, invstd, gamma.
    """
    name = "batchnorm"
    Params = BatchNormParams

    # fwd :: (x, gamma, beta) -> (y, residuals=(x, mean, invstd, gamma))
    def forward(self, x, gamma, beta):
        p = self.params
        out = forward(self.name, x, None, gamma, beta, p, relu=False, with_mask=False)
        self.layout, self.count = out.layout, out.count
        self.save_for_backward(x=out.x, mean=out.mean, invstd=out.invstd,
                               gamma=kernels.contiguous(gamma))
        return out.y

    # bwd :: (residuals, dy) -> (dx, dgamma, dbeta)
    def backward(self, dy):
        s = self.saved
        need_x, need_gamma, need_beta = self.needs_input_grad
        dx, dgamma, dbeta, _ = bn_backward(
            kernels.contiguous(dy), s.x, s.mean, s.invstd, s.gamma, None, self.layout,
            need=(need_x, need_gamma, need_beta, False), training=self.params.training,
            comm=self.params.comm, count=self.count)
        return dx, dgamma, dbeta


# --------------------------------------------------------------------------- public functions

def batchnorm_add_relu(x, z, gamma, beta, *, running_mean=None, running_var=None, training=True,
                       momentum=0.1, eps=1e-5, layout="NCHW", save="output", comm=None):
    """Fused ``relu(batchnorm(x) + z)``: the tail of a ResNet block, in one pass.

    Parameters
    ----------
    x, z : array or Tensor, (N, C, H, W) or (N, H, W, C)
        Batch-norm input and the residual added before the ReLU (same shape).
    gamma, beta : array or Tensor, (C,)
        Scale and shift.
    running_mean, running_var : array (C,), optional
        Running statistics: updated in place in training (``r = (1-m) r + m batch``, unbiased
        variance, PyTorch's rule); required and read (not updated) when ``training=False``.
    training : bool
        Batch statistics (True) or running statistics (False).
    momentum : float in [0, 1]
        The running statistics' factor; read only in training with running statistics
        (elsewhere any value passes). ``None`` (PyTorch's cumulative moving average) needs a
        layer's batch count: ``nn.BatchNorm2d(C, momentum=None)``; here it is a TypeError.
    eps : float >= 0;  layout : "NCHW" or "NHWC"
    save : {"output", "mask"}
        ReLU state kept for backward: y itself, or a packed 1-bit mask (32x smaller than a
        float32 y).
    comm : numbafuse.distributed.Communicator, optional
        Synchronized batch norm (training): the statistics are those of the batch of all
        ranks (this rank's x may have any batch size, even 0); the backward all-reduces its
        two per-channel sums, so dx and dz are this rank's rows of the gradient of the whole
        batch, and dgamma, dbeta this rank's contribution (docs/distributed.md).

    Returns
    -------
    y : array or Tensor, shape and dtype of x (on x's device). An empty batch (N*H*W = 0)
        gives an empty y and leaves the running statistics as they are (PyTorch's rule);
        exactly one value per channel in training is a ValueError.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x = np.arange(8.0).reshape(2, 1, 2, 2); z = np.zeros_like(x)
    >>> rm, rv = np.zeros(1), np.ones(1)
    >>> y = nf.batchnorm_add_relu(x, z, np.ones(1), np.zeros(1), running_mean=rm,
    ...                           running_var=rv)
    >>> (y > 0).sum(), rm
    (np.int64(4), array([0.35]))
    """
    return BatchNormAddReLU(running_mean=autograd.unwrap(running_mean),
                            running_var=autograd.unwrap(running_var),
                            training=training, momentum=momentum, eps=eps, layout=layout,
                            save=save, comm=comm).apply(x, z, gamma, beta)


def batchnorm_add_relu_backward(dy, x, z, gamma, beta, running_mean=None, running_var=None,
                                training=True, eps=1e-5, layout="NCHW", *, y=None, mask=None):
    """(dx, dz, dgamma, dbeta) of :func:`batchnorm_add_relu`, NumPy style (no tape): the
    gradients in the order of the forward's array arguments (x, z, gamma, beta).

    The positional arguments are those of ``numbafuse.reference.batchnorm_add_relu_backward``.
    The batch statistics are recomputed from x (training) or taken from the running statistics
    (inference; nothing is updated). The ReLU state is, in order of preference, ``mask`` (the
    packed mask of ``bn_apply(..., with_mask=True)``), ``y`` (the forward output), or else
    recomputed from x, z, gamma, beta (then z and beta are needed; otherwise they may be None).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x = np.arange(8.0).reshape(2, 1, 2, 2); z = np.zeros_like(x)
    >>> g, b = np.ones(1), np.zeros(1)
    >>> dx, dz, dgamma, dbeta = nf.batchnorm_add_relu_backward(np.ones_like(x), x, z, g, b)
    >>> dbeta
    array([4.])
    """
    op = "batchnorm_add_relu_backward"
    dy, x, z, gamma, beta, running_mean, running_var, y, mask = (
        autograd.unwrap(a) for a in (dy, x, z, gamma, beta, running_mean, running_var, y, mask))
    validate.check_given(op, dy=dy, x=x, gamma=gamma)
    state = mask if mask is not None else y
    if state is None and (z is None or beta is None):
        raise ValueError(f"{op}: without y or mask, z and beta are needed to recompute the "
                         f"ReLU state")
    beta_check = beta if beta is not None else gamma
    args = validate.batchnorm_args(
        op, dict(x=x, z=z, gamma=gamma, beta=beta_check, running_mean=running_mean,
                 running_var=running_var), training=training, momentum=0.0, eps=eps,
        layout=layout, updates=False)
    backend.backend_of(op, dy=dy, x=x, y=y, mask=mask)
    validate.check_float_dtypes(op, half=True, dy=dy, x=x, y=y)
    validate.check_same_shape(op, "dy", dy, "x", x)
    if y is not None:
        validate.check_same_shape(op, "y", y, "x", x)
    if mask is not None and (np.dtype(mask.dtype) != np.uint8 or tuple(mask.shape) != (
            mask_nbytes(int(np.prod(x.shape))),)):
        raise ValueError(f"{op}: mask must be uint8 of shape "
                         f"({mask_nbytes(int(np.prod(x.shape)))},), got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    impl = _kernels(args.backend)
    x, gamma = kernels.contiguous(x), kernels.contiguous(gamma)
    act = _activations(args.backend)
    xc = act(x)                               # as the backend's kernels take a half x
    if training:
        mean, _, invstd = (impl.stats(xc, args.layout, args.eps) if x.size else
                           _no_stats(x, args.layout))
    else:
        mean, invstd = impl.inference_stats(precision.compute(running_mean),
                                            precision.compute(running_var), args.eps)
    if state is None and x.size == 0:
        state = backend.empty(args.backend, (0,), np.uint8)              # the empty mask
    if state is None:
        state = impl.apply(xc, mean, invstd, precision.compute(gamma),
                           precision.compute(kernels.contiguous(beta)),
                           act(kernels.contiguous(z)), True, args.layout,
                           True)[1]
    dx, dgamma, dbeta, dz = bn_backward(kernels.contiguous(dy), xc, mean, invstd, gamma,
                                        kernels.contiguous(state), args.layout,
                                        training=training)
    return dx, dz, dgamma, dbeta


def batchnorm(x, gamma, beta, *, running_mean=None, running_var=None, training=True,
              momentum=0.1, eps=1e-5, layout="NCHW", comm=None):
    """Batch normalization ``gamma * (x - mean) / sqrt(var + eps) + beta`` (unfused op).

    Same arguments, running-statistics and ``comm`` semantics as :func:`batchnorm_add_relu`
    (no z, no ReLU, no save policy). The unfused chain ``relu(add(batchnorm(x, ...), z))``
    computes what :func:`batchnorm_add_relu` fuses.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x = np.arange(4.0).reshape(1, 1, 2, 2)
    >>> np.round(nf.batchnorm(x, np.ones(1), np.zeros(1)).ravel(), 3)
    array([-1.342, -0.447,  0.447,  1.342])
    """
    return BatchNorm(running_mean=autograd.unwrap(running_mean),
                     running_var=autograd.unwrap(running_var),
                     training=training, momentum=momentum, eps=eps, layout=layout,
                     comm=comm).apply(x, gamma, beta)


# the arguments that may be float32 when x is half (every op with a batch norm inside)
HALF_PARAMS = ("gamma", "beta", "running_mean", "running_var")

SPECS = (
    OpSpec("batchnorm", batchnorm, BatchNorm, reference=reference.batchnorm_train, half=True,
           half_params=HALF_PARAMS),
    OpSpec("batchnorm_add_relu", batchnorm_add_relu, BatchNormAddReLU,
           reference=reference.batchnorm_add_relu, backward=batchnorm_add_relu_backward,
           fuses=("batchnorm", "add", "relu"), half=True, half_params=HALF_PARAMS),
)
