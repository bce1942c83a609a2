r"""CPU convolution kernels: per-chunk gather + single-threaded GEMMs + epilogue, one task each.

Three algorithms (each section below says more; docs/conv_bias_relu.md has the measurements):
3x3 stride-1 forward and dX by Winograd F(2x2, 3x3); other stride-1 passes and every stride-1
dW by *shifted GEMMs* over a zero-padded chunk (no im2col); strided convolutions by im2col
(forward, dW) and by phases (dX), described here first.

Notation: N batch, C input channels, H/W input size, K filters, R/S filter size, P/Q output
size, PQ = P*Q, RSC = R*S*C, m = pixels of one chunk.

Work is cut into *chunks* of output pixels: a block of output rows of one image, or several
whole images when an image is small (``_chunking``), so that a chunk's im2col matrix is about
``CHUNK_BYTES`` (it stays in one core's L2 while its GEMM reads it). Each chunk is one task of
the thread pool (``_launch.py``): the thread that takes it builds the chunk's cols, runs one
GEMM on numbafuse's private single-threaded BLAS (``_blas.py``) and applies the epilogue while
the result is still in its cache. No thread pool hands a chunk to another one, and no step is
serial in N (the only serial step, the sum of the dW partials, is fixed in size).

The GEMM orientation follows the layout, so that y, g and dx need no transposes:

    NCHW  cols (RSC, m), rows (c, r, s)      ybuf (K, m)  = w (K, C*R*S) @ cols
    NHWC  cols (m, RSC), columns (r, s, c)   ybuf (m, K)  = cols @ wm^T,  wm (K, R*S*C)

Backward, from ``gy`` and (fused op) the output ``y``, whose sign is the ReLU mask:

    dW and db: chunks go into DW_GROUPS fixed groups (a function of the shape only); a group is
        one task, which for each of its chunks gathers g = gy * (y > 0) (db += sum g, float64)
        and accumulates dW_group += g @ cols (beta = 1 GEMMs). The groups' partials are summed
        in group order afterwards: the result does not depend on the thread count.
    dX: a transposed convolution computed as a convolution of g, gated on the fly, split by
        *phase* for strides > 1 (input rows h = a + sh*i, columns w = b + sw*j): the taps r with
        (a + ph - r*dh) % sh == 0 read output row p = i + (a + ph - r*dh) // sh, so each phase
        is a dense GEMM over its own taps only (no zero-stuffed columns; stride 1 is one phase):

    NCHW  gcols (T*K, m) rows (k, r, s)   dxbuf (C, m) = w'_phase (C, T*K) @ gcols
    NHWC  gcols (m, T*K) cols (r, s, k)   dxbuf (m, C) = gcols @ w'_phase (T*K, C)

    where T = taps of the phase and w'[c, (k, r, s)] = w[k, c, r, s]. Every dx element is
    written by exactly one task (no races, no atomics).

Both layouts run the same task kernels: the layout is a flag tested once per chunk, and the
per-layout loop nests are the small gather/scatter helpers below (``_im2col_*``, ``_g_*``,
``_gcols_*``, ``_scatter_*``), so the tasks, chunking, GEMM calls and reductions are written once.
"""
import numpy as np

from .. import cpu_blas as _blas
from ..cpu_launch import blocks, launch
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from . import math as conv_math

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)
_input_coord = cpu_scalar(conv_math.input_coord)
_valid_range = cpu_scalar(conv_math.valid_range)

CHUNK_BYTES = 384 << 10   # target bytes of one chunk's im2col matrix (L2-sized; see docs)
DW_GROUPS = 16            # fixed groups of chunks, each with its own dW and db partial
WINOGRAD = True           # 3x3 stride-1 forward and dX by Winograd F(2x2, 3x3)
WINOGRAD_TILES = 128      # 2x2 output tiles per Winograd chunk (the GEMMs' n)

geo_tuple = conv_math.geo_tuple

from . import cpu_winograd as _wino  # noqa: E402
from .cpu_direct import _shifted_dw_tasks, _shifted_tasks  # noqa: E402
from .cpu_im2col import (_dw_tasks, _dx_tasks, _forward_tasks, _nchunks,  # noqa: E402
                         _phase_weights, _phases)


