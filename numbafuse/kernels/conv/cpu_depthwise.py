r"""CPU depthwise convolution kernels: a direct stencil per channel, no GEMM.

A depthwise convolution has ``groups == C`` and ``K = C * M`` filters (M, the channel
multiplier, >= 1): filter ``k = c * M + m`` sees input channel ``c`` only, and w is
``(K, 1, R, S)``. It does R*S multiply-adds per output value against a GEMM's C*R*S, so it is
bound by memory, not arithmetic: each pass reads its inputs once and writes its output once.

    forward   y[n,k,p,q] = relu(sum_{r,s} x[n, c, p*sh - ph + r*dh, q*sw - pw + s*dw] w[k,r,s] + b[k])
    backward  g = gy * (y > 0);  db[k] = sum_{n,p,q} g[n,k,p,q]
              dw[k,r,s] = sum_{n,p,q} g[n,k,p,q] x[n, c, p*sh - ph + r*dh, q*sw - pw + s*dw]
              dx[n,c,h,w] = sum_{m,r,s} g[n, cM+m, p, q] w[cM+m, r, s]
                            over the (p, q) with h = p*sh - ph + r*dh, w = q*sw - pw + s*dw

Loops (one compiled task kernel per pass and layout):

    NHWC  channels on the vector lanes: the innermost loop runs over C contiguous values of
          x, of the taps ``wt`` (M, R, S, C) and of an accumulator. Tasks: blocks of output
          rows (forward, dW) or input rows (dX, gathered from the output rows that reach it).
    NCHW  per-plane stencil: the innermost loop runs over a row of the plane. Tasks: output
          planes (n, k) (forward, dW) or input planes (n, c) (dX, scattered within the plane
          the task owns).

dW and db: the chunks (row blocks or planes) go into ``min(chunks, DW_GROUPS)`` fixed groups,
one task each with its own partial (db in float64), summed in group order afterwards: results
do not depend on the thread count. dX: each dx element is written by exactly one task. Notation
as in ``cpu.py``; ``geo`` is ``math.GEO_FIELDS``'s tuple.
"""
import numpy as np
from numba import njit

from .. import scalar
from ..cpu_buffers import output_cache as _out
from ..cpu_launch import blocks, launch, task_kernel
from . import math as conv_math

CHUNK_ELEMENTS = 1 << 15   # output values of one NHWC task's rows (forward, dW), at least a row
DW_GROUPS = 16             # fixed groups of chunks, each with its own dW and db partial

_relu = scalar.cpu_scalar(scalar.relu)
_valid_range = scalar.cpu_scalar(conv_math.valid_range)


def is_depthwise(geom):
    """Whether a grouped convolution runs these kernels: one input channel per group."""
    return geom.groups > 1 and geom.groups == geom.C


# --------------------------------------------------------------------------- forward

@task_kernel
def _forward_nhwc(t0, t1, x, wt, b, relu, geo, rpc, y):
    # x: (N, H, W, C);  wt: (M, R, S, C) taps, channel fastest;  b: (K,);  y: (N, P, Q, K).
    # Task t: output rows [p0, p0 + rpc) of image t // blocks(P, rpc).
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    nb = (P + rpc - 1) // rpc
    acc = np.empty((M, C), wt.dtype)                                  # one output pixel
    for t in range(t0, t1):
        n, p0 = t // nb, (t % nb) * rpc
        for p in range(p0, min(P, p0 + rpc)):
            for q in range(Q):
                acc[:] = 0
                for r in range(R):
                    h = p * sh - ph + r * dh
                    if h < 0 or h >= H:
                        continue
                    for s in range(S):
                        wi = q * sw - pw + s * dw
                        if wi < 0 or wi >= W:
                            continue
                        xv = x[n, h, wi]                              # (C,)
                        for m in range(M):
                            a, wv = acc[m], wt[m, r, s]               # (C,), (C,)
                            for c in range(C):
                                a[c] += xv[c] * wv[c]
                yv = y[n, p, q]                                       # (K,), k = c*M + m
                for m in range(M):
                    for c in range(C):
                        v = acc[m, c] + b[c * M + m]
                        yv[c * M + m] = _relu(v) if relu else v


