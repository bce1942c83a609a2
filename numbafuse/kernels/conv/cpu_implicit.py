r"""The strided convolution's forward as an implicit GEMM over a padded slab of each chunk.

A chunk (output rows [p0, p1) of one image, or whole images: ``cpu._chunking``) copies the
input rows it reads into a zero-padded slab, (images, Hs, Ws, C) with Hs = (rows - 1) * sh +
(R - 1) * dh + 1 and Ws = (Q - 1) * sw + (S - 1) * dw + 1: slab pixel (u, v) of image i is input
pixel (p0 * sh - ph + u, v - pw), zero outside the image. Output pixel (p, q) then reads tap
(r, s) at slab pixel ((p - p0) * sh + r * dh, q * sw + s * dw): one row address per pixel
and one offset per tap, which ``cpu_gemm_taps.gemm_taps`` sums over C in registers, with the
bias and ReLU, straight into y (NHWC) or into a (pixels, K) buffer transposed into y (NCHW).
The slab copies each input value about once (an NCHW source is transposed to HWC on the way,
``cpu_transpose``); im2col copied it R*S / (sh*sw) times and OpenBLAS packed the copy again.

float32, K a multiple of 8 (``fits``); the rest keeps im2col. Every y element is written by
one task; its value is one float32 sum in (r, s, c) order, the same on any thread count.
"""
import numpy as np

from .. import cpu_gemm_taps as _taps
from ..cpu_launch import task_kernel
from ..cpu_transpose import transpose
from .cpu_im2col import _chunk


def fits(geom, dtype):
    """Whether this module computes the forward of ``geom`` for inputs of ``dtype``."""
    return np.dtype(dtype) == np.float32 and geom.K % 8 == 0


def slab_shape(geom, rows):
    """(Hs, Ws) of the slab of ``rows`` output rows."""
    return ((rows - 1) * geom.sh + (geom.R - 1) * geom.dh + 1,
            (geom.Q - 1) * geom.sw + (geom.S - 1) * geom.dw + 1)


def tap_offsets(geom, Ws):
    """Element offsets of the taps (r, s), r-major, from a pixel's corner in the slab."""
    C = geom.C
    return np.array([(r * geom.dh * Ws + s * geom.dw) * C for r in range(geom.R)
                     for s in range(geom.S)], np.int64)


@task_kernel
def _implicit_tasks(t0, t1, x, wt, aoff, b, has_bias, relu, geo, ipc, rpc, Hmax, Ws, wide, y):
    # x: (N, C, H, W) | (N, H, W, C); wt: (R*S, C, K) float32; aoff: (R*S,) int64 (tap_offsets);
    # y: (N, K, PQ) | (N, PQ, K); Hmax: slab rows of the tallest chunk; the chunks [t0, t1)
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    PQ = P * Q
    mmax = ipc * PQ if ipc > 1 else rpc * Q
    slab = np.empty((ipc, Hmax, Ws, C), np.float32)
    rows = np.empty(mmax, np.int64)                   # each output pixel's slab address
    ybuf = np.empty((0 if nhwc else mmax) * K, np.float32)
    wlo = min(pw, Ws)                                 # slab columns [wlo, whi) are input's
    whi = min(Ws, pw + W)
    base = np.int64(slab.ctypes.data)
    for t in range(t0, t1):
        n0, n1, p0, p1 = _chunk(t, N, P, ipc, rpc)
        per = (p1 - p0) * Q
        m = (n1 - n0) * per
        Hs = (p1 - p0 - 1) * sh + (R - 1) * dh + 1
        for i in range(n1 - n0):
            n = n0 + i
            for u in range(Hs):
                h = p0 * sh - ph + u
                d = slab[i, u]                                    # (Ws, C)
                if h < 0 or h >= H or whi <= wlo:
                    d[:, :] = 0
                    continue
                d[:wlo, :] = 0
                d[whi:, :] = 0
                if nhwc:
                    d[wlo:whi, :] = x[n, h, wlo - pw:whi - pw, :]
                else:
                    transpose(x[n, :, h, wlo - pw:whi - pw], d[wlo:whi])   # (C, w) -> (w, C)
            for pp in range(p1 - p0):
                r0 = i * per + pp * Q
                a0 = base + 4 * ((i * Hmax + pp * sh) * Ws * C)
                for q in range(Q):
                    rows[r0 + q] = a0 + 4 * q * sw * C
        if nhwc:
            yc = y.reshape((N * PQ, K))[n0 * PQ + p0 * Q:]            # m rows from here
            pc = np.int64(yc.ctypes.data)
        else:
            pc = np.int64(ybuf.ctypes.data)
        _taps.gemm_taps(np.int64(m), np.int64(K), np.int64(C), np.int64(R * S),
                        np.int64(rows.ctypes.data), np.int64(aoff.ctypes.data),
                        np.int64(wt.ctypes.data), np.int64(K), pc, np.int64(K),
                        np.int64(b.ctypes.data) if has_bias else np.int64(0),
                        np.int64(1 if relu else 0), np.int64(1 if wide else 0))
        if not nhwc:
            yb = ybuf[:m * K].reshape((m, K))
            for i in range(n1 - n0):
                transpose(yb[i * per:(i + 1) * per], y[n0 + i, :, p0 * Q:p1 * Q])
