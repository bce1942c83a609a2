"""Parallel CPU kernels that run serially on small inputs.

Waking Numba's worker threads for a ``prange`` loop costs tens of microseconds (about 40 us
on the 2-core CI machine with ``OMP_WAIT_POLICY=PASSIVE``), more than a small elementwise pass
takes. :func:`parallel_kernel` compiles a kernel twice - ``parallel=True`` and plain (where
``prange`` is ``range``) - and each call picks one by the size of its largest array argument.
Both versions do the same arithmetic in the same order per output, so results do not depend
on which ran (the reductions already fix their partial order by task, not by thread).
"""
import types

import numpy as np
from numba import njit

# Below this many elements in the largest array argument, a kernel runs on one thread.
PARALLEL_MIN_ELEMENTS = 1 << 16


def _renamed(fn, suffix):
    """A copy of ``fn`` with another qualified name, so Numba caches it in its own file."""
    clone = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix,
                               fn.__defaults__, fn.__closure__)
    clone.__qualname__ = fn.__qualname__ + suffix
    clone.__module__ = fn.__module__
    clone.__doc__ = fn.__doc__
    return clone


class ParallelKernel:
    """``kernel(*args)``: the parallel build for large inputs, the serial one for small."""

    def __init__(self, fn, **options):
        self.py_func = fn
        self.parallel = njit(parallel=True, cache=True, **options)(fn)
        self.serial = njit(cache=True, **options)(_renamed(fn, "__serial"))
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def __call__(self, *args):
        work = max((a.size for a in args if isinstance(a, np.ndarray)), default=0)
        kernel = self.parallel if work >= PARALLEL_MIN_ELEMENTS else self.serial
        return kernel(*args)


def parallel_kernel(fn=None, **options):
    """Decorator: ``@parallel_kernel`` in place of ``@njit(parallel=True, cache=True)``;
    ``@parallel_kernel(fastmath=...)`` passes other ``njit`` options to both builds."""
    if fn is None:
        return lambda f: ParallelKernel(f, **options)
    return ParallelKernel(fn, **options)
