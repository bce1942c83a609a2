r"""The strided convolution's forward and dW as implicit GEMMs over a padded slab of each chunk
(and the dW of a stride-1 1x1 on small maps: ``cpu_plan.Rules.pointwise_dw_implicit_pixels``;
an NCHW stem's passes, any stride, by output rows: below).

A chunk (output rows [p0, p1) of one image, or whole images: ``cpu._chunking``) copies the
input rows it reads into a zero-padded slab, (images, Hs, Ws, C) with Hs = (rows - 1) * sh +
(R - 1) * dh + 1 and Ws = (Q - 1) * sw + (S - 1) * dw + 1: slab pixel (u, v) of image i is input
pixel (p0 * sh - ph + u, v - pw), zero outside the image. Output pixel (p, q) then reads tap
(r, s) at slab pixel ((p - p0) * sh + r * dh, q * sw + s * dw): one row address per pixel
and one offset per tap, which ``cpu.gemm_taps.gemm_taps`` sums over C in registers, with the
bias and ReLU, straight into y (NHWC) or into a (pixels, K) buffer transposed into y (NCHW).
Undilated along W, the forward's taps are a filter row's S*C contiguous values (R taps,
:func:`row_taps`), the same sums in the same order: the stem's 7x7/2 on 3 channels sums
21 values a tap, not 3 (machine F, batch 16, 64x64, best of 30 alternating calls, ms taps
of C / of S*C: NCHW 5.72 / 4.15, NHWC 4.38 / 3.61; batch 8, 224x224 23.96 / 20.73, 21.77 /
18.00; the same bits).
The slab copies each input value about once (an NCHW source is transposed to HWC on the way,
``cpu.transpose``); im2col copied it R*S / (sh*sw) times and OpenBLAS packed the copy again.

dW (``implicit_dw_tasks``) reads the same slabs the other way round: for each tap (r, s),
dW_rs (K, C) += g^T (K, m) @ (the chunk's m pixel rows at that tap's offset), gathered by
address (``cpu.gemm_taps.gemm_gather``), per fixed group of chunks as ``cpu_im2col``'s dW
(whose g and db helpers it shares).

An NCHW forward on few input channels whose output rows are a multiple of 8 pixels (a stem:
7x7/2 on 3 channels, :func:`gathers`) runs by output rows instead (``gather_tasks``): each
task splits its image's input rows into ``sw`` column phases, zero-padded (a few KB: C * sw
planes, by the phase algorithm's plane copy, ``cpu_direct._plane_chw``), and each output
row of K channels is ``cpu.gemm_taps.gemm_gather``'s c (K, Q) = w (K, C*R*S) @ b, b's row
for tap (c, r, s) the Q contiguous values of phase (s*dw) % sw of channel c at input row
p*sh + r*dh from column (s*dw) // sw: y written in place in NCHW, no slab in HWC nor output
transposed. Machine F (Zen 3, AVX2), the stem at batch 16, 64x64,
best of 30 alternating calls, ms: im2col 4.45-5.25, the taps (S*C a tap) 3.6-4.2, the rows
3.15 (PyTorch 2.9). Its dW likewise (``gather_dw_tasks``: gemm_taps with the taps (c, r, s)
as rows and the output rows as taps, against g (pixels, K)): 3.0-3.25 against im2col's
3.8-4.1 ms; with AVX-512 the dW too, its products on 16-float tiles (machine A, Zen 4: 1.96
against im2col's 2.22 ms, ``Rules.wide_rows_dw``), where the forward keeps the taps.

float32; K (forward) or C (dW) a multiple of 8 (``fits``); the rest keeps im2col. Every y
element is written by one task; its value is one float32 sum in (r, s, c) order ((c, r, s)
by rows), the same on any thread count.
"""
import numpy as np
from numba import njit, types

from ..cpu import gemm_taps as _taps
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import launch, task_kernel
from ..cpu.steps import Step, array as _arr, ready as _ready_steps
from ..cpu.transpose import transpose
from ..scalar import cpu_scalar, relu as _relu_math
from . import math as conv_math
from .cpu_chunks import chunk, gated_chw, gated_hwc, sum_groups
from .cpu_direct import PLANE_CHW

