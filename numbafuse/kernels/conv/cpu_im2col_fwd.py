"""The im2col forward's task kernels, one per layout (``cpu_im2col``'s docstring has the
orientations): the host picks by the layout, so a first call compiles one layout's body (the
two in one kernel took 2.5 s cold)."""
import numpy as np
from numba import njit

from ..cpu import blas as _blas
from ..cpu.launch import task_kernel
from ..cpu.transpose import ROWS as _ROWS
from ..scalar import cpu_scalar, relu as _relu_math
from .cpu_chunks import block_len, chunk
from .cpu_im2col import IM2COL_CHW, IM2COL_HWC, IM2COL_SLAB, slab_buffer

_relu = cpu_scalar(_relu_math)
_im2col_chw_step, _im2col_hwc_step = IM2COL_CHW.call, IM2COL_HWC.call
_im2col_slab_step, _rows_step = IM2COL_SLAB.call, _ROWS.call


@njit(inline="always")
def block_weights(wmat, k0, k1, C, RS, wt, wdst, wbuf):
    """Filters [k0, k1)'s weights as (kn, R*S*C) rows: wmat's own (already in that order),
    or with ``wt`` reordered from (kn, C, R*S) into their rows of wdst (K, R*S*C) where it
    has rows (the weight cache's), else into wbuf. (Also the tapwise forward's.)"""
    kn = k1 - k0
    wk = wmat[k0:k1]                                              # (kn, RSC)
    if wt and kn > 0:                                             # (kn, C, RS) -> (kn, RS, C)
        wk = wdst[k0:k1] if wdst.shape[0] > 0 else wbuf[:kn * RS * C].reshape((kn, RS * C))
        _rows_step((wmat[k0:k1].reshape((kn, C, RS)), wk.reshape((kn, RS, C))))
    return wk


