r"""The forward of a convolution over a small map, a GEMM per tap over only the outputs the
tap reaches: no products with the zero padding.

On a 2x2 map with a 3x3 kernel and padding 1 each output reads 4 of its 9 taps inside the
input; on 4x4, 100 of 144 (69%). im2col multiplies the padding's zeros as well: at ResNet's
deepest layers (3x3, 512 channels, 2x2 maps at a 64x64 input) more than half of the GEMM's
products are with zeros. Here tap (r, s) reaches the outputs (p, q) whose input pixel
``(p*sh + r*dh - ph, q*sw + s*dw - pw)`` is inside the map, and only those:

    cols_t (m_t, C)    the input pixels tap t reads, one row per (image, output) it reaches
    acc[dst_t] += cols_t @ w_t^T          w_t (K, C) = w[:, :, r, s]

then y = relu?(acc * scale + b) in y's layout. ``cols`` holds every tap's rows, tap after
tap (gathered first, an image a task, from its NHWC rows: ``tables``, ``prep_tasks``); a
task is a block of output channels [k0, k1) (a multiple of 16, as the k-blocked im2col
forward's: ``cpu_chunks.block_len``) that reorders its own weights to (kn, R*S*C) first,
unless a cached reordering is given (``wmat`` then is it), so every weight is read once; the
tap's GEMM goes to a buffer whose rows are then added to the outputs' rows. The sums are
those of im2col without its zero products, in tap order (not bitwise im2col's: its GEMM sums
the taps inside one dot product).
"""
import functools

import numpy as np

from numba import njit

from ..cpu import blas as _blas
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import launch, task_kernel
from ..cpu.transpose import ROWS as _ROWS
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from . import weights as _weights
from .cpu_chunks import block_len
from .cpu_im2col import ready_reorder
from .cpu_im2col_fwd import block_weights
from .math import geo_tuple, k_view

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)
_rows_step = _ROWS.call


@functools.lru_cache(maxsize=256)
def tables(geo):
    """(offsets (R*S + 1,), src (T,), dst (T,)) for a ``math.geo_tuple``: tap t's rows of
    ``cols`` are [offsets[t], offsets[t + 1]); row i gathers the NHWC input pixel src[i]
    (``(n*H + h)*W + w``) and adds to the output pixel dst[i] (``(n*P + p)*Q + q``)."""
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    n = np.arange(N)[:, None, None]
    offsets, src, dst = [0], [], []
    for r in range(R):
        p = np.arange(P)
        h = p * sh + r * dh - ph
        p, h = p[(h >= 0) & (h < H)], h[(h >= 0) & (h < H)]
        for s in range(S):
            q = np.arange(Q)
            w = q * sw + s * dw - pw
            q, w = q[(w >= 0) & (w < W)], w[(w >= 0) & (w < W)]
            src.append(((n * H + h[None, :, None]) * W + w[None, None, :]).ravel())
            dst.append(((n * P + p[None, :, None]) * Q + q[None, None, :]).ravel())
            offsets.append(offsets[-1] + src[-1].size)
    return (np.array(offsets, np.int64), np.concatenate(src).astype(np.int64),
            np.concatenate(dst).astype(np.int64))


@njit(inline="always")
def _most_rows(offsets):
    """The most rows of one tap (``tables``' offsets)."""
    most = 0
    for t in range(offsets.shape[0] - 1):
        most = max(most, offsets[t + 1] - offsets[t])
    return most


@njit(inline="always")
def _sum_taps(acc, tmp, lhs, offsets, pix, wflat, first, tap, ldb, tb, inner, blas):
    """acc (M, n) = the sum over taps t of lhs's rows of t (m_t, inner) times t's weights,
    which start at wflat[first + t*tap], rows ``ldb`` apart: (n, inner) used transposed
    (``tb``) or (inner, n); each product's row i added into acc's row pix[i]. tmp: at
    least the most rows of a tap times n values. (``blas.gemm`` runs the products with b
    not transposed on gemm_taps' register tiles: dX's, and the forward's with tiles_forward.)"""
    n = acc.shape[1]
    acc[:] = 0
    for t in range(offsets.shape[0] - 1):
        r0, r1 = offsets[t], offsets[t + 1]
        m = r1 - r0
        if m == 0:
            continue
        part = tmp[:m * n].reshape((m, n))
        _blas.gemm(blas, False, tb, (m, n, inner), 1.0, lhs[r0:r1], inner,
                   wflat[first + t * tap:], ldb, 0.0, part, n)
        for i in range(m):
            row, add = acc[pix[r0 + i]], part[i]
            for c in range(n):
                row[c] += add[c]


