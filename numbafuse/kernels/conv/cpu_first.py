"""The CPU conv kernels as ops call them: ``cpu.py`` / ``cpu_grouped.py``, each pass's first
call run by NumPy while its kernels compile (``cpu/first_calls.py``).

``kernels.conv_kernels("cpu", groups)`` returns this module (``kernels.interfaces.
ConvKernels``). A pass's key is what decides which compiled functions it runs: the pass, the
dtype, its flags, the geometry (the plan is a function of it) and the plan rules in force.
While a key's compiled run is pending, ``conv_forward``/``conv_backward`` run ``cpu_numpy.py``
and the fused batch-norm epilogues (``forward_stats``, ``forward_bn_sums``,
``forward_scaled``) return None, which the ops already take as "no such epilogue here" (they
run the conv, then the batch-norm kernels).

A conv of whose taps one alone reaches input pixels from any output (a small map's padding:
a 3x3 conv with padding 1 on a 1x1 map reads its center tap only: ResNet's l4 at a 32x32
input) runs as the 1x1 conv of that tap (:func:`_crop`): the forward and backward run the
conv of ``w[:, :, r:r+1, s:s+1]``, the same sums without the padding's zero products
(pointwise GEMMs on a ninth of the weights), dW comes back with zeros at the other taps,
and the batch-norm statistics epilogues say None (the 1x1 has none). Inference's scaled
forward is not cropped (:func:`forward_scaled`).
"""
import dataclasses
import functools
from functools import partial

import numpy as np

from ..cpu import first_calls
from ..cpu.compile_child import Values, Zeros
from . import cpu, cpu_chunks, cpu_grouped, cpu_numpy
from . import weights as _weights
from .cpu import bias_add, channel_sum  # noqa: F401  (kernels.interfaces.ConvKernels)
from .cpu_plan import current_rules
from .math import tap_spans

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


def _used(out, size, taps, stride, dilation, pad):
    """The taps along one axis that some output reads inside the input."""
    spans = tap_spans(out, size, taps, stride, dilation, pad)
    return [t for t, (lo, hi) in enumerate(spans) if hi > lo]


@functools.lru_cache(maxsize=256)
def _crop(geom):
    """(r, s, the geometry of ``w[:, :, r:r+1, s:s+1]``) where tap (r, s) alone reaches input
    pixels from any output, else None."""
    rows = _used(geom.P, geom.H, geom.R, geom.sh, geom.dh, geom.ph)
    cols = _used(geom.Q, geom.W, geom.S, geom.sw, geom.dw, geom.pw)
    if len(rows) != 1 or len(cols) != 1 or geom.R * geom.S == 1:
        return None         # (one tap only: a 2x2 kernel cropped from a 3x3/2 on a 2x2 map
        # took 2.4 ms at 256 -> 512, batch 2, against tapwise's 0.33 on the 3x3; the 1x1 runs
        # the pointwise GEMMs: 512 at 1x1, batch 2, forward / dX / dW 0.56 / 0.98 / 0.96 ms
        # -> 0.32 / 0.30 / 0.75 on machine F)
    (r,), (s,) = rows, cols
    ph, pw = geom.ph - r * geom.dh, geom.pw - s * geom.dw
    ph_end = (geom.P - 1) * geom.sh + 1 - geom.H - ph                           # (P kept)
    pw_end = (geom.Q - 1) * geom.sw + 1 - geom.W - pw
    if ph_end < 0 or pw_end < 0:           # windows ending before the input's edge: as it is
        return None
    return r, s, dataclasses.replace(geom, R=1, S=1, ph=ph, pw=pw, ph_end=ph_end,
                                     pw_end=pw_end)


def _cropped(function, w, geom, args):
    """``function(*args)`` (``args`` with w and geom at ``_crop``'s places in them) on the
    cropped conv where :func:`_crop` crops, its weights kept by the weight cache where w's
    derived arrays are (and vouched for like w, so the cropped conv's own are too)."""
    crop = _crop(geom)
    if crop is None:
        return function(*args)
    r, s, cropped = crop
    wc = _weights.derived(w, ("cropped", r, s),
                          lambda: cpu_chunks.one_tap(np.ascontiguousarray(w), r, s))
    swap = {id(w): wc, id(geom): cropped}
    with _weights.vouch_like(wc, w):
        return function(*(swap.get(id(a), a) for a in args))


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w, groups) + b?)`` (``cpu.conv_forward``)."""
    relu = bool(relu)
    return _cropped(_conv_forward, w, geom, (x, w, b, geom, relu))


def _conv_forward(x, w, b, geom, relu):
    return _call("conv_forward", (x.dtype.char, b is None, relu), geom, (x, w, b, geom, relu),
                 cpu_numpy.conv_forward)


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)``, only ``need``'s (``cpu.conv_backward``); a cropped conv's dW with
    zeros at the taps it leaves out."""
    need = tuple(bool(v) for v in need)
    dx, dw, db = _cropped(_conv_backward, w, geom, (gy, x, w, geom, y, need))
    crop = _crop(geom)
    if crop is not None and dw is not None:
        # (an output-cache buffer: np.zeros' fresh pages each step cost 3 ms a step where
        # SGD faulted them in)
        dw = cpu_chunks.spread_tap(dw, w.shape, crop[0], crop[1])
    return dx, dw, db


def _conv_backward(gy, x, w, geom, y, need):
    return _call("conv_backward", (gy.dtype.char, y is None, need), geom,
                 (gy, x, w, geom, y, need), cpu_numpy.conv_backward)


# The batch-norm statistics epilogues: None for a conv that runs as one tap's 1x1 (they are
# the 3x3 Winograd's; the 1x1 runs the pointwise GEMMs): the ops then run the conv (cropped)
# and the batch norm's own passes.

def forward_stats(x, w, geom, eps):
    """``cpu.forward_stats``, or None while its kernels compile."""
    if _crop(geom) is not None:
        return None
    return _call("forward_stats", x.dtype.char, geom, (x, w, geom, eps))


def forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta):
    """``cpu.forward_bn_sums``, or None while its kernels compile."""
    if _crop(geom) is not None:
        return None
    return _call("forward_bn_sums", (x.dtype.char, beta is None), geom,
                 (x, w, geom, dy, mean, invstd, gamma, beta))


def forward_scaled(x, w, values, geom, relu, z=None):
    """``cpu.forward_scaled``, or None while its kernels compile. Not cropped: inference
    scales the sums of the whole kernel's plan (ResNet-18 at batch 2, 32x32, eval forward
    on machine F 9.72 ms so, 9.99 with the cropped tap's weights scaled by NumPy, 10.97 with
    the whole w folded and then cropped)."""
    relu = bool(relu)
    return _call("forward_scaled", (x.dtype.char, relu, z is None), geom,
                 (x, w, values, geom, relu, z))
