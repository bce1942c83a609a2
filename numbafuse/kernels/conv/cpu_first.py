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


def _spec(function, geom, *args):
    """The call for the compiling process (``cpu/compile_child.py``): arrays as their shapes
    and dtypes."""
    args = tuple(Zeros(a.shape, a.dtype.str) if isinstance(a, np.ndarray) else a for a in args)
    return _kernels(geom).__name__, function, args, current_rules()


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w, groups) + b?)`` (``cpu.conv_forward``)."""
    key = ("forward", x.dtype.char, b is None, bool(relu), geom, current_rules())
    if first_calls.is_ready(key):
        return _kernels(geom).conv_forward(x, w, b, geom, relu)
    return first_calls.run(key, partial(_kernels(geom).conv_forward, x, w, b, geom, relu),
                           partial(cpu_numpy.conv_forward, x, w, b, geom, relu),
                           _spec("conv_forward", geom, x, w, b, geom, relu))


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)``, only ``need``'s (``cpu.conv_backward``)."""
    need = tuple(bool(v) for v in need)
    key = ("backward", gy.dtype.char, y is None, need, geom, current_rules())
    if first_calls.is_ready(key):
        return _kernels(geom).conv_backward(gy, x, w, geom, y, need)
    return first_calls.run(key, partial(_kernels(geom).conv_backward, gy, x, w, geom, y, need),
                           partial(cpu_numpy.conv_backward, gy, x, w, geom, y, need),
                           _spec("conv_backward", geom, gy, x, w, geom, y, need))


def forward_stats(x, w, geom, eps):
    """``cpu.forward_stats``, or None while its kernels compile."""
    key = ("forward_stats", x.dtype.char, geom, current_rules())
    if first_calls.is_ready(key):
        return _kernels(geom).forward_stats(x, w, geom, eps)
    return first_calls.run(key, partial(_kernels(geom).forward_stats, x, w, geom, eps), _none,
                           _spec("forward_stats", geom, x, w, geom, eps))


def forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta):
    """``cpu.forward_bn_sums``, or None while its kernels compile."""
    key = ("forward_bn_sums", x.dtype.char, beta is None, geom, current_rules())
    if first_calls.is_ready(key):
        return _kernels(geom).forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta)
    return first_calls.run(key, partial(_kernels(geom).forward_bn_sums, x, w, geom, dy, mean,
                                        invstd, gamma, beta), _none,
                           _spec("forward_bn_sums", geom, x, w, geom, dy, mean, invstd, gamma,
                                 beta))


def forward_scaled(x, w, values, geom, relu):
    """``cpu.forward_scaled``, or None while its kernels compile."""
    key = ("forward_scaled", x.dtype.char, bool(relu), geom, current_rules())
    if first_calls.is_ready(key):
        return _kernels(geom).forward_scaled(x, w, values, geom, relu)
    return first_calls.run(key, partial(_kernels(geom).forward_scaled, x, w, values, geom, relu),
                           _none, _spec("forward_scaled", geom, x, w, Values(geom.K, x.dtype.str),
                                        geom, relu))
