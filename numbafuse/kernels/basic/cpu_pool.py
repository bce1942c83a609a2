"""The CPU max pool, with padding, vectorised over channels.

Every output ``(p, q)`` of a window reads the taps ``(r, s)`` whose input pixel ``(p*sh - ph +
r, q*sw - pw + s)`` is inside the map (the padding never wins: PyTorch's rule), and keeps the
first maximum in row-major tap order, a NaN beating every number (the first NaN kept):
``basic/math.first_max_tap``'s rule. The window argmax ``t = r*kw + s`` is kept for the
backward (one byte an output up to 16x16 windows), which adds each gy to its input pixel,
output after output in row-major order per channel plane (PyTorch's order: the same sums).

The work runs on rows of channels, so that each comparison is a vector over channels: NHWC
pixels are such rows already; an NCHW image is taken ``LANES`` channels at a time, their
planes transposed to (H*W, LANES) rows (``cpu.transpose``'s 8x8 tiles) and the outputs
transposed back. At ResNet's stem pool (3x3/2, padding 1, (16, 64, 32, 32) float32, 2
threads, machine E) the NCHW forward took 0.29 ms with 64 lanes, 0.40 with 32, 0.59-0.65
with 16 (the loop over each output's taps paid per lane block); the generic strided loop it
replaced 3.5 ms, PyTorch's NCHW kernel 3.0, its channels_last one 0.17. At (16, 64, 112,
112) (a 224x224 input's stem): 4.4 ms against PyTorch's 57.2 (its own process).

The backward adds into planes (NCHW) or image rows (NHWC) that it zeroes itself, in cache,
in an output-cache buffer: before 2026-12-02 it added into a fresh ``np.zeros`` array (every
page faulted inside the kernel) with each tap's row and column found by ``//`` and ``%``. At
(16, 64, 112, 112), 2 threads, machine A, alone after a 64 MiB write: NCHW 8.9-14.7 ->
3.2-3.4 ms, NHWC 24.6 -> 3.8; in ResNet-50's 224x224 training step 42.2 -> 3.9 ms.
"""
import numpy as np
from numba import njit

from ..cpu.launch import task_kernel
from ..cpu.transpose import transpose

LANES = 64                       # NCHW channels pooled together (a block's rows: 256 KB at 32x32)
# The window argmax is made in int32 lanes, the float compares' width, and narrowed to the kept
# dtype (uint8 up to 16x16 windows) as it is written out: with uint8 lanes LLVM left the tap loop
# scalar on AVX2 (no AVX-512 masks to narrow the compares with), a branch per lane that random
# data mispredicts (machine F, Zen 3, 2026-12-02: _pool_rows alone on one thread, an ad-hoc
# script, 6.9 ms with random data against 1.3 with int32 lanes). `python benchmarks/bench_pool.py
# --rounds 3 --repeats 5`, F, 2 threads, forward before -> after (PyTorch's): (16, 64, 32, 32)
# NCHW 4.47 -> 1.07 ms (4.58), NHWC 4.06 -> 0.80 (0.26); (16, 64, 112, 112) NCHW 54.25 -> 13.21
# (54.66), NHWC 48.44 -> 9.02 (3.56): PyTorch's channels_last kernel stays ahead.
ARG_DTYPE = np.int32


@njit(inline="always")
def _pool_rows(src, W, p0, p1, Q, geo, y, arg):
    """Outputs rows p0 <= p < p1 of one image from its pixel rows ``src`` (H*W, L): ``y``,
    ``arg`` (P*Q, L) rows; geo = (H, W, P, Q, kh, kw, sh, sw, ph, pw)."""
    H = src.shape[0] // W
    kh, kw, sh, sw, ph, pw = geo[4], geo[5], geo[6], geo[7], geo[8], geo[9]
    L = src.shape[1]
    for p in range(p0, p1):
        h0 = p * sh - ph
        r0, r1 = max(0, -h0), min(kh, H - h0)
        for q in range(Q):
            w0 = q * sw - pw
            s0, s1 = max(0, -w0), min(kw, W - w0)
            best, t = y[p * Q + q], arg[p * Q + q]
            first = src[(h0 + r0) * W + w0 + s0]
            t0 = r0 * kw + s0
            for c in range(L):
                best[c] = first[c]
                t[c] = t0
            for r in range(r0, r1):
                for s in range(s0, s1):
                    if r == r0 and s == s0:
                        continue
                    v = src[(h0 + r) * W + w0 + s]
                    tap = r * kw + s
                    for c in range(L):
                        b, x = best[c], v[c]
                        better = (b == b) & ((x > b) | (x != x))
                        best[c] = x if better else b
                        t[c] = tap if better else t[c]


# The forward is one task kernel per layout, each inlining _pool_rows once: one kernel with
# both layouts' paths took 1.8-2.2 s of self compile time (issue 33's line: 2 s).