@njit(inline="always")
def _forward_block(t, wmat, flags, geo, chunks, wdst, wbuf):
    # task t's block: (n0, n1, p0, p1, k0, k1, wk), wk its (kn, RSC) weight rows (reordered
    # to (kn, R*S*C) first where ``wt``; kn = k1 - k0 <= 0: nothing to do)
    ipc, rpc, kb = chunks
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    kb_len = block_len(K, kb)
    n0, n1, p0, p1 = chunk(t // kb, N, P, ipc, rpc)
    k0 = (t % kb) * kb_len
    k1 = min(K, k0 + kb_len)
    return n0, n1, p0, p1, k0, k1, block_weights(wmat, k0, k1, C, R * S, flags[3], wdst, wbuf)


@njit(inline="always")
def _forward_buffers(x, flags, geo, chunks, pre):
    # (cols, ybuf, sbuf, wbuf): a task range's buffers, reused by each of its tasks
    slab, wt = flags[2], flags[3]
    ipc, rpc, kb = chunks
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    RSC = R * S * C
    kb_len = block_len(K, kb)
    mmax = ipc * P * Q if ipc > 1 else rpc * Q
    built = pre.shape[0] == 0                                     # cols built here
    cols = np.empty(mmax * RSC if built else 0, x.dtype)          # reused by every chunk
    ybuf = np.empty(mmax * min(K, kb_len), x.dtype)
    sbuf = slab_buffer(x, geo, ipc, rpc, slab and built)
    wbuf = np.empty(min(K, kb_len) * RSC if wt else 0, x.dtype)
    return cols, ybuf, sbuf, wbuf


# forward_tasks_hwc and forward_tasks_chw, their shared arguments: x: (N, H, W, C) | (N, C, H, W);
# wmat: (K, R*S*C) (NHWC, or NCHW with slab) | (K, C*R*S); bs = (b, scale, z), b and scale
# (K,), z shaped as y (read where has_z); y: (N, PQ, K) | (N, K, PQ); flags = (has_bias, relu,
# slab, wt, scaled, has_z) (the 1x1 passes whose x is the cols are cpu_pointwise's kernels):
# with scaled each output channel's sum is times scale[k] before the bias (inference batch
# norm not folded into w), with has_z z's value is added after the bias, before the ReLU (a
# residual: inference Conv-BN-Add-ReLU in one pass). Task t: the output
# channels [k0, k1) (block t % kb of kb, each a multiple of 16 channels) of chunk t // kb.
# slab (NCHW): each image's input rows of the chunk are transposed to (rows, W, C) first and
# the cols built as NHWC's, (m, R*S*C): a strided NCHW gather reads single values, this one
# vectors. pre: the whole batch's cols ((M, R*S*C), NCHW without slab (C*R*S, M)) built once
# by cols_tasks (kb > 1: one chunk), else empty. wt: wmat is w as it is, (K, C*R*S), and each
# task reorders its own block of it to (kn, R*S*C) (kb > 1: the blocks' reorderings run in
# parallel, not as one 9.4 MB transpose on the host first at 512 -> 512 3x3), into its rows
# of wdst (K, R*S*C) where given (for the weight cache), else into a buffer of its own.

@task_kernel
def forward_tasks_hwc(t0, t1, x, wmat, bs, flags, geo, chunks, blas, pre, wdst, y):
    has_bias, relu, scaled, has_z = flags[0], flags[1], flags[4], flags[5]
    b, scale, z = bs
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    RSC = R * S * C
    PQ = P * Q
    cols, ybuf, sbuf, wbuf = _forward_buffers(x, flags, geo, chunks, pre)
    z2 = z.reshape((z.size // K if has_z else 0, K))              # (N*PQ, K) | none
    for t in range(t0, t1):
        n0, n1, p0, p1, k0, k1, wk = _forward_block(t, wmat, flags, geo, chunks, wdst, wbuf)
        kn = k1 - k0
        if kn <= 0:
            continue
        per = (p1 - p0) * Q                                       # pixels per image
        m = (n1 - n0) * per
        yb = ybuf[:m * kn].reshape((m, kn))                       # (m, kn)
        c2 = pre                                                  # (m, R*S*C)
        if pre.shape[0] == 0:
            c2 = cols[:m * RSC].reshape((m, RSC))
            for n in range(n0, n1):
                _im2col_hwc_step((x, n, p0, p1, geo, c2, (n - n0) * per))
        _blas.gemm(blas, False, True, (m, kn, RSC), 1.0, c2, RSC, wk, RSC, 0.0, yb, kn)
        first = n0 * PQ + p0 * Q
        y2 = y.reshape((N * PQ, K))[first:first + m]              # (m, K)
        for i in range(m):          # (by index, no view of y's rows: cpu_chunks.gated_hwc)
            for k in range(kn):
                v = (yb[i, k] * scale[k0 + k] if scaled else yb[i, k]) + (b[k0 + k] if has_bias
                                                                          else 0)
                if has_z:
                    v += z2[first + i, k0 + k]
                y2[i, k0 + k] = _relu(v) if relu else v


@task_kernel
def forward_tasks_chw(t0, t1, x, wmat, bs, flags, geo, chunks, blas, pre, wdst, y):
    has_bias, relu, slab, scaled, has_z = flags[0], flags[1], flags[2], flags[4], flags[5]
    b, scale, z = bs
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    RSC = R * S * C
    cols, ybuf, sbuf, wbuf = _forward_buffers(x, flags, geo, chunks, pre)
    for t in range(t0, t1):
        n0, n1, p0, p1, k0, k1, wk = _forward_block(t, wmat, flags, geo, chunks, wdst, wbuf)
        kn = k1 - k0
        if kn <= 0:
            continue
        per = (p1 - p0) * Q                                       # pixels per image
        m = (n1 - n0) * per
        yb = ybuf[:kn * m].reshape((kn, m))                       # (kn, m)
        if slab:
            c2 = pre
            if pre.shape[0] == 0:
                c2 = cols[:m * RSC].reshape((m, RSC))             # (m, R*S*C)
                _im2col_slab_step((x, n0, n1, p0, p1, geo, sbuf, c2, per))
            _blas.gemm(blas, False, True, (kn, m, RSC), 1.0, wk, RSC, c2, RSC, 0.0, yb, m)
        else:
            c2 = pre                                              # (C*R*S, m)
            if pre.shape[0] == 0:
                c2 = cols[:RSC * m].reshape((RSC, m))
                for n in range(n0, n1):
                    _im2col_chw_step((x, n, p0, p1, geo, c2, (n - n0) * per))
            _blas.gemm(blas, False, False, (kn, m, RSC), 1.0, wk, RSC, c2, m, 0.0, yb, m)
        for n in range(n0, n1):
            for k in range(kn):
                src = yb[k, (n - n0) * per:(n - n0 + 1) * per]   # (per,)
                dst = y[n, k0 + k, p0 * Q:p1 * Q]
                zk = z[n, k0 + k, p0 * Q:p1 * Q] if has_z else dst   # (per,)
                bias = b[k0 + k] if has_bias else 0
                sc = scale[k0 + k] if scaled else 1
                for i in range(per):
                    v = (src[i] * sc if scaled else src[i]) + bias
                    if has_z:
                        v += zk[i]
                    dst[i] = _relu(v) if relu else v
