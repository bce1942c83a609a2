"""The depthwise NCHW float32 forward over the register tiles of ``cpu_depthwise_tiles``
(any multiplier; ``cpu_depthwise`` launches it and has the loops for every other case, and
the notation): each task splits an input plane into its stride phases and computes each
filter's output rows with the output columns on the vector lanes.

    forward_tiled  every tap through ``depthwise_taps`` (a tap's weight repeated on every
                   lane, one load of x per multiply-add)
    forward_rows7  7x7 taps at stride 1 or 2 through ``depthwise_rows7`` (a phase row's
                   vector loaded once for every output row of a tile it reaches); a kernel of
                   its own, so that its tiles compile only where a 7x7 runs

Both store the rows of a plane into y itself where they can (``_rows_into_y``) and make the
same sums in the same order as ``cpu_depthwise._forward_nchw``'s plane loops: the same bits.
"""
import dataclasses

import numpy as np
from numba import njit

from ..cpu import gemm_taps as _gemm_taps
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import task_kernel
from ..cpu.transpose import transposed_images
from . import cpu_depthwise_tiles as _tiles
from .cpu_phases import split as _split_phases

# a*b + c as one fused multiply-add (one rounding), as cpu_depthwise's loops
FMA = {"contract"}


@task_kernel(fastmath=FMA)
def forward_tiled(t0, t1, x, wrep, brep, relu, geo, Wpt, aoff, wide, y):
    # float32, any multiplier: the register tiles of cpu_depthwise_tiles with the output
    # columns on the vector lanes. Task t: input plane (n, c) = divmod(t, C), split into its
    # sh*sw phases (zero-padded, rows of Wpt >= Qv + the widest tap's column offset, Qv = Q
    # rounded up to 8); output row p of filter k sums, over the taps in (r, s) order, phase
    # row p at the tap's offset times w[k, r, s] on every lane, then the bias and ReLU: Qv
    # columns in registers, Q of them stored (_rows_into_y: how). The sums and their order
    # are cpu_depthwise._forward_nchw's. wrep: (K, R*S, Qv) each tap's weight on every lane;
    # brep: (K, Qv) the bias likewise (made once a call, lanes). aoff: (R*S,) int64 element
    # offset of each tap from a row of phase 0.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    Qv = (Q + 7) // 8 * 8
    T = R * S
    xph, acc, rows = _nchw_buffers(geo, Wpt, Qv)
    woff = np.empty(T, np.int64)
    for i in range(T):
        woff[i] = i * Qv
    pr, pa, pwo = np.int64(rows.ctypes.data), np.int64(aoff.ctypes.data), \
        np.int64(woff.ctypes.data)
    pacc = np.int64(acc.ctypes.data)
    rel, wid = np.int64(relu), np.int64(wide)
    last = _rows_into_y(P, Q, Qv, _gemm_taps.panel(wide, Qv) == Qv)
    for t in range(t0, t1):
        n, c = t // C, t % C
        _split_phases(x[n, c], ph, pw, sh, sw, Wpt, xph)
        for k in range(c * M, c * M + M):
            pwr, pb = np.int64(wrep[k].ctypes.data), np.int64(brep[k].ctypes.data)
            yp = y[n, k]
            if last > 0:
                _tiles.taps_step((last, Qv, T, pr, pa, pwo, pwr, np.int64(yp.ctypes.data), Q,
                                  pb, rel, wid))
            if last < P:
                _tiles.taps_step((P - last, Qv, T, pr + 8 * last, pa, pwo, pwr, pacc, Qv, pb,
                                  rel, wid))
                _from_acc(acc, last, yp)
    _gemm_taps.kept(rows, woff, acc)             # (the tiles read rows and woff by address)


@task_kernel(fastmath=FMA)
def forward_rows7(t0, t1, x, w, brep, relu, geo, Wpt, y):
    # forward_tiled's plane loop for 7x7 taps at stride 1 or 2 in both directions, no
    # dilation: cpu_depthwise_tiles.depthwise_rows7 (each phase row's vector
    # loaded once for every output row of a tile it reaches), the same sums in the same
    # order. w: (K, 49) the weights. A kernel of its own: its tiles compile only where a
    # 7x7 runs (its first call 5.46 s of CPU cold against 4.51, machine A).
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    Qv = (Q + 7) // 8 * 8
    xph, acc, rows = _nchw_buffers(geo, Wpt, Qv)
    plane = xph.shape[1]                                              # a phase plane's size
    pacc = np.int64(acc.ctypes.data)
    rel = np.int64(relu)
    last = _rows_into_y(P, Q, Qv, _tiles.rows7_panel(Qv) == Qv)
    for t in range(t0, t1):
        n, c = t // C, t % C
        _split_phases(x[n, c], ph, pw, sh, sw, Wpt, xph)
        for k in range(c * M, c * M + M):
            pws, pb = np.int64(w[k].ctypes.data), np.int64(brep[k].ctypes.data)
            yp = y[n, k]
            if last > 0:                    # (a direct call, not a step: through a step
                _tiles.depthwise_rows7(      # the 7x7/2 forward took 9% longer, 6144 calls)
                    last, Qv, rows[0], Wpt, plane, sh - 1, pws, np.int64(yp.ctypes.data), Q,
                    pb, rel)
            if last < P:
                _tiles.depthwise_rows7(P - last, Qv, rows[last], Wpt, plane, sh - 1, pws, pacc,
                                       Qv, pb, rel)
                _from_acc(acc, last, yp)


