"""The CPU conv kernels as ops call them: ``cpu.py`` / ``cpu_grouped.py``, each pass's first
call run by NumPy while its kernels compile (``cpu/first_calls.py``).

``kernels.conv_kernels("cpu", groups)`` returns this module (``kernels.interfaces.
ConvKernels``). A pass's key is what decides which compiled functions it runs: the pass, the
dtype, its flags, the geometry (the plan is a function of it) and the plan rules in force.
While a key's compiled run is pending, ``conv_forward``/``conv_backward`` run ``cpu_numpy.py``
and the fused batch-norm epilogues (``forward_stats``, ``forward_bn_sums``,
``forward_scaled``) return None, which the ops already take as "no such epilogue here" (they
run the conv, then the batch-norm kernels).
"""
from functools import partial

import numpy as np

from ..cpu import first_calls
from ..cpu.compile_child import Values, Zeros
from . import cpu, cpu_grouped, cpu_numpy
from .cpu import bias_add, channel_sum  # noqa: F401  (kernels.interfaces.ConvKernels)
from .cpu_plan import current_rules

DX_ADDEND = False   # conv_backward takes no dx_addend: the tape adds (interfaces.ConvKernels)


def _none():
    return None


def _kernels(geom):
    return cpu_grouped if geom.groups > 1 else cpu


def _spec(function, geom, args):
    """The call for the compiling process (``cpu/compile_child.py``): arrays as their shapes
    and dtypes, a callable (``forward_scaled``'s ``values``) as the (K,) arrays it returns."""
    def described(a):
        if isinstance(a, np.ndarray):
            return Zeros(a.shape, a.dtype.str)
        return Values(geom.K, args[0].dtype.str) if callable(a) else a
    return _kernels(geom).__name__, function, tuple(described(a) for a in args), current_rules()


def _call(function, flags, geom, args, fallback=None):
    """``function`` of the kernels that run ``geom`` on ``args``: on the calling thread once
    its key (the function, ``flags``, the geometry, the plan rules) is ready, else through
    ``first_calls.run`` with ``fallback`` on the same arguments (None: the call returns
    None, "no such epilogue here")."""
    kernel = getattr(_kernels(geom), function)
    key = (function, flags, geom, current_rules())
    if first_calls.is_ready(key):
        return kernel(*args)
    return first_calls.run(key, partial(kernel, *args),
                           partial(fallback, *args) if fallback else _none,
                           _spec(function, geom, args))


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w, groups) + b?)`` (``cpu.conv_forward``)."""
    relu = bool(relu)
    return _call("conv_forward", (x.dtype.char, b is None, relu), geom, (x, w, b, geom, relu),
                 cpu_numpy.conv_forward)


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)``, only ``need``'s (``cpu.conv_backward``)."""
    need = tuple(bool(v) for v in need)
    return _call("conv_backward", (gy.dtype.char, y is None, need), geom,
                 (gy, x, w, geom, y, need), cpu_numpy.conv_backward)


def forward_stats(x, w, geom, eps):
    """``cpu.forward_stats``, or None while its kernels compile."""
    return _call("forward_stats", x.dtype.char, geom, (x, w, geom, eps))


def forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta):
    """``cpu.forward_bn_sums``, or None while its kernels compile."""
    return _call("forward_bn_sums", (x.dtype.char, beta is None), geom,
                 (x, w, geom, dy, mean, invstd, gamma, beta))


def forward_scaled(x, w, values, geom, relu):
    """``cpu.forward_scaled``, or None while its kernels compile."""
    relu = bool(relu)
    return _call("forward_scaled", (x.dtype.char, relu), geom, (x, w, values, geom, relu))
