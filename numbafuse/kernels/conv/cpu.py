"""CPU convolution kernels: chunked im2col + tall-skinny BLAS GEMMs, fused epilogues.

Notation: N batch, C input channels, H/W input size, K filters, R/S filter size, P/Q output
size, PQ = P*Q, RSC = R*S*C, nb = images in one chunk, M = nb*PQ rows of a chunk.

Both layouts build the same cols matrix and use the same GEMM orientation - long M in the
rows of every operand, the shapes OpenBLAS's sgemm runs near peak on:

    cols (M, RSC)   rows (n, p, q), columns (r, s, c)      im2col of the chunk, channels last
    wm   (K, RSC)   w (K, C, R, S) permuted to (K, R, S, C)

Forward, per chunk of ``nb`` images (the cols buffer stays a few MiB, cache resident):

    NCHW:  xt = nchw_to_nhwc(x chunk);  cols = im2col_nhwc(xt)
           ymat (M, K) = cols @ wm^T                                      (one BLAS GEMM)
           y[n, k, :]  = relu(ymat[n*PQ:(n+1)*PQ, k] + b[k])   (epilogue: tiled transpose)
    NHWC:  cols = im2col_nhwc(x);  y rows (M, K) = cols @ wm^T     (GEMM straight into y)
           y rows = relu(y rows + b)                                   (epilogue, in place)

1x1 stride-1 unpadded convolutions skip im2col: the channels-last pixel rows are the cols.

Backward, per chunk, from ``gy`` and (fused op) the output ``y`` whose sign is the ReLU mask:

    gT (K, M) = (gy * (y > 0))^T, db += sum of g   (one pass over gy and y: the mask pass;
                                                    NCHW planes are gT's rows, NHWC g.T)
    dw (K, RSC) += gT @ cols                       (GEMM; cols recomputed from x)
    dcols (M, RSC) = gT^T @ wm;  dx = col2im(dcols)   (GEMM, then a gather: no races)

Threading: every Numba kernel here is ``prange`` over independent rows/images with plain loops
inside (on 1-3 d views taken at the top of the body); the GEMMs run outside any ``prange``
(NumPy's BLAS threads them itself), so the two thread pools never nest.
"""
# OMP_WAIT_POLICY=PASSIVE is chosen in numbafuse/__init__.py (see the note there).
import numpy as np
from numba import njit, prange

from ..parallel import parallel_kernel
from . import math as conv_math
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)
_input_coord = cpu_scalar(conv_math.input_coord)
_output_coord = cpu_scalar(conv_math.output_coord)
_valid_range = cpu_scalar(conv_math.valid_range)

CHUNK_BYTES = 6 << 20   # target size of one chunk's cols buffer (measured: 2.5-10 MiB best)
DB_PARTS = 16           # fixed row blocks of the NHWC bias-gradient reduction (deterministic)
DB_LANES = 4            # interleaved float64 accumulators of the NCHW bias gradient
ROW_BLOCK = 8           # input rows per iteration of the NCHW transposes (im2col, col2im)
EPILOGUE_TILE = 64      # output pixels per tile of the NCHW epilogue's transpose


geo_tuple = conv_math.geo_tuple


# --------------------------------------------------------------------------- im2col
# Inside each prange iteration the kernels first take the 1-3 d views they work on: indexing
# 4-d arrays directly inside a prange body compiled measurably slower (about 2x on a transpose).