_relu = cpu_scalar(_relu_math)
_plane_chw_step = PLANE_CHW.call             # (the phase algorithm's plane copy, a step)


def fits(geom, dtype, pass_="forward"):
    """Whether this module computes ``pass_`` ("forward" or "dw") of ``geom`` for inputs of
    ``dtype``: float32, and the product's columns (K forward, C for dW) a multiple of 8, or a
    dW by output rows (:func:`gathers`, K a multiple of 8)."""
    return np.dtype(dtype) == np.float32 and (
        (geom.K if pass_ == "forward" else geom.C) % 8 == 0
        or pass_ == "dw" and geom.K % 8 == 0 and gathers(geom))


def gathers(geom, wide=False):
    """Whether the forward of ``geom`` (that :func:`fits`) runs by output rows
    (``gather_tasks``): NCHW, at most ``GATHER_MAX_CHANNELS`` input channels (a stem's; the
    phase planes' rows, C*R*S of them an output row, stay in L1), output rows of a multiple of
    8 pixels (``gemm_gather``'s columns), on 8-float tiles (not ``wide``: with AVX-512's the
    taps' 4 x 4-vector blocks stay, not measured against the rows' 4 x 2)."""
    return (not wide and geom.layout == "NCHW" and geom.C <= GATHER_MAX_CHANNELS
            and geom.Q % 8 == 0 and geom.groups == 1)


GATHER_MAX_CHANNELS = 4
# bytes of g (rows of K values) in one dW product by output rows: its every 4-tap block reads
# them again (machine F, the stem's dW at batch 8, 224x224: 32 ms with a task's ~23 rows, 660
# KB, in one product, as im2col's)
DW_ROWS_BYTES = 128 << 10


def slab_shape(geom, rows):
    """(Hs, Ws) of the slab of ``rows`` output rows."""
    return ((rows - 1) * geom.sh + (geom.R - 1) * geom.dh + 1,
            (geom.Q - 1) * geom.sw + (geom.S - 1) * geom.dw + 1)


def tap_offsets(geom, Ws):
    """Element offsets of the taps (r, s), r-major, from a pixel's corner in the slab."""
    C = geom.C
    return np.array([(r * geom.dh * Ws + s * geom.dw) * C for r in range(geom.R)
                     for s in range(geom.S)], np.int64)


def row_taps(geom, Ws):
    """(k, taps, offsets) of the forward's GEMM: where the conv is not dilated along W, the S
    taps of a filter row are one tap of k = S*C values, contiguous in the slab and in w's
    (R, S*C, K) taps (R taps: the stem's 7x7 on 3 channels sums 21 values a tap, not 3); else
    the (r, s) taps of k = C (:func:`tap_offsets`)."""
    if geom.dw == 1:
        return geom.S * geom.C, geom.R, np.array([r * geom.dh * Ws * geom.C
                                                  for r in range(geom.R)], np.int64)
    return geom.C, geom.R * geom.S, tap_offsets(geom, Ws)


def _fill(x, n0, n1, p0, p1, geo, Hmax, Ws, slab, rows):
    # slab[i] (Hs, Ws, C) <- image n0 + i's padded input rows of output rows [p0, p1); rows[j]
    # <- the slab address of output pixel j's corner (pixels of the chunk in y's order)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    Hs = (p1 - p0 - 1) * sh + (R - 1) * dh + 1
    wlo = min(pw, Ws)                                 # slab columns [wlo, whi) are input's
    whi = min(Ws, pw + W)
    per = (p1 - p0) * Q
    base = np.int64(slab.ctypes.data)
    for i in range(n1 - n0):
        n = n0 + i
        for u in range(Hs):
            h = p0 * sh - ph + u
            d = slab[i, u]                                        # (Ws, C)
            if h < 0 or h >= H or whi <= wlo:
                d[:, :] = 0
                continue
            d[:wlo, :] = 0
            d[whi:, :] = 0
            if nhwc:        # element loops: an array slice assigned from an array makes
                #             Numba compile its shape-mismatch message, ~2.5 s on a cold start;
                #             x by index, no view of each pixel (cpu_chunks.gated_hwc's note)
                for w in range(wlo, whi):
                    for c in range(C):
                        d[w, c] = x[n, h, w - pw, c]
            else:
                transpose(x[n, :, h, wlo - pw:whi - pw], d[wlo:whi])   # (C, w) -> (w, C)
        for pp in range(p1 - p0):
            r0 = i * per + pp * Q
            a0 = base + 4 * ((i * Hmax + pp * sh) * Ws * C)
            for q in range(Q):
                rows[r0 + q] = a0 + 4 * q * sw * C


