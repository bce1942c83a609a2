"""Numba CPU kernels of batch norm's running statistics: the inference statistics and the
running-average update (host entry points :func:`inference_stats`, :func:`update_running`,
re-exported by ``kernels/batchnorm/cpu.py``)."""
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


def update_running(running_mean, running_var, mean, var, count, momentum):
    """In place: r_mean = (1-m) r_mean + m mean, r_var = (1-m) r_var + m var*M/(M-1)."""
    rm = np.ascontiguousarray(running_mean)
    rv = np.ascontiguousarray(running_var)
    _rec.step(_update_running, rm, rv, mean, var, float(count), float(momentum))
    if rm is not running_mean:   # a strided view: write the values back through it
        running_mean[...] = rm
    if rv is not running_var:
        running_var[...] = rv
