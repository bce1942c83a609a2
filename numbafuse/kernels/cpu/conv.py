"""CPU convolution kernels: chunked im2col + one BLAS GEMM per chunk, fused epilogues.

Notation: N batch, C input channels, H/W input size, K filters, R/S filter size, P/Q output
size, PQ = P*Q, CRS = C*R*S, nb = images in one chunk.

Forward, per chunk of ``nb`` images (so the cols buffer stays a few MiB, cache friendly):

    NCHW:  colsT (CRS, nb*PQ) = im2col(x)         rows (c, r, s), columns (n, p, q)
           yT    (K, nb*PQ)   = w (K, CRS) @ colsT                       (one BLAS GEMM)
           y[n, k, :, :]      = relu(yT[k, n*PQ:(n+1)*PQ] + b[k])        (epilogue: layout copy)
    NHWC:  cols  (nb*PQ, RSC) = im2col(x)         rows (n, p, q), columns (r, s, c)
           y rows (nb*PQ, K)  = cols @ wt (RSC, K)                       (GEMM straight into y)
           y rows             = relu(y rows + b)                         (epilogue, in place)

1x1 stride-1 unpadded convolutions skip im2col: x itself is the cols matrix.

Backward, per chunk, from ``gy`` and (fused op) the output ``y`` whose sign is the ReLU mask:

    g = gy * (y > 0) in the GEMM layout, db += sum of g   (one pass over gy: the mask pass)
    dw += g @ cols^T                                       (GEMM; cols recomputed from x)
    dcols = w^T @ g;  dx = col2im(dcols)                   (GEMM, then a gather: no races)

Threading: every Numba kernel here is ``prange`` over independent rows/images with plain loops
inside; the GEMMs run outside any ``prange`` (NumPy's BLAS threads them itself), so the two
thread pools never nest.
"""
# OMP_WAIT_POLICY=PASSIVE is chosen in numbafuse/__init__.py (see the note there).
import numpy as np
from numba import njit, prange

from .. import conv_math
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)
_input_coord = cpu_scalar(conv_math.input_coord)
_output_coord = cpu_scalar(conv_math.output_coord)
_valid_range = cpu_scalar(conv_math.valid_range)

CHUNK_BYTES = 16 << 20  # target size of one chunk's im2col buffer
DB_PARTS = 16           # fixed row blocks of the NHWC bias-gradient reduction (deterministic)


geo_tuple = conv_math.geo_tuple


# --------------------------------------------------------------------------- im2col