@task_kernel
def forward_tasks(t0, t1, cols, wmat, bs, flags, dims, taps, blas, wdst, y):
    # cols (T, C); wmat: w as (K, C*R*S) (flags[2], wt: each task reorders its block to
    # (kn, R*S*C), into its rows of wdst (K, R*S*C) where given, else a buffer) or already
    # (K, R*S*C); bs = (b, scale, z), (K,) each and z shaped as y (a residual added before
    # the ReLU where has_z); flags = (has_bias, relu, wt, scaled, tiles, has_z);
    # dims = (N, C, K, RS, PQ, kb, nhwc); taps = (offsets, dst) of ``tables``; y (N, PQ, K)
    # NHWC or (N, K, PQ) NCHW. Task t: output channels [k0, k1), block t of kb.
    # With tiles (flags[4]: ``tiles_forward``) tap t's weights are read as (C, kn) rows, the
    # orientation blas.gemm runs on gemm_taps' register tiles: each task transposes its block
    # of w (kn, C*R*S) to (C*R*S, kn) (row c*RS + t), into its C*R*S*kb_len values of wdst
    # (kb*C*R*S, kb_len) from task*C*R*S*kb_len on where given (the weight cache's), else
    # into a buffer (wt: unless wdst has them).
    has_bias, relu, wt, scaled, tiles, has_z = flags
    b, scale, z = bs
    N, C, K, RS, PQ, kb, nhwc = dims
    offsets, dst = taps
    RSC = RS * C
    M = N * PQ
    kb_len = block_len(K, kb)
    acc = np.empty((M, min(K, kb_len)), y.dtype)
    tmp = np.empty(_most_rows(offsets) * min(K, kb_len), y.dtype)
    wbuf = np.empty(min(K, kb_len) * RSC if wt and wdst.shape[0] == 0 else 0, y.dtype)
    for task in range(t0, t1):
        k0 = task * kb_len
        k1 = min(K, k0 + kb_len)
        kn = k1 - k0
        if kn <= 0:
            continue
        a = acc[:, :kn]
        if tiles:                                    # (C*R*S, kn): tap t's (C, kn) rows
            at = task * RSC * kb_len if wdst.shape[0] > 0 else 0    # (its block's first)
            wtk = (wdst.reshape(wdst.size) if wdst.shape[0] > 0 else wbuf)[at:at + RSC * kn]
            wtk = wtk.reshape((RSC, kn))
            if wt:
                _rows_step((wmat[k0:k1].reshape((1, kn, RSC)), wtk.reshape((1, RSC, kn))))
            _sum_taps(a, tmp, cols, offsets, dst, wtk.reshape(RSC * kn), 0, kn, RS * kn, False,
                      C, blas)
        else:
            wk = block_weights(wmat, k0, k1, C, RS, wt, wdst, wbuf)  # (kn, R*S*C)
            _sum_taps(a, tmp, cols, offsets, dst, wk.reshape(kn * RSC), 0, C, RSC, True, C,
                      blas)
        for i in range(M):
            n, pq = i // PQ, i % PQ
            src = a[i]
            for k in range(kn):
                v = (src[k] * scale[k0 + k] if scaled else src[k]) + (b[k0 + k] if has_bias
                                                                      else 0)
                if has_z:
                    v += z[n, pq, k0 + k] if nhwc else z[n, k0 + k, pq]
                v = _relu(v) if relu else v
                if nhwc:
                    y[n, pq, k0 + k] = v
                else:
                    y[n, k0 + k, pq] = v