@parallel_kernel
def nchw_to_nhwc(x, n0, xt):
    # x: (N, C, H, W);  xt: (nb, H, W, C) out, images n0 .. n0+nb of x, channels last
    # One block of ROW_BLOCK input rows per iteration: each channel's rows are read as one
    # contiguous run (short runs at a 4 KiB stride were latency-bound), the block is written
    # in cache.
    nb, H, W, C = xt.shape
    blocks = (H + ROW_BLOCK - 1) // ROW_BLOCK
    for job in prange(nb * blocks):
        h0 = (job % blocks) * ROW_BLOCK
        h1 = min(h0 + ROW_BLOCK, H)
        src = x[n0 + job // blocks]                       # (C, H, W): this image
        dst = xt[job // blocks]                           # (H, W, C)
        for c in range(C):
            for h in range(h0, h1):
                for wi in range(W):
                    dst[h, wi, c] = src[c, h, wi]


@parallel_kernel
def im2col_nhwc(x, n0, geo, cols):
    # x: (N, H, W, C);  cols: (nb*P*Q, R*S*C), rows (n, p, q), columns (r, s, c)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nb = cols.shape[0] // (P * Q)
    for np_ in prange(nb * P):
        n = np_ // P
        p = np_ % P
        for q in range(Q):
            m = np_ * Q + q
            for r in range(R):
                h = _input_coord(p, r, sh, ph, dh)
                for s in range(S):
                    wi = _input_coord(q, s, sw, pw, dw)
                    col0 = (r * S + s) * C
                    if h < 0 or h >= H or wi < 0 or wi >= W:
                        for c in range(C):
                            cols[m, col0 + c] = 0.0
                    else:
                        for c in range(C):
                            cols[m, col0 + c] = x[n0 + n, h, wi, c]


# --------------------------------------------------------------------------- epilogues

@parallel_kernel
def epilogue_nchw(ymat, b, has_bias, relu, n0, y):
    # ymat: (nb*PQ, K) GEMM output;  b: (K,);  y: (N, K, PQ), images n0 .. n0+nb written once
    # The layout copy is a tiled transpose: EPILOGUE_TILE pixels x K channels of ymat (in L1)
    # go out as K runs of EPILOGUE_TILE contiguous pixels.
    K = ymat.shape[1]
    PQ = y.shape[2]
    nb = ymat.shape[0] // PQ
    tiles = (PQ + EPILOGUE_TILE - 1) // EPILOGUE_TILE
    for job in prange(nb * tiles):
        n = job // tiles
        i0 = (job % tiles) * EPILOGUE_TILE
        i1 = min(i0 + EPILOGUE_TILE, PQ)
        src = ymat[n * PQ + i0:n * PQ + i1]               # (i1-i0, K)
        dst = y[n0 + n]                                   # (K, PQ)
        for k in range(K):
            bias = b[k] if has_bias else 0.0
            out = dst[k, i0:i1]                           # (i1-i0,)
            for i in range(i1 - i0):
                v = src[i, k] + bias
                out[i] = _relu(v) if relu else v


@parallel_kernel
def epilogue_rows(ymat, b, has_bias, relu):
    # ymat: (rows, K), in place: relu(ymat + b)
    rows, K = ymat.shape
    for m in prange(rows):
        row = ymat[m]                                     # (K,)
        for k in range(K):
            v = row[k] + (b[k] if has_bias else 0.0)
            row[k] = _relu(v) if relu else v


# --------------------------------------------------------------------------- mask pass (g, db)

@parallel_kernel
def mask_nchw(gy, y, use_mask, n0, gT, db):
    # gy, y: (N, K, PQ);  gT: (K, nb*PQ) out, g = gy*(y > 0);  db: (K,) float64, += sum g
    # Each gT row is written first (a vectorised select), then summed with DB_LANES
    # interleaved float64 accumulators: one sequential float64 sum would be latency-bound.
    # The order is fixed per channel, so db does not depend on the thread count.
    K = gT.shape[0]
    PQ = gy.shape[2]
    nb = gT.shape[1] // PQ
    for k in prange(K):
        a0 = 0.0
        a1 = 0.0
        a2 = 0.0
        a3 = 0.0
        for n in range(nb):
            row = gT[k, n * PQ:(n + 1) * PQ]              # (PQ,)
            gy_row = gy[n0 + n, k]                        # (PQ,)
            y_row = y[n0 + n, k]                          # (PQ,)
            for i in range(PQ):
                row[i] = _relu_grad(gy_row[i], y_row[i]) if use_mask else gy_row[i]
            i = 0
            while i + DB_LANES <= PQ:                     # DB_LANES == 4 accumulators
                a0 += row[i]
                a1 += row[i + 1]
                a2 += row[i + 2]
                a3 += row[i + 3]
                i += DB_LANES
            while i < PQ:
                a0 += row[i]
                i += 1
        db[k] += (a0 + a1) + (a2 + a3)


@parallel_kernel
def mask_rows(gy, y, use_mask, g, db):
    # gy, y, g: (rows, K);  g = gy*(y > 0);  db: (K,) float64, += column sums of g, summed
    # over DB_PARTS fixed row blocks in a fixed order (the same result for any thread count)
    rows, K = gy.shape
    partial = np.zeros((DB_PARTS, K))                  # (DB_PARTS, K) float64
    for part in prange(DB_PARTS):
        acc = partial[part]                            # (K,)
        for m in range(part * rows // DB_PARTS, (part + 1) * rows // DB_PARTS):
            gy_row, y_row, g_row = gy[m], y[m], g[m]   # (K,) each
            for k in range(K):
                v = _relu_grad(gy_row[k], y_row[k]) if use_mask else gy_row[k]
                g_row[k] = v
                acc[k] += v
    for part in range(DB_PARTS):
        for k in range(K):
            db[k] += partial[part, k]


# --------------------------------------------------------------------------- col2im (gather)

@njit(cache=True)
def _tap_table(size_in, T, stride, pad, dilation, size_out):
    # (size_in, T): the output position reading input position i through tap t, or -1
    table = np.empty((size_in, T), np.int64)
    for i in range(size_in):
        for t in range(T):
            table[i, t] = _output_coord(i, t, stride, pad, dilation, size_out)
    return table


@parallel_kernel
def col2im_nchw(dcols, n0, geo, dx):
    # dcols: (nb*P*Q, R*S*C), columns (r, s, c);  dx: (N, C, H, W), images n0 .. n0+nb written
    # Gather, one block of ROW_BLOCK input rows per iteration (no races): the rows are summed
    # as an (rows, W, C) tile from C-runs of dcols, over the taps (r, s) that read them, then
    # stored transposed, one contiguous run per channel.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nb = dcols.shape[0] // (P * Q)
    p_of = _tap_table(H, R, sh, ph, dh, P)             # (H, R)
    q_of = _tap_table(W, S, sw, pw, dw, Q)             # (W, S)
    blocks = (H + ROW_BLOCK - 1) // ROW_BLOCK
    for job in prange(nb * blocks):
        n = job // blocks
        h0 = (job % blocks) * ROW_BLOCK
        h1 = min(h0 + ROW_BLOCK, H)
        acc = np.zeros((h1 - h0, W, C), dcols.dtype)   # (rows, W, C): dx[n, :, h0:h1, :]^T
        for h in range(h0, h1):
            for r in range(R):
                p = p_of[h, r]
                if p < 0:
                    continue
                src = dcols[(n * P + p) * Q:(n * P + p + 1) * Q]     # (Q, RSC): output row p
                for s in range(S):
                    col0 = (r * S + s) * C
                    for wi in range(W):
                        q = q_of[wi, s]
                        if q >= 0:
                            for c in range(C):
                                acc[h - h0, wi, c] += src[q, col0 + c]
        dst = dx[n0 + n]                                  # (C, H, W)
        for c in range(C):
            for h in range(h0, h1):
                for wi in range(W):
                    dst[c, h, wi] = acc[h - h0, wi, c]


@parallel_kernel
def col2im_nhwc(dcols, n0, geo, dx):
    # dcols: (nb*P*Q, R*S*C);  dx: (N, H, W, C), images n0 .. n0+nb written (not accumulated)
    # Gather, one (n, h) row of dx per iteration: no races.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nb = dcols.shape[0] // (P * Q)
    p_of = _tap_table(H, R, sh, ph, dh, P)             # (H, R)
    q_of = _tap_table(W, S, sw, pw, dw, Q)             # (W, S)
    for nh in prange(nb * H):
        n = nh // H
        h = nh % H
        dst = dx[n0 + n, h]                               # (W, C)
        for wi in range(W):
            for c in range(C):
                dst[wi, c] = 0.0
            for r in range(R):
                p = p_of[h, r]
                if p < 0:
                    continue
                for s in range(S):
                    q = q_of[wi, s]
                    if q < 0:
                        continue
                    m = (n * P + p) * Q + q
                    col0 = (r * S + s) * C
                    for c in range(C):
                        dst[wi, c] += dcols[m, col0 + c]


# --------------------------------------------------------------------------- drivers

def _images_per_chunk(geom, itemsize):
    per_image = geom.C * geom.R * geom.S * geom.P * geom.Q * itemsize   # one image's cols
    return int(max(1, min(geom.N, CHUNK_BYTES // max(per_image, 1))))


def _is_pointwise(geom):
    """1x1, stride 1, unpadded: the cols matrix is x itself (channels last)."""
    return (geom.R == geom.S == geom.sh == geom.sw == 1 and geom.ph == geom.pw == 0
            and geom.ph_end == geom.pw_end == 0)


def _prefix(buf, *shape):
    """A C-contiguous ``shape`` view of the start of the flat buffer ``buf``."""
    return buf[:int(np.prod(shape))].reshape(shape)


def _chunks(N, nb):
    for n0 in range(0, N, nb):
        yield n0, min(nb, N - n0)


def _weight_matrix(w):
    """(K, C, R, S) -> (K, R*S*C): w's rows with columns in the cols matrix's (r, s, c) order."""
    K, C, R, S = w.shape
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1)).reshape(K, R * S * C)


class _Cols:
    """The cols matrix (m*P*Q, R*S*C) of a chunk of images, in reused buffers.

    NCHW: the chunk is first transposed to channels last (``xt``), then both layouts share
    ``im2col_nhwc``. Pointwise convolutions need no im2col: the (channels-last) chunk's pixel
    rows are the cols matrix.
    """

    def __init__(self, x, geom, nb):
        self.x, self.geom, self.geo = x, geom, geo_tuple(geom)
        self.nchw = geom.layout == "NCHW"
        self.pointwise = _is_pointwise(geom)
        g = geom
        self.xt_buf = np.empty(nb * g.H * g.W * g.C, x.dtype) if self.nchw else None
        self.buf = None if self.pointwise else np.empty(nb * g.P * g.Q * g.R * g.S * g.C,
                                                        x.dtype)

    def __call__(self, n0, m):
        g = self.geom
        if self.nchw:
            src, s0 = _prefix(self.xt_buf, m, g.H, g.W, g.C), 0     # (m, H, W, C)
            nchw_to_nhwc(self.x, n0, src)
        else:
            src, s0 = self.x, n0                                      # (N, H, W, C)
        if self.pointwise:
            return src[s0:s0 + m].reshape(m * g.H * g.W, g.C)         # (m*H*W, C)
        cols = self.scratch(m)                                        # (m*PQ, R*S*C)
        im2col_nhwc(src, s0, self.geo, cols)
        return cols

    def scratch(self, m):
        """The cols buffer as an (m*P*Q, R*S*C) matrix (backward reuses it for dcols)."""
        g = self.geom
        return _prefix(self.buf, m * g.P * g.Q, g.R * g.S * g.C)


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w) + b?)`` for contiguous host arrays of one dtype."""
    N, K, PQ = geom.N, geom.K, geom.P * geom.Q
    nchw = geom.layout == "NCHW"
    y = np.empty(geom.y_shape, x.dtype)
    has_bias = b is not None
    b = b if has_bias else np.zeros(K, x.dtype)
    nb = _images_per_chunk(geom, x.itemsize)
    wm = _weight_matrix(w)                                         # (K, R*S*C)
    cols_of = _Cols(x, geom, nb)
    ymat_buf = np.empty(nb * PQ * K, x.dtype) if nchw else None
    y2 = y.reshape(N * PQ, K) if not nchw else None                # (N*P*Q, K) NHWC rows
    y3 = y.reshape(N, K, PQ) if nchw else None                     # (N, K, P*Q)
    for n0, m in _chunks(N, nb):
        cols = cols_of(n0, m)                                      # (m*PQ, R*S*C)
        if nchw:
            ymat = _prefix(ymat_buf, m * PQ, K)                    # (m*PQ, K)
            np.matmul(cols, wm.T, out=ymat)                        # (m*PQ, RSC) @ (RSC, K)
            epilogue_nchw(ymat, b, has_bias, relu, n0, y3)
        else:
            ymat = y2[n0 * PQ:(n0 + m) * PQ]                       # (m*PQ, K), a view of y
            np.matmul(cols, wm.T, out=ymat)
            if has_bias or relu:
                epilogue_rows(ymat, b, has_bias, relu)
    return y


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``y = relu?(conv(x, w) + b)``; ``y`` given: g = gy * (y > 0).

    Only the gradients flagged in ``need`` are computed (the others are ``None``).
    """
    need_dx, need_dw, need_db = (bool(v) for v in need)
    if not (need_dx or need_dw or need_db):
        return None, None, None
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    PQ, RSC = P * Q, R * S * C
    geo = geo_tuple(geom)
    dtype = gy.dtype
    nchw = geom.layout == "NCHW"
    use_mask = y is not None
    y = y if use_mask else gy
    pointwise = _is_pointwise(geom)
    nb = _images_per_chunk(geom, x.itemsize)
    wm = _weight_matrix(w)                                         # (K, R*S*C)
    db = np.zeros(K, np.float64)                                   # float64 accumulation
    dx = np.empty(geom.x_shape, dtype) if need_dx else None
    dwm = np.empty((K, RSC), dtype) if need_dw else None           # (K, R*S*C)
    dw_part = np.empty((K, RSC), dtype) if need_dw and N > nb else None
    copy_g = nchw or use_mask or need_db                           # else g is gy's rows
    g_buf = np.empty(nb * PQ * K, dtype) if copy_g else None
    cols_of = _Cols(x, geom, nb)
    dxt_buf = np.empty(nb * PQ * C, dtype) if need_dx and nchw and pointwise else None
    gy3, y3 = gy.reshape(N, K, PQ), y.reshape(N, K, PQ)            # NCHW (N, K, P*Q)
    gy2, y2 = gy.reshape(N * PQ, K), y.reshape(N * PQ, K)          # NHWC rows (N*P*Q, K)
    for n0, m in _chunks(N, nb):
        rows = slice(n0 * PQ, (n0 + m) * PQ)
        # gT (K, m*PQ): g with one row per filter, whichever way it is stored
        if nchw:
            gT = _prefix(g_buf, K, m * PQ)                         # (K, m*PQ), contiguous
            mask_nchw(gy3, y3, use_mask, n0, gT, db)
        elif copy_g:
            g = _prefix(g_buf, m * PQ, K)                          # (m*PQ, K)
            mask_rows(gy2[rows], y2[rows], use_mask, g, db)
            gT = g.T
        else:
            gT = gy2[rows].T                                       # no mask, no db
        if need_dw:
            cols = cols_of(n0, m)                                  # (m*PQ, R*S*C)
            if n0 == 0:
                np.matmul(gT, cols, out=dwm)                       # (K, m*PQ) @ (m*PQ, RSC)
            else:
                np.matmul(gT, cols, out=dw_part)
                dwm += dw_part
        if need_dx:
            if pointwise and nchw:                                 # dx rows, channels last
                dxt = _prefix(dxt_buf, m * PQ, C)                  # (m*H*W, C)
                np.matmul(gT.T, wm, out=dxt)                       # (m*HW, K) @ (K, C)
                col2im_nchw(dxt, n0, geo, dx)                      # 1x1: a transpose
            elif pointwise:
                np.matmul(gT.T, wm, out=dx.reshape(N * PQ, C)[rows])   # straight into dx
            else:
                dcols = cols_of.scratch(m)                         # (m*PQ, RSC), reuses cols
                np.matmul(gT.T, wm, out=dcols)                     # (m*PQ, K) @ (K, RSC)
                (col2im_nchw if nchw else col2im_nhwc)(dcols, n0, geo, dx)
    # (K, R*S*C) -> (K, R, S, C) -> (K, C, R, S)
    dw = np.ascontiguousarray(dwm.reshape(K, R, S, C).transpose(0, 3, 1, 2)) if need_dw \
        else None
    return dx, dw, db.astype(dtype) if need_db else None


# --------------------------------------------------------------------------- unfused bias_add

def bias_add(x, b, layout):
    """``x + b[c]`` for a contiguous 4-d ``x`` in ``layout`` and ``b`` (C,)."""
    shape = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)   # b broadcast over N, H, W
    return x + b.reshape(shape)


def channel_sum(gy, layout):
    """Per-channel sum of a 4-d ``gy`` over N, H, W (float64 accumulation), shape (C,)."""
    axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
    return gy.sum(axis=axes, dtype=np.float64).astype(gy.dtype)
