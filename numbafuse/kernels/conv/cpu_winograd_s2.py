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
``cpu.gemm_taps``' register tiles (one tap, a table of V's row addresses, one offset per
position), float32 with K a multiple of 8.
"""
import numpy as np
from numba import njit, types

from ..cpu import gemm_taps as _tiles
from ..cpu.buffers import output_cache as _out
from ..cpu.launch import launch, task_kernel
from ..cpu.steps import Step, array as _arr, ready as _ready_steps
from ..cpu.transpose import transpose
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from .cpu_chunks import chunk, sum64, sum_groups, tile_chunks
from .cpu_winograd import (OFF, STORE_NCHW, estride, gate_tiles, layout_steps, padded_rows,
                           padded_rows_step,
                           vadd, vcopy, vsub)
from .math import int_tuple
from . import weights as _weights

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)

POSITIONS = 25


def fits(geom, dtype, pass_="forward"):
    """Whether this module (or ``cpu_winograd_s2dx``) computes ``pass_`` ("forward", "dx" or
    "dw") of ``geom`` on inputs of ``dtype``: 3x3, stride 2, no dilation, float32, and the
    register tiles' columns (K forward, C for dX and dW) a multiple of 8."""
    return (geom.R == geom.S == 3 and geom.sh == geom.sw == 2 and geom.dh == geom.dw == 1
            and np.dtype(dtype) == np.float32
            and (geom.K if pass_ == "forward" else geom.C) % 8 == 0)


def forward(x, w, b, geom, relu, y, tiles, wide, work):
    """y <- relu?(conv(x, w) + b) (b: zeros for none) by ``_s2_tasks`` in chunks of
    ~``tiles`` tiles; ``wide``: 16-float register tiles."""
    N, C, K, P, Q = geom.N, geom.C, geom.K, geom.P, geom.Q
    ipc, tyb, nchunks, most = tile_chunks(N, P, Q, True, tiles)
    sizes = (geom.ph, geom.pw, ipc, tyb, estride(C * most, 4), estride(K * most, 4))
    _ready_steps(np.float32, FORWARD_STEPS + layout_steps(geom.layout == "NHWC"))
    launch(_s2_tasks, nchunks, x, _weights.derived(w, "s2", lambda: taps(w)),
           int_tuple(*sizes), b,
           (bool(relu), geom.layout == "NHWC", bool(wide)), y, work=work, grain=1)


def dw(x, gy, y, use_mask, geom, need_dw, tiles, groups, wide, work):
    """(dw or None, db_parts (groups, K) float64) of g = gy (* (y > 0) where ``use_mask``) by
    ``_s2_dw_tasks``: chunks of ~``tiles`` tiles in at most ``groups`` fixed groups, each
    with its own partials, summed in group order (float64), then dw = G^T D G."""
    N, C, K, P, Q = geom.N, geom.C, geom.K, geom.P, geom.Q
    ipc, tyb, nchunks, most = tile_chunks(N, P, Q, True, tiles)
    groups = min(nchunks, groups)
    D_parts = _out.empty((groups if need_dw else 1, POSITIONS, K, C), x.dtype)
    db_parts = np.empty((groups, K))
    sizes = (geom.ph, geom.pw, ipc, tyb, estride(C * most, 4), nchunks, groups)
    _ready_steps(np.float32, _DW_STEPS)
    launch(_s2_dw_tasks, groups, x, gy, y, use_mask, int_tuple(*sizes),
           (bool(need_dw), geom.layout == "NHWC", bool(wide)), DM_OF, (D_parts, db_parts),
           work=work, grain=1)
    if not need_dw:
        return None, db_parts
    planes = np.empty((9, K * C))                     # dw = G^T D G: the adjoint of taps
    _sums(_GG_T, sum_groups(D_parts, np.float64).reshape(POSITIONS, K * C), planes)
    return np.ascontiguousarray(planes.reshape(3, 3, K, C).transpose(2, 3, 0, 1),
                                x.dtype), db_parts


