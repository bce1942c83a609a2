"""Numba kernels: ``cpu/`` (``@njit``, ``prange``) and ``cuda/`` (``numba.cuda``)."""