@task_kernel
def max_pool_fwd_nhwc(t0, t1, x, y, arg, geo):
    # x (N, H*W, C); y, arg (N, P*Q, C); geo = (H, W, P, Q, kh, kw, sh, sw, ph, pw). Task: one
    # image, its argmax made in int32 rows (ARG_DTYPE) and narrowed into arg.
    P, Q, C = geo[2], geo[3], x.shape[2]
    ars = np.empty((P * Q, C), ARG_DTYPE)
    for task in range(t0, t1):
        _pool_rows(x[task], geo[1], 0, P, Q, geo, y[task], ars)
        a = arg[task]
        for i in range(P * Q):
            for c in range(C):
                a[i, c] = ars[i, c]


@task_kernel
def max_pool_fwd_nchw(t0, t1, x, y, arg, geo):
    # x (N, C, H*W); y, arg (N, C, P*Q); geo as above. Task: one image's block of LANES
    # channels (blocks = ceil(C / LANES) an image), transposed to rows and back (the argmax
    # rows int32, ARG_DTYPE, narrowed as they go back).
    H, W, P, Q = geo[0], geo[1], geo[2], geo[3]
    C = x.shape[1]
    nb = (C + LANES - 1) // LANES
    # (flat: a block's (H*W, cb) rows C-contiguous, so that the lanes' loops vectorise; views
    # [:, :cb] of (H*W, LANES) arrays had left them scalar: 0.59 ms at the stem pool)
    rows = np.empty(H * W * LANES, x.dtype)
    yrows = np.empty(P * Q * LANES, x.dtype)
    arows = np.empty(P * Q * LANES, ARG_DTYPE)
    for task in range(t0, t1):
        n, c0 = task // nb, (task % nb) * LANES
        c1 = min(C, c0 + LANES)
        cb = c1 - c0
        src = rows[:H * W * cb].reshape((H * W, cb))
        ys = yrows[:P * Q * cb].reshape((P * Q, cb))
        ars = arows[:P * Q * cb].reshape((P * Q, cb))
        transpose(x[n, c0:c1], src)                       # (cb, HW) -> (HW, cb)
        _pool_rows(src, W, 0, P, Q, geo, ys, ars)
        transpose(ys, y[n, c0:c1])                        # (PQ, cb) -> (cb, PQ)
        ya = arg[n, c0:c1]
        for i in range(P * Q):
            for c in range(cb):
                ya[c, i] = ars[i, c]


@njit(inline="always")
def _tap_offsets(W, kh, kw):
    """off[t]: where tap t = r*kw + s of a window lands, as a flat pixel offset (r*W + s)
    from the window's corner."""
    off = np.empty(kh * kw, np.int64)
    for r in range(kh):
        for s in range(kw):
            off[r * kw + s] = r * W + s
    return off


@task_kernel
def max_pool_bwd_nchw(t0, t1, gy, arg, gx, geo):
    # gy, arg (N, C, P*Q); gx (N, C, H*W), not initialised: each task zeroes its planes
    # first (in cache, no fresh pages) and adds each gy to its input pixel, output after
    # output in row-major order (PyTorch's order of the sums). Task: one image's block of
    # LANES channels, as the forward's.
    H, W, P, Q, kh, kw, sh, sw, ph, pw = geo
    C = gy.shape[1]
    nb = (C + LANES - 1) // LANES
    off = _tap_offsets(W, kh, kw)
    for task in range(t0, t1):
        n, c0 = task // nb, (task % nb) * LANES
        for c in range(c0, min(C, c0 + LANES)):
            plane, a, g = gx[n, c], arg[n, c], gy[n, c]
            for i in range(H * W):
                plane[i] = 0
            for p in range(P):
                base = (p * sh - ph) * W - pw
                for q in range(Q):
                    o = p * Q + q
                    plane[base + q * sw + off[a[o]]] += g[o]


@task_kernel
def max_pool_bwd_nhwc(t0, t1, gy, arg, gx, geo):
    # gy, arg (N, P*Q, C); gx (N, H*W, C), not initialised (zeroed here, as the NCHW one).
    # Task: one image; per channel the sums in the same order.
    H, W, P, Q, kh, kw, sh, sw, ph, pw = geo
    C = gy.shape[2]
    off = _tap_offsets(W, kh, kw)
    for n in range(t0, t1):
        rows, a, g = gx[n], arg[n], gy[n]
        for i in range(H * W):
            for c in range(C):
                rows[i, c] = 0
        for p in range(P):
            base = (p * sh - ph) * W - pw
            for q in range(Q):
                o = p * Q + q
                at, go = a[o], g[o]
                for c in range(C):
                    rows[base + q * sw + off[at[c]], c] += go[c]
