r"""Winograd for 3x3 stride-2 convolutions: 25 products a 2x2 output tile instead of 36.

Along one axis, output 0 of a pair reads inputs d0 d1 d2 (taps g0 g1 g2) and output 1 reads
d2 d3 d4. The even inputs d0, d2, d4 meet the taps g0, g2 as a stride-1 correlation with two
taps, which Winograd F(2, 2) computes with 3 products for 2 outputs; the odd inputs d1, d3
meet g1 alone (2 products). So a pair costs 5 products instead of 6:

    m0 = (d0 - d2) g0   m1 = d2 (g0 + g2)   m2 = (d4 - d2) g2   m3 = d1 g1   m4 = d3 g1
    y0 = m0 + m1 + m3   y1 = m1 + m2 + m4

that is, with B^T, G and A^T below, y = A^T [(G g) (.) (B^T d)]. A 2x2 tile of output pixels
(2ty + a, 2tx + b) reads the 5x5 patch d of the zero-padded input at rows 4ty ... 4ty + 4 and
columns 4tx ... 4tx + 4, and in 2-d

    Y = A^T [ U (.) V ] A,   V = B^T d B (the patch),   U = G g G^T (the taps)

    B^T = [1 0 -1 0 0; 0 0 1 0 0; 0 0 -1 0 1; 0 1 0 0 0; 0 0 0 1 0]
    G   = [1 0 0; 1 0 1; 0 0 1; 0 1 0; 0 1 0]
    A^T = [1 1 0 1 0; 0 1 1 0 1]

with a GEMM per transformed position e = (xi, nu) of the 25, summed over input channels:
M[e] (T, K) = V[e] (T, C) @ U[e] (C, K) for the T tiles of a chunk: 25/36 of the
multiply-adds of the direct convolution. Every coefficient is 0 or +-1: V is the patch's
values and differences of two, U sums of up to four taps (formed in float64, then rounded
once), so the rounding is that of a direct convolution's, in another order.

NHWC (and NCHW through HWC slabs of each chunk's input rows, as ``cpu_winograd``): the padded
input rows of a chunk are split by column mod 4, ``R[u, m][j*C + c] = pad[u, 4j + m, c]``, so
each transform is a few loops over TX * C contiguous values of a tile row. The GEMMs run on
``cpu_gemm_taps``' register tiles (one tap, a table of V's row addresses, one offset per
position), float32 with K a multiple of 8.
"""
import numpy as np
from numba import njit

from .. import cpu_gemm_taps as _tiles
from ..cpu_launch import task_kernel
from ..cpu_transpose import transpose
from ..scalar import cpu_scalar, relu as _relu_math
from .cpu_im2col import _chunk
from .cpu_winograd import _comb, _hwc_slab

_relu = cpu_scalar(_relu_math)

POSITIONS = 25


def fits(geom, dtype):
    """Whether this module computes the forward of ``geom`` on inputs of ``dtype``: 3x3,
    stride 2, no dilation, float32, K a multiple of 8 (the register tiles' columns)."""
    return (geom.R == geom.S == 3 and geom.sh == geom.sw == 2 and geom.dh == geom.dw == 1
            and np.dtype(dtype) == np.float32 and geom.K % 8 == 0)


# the taps' transform G (5, 3): which rows (columns) of a 3x3 filter each transformed row
# (column) sums
_G = np.array([[1, 0, 0], [1, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0]], np.int64)


def taps(w):
    """U (25, C, K) float32 = G g G^T of every filter pair g = w[k, c] of w (K, C, 3, 3): each
    entry a sum of up to four taps, formed in float64 and rounded once."""
    K, C = w.shape[0], w.shape[1]
    out = np.empty((POSITIONS, C, K), np.float32)
    _taps(np.ascontiguousarray(w.transpose(2, 3, 1, 0)).reshape(9, C * K),
          out.reshape(POSITIONS, C * K))
    return out


@njit(cache=True)
def _taps(planes, out):
    # out[5i + j] = sum of planes[3r + s] over G[i, r] = G[j, s] = 1 (planes: w[:, :, r, s].T)
    acc = np.empty(planes.shape[1])
    for i in range(5):
        for j in range(5):
            acc[:] = 0.0
            for r in range(3):
                for s in range(3):
                    if _G[i, r] and _G[j, s]:
                        p = planes[3 * r + s]
                        for q in range(acc.shape[0]):
                            acc[q] += p[q]
            o = out[5 * i + j]
            for q in range(acc.shape[0]):
                o[q] = acc[q]