@njit(nogil=True, cache=True, inline="always")
def _nchw_buffers(geo, Wpt, Qv):
    # a task's phase buffer (zero padding written once), its (P, Qv) accumulator rows and
    # the addresses of phase 0's P rows (int64)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    xph = np.zeros((sh * sw, (P + (R - 1) * dh // sh + 1) * Wpt), np.float32)
    rows = np.empty(P, np.int64)
    for p in range(P):
        rows[p] = np.int64(xph.ctypes.data) + 4 * p * Wpt
    return xph, np.empty((P, Qv), np.float32), rows


@njit(nogil=True, cache=True, inline="always")
def _rows_into_y(P, Q, Qv, one_panel):
    # how many of a plane's output rows the tiles store into y itself (row stride Q), the
    # rest going through the accumulator rows: all where Q == Qv; else, where Qv is one
    # panel of the tiles and Q >= Qv - Q, all but the last: a row's Qv - Q extra lanes land
    # on the next row's first columns, which that row's store (later, in row order)
    # overwrites; the last row's would land on another plane, another task's. (Panels run
    # one after the other over all rows: a second panel's extra lanes would land on columns
    # the first stored already.)
    if Q == Qv:
        return P
    if one_panel and P >= 2 and 2 * Q >= Qv:
        return P - 1
    return 0


@njit(nogil=True, cache=True, inline="always")
def _from_acc(acc, last, yp):
    # y rows last.. of one plane from the accumulator rows 0..
    P, Q = yp.shape
    for p in range(last, P):
        for q in range(Q):
            yp[p, q] = acc[p - last, q]


def lanes(a, rows, geom):
    """(rows, Qv) float32: ``a``'s ``rows`` values (a bias: K; weights: K*R*S), each on
    every lane of the NCHW tiles' Qv columns (Q rounded up to 8); made once a call."""
    Qv = (geom.Q + 7) // 8 * 8
    out = np.empty((rows, Qv), np.float32)
    out[...] = a.reshape(rows, 1)
    return out


# A float32 NCHW depthwise conv whose output maps have at most this many pixels runs the NHWC
# register tiles on transposed copies (x, and gy, y in backward; y and dx transposed back),
# forward and backward apart: the NCHW passes' tasks are planes (n, c), each copied into padded
# phases, which at a MobileNet's deep 2x2-8x8 maps cost far more than the plane's few values,
# and their dW sums in float64 one plane at a time. Machine F, 2 threads, conv_bias_relu ms,
# NCHW planes -> the NHWC tiles on copies (the NHWC tiles alone), forward / backward:
# (16, 960, 2, 2) 1.76 -> 0.33 (0.17) / 6.69 -> 0.80 (0.46); (16, 192, 8, 8) 0.49 -> 0.34 /
# 3.18 -> 0.81; (16, 144, 16, 16) 0.54 -> 0.68 / 5.57 -> 2.38; (16, 96, 32, 32) stride 2 0.47
# -> 0.81 / 4.92 -> 3.54; (16, 32, 32, 32) 0.38 -> 0.68 / 1.39 -> 1.52.
NHWC_FORWARD_MAX_PIXELS = 64
NHWC_BACKWARD_MAX_PIXELS = 256


def by_nhwc(geom, dtype, limit):
    """Whether the NCHW depthwise conv of ``geom`` runs the NHWC tiles on transposed copies:
    ``limit`` output pixels at most."""
    return (geom.layout == "NCHW" and geom.P * geom.Q <= limit and np.dtype(dtype) == np.float32
            and geom.K == geom.C and geom.C % 8 == 0)     # (cpu_depthwise._tiled's NHWC)


def swapped(a, rows, cols):
    """(N, cols, rows) C-contiguous from ``a`` viewed as (N, rows, cols)."""
    N = a.shape[0]
    return transposed_images(a.reshape(N, rows, cols), _out.empty((N, cols, rows), a.dtype))


def forward_by_nhwc(forward, x, w, b, geom, relu):
    """``forward`` (cpu_depthwise's) of the NHWC geometry on x transposed, y transposed back."""
    hwc = dataclasses.replace(geom, layout="NHWC")
    y = forward(swapped(x, geom.C, geom.H * geom.W).reshape(hwc.x_shape), w, b, hwc, relu)
    return swapped(y, geom.P * geom.Q, geom.K).reshape(geom.y_shape)


def backward_by_nhwc(backward, gy, x, w, geom, y, need):
    """``backward`` (cpu_depthwise's) of the NHWC geometry on gy, x (for dW) and y transposed,
    dx transposed back."""
    hwc, HW, PQ = dataclasses.replace(geom, layout="NHWC"), geom.H * geom.W, geom.P * geom.Q
    dx, dw, db = backward(
        swapped(gy, geom.K, PQ).reshape(hwc.y_shape),
        swapped(x, geom.C, HW).reshape(hwc.x_shape) if need[1]
        else np.empty(hwc.x_shape, x.dtype), w, hwc,
        None if y is None else swapped(y, geom.K, PQ).reshape(hwc.y_shape), need)
    return (None if dx is None else swapped(dx, HW, geom.C).reshape(geom.x_shape)), dw, db