def _chunking(pixels_per_image, rows, row_pixels, row_bytes):
    """(images per chunk, rows per chunk): whole images if one image's matrix is small, else
    blocks of rows of one image; ``row_bytes``: the im2col bytes of one output pixel."""
    target = max(1, CHUNK_BYTES // max(row_bytes, 1))          # pixels of one chunk
    if pixels_per_image <= target:
        return max(1, target // max(pixels_per_image, 1)), rows
    return 1, max(1, target // max(row_pixels, 1))





# --------------------------------------------------------------------------- drivers

def _is_pointwise(geom):
    """1x1, stride 1, unpadded: the cols matrix is x itself."""
    return (geom.R == geom.S == geom.sh == geom.sw == geom.dh == geom.dw == 1
            and geom.ph == geom.pw == 0 and geom.ph_end == geom.pw_end == 0)


def _weight_matrix(w, nhwc):
    """NCHW: (K, C*R*S) = w as it is; NHWC: (K, R*S*C), columns in the cols order."""
    K, C, R, S = w.shape
    if not nhwc:
        return w.reshape(K, C * R * S)
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1)).reshape(K, R * S * C)


def _winograd(geom):
    """3x3, stride 1, no dilation: Winograd F(2x2, 3x3) for the forward and dX."""
    return (WINOGRAD and geom.R == geom.S == 3 and geom.sh == geom.sw == 1
            and geom.dh == geom.dw == 1)


def _winograd_chunks(N, Ho, Wo, nhwc):
    """(images per chunk, tile rows per chunk, chunks, most tiles of a chunk) of a Winograd
    pass over an Ho x Wo output: ~WINOGRAD_TILES tiles (NCHW rows of tiles carry one junk
    tile each), whole images when an image has fewer."""
    TY, TX = (Ho + 1) // 2, (Wo + 1) // 2
    per_row = TX if nhwc else TX + 1
    if TY * per_row <= WINOGRAD_TILES:
        ipc, tyb = max(1, WINOGRAD_TILES // (TY * per_row)), TY
    else:
        ipc, tyb = 1, max(1, WINOGRAD_TILES // per_row)
    most = (ipc * TY if ipc > 1 else tyb) * per_row
    return ipc, tyb, _nchunks(N, TY, ipc, tyb), most


def _winograd_run(src, gate, use_gate, w, flip, top, left, bias, relu, nhwc, blas, out, work):
    """out = relu?(Winograd 3x3 correlation of src (gated) zero-padded by top/left + bias);
    taps w (K, C, 3, 3), flipped and transposed for dX (``flip``)."""
    Ci, Co = (w.shape[0], w.shape[1]) if flip else (w.shape[1], w.shape[0])
    N, Ho, Wo = out.shape[0], *(out.shape[1:3] if nhwc else out.shape[2:4])
    U = np.empty((16, Ci, Co) if nhwc else (16, Co, Ci), src.dtype)   # the GEMMs' orientation
    _wino.winograd_taps(w, flip, nhwc, U)
    ipc, tyb, nchunks, most = _winograd_chunks(N, Ho, Wo, nhwc)
    launch(_wino._winograd_tasks, nchunks, src, gate, use_gate, U, top, left, ipc, tyb,
           _wino.estride(Ci * most, src.itemsize), _wino.estride(Co * most, src.itemsize),
           bias, relu, nhwc, blas, out, work=work, grain=1)


def _shifted(geom):
    """Stride 1: the shifted-GEMM kernels (no im2col)."""
    return geom.sh == 1 and geom.sw == 1


def _shifted_rows_per_chunk(ci, co, padded_width, itemsize):
    """Output rows per chunk: the padded input block and the output buffer ~CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // max(1, (ci + co) * padded_width * itemsize))


def conv_forward(x, w, b, geom, relu):
    """``y = relu?(conv(x, w) + b?)`` for contiguous host arrays of one dtype."""
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    nhwc = geom.layout == "NHWC"
    y = np.empty(geom.y_shape, x.dtype)
    has_bias = b is not None
    b = b if has_bias else np.zeros(K, x.dtype)
    blas = _blas.blas_for(x.dtype)
    if _winograd(geom):
        _winograd_run(x, x, False, w, False, geom.ph, geom.pw, b, bool(relu), nhwc, blas, y,
                      x.size + y.size)
        return y
    if _shifted(geom):
        wt = np.ascontiguousarray(w.transpose(2, 3, 0, 1)).reshape(R * S, K, C)  # wt[r,s] (K, C)
        rpc = _shifted_rows_per_chunk(C, K, Q + (S - 1) * geom.dw, x.itemsize)
        launch(_shifted_tasks, N * blocks(P, rpc), x, x, False, wt, R, S, geom.dh, geom.dw,
               geom.ph, geom.pw, rpc, b, has_bias, bool(relu), nhwc, blas, y,
               work=x.size + y.size, grain=1)
        return y
    ipc, rpc = _chunking(P * Q, P, Q, R * S * C * x.itemsize)
    y_k = y.reshape(N, P * Q, K) if nhwc else y.reshape(N, K, P * Q)    # (N, PQ, K) | (N, K, PQ)
    launch(_forward_tasks, _nchunks(N, P, ipc, rpc), x, _weight_matrix(w, nhwc), b, has_bias,
           bool(relu), geo_tuple(geom), ipc, rpc, _is_pointwise(geom), blas, y_k,
           work=x.size + y.size, grain=1)
    return y


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``y = relu?(conv(x, w) + b)``; ``y`` given: g = gy * (y > 0).

    Only the gradients flagged in ``need`` are computed (the others are ``None``).
    """
    need_dx, need_dw, need_db = (bool(v) for v in need)
    N, C, H, W, K, R, S, P, Q = (geom.N, geom.C, geom.H, geom.W, geom.K, geom.R, geom.S,
                                 geom.P, geom.Q)
    nhwc = geom.layout == "NHWC"
    use_mask = y is not None
    y = y if use_mask else gy
    geo = geo_tuple(geom)
    blas = _blas.blas_for(gy.dtype)
    work = x.size + 2 * gy.size
    shifted = _shifted(geom)
    dx = dw = db = None
    if (need_dw or need_db) and _winograd(geom):
        ipc, tyb, nchunks, most = _winograd_chunks(N, P, Q, nhwc)
        groups = min(nchunks, DW_GROUPS)
        D_parts = np.empty((groups if need_dw else 1, 16, K, C), x.dtype)  # D[e] (K, C)
        db_parts = np.empty((groups, K))                                 # float64
        launch(_wino._winograd_dw_tasks, groups, x, gy, y, use_mask, geom.ph, geom.pw, ipc,
               tyb, _wino.estride(C * most, x.itemsize), _wino.estride(K * most, x.itemsize),
               nchunks, groups, need_dw, nhwc, blas, D_parts, db_parts, work=work, grain=1)
        if need_db:
            db = np.add.reduce(db_parts, axis=0).astype(gy.dtype)     # group order
        if need_dw:
            dw = np.empty((K, C, 3, 3), x.dtype)
            _wino.winograd_dw(np.add.reduce(D_parts, axis=0, dtype=np.float64), dw)
    elif need_dw or need_db:
        if shifted:
            rpc = _shifted_rows_per_chunk(C, K, Q + (S - 1) * geom.dw, x.itemsize)
            nchunks = N * blocks(P, rpc)
        else:
            ipc, rpc = _chunking(P * Q, P, Q, R * S * C * x.itemsize)
            nchunks = _nchunks(N, P, ipc, rpc)
        groups = min(nchunks, DW_GROUPS)
        dw_parts = np.empty((groups if need_dw else 1, K * R * S * C), x.dtype)
        db_parts = np.empty((groups, K))                               # float64
        if shifted:
            launch(_shifted_dw_tasks, groups, x, gy, y, use_mask, R, S, geom.dh, geom.dw,
                   geom.ph, geom.pw, rpc, nchunks, groups, need_dw, nhwc, blas,
                   dw_parts.reshape(-1, R * S, K, C), db_parts, work=work, grain=1)
        else:
            gy_k = gy.reshape(N, P * Q, K) if nhwc else gy.reshape(N, K, P * Q)
            y_k = y.reshape(N, P * Q, K) if nhwc else y.reshape(N, K, P * Q)
            launch(_dw_tasks, groups, x, gy_k, y_k, use_mask, geo, ipc, rpc, nchunks, groups,
                   _is_pointwise(geom), need_dw, blas, dw_parts.reshape(-1, K, R * S * C),
                   db_parts, work=work, grain=1)
        if need_db:
            db = np.add.reduce(db_parts, axis=0).astype(gy.dtype)     # group order
        if need_dw:
            dwm = np.add.reduce(dw_parts, axis=0)                      # group order
            if shifted:                                                # (R, S, K, C)
                dw = np.ascontiguousarray(dwm.reshape(R, S, K, C).transpose(2, 3, 0, 1))
            elif nhwc:                                                 # (K, R, S, C)
                dw = np.ascontiguousarray(dwm.reshape(K, R, S, C).transpose(0, 3, 1, 2))
            else:                                                      # (K, C, R, S)
                dw = dwm.reshape(K, C, R, S)
    if need_dx:
        dx = np.empty(geom.x_shape, gy.dtype)
        if _winograd(geom):
            # dx = 3x3 correlation of g padded by 2 - ph, taps w[:, :, 2-r, 2-s]^T (C, K)
            _winograd_run(gy, y, use_mask, w, True, 2 - geom.ph, 2 - geom.pw,
                          np.zeros(C, gy.dtype), False, nhwc, blas, dx, work)
            return dx, dw, db
        if shifted:
            # dx = stride-1 conv of g, padded by (R-1)*dh - ph rows on top (likewise columns),
            # with the flipped, transposed taps wt[r, s] = w[:, :, R-1-r, S-1-s]^T (C, K)
            wt = np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(2, 3, 1, 0)).reshape(
                R * S, C, K)
            rpc = _shifted_rows_per_chunk(K, C, W + (S - 1) * geom.dw, x.itemsize)
            launch(_shifted_tasks, N * blocks(H, rpc), gy, y, use_mask, wt, R, S, geom.dh,
                   geom.dw, (R - 1) * geom.dh - geom.ph, (S - 1) * geom.dw - geom.pw, rpc,
                   np.zeros(C, gy.dtype), False, False, nhwc, blas, dx, work=work, grain=1)
            return dx, dw, db
        tr, orr, nr = _phases(H, R, geom.sh, geom.ph, geom.dh)
        ts, os_, ns = _phases(W, S, geom.sw, geom.pw, geom.dw)
        wphase, woff = _phase_weights(w, tr, nr, ts, ns, nhwc)
        rows_max = -(-H // geom.sh)
        wb_max = -(-W // geom.sw)
        ipc, rpc = _chunking(rows_max * wb_max, rows_max, wb_max,
                             int(nr.max()) * int(ns.max()) * K * x.itemsize)
        per_phase = _nchunks(N, rows_max, ipc, rpc)
        launch(_dx_tasks, geom.sh * geom.sw * per_phase, gy.reshape(geom.y_shape),
               y.reshape(geom.y_shape), use_mask, geo, ipc, rpc, per_phase, rows_max, tr, orr,
               nr, ts, os_, ns, wphase, woff, blas, dx, work=work, grain=1)
    return dx, dw, db


# --------------------------------------------------------------------------- unfused bias_add

def bias_add(x, b, layout):
    """``x + b[c]`` for a contiguous 4-d ``x`` in ``layout`` and ``b`` (C,)."""
    shape = (1, -1, 1, 1) if layout == "NCHW" else (1, 1, 1, -1)   # b broadcast over N, H, W
    return x + b.reshape(shape)


def channel_sum(gy, layout):
    """Per-channel sum of a 4-d ``gy`` over N, H, W (float64 accumulation), shape (C,)."""
    axes = (0, 2, 3) if layout == "NCHW" else (0, 1, 2)
    return gy.sum(axis=axes, dtype=np.float64).astype(gy.dtype)
