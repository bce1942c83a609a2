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

``check_args(op, x, gamma, beta, z=None, running_mean=None, running_var=None, training=True,
momentum=0.1, eps=1e-5, layout="NCHW", save="output") -> BatchNormArgs``
    All validation of a batch-norm call (backend, dtypes, shapes, scalars, running-stat pair,
    one value per channel in training); raises a named ValueError/TypeError, writes nothing.
``check_running_stats(op, C, M, running_mean, running_var, training, momentum, eps)
-> (momentum, eps)``
    The batch-norm state part of it (also used by Conv -> BatchNorm): running statistics,
    ``training`` a real boolean, the scalars, more than one value per channel in training.
``bn_stats(x, eps=1e-5, layout="NCHW") -> (mean, var, invstd)``
    Batch statistics, float64 (C,); var is biased; shifted float64 accumulation.
``bn_inference_stats(running_mean, running_var, eps=1e-5) -> (mean, invstd)``
    The same vectors from the running statistics (inference).
``bn_apply(x, mean, invstd, gamma, beta, z=None, relu=True, layout="NCHW", with_mask=False)``
    ``y = [relu](gamma * (x - mean) * invstd + beta [+ z])`` in one pass writing y once;
    returns y, or ``(y, mask)`` with ``with_mask`` (mask: packed bits of y > 0, see below).
``bn_backward(gy, x, mean, invstd, gamma, relu_state, layout="NCHW", need=(True,)*4,
training=True) -> (gx, ggamma, gbeta, gz)``
    Two passes: reduce ``gbeta = sum g``, ``ggamma = sum g*xhat`` with ``g = gy * (relu open)``,
    then write ``gx`` and ``gz = g``. ``relu_state`` is y (same shape/dtype as x), a packed mask
    (uint8, from ``bn_apply(..., with_mask=True)``) or None (no ReLU: ``g = gy``). ``need``
    says which of (gx, ggamma, gbeta, gz) to compute (the others are None). ``training=False``:
    mean/invstd are constants (``gx = gamma * invstd * g``).
``update_running(running_mean, running_var, mean, var, count, momentum)``
    In place, PyTorch's rule: ``r_mean = (1-m) r_mean + m mean``,
    ``r_var = (1-m) r_var + m var * count / (count - 1)``.
``mask_nbytes(size)``: bytes of the packed mask of ``size`` elements (``ceil(size / 8)``).

