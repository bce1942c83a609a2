"""Numba CPU kernels (``@njit``, ``prange``). Importing this package compiles nothing."""
