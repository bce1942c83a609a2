r"""Winograd F(2x2, 3x3) CPU tasks: the forward, dX and dW of 3x3 stride-1 convolutions.

Each 2x2 block ("tile") of output pixels comes from the 4x4 input patch ``d`` under it
(Lavin & Gray 2015):

    Y = A^T [ U (.) V ] A,   V = B^T d B (the patch transformed),   U = G g G^T (the taps)

with a product per transformed position e = (xi, nu) of the 16, summed over input channels:
16 GEMMs per chunk of tiles, 16/36 of the multiply-adds of a direct convolution, and
transforms made of adds only:

    B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]   G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1]
    A^T = [1 1 1 0; 0 1 -1 -1]

    forward / dX   NCHW  M[e] (Co, T) = U[e] (Co, Ci) @ V[e] (Ci, T)
                   NHWC  M[e] (T, Co) = V[e] (T, Ci) @ U[e] (Ci, Co)
    dW             NCHW  D[e] (K, C) += dM[e] (K, T) @ V[e]^T (T, C)
                   NHWC  D[e] (K, C) += dM[e]^T (K, T) @ V[e] (T, C)

dX of a 3x3 stride-1 conv is a 3x3 stride-1 correlation of g = gy * (y > 0) (gated while the
patches are read) with the flipped, transposed taps, so the forward task runs it. dW: with
dY the 2x2 gradient of a tile, dM = A dY A^T and dU = dM (.) V, so the taps' gradient is
dw = G^T D G with D[e] = sum over tiles of dM[e] V[e] (the GEMMs above, summed per fixed group
of chunks, then over groups in group order; G^T D G on the host, :func:`winograd_dw`).

Layout of the transformed tiles (both keep every inner loop long, contiguous and with one
output stream, which is what made the transforms 3x cheaper than patch by patch):

* NCHW: the columns of V[e] (Ci, T) are tiles ``tyl * L + tx`` with ``L = TX + 1``: one *junk*
  tile per tile row (its V and dM are zero, its output is dropped). Then the padded input,
  split into four *phase planes* ``P[a, b][r, j] = pad[2r + a, 2j + b]`` of rows of L, gives
  every patch value of tile t at ``P[a, b][t + (i // 2) * L + (j // 2)]``: each transform is a
  loop over t of a few shifted plane views (``_planes_chw``, ``_in_chw``).
* NHWC: V[e] (T, Ci), tiles without junk; the padded rows are split by pixel parity into
  ``R[u, b][j] = pad[u, 2j + b]`` (L pixels of Ci), so a tile row's transform is loops over
  ``TX * Ci`` contiguous values (``_split_rows``, ``_in_hwc``).
* NCHW through slabs (``WINOGRAD_NCHW_SLABS``, the default): a chunk's input rows of each
  image are transposed to (rows, W, Ci) in cache (8x8 tiles, ``cpu_transpose.py``;
  ``_hwc_slab``) and run through the NHWC transforms and GEMMs; the output rows come out as
  (rows, Wo, Co) and are transposed into the NCHW output (dW: x's, gy's and y's rows). The
  NCHW transforms above vectorise along a tile row of TX + 1 values and took ~1.6x the
  NHWC ones' time next to the same GEMMs (perf, one thread, ResNet layer).

The 16 transformed matrices of a chunk lie ``_estride`` elements apart, a multiple of 4 KB plus
one cache line: matrices exactly a power of two apart put all 16 write streams of a transform
in one L1 set (measured: that alone cost 40% of the transform).

Chunks: tile rows of one image (about ``WINOGRAD_TILES`` tiles), or several whole images when
an image has fewer tiles than that (small images: larger GEMMs, fewer BLAS calls).
"""
import numpy as np
from numba import njit

from .. import cpu_blas as _blas
from ..cpu_launch import task_kernel
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from ..cpu_transpose import transpose
from .cpu_im2col import _chunk, _sum64
from . import cpu_epilogue as _epi

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)

# G (4, 3), the taps transform, in float64 (U and dw are formed in float64, then cast)
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])
_PAGE_BYTES = 4096        # the 16 matrices of a chunk: a multiple of this apart ...
_LINE_BYTES = 64          # ... plus one cache line (distinct L1 sets)