Packed ReLU mask: a 1-d uint8 array of ``ceil(size/8)`` bytes; bit ``j % 8`` of byte ``j // 8``
is set where ``y.reshape(-1)[j] > 0`` (flat index in x's own layout): 32x smaller than a
float32 y, 64x than a float64 one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .. import _arrays
from ..autograd import Function, is_recording
from ..kernels.cpu import batchnorm as cpu_kernels

SAVE_POLICIES = ("output", "mask")
MASK_BITS = 8   # elements per byte of the packed mask

_kernels = functools.partial(_arrays.kernels, "batchnorm")   # _kernels(backend): the module


# --------------------------------------------------------------------------- validation

@dataclass(frozen=True)
class BatchNormArgs:
    """What :func:`check_args` established about one call."""
    backend: str
    dtype: np.dtype
    layout: str
    C: int
    M: int           # values per channel, N*H*W
    eps: float
    momentum: float


def check_args(op, x, gamma, beta, z=None, running_mean=None, running_var=None, training=True,
               momentum=0.1, eps=1e-5, layout="NCHW", save="output") -> BatchNormArgs:
    """Validate a batch-norm(-add-relu) call; a named ValueError/TypeError, nothing written."""
    if x is None or gamma is None or beta is None:
        missing = [n for n, a in (("x", x), ("gamma", gamma), ("beta", beta)) if a is None]
        raise TypeError(f"{op}: {', '.join(missing)} must be an array, got None")
    backend = _arrays.backend_of(op, x=x, z=z, gamma=gamma, beta=beta,
                                 running_mean=running_mean, running_var=running_var)
    dtype = _arrays.check_float_dtypes(op, x=x, z=z, gamma=gamma, beta=beta,
                                       running_mean=running_mean, running_var=running_var)
    layout = _arrays.check_layout(op, layout)
    _arrays.check_ndim(op, "x", x, 4, layout)
    if min(x.shape) < 1:
        raise ValueError(f"{op}: x must have no empty dimension, got shape {tuple(x.shape)}")
    if z is not None:
        _arrays.check_same_shape(op, "z", z, "x", x)
    C = x.shape[_arrays.channel_axis(layout)]
    _arrays.check_vector(op, "gamma", gamma, C)
    _arrays.check_vector(op, "beta", beta, C)
    if save not in SAVE_POLICIES:
        raise ValueError(f"{op}: save must be 'output' or 'mask', got {save!r}")
    M = int(np.prod(x.shape, dtype=np.int64)) // C
    momentum, eps = check_running_stats(op, C, M, running_mean, running_var, training,
                                        momentum, eps)
    return BatchNormArgs(backend, dtype, layout, C, M, eps, momentum)


def check_running_stats(op, C, M, running_mean, running_var, training, momentum, eps):
    """Validate the batch-norm state of a call: ``(momentum, eps)`` as floats.

    Shared by every op with a batch norm inside (``batchnorm``, ``batchnorm_add_relu``,
    ``conv_batchnorm_relu``, their NumPy-style backwards): running statistics of shape (C,),
    given both or neither, required in inference, contiguous when on the device (they are
    updated in place); ``training`` a real boolean (``"no"`` is not False); ``eps >= 0``,
    ``momentum`` in [0, 1]; more than one value per channel (``M``) in training. Backend and
    dtype agreement with the other arrays is the caller's ``backend_of``/``check_float_dtypes``.
    Raises a named ValueError/TypeError; writes nothing.
    """
    _arrays.check_vector(op, "running_mean", running_mean, C)
    _arrays.check_vector(op, "running_var", running_var, C)
    eps = _arrays.check_scalar(op, "eps", eps, lo=0.0)
    momentum = _arrays.check_scalar(op, "momentum", momentum, lo=0.0, hi=1.0)
    _arrays.check_flag(op, "training", training)
    if (running_mean is None) != (running_var is None):
        given = "running_mean" if running_mean is not None else "running_var"
        raise ValueError(f"{op}: running_mean and running_var go together; only {given} "
                         f"was given")
    if not training and running_mean is None:
        raise ValueError(f"{op}: inference (training=False) needs running_mean and running_var")
    for name, v in (("running_mean", running_mean), ("running_var", running_var)):
        if _arrays.is_device_array(v) and not _arrays.as_device_array(v).is_c_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous on the device "
                             f"(it is updated in place)")
    if training and M < 2:
        raise ValueError(f"{op}: training needs more than one value per channel to "
                         f"normalise over, got {M}")
    return momentum, eps


# --------------------------------------------------------------------------- array helpers

def bn_stats(x, eps=1e-5, layout="NCHW"):
    """(mean, var, invstd) of C-contiguous ``x``: float64 (C,), var biased, on x's backend."""
    return _kernels(_arrays.backend_of("bn_stats", x=x)).stats(x, layout, eps)


def bn_inference_stats(running_mean, running_var, eps=1e-5):
    """(mean, invstd) float64 (C,) from the running statistics, on their backend."""
    backend = _arrays.backend_of("bn_inference_stats", running_mean=running_mean,
                                 running_var=running_var)
    return _kernels(backend).inference_stats(running_mean, running_var, eps)


def bn_apply(x, mean, invstd, gamma, beta, z=None, relu=True, layout="NCHW", with_mask=False):
    """``y = [relu](gamma*(x - mean)*invstd + beta [+ z])``, and the packed mask if asked."""
    backend = _arrays.backend_of("bn_apply", x=x, z=z, gamma=gamma, beta=beta)
    y, mask = _kernels(backend).apply(x, mean, invstd, gamma, beta, z, relu, layout,
                                      with_mask)
    return (y, mask) if with_mask else y


def _state_kind(relu_state):
    if relu_state is None:
        return cpu_kernels.STATE_NONE
    return cpu_kernels.STATE_MASK if np.dtype(relu_state.dtype) == np.uint8 else \
        cpu_kernels.STATE_Y


def bn_backward(gy, x, mean, invstd, gamma, relu_state, layout="NCHW", need=(True,) * 4,
                training=True):
    """(gx, ggamma, gbeta, gz) of ``[relu](batchnorm(x) [+ z])``; unneeded ones are None."""
    backend = _arrays.backend_of("bn_backward", gy=gy, x=x, gamma=gamma)
    return _kernels(backend).backward(gy, x, mean, invstd, gamma, _state_kind(relu_state),
                                      relu_state, layout, bool(training), tuple(need))