@task_kernel
def _forward_nchw(t0, t1, x, w, b, relu, geo, y):
    # x: (N, C, H, W);  w: (K, R, S);  b: (K,);  y: (N, K, P, Q).  Task t: plane (n, k) = divmod(t, K).
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    acc = np.empty(Q, w.dtype)                                        # one output row
    for t in range(t0, t1):
        n, k = t // K, t % K
        xp, yp, bias = x[n, k // M], y[n, k], b[k]
        for p in range(P):
            acc[:] = 0
            for r in range(R):
                h = p * sh - ph + r * dh
                if h < 0 or h >= H:
                    continue
                xr = xp[h]                                            # (W,)
                for s in range(S):
                    q0, q1 = _valid_range(s, sw, pw, dw, W, Q)
                    if q1 <= q0:
                        continue
                    x0, wv = q0 * sw + s * dw - pw, w[k, r, s]        # input column of q0
                    a = acc[q0:q1]                  # views from 0: no negative-index checks
                    if sw == 1:
                        xs = xr[x0:x0 + q1 - q0]
                        for i in range(q1 - q0):
                            a[i] += xs[i] * wv
                    else:
                        xs2 = xr[x0:x0 + (q1 - q0 - 1) * sw + 1:sw]
                        for i in range(q1 - q0):
                            a[i] += xs2[i] * wv
            yr = yp[p]
            for q in range(Q):
                v = acc[q] + bias
                yr[q] = _relu(v) if relu else v


def forward(x, w, b, geom, relu):
    """``y = relu?(depthwise_conv(x, w) + b?)`` for contiguous host arrays of one dtype."""
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    y = _out.empty(geom.y_shape, x.dtype)
    b = np.zeros(K, x.dtype) if b is None else b
    work = x.size + y.size
    geo = conv_math.geo_tuple(geom)
    relu = bool(relu)
    if geom.layout == "NHWC":
        rpc = _rows_per_chunk(geom)
        launch(_forward_nhwc, N * blocks(P, rpc), x, _taps_nhwc(w, C, K // C), b, relu, geo,
               rpc, y, work=work)
    else:
        launch(_forward_nchw, N * K, x, w.reshape(K, R, S), b, relu, geo, y, work=work)
    return y


def _rows_per_chunk(geom):
    """Output rows of one NHWC forward or dW task: CHUNK_ELEMENTS output values, a row at least."""
    return max(1, min(geom.P, CHUNK_ELEMENTS // max(1, geom.Q * geom.K)))


def _taps_nhwc(w, C, M):
    """w (K, 1, R, S), k = c*M + m, as the NHWC kernels' taps (M, R, S, C)."""
    R, S = w.shape[2], w.shape[3]
    return np.ascontiguousarray(w.reshape(C, M, R, S).transpose(1, 2, 3, 0))


# --------------------------------------------------------------------------- dX

@task_kernel
def _dx_nhwc(t0, t1, gy, y, use_mask, wt, geo, dx):
    # gy, y: (N, P, Q, K);  wt: (M, R, S, C);  dx: (N, H, W, C).  Task t: input row (n, h) =
    # divmod(t, H), which the task owns: the output rows p whose tap r reaches it
    # (h = p*sh - ph + r*dh) scatter g * w into it, tap by tap.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    zero = np.zeros(1, gy.dtype)[0]
    for t in range(t0, t1):
        n, h = t // H, t % H
        d = dx[n, h]                                                  # (W, C)
        d[:] = 0
        for r in range(R):
            num = h + ph - r * dh                                     # = p * sh
            if num < 0 or num % sh != 0 or num // sh >= P:
                continue
            p = num // sh
            for s in range(S):
                q0, q1 = _valid_range(s, sw, pw, dw, W, Q)
                for q in range(q0, q1):
                    a = d[q * sw - pw + s * dw]                       # (C,)
                    gv, yv = gy[n, p, q], y[n, p, q]                  # (K,), (K,)
                    for m in range(M):
                        wv = wt[m, r, s]                              # (C,)
                        for c in range(C):
                            i = c * M + m
                            a[c] += (gv[i] if not use_mask or yv[i] > 0 else zero) * wv[c]


@task_kernel
def _dx_nchw(t0, t1, gy, y, use_mask, w, geo, dx):
    # gy, y: (N, K, P, Q);  w: (K, R, S);  dx: (N, C, H, W).  Task t: input plane (n, c) =
    # divmod(t, C), which the task owns: its filters' g * w scattered into it.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    g = np.empty(Q, gy.dtype)                                         # one gated row of g
    for t in range(t0, t1):
        n, c = t // C, t % C
        dp = dx[n, c]                                                 # (H, W)
        dp[:] = 0
        for k in range(c * M, c * M + M):
            gp, yp = gy[n, k], y[n, k]                                # (P, Q), (P, Q)
            for p in range(P):
                for q in range(Q):
                    g[q] = gp[p, q]
                    if use_mask and not yp[p, q] > 0:
                        g[q] = 0
                for r in range(R):
                    h = p * sh - ph + r * dh
                    if h < 0 or h >= H:
                        continue
                    dr = dp[h]                                        # (W,)
                    for s in range(S):
                        q0, q1 = _valid_range(s, sw, pw, dw, W, Q)
                        if q1 <= q0:
                            continue
                        x0, wv = q0 * sw + s * dw - pw, w[k, r, s]    # dx column of q0
                        gs = g[q0:q1]               # views from 0: no negative-index checks
                        if sw == 1:
                            ds = dr[x0:x0 + q1 - q0]
                            for i in range(q1 - q0):
                                ds[i] += gs[i] * wv
                        else:
                            ds2 = dr[x0:x0 + (q1 - q0 - 1) * sw + 1:sw]
                            for i in range(q1 - q0):
                                ds2[i] += gs[i] * wv


# --------------------------------------------------------------------------- dW and db

@task_kernel
def _dw_nhwc(t0, t1, x, gy, y, use_mask, need_dw, geo, plan, dw_parts, db_parts):
    # x: (N, H, W, C);  gy, y: (N, P, Q, K);  dw_parts: (groups, M, R, S, C);  db_parts:
    # (groups, K) float64;  plan: (rpc, nchunks, groups).  Task t: group t, the chunks
    # [t*nchunks//groups, (t+1)*...), a chunk being output rows [p0, p0 + rpc) of one image.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    rpc, nchunks, groups = plan
    M = K // C
    nb = (P + rpc - 1) // rpc
    g = np.empty((M, C), gy.dtype)                                    # one pixel's gated g
    zero = np.zeros(1, gy.dtype)[0]
    for t in range(t0, t1):
        dwp, dbp = dw_parts[t], db_parts[t]
        dwp[:] = 0
        dbp[:] = 0
        for chunk in range(t * nchunks // groups, (t + 1) * nchunks // groups):
            n, p0 = chunk // nb, (chunk % nb) * rpc
            for p in range(p0, min(P, p0 + rpc)):
                for q in range(Q):
                    gv, yv = gy[n, p, q], y[n, p, q]                  # (K,), (K,)
                    for m in range(M):
                        gm = g[m]
                        for c in range(C):
                            i = c * M + m
                            gm[c] = gv[i] if not use_mask or yv[i] > 0 else zero
                            dbp[i] += gm[c]
                    if not need_dw:
                        continue
                    for r in range(R):
                        h = p * sh - ph + r * dh
                        if h < 0 or h >= H:
                            continue
                        for s in range(S):
                            wi = q * sw - pw + s * dw
                            if wi < 0 or wi >= W:
                                continue
                            xv = x[n, h, wi]                          # (C,)
                            for m in range(M):
                                a, gm = dwp[m, r, s], g[m]            # (C,), (C,)
                                for c in range(C):
                                    a[c] += gm[c] * xv[c]


@task_kernel
def _dw_nchw(t0, t1, x, gy, y, use_mask, need_dw, geo, plan, dw_parts, db_parts):
    # x: (N, C, H, W);  gy, y: (N, K, P, Q);  dw_parts: (groups, K, R, S);  db_parts:
    # (groups, K) float64;  plan: (nchunks, groups).  Task t: group t, the chunks
    # [t*nchunks//groups, (t+1)*...), a chunk being plane (n, k) = divmod(chunk, K). Per plane,
    # each tap's products are summed per output column first (acc, vectorised over q), then
    # over the columns.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nchunks, groups = plan
    M = K // C
    g = np.empty(Q, gy.dtype)                                         # one gated row of g
    acc = np.empty((R, S, Q), gy.dtype)
    for t in range(t0, t1):
        dwp, dbp = dw_parts[t], db_parts[t]
        dwp[:] = 0
        dbp[:] = 0
        for chunk in range(t * nchunks // groups, (t + 1) * nchunks // groups):
            n, k = chunk // K, chunk % K
            xp, gp, yp = x[n, k // M], gy[n, k], y[n, k]
            acc[:] = 0
            db = 0.0
            for p in range(P):
                for q in range(Q):
                    g[q] = gp[p, q]
                    if use_mask and not yp[p, q] > 0:
                        g[q] = 0
                    db += g[q]
                if not need_dw:
                    continue
                for r in range(R):
                    h = p * sh - ph + r * dh
                    if h < 0 or h >= H:
                        continue
                    xr = xp[h]                                        # (W,)
                    for s in range(S):
                        q0, q1 = _valid_range(s, sw, pw, dw, W, Q)
                        if q1 <= q0:
                            continue
                        x0 = q0 * sw + s * dw - pw                    # input column of q0
                        a, gs = acc[r, s, q0:q1], g[q0:q1]    # views from 0: no wraparound
                        if sw == 1:
                            xs = xr[x0:x0 + q1 - q0]
                            for i in range(q1 - q0):
                                a[i] += gs[i] * xs[i]
                        else:
                            xs2 = xr[x0:x0 + (q1 - q0 - 1) * sw + 1:sw]
                            for i in range(q1 - q0):
                                a[i] += gs[i] * xs2[i]
            dbp[k] += db
            if need_dw:
                for r in range(R):
                    for s in range(S):
                        a = acc[r, s]
                        v = a[0] * 0
                        for q in range(Q):
                            v += a[q]
                        dwp[k, r, s] += v


def backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``y = relu?(depthwise_conv(x, w) + b)``; ``y`` given: g = gy * (y > 0).
    Only the gradients flagged in ``need`` are computed (the others are None)."""
    need_dx, need_dw, need_db = (bool(v) for v in need)
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    M = K // C
    use_mask = y is not None
    y = y if use_mask else gy
    nhwc = geom.layout == "NHWC"
    geo = conv_math.geo_tuple(geom)
    work = x.size + 2 * gy.size
    dx = dw = db = None
    if need_dx:
        dx = _out.empty(geom.x_shape, gy.dtype)
        if nhwc:
            launch(_dx_nhwc, N * geom.H, gy, y, use_mask, _taps_nhwc(w, C, M), geo, dx,
                   work=work)
        else:
            launch(_dx_nchw, N * C, gy, y, use_mask, w.reshape(K, R, S), geo, dx, work=work)
    if need_dw or need_db:
        if nhwc:
            rpc = _rows_per_chunk(geom)
            nchunks = N * blocks(P, rpc)
            groups = min(nchunks, DW_GROUPS)
            dw_parts = np.empty((groups, M, R, S, C), gy.dtype)
            db_parts = np.empty((groups, K))                          # float64
            launch(_dw_nhwc, groups, x, gy, y, use_mask, need_dw, geo, (rpc, nchunks, groups),
                   dw_parts, db_parts, work=work, grain=1)
            if need_dw:                                               # (M, R, S, C) -> (K, 1, R, S)
                dw = np.ascontiguousarray(
                    np.add.reduce(dw_parts, axis=0).transpose(3, 0, 1, 2)).reshape(K, 1, R, S)
        else:
            nchunks = N * K
            groups = min(nchunks, DW_GROUPS)
            dw_parts = np.empty((groups, K, R, S), gy.dtype)
            db_parts = np.empty((groups, K))                          # float64
            launch(_dw_nchw, groups, x, gy, y, use_mask, need_dw, geo, (nchunks, groups),
                   dw_parts, db_parts, work=work, grain=1)
            if need_dw:
                dw = np.add.reduce(dw_parts, axis=0).reshape(K, 1, R, S)    # group order
        if need_db:
            db = np.add.reduce(db_parts, axis=0).astype(gy.dtype)           # group order
    return dx, dw, db
