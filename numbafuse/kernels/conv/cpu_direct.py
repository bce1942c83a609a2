"""CPU convolution tasks without im2col, for stride 1: GEMMs over shifted views of a
zero-padded chunk, and Winograd F(2x2, 3x3) for 3x3 filters. See ``cpu.py``."""
import numpy as np
from numba import njit

from .. import cpu_blas as _blas
from ..cpu_launch import task_kernel
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from . import math as conv_math

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)
_input_coord = cpu_scalar(conv_math.input_coord)
_valid_range = cpu_scalar(conv_math.valid_range)

from .cpu_im2col import _g_chw, _g_hwc  # noqa: E402



# --------------------------------------------------------------------------- stride 1: shifted GEMMs
# A stride-1 convolution needs no im2col. With the input zero-padded to width Wp = Wo + (S-1)*dw
# and flattened over (row, column), output pixel (p, q) reads tap (r, s) at flat offset
# (p + r*dh)*Wp + q + s*dw: the same matrix as output row p's, shifted by r*dh*Wp + s*dw. So a
# chunk's output, computed on the padded width (columns q >= Wo are junk, dropped by the
# epilogue), is a sum of R*S GEMMs over shifted views of one padded copy of the chunk's input:
#
#     NCHW  out (Co, m') += wt[r, s] (Co, Ci) @ pad[:, off : off + m']      (ld of pad)
#     NHWC  out (m', Co) += pad[off : off + m', :] (m', Ci) @ wt[r, s]^T
#
# with m' = rows*Wp. Copying the padded chunk moves ~1x the input instead of R*S times (the
# im2col), and each of the R*S GEMMs (inner dimension Ci) ran at the speed of the one im2col
# GEMM (measured ~95-100 GFLOP/s per thread at Ci = Co = 64). The forward uses it on x with
# wt[r, s] = w[:, :, r, s]; dX, a stride-1 transposed convolution, on g = gy * (y > 0) with the
# flipped taps wt[r, s] = w[:, :, R-1-r, S-1-s]^T; dW = sum over chunks of g' @ shifted pad^T
# per tap, where g' is g on the padded width with zeros in the junk columns.

@njit(inline="always")
def _pad_chw(src, gate, use_gate, n, u0, u1, top, left, Wp, dst):
    # src, gate: (N, C, Hs, Ws); dst: (C, ld) <- rows u0 <= u < u1 of image n zero-padded:
    # dst[c, (u - u0)*Wp + v] = src[n, c, u - top, v - left] (times gate > 0), 0 outside;
    # the columns past (u1 - u0)*Wp (the slack read by the last shifted view) are zeroed
    C, Hs, Ws = src.shape[1], src.shape[2], src.shape[3]
    L = (u1 - u0) * Wp
    vlo = min(max(0, left), Wp)
    vhi = max(vlo, min(Wp, left + Ws))
    for c in range(C):
        row = dst[c]                                              # (ld,)
        for u in range(u0, u1):
            d = row[(u - u0) * Wp:(u - u0 + 1) * Wp]              # (Wp,)
            h = u - top
            if h < 0 or h >= Hs:
                for v in range(Wp):
                    d[v] = 0
                continue
            for v in range(vlo):
                d[v] = 0
            for v in range(vhi, Wp):
                d[v] = 0
            dv = d[vlo:vhi]
            sv = src[n, c, h, vlo - left:vhi - left]              # (vhi - vlo,)
            if use_gate:
                gv = gate[n, c, h, vlo - left:vhi - left]
                for v in range(vhi - vlo):
                    dv[v] = _relu_grad(sv[v], gv[v])
            else:
                for v in range(vhi - vlo):
                    dv[v] = sv[v]
        for i in range(L, row.shape[0]):
            row[i] = 0