@njit(parallel=True, cache=True)
def im2col_nchw(x, n0, geo, colsT):
    # x: (N, C, H, W);  colsT: (C*R*S, nb*P*Q), rows (c, r, s), columns (n, p, q)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nb = colsT.shape[1] // (P * Q)
    for row in prange(C * R * S):
        c = row // (R * S)
        r = (row // S) % R
        s = row % S
        q_lo, q_hi = _valid_range(s, sw, pw, dw, W, Q)
        for n in range(nb):
            for p in range(P):
                h = _input_coord(p, r, sh, ph, dh)
                base = (n * P + p) * Q
                if h < 0 or h >= H:
                    for q in range(Q):
                        colsT[row, base + q] = 0.0
                    continue
                for q in range(min(q_lo, Q)):
                    colsT[row, base + q] = 0.0
                for q in range(q_lo, q_hi):
                    colsT[row, base + q] = x[n0 + n, c, h, _input_coord(q, s, sw, pw, dw)]
                for q in range(max(q_hi, q_lo), Q):
                    colsT[row, base + q] = 0.0


@njit(parallel=True, cache=True)
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

@njit(parallel=True, cache=True)
def epilogue_nchw(yT, b, has_bias, relu, n0, y):
    # yT: (K, nb*PQ) GEMM output;  b: (K,);  y: (N, K, PQ), rows n0 .. n0+nb written once
    K = yT.shape[0]
    PQ = y.shape[2]
    nb = yT.shape[1] // PQ
    for nk in prange(nb * K):
        n = nk // K
        k = nk % K
        bias = b[k] if has_bias else 0.0
        for i in range(PQ):
            v = yT[k, n * PQ + i] + bias
            y[n0 + n, k, i] = _relu(v) if relu else v


@njit(parallel=True, cache=True)
def epilogue_rows(ymat, b, has_bias, relu):
    # ymat: (rows, K), in place: relu(ymat + b)
    rows, K = ymat.shape
    for m in prange(rows):
        for k in range(K):
            v = ymat[m, k] + (b[k] if has_bias else 0.0)
            ymat[m, k] = _relu(v) if relu else v


# --------------------------------------------------------------------------- mask pass (g, db)

@njit(parallel=True, cache=True)
def mask_nchw(gy, y, use_mask, n0, gT, db):
    # gy, y: (N, K, PQ);  gT: (K, nb*PQ) out, g = gy*(y > 0);  db: (K,) float64, += sum g
    K = gT.shape[0]
    PQ = gy.shape[2]
    nb = gT.shape[1] // PQ
    for k in prange(K):
        acc = 0.0
        for n in range(nb):
            for i in range(PQ):
                g = _relu_grad(gy[n0 + n, k, i], y[n0 + n, k, i]) if use_mask else gy[n0 + n, k, i]
                gT[k, n * PQ + i] = g
                acc += g
        db[k] += acc


@njit(parallel=True, cache=True)
def mask_rows(gy, y, use_mask, g, db):
    # gy, y, g: (rows, K);  g = gy*(y > 0);  db: (K,) float64, += column sums of g, summed
    # over DB_PARTS fixed row blocks in a fixed order (the same result for any thread count)
    rows, K = gy.shape
    partial = np.zeros((DB_PARTS, K))                  # (DB_PARTS, K) float64
    for part in prange(DB_PARTS):
        for m in range(part * rows // DB_PARTS, (part + 1) * rows // DB_PARTS):
            for k in range(K):
                v = _relu_grad(gy[m, k], y[m, k]) if use_mask else gy[m, k]
                g[m, k] = v
                partial[part, k] += v
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


@njit(parallel=True, cache=True)
def col2im_nchw(dcolsT, n0, geo, dx):
    # dcolsT: (C*R*S, nb*P*Q);  dx: (N, C, H, W), images n0 .. n0+nb written (not accumulated)
    # Gather: dx[n, c, h, w] = sum over the taps (r, s) that read (h, w) of dcolsT; each (n, c)
    # plane belongs to one thread, so there are no races.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nb = dcolsT.shape[1] // (P * Q)
    p_of = _tap_table(H, R, sh, ph, dh, P)             # (H, R)
    q_of = _tap_table(W, S, sw, pw, dw, Q)             # (W, S)
    for nc in prange(nb * C):
        n = nc // C
        c = nc % C
        for h in range(H):
            for wi in range(W):
                dx[n0 + n, c, h, wi] = 0.0
            for r in range(R):
                p = p_of[h, r]
                if p < 0:
                    continue
                for s in range(S):
                    row = (c * R + r) * S + s
                    base = (n * P + p) * Q
                    for wi in range(W):
                        q = q_of[wi, s]
                        if q >= 0:
                            dx[n0 + n, c, h, wi] += dcolsT[row, base + q]


@njit(parallel=True, cache=True)
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
        for wi in range(W):
            for c in range(C):
                dx[n0 + n, h, wi, c] = 0.0
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
                        dx[n0 + n, h, wi, c] += dcols[m, col0 + c]


# --------------------------------------------------------------------------- drivers

def _images_per_chunk(geom, itemsize):
    per_image = geom.C * geom.R * geom.S * geom.P * geom.Q * itemsize   # one image's cols
    return int(max(1, min(geom.N, CHUNK_BYTES // max(per_image, 1))))


def _is_pointwise(geom):
    """1x1, stride 1, unpadded: the cols matrix is x itself."""
    return (geom.R == geom.S == geom.sh == geom.sw == 1 and geom.ph == geom.pw == 0
            and geom.ph_end == geom.pw_end == 0)


def _prefix(buf, *shape):
    """A C-contiguous ``shape`` view of the start of the flat buffer ``buf``."""
    return buf[:int(np.prod(shape))].reshape(shape)


def _chunks(N, nb):
    for n0 in range(0, N, nb):
        yield n0, min(nb, N - n0)


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w) + b?)`` for contiguous host arrays of one dtype."""
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    PQ, CRS = P * Q, C * R * S
    geo = geo_tuple(geom)
    y = np.empty(geom.y_shape, x.dtype)
    has_bias = b is not None
    b = b if has_bias else np.zeros(K, x.dtype)
    pointwise = _is_pointwise(geom)
    if geom.layout == "NCHW":
        nb = 1 if pointwise else _images_per_chunk(geom, x.itemsize)
        wk = w.reshape(K, CRS)                                     # (K, C*R*S)
        colsT_buf = None if pointwise else np.empty(CRS * nb * PQ, x.dtype)
        yT_buf = np.empty(K * nb * PQ, x.dtype)
        y3 = y.reshape(N, K, PQ)                                   # (N, K, P*Q)
        for n0, m in _chunks(N, nb):
            if pointwise:
                colsT = x[n0].reshape(C, PQ)                       # (C, H*W) == (CRS, PQ)
            else:
                colsT = _prefix(colsT_buf, CRS, m * PQ)            # (CRS, m*PQ)
                im2col_nchw(x, n0, geo, colsT)
            yT = _prefix(yT_buf, K, m * PQ)                        # (K, m*PQ)
            np.matmul(wk, colsT, out=yT)
            epilogue_nchw(yT, b, has_bias, relu, n0, y3)
        return y
    nb = _images_per_chunk(geom, x.itemsize)
    wt = np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(R * S * C, K)  # (R*S*C, K)
    x2 = x.reshape(N * geom.H * geom.W, C)                         # (N*H*W, C) pointwise cols
    cols_buf = None if pointwise else np.empty(nb * PQ * CRS, x.dtype)
    y2 = y.reshape(N * PQ, K)                                      # (N*P*Q, K)
    for n0, m in _chunks(N, nb):
        if pointwise:
            cols = x2[n0 * PQ:(n0 + m) * PQ]                       # (m*PQ, C)
        else:
            cols = _prefix(cols_buf, m * PQ, CRS)                  # (m*PQ, R*S*C)
            im2col_nhwc(x, n0, geo, cols)
        rows = y2[n0 * PQ:(n0 + m) * PQ]                           # (m*PQ, K), a view of y
        np.matmul(cols, wt, out=rows)
        if has_bias or relu:
            epilogue_rows(rows, b, has_bias, relu)
    return y


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``y = relu?(conv(x, w) + b)``; ``y`` given: g = gy * (y > 0).

    Only the gradients flagged in ``need`` are computed (the others are ``None``).
    """
    need_dx, need_dw, need_db = (bool(v) for v in need)
    N, C, H, W = geom.N, geom.C, geom.H, geom.W
    K, R, S, P, Q = geom.K, geom.R, geom.S, geom.P, geom.Q
    PQ, CRS = P * Q, C * R * S
    geo = geo_tuple(geom)
    dtype = gy.dtype
    use_mask = y is not None
    y = y if use_mask else gy
    pointwise = _is_pointwise(geom)
    if not (need_dx or need_dw or need_db):
        return None, None, None
    db = np.zeros(K, np.float64)                                   # float64 accumulation
    dx = np.empty(geom.x_shape, dtype) if need_dx else None
    if geom.layout == "NCHW":
        nb = 1 if pointwise else _images_per_chunk(geom, x.itemsize)
        wk = w.reshape(K, CRS)                                     # (K, C*R*S)
        dwk = np.zeros((K, CRS), dtype) if need_dw else None       # (K, C*R*S)
        gT_buf = np.empty(K * nb * PQ, dtype)
        cols_buf = None if pointwise else np.empty(CRS * nb * PQ, dtype)
        gy3, y3 = gy.reshape(N, K, PQ), y.reshape(N, K, PQ)        # (N, K, P*Q)
        for n0, m in _chunks(N, nb):
            gT = _prefix(gT_buf, K, m * PQ)                        # (K, m*PQ)
            mask_nchw(gy3, y3, use_mask, n0, gT, db)
            if need_dw:
                if pointwise:
                    colsT = x[n0].reshape(C, PQ)                   # (C, H*W)
                else:
                    colsT = _prefix(cols_buf, CRS, m * PQ)         # (CRS, m*PQ)
                    im2col_nchw(x, n0, geo, colsT)
                dwk += gT @ colsT.T                                # (K, m*PQ) @ (m*PQ, CRS)
            if need_dx:
                if pointwise:
                    np.matmul(wk.T, gT, out=dx[n0].reshape(C, PQ))   # (C, K) @ (K, H*W)
                else:
                    dcolsT = _prefix(cols_buf, CRS, m * PQ)        # (CRS, m*PQ), reuses cols
                    np.matmul(wk.T, gT, out=dcolsT)
                    col2im_nchw(dcolsT, n0, geo, dx)
        dw = dwk.reshape(K, C, R, S) if need_dw else None          # (K, C, R, S)
    else:
        nb = _images_per_chunk(geom, x.itemsize)
        wt = np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(R * S * C, K)  # (RSC, K)
        dwt = np.zeros((R * S * C, K), dtype) if need_dw else None  # (R*S*C, K)
        gy2, y2 = gy.reshape(N * PQ, K), y.reshape(N * PQ, K)      # (N*P*Q, K)
        x2 = x.reshape(N * H * W, C)                               # (N*H*W, C)
        dx2 = dx.reshape(N * H * W, C) if need_dx else None
        copy_g = use_mask or need_db
        g_buf = np.empty(nb * PQ * K, dtype) if copy_g else None
        cols_buf = None if pointwise else np.empty(nb * PQ * CRS, dtype)
        for n0, m in _chunks(N, nb):
            rows = slice(n0 * PQ, (n0 + m) * PQ)
            if copy_g:
                g = _prefix(g_buf, m * PQ, K)                      # (m*PQ, K)
                mask_rows(gy2[rows], y2[rows], use_mask, g, db)
            else:
                g = gy2[rows]                                      # (m*PQ, K), no mask
            if need_dw:
                if pointwise:
                    cols = x2[rows]                                # (m*HW, C)
                else:
                    cols = _prefix(cols_buf, m * PQ, CRS)          # (m*PQ, R*S*C)
                    im2col_nhwc(x, n0, geo, cols)
                dwt += cols.T @ g                                  # (RSC, m*PQ) @ (m*PQ, K)
            if need_dx:
                if pointwise:
                    np.matmul(g, wt.T, out=dx2[rows])              # (m*HW, K) @ (K, C)
                else:
                    dcols = _prefix(cols_buf, m * PQ, CRS)         # (m*PQ, RSC), reuses cols
                    np.matmul(g, wt.T, out=dcols)
                    col2im_nhwc(dcols, n0, geo, dx)
        # (R*S*C, K) -> (R, S, C, K) -> (K, C, R, S)
        dw = np.ascontiguousarray(dwt.reshape(R, S, C, K).transpose(3, 2, 0, 1)) if need_dw \
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
