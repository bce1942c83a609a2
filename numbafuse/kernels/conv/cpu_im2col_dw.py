"""The im2col dW's task kernels (``cpu_im2col``'s docstring has the orientations and the
chunks): a group of chunks a task (``dw_tasks``), or the whole batch in blocks of output
channels (``dw_block_tasks``). Their products go through ``cpu.blas.gemm``, which runs those
with no operand transposed on ``gemm_taps``' register tiles (``blas.TILE_GEMM``): the NCHW
slab's dW = g @ cols does; without slab (a stem) ``gathers_dw`` says where g is transposed
first so that dW^T = cols @ g^T does too."""
import numpy as np

from ..cpu import blas as _blas, recorded as _rec
from ..cpu.launch import task_kernel
from ..cpu.transpose import ROWS as _ROWS, transpose_rows
from .cpu_chunks import block_len, chunk, gated_chw, gated_hwc
from .cpu_im2col import IM2COL_CHW, IM2COL_HWC, IM2COL_SLAB, slab_buffer

_im2col_chw_step, _im2col_hwc_step = IM2COL_CHW.call, IM2COL_HWC.call
_im2col_slab_step, _rows_step = IM2COL_SLAB.call, _ROWS.call


def gathers_dw(geom, slab, dtype):
    """Whether the NCHW dW over chunks without slab (:func:`dw_tasks`; cols (C*R*S, m))
    transposes each chunk's g to (m, K) and multiplies dW^T (C*R*S, K) = cols @ g^T, the
    orientation ``blas.gemm`` runs on the tiles, instead of OpenBLAS's (K, m) @ (m, C*R*S)^T:
    float32, K a multiple of 8 (the tiles' columns), from GATHER_MIN_PIXELS output pixels an
    image (each chunk's transpose and row table outweighed the tiles at 8x8). One thread,
    machine A (Zen 4, AVX-512), GFLOP/s tiles / OpenBLAS (NumPy's, the same library) at
    (C*R*S, K, m): the ResNet stem's (147, 64, 1024) 111 / 69, (576, 64, 1024) 116 / 73,
    (1152, 128, 256) 115 / 92, but (27, 32, 1024) 84 / 96. (With slab, dW = g @ cols is that
    orientation already: (128, 2304, 256) 113 / 104, (128, 1024, 64) 113 / 80.)"""
    return (geom.layout == "NCHW" and not slab and np.dtype(dtype) == np.float32
            and geom.K % 8 == 0 and geom.P * geom.Q >= GATHER_MIN_PIXELS)


# The dW without slab, 2 threads, machine A, OpenBLAS -> tiles ms (in-process A/B, best of
# 10): (N, C, H, K, kernel) = (32, 1, 8, 24, 3) 0.044 -> 0.060 (the digits stem: 64 pixels an
# image), (16, 3, 32, 64, 3/2) 0.36 -> 0.30 (256), (32, 1, 28, 32, 3) 0.32 -> 0.25 (784),
# (16, 3, 64, 32, 3) 2.86 -> 2.04, (32, 3, 32, 16, 5) 1.38 -> 0.66 (1024)
GATHER_MIN_PIXELS = 256


@task_kernel
def dw_tasks(t0, t1, x, gy, y, use_mask, geo, chunks, flags, blas, parts):
    ipc, rpc, nchunks, groups = chunks
    slab, need_dw, gather = flags
    dw_parts, db_parts = parts
    # x as in the forward (slab too); gy, y: (N, K, PQ) | (N, PQ, K); dw_parts: (groups, K,
    # RSC) <- each group's dW (columns in the cols order: (r, s, c) with slab), or with
    # gather (:func:`gathers_dw`) (groups, RSC, K) <- its dW^T = cols (RSC, m) @ g^T (m, K),
    # g transposed first; db_parts: (groups, K) float64 <- its sum of g
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    RSC = R * S * C
    PQ = P * Q
    mmax = ipc * PQ if ipc > 1 else rpc * Q
    cols = np.empty(mmax * RSC if need_dw else 0, x.dtype)
    gbuf = np.empty(mmax * K, x.dtype)
    gtbuf = np.empty(mmax * K if gather else 0, x.dtype)          # g^T: (m, K)
    sbuf = slab_buffer(x, geo, ipc, rpc, slab and need_dw)
    for grp in range(t0, t1):
        dbp = db_parts[grp]                                       # (K,)
        dbp[:] = 0.0
        dwp = dw_parts[grp if need_dw else 0]                     # (K, RSC); (1, ...) without dW
        first = True
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n0, n1, p0, p1 = chunk(t, N, P, ipc, rpc)
            per = (p1 - p0) * Q
            m = (n1 - n0) * per
            beta = 0.0 if first else 1.0
            first = False
            if nhwc:
                g = gbuf[:m * K].reshape((m, K))                  # (m, K)
                m0 = n0 * PQ + p0 * Q
                gated_hwc(gy.reshape((N * PQ, K)), y.reshape((N * PQ, K)), use_mask, m0, m0 + m,
                       g, 0, dbp)                                 # rows of gy
                if not need_dw:
                    continue
                c2 = cols[:m * RSC].reshape((m, RSC))             # (m, R*S*C)
                for n in range(n0, n1):
                    _im2col_hwc_step((x, n, p0, p1, geo, c2, (n - n0) * per))
                # dW (K, RSC) += g^T (K, m) @ cols (m, RSC)
                _blas.gemm(blas, True, False, (K, RSC, m), 1.0, g, K, c2, RSC, beta, dwp, RSC)
            else:
                g = gbuf[:K * m].reshape((K, m))                  # (K, m)
                for n in range(n0, n1):
                    gated_chw(gy, y, use_mask, n, p0, p1, PQ, Q, g, (n - n0) * per, dbp)
                if not need_dw:
                    continue
                if slab:
                    c2 = cols[:m * RSC].reshape((m, RSC))         # (m, R*S*C)
                    _im2col_slab_step((x, n0, n1, p0, p1, geo, sbuf, c2, per))
                    # dW (K, RSC) += g (K, m) @ cols (m, RSC)
                    _blas.gemm(blas, False, False, (K, RSC, m), 1.0, g, m, c2, RSC, beta, dwp,
                               RSC)
                    continue
                c2 = cols[:RSC * m].reshape((RSC, m))             # (C*R*S, m)
                for n in range(n0, n1):
                    _im2col_chw_step((x, n, p0, p1, geo, c2, (n - n0) * per))
                if gather:
                    # dW^T (RSC, K) += cols (RSC, m) @ g^T (m, K)
                    gt = gtbuf[:m * K].reshape((m, K))
                    _rows_step((g.reshape((1, K, m)), gt.reshape((1, m, K))))
                    _blas.gemm(blas, False, False, (RSC, K, m), 1.0, c2, m, gt, K, beta,
                               dwp.reshape((RSC, K)), K)
                    continue
                # dW (K, RSC) += g (K, m) @ cols^T (m, RSC)
                _blas.gemm(blas, False, True, (K, RSC, m), 1.0, g, m, c2, m, beta, dwp, RSC)