@njit(inline="always")
def _pad_hwc(src, gate, use_gate, n, u0, u1, top, left, Wp, dst):
    # src, gate: (N, Hs, Ws, C); dst: (rows, C) <- dst[(u - u0)*Wp + v] = src[n, u - top,
    # v - left] (gated), 0 outside; rows past (u1 - u0)*Wp zeroed
    Hs, Ws, C = src.shape[1], src.shape[2], src.shape[3]
    L = (u1 - u0) * Wp
    vlo = min(max(0, left), Wp)
    vhi = max(vlo, min(Wp, left + Ws))
    flat = dst.reshape(dst.shape[0] * C)
    for u in range(u0, u1):
        d = flat[(u - u0) * Wp * C:(u - u0 + 1) * Wp * C]         # (Wp*C,)
        h = u - top
        if h < 0 or h >= Hs:
            for i in range(Wp * C):
                d[i] = 0
            continue
        for i in range(vlo * C):
            d[i] = 0
        for i in range(vhi * C, Wp * C):
            d[i] = 0
        dv = d[vlo * C:vhi * C]
        sv = src[n, h].reshape(Ws * C)[(vlo - left) * C:(vhi - left) * C]
        if use_gate:
            gv = gate[n, h].reshape(Ws * C)[(vlo - left) * C:(vhi - left) * C]
            for i in range((vhi - vlo) * C):
                dv[i] = _relu_grad(sv[i], gv[i])
        else:
            for i in range((vhi - vlo) * C):
                dv[i] = sv[i]
    for i in range(L * C, flat.shape[0]):
        flat[i] = 0


