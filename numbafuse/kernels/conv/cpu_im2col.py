r"""CPU convolution tasks over im2col chunks (convolutions with few channels, where one GEMM
with the inner dimension C*R*S beats R*S GEMMs with inner dimension C), and the helpers every
CPU conv module shares: chunking, masked gradients (``_g_*``), ``sum64``. See ``cpu.py``.

Notation: PQ = P*Q, RSC = R*S*C, m = pixels of one chunk. A chunk is a block of output rows
of one image, or several whole images when an image is small (``cpu._chunking``), so that its
im2col matrix is about ``CHUNK_BYTES`` (it stays in one core's L2 while its GEMM reads it). The
GEMM orientation follows the layout, so that y, g and dx need no transposes:

    NCHW  cols (RSC, m), rows (c, r, s)      ybuf (K, m)  = w (K, C*R*S) @ cols
    NHWC  cols (m, RSC), columns (r, s, c)   ybuf (m, K)  = cols @ wm^T,  wm (K, R*S*C)

Backward, from ``gy`` and (fused op) the output ``y``, whose sign is the ReLU mask:

    dW and db: a group of chunks (``DW_GROUPS``) is one task, which for each of its chunks
        gathers g = gy * (y > 0) (db += sum g, float64) and accumulates dW_group += g @ cols.
    dX: a convolution of g split by *phase* (input rows h = a + sh*i, columns w = b + sw*j):
        the taps r with (a + ph - r*dh) % sh == 0 read output row p = i + (a + ph - r*dh) // sh,
        so each phase is a dense GEMM over its own taps (T of them):

    NCHW  gcols (T*K, m) rows (k, r, s)   dxbuf (C, m) = w'_phase (C, T*K) @ gcols
    NHWC  gcols (m, T*K) cols (r, s, k)   dxbuf (m, C) = gcols @ w'_phase (T*K, C)

    where w'[c, (k, r, s)] = w[k, c, r, s]. Every dx element is written by exactly one task.
"""
import numpy as np
from numba import njit, types

from ..cpu import blas as _blas
from ..cpu.launch import task_kernel
from ..cpu.steps import Step, array as _arr, ready as _ready_steps
from ..cpu.transpose import ROWS as _ROWS, transpose
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from . import math as conv_math
from .cpu_chunks import block_len, chunk

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)
_input_coord = cpu_scalar(conv_math.input_coord)
_valid_range = cpu_scalar(conv_math.valid_range)


@njit(inline="always")
def _is_pointwise(geo):
    # a 1x1, stride-1, unpadded conv (the cols are x's pixels in order; P, Q = H, W)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    return R == 1 and S == 1 and sh == 1 and sw == 1 and ph == 0 and pw == 0 and P == H and Q == W


# --------------------------------------------------------------------------- gathers

@njit(inline="always")
def _shifted_rows(src, src0, mask, use_mask, rows, width, shift, dst):
    # dst (rows*width,) <- rows of ``width`` read from the flat plane ``src`` starting at src0
    # (rows ``width`` apart in src as in dst), each shifted by ``shift`` columns; what falls
    # outside the plane or across a row's edge is 0. One long copy, then the edge columns:
    # the stride-1 "same" case, where a chunk's rows are contiguous in x and in cols. With
    # use_mask, dst = src where mask > 0 (the ReLU gate read from y).
    L = rows * width
    first = src0 + shift
    lo = min(L, max(0, -first))
    hi = max(lo, min(L, src.shape[0] - first))
    for i in range(lo):
        dst[i] = 0
    # 0-based loops over views: Numba then knows the indices are non-negative and LLVM
    # vectorises the copy (an index like first + i keeps a wraparound check per element)
    d = dst[lo:hi]
    sv = src[first + lo:first + hi]
    if use_mask:
        mv = mask[first + lo:first + hi]
        for i in range(hi - lo):
            d[i] = _relu_grad(sv[i], mv[i])
    else:
        for i in range(hi - lo):
            d[i] = sv[i]
    for i in range(hi, L):
        dst[i] = 0
    if shift < 0:
        for row in range(rows):
            for q in range(min(-shift, width)):
                dst[row * width + q] = 0
    elif shift > 0:
        for row in range(rows):
            for q in range(max(0, width - shift), width):
                dst[row * width + q] = 0


