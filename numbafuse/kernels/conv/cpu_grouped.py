"""CPU grouped convolutions (``groups > 1``): depthwise kernels, grouped implicit GEMMs, or the
ungrouped kernels per group.

Same interface as ``cpu.py`` (``kernels.interfaces.ConvKernels``), for a geometry with
``groups > 1`` (``groups == 1`` never comes here: the ops call ``cpu.py`` directly, unchanged).

    depthwise  groups == C (one input channel per group, K = C * multiplier): the direct
               stencils of ``cpu_depthwise.py``
    taps       1 < groups < C, float32, the groups' channels and filters multiples of 8 once
               merged in 1s, 2s, 4s or 8s (``cpu_grouped_taps.fits``): every group in one
               launch a pass, implicit GEMMs on ``cpu.gemm_taps``' tiles
    per group  the other 1 < groups < C: each group's channel slice of x (and of gy, y in backward)
               copied contiguous (the kernels take C-contiguous arrays), ``cpu.py``'s kernels
               run on it with the group's geometry (C/groups channels, K/groups filters,
               groups=1), and the result written into its channel block of y (dx); dw and db
               per group are their rows of dw, db. One copy in and one out per group and array.
"""
import numpy as np

from . import cpu as conv_cpu
from . import cpu_depthwise, cpu_grouped_taps
from .cpu import bias_add, channel_sum  # noqa: F401  (kernels.interfaces.ConvKernels)
from .math import channel_block as _channels, group_geometry


# Grouped float32 convs whose (merged) groups are multiples of 8 channels run in one launch a
# pass (cpu_grouped_taps.py); False: every one by the loop over groups below (tests, A/B)
TAPS = True


def forward_stats(x, w, geom, eps):
    """None: a grouped conv has no batch-norm epilogue (the op makes the statistics pass)."""
    return None


def forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta):
    """None: a grouped conv has no batch-norm epilogue (the op makes the backward's pass)."""
    return None


def forward_scaled(x, w, values, geom, relu, z=None):
    """None: a grouped conv scales no output channel (the op folds the batch norm into w)."""
    return None


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w, groups) + b?)`` for contiguous host arrays of one dtype."""
    if cpu_depthwise.is_depthwise(geom):
        return cpu_depthwise.forward(x, w, b, geom, relu)
    if TAPS and cpu_grouped_taps.fits(geom, x.dtype):
        return cpu_grouped_taps.forward(x, w, b, geom, relu)
    one, layout = group_geometry(geom), geom.layout
    Cg, Kg = one.C, one.K
    y = np.empty(geom.y_shape, x.dtype)
    for g in range(geom.groups):
        xg = np.ascontiguousarray(_channels(x, layout, g * Cg, (g + 1) * Cg))
        bg = None if b is None else b[g * Kg:(g + 1) * Kg]
        _channels(y, layout, g * Kg, (g + 1) * Kg)[...] = conv_cpu.conv_forward(
            xg, w[g * Kg:(g + 1) * Kg], bg, one, relu)
    return y


DX_ADDEND = False   # conv_backward takes no dx_addend (interfaces.ConvKernels)


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of a grouped conv [+ bias] [+ ReLU whose output is ``y``]; only
    ``need``'s are computed (``cpu.conv_backward``)."""
    if cpu_depthwise.is_depthwise(geom):
        return cpu_depthwise.backward(gy, x, w, geom, y, need)
    if TAPS and cpu_grouped_taps.fits(geom, gy.dtype):
        return cpu_grouped_taps.backward(gy, x, w, geom, y, need)
    need_dx, need_dw, need_db = (bool(v) for v in need)
    one, layout = group_geometry(geom), geom.layout
    Cg, Kg = one.C, one.K
    dx = np.empty(geom.x_shape, gy.dtype) if need_dx else None
    dw = np.empty(geom.w_shape, gy.dtype) if need_dw else None
    db = np.empty(geom.K, gy.dtype) if need_db else None
    for g in range(geom.groups):
        cs, ks = slice(g * Cg, (g + 1) * Cg), slice(g * Kg, (g + 1) * Kg)
        gyg = np.ascontiguousarray(_channels(gy, layout, ks.start, ks.stop))
        yg = None if y is None else np.ascontiguousarray(_channels(y, layout, ks.start, ks.stop))
        xg = np.ascontiguousarray(_channels(x, layout, cs.start, cs.stop))
        dxg, dwg, dbg = conv_cpu.conv_backward(gyg, xg, w[ks], one, yg, need)
        if need_dx:
            _channels(dx, layout, cs.start, cs.stop)[...] = dxg
        if need_dw:
            dw[ks] = dwg
        if need_db:
            db[ks] = dbg
    return dx, dw, db