def forward(x, w, b, has_bias, scale, geom, relu, k_blocks, y, blas, work, z=None):
    """``y`` = relu?(conv(x, w) * scale? + b? + z?) tap by tap (``forward_tasks``), in
    ``k_blocks`` blocks of output channels; ``b`` (K,) (read where ``has_bias``); ``z``
    shaped as y (a residual) or None. The
    weights reordered to (K, R*S*C) come from the weight cache (kind "matrix", the im2col
    forward's) where it has them and go to it where it keeps them."""
    K, R, S = geom.K, geom.R, geom.S
    offsets, src, dst = tables(geo_tuple(geom))
    N, C, HW = geom.N, geom.C, geom.H * geom.W
    nhwc = geom.layout == "NHWC"
    cols = _out.empty((src.size, C), x.dtype)                    # each tap's input rows
    _ROWS.ready(x.dtype)
    x3 = np.ascontiguousarray(x).reshape((N, HW, C) if nhwc else (N, C, HW))
    none = np.empty((0, 1, 1), x.dtype)
    launch(prep_tasks, N, none, none, 0, x3, x3, False, bool(nhwc), offsets, src, cols,
           work=cols.size, grain=1)
    tiles = tiles_forward(geom, x.dtype)
    # the weights as the tasks read them: (K, R*S*C) (OpenBLAS), or blocks of (C*R*S, kb_len)
    # (the tiles; this many blocks: the cache keeps one array per kind)
    kind = f"tapwise_t{k_blocks}" if tiles else "matrix"
    rows = (k_blocks * C * R * S, block_len(K, k_blocks)) if tiles else (K, w[0].size)
    kept = _weights.peek(w, kind)
    wt = kept is None
    wdst = kept if not wt and tiles else np.empty(rows if wt and _weights.will_keep(w) else
                                                   (0, rows[1]), x.dtype)
    if wt or tiles:
        ready_reorder(x.dtype)
    PQ = geom.P * geom.Q
    launch(forward_tasks, k_blocks, cols, w.reshape(K, -1) if wt or tiles else kept,
           (b, b if scale is None else scale, np.empty((0, 0, 0), y.dtype) if z is None
            else k_view(z, geom)),
           (bool(has_bias), bool(relu), wt, scale is not None, tiles, z is not None),
           (geom.N, geom.C, K, R * S, PQ, k_blocks, int(nhwc)), (offsets, dst), blas, wdst,
           k_view(y, geom), work=work, grain=1)
    if wt and wdst.shape[0]:
        _weights.put(w, kind, wdst)
    return y


def tiles_forward(geom, dtype):
    """Whether :func:`forward` transposes each block of weights so that its products run on
    ``gemm_taps``' register tiles (``blas.gemm``'s route for b not transposed) instead of
    OpenBLAS's (m, C) @ (kn, C)^T: float32 and K a multiple of 8 (each block's columns).
    Measured: see docs/conv_bias_relu.md."""
    return np.dtype(dtype) == np.float32 and geom.K % 8 == 0


# --------------------------------------------------------------------------- dX by tap

@task_kernel
def prep_tasks(t0, t1, w3, wt3, kb, a3, b3, gate, nhwc, offsets, pix, out):
    # What the tap GEMMs read, made in parallel. Tasks [0, kb): blocks of filters of w3 (K, C,
    # RS) reordered into wt3 (K, RS, C) (dX; kb = 0: none). Task kb + n: image n's rows of out
    # (T, L): row i is pixel pix[i] (``tables``' src or dst: n*HW + its pixel) of a3 as (HW,
    # L) rows, a3 (N, L, HW) NCHW (transposed first, in cache) or (N, HW, L) NHWC; with gate,
    # a3 where b3 (shaped as a3: the ReLU's output) > 0, else 0. A tap's rows are image after
    # image (``tables``), so image n's are a block of each tap's.
    K = w3.shape[0]
    N = a3.shape[0]
    L = out.shape[1]
    HW = a3.shape[1] if nhwc else a3.shape[2]
    RS = offsets.shape[0] - 1
    rows = np.empty((0 if nhwc else HW) * L, a3.dtype)
    mask = np.empty((HW if gate and not nhwc else 0) * L, a3.dtype)
    for task in range(t0, t1):
        if task < kb:
            k_len = block_len(K, kb)
            k0 = task * k_len
            k1 = min(K, k0 + k_len)
            if k1 > k0:
                _rows_step((w3[k0:k1], wt3[k0:k1]))
            continue
        n = task - kb
        src = a3[n]
        gate_rows = b3[n]
        if not nhwc:                                   # (L, HW) -> (HW, L)
            src = rows.reshape((HW, L))
            _rows_step((a3[n:n + 1], rows.reshape((1, HW, L))))
            if gate:
                gate_rows = mask.reshape((HW, L))
                _rows_step((b3[n:n + 1], mask.reshape((1, HW, L))))
        for t in range(RS):
            per = (offsets[t + 1] - offsets[t]) // N
            for i in range(offsets[t] + n * per, offsets[t] + (n + 1) * per):
                # (by index, no view of each row: cpu_chunks.gated_hwc's note)
                j = pix[i] - n * HW
                if gate:
                    for c in range(L):
                        out[i, c] = _relu_grad(src[j, c], gate_rows[j, c])
                else:
                    for c in range(L):
                        out[i, c] = src[j, c]