@task_kernel
def _shifted_tasks(t0, t1, src, gate, use_gate, wt, R, S, dh, dw, top, left, rpc, bias,
                   has_bias, relu, nhwc, blas, out):
    # src, gate: (N, Ci, Hs, Ws) | (N, Hs, Ws, Ci); wt: (R*S, Co, Ci); out: (N, Co, Ho, Wo) |
    # (N, Ho, Wo, Co) = relu?(sum over taps + bias?), chunk t = rows [o0, o1) of one image
    if nhwc:
        N, Ho, Wo, Co = out.shape
        Ci = src.shape[3]
    else:
        N, Co, Ho, Wo = out.shape
        Ci = src.shape[1]
    Wp = Wo + (S - 1) * dw
    ext = (R - 1) * dh                                            # extra padded rows
    slack = (S - 1) * dw
    nblk = (Ho + rpc - 1) // rpc
    pad = np.empty(Ci * ((rpc + ext) * Wp + slack), src.dtype)
    obuf = np.empty(Co * rpc * Wp, src.dtype)
    for t in range(t0, t1):
        n = t // nblk
        o0 = (t - n * nblk) * rpc
        o1 = min(Ho, o0 + rpc)
        m = (o1 - o0) * Wp                                        # pixels on the padded width
        ld = (o1 - o0 + ext) * Wp + slack
        if nhwc:
            pb = pad[:ld * Ci].reshape((ld, Ci))                  # (ld, Ci)
            _pad_hwc(src, gate, use_gate, n, o0, o1 + ext, top, left, Wp, pb)
            ob = obuf[:m * Co].reshape((m, Co))                   # (m', Co)
            for tap in range(R * S):
                off = (tap // S) * dh * Wp + (tap % S) * dw
                _blas.gemm(blas, False, True, m, Co, Ci, 1.0, pb[off:], Ci, wt[tap], Ci,
                           0.0 if tap == 0 else 1.0, ob, Co)
            for p in range(o0, o1):
                for q in range(Wo):
                    sr, dr = ob[(p - o0) * Wp + q], out[n, p, q]  # (Co,) each
                    for k in range(Co):
                        v = sr[k] + (bias[k] if has_bias else 0)
                        dr[k] = _relu(v) if relu else v
        else:
            pb = pad[:Ci * ld].reshape((Ci, ld))                  # (Ci, ld)
            _pad_chw(src, gate, use_gate, n, o0, o1 + ext, top, left, Wp, pb)
            ob = obuf[:Co * m].reshape((Co, m))                   # (Co, m')
            for tap in range(R * S):
                off = (tap // S) * dh * Wp + (tap % S) * dw
                _blas.gemm(blas, False, False, Co, m, Ci, 1.0, wt[tap], Ci, pb[:, off:], ld,
                           0.0 if tap == 0 else 1.0, ob, m)
            for k in range(Co):
                bk = bias[k] if has_bias else 0
                for p in range(o0, o1):
                    sr, dr = ob[k, (p - o0) * Wp:(p - o0) * Wp + Wo], out[n, k, p]   # (Wo,)
                    for q in range(Wo):
                        v = sr[q] + bk
                        dr[q] = _relu(v) if relu else v


@task_kernel
def _shifted_dw_tasks(t0, t1, x, gy, y, use_mask, R, S, dh, dw, ph, pw, rpc, nchunks, groups,
                      need_dw, nhwc, blas, dw_parts, db_parts):
    # x: (N, C, H, W) | (N, H, W, C); gy, y: (N, K, P, Q) | (N, P, Q, K); dw_parts: (groups,
    # R*S, K, C) <- each group's dW per tap; db_parts: (groups, K) float64 <- its sum of g
    if nhwc:
        N, P, Q, K = gy.shape
        C = x.shape[3]
    else:
        N, K, P, Q = gy.shape
        C = x.shape[1]
    Wp = Q + (S - 1) * dw
    ext = (R - 1) * dh
    slack = (S - 1) * dw
    nblk = (P + rpc - 1) // rpc
    pad = np.empty(C * ((rpc + ext) * Wp + slack) if need_dw else 0, x.dtype)
    gbuf = np.empty(K * rpc * Wp, x.dtype)
    for grp in range(t0, t1):
        dbp = db_parts[grp]                                       # (K,)
        dbp[:] = 0.0
        first = True
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n = t // nblk
            p0 = (t - n * nblk) * rpc
            p1 = min(P, p0 + rpc)
            m = (p1 - p0) * Wp
            ld = (p1 - p0 + ext) * Wp + slack
            beta = 0.0 if first else 1.0
            first = False
            if nhwc:
                g = gbuf[:m * K].reshape((m, K))                  # (m', K), junk rows 0
                gy2, y2 = gy[n].reshape((P * Q, K)), y[n].reshape((P * Q, K))
                for p in range(p0, p1):
                    _g_hwc(gy2, y2, use_mask, p * Q, (p + 1) * Q, g, (p - p0) * Wp, dbp)
                    for q in range(Q, Wp):
                        g[(p - p0) * Wp + q, :] = 0
                if not need_dw:
                    continue
                pb = pad[:ld * C].reshape((ld, C))
                _pad_hwc(x, x, False, n, p0, p1 + ext, ph, pw, Wp, pb)
                for tap in range(R * S):
                    off = (tap // S) * dh * Wp + (tap % S) * dw
                    # dW_rs (K, C) += g'^T (K, m') @ pad[off:off+m'] (m', C)
                    _blas.gemm(blas, True, False, K, C, m, 1.0, g, K, pb[off:], C, beta,
                               dw_parts[grp, tap], C)
            else:
                g = gbuf[:K * m].reshape((K, m))                  # (K, m'), junk columns 0
                for p in range(p0, p1):
                    _g_chw(gy.reshape((N, K, P * Q)), y.reshape((N, K, P * Q)), use_mask, n, p,
                           p + 1, P * Q, Q, g, (p - p0) * Wp, dbp)
                    for q in range(Q, Wp):
                        g[:, (p - p0) * Wp + q] = 0
                if not need_dw:
                    continue
                pb = pad[:C * ld].reshape((C, ld))
                _pad_chw(x, x, False, n, p0, p1 + ext, ph, pw, Wp, pb)
                for tap in range(R * S):
                    off = (tap // S) * dh * Wp + (tap % S) * dw
                    # dW_rs (K, C) += g' (K, m') @ pad[:, off:off+m']^T (m', C)
                    _blas.gemm(blas, False, True, K, C, m, 1.0, g, m, pb[:, off:], ld, beta,
                               dw_parts[grp, tap], C)


# --------------------------------------------------------------------------- 3x3, stride 1: Winograd
# F(2x2, 3x3) (Lavin & Gray 2015): each 2x2 block ("tile") of output pixels comes from the 4x4
# input patch under it: Y = A^T [ U (.) V ] A, with V = B^T d B the patch transformed,
# U = G g G^T the 3x3 taps transformed (host side, once per call) and (.) a product per
# transformed position e = (xi, nu) of the 16, summed over input channels: 16 GEMMs per chunk,
#
#     NCHW  M[e] (Co, T) = U[e] (Co, Ci) @ V[e] (Ci, T)     T = tiles of the chunk
#     NHWC  M[e] (T, Co) = V[e] (T, Ci) @ U[e]^T (Ci, Co)
#
# doing 16/36 of the multiply-adds of the shifted GEMMs. The transforms are adds only. The
# forward runs it on x with g[r, s] = w[:, :, r, s]; dX on g = gy * (y > 0) with the flipped,
# transposed taps (as the shifted kernel). Chunks: rows of tiles of one image.
#   B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]   G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1]
#   A^T = [1 1 1 0; 0 1 -1 -1]

_WINO_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def _winograd_taps(wt):
    """U (16, Co, Ci) = G g G^T per (Co, Ci) pair, from the taps wt (3, 3, Co, Ci)."""
    u = np.einsum("xr,ys,rsoi->xyoi", _WINO_G, _WINO_G, wt.astype(np.float64))
    return np.ascontiguousarray(u.reshape(16, *wt.shape[2:]), dtype=wt.dtype)


@njit(inline="always")
def _bt_cols(d0, d1, d2, d3, t0, t1, t2, t3):
    # the B^T combination of four input rows (vectors): t = B^T d down the columns
    for v in range(d0.shape[0]):
        a0, a1, a2, a3 = d0[v], d1[v], d2[v], d3[v]
        t0[v] = a0 - a2
        t1[v] = a1 + a2
        t2[v] = a2 - a1
        t3[v] = a1 - a3


@njit(inline="always")
def _wino_in_chw(src, gate, use_gate, n, ty0, ty1, TX, top, left, d, tb, V):
    # src, gate: (N, Ci, Hs, Ws); V: (16, Ci, T) <- B^T d B of each tile's 4x4 input patch;
    # tile (ty, tx) at column (ty - ty0)*TX + tx reads rows 2ty - top + i, columns 2tx - left
    # + j (0 outside); d, tb: (4, 2*TX + 2) scratch rows
    Ci, Hs, Ws = src.shape[1], src.shape[2], src.shape[3]
    Wt = 2 * TX + 2
    vlo = min(max(0, left), Wt)
    vhi = max(vlo, min(Wt, left + Ws))
    for c in range(Ci):
        for ty in range(ty0, ty1):
            for i in range(4):
                h = 2 * ty - top + i
                row = d[i]                                        # (Wt,)
                if h < 0 or h >= Hs:
                    row[:] = 0
                    continue
                for v in range(vlo):
                    row[v] = 0
                for v in range(vhi, Wt):
                    row[v] = 0
                dv = row[vlo:vhi]
                sv = src[n, c, h, vlo - left:vhi - left]
                if use_gate:
                    gv = gate[n, c, h, vlo - left:vhi - left]
                    for v in range(vhi - vlo):
                        dv[v] = _relu_grad(sv[v], gv[v])
                else:
                    for v in range(vhi - vlo):
                        dv[v] = sv[v]
            _bt_cols(d[0], d[1], d[2], d[3], tb[0], tb[1], tb[2], tb[3])
            col = (ty - ty0) * TX
            for i in range(4):
                r = tb[i]                                         # (Wt,)
                v0 = V[4 * i, c, col:col + TX]                    # (TX,) each
                v1 = V[4 * i + 1, c, col:col + TX]
                v2 = V[4 * i + 2, c, col:col + TX]
                v3 = V[4 * i + 3, c, col:col + TX]
                for tx in range(TX):
                    a0, a1, a2, a3 = r[2 * tx], r[2 * tx + 1], r[2 * tx + 2], r[2 * tx + 3]
                    v0[tx] = a0 - a2
                    v1[tx] = a1 + a2
                    v2[tx] = a2 - a1
                    v3[tx] = a1 - a3


@njit(inline="always")
def _wino_in_hwc(src, gate, use_gate, n, ty0, ty1, TX, top, left, d, tb, V):
    # src, gate: (N, Hs, Ws, Ci); V: (16, T, Ci); d, tb: (4, 4, Ci) scratch (one patch)
    Hs, Ws, Ci = src.shape[1], src.shape[2], src.shape[3]
    for ty in range(ty0, ty1):
        for tx in range(TX):
            for i in range(4):
                h = 2 * ty - top + i
                for j in range(4):
                    wi = 2 * tx - left + j
                    dst = d[i, j]                                 # (Ci,)
                    if h < 0 or h >= Hs or wi < 0 or wi >= Ws:
                        dst[:] = 0
                    elif use_gate:
                        sv, gv = src[n, h, wi], gate[n, h, wi]
                        for c in range(Ci):
                            dst[c] = _relu_grad(sv[c], gv[c])
                    else:
                        sv = src[n, h, wi]
                        for c in range(Ci):
                            dst[c] = sv[c]
            for j in range(4):                                    # tb = B^T d
                _bt_cols(d[0, j], d[1, j], d[2, j], d[3, j], tb[0, j], tb[1, j], tb[2, j],
                         tb[3, j])
            t = (ty - ty0) * TX + tx
            for i in range(4):                                    # V = tb B
                _bt_cols(tb[i, 0], tb[i, 1], tb[i, 2], tb[i, 3], V[4 * i, t], V[4 * i + 1, t],
                         V[4 * i + 2, t], V[4 * i + 3, t])


@task_kernel
def _winograd_tasks(t0, t1, src, gate, use_gate, U, top, left, tyb, bias, has_bias, relu,
                    nhwc, blas, out):
    # src, gate: (N, Ci, Hs, Ws) | (N, Hs, Ws, Ci); U: (16, Co, Ci); out: (N, Co, Ho, Wo) |
    # (N, Ho, Wo, Co) = relu?(3x3 correlation of src zero-padded by top/left + bias?);
    # chunk t = tile rows [ty0, ty1) of one image
    if nhwc:
        N, Ho, Wo, Co = out.shape
        Ci = src.shape[3]
    else:
        N, Co, Ho, Wo = out.shape
        Ci = src.shape[1]
    TY, TX = (Ho + 1) // 2, (Wo + 1) // 2
    nblk = (TY + tyb - 1) // tyb
    vbuf = np.empty(16 * Ci * tyb * TX, src.dtype)
    mbuf = np.empty(16 * Co * tyb * TX, src.dtype)
    scratch = 16 * Ci if nhwc else 4 * (2 * TX + 2)               # one patch | four rows
    d = np.empty(scratch, src.dtype)
    tb = np.empty(scratch, src.dtype)
    ob = np.empty((2, TX), src.dtype)                             # NCHW: two output rows
    for t in range(t0, t1):
        n = t // nblk
        ty0 = (t - n * nblk) * tyb
        ty1 = min(TY, ty0 + tyb)
        T = (ty1 - ty0) * TX
        if nhwc:
            V = vbuf[:16 * T * Ci].reshape((16, T, Ci))
            M = mbuf[:16 * T * Co].reshape((16, T, Co))
            _wino_in_hwc(src, gate, use_gate, n, ty0, ty1, TX, top, left,
                         d.reshape((4, 4, Ci)), tb.reshape((4, 4, Ci)), V)
            for e in range(16):
                _blas.gemm(blas, False, True, T, Co, Ci, 1.0, V[e], Ci, U[e], Ci, 0.0, M[e],
                           Co)
            for ty in range(ty0, ty1):
                for tx in range(TX):
                    tt = (ty - ty0) * TX + tx
                    for a in range(2):
                        p = 2 * ty + a
                        if p >= Ho:
                            continue
                        for b in range(2):
                            q = 2 * tx + b
                            if q >= Wo:
                                continue
                            dst = out[n, p, q]                    # (Co,)
                            for k in range(Co):
                                # rows: s_nu = m[0,nu] + m[1,nu] + m[2,nu] (a=0) or
                                # m[1,nu] - m[2,nu] - m[3,nu] (a=1); then the same on nu
                                if a == 0:
                                    s0 = M[0, tt, k] + M[4, tt, k] + M[8, tt, k]
                                    s1 = M[1, tt, k] + M[5, tt, k] + M[9, tt, k]
                                    s2 = M[2, tt, k] + M[6, tt, k] + M[10, tt, k]
                                    s3 = M[3, tt, k] + M[7, tt, k] + M[11, tt, k]
                                else:
                                    s0 = M[4, tt, k] - M[8, tt, k] - M[12, tt, k]
                                    s1 = M[5, tt, k] - M[9, tt, k] - M[13, tt, k]
                                    s2 = M[6, tt, k] - M[10, tt, k] - M[14, tt, k]
                                    s3 = M[7, tt, k] - M[11, tt, k] - M[15, tt, k]
                                v = (s0 + s1 + s2) if b == 0 else (s1 - s2 - s3)
                                v = v + (bias[k] if has_bias else 0)
                                dst[k] = _relu(v) if relu else v
        else:
            V = vbuf[:16 * Ci * T].reshape((16, Ci, T))
            M = mbuf[:16 * Co * T].reshape((16, Co, T))
            _wino_in_chw(src, gate, use_gate, n, ty0, ty1, TX, top, left,
                         d.reshape((4, 2 * TX + 2)), tb.reshape((4, 2 * TX + 2)), V)
            for e in range(16):
                _blas.gemm(blas, False, False, Co, T, Ci, 1.0, U[e], Ci, V[e], T, 0.0, M[e], T)
            for k in range(Co):
                bk = bias[k] if has_bias else ob[0, 0] * 0       # a zero of the dtype
                for ty in range(ty0, ty1):
                    c0 = (ty - ty0) * TX
                    for a in range(2):
                        p = 2 * ty + a
                        if p >= Ho:
                            continue
                        # s_nu = A^T over xi (row a), then y = the same over nu, per tile:
                        # vectorised over the TX tiles into ob (2, TX), then interleaved
                        o0, o1 = ob[0], ob[1]                     # (TX,) each
                        # row a of A^T m: a = 0 adds xi = 0, 1, 2; a = 1 takes 1, -2, -3
                        e0 = 0 if a == 0 else 4
                        r0, r1, r2, r3 = M[e0, k, c0:c0 + TX], \
                            M[e0 + 1, k, c0:c0 + TX], M[e0 + 2, k, c0:c0 + TX], \
                            M[e0 + 3, k, c0:c0 + TX]
                        q0, q1, q2, q3 = M[e0 + 4, k, c0:c0 + TX], M[e0 + 5, k, c0:c0 + TX], \
                            M[e0 + 6, k, c0:c0 + TX], M[e0 + 7, k, c0:c0 + TX]
                        u0, u1, u2, u3 = M[e0 + 8, k, c0:c0 + TX], M[e0 + 9, k, c0:c0 + TX], \
                            M[e0 + 10, k, c0:c0 + TX], M[e0 + 11, k, c0:c0 + TX]
                        if a == 0:
                            for tx in range(TX):
                                s0 = r0[tx] + q0[tx] + u0[tx]
                                s1 = r1[tx] + q1[tx] + u1[tx]
                                s2 = r2[tx] + q2[tx] + u2[tx]
                                s3 = r3[tx] + q3[tx] + u3[tx]
                                o0[tx] = s0 + s1 + s2 + bk
                                o1[tx] = s1 - s2 - s3 + bk
                        else:
                            for tx in range(TX):
                                s0 = r0[tx] - q0[tx] - u0[tx]
                                s1 = r1[tx] - q1[tx] - u1[tx]
                                s2 = r2[tx] - q2[tx] - u2[tx]
                                s3 = r3[tx] - q3[tx] - u3[tx]
                                o0[tx] = s0 + s1 + s2 + bk
                                o1[tx] = s1 - s2 - s3 + bk
                        if relu:
                            for tx in range(TX):
                                o0[tx] = _relu(o0[tx])
                                o1[tx] = _relu(o1[tx])
                        row = out[n, k, p]                        # (Wo,)
                        for tx in range(Wo // 2):
                            row[2 * tx] = o0[tx]
                            row[2 * tx + 1] = o1[tx]
                        if Wo % 2:
                            row[Wo - 1] = o0[TX - 1]