def estride(elements, itemsize):
    """Elements between two of the 16 transformed matrices of a chunk (see the docstring)."""
    page, line = _PAGE_BYTES // itemsize, _LINE_BYTES // itemsize
    return -(-int(elements) // page) * page + line


# --------------------------------------------------------------------------- taps

@njit(cache=True)
def winograd_taps(w, flip, nhwc, out):
    """U = G g G^T for every filter pair, into ``out`` (16, A, B) in the GEMMs' orientation.

    w: (K, C, 3, 3). Forward (flip False): g[k, c] = w[k, c]; dX (flip True): g[c, k] =
    w[k, c, ::-1, ::-1], the flipped, transposed taps. NCHW out[e] is (Co, Ci), NHWC (Ci, Co).
    Formed in float64 (vectorised over c, G's rows are adds and halves), stored in out's dtype.
    """
    K, C = w.shape[0], w.shape[1]
    t = np.empty((4, 3, C))                                       # G g over c, one k
    u = np.empty((16, C))                                         # G g G^T over c
    for k in range(K):
        for s in range(3):
            sc = 2 - s if flip else s
            a, b, c = w[k, :, 2 if flip else 0, sc], w[k, :, 1, sc], w[k, :, 0 if flip else 2, sc]
            t0, t1, t2, t3 = t[0, s], t[1, s], t[2, s], t[3, s]   # (C,) each: rows of G g
            for i in range(C):
                ai, bi, ci = np.float64(a[i]), np.float64(b[i]), np.float64(c[i])
                t0[i] = ai
                t1[i] = 0.5 * (ai + bi + ci)
                t2[i] = 0.5 * (ai - bi + ci)
                t3[i] = ci
        for x in range(4):
            a, b, c = t[x, 0], t[x, 1], t[x, 2]
            u0, u1, u2, u3 = u[4 * x], u[4 * x + 1], u[4 * x + 2], u[4 * x + 3]
            for i in range(C):
                u0[i] = a[i]
                u1[i] = 0.5 * (a[i] + b[i] + c[i])
                u2[i] = 0.5 * (a[i] - b[i] + c[i])
                u3[i] = c[i]
        # (co, ci) = (k, c) forward, (c, k) dX; NCHW stores [co, ci], NHWC [ci, co]
        if flip == nhwc:                                          # out[e, k, :]
            for e in range(16):
                dst, src = out[e, k], u[e]
                for i in range(C):
                    dst[i] = src[i]
        else:                                                     # out[e, :, k]
            for e in range(16):
                src = u[e]
                for i in range(C):
                    out[e, i, k] = src[i]


@njit(cache=True)
def winograd_dw(D, dw):
    """dw (K, C, 3, 3) = G^T D G per filter pair, from D (16, K, C) (float64 sums)."""
    K, C = D.shape[1], D.shape[2]
    t = np.empty((3, 4))                                          # G^T D, one pair
    for k in range(K):
        for c in range(C):
            for r in range(3):
                for y in range(4):
                    acc = 0.0
                    for x in range(4):
                        acc += _G[x, r] * D[4 * x + y, k, c]
                    t[r, y] = acc
            for r in range(3):
                for s in range(3):
                    dw[k, c, r, s] = (t[r, 0] * _G[0, s] + t[r, 1] * _G[1, s]
                                      + t[r, 2] * _G[2, s] + t[r, 3] * _G[3, s])


# --------------------------------------------------------------------------- NCHW transforms

@njit(inline="always")
def _planes_chw(src, gate, use_gate, n, c, u0, nr, left, L, d, P):
    # P: (4, (nr+1)*L + 1) <- the phase planes P[2a + b][r*L + j] = pad[u0 + 2r + a, 2j + b]
    # of image n, channel c of src (gated), pad = src shifted by ``left`` columns, zero
    # outside; the last element (read by the last junk tile) is 0. d: (2L,) scratch row
    Hs, Ws = src.shape[2], src.shape[3]
    Wt = 2 * L
    vlo = min(max(0, left), Wt)
    vhi = max(vlo, min(Wt, left + Ws))
    for u in range(2 * nr + 2):
        h = u0 + u
        a, r = u % 2, u // 2
        pe = P[2 * a, r * L:(r + 1) * L]                          # (L,) even columns
        po = P[2 * a + 1, r * L:(r + 1) * L]                      # (L,) odd columns
        if h < 0 or h >= Hs:
            for j in range(L):
                pe[j] = 0
                po[j] = 0
            continue
        for v in range(vlo):
            d[v] = 0
        for v in range(vhi, Wt):
            d[v] = 0
        dv = d[vlo:vhi]
        sv = src[n, c, h, vlo - left:vhi - left]                  # (vhi - vlo,)
        if use_gate:
            gv = gate[n, c, h, vlo - left:vhi - left]
            for v in range(vhi - vlo):
                dv[v] = _relu_grad(sv[v], gv[v])
        else:
            for v in range(vhi - vlo):
                dv[v] = sv[v]
        for j in range(L):
            pe[j] = d[2 * j]
            po[j] = d[2 * j + 1]
    end = (nr + 1) * L
    for p in range(4):
        P[p, end] = 0


@njit(inline="always")
def _comb(x, y, op, out):
    # out = x + y (op 1), x - y (-1), x (0) or -y (2): a loop with one output stream
    if op == 1:
        for i in range(out.shape[0]):
            out[i] = x[i] + y[i]
    elif op == -1:
        for i in range(out.shape[0]):
            out[i] = x[i] - y[i]
    elif op == 0:
        for i in range(out.shape[0]):
            out[i] = x[i]
    else:
        for i in range(out.shape[0]):
            out[i] = -y[i]


@njit(inline="always")
def _in_chw(P, nr, L, TX, tv, V, c, col, T):
    # V[e][c, col + t] (rows of T) <- B^T d B of tiles t < nr*L from the planes P; tv: (8,
    # nr*L + 1) scratch: tv[2*xi + b] = row xi of B^T d for column parity b
    n = nr * L
    for b in range(2):
        p0, p1 = P[b], P[2 + b]                                   # even rows, odd rows
        # rows of B^T: d0 - d2, d1 + d2, d2 - d1, d1 - d3; d_i = P[i % 2][t + (i // 2)*L]
        _comb(p0[:n + 1], p0[L:L + n + 1], -1, tv[b, :n + 1])
        _comb(p1[:n + 1], p0[L:L + n + 1], 1, tv[2 + b, :n + 1])
        _comb(p0[L:L + n + 1], p1[:n + 1], -1, tv[4 + b, :n + 1])
        _comb(p1[:n + 1], p1[L:L + n + 1], -1, tv[6 + b, :n + 1])
    base = c * T + col
    for xi in range(4):
        te, to = tv[2 * xi], tv[2 * xi + 1]                       # columns 2j, 2j + 1
        # columns of B: d_0 - d_2, d_1 + d_2, d_2 - d_1, d_1 - d_3; d_j = t[j % 2][t + j // 2]
        _comb(te[:n], te[1:n + 1], -1, V[4 * xi, base:base + n])
        _comb(to[:n], te[1:n + 1], 1, V[4 * xi + 1, base:base + n])
        _comb(te[1:n + 1], to[:n], -1, V[4 * xi + 2, base:base + n])
        _comb(to[:n], to[1:n + 1], -1, V[4 * xi + 3, base:base + n])
    for e in range(16):                                           # the junk tiles: 0
        for r in range(nr):
            V[e, base + r * L + TX] = 0


@njit(inline="always")
def _at_rows(m0, m1, m2, m3, s0, s1):
    # rows a = 0, 1 of A^T m: s0 = m0 + m1 + m2, s1 = m1 - m2 - m3 (two loops: LLVM vectorises
    # a loop only while its runtime alias checks stay few, so one output stream per loop)
    for i in range(s0.shape[0]):
        s0[i] = m0[i] + m1[i] + m2[i]
    for i in range(s1.shape[0]):
        s1[i] = m1[i] - m2[i] - m3[i]


@njit(inline="always")
def _out_chw(M, col, nr, L, TX, p0, bk, relu, s, o, yk):
    # yk: (Ho, Wo), one output channel k <- A^T m A + bk (relu?) of the nr*L tiles at
    # M[e, col:] (col = k*T + the image's first tile), output rows p0 + 2r + a; s: (8, nr*L),
    # o: (2, nr*L) scratch
    Ho, Wo = yk.shape
    n = nr * L
    for nu in range(4):
        _at_rows(M[nu, col:col + n], M[4 + nu, col:col + n], M[8 + nu, col:col + n],
                 M[12 + nu, col:col + n], s[nu, :n], s[4 + nu, :n])
    for a in range(2):
        q0, q1, q2, q3 = s[4 * a, :n], s[4 * a + 1, :n], s[4 * a + 2, :n], s[4 * a + 3, :n]
        o0, o1 = o[0, :n], o[1, :n]                               # columns b = 0, 1
        for i in range(n):
            v = q0[i] + q1[i] + q2[i] + bk
            o0[i] = _relu(v) if relu else v
        for i in range(n):
            v = q1[i] - q2[i] - q3[i] + bk
            o1[i] = _relu(v) if relu else v
        for r in range(nr):
            p = p0 + 2 * r + a
            if p >= Ho:
                continue
            row = yk[p]                                           # (Wo,)
            e0, e1 = o0[r * L:r * L + TX], o1[r * L:r * L + TX]   # (TX,) each
            for tx in range(Wo // 2):
                row[2 * tx] = e0[tx]
                row[2 * tx + 1] = e1[tx]
            if Wo % 2:
                row[Wo - 1] = e0[TX - 1]


@njit(inline="always")
def _a_dy_at(g00, g01, g10, g11, tmp, dM, base, n):
    # dM[e, base:base + n] <- A dY A^T, dY[a][b] = g_ab (n,) views, tile by tile: rows of A
    # over a: T0 = dY0, T1 = dY0 + dY1, T2 = dY0 - dY1, T3 = -dY1, then the same over b
    x0, x1 = tmp[0, :n], tmp[1, :n]
    for i in range(4):
        if i == 0:
            _comb(g00, g10, 0, x0)
            _comb(g01, g11, 0, x1)
        elif i == 1:
            _comb(g00, g10, 1, x0)
            _comb(g01, g11, 1, x1)
        elif i == 2:
            _comb(g00, g10, -1, x0)
            _comb(g01, g11, -1, x1)
        else:
            _comb(g10, g10, 2, x0)
            _comb(g11, g11, 2, x1)
        _comb(x0, x1, 0, dM[4 * i, base:base + n])
        _comb(x0, x1, 1, dM[4 * i + 1, base:base + n])
        _comb(x0, x1, -1, dM[4 * i + 2, base:base + n])
        _comb(x1, x1, 2, dM[4 * i + 3, base:base + n])


@njit(inline="always")
def _grad_chw(gy, y, use_mask, n, k, p0, nr, L, G, tmp, dM, base, db):
    # dM[e, base:base + nr*L] <- A dY A^T of the tiles of output rows p0 <= p < p0 + 2*nr of
    # image n, channel k of g = gy * (y > 0); G: (4, nr*L) scratch, G[2a + b][r*L + tx] =
    # g[p0 + 2r + a, 2tx + b] (0 outside the output and in the junk tiles); db (K,) float64
    # += the sum of g (a fixed order)
    P, Q = gy.shape[2], gy.shape[3]
    acc = 0.0
    for a in range(2):
        for r in range(nr):
            p = p0 + 2 * r + a
            ge, go = G[2 * a, r * L:(r + 1) * L], G[2 * a + 1, r * L:(r + 1) * L]   # (L,)
            for j in range(L):
                ge[j] = 0
                go[j] = 0
            if p >= P:
                continue
            gyr, yr = gy[n, k, p], y[n, k, p]                     # (Q,) each
            for j in range(Q // 2):
                if use_mask:
                    ge[j] = _relu_grad(gyr[2 * j], yr[2 * j])
                    go[j] = _relu_grad(gyr[2 * j + 1], yr[2 * j + 1])
                else:
                    ge[j] = gyr[2 * j]
                    go[j] = gyr[2 * j + 1]
            if Q % 2:
                ge[Q // 2] = _relu_grad(gyr[Q - 1], yr[Q - 1]) if use_mask else gyr[Q - 1]
            acc += _sum64(ge) + _sum64(go)
    db[k] += acc
    m = nr * L
    _a_dy_at(G[0, :m], G[1, :m], G[2, :m], G[3, :m], tmp, dM, base, m)


# --------------------------------------------------------------------------- NHWC transforms

@njit(inline="always")
def _split_rows(src, gate, use_gate, n, u0, nu, c0, L, R):
    # R: (nu, m, L*C) <- R[u, b][j*C + c] = g[u0 + u, m*j + b + c0, c] of image n of g = src
    # (gated), zero outside the image: its rows split by column mod m = R.shape[1] (here m = 2
    # with c0 = -left, the padded rows by pixel parity; the stride-2 kernels' m = 4 and 2)
    Hs, Ws, Ci = src.shape[1], src.shape[2], src.shape[3]
    m = R.shape[1]
    for u in range(nu):
        h = u0 + u
        for j in range(L):
            for b in range(m):
                dst = R[u, b, j * Ci:(j + 1) * Ci]                # (Ci,)
                wi = m * j + b + c0
                if h < 0 or h >= Hs or wi < 0 or wi >= Ws:
                    for c in range(Ci):
                        dst[c] = 0
                elif use_gate:
                    sv, gv = src[n, h, wi], gate[n, h, wi]        # (Ci,) each
                    for c in range(Ci):
                        dst[c] = _relu_grad(sv[c], gv[c])
                else:
                    sv = src[n, h, wi]
                    for c in range(Ci):
                        dst[c] = sv[c]


@njit(inline="always")
def _in_hwc(R, r0, TX, Ci, tv, V, t0):
    # V[e][t0 + tx, :] (rows of Ci) <- B^T d B of the TX tiles of one tile row, whose padded
    # input rows are R[r0 + i], i < 4; tv: (8, L*Ci) scratch, tv[2*xi + b] as in _in_chw
    n = (TX + 1) * Ci
    for b in range(2):
        d0, d1, d2, d3 = R[r0, b], R[r0 + 1, b], R[r0 + 2, b], R[r0 + 3, b]   # (L*Ci,)
        _comb(d0[:n], d2[:n], -1, tv[b, :n])
        _comb(d1[:n], d2[:n], 1, tv[2 + b, :n])
        _comb(d2[:n], d1[:n], -1, tv[4 + b, :n])
        _comb(d1[:n], d3[:n], -1, tv[6 + b, :n])
    m = TX * Ci
    base = t0 * Ci
    for xi in range(4):
        te, to = tv[2 * xi], tv[2 * xi + 1]
        _comb(te[:m], te[Ci:Ci + m], -1, V[4 * xi, base:base + m])
        _comb(to[:m], te[Ci:Ci + m], 1, V[4 * xi + 1, base:base + m])
        _comb(te[Ci:Ci + m], to[:m], -1, V[4 * xi + 2, base:base + m])
        _comb(to[:m], to[Ci:Ci + m], -1, V[4 * xi + 3, base:base + m])


@njit(inline="always")
def _out_hwc(M, t0, TX, p0, bias, relu, s, yn):
    # yn: (Ho, Wo, Co), one image <- A^T m A + bias (relu?) of the TX tiles t0 ... of one
    # tile row (rows of Co in M[e]), output rows p0, p0 + 1; s: (8, TX*Co) scratch
    Ho, Wo, Co = yn.shape
    m = TX * Co
    base = t0 * Co
    for nu in range(4):
        _at_rows(M[nu, base:base + m], M[4 + nu, base:base + m], M[8 + nu, base:base + m],
                 M[12 + nu, base:base + m], s[nu, :m], s[4 + nu, :m])
    for a in range(2):
        p = p0 + a
        if p >= Ho:
            continue
        for tx in range(TX):
            o = tx * Co
            q0, q1 = s[4 * a, o:o + Co], s[4 * a + 1, o:o + Co]   # (Co,) each
            q2, q3 = s[4 * a + 2, o:o + Co], s[4 * a + 3, o:o + Co]
            dst = yn[p, 2 * tx]                                   # (Co,)
            for k in range(Co):
                v = q0[k] + q1[k] + q2[k] + bias[k]
                dst[k] = _relu(v) if relu else v
            if 2 * tx + 1 < Wo:
                dst = yn[p, 2 * tx + 1]
                for k in range(Co):
                    v = q1[k] - q2[k] - q3[k] + bias[k]
                    dst[k] = _relu(v) if relu else v


@njit(inline="always")
def gate_tiles(gy, y, use_mask, n, p0, TX, G, t0, db):
    # G: (4, *) <- G[2a + b][(t0 + tx)*K + k] = g[n, p0 + a, 2tx + b, k] (0 outside the
    # output) of the TX 2x2 tiles of output rows p0, p0 + 1 of image n of g = gy * (y > 0)
    # (HWC); db (K,) float64 += g, pixel by pixel (a fixed order)
    P, Q, K = gy.shape[1], gy.shape[2], gy.shape[3]
    for a in range(2):
        p = p0 + a
        for j in range(2 * TX):
            o = (t0 + j // 2) * K
            dst = G[2 * a + j % 2, o:o + K]                       # (K,)
            if p >= P or j >= Q:
                for k in range(K):
                    dst[k] = 0
                continue
            gyr, yr = gy[n, p, j], y[n, p, j]                     # (K,) each
            for k in range(K):
                v = _relu_grad(gyr[k], yr[k]) if use_mask else gyr[k]
                dst[k] = v
                db[k] += v


@njit(inline="always")
def _grad_hwc(gy, y, use_mask, n, p0, TX, G, tmp, dM, t0, db):
    # dM[e][t0 + tx, :] (rows of K) <- A dY A^T of the TX tiles of output rows p0, p0 + 1 of
    # image n of g = gy * (y > 0) (gate_tiles into G: (4, TX*K) scratch); db as gate_tiles
    gate_tiles(gy, y, use_mask, n, p0, TX, G, 0, db)
    m = TX * gy.shape[3]
    _a_dy_at(G[0, :m], G[1, :m], G[2, :m], G[3, :m], tmp, dM, t0 * gy.shape[3], m)


# --------------------------------------------------------------------------- tasks

@task_kernel
def _winograd_tasks(t0, t1, src, gate, use_gate, U, top, left, ipc, tyb, vs, ms, bias, relu,
                    nhwc, slabs, blas, out, epi, affine, dy, gz, ev, parts, counts):
    # src, gate: (N, Ci, Hs, Ws) | (N, Hs, Ws, Ci); U: (16, Co, Ci) | (16, Ci, Co) from
    # winograd_taps (NHWC's orientation with slabs); out: (N, Co, Ho, Wo) | (N, Ho, Wo, Co) =
    # relu?(3x3 correlation of src zero-padded by top/left + bias), bias (Co,) zeros for none.
    # Chunk t: images [n0, n1) (ipc > 1) or tile rows [ty0, ty1) of one image (_chunk); vs,
    # ms: estride of V and M. slabs (NCHW): each image's input rows of the chunk are
    # transposed to (rows, Ws, Ci) and its output rows computed as (rows, Wo, Co), then
    # transposed into out: the NHWC transforms and GEMMs run on NCHW tensors.
    # epi (cpu_epilogue, HWC only): each chunk's batch-norm sums of the rows it wrote into
    # parts[t], counts[t]: EPI_STATS, or EPI_BN_SUMS with dy (shaped as out, NHWC) and gz <- g,
    # ev (4, mt*Co) the batch-norm values, affine (the ReLU gate); else dy, gz, ev, ... unused
    if nhwc:
        N, Ho, Wo, Co = out.shape
        Ws, Ci = src.shape[2], src.shape[3]
    else:
        N, Co, Ho, Wo = out.shape
        Ci, Ws = src.shape[1], src.shape[3]
    hwc = nhwc or slabs
    TY, TX = (Ho + 1) // 2, (Wo + 1) // 2
    L = TX + 1
    rows = TY if ipc > 1 else tyb                                 # tile rows per image, max
    V = np.empty((16, vs), src.dtype)                             # V[e]: (Ci, T) | (T, Ci)
    M = np.empty((16, ms), src.dtype)                             # M[e]: (Co, T) | (T, Co)
    if hwc:
        R = np.empty((2 * rows + 2, 2, L * Ci), src.dtype)        # padded rows by parity
        tv = np.empty((8, L * Ci), src.dtype)
        s = np.empty((8, TX * Co), src.dtype)
        P = np.empty((4, 1), src.dtype)                           # (NCHW only)
        d = np.empty(1, src.dtype)
        o = np.empty((2, 1), src.dtype)
    else:
        R = np.empty((1, 2, 1), src.dtype)                        # (NHWC only)
        tv = np.empty((8, rows * L + 1), src.dtype)
        s = np.empty((8, rows * L), src.dtype)
        P = np.empty((4, (rows + 1) * L + 1), src.dtype)          # phase planes
        d = np.empty(2 * L, src.dtype)
        o = np.empty((2, rows * L), src.dtype)
    xs = np.empty((2 * rows + 2) * Ws * Ci if slabs else 0, src.dtype)   # input rows, HWC
    gs = np.empty((2 * rows + 2) * Ws * Ci if slabs and use_gate else 0, src.dtype)
    ys = np.empty(2 * rows * Wo * Co if slabs else 0, src.dtype)         # output rows, HWC
    acc = np.empty((2, ev.shape[1]))                              # epilogue sums, tiled
    shift = np.empty(ev.shape[1])
    for t in range(t0, t1):
        n0, n1, ty0, ty1 = _chunk(t, N, TY, ipc, tyb)
        nr = ty1 - ty0
        if epi != _epi.EPI_NONE:
            _epi.start_chunk(acc, counts, t)
        if hwc:
            T = (n1 - n0) * nr * TX
            for n in range(n0, n1):
                _padded_rows(src, gate, use_gate, n, 2 * ty0 - top, 2 * nr + 2, -left, L, R,
                             slabs, xs, gs)
                for r in range(nr):
                    _in_hwc(R, 2 * r, TX, Ci, tv, V, ((n - n0) * nr + r) * TX)
            for e in range(16):
                _blas.gemm(blas, False, False, T, Co, Ci, 1.0, V[e], Ci, U[e], Co, 0.0, M[e],
                           Co)
            p0 = 2 * ty0
            np_ = min(Ho, p0 + 2 * nr) - p0                       # output rows of the chunk
            for n in range(n0, n1):
                if slabs:
                    yv = ys[:np_ * Wo * Co].reshape((np_, Wo, Co))
                    for r in range(nr):
                        _out_hwc(M, ((n - n0) * nr + r) * TX, TX, 2 * r, bias, relu, s, yv)
                    flat = ys[:np_ * Wo * Co]
                else:
                    for r in range(nr):
                        _out_hwc(M, ((n - n0) * nr + r) * TX, TX, 2 * (ty0 + r), bias, relu,
                                 s, out[n])
                    flat = out[n].reshape(Ho * Wo * Co)[p0 * Wo * Co:(p0 + np_) * Wo * Co]
                if epi != _epi.EPI_NONE:          # the rows just written, still in cache
                    dflat = gflat = flat
                    if epi == _epi.EPI_BN_SUMS:
                        dflat = dy[n].reshape(Ho * Wo * Co)[p0 * Wo * Co:(p0 + np_) * Wo * Co]
                        gflat = gz[n].reshape(Ho * Wo * Co)[p0 * Wo * Co:(p0 + np_) * Wo * Co]
                    _epi.block(flat, dflat, gflat, Co, n == n0, epi, affine, ev, shift, acc,
                               counts, t)
                if slabs:
                    transpose(flat.reshape((np_ * Wo, Co)),
                              out[n].reshape((Co, Ho * Wo))[:, p0 * Wo:(p0 + np_) * Wo])
            if epi != _epi.EPI_NONE:
                _epi.end_chunk(epi, shift, acc, parts, t)
        else:
            T = (n1 - n0) * nr * L
            for n in range(n0, n1):
                for c in range(Ci):
                    _planes_chw(src, gate, use_gate, n, c, 2 * ty0 - top, nr, left, L, d, P)
                    _in_chw(P, nr, L, TX, tv, V, c, (n - n0) * nr * L, T)
            for e in range(16):
                _blas.gemm(blas, False, False, Co, T, Ci, 1.0, U[e], Ci, V[e], T, 0.0, M[e], T)
            for n in range(n0, n1):
                for k in range(Co):
                    _out_chw(M, k * T + (n - n0) * nr * L, nr, L, TX, 2 * ty0, bias[k], relu, s, o,
                             out[n, k])


@njit(inline="always")
def _hwc_slab(src, gate, use_gate, n, u0, nu, xs, gs):
    # rows [max(0, u0), min(Hs, u0 + nu)) of image n of NCHW src (and gate) transposed to
    # (1, rows, Ws, C) views of the buffers xs, gs: what _split_rows reads as an NHWC image whose
    # row 0 is input row max(0, u0) (rows past it are the zero padding, as in the image)
    C, Hs, Ws = src.shape[1], src.shape[2], src.shape[3]
    h0, h1 = max(0, u0), min(Hs, u0 + nu)
    nh = max(0, h1 - h0)
    sv = xs[:nh * Ws * C].reshape((1, nh, Ws, C))
    gv = sv
    if use_gate:
        gv = gs[:nh * Ws * C].reshape((1, nh, Ws, C))
    for h in range(h0, h1):
        transpose(src[n, :, h], sv[0, h - h0])                    # (C, Ws) -> (Ws, C)
        if use_gate:
            transpose(gate[n, :, h], gv[0, h - h0])
    return sv, gv


@njit(inline="always")
def _padded_rows(src, gate, use_gate, n, u0, nu, c0, L, R, slabs, xs, gs):
    # R <- the rows [u0, u0 + nu) of image n of src (gated) split by column (_split_rows, from
    # column c0: -left for a padded input); slabs: of an NCHW src (and gate), through its HWC
    # slab in xs (gs)
    if slabs:
        sv, gv = _hwc_slab(src, gate, use_gate, n, u0, nu, xs, gs)
        _split_rows(sv, gv, use_gate, 0, u0 - max(0, u0), nu, c0, L, R)
    else:
        _split_rows(src, gate, use_gate, n, u0, nu, c0, L, R)


@task_kernel
def _winograd_dw_tasks(t0, t1, x, gy, y, use_mask, top, left, ipc, tyb, vs, ms, nchunks,
                       groups, need_dw, nhwc, slabs, blas, D_parts, db_parts):
    # x: (N, C, H, W) | (N, H, W, C); gy, y: (N, K, P, Q) | (N, P, Q, K); D_parts: (groups, 16,
    # K, C) <- each group's D = sum over its chunks of dM[e] V[e]; db_parts: (groups, K)
    # float64 <- its sum of g. Chunks as in _winograd_tasks (over the output's tiles); vs,
    # ms: estride of V and dM. slabs (NCHW): the chunk's rows of x, gy and y transposed to
    # HWC first (_hwc_slab), then NHWC's transforms and GEMMs
    if nhwc:
        N, P, Q, K = gy.shape
        C, Wx = x.shape[3], x.shape[2]
    else:
        N, K, P, Q = gy.shape
        C, Wx = x.shape[1], x.shape[3]
    hwc = nhwc or slabs
    TY, TX = (P + 1) // 2, (Q + 1) // 2
    L = TX + 1
    rows = TY if ipc > 1 else tyb
    V = np.empty((16, vs if need_dw else 1), x.dtype)             # V[e]: (C, T) | (T, C)
    dM = np.empty((16, ms), x.dtype)                             # dM[e]: (K, T) | (T, K)
    if hwc:
        R = np.empty((2 * rows + 2, 2, L * C), x.dtype)
        tv = np.empty((8, L * C), x.dtype)
        G = np.empty((4, TX * K), x.dtype)
        tmp = np.empty((2, TX * K), x.dtype)
        Pl = np.empty((4, 1), x.dtype)
        d = np.empty(1, x.dtype)
    else:
        R = np.empty((1, 2, 1), x.dtype)
        tv = np.empty((8, rows * L + 1), x.dtype)
        G = np.empty((4, rows * L), x.dtype)
        tmp = np.empty((2, rows * L), x.dtype)
        Pl = np.empty((4, (rows + 1) * L + 1), x.dtype)
        d = np.empty(2 * L, x.dtype)
    xs = np.empty((2 * rows + 2) * Wx * C if slabs and need_dw else 0, x.dtype)
    gs = np.empty(2 * rows * Q * K if slabs else 0, x.dtype)      # gy's and y's rows, HWC
    ysb = np.empty(2 * rows * Q * K if slabs and use_mask else 0, x.dtype)
    for grp in range(t0, t1):
        dbp = db_parts[grp]                                       # (K,)
        dbp[:] = 0.0
        first = True
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n0, n1, ty0, ty1 = _chunk(t, N, TY, ipc, tyb)
            nr = ty1 - ty0
            if hwc:
                T = (n1 - n0) * nr * TX
                for n in range(n0, n1):
                    if slabs:
                        gv, yv = _hwc_slab(gy, y, use_mask, n, 2 * ty0, 2 * nr, gs, ysb)
                        for r in range(nr):
                            _grad_hwc(gv, yv, use_mask, 0, 2 * r, TX, G, tmp, dM,
                                      ((n - n0) * nr + r) * TX, dbp)
                    else:
                        for r in range(nr):
                            _grad_hwc(gy, y, use_mask, n, 2 * (ty0 + r), TX, G, tmp, dM,
                                      ((n - n0) * nr + r) * TX, dbp)
                if not need_dw:
                    continue
                for n in range(n0, n1):
                    _padded_rows(x, x, False, n, 2 * ty0 - top, 2 * nr + 2, -left, L, R, slabs,
                                 xs, xs)
                    for r in range(nr):
                        _in_hwc(R, 2 * r, TX, C, tv, V, ((n - n0) * nr + r) * TX)
                for e in range(16):
                    # D[e] (K, C) += dM[e]^T (K, T) @ V[e] (T, C)
                    _blas.gemm(blas, True, False, K, C, T, 1.0, dM[e], K, V[e], C,
                               0.0 if first else 1.0, D_parts[grp, e], C)
            else:
                T = (n1 - n0) * nr * L
                for n in range(n0, n1):
                    for k in range(K):
                        _grad_chw(gy, y, use_mask, n, k, 2 * ty0, nr, L, G, tmp, dM,
                                  k * T + (n - n0) * nr * L, dbp)
                if not need_dw:
                    continue
                for n in range(n0, n1):
                    for c in range(C):
                        _planes_chw(x, x, False, n, c, 2 * ty0 - top, nr, left, L, d, Pl)
                        _in_chw(Pl, nr, L, TX, tv, V, c, (n - n0) * nr * L, T)
                for e in range(16):
                    # D[e] (K, C) += dM[e] (K, T) @ V[e]^T (T, C)
                    _blas.gemm(blas, False, True, K, C, T, 1.0, dM[e], T, V[e], T,
                               0.0 if first else 1.0, D_parts[grp, e], C)
            first = False
