"""Numba CPU kernels of batch norm's running statistics: the inference statistics, the
inference batch norm as a scale and shift, and the running-average update (host entry points
:func:`inference_stats`, :func:`scale_shift`, :func:`update_running`, re-exported by
``kernels/batchnorm/cpu.py``)."""
import numpy as np
from numba import njit

from ..cpu import recorded as _rec
from . import math as bm
from ..scalar import cpu_scalar

invstd_of = cpu_scalar(bm.invstd_of)
_unbiased_var = cpu_scalar(bm.unbiased_var)
_running_update = cpu_scalar(bm.running_update)


@njit(cache=True)
def _inference_stats(running_mean, running_var, eps, mean, invstd):
    # running_*: (C,) any float dtype; mean, invstd: (C,) float64
    for c in range(running_mean.shape[0]):
        mean[c] = running_mean[c]
        invstd[c] = invstd_of(np.float64(running_var[c]), eps)


@njit(cache=True)
def _update_running(running_mean, running_var, mean, var, count, momentum):
    # running_*: (C,) updated in place; mean, var: (C,) float64 batch statistics (var biased)
    for c in range(running_mean.shape[0]):
        running_mean[c] = _running_update(np.float64(running_mean[c]), mean[c], momentum)
        running_var[c] = _running_update(np.float64(running_var[c]),
                                         _unbiased_var(var[c], count), momentum)


def inference_stats(running_mean, running_var, eps):
    """(mean, invstd) float64 (C,) from the running statistics."""
    C = running_mean.shape[0]
    mean, invstd = np.empty(C), np.empty(C)
    _rec.step(_inference_stats, np.ascontiguousarray(running_mean),
              np.ascontiguousarray(running_var), float(eps), mean, invstd)
    return mean, invstd


@njit(cache=True)
def _scale_shift(gamma, beta, mean, invstd, scale, shift):
    # gamma, beta: (K,) float32 or float64; mean, invstd: (K,) float64; scale, shift: (K,) in
    # the conv's dtype. NumPy's ``s = gamma * invstd``, ``beta - mean * s`` (float64), cast
    for k in range(gamma.shape[0]):
        s = np.float64(gamma[k]) * invstd[k]
        scale[k] = s
        shift[k] = np.float64(beta[k]) - mean[k] * s


def scale_shift(gamma, beta, mean, invstd, dtype):
    """(scale, shift), (K,) each in ``dtype``: an inference batch norm as a per-channel affine
    map, ``scale = gamma * invstd``, ``shift = beta - mean * scale`` computed in float64 (as
    NumPy computes them from float32 or float64 parameters: the same bits), by a compiled
    step (recorded by a prepared call); other parameter dtypes by NumPy."""
    if gamma.dtype not in _PARAMS or beta.dtype not in _PARAMS:
        s = gamma * invstd
        return s.astype(dtype), (beta - mean * s).astype(dtype)
    K = gamma.shape[0]
    scale, shift = np.empty(K, dtype), np.empty(K, dtype)
    _rec.step(_scale_shift, gamma, beta, mean, invstd, scale, shift)
    return scale, shift


_PARAMS = (np.dtype(np.float32), np.dtype(np.float64))


def update_running(running_mean, running_var, mean, var, count, momentum):
    """In place: r_mean = (1-m) r_mean + m mean, r_var = (1-m) r_var + m var*M/(M-1)."""
    rm = np.ascontiguousarray(running_mean)
    rv = np.ascontiguousarray(running_var)
    _rec.step(_update_running, rm, rv, mean, var, float(count), float(momentum))
    if rm is not running_mean:   # a strided view: write the values back through it
        running_mean[...] = rm
    if rv is not running_var:
        running_var[...] = rv
