"""The CPU batch-norm kernels as ops call them: ``cpu.py``, each entry point's first call run
by NumPy (``cpu_numpy.py``) while its kernels compile (``kernels/cpu/first_calls.py``, as the
conv passes' ``conv/cpu_first.py``).

``kernels.batchnorm_kernels("cpu")`` returns this module (``kernels.interfaces.
BatchNormKernels``). A key is what decides which compiled functions a call runs: the entry
point, the kernels' family for the shape (``cpu_rows``: the NCHW rows, NHWC or flat NCHW
rows), x's dtype and, for the backward, the state, the gradients asked for, training and
whether pass 1's sums came with the call. A batch norm's kernels compile in 7-10 s with an
empty cache (docs/benchmarks.md, "Small maps as one row a sample"), on the first training
step, where they had run on the calling thread. Synchronized batch norm (``sync``) and an
empty x run compiled always (no NumPy path: a rank must not wait on another's fallback).
"""
from functools import partial

import numpy as np

from ..conv.cpu_plan import current_rules
from ..cpu import first_calls
from ..cpu.compile_child import Zeros
from . import cpu, cpu_numpy
from .cpu import AFFINE_GATE, inference_stats, update_running  # noqa: F401  (the interface)

MODULE = cpu.__name__


def _spec(function, args):
    """The call for the compiling process: arrays as their shapes and dtypes."""
    return MODULE, function, tuple(Zeros(a.shape, a.dtype.str) if isinstance(a, np.ndarray)
                                   else a for a in args), current_rules()


def _call(function, key, args, fallback):
    """``cpu.function(*args)`` once ``key`` is ready, else through ``first_calls.run`` with
    ``fallback(*args)`` (NumPy) while it compiles."""
    kernel = getattr(cpu, function)
    if first_calls.is_ready(key):
        return kernel(*args)
    return first_calls.run(key, partial(kernel, *args), partial(fallback, *args),
                           _spec(function, args))


def _family(x, layout):
    return cpu._view(x.shape, layout).family


def stats(x, layout, eps):
    """``(mean, var, invstd)`` float64 (C,) (``cpu.stats``)."""
    if x.size == 0:
        return cpu.stats(x, layout, eps)
    return _call("stats", ("bn stats", _family(x, layout), x.dtype.char),
                 (x, layout, eps), cpu_numpy.stats)


def stats_update(x, layout, eps, running_mean, running_var, momentum):
    """:func:`stats` and the running statistics updated (``cpu.stats_update``)."""
    if x.size == 0:
        return cpu.stats_update(x, layout, eps, running_mean, running_var, momentum)
    key = ("bn stats_update", _family(x, layout), x.dtype.char,
           None if running_mean is None else running_mean.dtype.char)
    return _call("stats_update", key, (x, layout, eps, running_mean, running_var, momentum),
                 cpu_numpy.stats_update)


def apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
    """``(y, mask or None)`` (``cpu.apply``)."""
    if x.size == 0:
        return cpu.apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask)
    key = ("bn apply", _family(x, layout), x.dtype.char, gamma.dtype.char, beta.dtype.char)
    return _call("apply", key, (x, mean, invstd, gamma, beta, z, relu, layout, want_mask),
                 cpu_numpy.apply)


def apply_running(x, running_mean, running_var, eps, gamma, beta, z, relu, layout, want_mask):
    """Inference: ``(y, mask or None, mean, invstd)`` (``cpu.apply_running``)."""
    mean, invstd = inference_stats(running_mean, running_var, eps)
    y, mask = apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask)
    return y, mask, mean, invstd


def backward(gy, x, mean, invstd, gamma, state_kind, state, layout, training, need,
             sync=None, sums=None):
    """``(gx, ggamma, gbeta, gz)`` (``cpu.backward``)."""
    args = (gy, x, mean, invstd, gamma, state_kind, state, layout, training, need)
    if sync is not None or x.size == 0:
        return cpu.backward(*args, sync=sync, sums=sums)
    key = ("bn backward", _family(x, layout), x.dtype.char, gamma.dtype.char, int(state_kind),
           None if state is None else state.dtype.char, tuple(bool(n) for n in need),
           bool(training), sums is None)
    return _call("backward", key, args + (None, sums), cpu_numpy.backward)
