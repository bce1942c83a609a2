"""CPU task kernels of the pointwise convolution (1x1, stride 1, unpadded), one per layout and
pass: x itself is the GEMM operand, so a chunk is one GEMM straight into y (then bias and ReLU
while it is in cache), dX one GEMM of the gated gradient straight into dx, dW one GEMM per
chunk; nothing is copied but g. See ``cpu_plan.py`` for when it runs; the host side of dX
(:func:`dx`) and dW (:func:`dw`) is here.

dX of a strided unpadded 1x1 conv (ResNet's downsample 1x1/2) is the same GEMM into the
compact dx of the pixels the conv reads, scattered into dx with zeros between (:func:`dx`).
By input phase (``cpu_direct``), where it ran before, the same products took 2-3x the time
(NCHW, batch 16, 2 threads, ms phase / this, the input's size: 64 -> 128 at 16x16 0.435 /
0.151, 128 -> 256 at 8x8 0.419 / 0.135; the same at 56x56, 28x28 and 256 -> 512 at 14x14 2.69
/ 1.14, 2.08 / 0.88, 1.95 / 0.95; NHWC at 16x16 and 8x8 0.165 / 0.099, 0.158 / 0.108), the
same bits.

The host picks the kernel by the layout, so that a first call compiles one layout's body (the
two layouts in one kernel: 1.06-1.12 s of compile for a 1x1 forward, of a 3.2-3.5 s first call;
issue 33). Shapes, with M = N*H*W:

    NCHW  src (N, Ci, HW), wm (Co, Ci), out (N, Co, HW); chunk t: pixels [c0, c1) of one image
    NHWC  src (M, Ci),     wm (Ci, Co), out (M, Co);     chunk t: rows [c0, c1) of M

The forward runs ``forward_*`` on x with wm = w (NCHW) | w^T (NHWC); dX runs it on gy gated by
y (``use_gate``; gate = y) with wm = w^T | w.
"""
import numpy as np

from ..cpu import blas as _blas, recorded as _rec
from ..cpu import gemm_taps as _gemm_taps
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import blocks, launch, task_kernel
from ..cpu.transpose import transposed as _transposed
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from . import math as _math
from . import weights as _weights
from .cpu_chunks import balanced, gated_chw, gated_hwc, sum_groups

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)


@task_kernel
def forward_hwc(t0, t1, src, gate, use_gate, wm, mpc, bias, flags, blas, taps, out):
    # NHWC: src, gate (M, Ci); wm (Ci, Co); out (M, Co); flags (has_bias, relu). taps
    # (float32, Co % 8 == 0): 1 or 2 (16-float vectors) for cpu.gemm_taps's tiles (one tap,
    # a row address per pixel) instead of the BLAS, 0 for the BLAS
    has_bias, relu = flags
    M, Ci = src.shape
    Co = out.shape[1]
    gbuf = np.empty(Ci * mpc if use_gate else 0, src.dtype)
    rows = np.empty(mpc if taps else 0, np.int64)
    aoff = np.zeros(1, np.int64)
    for t in range(t0, t1):
        c0 = t * mpc
        c1 = min(M, c0 + mpc)
        m = c1 - c0
        a = src[c0:c1]                                            # (m, Ci)
        if use_gate:
            g = gbuf[:m * Ci].reshape((m, Ci))
            for i in range(m):
                sr, gr, dr = src[c0 + i], gate[c0 + i], g[i]
                for c in range(Ci):
                    dr[c] = _relu_grad(sr[c], gr[c])
            a = g
        o = out[c0:c1]                                            # (m, Co)
        if taps:
            _gemm_taps.dense_rows(rows, np.int64(a.ctypes.data), m, Ci)
            _gemm_taps.taps_step(((np.int64(m), np.int64(Co), np.int64(Ci)), np.int64(1),
                                 np.int64(rows.ctypes.data), np.int64(aoff.ctypes.data),
                                 np.int64(wm.ctypes.data), np.int64(Co),
                                 np.int64(o.ctypes.data), np.int64(Co),
                                 np.int64(bias.ctypes.data) if has_bias else np.int64(0),
                                 np.int64(1 if relu else 0), np.int64(taps - 1)))
        elif relu or has_bias:                                      # the epilogue in cache
            _blas.gemm_bias_relu(blas, m, Co, Ci, a, Ci, wm, Co, o, bias, relu)
        else:
            _blas.gemm(blas, False, False, (m, Co, Ci), 1.0, a, Ci, wm, Co, 0.0, o, Co)