def update_running(running_mean, running_var, mean, var, count, momentum):
    """Update the running statistics in place (PyTorch's momentum rule, unbiased var)."""
    backend = _arrays.backend_of("update_running", running_mean=running_mean,
                                 running_var=running_var)
    _kernels(backend).update_running(running_mean, running_var, mean, var, count, momentum)


def mask_nbytes(size):
    """Bytes of the packed ReLU mask of ``size`` elements."""
    return -(-int(size) // MASK_BITS)


def _forward(op, x, z, gamma, beta, running_mean, running_var, training, momentum, eps,
             layout, relu, with_mask, save="output"):
    """Validate, compute the statistics, update the running ones, apply: shared by the ops.

    Returns (y, mask, x, mean, invstd, args) with x the C-contiguous array the kernels read.
    """
    args = check_args(op, x, gamma, beta, z=z, running_mean=running_mean,
                      running_var=running_var, training=training, momentum=momentum, eps=eps,
                      layout=layout, save=save)
    x, gamma, beta = _arrays.contiguous(x), _arrays.contiguous(gamma), _arrays.contiguous(beta)
    z = None if z is None else _arrays.contiguous(z)
    kernels = _kernels(args.backend)
    if training:
        mean, var, invstd = kernels.stats(x, args.layout, args.eps)
        if running_mean is not None:
            kernels.update_running(running_mean, running_var, mean, var, args.M,
                                   args.momentum)
    else:
        mean, invstd = kernels.inference_stats(running_mean, running_var, args.eps)
    y, mask = kernels.apply(x, mean, invstd, gamma, beta, z, relu, args.layout, with_mask)
    return y, mask, x, mean, invstd, args


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

    # fwd :: (x, z, gamma, beta) -> (y, residuals=(x, mean, invstd, gamma, y | mask))
    def forward(self, x, z, gamma, beta):
        needs_grad = any(self.needs_input_grad) and is_recording()
        with_mask = needs_grad and self.save == "mask"
        y, mask, x, mean, invstd, args = _forward(
            self.name, x, z, gamma, beta, self.running_mean, self.running_var, self.training,
            self.momentum, self.eps, self.layout, relu=True, with_mask=with_mask,
            save=self.save)
        self.layout_ = args.layout
        relu_state = mask if self.save == "mask" else y
        self.save_for_backward(x=x, mean=mean, invstd=invstd, gamma=_arrays.contiguous(gamma),
                               **{"mask" if self.save == "mask" else "y": relu_state})
        return y

    # bwd :: (residuals, gy) -> (gx, gz, ggamma, gbeta)
    def backward(self, gy):
        s = self.saved
        relu_state = s.mask if self.save == "mask" else s.y
        need_x, need_z, need_gamma, need_beta = self.needs_input_grad
        gx, ggamma, gbeta, gz = bn_backward(
            _arrays.contiguous(gy), s.x, s.mean, s.invstd, s.gamma, relu_state, self.layout_,
            need=(need_x, need_gamma, need_beta, need_z), training=self.training)
        return gx, gz, ggamma, gbeta


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

    # fwd :: (x, gamma, beta) -> (y, residuals=(x, mean, invstd, gamma))
    def forward(self, x, gamma, beta):
        y, _, x, mean, invstd, args = _forward(
            self.name, x, None, gamma, beta, self.running_mean, self.running_var, self.training,
            self.momentum, self.eps, self.layout, relu=False, with_mask=False)
        self.layout_ = args.layout
        self.save_for_backward(x=x, mean=mean, invstd=invstd, gamma=_arrays.contiguous(gamma))
        return y

    # bwd :: (residuals, gy) -> (gx, ggamma, gbeta)
    def backward(self, gy):
        s = self.saved
        need_x, need_gamma, need_beta = self.needs_input_grad
        gx, ggamma, gbeta, _ = bn_backward(
            _arrays.contiguous(gy), s.x, s.mean, s.invstd, s.gamma, None, self.layout_,
            need=(need_x, need_gamma, need_beta, False), training=self.training)
        return gx, ggamma, gbeta


# --------------------------------------------------------------------------- public functions

def batchnorm_add_relu(x, z, gamma, beta, *, running_mean=None, running_var=None, training=True,
                       momentum=0.1, eps=1e-5, layout="NCHW", save="output"):
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
    momentum : float in [0, 1];  eps : float >= 0;  layout : "NCHW" or "NHWC"
    save : {"output", "mask"}
        ReLU state kept for backward: y itself, or a packed 1-bit mask (32x smaller than a
        float32 y).

    Returns
    -------
    y : array or Tensor, shape and dtype of x (on x's device).

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
    return BatchNormAddReLU(running_mean=_arrays.data(running_mean),
                            running_var=_arrays.data(running_var),
                            training=training, momentum=momentum, eps=eps, layout=layout,
                            save=save).apply(x, z, gamma, beta)


def batchnorm_add_relu_backward(gy, x, z, gamma, beta, running_mean=None, running_var=None,
                                training=True, eps=1e-5, layout="NCHW", *, y=None, mask=None):
    """(gx, ggamma, gbeta, gz) of :func:`batchnorm_add_relu`, NumPy style (no tape).

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
    >>> gx, ggamma, gbeta, gz = nf.batchnorm_add_relu_backward(np.ones_like(x), x, z, g, b)
    >>> gbeta
    array([4.])
    """
    op = "batchnorm_add_relu_backward"
    gy, x, z, gamma, beta, running_mean, running_var, y, mask = (
        _arrays.data(a) for a in (gy, x, z, gamma, beta, running_mean, running_var, y, mask))
    state = mask if mask is not None else y
    if state is None and (z is None or beta is None):
        raise ValueError(f"{op}: without y or mask, z and beta are needed to recompute the "
                         f"ReLU state")
    beta_check = beta if beta is not None else gamma
    args = check_args(op, x, gamma, beta_check, z=z, running_mean=running_mean,
                      running_var=running_var, training=training, momentum=0.0, eps=eps,
                      layout=layout)
    _arrays.backend_of(op, gy=gy, x=x, y=y, mask=mask)
    _arrays.check_float_dtypes(op, gy=gy, x=x, y=y)
    _arrays.check_same_shape(op, "gy", gy, "x", x)
    if y is not None:
        _arrays.check_same_shape(op, "y", y, "x", x)
    if mask is not None and (np.dtype(mask.dtype) != np.uint8 or tuple(mask.shape) != (
            mask_nbytes(int(np.prod(x.shape))),)):
        raise ValueError(f"{op}: mask must be uint8 of shape "
                         f"({mask_nbytes(int(np.prod(x.shape)))},), got {mask.dtype} "
                         f"{tuple(mask.shape)}")
    kernels = _kernels(args.backend)
    x, gamma = _arrays.contiguous(x), _arrays.contiguous(gamma)
    if training:
        mean, _, invstd = kernels.stats(x, args.layout, args.eps)
    else:
        mean, invstd = kernels.inference_stats(running_mean, running_var, args.eps)
    if state is None:
        state = kernels.apply(x, mean, invstd, gamma, _arrays.contiguous(beta),
                              _arrays.contiguous(z), True, args.layout, True)[1]
    return bn_backward(_arrays.contiguous(gy), x, mean, invstd, gamma,
                       _arrays.contiguous(state), args.layout, training=training)


def batchnorm(x, gamma, beta, *, running_mean=None, running_var=None, training=True,
              momentum=0.1, eps=1e-5, layout="NCHW"):
    """Batch normalization ``gamma * (x - mean) / sqrt(var + eps) + beta`` (unfused op).

    Same arguments and running-statistics semantics as :func:`batchnorm_add_relu` (no z, no
    ReLU, no save policy). The unfused chain ``relu(add(batchnorm(x, ...), z))`` computes what
    :func:`batchnorm_add_relu` fuses.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> x = np.arange(4.0).reshape(1, 1, 2, 2)
    >>> np.round(nf.batchnorm(x, np.ones(1), np.zeros(1)).ravel(), 3)
    array([-1.342, -0.447,  0.447,  1.342])
    """
    return BatchNorm(running_mean=_arrays.data(running_mean),
                            running_var=_arrays.data(running_var),
                     training=training, momentum=momentum, eps=eps,
                     layout=layout).apply(x, gamma, beta)
