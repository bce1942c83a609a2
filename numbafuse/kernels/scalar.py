"""Scalar math shared by the CPU and the CUDA kernels, written once as plain Python.

CPU kernels wrap these with ``numba.njit`` (see ``cpu_scalar``), CUDA kernels with
``cuda.jit(device=True, inline=True)`` (see ``cuda_scalar``); the simulator runs them as they
are. Op families keep their own scalar helpers in ``<family>_math.py`` beside this module.
"""


def relu(v):
    """max(v, 0), but NaN stays NaN (a ReLU must not hide a NaN)."""
    if v > 0 or v != v:
        return v
    return 0.0


def relu_grad(g, y):
    """Gradient through a ReLU whose *output* is ``y``: g where y > 0, else 0."""
    return g if y > 0 else 0.0


def cpu_scalar(f):
    from numba import njit
    return njit(cache=True)(f)


def cuda_scalar(f):
    from ..cuda import numba_cuda
    return numba_cuda.jit(device=True, inline=True)(f)