@task_kernel
def forward_chw(t0, t1, src, gate, use_gate, wm, mpc, bs, flags, blas, taps, out):
    # NCHW: src, gate (N, Ci, HW); wm (Co, Ci); out (N, Co, HW); bs = (bias, scale, z): bias
    # zeros where not has_bias, scale ones where not scaled, z (N, Co, HW) or empty; flags
    # (has_bias, relu, scaled, has_z): out = relu?(scale[k] * sum + bias[k] + z?) in place
    # while the chunk is in cache (scale and z: an inference batch norm, Conv-BN-Add-ReLU in
    # one pass, as the im2col forward's epilogue). taps unused (forward_hwc's place)
    has_bias, relu, scaled, has_z = flags
    bias, scale, z = bs
    Ci, HW = src.shape[1], src.shape[2]
    Co = out.shape[1]
    nblk = (HW + mpc - 1) // mpc
    gbuf = np.empty(Ci * mpc if use_gate else 0, src.dtype)
    for t in range(t0, t1):
        n = t // nblk
        c0 = (t - n * nblk) * mpc
        c1 = min(HW, c0 + mpc)
        m = c1 - c0
        b = src[n, :, c0:]                                        # (Ci, m), ld HW
        ldb = HW
        if use_gate:
            g = gbuf[:Ci * m].reshape((Ci, m))
            for c in range(Ci):
                sr, gr, dr = src[n, c, c0:c1], gate[n, c, c0:c1], g[c]
                for i in range(m):
                    dr[i] = _relu_grad(sr[i], gr[i])
            b = g
            ldb = m
        _blas.gemm(blas, False, False, (Co, m, Ci), 1.0, wm, Ci, b, ldb, 0.0, out[n, :, c0:],
                   HW)
        if relu or has_bias or scaled or has_z:                   # in place, in cache
            for k in range(Co):
                r = out[n, k, c0:c1]                              # (m,)
                bk, sk = bias[k], scale[k]      # (zeros, ones where not used: x's dtype)
                if has_z:               # (a loop each: a test inside kept LLVM's vectors out)
                    zr = z[n, k, c0:c1]
                    for i in range(m):
                        v = r[i] * sk + bk + zr[i]
                        r[i] = _relu(v) if relu else v
                else:
                    for i in range(m):
                        v = r[i] * sk + bk      # (times 1: r itself, exactly)
                        r[i] = _relu(v) if relu else v


# dW and db. counts = (mpc, nchunks, groups): the chunks as the forward's, in groups of
# consecutive chunks (a task each); dw_parts: (groups, K, C) <- each group's dW; db_parts:
# (groups, K) float64 <- its sum of g. need_dw false: db only.

@task_kernel
def dw_hwc(t0, t1, x, gy, y, use_mask, counts, need_dw, blas, parts):
    # NHWC: x (M, C); gy, y (M, K)
    mpc, nchunks, groups = counts
    dw_parts, db_parts = parts
    M, C = x.shape
    K = gy.shape[1]
    gbuf = np.empty(K * mpc, x.dtype)
    for grp in range(t0, t1):
        dbp = db_parts[grp]
        dbp[:] = 0.0
        first = True
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            c0 = t * mpc
            c1 = min(M, c0 + mpc)
            m = c1 - c0
            beta = 0.0 if first else 1.0
            first = False
            g = gbuf[:m * K].reshape((m, K))                      # (m, K)
            gated_hwc(gy, y, use_mask, c0, c1, g, 0, dbp)
            if need_dw:
                # dW (K, C) += g^T (K, m) @ x (m, C)
                _blas.gemm(blas, True, False, (K, C, m), 1.0, g, K, x[c0:c1], C, beta,
                           dw_parts[grp], C)


@task_kernel
def dw_chw(t0, t1, x, gy, y, use_mask, counts, need_dw, blas, parts):
    # NCHW: x (N, C, HW); gy, y (N, K, HW)
    mpc, nchunks, groups = counts
    dw_parts, db_parts = parts
    C, HW = x.shape[1], x.shape[2]
    K = gy.shape[1]
    nblk = (HW + mpc - 1) // mpc
    gbuf = np.empty(K * mpc, x.dtype)
    for grp in range(t0, t1):
        dbp = db_parts[grp]
        dbp[:] = 0.0
        first = True
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n = t // nblk
            c0 = (t - n * nblk) * mpc
            c1 = min(HW, c0 + mpc)
            m = c1 - c0
            beta = 0.0 if first else 1.0
            first = False
            g = gbuf[:K * m].reshape((K, m))                      # (K, m)
            gated_chw(gy, y, use_mask, n, c0, c1, HW, 1, g, 0, dbp)
            if need_dw:
                # dW (K, C) += g (K, m) @ x[n][:, c0:c1]^T (m, C)
                _blas.gemm(blas, False, True, (K, C, m), 1.0, g, m, x[n, :, c0:], HW, beta,
                           dw_parts[grp], C)


# --------------------------------------------------------------------------- the host side

# forward_chw's z where there is none, by dtype char (one per dtype: no array made a call)
_NO_Z = {np.dtype(d).char: np.empty((0, 0, 0), d) for d in (np.float32, np.float64)}


def _chw_epilogue(b, scale, z, dtype):
    """forward_chw's bs = (b, scale, z): scale ones where None, z the empty one."""
    return (b, np.ones(b.shape[0], dtype) if scale is None else scale,
            _NO_Z[np.dtype(dtype).char] if z is None else view(z, False))


