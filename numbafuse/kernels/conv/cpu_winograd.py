r"""Winograd F(2x2, 3x3) CPU tasks: the forward, dX and dW of 3x3 stride-1 convolutions.

Each 2x2 block ("tile") of output pixels comes from the 4x4 input patch ``d`` under it
(Lavin & Gray 2015):

    Y = A^T [ U (.) V ] A,   V = B^T d B (the patch transformed),   U = G g G^T (the taps)

with a product per transformed position e = (xi, nu) of the 16, summed over input channels:
16 GEMMs per chunk of tiles, 16/36 of the multiply-adds of a direct convolution, and
transforms made of adds only:

    B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]   G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1]
    A^T = [1 1 1 0; 0 1 -1 -1]

    forward / dX   M[e] (T, Co) = V[e] (T, Ci) @ U[e] (Ci, Co)
    dW             D[e] (K, C) += dM[e]^T (K, T) @ V[e] (T, C)

dX of a 3x3 stride-1 conv is a 3x3 stride-1 correlation of g = gy * (y > 0) (gated while the
patches are read) with the flipped, transposed taps, so the forward task runs it. dW: with
dY the 2x2 gradient of a tile, dM = A dY A^T and dU = dM (.) V, so the taps' gradient is
dw = G^T D G with D[e] = sum over tiles of dM[e] V[e] (the GEMMs above, summed per fixed group
of chunks, then over groups in group order; G^T D G, :func:`winograd_dw`).

Layout: the transformed tiles of a chunk are V[e] (T, Ci) and M[e] (T, Co), rows of channels
(NHWC's order). The padded input rows are split by pixel parity into ``R[u, b][j] = pad[u,
2j + b]`` (L = TX + 1 pixels of Ci), so a tile row's transform is loops over ``TX * Ci``
contiguous values (``_split_rows``, ``_in_hwc``): every inner loop long, contiguous and with
one output stream. NCHW tensors run through the same transforms and GEMMs on *slabs*: a
chunk's input rows of each image are transposed to (rows, W, Ci) in cache (8x8 tiles,
``cpu/transpose.py``; ``_hwc_slab``), and the output rows come out as (rows, Wo, Co) and are
transposed into the NCHW output (dW: x's, gy's and y's rows). NCHW's own transforms (along a
tile row of TX + 1 values) took ~1.6x the time of these next to the same GEMMs and are gone.

A chunk's steps (its tiles' transform, the 16 GEMMs, each image's output rows) are compiled
functions of their own, called by small task kernels: the forward (with or without
batch-norm sums in its epilogue), dX (the forward's kernel on the flipped taps) and dW.

The 16 transformed matrices of a chunk lie ``_estride`` elements apart, a multiple of 4 KB plus
one cache line: matrices exactly a power of two apart put all 16 write streams of a transform
in one L1 set (measured: that alone cost 40% of the transform).

Chunks: tile rows of one image (about ``WINOGRAD_TILES`` tiles), or several whole images when
an image has fewer tiles than that (small images: larger GEMMs, fewer BLAS calls).
"""
import numpy as np
from numba import njit, types

from ..cpu import blas as _blas
from ..cpu.launch import task_kernel
from ..cpu.steps import Step, array as _arr, ready as _ready_steps
from ..scalar import cpu_scalar, relu as _relu_math, relu_grad as _relu_grad_math
from ..cpu.transpose import transpose
from .cpu_chunks import chunk
from . import cpu_epilogue as _epi
from .cpu_winograd_taps import winograd_dw, winograd_taps  # noqa: F401  (cpu.py's _wino.*)

_relu = cpu_scalar(_relu_math)
_relu_grad = cpu_scalar(_relu_grad_math)

_PAGE_BYTES = 4096        # the 16 matrices of a chunk: a multiple of this apart ...
_LINE_BYTES = 64          # ... plus one cache line (distinct L1 sets)