def _gated_chunk(gy, y, use_mask, n0, n1, p0, p1, geo, need_dw, gbuf, gtbuf, dbp):
    # A dW chunk's g = gy * (y > 0) as g^T (K, m) (gy, y: (N, K, PQ) | (N, PQ, K)): NCHW
    # into gbuf, NHWC as (m, K) into gbuf and transposed into gtbuf (unless not need_dw);
    # dbp (K,) float64 += its sums (cpu_im2col's dW: the same helpers, the same order)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    PQ = P * Q
    per = (p1 - p0) * Q
    m = (n1 - n0) * per
    if nhwc:
        g = gbuf[:m * K].reshape((m, K))
        m0 = n0 * PQ + p0 * Q
        gated_hwc(gy.reshape((N * PQ, K)), y.reshape((N * PQ, K)), use_mask, m0, m0 + m, g, 0,
                  dbp)
        if need_dw:
            transpose(g, gtbuf[:K * m].reshape((K, m)))
    else:
        gt = gbuf[:K * m].reshape((K, m))
        for n in range(n0, n1):
            gated_chw(gy, y, use_mask, n, p0, p1, PQ, Q, gt, (n - n0) * per, dbp)


# The slab fill and dW's gated g as steps called through slots (kernels/cpu/steps.py):
# compiled once, not again inside each task kernel (float32: this module's dtype)
_I, _GEO, _F32 = types.int64, types.UniTuple(types.int64, 16), types.float32
FILL = Step(_fill, lambda f: [(_arr(_F32, 4), _I, _I, _I, _I, _GEO, _I, _I, _arr(_F32, 4),
                               _arr(_I, 1))], per_dtype=False)
GATED_CHUNK = Step(_gated_chunk, lambda f: [
    (_arr(_F32, 3), _arr(_F32, 3), types.boolean, _I, _I, _I, _I, _GEO, types.boolean,
     _arr(_F32, 1), _arr(_F32, 1), _arr(types.float64, 1))], per_dtype=False)
_fill_step, _gated_chunk_step = FILL.call, GATED_CHUNK.call


def ready():
    """The steps compiled and their slots filled (with cpu.gemm_taps'): host code calls this
    before it launches implicit_tasks or implicit_dw_tasks."""
    _taps.ready()
    _ready_steps(None, (FILL, GATED_CHUNK))