# --------------------------------------------------------------------------- transforms

@njit(inline="always")
def _rows_mod4(src, n, u0, nu, left, L, R):
    # R: (nu, 4, L*C) <- R[u, m][j*C + c] = pad[u0 + u, 4j + m, c] of image n of src (HWC),
    # pad = src shifted by ``left`` columns, zero outside
    Hs, Ws, C = src.shape[1], src.shape[2], src.shape[3]
    for u in range(nu):
        h = u0 + u
        for v in range(4 * L):
            dst = R[u, v % 4, (v // 4) * C:(v // 4 + 1) * C]       # (C,)
            wi = v - left
            if h < 0 or h >= Hs or wi < 0 or wi >= Ws:
                for c in range(C):
                    dst[c] = 0
            else:
                sv = src[n, h, wi]
                for c in range(C):
                    dst[c] = sv[c]


@njit(inline="always")
def _in_row(S, m, C, V, xi, base):
    # V[5*xi + nu][base:base + m] <- column transform (B^T along columns) of one transformed
    # row S (4, L*C), classes mod 4: d0 = S[0][tx], d1 = S[1][tx], d2 = S[2][tx], d3 =
    # S[3][tx], d4 = S[0][tx + 1]
    e = 5 * xi
    _comb(S[0, :m], S[2, :m], -1, V[e, base:base + m])
    _comb(S[2, :m], S[2, :m], 0, V[e + 1, base:base + m])
    _comb(S[0, C:C + m], S[2, :m], -1, V[e + 2, base:base + m])
    _comb(S[1, :m], S[1, :m], 0, V[e + 3, base:base + m])
    _comb(S[3, :m], S[3, :m], 0, V[e + 4, base:base + m])


@njit(inline="always")
def _in_s2(R, u, TX, C, tv, V, t0):
    # V[e][t0 + tx, :] (rows of C) <- B^T d B of the TX tiles of one tile row, whose padded
    # input rows are R[u + i], i < 5; tv: (2, 4, L*C) scratch (rows d0 - d2 and d4 - d2)
    n = R.shape[2]
    for m in range(4):
        _comb(R[u, m, :n], R[u + 2, m, :n], -1, tv[0, m, :n])
        _comb(R[u + 4, m, :n], R[u + 2, m, :n], -1, tv[1, m, :n])
    m = TX * C
    base = t0 * C
    _in_row(tv[0], m, C, V, 0, base)
    _in_row(R[u + 2], m, C, V, 1, base)
    _in_row(tv[1], m, C, V, 2, base)
    _in_row(R[u + 1], m, C, V, 3, base)
    _in_row(R[u + 3], m, C, V, 4, base)


@njit(inline="always")
def _out_s2(M, t0, TX, p0, bias, relu, s, yn):
    # yn: (P, Q, K), one image (or a chunk's rows of it) <- A^T m A + bias (relu?) of the TX
    # tiles t0 ... of one tile row (rows of K in M[e]), output rows p0, p0 + 1; s: (10, TX*K)
    P, Q, K = yn.shape
    m = TX * K
    base = t0 * K
    for nu in range(5):                               # rows of A^T: s[5a + nu]
        m0, m1, m2 = M[nu, base:base + m], M[5 + nu, base:base + m], M[10 + nu, base:base + m]
        m3, m4 = M[15 + nu, base:base + m], M[20 + nu, base:base + m]
        s0, s1 = s[nu, :m], s[5 + nu, :m]
        for i in range(m):
            s0[i] = m0[i] + m1[i] + m3[i]
        for i in range(m):
            s1[i] = m1[i] + m2[i] + m4[i]
    for a in range(2):
        p = p0 + a
        if p >= P:
            continue
        for tx in range(TX):
            o = tx * K
            q0, q1, q2 = s[5 * a, o:o + K], s[5 * a + 1, o:o + K], s[5 * a + 2, o:o + K]
            q3, q4 = s[5 * a + 3, o:o + K], s[5 * a + 4, o:o + K]
            dst = yn[p, 2 * tx]                                   # (K,)
            for k in range(K):
                v = q0[k] + q1[k] + q3[k] + bias[k]
                dst[k] = _relu(v) if relu else v
            if 2 * tx + 1 < Q:
                dst = yn[p, 2 * tx + 1]
                for k in range(K):
                    v = q1[k] + q2[k] + q4[k] + bias[k]
                    dst[k] = _relu(v) if relu else v


# --------------------------------------------------------------------------- tasks

@task_kernel
def _s2_tasks(t0, t1, x, U, top, left, ipc, tyb, vs, ms, bias, relu, nhwc, wide, y):
    # x: (N, H, W, C) | (N, C, H, W); U: (25, C, K) float32 (taps); y: (N, P, Q, K) | (N, K,
    # P, Q) = relu?(the stride-2 3x3 correlation of x zero-padded by top/left + bias). Chunk t:
    # images [n0, n1) (ipc > 1) or tile rows [ty0, ty1) of one image (_chunk); vs, ms:
    # estride of V and M. NCHW: each image's input rows of the chunk are transposed to (rows,
    # W, C) first and its output rows computed as (rows, Q, K), then transposed into y.
    if nhwc:
        N, P, Q, K = y.shape
        W, C = x.shape[2], x.shape[3]
    else:
        N, K, P, Q = y.shape
        C, W = x.shape[1], x.shape[3]
    TY, TX = (P + 1) // 2, (Q + 1) // 2
    L = TX + 1                                        # padded columns of each class mod 4
    rows = TY if ipc > 1 else tyb                     # tile rows per image, most
    V = np.empty((25, vs), np.float32)                # V[e]: (T, C)
    M = np.empty((25, ms), np.float32)                # M[e]: (T, K)
    R = np.empty((4 * rows + 1, 4, L * C), np.float32)
    tv = np.empty((2, 4, L * C), np.float32)
    s = np.empty((10, TX * K), np.float32)
    vrows = np.empty(ipc * rows * TX, np.int64)       # V[0]'s row addresses
    eoff = np.arange(25) * np.int64(vs)               # V[e] from V[0], elements
    xs = np.empty(0 if nhwc else (4 * rows + 1) * W * C, np.float32)   # input rows, HWC
    ys = np.empty(0 if nhwc else 2 * rows * Q * K, np.float32)         # output rows, HWC
    _tiles.dense_rows(vrows, np.int64(V.ctypes.data), ipc * rows * TX, C)
    for t in range(t0, t1):
        n0, n1, ty0, ty1 = _chunk(t, N, TY, ipc, tyb)
        nr = ty1 - ty0
        T = (n1 - n0) * nr * TX
        u0 = 4 * ty0 - top                            # the chunk's first padded input row
        for n in range(n0, n1):
            if nhwc:
                _rows_mod4(x, n, u0, 4 * nr + 1, left, L, R)
            else:
                sv, _ = _hwc_slab(x, x, False, n, u0, 4 * nr + 1, xs, xs)
                _rows_mod4(sv, 0, u0 - max(0, u0), 4 * nr + 1, left, L, R)
            for r in range(nr):
                _in_s2(R, 4 * r, TX, C, tv, V, ((n - n0) * nr + r) * TX)
        for e in range(25):
            _tiles.gemm_taps(np.int64(T), np.int64(K), np.int64(C), np.int64(1),
                            np.int64(vrows.ctypes.data), np.int64(eoff.ctypes.data) + 8 * e,
                            np.int64(U.ctypes.data) + 4 * e * C * K, np.int64(K),
                            np.int64(M.ctypes.data) + 4 * e * ms, np.int64(K), np.int64(0),
                            np.int64(0), np.int64(1 if wide else 0))
        p0 = 2 * ty0
        np_ = min(P, p0 + 2 * nr) - p0                # output rows of the chunk
        for n in range(n0, n1):
            if nhwc:
                for r in range(nr):
                    _out_s2(M, ((n - n0) * nr + r) * TX, TX, 2 * (ty0 + r), bias, relu, s,
                            y[n])
            else:
                yv = ys[:np_ * Q * K].reshape((np_, Q, K))
                for r in range(nr):
                    _out_s2(M, ((n - n0) * nr + r) * TX, TX, 2 * r, bias, relu, s, yv)
                transpose(ys[:np_ * Q * K].reshape((np_ * Q, K)),
                          y[n].reshape((K, P * Q))[:, p0 * Q:(p0 + np_) * Q])

