"""CUDA grouped convolutions (``groups > 1``): depthwise kernels, or ``cuda.py``'s implicit
GEMMs once per group.

Same interface as ``cuda.py`` (``kernels.interfaces.ConvKernels``), for a geometry with
``groups > 1`` (``groups == 1`` never comes here), as ``cpu_grouped.py`` on the CPU:

    depthwise  groups == C (one input channel per group, K = C * multiplier): the direct
               stencils of ``cuda_depthwise.py`` (one forward launch; dx, dW's partials and
               their sum, db's channel sums in the backward)
    direct     where a group has at most ``config.direct_group_channels`` input channels
               (``_nhwc``: NHWC's): the depthwise kernels, each value summing its group's
               channels (a GEMM per group runs its few filters in tiles of 64 or 128 columns,
               and a backward per group takes ~10 launches a group)
    per group  1 < groups < C: each group's channel slice of x (and of gy, y in backward)
               copied contiguous on the device (the GEMMs take flat C-contiguous arrays;
               ``elementwise.cuda.channel_slice``, no numba view of the slice),
               the group's GEMMs run with its ungrouped geometry (C/groups channels, K/groups
               filters), and the result copied into its channel block of y (dx) and its rows
               of dw, db.
"""
from ...cuda import empty as _empty
from ..elementwise.cuda import channel_slice, copy_into, put_channels
from ..cuda import config
from . import cuda as conv_cuda
from . import cuda_depthwise
from .cuda import (bias_add, channel_sum, forward_bn_sums, forward_scaled,  # noqa: F401
                   forward_stats)
from .math import group_geometry


def _direct(geom):
    """Whether the direct stencils take a grouped geometry (depthwise, or few channels a
    group: ``config.direct_group_channels``)."""
    direct = (config.direct_group_channels if geom.layout == "NCHW"
              else config.direct_group_channels_nhwc)
    return cuda_depthwise.is_depthwise(geom) or geom.C // geom.groups <= direct


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w, groups) + b?)`` for contiguous device arrays of one dtype."""
    if _direct(geom):
        return cuda_depthwise.forward(x, w, b, geom, relu)
    one, layout = group_geometry(geom), geom.layout
    Cg, Kg = one.C, one.K
    y = _empty(geom.y_shape, x.dtype)
    for g in range(geom.groups):
        xg = channel_slice(x, layout, g * Cg, (g + 1) * Cg)
        bg = None if b is None else b[g * Kg:(g + 1) * Kg]
        yg = conv_cuda.conv_forward(xg, w[g * Kg:(g + 1) * Kg], bg, one, relu)
        put_channels(yg, y, layout, g * Kg)
    return y


DX_ADDEND = False   # conv_backward takes no dx_addend: one GEMM set per group
                    # (interfaces.ConvKernels)


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of a grouped conv [+ bias] [+ ReLU whose output is ``y``] on the
    device; only ``need``'s are computed (``cuda.conv_backward``)."""
    if _direct(geom):
        return cuda_depthwise.backward(gy, x, w, geom, y, need)
    need_dx, need_dw, need_db = (bool(v) for v in need)
    one, layout = group_geometry(geom), geom.layout
    Cg, Kg = one.C, one.K
    dx = _empty(geom.x_shape, gy.dtype) if need_dx else None
    dw = _empty(geom.w_shape, gy.dtype) if need_dw else None
    db = _empty((geom.K,), gy.dtype) if need_db else None
    for g in range(geom.groups):
        c0, k0 = g * Cg, g * Kg
        gyg = channel_slice(gy, layout, k0, k0 + Kg)
        yg = None if y is None else channel_slice(y, layout, k0, k0 + Kg)
        xg = channel_slice(x, layout, c0, c0 + Cg)
        dxg, dwg, dbg = conv_cuda.conv_backward(gyg, xg, w[k0:k0 + Kg], one, yg, need)
        if need_dx:
            put_channels(dxg, dx, layout, c0)
        if need_dw:
            copy_into(dwg, dw[k0:k0 + Kg])
        if need_db:
            copy_into(dbg, db[k0:k0 + Kg])
    return dx, dw, db
