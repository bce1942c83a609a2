r"""Winograd dX of 3x3 stride-2 convolutions: 25 products a 4x4 block of dx instead of 36.

Along one axis, dx at a padded position u reads g through tap r where u = 2p + r: an even u
two taps (w0 from g[u/2], w2 from g[u/2 - 1]), an odd u one (w1 from g[(u-1)/2]). Four dx
values from an even u read three g values a, b, c (consecutive) as

    x0 = b w0 + a w2   x1 = b w1   x2 = c w0 + b w2   x3 = c w1

where x0 and x2 are a stride-1 correlation of (a, b, c) with two taps, Winograd F(2, 2):

    m0 = (a - b) w2   m1 = b (w0 + w2)   m2 = (c - b) w0   m3 = b w1   m4 = c w1
    x0 = m0 + m1      x1 = m3            x2 = m1 + m2      x3 = m4

and four from an odd u the same products with m3 = a w1, m4 = b w1 and the outputs in the
order (m3, m0 + m1, m4, m1 + m2). 5 products for 4 values instead of 6. The blocks start at
dx row (column) 0, 4, 8, ... whatever the padding: its parity picks the form, so no block
is wasted on the padding. In 2-d a 4x4 block of dx comes from the 3x3 patch of g above it
with a GEMM per position e of the 25, M[e] (T, C) = V[e] (T, K) @ U[e] (K, C). Blocks never
overlap (their patches do, by a row and a column, read only), so every dx element is written
by one task, with no sums between chunks. The taps' transform, the same for both forms, is
the forward's G with rows 0 and 2 swapped (``G_DX``), applied to the transposed taps.

Layout as the forward (``cpu_winograd_s2``): g's rows split by column parity from the first
column a block reads, ``R[v, 0][j*K + k] = g[v, 2j + c0, k]`` and ``R[v, 1][j*K + k] = g[v,
2j + c0 + 1, k]`` (a = R0[j], b = R1[j], c = R0[j + 1]), gated by y > 0 on the way; NCHW
through HWC slabs of the chunk's rows of gy and y, its dx rows transposed back.
"""
import numpy as np
from numba import njit, types

from ..cpu.launch import launch, task_kernel
from ..cpu.steps import Step, array as _arr, ready as _ready_steps
from .cpu_chunks import block_chunks, chunk
from .cpu_winograd import STORE_NCHW, estride, layout_steps, padded_rows_step, vcopy, vsub
from .cpu_winograd_s2 import GEMMS, gemm_operands, taps
from .math import int_tuple

# which taps each transformed position sums (per axis): w2, w0 + w2, w0, w1, w1
G_DX = np.array([[0, 0, 1], [1, 0, 1], [1, 0, 0], [0, 1, 0], [0, 1, 0]], np.int64)
_GG_DX = np.kron(G_DX, G_DX)