def row_chunks(geom, chunks):
    """(rows a task, the phase planes' rows and columns) of the passes by output rows, from
    ``cpu._implicit_plan``'s ``chunks``."""
    ipc, rpc = chunks[:2]
    rows = geom.P if ipc > 1 else rpc
    return (rows, (rows - 1) * geom.sh + (geom.R - 1) * geom.dh + 1,
            geom.Q + (geom.S - 1) * geom.dw // geom.sw)


def dw_by_rows(x, gy, y, use_mask, geom, need_dw, chunks, taps, work):
    """(dW or None, db_parts) of a conv that :func:`gathers` on 8-float tiles
    (``gather_dw_tasks``' partials summed in task order), its products on the plan's tiles
    (``taps``: 2 for 16-float ones, ``Rules.wide_rows_dw``; else 8-float)."""
    rows, Hs, Wh = row_chunks(geom, chunks)
    ntasks = geom.N * -(-geom.P // rows)
    dw_parts = _out.empty((ntasks if need_dw else 1, geom.C * geom.R * geom.S, geom.K),
                          np.float32)
    db_parts = np.empty((ntasks, geom.K))                              # float64
    _ready_steps(None, (_taps.GEMM_TAPS,))
    _ready_steps(np.float32, (PLANE_CHW,))
    launch(gather_dw_tasks, ntasks, x, conv_math.k_view(gy, geom), conv_math.k_view(y, geom),
           use_mask, conv_math.geo_tuple(geom),
           conv_math.int_tuple(rows, Hs, Wh, max(1, DW_ROWS_BYTES // (4 * geom.Q * geom.K)),
                               taps == 2),
           bool(need_dw), (dw_parts, db_parts), work=work, grain=1)
    if not need_dw:
        return None, db_parts
    dwt = sum_groups(dw_parts)                                          # (C*R*S, K)
    return np.ascontiguousarray(dwt.T).reshape(geom.K, geom.C, geom.R, geom.S), db_parts


def forward(x, w, b, has_bias, relu, geom, wide, chunks, taps_of, y, work):
    """y = relu?(conv(x, w) + b?) by ``gather_tasks`` where :func:`gathers`, else by
    ``implicit_tasks`` (``chunks``: ``cpu._implicit_plan``'s; ``taps_of``: w's (R*S, C, K)
    taps, ``cpu._taps``)."""
    ipc, rpc, nchunks, Hmax, Ws = chunks
    geo = conv_math.geo_tuple(geom)
    if gathers(geom, wide):
        rows, Hs, Wh = row_chunks(geom, chunks)
        _ready_steps(None, (_taps.GEMM_GATHER,))
        _ready_steps(np.float32, (PLANE_CHW,))
        launch(gather_tasks, geom.N * -(-geom.P // rows), x, w.reshape(geom.K, -1), b,
               (has_bias, relu, wide), geo, conv_math.int_tuple(rows, Hs, Wh), y, work=work,
               grain=1)
        return
    ready()
    kt, ntaps, aoff = row_taps(geom, Ws)
    launch(implicit_tasks, nchunks, x, taps_of(w, False), aoff, b, (has_bias, relu, wide), geo,
           conv_math.int_tuple(ipc, rpc, Hmax, Ws, kt, ntaps), conv_math.k_view(y, geom),
           work=work, grain=1)


@njit(inline="always")
def _phase_planes(x, n, p0, p1, geo, planes, offs):
    # planes (sw, C, Hs, Wh) <- image n's input rows of output rows [p0, p1) as sw column
    # phases, by the phase algorithm's plane copy (cpu_direct._plane_chw: all rows, column
    # phase f): plane (f, c) row u column j = input (c, p0*sh - ph + u, j*sw + f - pw), zero
    # outside the image; offs (C*R*S,) <- tap (c, r, s)'s first value in the planes, at
    # output row p0 (a later row p: (p - p0) * sh * Wh further)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    Hs, Wh = planes.shape[2], planes.shape[3]
    for c in range(C):
        for r in range(R):
            for s in range(S):
                offs[(c * R + r) * S + s] = ((s * dw % sw * C + c) * Hs + r * dh) * Wh + \
                    s * dw // sw
    nrows = (p1 - p0 - 1) * sh + (R - 1) * dh + 1
    for f in range(sw):
        _plane_chw_step((x, x, False, (n, p0 * sh, nrows), (1, 0, sw, f), (ph, pw), Wh,
                         planes[f].reshape((C, Hs * Wh))))


@task_kernel
def gather_tasks(t0, t1, x, wm, b, flags, geo, sizes, y):
    has_bias, relu, wide = flags
    rpc, Hs, Wh = sizes
    # x (N, C, H, W); wm (K, C*R*S) (w as it is); b (K,); y (N, K, P, Q); task t: output
    # rows [p0, p0 + rpc) of image t // blocks, over _phase_planes' planes (sw, C, Hs, Wh)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    CRS = C * R * S
    nblk = (P + rpc - 1) // rpc
    planes = np.empty((sw, C, Hs, Wh), np.float32)
    offs = np.empty(CRS, np.int64)
    rows = np.empty(CRS, np.int64)
    base = np.int64(planes.ctypes.data)
    for t in range(t0, t1):
        n = t // nblk
        p0 = (t - n * nblk) * rpc
        p1 = min(P, p0 + rpc)
        _phase_planes(x, n, p0, p1, geo, planes, offs)
        for p in range(p0, p1):
            a0 = base + 4 * (p - p0) * sh * Wh
            for i in range(CRS):
                rows[i] = a0 + 4 * offs[i]
            _taps.gather_step((np.int64(K), np.int64(Q), np.int64(CRS),
                               np.int64(wm.ctypes.data), np.int64(CRS),
                               np.int64(rows.ctypes.data), np.int64(0),
                               np.int64(y[n, 0, p].ctypes.data), np.int64(P * Q),
                               np.int64(0), np.int64(1 if wide else 0)))
            if has_bias or relu:                        # in place, while the row is in cache
                for k in range(K):
                    o = y[n, k, p]
                    bk = b[k] if has_bias else 0
                    for q in range(Q):
                        v = o[q] + bk
                        o[q] = _relu(v) if relu else v


@task_kernel
def gather_dw_tasks(t0, t1, x, gy, y, use_mask, geo, sizes, need_dw, parts):
    rpc, Hs, Wh, sub, wide = sizes
    dw_parts, db_parts = parts
    # x (N, C, H, W); gy, y (N, K, PQ); task t (rows [p0, p1) of image t // blocks):
    # dw_parts[t] (C*R*S, K) = dW^T of its pixels, ``gemm_taps`` with the taps (c, r, s) as
    # c's rows (a tap's values along an output row: _phase_planes' row) and the output rows
    # as its taps, summed over each row's Q pixels against g (m, K), in products of ``sub``
    # rows (DW_ROWS_BYTES of g; each summed, then added in row order); db_parts[t] (K,)
    # float64 its sums of g = gy * (y > 0) (cpu_chunks.gated_chw's order)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    CRS = C * R * S
    nblk = (P + rpc - 1) // rpc
    planes = np.empty((sw, C, Hs, Wh) if need_dw else (0, 0, 0, 0), np.float32)
    offs = np.empty(CRS, np.int64)
    rows = np.empty(CRS, np.int64)
    aoff = np.empty(rpc, np.int64)
    gt = np.empty((K, rpc * Q), np.float32)                        # g^T (K, m)
    g = np.empty((rpc * Q if need_dw else 0, K), np.float32)        # g (m, K)
    cbuf = np.empty((CRS if need_dw else 0, K), np.float32)
    base = np.int64(planes.ctypes.data)
    for t in range(t0, t1):
        n = t // nblk
        p0 = (t - n * nblk) * rpc
        p1 = min(P, p0 + rpc)
        m = (p1 - p0) * Q
        dbp = db_parts[t]
        dbp[:] = 0.0
        gated_chw(gy, y, use_mask, n, p0, p1, P * Q, Q, gt, 0, dbp)
        if not need_dw:
            continue
        transpose(gt[:, :m], g[:m])
        _phase_planes(x, n, p0, p1, geo, planes, offs)
        for i in range(CRS):
            rows[i] = base + 4 * offs[i]
        for j in range(p1 - p0):
            aoff[j] = j * sh * Wh
        part = dw_parts[t]                                          # (CRS, K)
        for j0 in range(0, p1 - p0, sub):           # g's rows read from L2 by every tap block
            j1 = min(p1 - p0, j0 + sub)
            c = part if j0 == 0 else cbuf
            _taps.taps_step(((np.int64(CRS), np.int64(K), np.int64(Q)), np.int64(j1 - j0),
                            np.int64(rows.ctypes.data), np.int64(aoff[j0:].ctypes.data),
                            np.int64(g[j0 * Q:].ctypes.data), np.int64(K),
                            np.int64(c.ctypes.data), np.int64(K), np.int64(0), np.int64(0),
                            np.int64(wide)))
            if j0 > 0:
                for i in range(CRS):
                    pr, cr = part[i], cbuf[i]
                    for k in range(K):
                        pr[k] += cr[k]


@task_kernel
def implicit_tasks(t0, t1, x, wt, aoff, b, flags, geo, sizes, y):
    has_bias, relu, wide = flags
    ipc, rpc, Hmax, Ws, kt, ntaps = sizes
    # x: (N, C, H, W) | (N, H, W, C); wt: (R*S, C, K) float32, read as (ntaps, kt, K); aoff:
    # (ntaps,) int64 (row_taps: kt, ntaps); y: (N, K, PQ) | (N, PQ, K); Hmax: slab rows of
    # the tallest chunk; the chunks [t0, t1)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    PQ = P * Q
    mmax = ipc * PQ if ipc > 1 else rpc * Q
    slab = np.empty((ipc, Hmax, Ws, C), np.float32)
    rows = np.empty(mmax, np.int64)                   # each output pixel's slab address
    ybuf = np.empty((0 if nhwc else mmax) * K, np.float32)
    for t in range(t0, t1):
        n0, n1, p0, p1 = chunk(t, N, P, ipc, rpc)
        per = (p1 - p0) * Q
        m = (n1 - n0) * per
        _fill_step((x, n0, n1, p0, p1, geo, Hmax, Ws, slab, rows))
        if nhwc:
            yc = y.reshape((N * PQ, K))[n0 * PQ + p0 * Q:]            # m rows from here
            pc = np.int64(yc.ctypes.data)
        else:
            pc = np.int64(ybuf.ctypes.data)
        _taps.taps_step(((np.int64(m), np.int64(K), np.int64(kt)), np.int64(ntaps),
                        np.int64(rows.ctypes.data), np.int64(aoff.ctypes.data),
                        np.int64(wt.ctypes.data), np.int64(K), pc, np.int64(K),
                        np.int64(b.ctypes.data) if has_bias else np.int64(0),
                        np.int64(1 if relu else 0), np.int64(1 if wide else 0)))
        if not nhwc:
            yb = ybuf[:m * K].reshape((m, K))
            for i in range(n1 - n0):
                transpose(yb[i * per:(i + 1) * per], y[n0 + i, :, p0 * Q:p1 * Q])


@task_kernel
def implicit_dw_tasks(t0, t1, x, gy, y, use_mask, geo, sizes, flags, aoff, parts):
    ipc, rpc, nchunks, groups, Hmax, Ws = sizes
    need_dw, wide = flags
    dw_parts, db_parts = parts
    # gy, y: (N, K, PQ) | (N, PQ, K); dw_parts: (groups, R*S, K, C) <- each group's dW_rs
    # (K, C) = sum over its chunks of g^T (K, m) @ (the m pixels' tap-rs rows of the slab);
    # db_parts: (groups, K) float64 <- its sums of g (as cpu_im2col's dW: the same helpers).
    # (Taps of S*C values, as the forward's, made no difference on machine F: the same bits,
    # 0.9-1.1x at ResNet's 3x3/2 and 1x1/2 shapes, both layouts)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    PQ = P * Q
    mmax = ipc * PQ if ipc > 1 else rpc * Q
    slab = np.empty((ipc if need_dw else 0, Hmax, Ws, C), np.float32)
    rows = np.empty(mmax, np.int64)
    gbuf = np.empty(mmax * K, np.float32)             # g: (m, K) NHWC | (K, m) NCHW
    gtbuf = np.empty(mmax * K if nhwc and need_dw else 0, np.float32)   # NHWC's g^T
    for grp in range(t0, t1):
        dbp = db_parts[grp]                                       # (K,)
        dbp[:] = 0.0
        beta = 0
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n0, n1, p0, p1 = chunk(t, N, P, ipc, rpc)
            m = (n1 - n0) * (p1 - p0) * Q
            _gated_chunk_step((gy, y, use_mask, n0, n1, p0, p1, geo, need_dw, gbuf, gtbuf, dbp))
            if not need_dw:
                continue
            gt = (gtbuf if nhwc else gbuf)[:K * m].reshape((K, m))
            _fill_step((x, n0, n1, p0, p1, geo, Hmax, Ws, slab, rows))
            for tap in range(R * S):
                _taps.gather_step((np.int64(K), np.int64(C), np.int64(m),
                                  np.int64(gt.ctypes.data), np.int64(m),
                                  np.int64(rows.ctypes.data), aoff[tap],
                                  np.int64(dw_parts[grp, tap].ctypes.data), np.int64(C),
                                  np.int64(beta), np.int64(1 if wide else 0)))
            beta = 1
