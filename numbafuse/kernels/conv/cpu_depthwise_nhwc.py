"""Depthwise NHWC task kernels over the register tiles of ``cpu_depthwise_tiles`` (float32,
multiplier 1, C % 8 == 0; ``cpu_depthwise`` launches them and has the loops for every other
case, and the notation):

    forward_tiled  every output pixel through ``depthwise_taps``, addressed in x itself with
                   the taps that lie inside the image (an output row's interior run shares one
                   tap table, a border pixel gets its own); with a mask, over x gated by it,
                   its rows gated per task into a buffer of its own: dX at stride 1 is this
                   kernel over g = gy * (y > 0) with the taps flipped (padding (R-1)*dh - ph,
                   (S-1)*dw - pw), so the two passes share one compiled kernel
    dw_tiled       per output row the gated g (and db from it), then ``depthwise_dw_taps`` over
                   the interior run's pixels and every tap inside, each border pixel over its own

``gate_row`` is the ReLU gradient's gate that every depthwise kernel uses.
"""
import numpy as np
from numba import njit

from .. import scalar
from ..cpu.launch import task_kernel
from . import math as conv_math
from . import cpu_depthwise_tiles as _tiles

# a*b + c as one fused multiply-add (one rounding), as cpu_depthwise's loops
FMA = {"contract"}

_valid_range = scalar.cpu_scalar(conv_math.valid_range)


@njit(cache=True)
def gate_row(gv, yv, use_mask, g):
    # g[i] <- gv[i] * (yv[i] > 0), or gv[i] (no mask): the ReLU's gradient, 1-d views (a
    # select, not a branch: the loop vectorises)
    if use_mask:
        for i in range(g.shape[0]):
            g[i] = gv[i] if yv[i] > 0 else 0
    else:
        for i in range(g.shape[0]):
            g[i] = gv[i]