def dx(gy, y, use_mask, w, geom, out, tiles, wide, work):
    """out (dx) <- the dX of g = gy (* (y > 0) where ``use_mask``) by ``_s2_dx_tasks``, in
    chunks of ~``tiles`` 4x4 blocks; ``wide``: 16-float register tiles."""
    N, C, K, H, W = geom.N, geom.C, geom.K, geom.H, geom.W
    ipc, ib, nchunks, most = block_chunks(N, -(-H // 4), -(-W // 4), tiles)
    sizes = (geom.ph, geom.pw, ipc, ib, estride(K * most, 4), estride(C * most, 4))
    _ready_steps(np.float32, _STEPS + layout_steps(geom.layout == "NHWC"))
    launch(_s2_dx_tasks, nchunks, gy, y, use_mask, taps(w, _GG_DX, dx=True),
           int_tuple(*sizes), (geom.layout == "NHWC", bool(wide)), out, work=work,
           grain=1)


# the column transform of a row of g split by parity (a = class 0 at pair j, b = class 1 at
# j, c = class 0 at j + 1): position nu is operand _FIRST[odd][nu] (0: a, 1: b, 2: c) minus
# b where nu is 0 or 2 (a - b, b, c - b, then b, c; odd: a, b)
_FIRST = ((0, 1, 2, 1, 2), (0, 1, 2, 0, 1))


@njit(nogil=True, cache=True)
def _in_dx(R, v, IX, K, oddh, oddw, tv, V, t0):
    # V[e][t0 + j, :] (rows of K) <- the transformed 3x3 patches of the IX blocks of one block
    # row, whose g rows are R[v], R[v + 1], R[v + 2] (a, b, c); tv: (2, 2, L*K) scratch.
    # Loops over rows and positions, each vector loop written once (unrolled: 3 s to compile)
    n = R.shape[2]
    for h in range(2):                                # along the rows: a - b, c - b
        for cl in range(2):
            vsub(R[v + 2 * h, cl, :n], R[v + 1, cl, :n], tv[h, cl, :n])
    m = IX * K
    base = t0 * K
    first = _FIRST[1 if oddw else 0]
    for xi in range(5):          # rows a - b, b, c - b, then b, c (odd: a, b)
        S = tv[0] if xi == 0 else tv[1] if xi == 2 else R[v + 1] if xi == 1 else (
            R[v + (0 if oddh else 1) + xi - 3])
        for nu in range(5):
            f = first[nu]
            src = S[f % 2, (f // 2) * K:(f // 2) * K + m]
            dst = V[5 * xi + nu, base:base + m]
            if nu == 0 or nu == 2:
                vsub(src, S[1, :m], dst)
            else:
                vcopy(src, dst)


@njit(nogil=True, cache=True)
def _out_dx(M, t0, IX, h0, oddh, oddw, s, xn):
    # xn: (rows, W, C) <- the 4x4 blocks of the IX blocks t0 ... of one block row (rows of C
    # in M[e]): rows h0 + a (a < 4), columns 4j + b, those inside xn; s: (10, IX*C) scratch,
    # s[nu] = M[0, nu] + M[1, nu], s[5 + nu] = M[1, nu] + M[2, nu]
    Hs, W, C = xn.shape
    m = IX * C
    base = t0 * C
    for nu in range(5):
        m0, m1, m2 = M[nu, base:base + m], M[5 + nu, base:base + m], M[10 + nu, base:base + m]
        s0, s1 = s[nu, :m], s[5 + nu, :m]
        for i in range(m):
            s0[i] = m0[i] + m1[i]
        for i in range(m):
            s1[i] = m1[i] + m2[i]
    for a in range(4):
        h = h0 + a
        if h < 0 or h >= Hs:
            continue
        # row a of the block: m0 + m1, m3, m1 + m2, m4 (odd: m3, m0 + m1, m4, m1 + m2) of
        # the rows of A^T; the same along the columns, q0 ... q4 = Q[0 ... 4] from column qo
        pos = a ^ 1 if oddh else a
        if pos % 2 == 0:
            Q, qo = s[5 * (pos // 2):5 * (pos // 2) + 5], 0
        else:
            Q, qo = M[15 + 5 * (pos // 2):20 + 5 * (pos // 2)], base
        for wq in range(min(4 * IX, W)):
            pb = wq % 4 ^ 1 if oddw else wq % 4
            o = qo + (wq // 4) * C
            dst = xn[h, wq]                                       # (C,)
            if pb % 2 == 0:                                       # q0 + q1, q1 + q2
                qa, qb = Q[pb // 2, o:o + C], Q[pb // 2 + 1, o:o + C]
                for c in range(C):
                    dst[c] = qa[c] + qb[c]
            else:                                                 # q3, q4
                q = Q[3 + pb // 2, o:o + C]
                for c in range(C):
                    dst[c] = q[c]


# The task kernel calls its steps through slots (kernels/cpu/steps.py): float32 only.
_I, _B = types.int64, types.boolean
IN_DX = Step(_in_dx.py_func, lambda f: [
    (_arr(f, 3), _I, _I, _I, _B, _B, _arr(f, 3), _arr(f, 2), _I)])
OUT_DX = Step(_out_dx.py_func, lambda f: [
    (_arr(f, 2), _I, _I, _I, _B, _B, _arr(f, 2), _arr(f, 3))])
_STEPS = (GEMMS, IN_DX, OUT_DX)                  # and the layout's (layout_steps)
_store_nchw, _gemms = STORE_NCHW.call, GEMMS.call
_in_dx_step, _out_dx_step = IN_DX.call, OUT_DX.call


@task_kernel
def _s2_dx_tasks(t0, t1, gy, y, use_mask, U, sizes, flags, dx):
    top, left, ipc, ib, vs, ms = sizes
    nhwc, wide = flags
    # gy, y: (N, P, Q, K) | (N, K, P, Q); U: (25, K, C) float32 (taps(w, G_DX, dx=True)); dx: (N, H,
    # W, C) | (N, C, H, W). Chunk t: images [n0, n1) (ipc > 1) or block rows [i0, i1) of one
    # image; block row i: dx rows 4i ... 4i + 3, g rows 2i + c0 ... 2i + c0 + 2 with c0 =
    # (top - 1) // 2 (columns likewise); vs, ms: estride of V and M. NCHW: the chunk's rows of
    # gy and y transposed to HWC first, its dx rows computed as (rows, W, C), then transposed
    # into dx.
    if nhwc:
        N, H, W, C = dx.shape
        Q, K = gy.shape[2], gy.shape[3]
    else:
        N, C, H, W = dx.shape
        K, Q = gy.shape[1], gy.shape[3]
    IY, IX = (H + 3) // 4, (W + 3) // 4
    L = IX + 1                                        # g columns of each parity
    c0h, c0w = (top - 1) // 2, (left - 1) // 2        # first g row (column) of block 0
    oddh, oddw = top % 2 == 1, left % 2 == 1
    rows = IY if ipc > 1 else ib                      # block rows per image, most
    V, M, vrows, eoff = gemm_operands(vs, ms, ipc * rows * IX, K)   # V[e] (T, K), M[e] (T, C)
    R = np.empty((2 * rows + 1, 2, L * K), np.float32)
    tv = np.empty((2, 2, L * K), np.float32)
    s = np.empty((10, IX * C), np.float32)
    gs = np.empty(0 if nhwc else (2 * rows + 1) * Q * K, np.float32)    # g's rows, HWC
    ysl = np.empty(0 if nhwc or not use_mask else (2 * rows + 1) * Q * K, np.float32)
    xs = np.empty(0 if nhwc else 4 * rows * W * C, np.float32)          # dx's rows, HWC
    for t in range(t0, t1):
        n0, n1, i0, i1 = chunk(t, N, IY, ipc, ib)
        nr = i1 - i0
        T = (n1 - n0) * nr * IX
        u0 = 2 * i0 + c0h                             # the chunk's first g row
        for n in range(n0, n1):
            # g's rows split by column parity from column c0w (gated; NCHW through slabs)
            padded_rows_step((gy, y, use_mask, n, u0, 2 * nr + 1, c0w, L, R,
                              np.int64(not nhwc), gs, ysl))
            for r in range(nr):
                _in_dx_step((R, 2 * r, IX, K, oddh, oddw, tv, V, ((n - n0) * nr + r) * IX))
        _gemms((T, C, K, vrows, eoff, U, M, ms, wide))
        h0, h1 = 4 * i0, min(H, 4 * i1)               # the chunk's dx rows
        for n in range(n0, n1):
            t0n = (n - n0) * nr * IX
            xv = dx[n] if nhwc else xs[:(h1 - h0) * W * C].reshape((h1 - h0, W, C))
            for r in range(nr):
                _out_dx_step((M, t0n + r * IX, IX, 4 * r + (h0 if nhwc else 0), oddh, oddw, s,
                              xv))
            if not nhwc:
                _store_nchw((xs[:(h1 - h0) * W * C], dx, n, h0))
