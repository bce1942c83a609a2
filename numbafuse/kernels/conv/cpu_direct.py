"""CPU convolution tasks without im2col, for stride 1: GEMMs over shifted views of a
zero-padded chunk (3x3 filters go to ``cpu_winograd.py``). See ``cpu.py``."""
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