@njit(cache=True, nogil=True)
def _interior(S, W, Q, sw, pw, dw):
    """(qa, qb): the output columns whose every tap column lies inside a row of W."""
    qa = min(Q, (pw + sw - 1) // sw)
    last = W - 1 - (S - 1) * dw + pw
    return qa, (max(qa, min(Q, last // sw + 1)) if last >= 0 else qa)


@task_kernel(fastmath=FMA)
def forward_tiled(t0, t1, x, mask, wt, b, geo, rpc, flags, aoff, y):
    # Multiplier 1, float32, C % 8 == 0, every pixel through the register tiles
    # (cpu_depthwise_tiles), addressed in x itself with the taps that lie inside the image: an
    # output row's rows of taps [r0, r1); its interior columns (every tap column inside) share
    # one tap table, a border column gets a table of its own taps. x, mask: (N, H, W, C);  wt:
    # (R*S, C);  b: (C,);  aoff: (2, R*S) int64 element offsets of each tap in x and in wt;
    # y: (N, P, Q, C);  flags: (relu, use_mask, wide). Tasks as cpu_depthwise's _forward_nhwc.
    # Each value is the sum over the valid taps in (r, s) order, as the other NHWC kernels
    # make it. With use_mask the input is x where mask > 0, else 0, its rows gated per task
    # into a buffer of the task's own: dX at stride 1 runs here (x = gy, mask = y, the taps
    # flipped; cpu_depthwise.backward), one compiled kernel for both passes.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    relu, use_mask, wide = flags
    nb = (P + rpc - 1) // rpc
    rows = np.empty(Q, np.int64)                                      # pixel addresses in x
    own = np.empty((2, R * S), np.int64)                              # a border pixel's taps
    gbuf = np.empty(((rpc - 1) * sh + (R - 1) * dh + 1 if use_mask else 0, W, C), np.float32)
    qa, qb = _interior(S, W, Q, sw, pw, dw)
    px, py, pb = np.int64(x.ctypes.data), np.int64(y.ctypes.data), np.int64(b.ctypes.data)
    pxo, pwo = np.int64(aoff[0].ctypes.data), np.int64(aoff[1].ctypes.data)
    pown, pownw = np.int64(own[0].ctypes.data), np.int64(own[1].ctypes.data)
    pr, pwt, pbuf = np.int64(rows.ctypes.data), np.int64(wt.ctypes.data), \
        np.int64(gbuf.ctypes.data)
    rel, wid = np.int64(relu), np.int64(wide)
    for t in range(t0, t1):
        n, p0 = t // nb, (t % nb) * rpc
        p1 = min(P, p0 + rpc)
        base = px + 4 * n * H * W * C                              # input row h at base + 4hWC
        if use_mask:                       # the input rows these output rows read, gated
            h0 = max(0, p0 * sh - ph)
            h1 = min(H, (p1 - 1) * sh - ph + (R - 1) * dh + 1)
            for h in range(h0, h1):
                gate_row(x[n, h].ravel(), mask[n, h].ravel(), True, gbuf[h - h0].ravel())
            base = pbuf - 4 * h0 * W * C
        for p in range(p0, p1):
            r0, r1 = _valid_range(p, dh, ph, sh, H, R)              # tap rows inside
            r1 = max(r0, r1)
            for q in range(Q):                                      # first taps' addresses
                rows[q] = base + 4 * ((p * sh - ph) * W + q * sw - pw) * C
            pc = py + 4 * ((n * P + p) * Q * C)
            lo, hi = (qa, qb) if r1 > r0 else (Q, Q)
            q = 0
            while q < Q:               # the interior run, else one border pixel at a time
                if q == lo and hi > lo:
                    m, k, tx, tw = hi - lo, (r1 - r0) * S, pxo + 8 * r0 * S, pwo + 8 * r0 * S
                else:
                    s0, s1 = _valid_range(q, dw, pw, sw, W, S)      # tap columns inside
                    m, k, tx, tw = 1, 0, pown, pownw
                    for r in range(r0, r1):
                        for s in range(s0, s1):
                            own[0, k], own[1, k] = aoff[0, r * S + s], aoff[1, r * S + s]
                            k += 1
                _tiles.depthwise_taps(m, C, k, pr + 8 * q, tx, tw, pwt, pc + 4 * q * C, C, pb,
                                      rel, wid)           # (one call site: one inlined copy)
                q += m


@task_kernel(fastmath=FMA)
def dw_tiled(t0, t1, x, gy, y, use_mask, need_dw, geo, plan, aoff, dw_parts, db_parts):
    # Multiplier 1, float32, C % 8 == 0: dW by the register tiles (cpu_depthwise_tiles.
    # depthwise_dw_taps), addressed in x itself as forward_tiled's forward. x: (N, H, W, C);
    # gy, y: (N, P, Q*C);  aoff: cpu_depthwise._tap_offsets;  dw_parts: (groups, R*S, C);
    # db_parts: (groups, C) float64;  plan: (rpc, nchunks, groups, wide), the tasks those of
    # cpu_depthwise's _dw_nhwc. Per output row: the gated g row (db from it, pixel by pixel as
    # _dw_nhwc), then its interior pixels over every tap inside in one run of tiles, and each
    # border pixel over its own taps.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    rpc, nchunks, groups, wide = plan
    wid = np.int64(wide)
    nb = (P + rpc - 1) // rpc
    g = np.empty(Q * C, np.float32)                                   # one gated row
    zero = np.float32(0)
    own = np.empty((2, R * S), np.int64)                              # a border pixel's taps
    qa, qb = _interior(S, W, Q, sw, pw, dw)
    px, pg = np.int64(x.ctypes.data), np.int64(g.ctypes.data)
    pxo, pwo = np.int64(aoff[0].ctypes.data), np.int64(aoff[1].ctypes.data)
    pown, pownw = np.int64(own[0].ctypes.data), np.int64(own[1].ctypes.data)
    for t in range(t0, t1):
        dwp, dbp = dw_parts[t], db_parts[t]
        dwp[:] = 0
        dbp[:] = 0
        pacc = np.int64(dwp.ctypes.data)
        for chunk in range(t * nchunks // groups, (t + 1) * nchunks // groups):
            n, p0 = chunk // nb, (chunk % nb) * rpc
            for p in range(p0, min(P, p0 + rpc)):
                gv, yv = gy[n, p], y[n, p]
                for q in range(Q):                  # g = gy * (y > 0), db += g, as _dw_nhwc
                    gq, gvq, yvq = g[q * C:(q + 1) * C], gv[q * C:(q + 1) * C], \
                        yv[q * C:(q + 1) * C]
                    if use_mask:
                        for c in range(C):
                            v = gvq[c] if yvq[c] > 0 else zero
                            gq[c] = v
                            dbp[c] += v
                    else:
                        for c in range(C):
                            gq[c] = gvq[c]
                            dbp[c] += gvq[c]
                if not need_dw:
                    continue
                r0, r1 = _valid_range(p, dh, ph, sh, H, R)          # tap rows inside
                if r1 <= r0:
                    continue
                first = px + 4 * (((n * H + p * sh - ph) * W - pw) * C)
                q = 0
                while q < Q:           # the interior run, else one border pixel at a time
                    if q == qa and qb > qa:
                        m, k, tx, tw = qb - qa, (r1 - r0) * S, pxo + 8 * r0 * S, pwo + 8 * r0 * S
                    else:
                        s0, s1 = _valid_range(q, dw, pw, sw, W, S)  # tap columns inside
                        m, k, tx, tw = 1, 0, pown, pownw
                        for r in range(r0, r1):
                            for s in range(s0, s1):
                                own[0, k], own[1, k] = aoff[0, r * S + s], aoff[1, r * S + s]
                                k += 1
                    if k > 0:                                       # (one call site)
                        _tiles.depthwise_dw_taps(m, C, k, first + 4 * q * sw * C, sw * C, tx,
                                                 pg + 4 * q * C, C, pacc, tw, wid)
                    q += m