def forward(x, w, b, has_bias, scale, z, relu, geom, plan, blas, y, work):
    """``y = relu?(scale? * conv(x, w) + b + z?)`` of a 1x1 stride-1 conv (``cpu.conv_forward``'s
    pointwise plan): b (K,) (zeros where not ``has_bias``); ``scale`` (K,) and ``z`` (y's
    shape) NCHW only, or None."""
    K, C, nhwc = geom.K, geom.C, geom.layout == "NHWC"
    wm = w.reshape(K, C)
    mpc, nchunks = chunks(plan, geom, C + K, x.itemsize)
    xv = view(x, nhwc)
    if nhwc:
        if plan.taps:
            _gemm_taps.ready(gather=False)
        launch(forward_hwc, nchunks, xv, xv, False, transposed_weights(w, wm), mpc, b,
               (has_bias, relu), blas, plan.taps, view(y, nhwc), work=work, grain=1)
        return
    launch(forward_chw, nchunks, xv, xv, False, wm, mpc, _chw_epilogue(b, scale, z, x.dtype),
           (bool(has_bias), bool(relu), scale is not None, z is not None), blas, 0,
           view(y, nhwc), work=work, grain=1)


def view(a, nhwc):
    """A 1x1 conv's operand as the pointwise tasks take it: (N, C, HW) | (N*HW, C)."""
    return a.reshape(-1, a.shape[3]) if nhwc else a.reshape(a.shape[0], a.shape[1], -1)


def chunks(plan, geom, channels, itemsize):
    """(pixels per chunk, chunks) of a pointwise pass over the output's P x Q pixels."""
    HW = geom.P * geom.Q
    mpc = balanced(geom.N * HW if geom.layout == "NHWC" else HW,
                   plan.chunk_bytes // max(1, channels * itemsize))
    nchunks = blocks(geom.N * HW, mpc) if geom.layout == "NHWC" else geom.N * blocks(HW, mpc)
    return mpc, nchunks


def transposed_weights(w, wm):
    """wm.T contiguous (C, K), wm the (K, C) matrix of a 1x1 w: the NHWC forward's operand and
    the NCHW dX's (``w^T @ g``), one entry of the weight cache for both where it keeps w's
    arrays, else made again into an output-cache buffer (``cpu.transpose.transposed``)."""
    kept = _weights.peek(w, "transposed")
    if kept is not None:
        return kept
    keep = _weights.will_keep(w)
    shape = wm.shape[::-1]
    out = _transposed(wm, np.empty(shape, wm.dtype) if keep else _out.empty(shape, wm.dtype))
    if keep:
        _weights.put(w, "transposed", out)
    return out


def dx(gy, y, use_mask, w, geom, plan, out, work):
    """``out`` = dx of a 1x1 conv (``dx = g @ w | w^T @ g``, g = gy gated by y when
    ``use_mask``); strided (unpadded): the GEMMs into the compact dx of the pixels read
    (N, C, P, Q), then those scattered into ``out`` with zeros between."""
    K, C, nhwc = geom.K, geom.C, geom.layout == "NHWC"
    strided = geom.sh > 1 or geom.sw > 1
    shape = (geom.N, geom.P, geom.Q, C) if nhwc else (geom.N, C, geom.P, geom.Q)
    compact = _out.empty(shape, gy.dtype) if strided else out
    wm = w.reshape(K, C)
    mpc, nchunks = chunks(plan, geom, C + K, gy.itemsize)
    if plan.taps:
        _gemm_taps.ready(gather=False)
    zero = np.zeros(C, gy.dtype)
    launch(forward_hwc if nhwc else forward_chw, nchunks, view(gy, nhwc), view(y, nhwc),
           use_mask, wm if nhwc else transposed_weights(w, wm), mpc,
           zero if nhwc else _chw_epilogue(zero, None, None, gy.dtype),
           (False, False) if nhwc else (False, False, False, False),
           _blas.blas_for(gy.dtype), plan.taps, view(compact, nhwc), work=work, grain=1)
    if strided:                                   # zeros, then every sh-th row, sw-th column
        _rec.copy(out, 0)                         # (copies a prepared call makes again)
        if nhwc:
            _rec.copy(out[:, :geom.P * geom.sh:geom.sh, :geom.Q * geom.sw:geom.sw], compact)
        else:
            _rec.copy(out[:, :, :geom.P * geom.sh:geom.sh, :geom.Q * geom.sw:geom.sw], compact)


def dw(x, gy, y, use_mask, geom, need_dw, plan, work):
    """(dw or None, db_parts) of a pointwise conv: (groups, K) float64 db partials."""
    K, C = geom.K, geom.C
    nhwc = geom.layout == "NHWC"
    mpc, nchunks = chunks(plan, geom, C + K, x.itemsize)
    groups = min(nchunks, plan.dw_groups)
    dw_parts = np.empty((groups if need_dw else 1, K, C), x.dtype)
    db_parts = np.empty((groups, K))                                   # float64
    launch(dw_hwc if nhwc else dw_chw, groups, view(x, nhwc), view(gy, nhwc), view(y, nhwc),
           use_mask, _math.int_tuple(mpc, nchunks, groups), need_dw, _blas.blas_for(x.dtype),
           (dw_parts, db_parts), work=work, grain=1)
    if not need_dw:
        return None, db_parts
    return sum_groups(dw_parts).reshape(K, C, 1, 1), db_parts         # group order