def estride(elements, itemsize):
    """Elements between two of the 16 transformed matrices of a chunk (see the docstring)."""
    page, line = _PAGE_BYTES // itemsize, _LINE_BYTES // itemsize
    return -(-int(elements) // page) * page + line


# --------------------------------------------------------------------------- transforms

# out = x + y, x - y, x or -y: a loop with one output stream each (inlined: the rows are
# short, TX * C values, and an array passed to a compiled call is ~7 arguments)

@njit(inline="always")
def vadd(x, y, out):
    for i in range(out.shape[0]):
        out[i] = x[i] + y[i]


@njit(inline="always")
def vsub(x, y, out):
    for i in range(out.shape[0]):
        out[i] = x[i] - y[i]


@njit(inline="always")
def vcopy(x, out):
    for i in range(out.shape[0]):
        out[i] = x[i]


@njit(inline="always")
def vneg(y, out):
    for i in range(out.shape[0]):
        out[i] = -y[i]


@njit(inline="always")
def _at_rows(m0, m1, m2, m3, s0, s1):
    # rows a = 0, 1 of A^T m: s0 = m0 + m1 + m2, s1 = m1 - m2 - m3 (two loops: LLVM vectorises
    # a loop only while its runtime alias checks stay few, so one output stream per loop)
    for i in range(s0.shape[0]):
        s0[i] = m0[i] + m1[i] + m2[i]
    for i in range(s1.shape[0]):
        s1[i] = m1[i] - m2[i] - m3[i]


@njit(inline="always")
def _a_row(x, y, i, out):
    # row i of A applied to the pair (x, y): x, x + y, x - y, -y
    if i == 0:
        vcopy(x, out)
    elif i == 1:
        vadd(x, y, out)
    elif i == 2:
        vsub(x, y, out)
    else:
        vneg(y, out)


@njit(inline="always")
def _a_dy_at(g00, g01, g10, g11, tmp, dM, base, n):
    # dM[e, base:base + n] <- A dY A^T, dY[a][b] = g_ab (n,) views, tile by tile: rows of A
    # over a: T0 = dY0, T1 = dY0 + dY1, T2 = dY0 - dY1, T3 = -dY1, then the same over b
    # (loops over the rows, each vector loop written twice rather than 12 times)
    for i in range(4):
        for b in range(2):
            _a_row(g00 if b == 0 else g01, g10 if b == 0 else g11, i, tmp[b, :n])
        for j in range(4):
            _a_row(tmp[0, :n], tmp[1, :n], j, dM[4 * i + j, base:base + n])


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


# B^T of F(2, 3) along four values d0 ... d3: row xi is d[_BT_A[xi]] + _BT_SIGN[xi] *
# d[_BT_B[xi]] (d0 - d2, d1 + d2, d2 - d1, d1 - d3)
_BT_A = (0, 1, 2, 1)
_BT_B = (2, 2, 1, 3)
_BT_SIGN = (-1, 1, -1, -1)


@njit(inline="always")
def _add_or_sub(x, y, sign, out):
    # out = x + y (sign > 0) or x - y: two loops, so each call site costs two vector loops
    if sign > 0:
        vadd(x, y, out)
    else:
        vsub(x, y, out)


@njit(nogil=True, cache=True)
def _in_hwc(R, r0, TX, Ci, tv, V, t0):
    # V[e][t0 + tx, :] (rows of Ci) <- B^T d B of the TX tiles of one tile row, whose padded
    # input rows are R[r0 + i], i < 4 (split by column parity: column 2j + b of row i in
    # R[r0 + i, b][j*Ci:(j + 1)*Ci]); tv: (8, L*Ci) scratch, tv[2*xi + b] = row xi of B^T d
    # at the columns of parity b. Loops over the rows and positions, each vector loop written
    # once (unrolled, 24 of them, it compiled several times slower)
    n = (TX + 1) * Ci
    for b in range(2):
        for xi in range(4):
            _add_or_sub(R[r0 + _BT_A[xi], b, :n], R[r0 + _BT_B[xi], b, :n], _BT_SIGN[xi],
                        tv[2 * xi + b, :n])
    m = TX * Ci
    base = t0 * Ci
    for xi in range(4):          # columns d0 ... d3 of the row: tv[2xi + k % 2] at pair k // 2
        for nu in range(4):
            a, b = _BT_A[nu], _BT_B[nu]
            _add_or_sub(tv[2 * xi + a % 2, (a // 2) * Ci:(a // 2) * Ci + m],
                        tv[2 * xi + b % 2, (b // 2) * Ci:(b // 2) * Ci + m], _BT_SIGN[nu],
                        V[4 * xi + nu, base:base + m])


@njit(nogil=True, cache=True)
def _out_hwc(M, t0, TX, p0, bias, relu, s, yn):
    # yn: (Ho, Wo, Co), one image <- (A^T m A) * scale + bias (relu?) of the TX tiles t0 ...
    # of one tile row (rows of Co in M[e]), output rows p0, p0 + 1; bias (2*Co,): the bias,
    # then the scale (ones but for an inference batch norm's: times 1 is exact); s: (8,
    # TX*Co) scratch
    Ho, Wo, Co = yn.shape
    scale = bias[Co:]
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
                v = (q0[k] + q1[k] + q2[k]) * scale[k] + bias[k]
                dst[k] = _relu(v) if relu else v
            if 2 * tx + 1 < Wo:
                dst = yn[p, 2 * tx + 1]
                for k in range(Co):
                    v = (q1[k] - q2[k] - q3[k]) * scale[k] + bias[k]
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


@njit(nogil=True, cache=True)
def _grad_hwc(gy, y, use_mask, n, p0, TX, G, tmp, dM, t0, db):
    # dM[e][t0 + tx, :] (rows of K) <- A dY A^T of the TX tiles of output rows p0, p0 + 1 of
    # image n of g = gy * (y > 0) (gate_tiles into G: (4, TX*K) scratch); db as gate_tiles
    gate_tiles(gy, y, use_mask, n, p0, TX, G, 0, db)
    m = TX * gy.shape[3]
    _a_dy_at(G[0, :m], G[1, :m], G[2, :m], G[3, :m], tmp, dM, t0 * gy.shape[3], m)




# --------------------------------------------------------------------------- chunk steps
#
# A chunk's work in steps, each a compiled function of its own: the task kernels stay small
# enough to compile in seconds, and the stride-1 and stride-2 kernels share the compiled steps
# (padded_rows, store_nchw). Each step loops over whole tile rows, so a call costs nothing
# measurable. A step called directly has its code linked into the caller and compiled again
# there, so the task kernels call theirs through slots (kernels/cpu/steps.py, the Steps below:
# compiled once); a step that calls another directly (the stride-2 chunk_v calls padded_rows)
# has it compiled into it once, so steps stay one level deep (small helpers between them, such
# as _chunk_tiles, are inlined) and are written with few vector loops. A constant passed to
# a step is typed as a literal (a signature of its own, compiled again): flags go as OFF /
# np.int64(0), plain variables.

OFF = np.bool_(False)

@njit(inline="always")
def _hwc_slab(src, gate, use_gate, n, u0, nu, xs, gs):
    # rows [max(0, u0), min(Hs, u0 + nu)) of image n of NCHW src (and gate) transposed to
    # (1, rows, Ws, C) views of the buffers xs, gs: what _split_rows reads as an NHWC image whose
    # row 0 is input row max(0, u0) (rows past it are the zero padding, as in the image)
    sv, gv = _slab_views(src, use_gate, u0, nu, xs, gs)
    h0 = max(0, u0)
    for h in range(h0, h0 + sv.shape[1]):
        transpose(src[n, :, h], sv[0, h - h0])                    # (C, Ws) -> (Ws, C)
        if use_gate:
            transpose(gate[n, :, h], gv[0, h - h0])
    return sv, gv


@njit(inline="always")
def _slab_views(src, use_gate, u0, nu, xs, gs):
    # the (1, rows, Ws, C) views of xs and gs (gs: xs's without the gate) that _hwc_slab fills
    C, Hs, Ws = src.shape[1], src.shape[2], src.shape[3]
    nh = max(0, min(Hs, u0 + nu) - max(0, u0))
    sv = xs[:nh * Ws * C].reshape((1, nh, Ws, C))
    gv = gs[:nh * Ws * C].reshape((1, nh, Ws, C)) if use_gate else sv
    return sv, gv


@njit(nogil=True, cache=True)
def fill_hwc_slab(src, gate, use_gate, n, u0, nu, xs, gs):
    """_hwc_slab compiled on its own, a step (the dW tasks' gy and y rows; they take the
    filled views with _slab_views)."""
    _hwc_slab(src, gate, use_gate, n, u0, nu, xs, gs)


@njit(nogil=True, cache=True)
def padded_rows(src, gate, use_gate, n, u0, nu, c0, L, R, slabs, xs, gs):
    """R <- the rows [u0, u0 + nu) of image n of src (gated) split by column (_split_rows,
    from column c0: -left for a padded input); slabs: of an NCHW src (and gate), through its
    HWC slab in xs (gs). Every Winograd kernel's first step: through padded_rows_step's
    slots, or (the stride-2 chunk_v) called directly, both layouts' code linked in."""
    if slabs:
        padded_rows_slabs(src, gate, use_gate, n, u0, nu, c0, L, R, xs, gs)
    else:
        padded_rows_hwc(src, gate, use_gate, n, u0, nu, c0, L, R)


@njit(nogil=True, cache=True)
def padded_rows_hwc(src, gate, use_gate, n, u0, nu, c0, L, R):
    """:func:`padded_rows` of an NHWC src, a step of its own: NHWC callers compile and ready
    no slab code."""
    _split_rows(src, gate, use_gate, n, u0, nu, c0, L, R)


@njit(nogil=True, cache=True)
def padded_rows_slabs(src, gate, use_gate, n, u0, nu, c0, L, R, xs, gs):
    """:func:`padded_rows` of an NCHW src (through its HWC slab in xs, gs), a step of its
    own: NCHW callers compile and ready no NHWC code."""
    sv, gv = _hwc_slab(src, gate, use_gate, n, u0, nu, xs, gs)
    _split_rows(sv, gv, use_gate, 0, u0 - max(0, u0), nu, c0, L, R)


@njit(inline="always")
def padded_rows_step(args):
    # padded_rows through the step of src's layout: args as padded_rows' (slabs an int64)
    src, gate, use_gate, n, u0, nu, c0, L, R, slabs, xs, gs = args
    if slabs:
        _rows_slabs((src, gate, use_gate, n, u0, nu, c0, L, R, xs, gs))
    else:
        _rows_hwc((src, gate, use_gate, n, u0, nu, c0, L, R))


@njit(inline="always")
def _chunk_tiles(src, gate, use_gate, n0, n1, u0, nr, left, slabs, work, slab):
    # V[e][((n - n0)*nr + r)*TX + tx, :] (rows of Ci) <- B^T d B of the chunk's tiles: nr
    # tile rows of images [n0, n1) from padded input row u0; work = (R, tv, V), slab = the
    # (xs, gs) buffers of the NCHW slabs
    R, tv, V = work
    xs, gs = slab
    Ci = src.shape[1] if slabs else src.shape[3]
    L = R.shape[2] // Ci
    for n in range(n0, n1):
        padded_rows_step((src, gate, use_gate, n, u0, 2 * nr + 2, -left, L, R, slabs, xs, gs))
        for r in range(nr):
            _in_hwc_step((R, 2 * r, L - 1, Ci, tv, V, ((n - n0) * nr + r) * (L - 1)))


@njit(inline="always")
def _forward_gemms(blas, T, V, U, M):
    # M[e] (T, Co) = V[e] (T, Ci) @ U[e] (Ci, Co), e < 16
    Ci, Co = U.shape[1], U.shape[2]
    for e in range(16):
        _blas.gemm(blas, False, False, (T, Co, Ci), 1.0, V[e], Ci, U[e], Co, 0.0, M[e], Co)


@njit(inline="always")
def _out_hw(out, slabs):
    # (N, Ho, Wo) of an output (N, Ho, Wo, Co) | (N, Co, Ho, Wo) (slabs)
    if slabs:
        return out.shape[0], out.shape[2], out.shape[3]
    return out.shape[0], out.shape[1], out.shape[2]


@njit(inline="always")
def _image_rows(M, n, n0, ty0, nr, bias, relu, slabs, s, ys, out):
    # image n's output rows of the chunk (A^T m A + bias, relu?) from M; returns them as a
    # flat (rows*Wo*Co,) HWC view: of ys (slabs: NCHW out, written by store_nchw) or of out
    N, Ho, Wo = _out_hw(out, slabs)
    Co = out.shape[1] if slabs else out.shape[3]
    TX = (Wo + 1) // 2
    p0 = 2 * ty0
    np_ = min(Ho, p0 + 2 * nr) - p0
    if slabs:
        yv = ys[:np_ * Wo * Co].reshape((np_, Wo, Co))
        for r in range(nr):
            _out_hwc_step((M, ((n - n0) * nr + r) * TX, TX, 2 * r, bias, relu, s, yv))
        return ys[:np_ * Wo * Co]
    for r in range(nr):
        _out_hwc_step((M, ((n - n0) * nr + r) * TX, TX, p0 + 2 * r, bias, relu, s, out[n]))
    return out[n].reshape(Ho * Wo * Co)[p0 * Wo * Co:(p0 + np_) * Wo * Co]


@njit(nogil=True, cache=True)
def store_nchw(flat, out, n, p0):
    """out[n, :, p0:p0 + rows] (NCHW) <- the (rows*Wo, Co) HWC rows in flat (every
    Winograd kernel's NCHW output rows, through an HWC slab)."""
    Co, Ho, Wo = out.shape[1], out.shape[2], out.shape[3]
    np_ = flat.shape[0] // (Wo * Co)
    transpose(flat.reshape((np_ * Wo, Co)),
              out[n].reshape((Co, Ho * Wo))[:, p0 * Wo:(p0 + np_) * Wo])


# The stride-1 task kernels below call these steps through slots (kernels/cpu/steps.py):
# each is compiled once, not again inside every kernel that calls it. Their signatures are
# declared here, per float type f (arrays C-contiguous; db sums in float64).
_I, _B = types.int64, types.boolean
ROWS_HWC = Step(padded_rows_hwc.py_func, lambda f: [
    (_arr(f, 4), _arr(f, 4), _B, _I, _I, _I, _I, _I, _arr(f, 3))])
ROWS_SLABS = Step(padded_rows_slabs.py_func, lambda f: [
    (_arr(f, 4), _arr(f, 4), _B, _I, _I, _I, _I, _I, _arr(f, 3), _arr(f, 1), _arr(f, 1))])
IN_HWC = Step(_in_hwc.py_func, lambda f: [
    (_arr(f, 3), _I, _I, _I, _arr(f, 2), _arr(f, 2), _I)])
OUT_HWC = Step(_out_hwc.py_func, lambda f: [
    (_arr(f, 2), _I, _I, _I, _arr(f, 1), _B, _arr(f, 2), _arr(f, 3))])
STORE_NCHW = Step(store_nchw.py_func, lambda f: [(_arr(f, 1), _arr(f, 4), _I, _I)])
GRAD_HWC = Step(_grad_hwc.py_func, lambda f: [
    (_arr(f, 4), _arr(f, 4), _B, _I, _I, _I, _arr(f, 2), _arr(f, 2), _arr(f, 2), _I,
     _arr(types.float64, 1))])
FILL_HWC_SLAB = Step(fill_hwc_slab.py_func, lambda f: [
    (_arr(f, 4), _arr(f, 4), _B, _I, _I, _I, _arr(f, 1), _arr(f, 1))])
_FORWARD_STEPS = (IN_HWC, OUT_HWC)              # forward(_epilogue)_tasks, and layout_steps
_DW_STEPS = (IN_HWC, GRAD_HWC, FILL_HWC_SLAB)      # dw_tasks, and ROWS_HWC or ROWS_SLABS
_rows_hwc, _rows_slabs = ROWS_HWC.call, ROWS_SLABS.call
_in_hwc_step, _out_hwc_step = IN_HWC.call, OUT_HWC.call
_store_nchw, _grad_hwc_step = STORE_NCHW.call, GRAD_HWC.call
_fill_hwc_slab = FILL_HWC_SLAB.call


def layout_steps(nhwc, store=True):
    """The steps only one layout's Winograd kernels call: NHWC's rows, or NCHW's slab rows
    and (``store``) NCHW output store; ``nhwc`` None: both layouts'. A kernel's code calls
    both layouts' slots; only its layout's is ever reached, and only that one is compiled
    on a first call (``padded_rows``' two paths: 1.8-2.5 s cold, about half each)."""
    hwc, nchw = (ROWS_HWC,), (ROWS_SLABS, STORE_NCHW) if store else (ROWS_SLABS,)
    return hwc + nchw if nhwc is None else hwc if nhwc else nchw


def ready(dtype, dw=False, nhwc=None):
    """The steps of the stride-1 forward task kernels (``dw``: of dw_tasks) compiled for
    ``dtype`` and the layout (``nhwc``; None: both) and their slots filled: host code calls
    this before it launches them."""
    _ready_steps(dtype, (_DW_STEPS if dw else _FORWARD_STEPS)
                 + layout_steps(nhwc, store=not dw))


# --------------------------------------------------------------------------- tasks

@task_kernel
def forward_tasks(t0, t1, src, gate, use_gate, U, chunks, bias, relu, blas, out):
    # out: (N, Ho, Wo, Co) | (N, Co, Ho, Wo) (slabs) = relu?(3x3 correlation of src (gated)
    # zero-padded by top/left, * scale + bias), bias (2*Co,): the bias (zeros for none), then
    # the scale (ones for none: an inference batch norm's); src, gate: (N, Hs, Ws, Ci)
    # | (N, Ci, Hs, Ws); U: (16, Ci, Co) from winograd_taps. chunks = (top, left, ipc, tyb,
    # vs, ms, slabs): chunk t is images [n0, n1) (ipc > 1) or tile rows [ty0, ty1) of one
    # image (chunk); vs, ms: estride of V and M; slabs (NCHW): each image's input rows of
    # the chunk are transposed to (rows, Ws, Ci) and its output rows computed as
    # (rows, Wo, Co), then transposed into out
    top, left, ipc, tyb, vs, ms, slabs = chunks
    Ci, Co = U.shape[1], U.shape[2]
    N, Ho, Wo = _out_hw(out, slabs)
    Ws = src.shape[3] if slabs else src.shape[2]
    TY, TX = (Ho + 1) // 2, (Wo + 1) // 2
    L = TX + 1
    rows = TY if ipc > 1 else tyb                                 # tile rows per image, max
    work = (np.empty((2 * rows + 2, 2, L * Ci), src.dtype),       # padded rows by parity
            np.empty((8, L * Ci), src.dtype), np.empty((16, vs), src.dtype))   # V[e] (T, Ci)
    M = np.empty((16, ms), src.dtype)                             # M[e]: (T, Co)
    s = np.empty((8, TX * Co), src.dtype)
    n_in = (2 * rows + 2) * Ws * Ci if slabs else 0               # input rows, HWC
    slab = (np.empty(n_in, src.dtype), np.empty(n_in if use_gate else 0, src.dtype))
    ys = np.empty(2 * rows * Wo * Co if slabs else 0, src.dtype)  # output rows, HWC
    for t in range(t0, t1):
        n0, n1, ty0, ty1 = chunk(t, N, TY, ipc, tyb)
        nr = ty1 - ty0
        _chunk_tiles(src, gate, use_gate, n0, n1, 2 * ty0 - top, nr, left, slabs, work, slab)
        _forward_gemms(blas, (n1 - n0) * nr * TX, work[2], U, M)
        for n in range(n0, n1):
            flat = _image_rows(M, n, n0, ty0, nr, bias, relu, slabs, s, ys, out)
            if slabs:
                _store_nchw((flat, out, n, 2 * ty0))


@task_kernel
def forward_epilogue_tasks(t0, t1, x, U, chunks, blas, out, modes, ev, dg, parts, counts):
    # forward_tasks of an ungated, bias-free conv without ReLU, with batch norm's sums of the
    # rows each chunk wrote into parts[t], counts[t] (cpu_epilogue): modes = (epi, affine),
    # EPI_STATS, or EPI_BN_SUMS with dg = (dy, gz): dy shaped as out (NHWC) and gz <- g, ev
    # (4, mt*Co) the batch-norm values, affine (the ReLU gate); else dg, ev unused
    top, left, ipc, tyb, vs, ms, slabs = chunks
    epi, affine = modes
    dy, gz = dg
    Ci, Co = U.shape[1], U.shape[2]
    N, Ho, Wo = _out_hw(out, slabs)
    Ws = x.shape[3] if slabs else x.shape[2]
    TY, TX = (Ho + 1) // 2, (Wo + 1) // 2
    L = TX + 1
    rows = TY if ipc > 1 else tyb
    work = (np.empty((2 * rows + 2, 2, L * Ci), x.dtype), np.empty((8, L * Ci), x.dtype),
            np.empty((16, vs), x.dtype))
    M = np.empty((16, ms), x.dtype)
    s = np.empty((8, TX * Co), x.dtype)
    slab = (np.empty((2 * rows + 2) * Ws * Ci if slabs else 0, x.dtype), np.empty(0, x.dtype))
    ys = np.empty(2 * rows * Wo * Co if slabs else 0, x.dtype)
    bias = np.zeros(2 * Co, x.dtype)                              # no bias, scale 1
    bias[Co:] = 1
    acc = np.empty((2, ev.shape[1]))                              # epilogue sums, tiled
    shift = np.empty(ev.shape[1])
    for t in range(t0, t1):
        n0, n1, ty0, ty1 = chunk(t, N, TY, ipc, tyb)
        nr = ty1 - ty0
        _epi.start_chunk(acc, counts, t)
        _chunk_tiles(x, x, OFF, n0, n1, 2 * ty0 - top, nr, left, slabs, work, slab)
        _forward_gemms(blas, (n1 - n0) * nr * TX, work[2], U, M)
        p0 = 2 * ty0
        for n in range(n0, n1):
            flat = _image_rows(M, n, n0, ty0, nr, bias, OFF, slabs, s, ys, out)
            dflat = gflat = flat                  # the rows just written, still in cache
            if epi == _epi.EPI_BN_SUMS:
                lo, hi = p0 * Wo * Co, p0 * Wo * Co + flat.shape[0]
                dflat = dy[n].reshape(Ho * Wo * Co)[lo:hi]
                gflat = gz[n].reshape(Ho * Wo * Co)[lo:hi]
            _epi.block_step((flat, dflat, gflat, Co, n == n0, epi, affine, ev, shift, acc,
                             counts, t))
            if slabs:
                _store_nchw((flat, out, n, p0))
        _epi.end_chunk(epi, shift, acc, parts, t)


@task_kernel
def dw_tasks(t0, t1, x, gy, y, use_mask, chunks, need_dw, blas, D_parts, db_parts):
    # x: (N, H, W, C) | (N, C, H, W) (slabs); gy, y: (N, P, Q, K) | (N, K, P, Q); D_parts:
    # (groups, 16, K, C) <- each group's D = sum over its chunks of dM[e] V[e]; db_parts:
    # (groups, K) float64 <- its sum of g. chunks = (top, left, ipc, tyb, vs, ms, slabs,
    # nchunks, groups): chunks as in forward_tasks, over the output's tiles; vs, ms: estride
    # of V and dM; slabs (NCHW): the chunk's rows of x, gy and y transposed to HWC first
    top, left, ipc, tyb, vs, ms, slabs, nchunks, groups = chunks
    if slabs:
        N, K, P, Q = gy.shape
        C, Wx = x.shape[1], x.shape[3]
    else:
        N, P, Q, K = gy.shape
        C, Wx = x.shape[3], x.shape[2]
    TY, TX = (P + 1) // 2, (Q + 1) // 2
    L = TX + 1
    rows = TY if ipc > 1 else tyb
    work = (np.empty((2 * rows + 2, 2, L * C), x.dtype), np.empty((8, L * C), x.dtype),
            np.empty((16, vs if need_dw else 1), x.dtype))       # V[e]: (T, C)
    dM = np.empty((16, ms), x.dtype)                              # dM[e]: (T, K)
    G = np.empty((4, TX * K), x.dtype)
    tmp = np.empty((2, TX * K), x.dtype)
    xs = np.empty((2 * rows + 2) * Wx * C if slabs and need_dw else 0, x.dtype)
    slab = (xs, xs)
    gs = np.empty(2 * rows * Q * K if slabs else 0, x.dtype)      # gy's and y's rows, HWC
    ysb = np.empty(2 * rows * Q * K if slabs and use_mask else 0, x.dtype)
    for grp in range(t0, t1):
        dbp = db_parts[grp]                                       # (K,)
        dbp[:] = 0.0
        beta = 0.0                                                # D = the first chunk's, then +=
        for t in range(grp * nchunks // groups, (grp + 1) * nchunks // groups):
            n0, n1, ty0, ty1 = chunk(t, N, TY, ipc, tyb)
            nr = ty1 - ty0
            T = (n1 - n0) * nr * TX
            for n in range(n0, n1):
                if slabs:
                    _fill_hwc_slab((gy, y, use_mask, n, 2 * ty0, 2 * nr, gs, ysb))
                    gv, yv = _slab_views(gy, use_mask, 2 * ty0, 2 * nr, gs, ysb)
                    for r in range(nr):
                        _grad_hwc_step((gv, yv, use_mask, np.int64(0), 2 * r, TX, G, tmp,
                                        dM, ((n - n0) * nr + r) * TX, dbp))
                else:
                    for r in range(nr):
                        _grad_hwc_step((gy, y, use_mask, n, 2 * (ty0 + r), TX, G, tmp,
                                        dM, ((n - n0) * nr + r) * TX, dbp))
            if not need_dw:
                continue
            _chunk_tiles(x, x, OFF, n0, n1, 2 * ty0 - top, nr, left, slabs, work, slab)
            _dw_gemms(blas, T, dM, work[2], beta, D_parts[grp])
            beta = 1.0


@njit(inline="always")
def _dw_gemms(blas, T, dM, V, beta, D):
    # D[e] (K, C) = dM[e]^T (K, T) @ V[e] (T, C) + beta D[e], e < 16
    K, C = D.shape[1], D.shape[2]
    for e in range(16):
        _blas.gemm(blas, True, False, (K, C, T), 1.0, dM[e], K, V[e], C, beta, D[e], C)