@njit(nogil=True, cache=True)
def _im2col_chw(x, n, p0, p1, geo, cols, col0):
    # x: (N, C, H, W); cols: (C*R*S, ld), rows (c, r, s); output pixels (p, q) of image n,
    # p0 <= p < p1, go to columns col0 + (p - p0)*Q + q
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    fast = sh == 1 and sw == 1 and Q == W                      # rows contiguous in x and cols
    # strided: each channel's input rows that the chunk reads first split by phase (rows h =
    # a + sh*i, columns w = b + sw*j: plane (a, b)), so that every tap reads a plane's row
    # contiguously: tap (r, s) reads plane a = (r*dh - ph) % sh at row p + (r*dh - ph - a) //
    # sh, columns from (s*dw - pw - b) // sw, b = (s*dw - pw) % sw. (Stride 1: x's rows
    # themselves.) The strided gather of single values had taken 1.75 of a ResNet stem's
    # (7x7/2, 3 -> 64, batch 16, 64x64) dW's 2.0 ms on one thread
    split = sh > 1 or sw > 1
    h0 = min(max(0, p0 * sh - ph), H)                       # the input rows the chunk reads
    h1 = max(h0, min(H, (p1 - 1) * sh - ph + (R - 1) * dh + 1))
    i0 = h0 // sh
    Hs = (h1 - 1) // sh - i0 + 1 if h1 > h0 and split else 0
    planes = np.empty((sh, sw, Hs, -(-W // sw)), x.dtype)
    for c in range(C):
        plane = x[n, c]                                           # (H, W)
        flat = plane.reshape(H * W)                               # (H*W,)
        for h in range(h0, h1 if split else h0):
            src, i = plane[h], h // sh - i0
            for b in range(sw):
                dst = planes[h % sh, b, i]
                for j in range((W - b + sw - 1) // sw):
                    dst[j] = src[j * sw + b]
        for r in range(R):
            plo, phi = _valid_range(r, sh, ph, dh, H, P)          # rows inside the image
            plo = min(max(plo, p0), p1)                           # clamped to the chunk
            phi = max(min(phi, p1), plo)
            a = (r * dh - ph) % sh
            for s in range(S):
                row = cols[(c * R + r) * S + s]                   # (ld,)
                blk = row[col0:col0 + (p1 - p0) * Q]              # ((p1-p0)*Q,)
                for i in range(0, (plo - p0) * Q):                # rows in the padding
                    blk[i] = 0
                for i in range((phi - p0) * Q, (p1 - p0) * Q):
                    blk[i] = 0
                if phi <= plo:
                    continue
                if fast:
                    h0_ = _input_coord(plo, r, sh, ph, dh)
                    _shifted_rows(flat, h0_ * W, flat, False, phi - plo, Q, s * dw - pw,
                                  blk[(plo - p0) * Q:(phi - p0) * Q])
                    continue
                lo, hi = _valid_range(s, sw, pw, dw, W, Q)
                lo, hi = min(lo, Q), max(min(hi, Q), min(lo, Q))
                b = (s * dw - pw) % sw
                off = (s * dw - pw - b) // sw                     # source column of q = 0
                for p in range(plo, phi):
                    src = (planes[a, b, p + (r * dh - ph - a) // sh - i0] if split
                           else plane[_input_coord(p, r, sh, ph, dh)])
                    dst = blk[(p - p0) * Q:(p - p0 + 1) * Q]      # (Q,)
                    for q in range(lo):
                        dst[q] = 0
                    sv = src[lo + off:hi + off]
                    dv = dst[lo:hi]
                    for q in range(hi - lo):
                        dv[q] = sv[q]
                    for q in range(hi, Q):
                        dst[q] = 0


@njit(nogil=True, cache=True)
def _im2col_hwc(x, n, p0, p1, geo, cols, row0):
    # x: (N, H, W, C); cols: (rows, R*S*C), columns (r, s, c); output pixel (p, q) of image
    # n, p0 <= p < p1, goes to row row0 + (p - p0)*Q + q
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    for p in range(p0, p1):
        for q in range(Q):
            dst = cols[row0 + (p - p0) * Q + q]                   # (R*S*C,)
            for r in range(R):
                h = _input_coord(p, r, sh, ph, dh)
                for s in range(S):
                    wi = _input_coord(q, s, sw, pw, dw)
                    c0 = (r * S + s) * C
                    if h < 0 or h >= H or wi < 0 or wi >= W:
                        for c in range(C):
                            dst[c0 + c] = 0
                    else:
                        src = x[n, h, wi]                         # (C,)
                        for c in range(C):
                            dst[c0 + c] = src[c]


# --------------------------------------------------------------------------- forward

@njit(inline="always")
def _slab_rows(p0, p1, geo):
    # [h0, h1): the input rows that output rows [p0, p1) read (clipped to the image)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    return max(0, p0 * sh - ph), min(H, (p1 - 1) * sh - ph + (R - 1) * dh + 1)


@njit(inline="always")
def _slab_hwc(x, n, h0, h1, slab):
    # slab (h1 - h0, W, C) <- rows [h0, h1) of x[n] (C, H, W), transposed: an NCHW chunk's
    # input in NHWC order, so the gather copies whole channel vectors (it stays in cache)
    for h in range(h0, h1):
        transpose(x[n, :, h], slab[h - h0])                       # (C, W) -> (W, C)


@njit(inline="always")
def slab_buffer(x, geo, ipc, rpc, slab):
    # the (rows, W, C) slab of one image's input rows that a chunk reads (empty without slab)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    rows = min(H, ((P if ipc > 1 else rpc) - 1) * sh + (R - 1) * dh + 1)
    return np.empty(rows * W * C if slab else 0, x.dtype)


@njit(nogil=True, cache=True)
def _im2col_slab(x, n0, n1, p0, p1, geo, sbuf, cols, per):
    # cols (m, R*S*C), columns (r, s, c) as _im2col_hwc's, of NCHW x's images [n0, n1),
    # output rows [p0, p1): each image's input rows go through the slab first
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    h0, h1 = _slab_rows(p0, p1, geo)
    rows = max(0, h1 - h0)
    sv = sbuf[:rows * W * C].reshape((1, rows, W, C))             # (1, rows, W, C)
    # the slab's geometry: one NHWC image of `rows` rows whose row 0 is input row h0
    geo_s = (1, C, rows, W, K, R, S, P, Q, sh, sw, ph + h0, pw, dh, dw, 1)
    for n in range(n0, n1):
        _slab_hwc(x, n, h0, h0 + rows, sv[0])
        _im2col_hwc_step((sv, np.int64(0), p0, p1, geo_s, cols, (n - n0) * per))


# The gathers as steps called through slots (kernels/cpu/steps.py): compiled once, not again
# inside each task kernel below. Signatures per float type f (geo: 16 int64).
_I, _GEO = types.int64, types.UniTuple(types.int64, 16)
IM2COL_CHW = Step(_im2col_chw.py_func, lambda f: [(_arr(f, 4), _I, _I, _I, _GEO, _arr(f, 2), _I)])
IM2COL_HWC = Step(_im2col_hwc.py_func, lambda f: [(_arr(f, 4), _I, _I, _I, _GEO, _arr(f, 2), _I)])
IM2COL_SLAB = Step(_im2col_slab.py_func, lambda f: [
    (_arr(f, 4), _I, _I, _I, _I, _GEO, _arr(f, 1), _arr(f, 2), _I)], calls=(IM2COL_HWC,))
_im2col_chw_step, _im2col_hwc_step = IM2COL_CHW.call, IM2COL_HWC.call
_im2col_slab_step, _rows_step = IM2COL_SLAB.call, _ROWS.call


def ready(dtype, nhwc=None, slab=False):
    """The gathers compiled for ``dtype`` and their slots filled: host code calls this before
    it launches cpu_im2col_fwd's or cpu_im2col_dw's tasks or cols_tasks. Only the
    layout's gather (``nhwc``; NCHW: the slab's, or the strided one): the kernels' code calls
    every gather's slot, but a call reaches only its layout's. ``nhwc`` None: all three."""
    if nhwc is None:
        steps = (IM2COL_CHW, IM2COL_HWC, IM2COL_SLAB)
    else:
        steps = (IM2COL_HWC,) if nhwc else (IM2COL_SLAB,) if slab else (IM2COL_CHW,)
    _ready_steps(dtype, steps)


def ready_reorder(dtype):
    """``cpu.transpose.ROWS`` ready (the k blocks' reordering of w or dW): host code calls
    this before a launch that reorders (a first call that needs none does not compile it)."""
    _ready_steps(dtype, (_ROWS,))


@task_kernel
def cols_tasks(t0, t1, x, geo, orient, cols):
    # The whole batch's cols, once, for the k-blocked forward and dW (each of whose tasks
    # then reads them): task t image t. orient 0: NHWC x, cols (M, R*S*C); 1: NCHW x through
    # its HWC slab, cols (M, R*S*C); 2: NCHW x, cols (C*R*S, M); M = N*P*Q.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    RSC = R * S * C
    PQ = P * Q
    M = N * PQ
    sbuf = slab_buffer(x, geo, N, P, orient == 1)
    pointwise = _is_pointwise(geo)
    for n in range(t0, t1):
        if orient == 2 and pointwise:          # 1x1: each channel's plane, whole, in order
            xf, c2 = x.reshape((N, C, PQ)), cols.reshape((C, M))
            for c in range(C):
                src, dst = xf[n, c], c2[c, n * PQ:(n + 1) * PQ]
                for i in range(PQ):
                    dst[i] = src[i]
        elif orient == 2:
            _im2col_chw_step((x, n, 0, P, geo, cols.reshape((RSC, M)), n * PQ))
        elif orient == 1:
            _im2col_slab_step((x, n, n + 1, 0, P, geo, sbuf,
                               cols.reshape((M, RSC))[n * PQ:(n + 1) * PQ], PQ))
        else:
            _im2col_hwc_step((x, n, 0, P, geo, cols.reshape((M, RSC)), n * PQ))


# --------------------------------------------------------------------------- backward: dX

@task_kernel
def dx_block_tasks(t0, t1, gy, y, use_mask, wmat, geo, cb, blas, dx):
    # dX of the whole batch split by input channels (deep layers: few pixels, many weights):
    # task t the channels [c0, c1) (block t of cb, a multiple of 16): dcols (cn*R*S, M) =
    # wmat[:, c0*RS:c1*RS]^T (K, cn*RS)^T @ g (K, M), g = gy (* (y > 0)) of the batch's M =
    # N*P*Q output pixels as columns, then each column (c, r, s) of a pixel added into dx
    # at its input pixel (col2im), the taps in (r, s) order: every dx value is one task's, in
    # a fixed order. wmat: w as (K, C*R*S). gy, y: (N, K, P, Q) | (N, P, Q, K); dx: (N, C,
    # H, W) | (N, H, W, C), written here (zeros where no tap reaches).
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    RS = R * S
    PQ = P * Q
    M = N * PQ
    pointwise = _is_pointwise(geo)
    cb_len = block_len(C, cb)
    g = np.empty((K, M), dx.dtype)                                # gated, pixels as columns
    dcols = np.empty(min(C, cb_len) * RS * M, dx.dtype)
    for t in range(t0, t1):
        c0 = t * cb_len
        c1 = min(C, c0 + cb_len)
        cn = c1 - c0
        if cn <= 0:
            continue
        if t == t0:                 # each task range gathers g once (it is the same for all)
            for n in range(N):
                if nhwc:
                    for p in range(P):
                        for q in range(Q):
                            i = n * PQ + p * Q + q
                            gr, yr = gy[n, p, q], y[n, p, q]              # (K,) each
                            for k in range(K):
                                g[k, i] = _relu_grad(gr[k], yr[k]) if use_mask else gr[k]
                else:               # (indices, not a view per channel: few pixels each)
                    for k in range(K):
                        for p in range(P):
                            for q in range(Q):
                                v = gy[n, k, p, q]
                                g[k, n * PQ + p * Q + q] = (_relu_grad(v, y[n, k, p, q])
                                                            if use_mask else v)
        d2 = dcols[:cn * RS * M].reshape((cn * RS, M))
        # dcols (cn*RS, M) = wmat[:, block]^T @ g
        _blas.gemm(blas, True, False, (cn * RS, M, K), 1.0, wmat[:, c0 * RS:], C * RS, g, M,
                   0.0, d2, M)
        if pointwise:               # 1x1, stride 1, unpadded: dcols is dx, pixels in order
            for n in range(N):
                for c in range(c0, c1):
                    src = d2[c - c0, n * PQ:(n + 1) * PQ]
                    for h in range(H):
                        for x_ in range(W):
                            if nhwc:
                                dx[n, h, x_, c] = src[h * W + x_]
                            else:
                                dx[n, c, h, x_] = src[h * W + x_]
            continue
        for n in range(N):
            if nhwc:                                              # this block's channels
                for h in range(H):
                    for x_ in range(W):
                        dx[n, h, x_, c0:c1] = 0
            else:
                for c in range(c0, c1):
                    dxc = dx[n, c]                                # (H, W)
                    for h in range(H):
                        for x_ in range(W):
                            dxc[h, x_] = 0
            for c in range(c0, c1):
                for r in range(R):
                    for s_ in range(S):
                        row = d2[(c - c0) * RS + r * S + s_, n * PQ:(n + 1) * PQ]
                        for p in range(P):
                            h = _input_coord(p, r, sh, ph, dh)
                            if h < 0 or h >= H:
                                continue
                            for q in range(Q):
                                x_ = _input_coord(q, s_, sw, pw, dw)
                                if x_ < 0 or x_ >= W:
                                    continue
                                if nhwc:
                                    dx[n, h, x_, c] += row[p * Q + q]
                                else:
                                    dx[n, c, h, x_] += row[p * Q + q]


@njit(nogil=True, cache=True)
def _gcols_chw(gy, y, use_mask, span, taps, gc):
    n, i0, i1, Wb, P, Q, col0 = span
    taps_r, off_r, taps_s, off_s = taps
    # gy, y: (N, K, P, Q); gc: (K*T, ld), rows (k, r, s) over the phase's taps; input pixels
    # (i, j) of the phase, i0 <= i < i1, j < Wb, go to columns col0 + (i - i0)*Wb + j;
    # gc = g at output pixel (i + off_r, j + off_s), 0 outside, gated by y > 0
    K = gy.shape[1]
    nr, ns = taps_r.shape[0], taps_s.shape[0]
    fast = Wb == Q                                                # rows contiguous in g and gc
    for k in range(K):
        gyf = gy[n, k].reshape(P * Q)                             # (P*Q,)
        yf = y[n, k].reshape(P * Q)
        for a in range(nr):
            ilo = min(max(i0, -off_r[a]), i1)                     # rows i with 0 <= i+off < P
            ihi = max(min(i1, P - off_r[a]), ilo)
            for bb in range(ns):
                blk = gc[(k * nr + a) * ns + bb, col0:col0 + (i1 - i0) * Wb]   # ((i1-i0)*Wb,)
                for t in range(0, (ilo - i0) * Wb):
                    blk[t] = 0
                for t in range((ihi - i0) * Wb, (i1 - i0) * Wb):
                    blk[t] = 0
                if ihi <= ilo:
                    continue
                os_ = off_s[bb]
                if fast:
                    _shifted_rows(gyf, (ilo + off_r[a]) * Q, yf, use_mask, ihi - ilo, Wb, os_,
                                  blk[(ilo - i0) * Wb:(ihi - i0) * Wb])
                    continue
                lo = min(max(0, -os_), Wb)                        # j with 0 <= j + os_ < Q
                hi = max(min(Wb, Q - os_), lo)
                for i in range(ilo, ihi):
                    p = i + off_r[a]
                    dst = blk[(i - i0) * Wb:(i - i0 + 1) * Wb]    # (Wb,)
                    gyr, yr = gy[n, k, p], y[n, k, p]             # (Q,) each
                    for j in range(lo):
                        dst[j] = 0
                    if use_mask:
                        for j in range(lo, hi):
                            dst[j] = _relu_grad(gyr[j + os_], yr[j + os_])
                    else:
                        for j in range(lo, hi):
                            dst[j] = gyr[j + os_]
                    for j in range(hi, Wb):
                        dst[j] = 0


@njit(nogil=True, cache=True)
def _gcols_hwc(gy, y, use_mask, span, taps, gc):
    n, i0, i1, Wb, P, Q, row0 = span
    taps_r, off_r, taps_s, off_s = taps
    # gy, y: (N, P, Q, K); gc: (rows, T*K), columns (r, s, k); input pixel (i, j) of the phase
    # goes to row row0 + (i - i0)*Wb + j
    K = gy.shape[3]
    nr, ns = taps_r.shape[0], taps_s.shape[0]
    for i in range(i0, i1):
        for j in range(Wb):
            dst = gc[row0 + (i - i0) * Wb + j]                    # (T*K,)
            for a in range(nr):
                p = i + off_r[a]
                for bb in range(ns):
                    q = j + off_s[bb]
                    c0 = (a * ns + bb) * K
                    if p < 0 or p >= P or q < 0 or q >= Q:
                        for k in range(K):
                            dst[c0 + k] = 0
                    else:
                        gyr, yr = gy[n, p, q], y[n, p, q]         # (K,) each
                        for k in range(K):
                            dst[c0 + k] = _relu_grad(gyr[k], yr[k]) if use_mask else gyr[k]


@task_kernel
def dx_tasks(t0, t1, gy, y, use_mask, geo, chunks, taps, weights, blas, dx):
    ipc, rpc, chunks_per_phase, rows_max = chunks
    taps_r, off_r, nr, taps_s, off_s, ns = taps
    wphase, woff = weights
    # gy, y: (N, K, P, Q) | (N, P, Q, K); task t = (phase, chunk of that phase's input rows);
    # taps_r/off_r: (sh, R) the row taps of each row phase and their output-row offsets (nr[a]
    # valid), likewise taps_s/off_s/ns for columns; wphase: flat, phase f's w' at woff[f]
    # (NCHW (C, T*K), NHWC (T*K, C)); dx: (N, C, H, W) | (N, H, W, C), every element written once
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    mmax = ipc * rows_max * ((W + sw - 1) // sw) if ipc > 1 else \
        rpc * ((W + sw - 1) // sw)
    gcol = np.empty(mmax * R * S * K, dx.dtype)
    dbuf = np.empty(mmax * C, dx.dtype)
    for t in range(t0, t1):
        f = t // chunks_per_phase                                 # phase (a, bph)
        a = f // sw
        bph = f - a * sw
        Ha = (H - a + sh - 1) // sh                               # input rows of the phase
        Wb = (W - bph + sw - 1) // sw
        if Ha <= 0 or Wb <= 0:
            continue
        tc = t - f * chunks_per_phase
        if ipc > 1:
            if tc * ipc >= N:
                continue
        elif tc >= N * ((Ha + rpc - 1) // rpc):
            continue
        n0, n1, i0, i1 = chunk(tc, N, Ha, ipc, rpc)
        per = (i1 - i0) * Wb
        m = (n1 - n0) * per
        T = nr[a] * ns[bph]
        tr, orr = taps_r[a, :nr[a]], off_r[a, :nr[a]]
        ts, os_ = taps_s[bph, :ns[bph]], off_s[bph, :ns[bph]]
        if nhwc:
            d = dbuf[:m * C].reshape((m, C))                      # (m, C)
            if T == 0:
                d[:] = 0
            else:
                gc = gcol[:m * T * K].reshape((m, T * K))         # (m, T*K)
                for n in range(n0, n1):
                    _gcols_hwc(gy, y, use_mask, (n, i0, i1, Wb, P, Q, (n - n0) * per),
                               (tr, orr, ts, os_), gc)
                wp = wphase[woff[f]:woff[f] + T * K * C]          # (T*K, C) flat
                _blas.gemm(blas, False, False, (m, C, T * K), 1.0, gc, T * K, wp, C, 0.0, d, C)
            for n in range(n0, n1):
                for i in range(i0, i1):
                    h = a + i * sh
                    for j in range(Wb):
                        src = d[(n - n0) * per + (i - i0) * Wb + j]   # (C,)
                        dst = dx[n, h, bph + j * sw]
                        for c in range(C):
                            dst[c] = src[c]
        else:
            d = dbuf[:C * m].reshape((C, m))                      # (C, m)
            if T == 0:
                d[:] = 0
            else:
                gc = gcol[:T * K * m].reshape((T * K, m))         # (K*T, m)
                for n in range(n0, n1):
                    _gcols_chw(gy, y, use_mask, (n, i0, i1, Wb, P, Q, (n - n0) * per),
                               (tr, orr, ts, os_), gc)
                wp = wphase[woff[f]:woff[f] + C * T * K]          # (C, K*T) flat
                _blas.gemm(blas, False, False, (C, m, T * K), 1.0, wp, T * K, gc, m, 0.0, d, m)
            for n in range(n0, n1):
                for c in range(C):
                    src = d[c, (n - n0) * per:(n - n0 + 1) * per]  # (per,)
                    plane = dx[n, c]                              # (H, W)
                    for i in range(i0, i1):
                        dst = plane[a + i * sh]                   # (W,)
                        s = src[(i - i0) * Wb:(i - i0 + 1) * Wb]
                        if sw == 1:
                            for j in range(Wb):
                                dst[j] = s[j]
                        else:
                            for j in range(Wb):
                                dst[bph + j * sw] = s[j]