@task_kernel
def dw_block_tasks(t0, t1, x, gy, y, use_mask, geo, kb, flags, blas, pre, out):
    slab, need_dw, ordered = flags
    dwk, db = out
    # dW and db of the whole batch split by output channels, not by pixels (deep layers: few
    # pixels, many weights): task t the channels [k0, k1) (block t of kb, a multiple of 16),
    # dwk[k0:k1] (K, RSC) = g[k0:k1] (kn, M) @ cols (M, RSC) and db[k0:k1] (float64) = the
    # sums of g, with M = N*P*Q; dwk (K, C*R*S) in w's order (a block computed in the cols'
    # (r, s, c) order is reordered by its task). The batch's cols (a few MiB at most,
    # Rules.whole_batch_bytes) come built once by cols_tasks in pre ((M, R*S*C) NHWC or
    # slab, (C*R*S, M) NCHW; empty without need_dw); no partials to sum; ``ordered``: pre's
    # rows already in w's (c, r, s) order (reordered once where M < K: less to move than
    # every block's dW). x, gy, y as in dw_tasks.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    RSC = R * S * C
    PQ = P * Q
    M = N * PQ
    kb_len = block_len(K, kb)
    gbuf = np.empty(M * min(K, kb_len), x.dtype)
    # cols in (r, s, c) order: dW too, then reordered (a 1x1 conv's orders are one)
    reorder = need_dw and (nhwc or slab) and R * S > 1 and not ordered
    dbuf = np.empty(min(K, kb_len) * RSC if reorder else 0, x.dtype)
    for t in range(t0, t1):
        k0 = t * kb_len
        k1 = min(K, k0 + kb_len)
        kn = k1 - k0
        if kn <= 0:
            continue
        dbk = db[k0:k1]
        dbk[:] = 0.0
        if nhwc:
            g = gbuf[:M * kn].reshape((M, kn))                    # (M, kn)
            gated_hwc(gy.reshape((M, K))[:, k0:k1], y.reshape((M, K))[:, k0:k1], use_mask, 0,
                      M, g, 0, dbk)
            if not need_dw:
                continue
            # dW[k0:k1] (kn, RSC) = g^T (kn, M) @ cols (M, RSC), then (kn, C, R*S) into dwk
            d2 = dbuf[:kn * RSC].reshape((kn, RSC)) if reorder else dwk[k0:k1]
            _blas.gemm(blas, True, False, (kn, RSC, M), 1.0, g, kn, pre, RSC, 0.0, d2, RSC)
            if reorder:
                _rows_step((d2.reshape((kn, R * S, C)), dwk[k0:k1].reshape((kn, C, R * S))))
            continue
        g = gbuf[:kn * M].reshape((kn, M))                        # (kn, M)
        for n in range(N):
            gated_chw(gy[:, k0:k1], y[:, k0:k1], use_mask, n, 0, P, PQ, Q, g, n * PQ, dbk)
        if not need_dw:
            continue
        if slab:                                                  # pre: (M, R*S*C)
            d2 = dbuf[:kn * RSC].reshape((kn, RSC)) if reorder else dwk[k0:k1]
            _blas.gemm(blas, False, False, (kn, RSC, M), 1.0, g, M, pre, RSC, 0.0, d2, RSC)
            if reorder:
                _rows_step((d2.reshape((kn, R * S, C)), dwk[k0:k1].reshape((kn, C, R * S))))
        else:                                                     # pre: (C*R*S, M)
            _blas.gemm(blas, False, True, (kn, RSC, M), 1.0, g, M, pre, M, 0.0, dwk[k0:k1],
                       RSC)


def in_w_order(cols, taps, C):
    """The k-blocked dW's batch cols (M, R*S*C) with each row reordered to w's (C, R*S), on
    the calling thread: where M < K, so that the blocks' products land in w's order instead
    of each reordering its block of dW (ResNet-18's l4 3x3 512 at 2x2, batch 16: 1.2 MB moved
    once instead of 9.4 MB)."""
    out = np.empty_like(cols)
    _rec.step(transpose_rows, cols.reshape(cols.shape[0], taps, C),
              out.reshape(cols.shape[0], C, taps))
    return out