# the taps' transform G (5, 3): which rows (columns) of a 3x3 filter each transformed row
# (column) sums; in 2-d kron(G, G) (25, 9): position 5i + j sums tap 3r + s where G[i, r] =
# G[j, s] = 1
_G = np.array([[1, 0, 0], [1, 0, 1], [0, 0, 1], [0, 1, 0], [0, 1, 0]], np.int64)
_GG = np.kron(_G, _G)
_GG_T = np.ascontiguousarray(_GG.T)


def taps(w, GG=_GG, dx=False):
    """U (25, C, K) float32 = G g G^T of every filter pair g = w[k, c] of w (K, C, 3, 3)
    (``GG`` = kron(G, G)): each entry a sum of up to four taps, formed in float64 and rounded
    once. ``dx``: the transposed taps' U (25, K, C) (with the dX's G, ``cpu_winograd_s2dx``).
    A task per _TAPS_BLOCK rows of U's middle axis (input channels; dX: filters) copies each
    row's 9 taps out as rows along U's inner axis, then forms its 25 rows; on the calling
    thread below _TAPS_PARALLEL_MIN values of U. It had been one single-threaded pass holding
    the GIL into a fresh array: 256 x 128 filters 371 us (dX 304; now 155 and 199 on two
    threads), ~0.9 ms of a fused ResNet-18 training step (py-spy)."""
    K, C = w.shape[0], w.shape[1]
    w = np.ascontiguousarray(w, np.float32)
    out = _out.empty((POSITIONS, K, C) if dx else (POSITIONS, C, K), np.float32)
    launch(_taps_tasks, -(-(K if dx else C) // _TAPS_BLOCK), GG, w, bool(dx), out,
           work=out.size, grain=1, parallel_min=_TAPS_PARALLEL_MIN)
    return out


_TAPS_BLOCK = 8
# (1 << 18 until compiled launches: ResNet-18's 64 -> 128 taps, 204,800 values, then ran on
# one thread, 0.85 ms a step; on two 0.55, one process alternating, 12 steps each)
_TAPS_PARALLEL_MIN = 1 << 17


@task_kernel
def _taps_tasks(t0, t1, A, w, dx, out):
    # Task t: rows [t*_TAPS_BLOCK, ...) of out's middle axis (see taps): out[o, i, :] = the
    # sum over A[o, q] = 1, in q order and float64, of tap q's row over out's inner axis. The
    # 9 tap rows of a row i are first copied out of w (a filter pair's 9 taps are contiguous
    # in w) into a buffer that stays in L1 (an 8x8 tile transpose took longer to compile)
    K, C = w.shape[0], w.shape[1]
    L = C if dx else K
    acc = np.empty(L)
    src = np.empty((9, L), w.dtype)
    for t in range(t0, t1):
        for i in range(t * _TAPS_BLOCK, min(K if dx else C, (t + 1) * _TAPS_BLOCK)):
            for j in range(L):
                pair = w[i, j] if dx else w[j, i]                 # (3, 3)
                for q in range(9):
                    src[q, j] = pair[q // 3, q % 3]
            for o in range(A.shape[0]):
                acc[:] = 0.0
                for q in range(9):
                    if A[o, q]:
                        sq = src[q]
                        for j in range(L):
                            acc[j] += sq[j]
                dst = out[o, i]
                for j in range(L):
                    dst[j] = acc[j]


@njit(cache=True)
def _sums(A, src, out):
    # out[o] = the sum of src[q] over A[o, q] = 1 in q order, in float64, then stored in out's
    # dtype (A 0/1, (len(out), len(src)); src, out: rows of one length)
    acc = np.empty(src.shape[1])
    for o in range(A.shape[0]):
        acc[:] = 0.0
        for q in range(A.shape[1]):
            if A[o, q]:
                sq = src[q]
                for i in range(acc.shape[0]):
                    acc[i] += sq[i]
        dst = out[o]
        for i in range(acc.shape[0]):
            dst[i] = acc[i]


# --------------------------------------------------------------------------- transforms

# B^T along a row of classes mod 4 (d0 d1 d2 d3 = classes 0-3 at column group j, d4 = class
# 0 at j + 1): transformed value nu is d_{_CLASS_IN[nu]} at group j + _SHIFT_IN[nu], minus d2
# where nu is 0 or 2 (d0 - d2, d2, d4 - d2, d1, d3)
_CLASS_IN = (0, 2, 0, 1, 3)
_SHIFT_IN = (0, 0, 1, 0, 0)


@njit(nogil=True, cache=True)
def _in_s2(R, u, TX, C, tv, V, t0):
    # V[e][t0 + tx, :] (rows of C) <- B^T d B of the TX tiles of one tile row, whose padded
    # input rows are R[u + i], i < 5; tv: (2, 4, L*C) scratch (rows d0 - d2 and d4 - d2).
    # Written as loops over the rows and positions, each vector loop once: unrolled (a loop
    # per position, 33 in all) the function took 4.4 s to compile
    n = R.shape[2]
    for h in range(2):                                # B^T along the rows: d0 - d2, d4 - d2
        for m in range(4):
            vsub(R[u + 4 * h, m, :n], R[u + 2, m, :n], tv[h, m, :n])
    m = TX * C
    base = t0 * C
    for xi in range(5):                               # rows d0 - d2, d2, d4 - d2, d1, d3
        S = tv[0] if xi == 0 else tv[1] if xi == 2 else R[u + 2] if xi == 1 else (
            R[u + 1] if xi == 3 else R[u + 3])
        for nu in range(5):
            o = _SHIFT_IN[nu] * C
            src, dst = S[_CLASS_IN[nu], o:o + m], V[5 * xi + nu, base:base + m]
            if nu == 0 or nu == 2:
                vsub(src, S[2, :m], dst)
            else:
                vcopy(src, dst)


@njit(nogil=True, cache=True)
def chunk_v(x, rows, slabs, xs, R, tv, V):
    """V <- the transformed patches of a chunk's tiles: rows = (n0, n1, nr, TX, u0, left, L),
    nr tile rows of images [n0, n1) from padded input row u0; slabs: x NCHW, its rows
    transposed to HWC in xs first (the forward's and dW's first step)."""
    n0, n1, nr, TX, u0, left, L = rows
    C = R.shape[2] // L
    for n in range(n0, n1):
        padded_rows(x, x, OFF, n, u0, 4 * nr + 1, -left, L, R, slabs, xs, xs)
        for r in range(nr):
            _in_s2(R, 4 * r, TX, C, tv, V, ((n - n0) * nr + r) * TX)


@njit(inline="always")
def gemm_operands(vs, ms, most, k):
    # the buffers of gemms: V (25, vs) and M (25, ms) float32, the row addresses of V[0]'s
    # ``most`` rows of k elements (vrows) and each V[e]'s offset from V[0] (eoff, elements)
    V = np.empty((25, vs), np.float32)
    M = np.empty((25, ms), np.float32)
    vrows = np.empty(most, np.int64)
    _tiles.dense_rows(vrows, np.int64(V.ctypes.data), most, k)
    return V, M, vrows, np.arange(25) * np.int64(vs)


@njit(nogil=True, cache=True)
def gemms(m, n, k, vrows, eoff, U, M, ms, wide):
    # M[e] (m, n) = V[e] (m, k) @ U[e] (k, n) for the 25 positions: V[e]'s rows at vrows[i] +
    # eoff[e] elements, M[e] at M[e] (row stride n), on the taps tiles
    for e in range(25):
        _tiles.taps_step(((np.int64(m), np.int64(n), np.int64(k)), np.int64(1),
                         np.int64(vrows.ctypes.data), np.int64(eoff.ctypes.data) + 8 * e,
                         np.int64(U.ctypes.data) + 4 * e * k * n, np.int64(n),
                         np.int64(M.ctypes.data) + 4 * e * ms, np.int64(n), np.int64(0),
                         np.int64(0), np.int64(1 if wide else 0)))


@njit(nogil=True, cache=True)
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
        for j in range(min(2 * TX, Q)):               # columns of A^T: (0, 1, 3) or (1, 2, 4)
            o = (j // 2) * K
            b = j % 2
            qa, qb = s[5 * a + b, o:o + K], s[5 * a + 1 + b, o:o + K]
            qc = s[5 * a + 3 + b, o:o + K]
            dst = yn[p, j]                                        # (K,)
            for k in range(K):
                v = qa[k] + qb[k] + qc[k] + bias[k]
                dst[k] = _relu(v) if relu else v


# The task kernels call their steps through slots (kernels/cpu/steps.py: each compiled once,
# not again inside every kernel). float32 only; signatures declared per float type f.
_I, _B, _I64S = types.int64, types.boolean, _arr(types.int64, 1)
IN_S2 = Step(_in_s2.py_func, lambda f: [(_arr(f, 3), _I, _I, _I, _arr(f, 3), _arr(f, 2), _I)])
GEMMS = Step(gemms.py_func, lambda f: [(_I, _I, _I, _I64S, _I64S, _arr(f, 3), _arr(f, 2), _I, _B)],
             calls=(_tiles.GEMM_TAPS,))
OUT_S2 = Step(_out_s2.py_func, lambda f: [
    (_arr(f, 2), _I, _I, _I, _arr(f, 1), _B, _arr(f, 2), _arr(f, 3))])
FORWARD_STEPS = (IN_S2, GEMMS, OUT_S2)             # and the layout's (layout_steps)
_store_nchw = STORE_NCHW.call
_in_s2_step, _gemms, _out_s2_step = IN_S2.call, GEMMS.call, OUT_S2.call


# --------------------------------------------------------------------------- tasks

@task_kernel
def _s2_tasks(t0, t1, x, U, sizes, bias, flags, y):
    top, left, ipc, tyb, vs, ms = sizes
    relu, nhwc, wide = flags
    # x: (N, H, W, C) | (N, C, H, W); U: (25, C, K) float32 (taps); y: (N, P, Q, K) | (N, K,
    # P, Q) = relu?(the stride-2 3x3 correlation of x zero-padded by top/left + bias). Chunk t:
    # images [n0, n1) (ipc > 1) or tile rows [ty0, ty1) of one image (chunk); vs, ms:
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
    V, M, vrows, eoff = gemm_operands(vs, ms, ipc * rows * TX, C)   # V[e] (T, C), M[e] (T, K)
    R = np.empty((4 * rows + 1, 4, L * C), np.float32)
    tv = np.empty((2, 4, L * C), np.float32)
    s = np.empty((10, TX * K), np.float32)
    xs = np.empty(0 if nhwc else (4 * rows + 1) * W * C, np.float32)   # input rows, HWC
    ys = np.empty(0 if nhwc else 2 * rows * Q * K, np.float32)         # output rows, HWC
    for t in range(t0, t1):
        n0, n1, ty0, ty1 = chunk(t, N, TY, ipc, tyb)
        nr = ty1 - ty0
        for n in range(n0, n1):
            padded_rows_step((x, x, OFF, n, 4 * ty0 - top, 4 * nr + 1, -left, L, R,
                              np.int64(not nhwc), xs, xs))
            for r in range(nr):
                _in_s2_step((R, 4 * r, TX, C, tv, V, ((n - n0) * nr + r) * TX))
        _gemms(((n1 - n0) * nr * TX, K, C, vrows, eoff, U, M, ms, wide))
        p0 = 2 * ty0
        np_ = min(P, p0 + 2 * nr) - p0                # output rows of the chunk
        for n in range(n0, n1):
            t0n = (n - n0) * nr * TX
            yv = y[n] if nhwc else ys[:np_ * Q * K].reshape((np_, Q, K))
            for r in range(nr):
                _out_s2_step((M, t0n + r * TX, TX, 2 * r + (p0 if nhwc else 0), bias, relu, s,
                              yv))
            if not nhwc:
                _store_nchw((ys[:np_ * Q * K], y, n, p0))


# --------------------------------------------------------------------------- dW

# dM = A dY A^T of a tile's 2x2 gradient dY: along each axis, positions 0 and 3 take dY's
# first row (column), 2 and 4 its second, 1 their sum; so 9 distinct matrices, one per pair
# of classes (0: first, 1: sum, 2: second), kept as (K, T) in dm[_CLASS[class_row,
# class_col]]: 0-3 the gradient's four pixel classes (2a + b), 4-8 their sums
_AXIS = np.array([0, 1, 2, 0, 2], np.int64)
_CLASS = np.array([[0, 4, 1], [6, 8, 7], [2, 5, 3]], np.int64)
DM_OF = _CLASS[_AXIS[:, None], _AXIS[None, :]].reshape(POSITIONS)   # position e -> dm[...]
_SUMS_OF = ((0, 1), (2, 3), (0, 2), (1, 3), (4, 5))   # dm[4 + i] = dm[a] + dm[b]


@njit(nogil=True, cache=True)
def _grad_s2_chw(gy, y, use_mask, n, p0, nr, TX, dm, T, t0, db):
    # dm: (9, *) <- dm[2a + b][k*T + t0 + r*TX + tx] = g[n, k, p0 + 2r + a, 2tx + b] (0
    # outside the output) of the nr tile rows from output row p0 of image n of g = gy * (y >
    # 0) (CHW), straight into the (K, T) layout of the GEMMs; db (K,) float64 += g, per
    # channel: the sums of its four pixel classes (a fixed order)
    K, P, Q = gy.shape[1], gy.shape[2], gy.shape[3]
    m = nr * TX
    for k in range(K):                # indices, not views: a view per row cost ~1 ms a pass
        gk, yk = gy[n, k], y[n, k]                                # (P, Q) each
        base = k * T + t0
        for pl in range(2 * nr):
            a, p = pl % 2, p0 + pl
            o = base + (pl // 2) * TX
            if p >= P:
                for tx in range(TX):
                    dm[2 * a, o + tx] = 0
                    dm[2 * a + 1, o + tx] = 0
                continue
            for tx in range(Q // 2):
                ve, vo = gk[p, 2 * tx], gk[p, 2 * tx + 1]
                if use_mask:
                    ve, vo = _relu_grad(ve, yk[p, 2 * tx]), _relu_grad(vo, yk[p, 2 * tx + 1])
                dm[2 * a, o + tx] = ve
                dm[2 * a + 1, o + tx] = vo
            if Q % 2:
                v = gk[p, Q - 1]
                dm[2 * a, o + TX - 1] = _relu_grad(v, yk[p, Q - 1]) if use_mask else v
                dm[2 * a + 1, o + TX - 1] = 0
        db[k] += (sum64(dm[0, base:base + m]) + sum64(dm[1, base:base + m])
                  + sum64(dm[2, base:base + m]) + sum64(dm[3, base:base + m]))


@task_kernel
def _s2_dw_tasks(t0, t1, x, gy, y, use_mask, sizes, flags, dm_of, parts):
    top, left, ipc, tyb, vs, nchunks, groups = sizes
    need_dw, nhwc, wide = flags
    D_parts, db_parts = parts
    # x: (N, H, W, C) | (N, C, H, W); gy, y: (N, P, Q, K) | (N, K, P, Q); D_parts: (groups,
    # 25, K, C) <- each group's D[e] = sum over its chunks of dM[e]^T (K, T) @ V[e] (T, C);
    # db_parts: (groups, K) float64 <- its sums of g. Chunks as _s2_tasks' (tiles of the
    # output); vs: estride of V; dm_of (25,): DM_OF. NCHW: the chunk's rows of x transposed to
    # HWC first, g read straight into dM's (K, T) layout
    if nhwc:
        N, P, Q, K = gy.shape
        W, C = x.shape[2], x.shape[3]
    else:
        N, K, P, Q = gy.shape
        C, W = x.shape[1], x.shape[3]
    TY, TX = (P + 1) // 2, (Q + 1) // 2
    L = TX + 1
    rows = TY if ipc > 1 else tyb
    most = ipc * rows * TX                            # tiles of a chunk, at most
    V, _, vrows, _ = gemm_operands(vs if need_dw else 1, 0, most, C)  # V[e] (T, C)
    R = np.empty((4 * rows + 1 if need_dw else 1, 4, L * C), np.float32)
    tv = np.empty((2, 4, L * C), np.float32)
    G4 = np.empty((4, most * K if nhwc else 0), np.float32)   # g by pixel class, (T, K)
    dm = np.empty((9, K * most), np.float32)          # dM's 9 matrices, (K, T) each
    xs = np.empty(0 if nhwc or not need_dw else (4 * rows + 1) * W * C, np.float32)
    for grp in range(t0, t1):
        dbp = db_parts[grp]                                       # (K,)
        dbp[:] = 0.0
        beta = 0
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n0, n1, ty0, ty1 = chunk(t, N, TY, ipc, tyb)
            nr = ty1 - ty0
            T = (n1 - n0) * nr * TX
            _chunk_dm_step((gy, y, use_mask, (nhwc, need_dw), (n0, n1, ty0, nr, TX), G4, dm,
                            dbp))
            if not need_dw:
                continue
            _chunk_v((x, (n0, n1, nr, TX, 4 * ty0 - top, left, L), np.int64(not nhwc), xs, R,
                      tv, V))
            _dw_gemms_step((K, C, T, dm, dm_of, vrows, vs, D_parts[grp], beta, wide))
            beta = 1


@njit(nogil=True, cache=True)
def _chunk_dm(gy, y, use_mask, flags, rows, G4, dm, db):
    # db (K,) float64 += the chunk's gradient g = gy (* (y > 0)); with need_dw, dm[0:4] <- g
    # by pixel class, (K, T) each, and dm[4:9] their sums (_CLASS). rows = (n0, n1, ty0, nr,
    # TX): nr tile rows of images [n0, n1) from tile row ty0; G4: NHWC's (4, T*K) scratch
    nhwc, need_dw = flags
    n0, n1, ty0, nr, TX = rows
    K = gy.shape[3] if nhwc else gy.shape[1]
    T = (n1 - n0) * nr * TX
    for n in range(n0, n1):
        if nhwc:
            for r in range(nr):
                gate_tiles(gy, y, use_mask, n, 2 * (ty0 + r), TX, G4,
                           ((n - n0) * nr + r) * TX, db)
        else:                                             # straight into dm's (K, T)
            _grad_s2_chw(gy, y, use_mask, n, 2 * ty0, nr, TX, dm, T, (n - n0) * nr * TX, db)
    if not need_dw:
        return
    if nhwc:
        for c in range(4):
            transpose(G4[c, :T * K].reshape((T, K)), dm[c, :K * T].reshape((K, T)))
    kt = K * T
    for i in range(5):                                # dm[4 + i] = dm[a] + dm[b]
        a, b = _SUMS_OF[i]
        vadd(dm[a, :kt], dm[b, :kt], dm[4 + i, :kt])


@njit(nogil=True, cache=True)
def _dw_gemms(K, C, T, dm, dm_of, vrows, vs, D, beta, wide):
    # D[e] (K, C) = dM[e]^T (K, T) @ V[e] (T, C) (+ D[e] where beta) for the 25 positions:
    # dM[e] = dm[dm_of[e]], V[e]'s rows at vrows[i] + e*vs elements
    dmp = np.int64(dm.ctypes.data)
    for e in range(25):
        _tiles.gather_step((np.int64(K), np.int64(C), np.int64(T),
                           dmp + 4 * dm_of[e] * dm.shape[1], np.int64(T),
                           np.int64(vrows.ctypes.data), np.int64(e) * vs,
                           np.int64(D[e].ctypes.data), np.int64(C),
                           np.int64(beta), np.int64(1 if wide else 0)))


CHUNK_DM = Step(_chunk_dm.py_func, lambda f: [
    (_arr(f, 4), _arr(f, 4), _B, types.UniTuple(_B, 2), types.UniTuple(_I, 5), _arr(f, 2),
     _arr(f, 2), _arr(types.float64, 1))])
CHUNK_V = Step(chunk_v.py_func, lambda f: [     # (slabs an int64 flag, as padded_rows')
    (_arr(f, 4), types.UniTuple(_I, 7), _I, _arr(f, 1), _arr(f, 3), _arr(f, 3), _arr(f, 2))])
DW_GEMMS = Step(_dw_gemms.py_func, lambda f: [
    (_I, _I, _I, _arr(f, 2), _I64S, _I64S, _I, _arr(f, 3), _I, _B)], calls=(_tiles.GEMM_GATHER,))
_DW_STEPS = (CHUNK_DM, CHUNK_V, DW_GEMMS)
_chunk_dm_step, _chunk_v, _dw_gemms_step = CHUNK_DM.call, CHUNK_V.call, DW_GEMMS.call