@task_kernel
def dx_tasks(t0, t1, gcols, wmat, dims, taps, blas, dx):
    # dX by tap: dx[src_t] += gcols_t @ w_t, w_t (K, C) = w[:, :, r, s]: gcols (T, K) the
    # gated gradient's rows of each tap's outputs (``tables``' order), wmat w as (K, R*S*C);
    # dims = (N, C, K, RS, HW, cb, nhwc); taps = (offsets, src); dx (N, HW, C) NHWC or (N, C,
    # HW) NCHW. Task t: input channels [c0, c1), block t of cb; every dx value is one task's.
    N, C, K, RS, HW, cb, nhwc = dims
    offsets, src = taps
    M = N * HW
    RSC = RS * C
    cb_len = block_len(C, cb)
    cmax = min(C, cb_len)
    acc = np.empty((M, cmax), dx.dtype)
    tmp = np.empty(_most_rows(offsets) * cmax, dx.dtype)
    wflat = wmat.reshape(K * RSC)
    for task in range(t0, t1):
        c0 = task * cb_len
        c1 = min(C, c0 + cb_len)
        cn = c1 - c0
        if cn <= 0:
            continue
        a = acc[:, :cn]
        # w_t's (K, cn) block: columns c0.. of tap t's C in each filter's (R*S*C) row
        _sum_taps(a, tmp, gcols, offsets, src, wflat, c0, C, RSC, False, K, blas)
        for i in range(M):
            n, hw = i // HW, i % HW
            row = a[i]
            for c in range(cn):
                if nhwc:
                    dx[n, hw, c0 + c] = row[c]
                else:
                    dx[n, c0 + c, hw] = row[c]


def dx(gy, y, use_mask, w, geom, c_blocks, out, blas, work):
    """``out`` = dX of the convolution by tap (``dx_tasks``) in ``c_blocks`` blocks of input
    channels, from gy gated by y > 0 where ``use_mask``. One launch first makes what they
    read (``prep_tasks``): the weights as (K, R*S*C) (unless the weight cache has them: the
    forward's) and the gated gradient's rows of each tap."""
    N, K, C, R, S = geom.N, geom.K, geom.C, geom.R, geom.S
    PQ, RS = geom.P * geom.Q, R * S
    offsets, src, dst = tables(geo_tuple(geom))
    nhwc = geom.layout == "NHWC"
    kept = _weights.peek(w, "matrix")
    wmat = kept if kept is not None else _out.empty((K, RS * C), gy.dtype)
    kb = 0 if kept is not None else max(1, min(K // 16, 2 * c_blocks))
    gcols = _out.empty((dst.size, K), gy.dtype)
    _ROWS.ready(gy.dtype)
    def view(a):                                                  # (a C-contiguous copy if not)
        return np.ascontiguousarray(a).reshape((N, PQ, K) if nhwc else (N, K, PQ))
    launch(prep_tasks, kb + N, w.reshape(K, C, RS), wmat.reshape(K, RS, C), kb, view(gy),
           view(y), bool(use_mask), bool(nhwc), offsets, dst, gcols, work=work, grain=1)
    HW = geom.H * geom.W
    launch(dx_tasks, c_blocks, gcols, wmat, (N, C, K, RS, HW, c_blocks, int(nhwc)),
           (offsets, src), blas, out.reshape(N, HW, C) if nhwc else out.reshape(N, C, HW),
           work=work, grain=1)
    return out
