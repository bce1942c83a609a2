"""Numba kernels, one package per op family.

Each family (``conv``, ``batchnorm``, ``basic``, ``elementwise``) has ``math.py`` (plain-Python
scalar math shared by both backends, where it has any), ``cpu.py`` (``@njit``/``prange``
kernels) and ``cuda.py`` (``numba.cuda`` kernels), and the two backend modules expose the same
host-level functions, so an op picks one with :func:`module` and calls it. Shared pieces:
``scalar.py`` (ReLU math), ``cpu/launch.py`` (the CPU thread pool) and ``cpu/blas.py`` (its
private one-thread BLAS), ``cuda/config.py`` (every CUDA launch size), ``cuda/reduce.py``
(reductions), ``cuda/gemm.py`` (the GEMM skeleton), ``catalog.py`` (every CUDA kernel and its
signatures).

The CUDA modules are imported only when a device array comes, so CPU users never need
numba-cuda. This package knows nothing of Tensors or ops.
"""
import importlib

import numpy as np

from .. import backend, jit_cache
from . import interfaces  # noqa: F401  (the return types of conv_kernels() and batchnorm_kernels())

jit_cache.install_numbafuse()   # before any kernel is decorated: cached kernels see their imports

FAMILIES = ("conv", "batchnorm", "basic", "elementwise")


_modules = {}


def module(family: str, which: str):
    """The kernel module of op family ``family`` on backend ``which`` ("cpu" or "cuda")."""
    found = _modules.get((family, which))
    if found is None:       # import_module's own lookup costs ~2 us, and ops call this a lot
        found = _modules[family, which] = importlib.import_module(f"{__name__}.{family}.{which}")
    return found


def conv_kernels(which: str, groups: int = 1) -> "interfaces.ConvKernels":
    """The conv kernels of backend ``which`` (``interfaces.ConvKernels``): on the CPU
    ``conv/cpu_first.py`` (``cpu.py``, or ``cpu_grouped.py`` for ``groups > 1``, with each
    pass's first call run by NumPy while they compile: ``cpu/first_calls.py``); on CUDA
    ``conv/cuda.py``, or ``cuda_grouped.py`` for ``groups > 1``."""
    if which == backend.CPU:
        return module("conv", "cpu_first")
    return module("conv", which if groups == 1 else which + "_grouped")


def batchnorm_kernels(which: str) -> "interfaces.BatchNormKernels":
    """The batch-norm kernels of backend ``which`` (``interfaces.BatchNormKernels``)."""
    return module("batchnorm", which)


def contiguous(a):
    """``a`` as a C-contiguous array on its own device (one copy at most)."""
    if isinstance(a, np.ndarray):
        return backend.host_contiguous(a)
    d = backend.as_device_array(a)
    if d.is_c_contiguous():
        return d
    return module("elementwise", backend.CUDA).contiguous_copy(d)


def zeros(which: str, shape, dtype):
    """A zero-filled array on backend ``which``."""
    return full(which, shape, dtype, 0.0)


def full(which: str, shape, dtype, value):
    """An array of ``value`` on backend ``which`` (on the device by a fill kernel: no copy
    from the host, so it can be captured in a CUDA graph)."""
    if which == backend.CPU:
        return np.full(shape, value, dtype)
    return module("elementwise", which).fill(backend.empty(which, shape, dtype), value)


_ONES = {}     # (shape, dtype) -> a device array of ones, made once: see ones_seed


def ones_seed(which: str, shape, dtype):
    """Ones of ``shape``: the default gradient seeding a backward pass (``loss.backward()``).

    On the device the array is made once per (shape, dtype) and handed out again: a training
    step then launches no fill for its seed. It is shared, so it must never be written: the
    tape never writes into the gradient it is given (``engine.backward`` counts its memory as
    handed out, and copies it before making it a leaf's ``.grad``), and no backward kernel
    writes into its ``dy``. Inside a CUDA graph capture the ones are made afresh (a fill in
    the graph): memory taken during a capture belongs to the graph."""
    if which == backend.CPU:
        return np.ones(shape, dtype)
    from ..cuda import capture_in_progress
    key = (tuple(shape), np.dtype(dtype))
    ones = _ONES.get(key)
    if ones is None:
        ones = full(which, shape, dtype, 1.0)
        if capture_in_progress() is None:
            _ONES[key] = ones
    return ones
