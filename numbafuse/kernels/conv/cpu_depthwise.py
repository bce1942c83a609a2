r"""CPU depthwise convolution kernels: a direct stencil per channel, no GEMM.

A depthwise convolution has ``groups == C`` and ``K = C * M`` filters (M, the channel
multiplier, >= 1): filter ``k = c * M + m`` sees input channel ``c`` only, and w is
``(K, 1, R, S)``. It does R*S multiply-adds per output value against a GEMM's C*R*S, so it is
bound by memory more than arithmetic: each pass reads its inputs once and writes its output
once. The float32 NHWC passes with multiplier 1 and C % 8 == 0 sum in registers
(``cpu_depthwise_tiles``'s micro-kernels, ``cpu_depthwise_nhwc``'s task kernels: the forward,
dX where ``_tiled_dx``, dW), as does the float32 NCHW forward (``cpu_depthwise_nchw``, which
also sends small NCHW maps to the NHWC tiles); elsewhere the accumulators stay in L1.

    forward   y[n,k,p,q] = relu(sum_{r,s} x[n, c, p*sh-ph + r*dh, q*sw-pw + s*dw] w[k,r,s] + b[k])
    backward  g = gy * (y > 0);  db[k] = sum_{n,p,q} g[n,k,p,q]
              dw[k,r,s] = sum_{n,p,q} g[n,k,p,q] x[n, c, p*sh - ph + r*dh, q*sw - pw + s*dw]
              dx[n,c,h,w] = sum_{m,r,s} g[n, cM+m, p, q] w[cM+m, r, s]
                            over the (p, q) with h = p*sh - ph + r*dh, w = q*sw - pw + s*dw

Loops (one compiled task kernel per pass, layout and case):

    NHWC  float32, multiplier 1, C % 8 == 0 (``cpu_depthwise_nhwc``): the forward, every
          pixel through the register tiles, addressed in x itself (one row per pixel, one
          offset per tap) with the taps that lie inside the image, the same sums, bit for
          bit, as the loops below; dX the same tiles over the gated g with the taps flipped,
          phase by phase; dW tiles of taps x channels summed over blocks of pixels in
          registers. With dX and dW (or db) both asked for, dW gates g once and keeps it for
          dX (``_gate_once``).
    NHWC  channels on the vector lanes. Stride 1 along w and multiplier 1 (``_flat_rows``):
          a tap of an output row is one flat loop over Q*C values of x (or the gated g) against
          the tap's weights repeated Q times (``_tiled_taps``), forward and dX. Otherwise, and
          for dW: per pixel, the innermost loop over C values of x, of the taps ``wt``
          (M, R, S, C) and of an accumulator. Tasks: blocks of ``CHUNK_ELEMENTS`` output values
          of rows (forward, dW) or one input row (dX, which the output rows reaching it scatter
          into).
    NCHW  phase planes: a task is one input plane (n, c) and its M filters. The plane is
          copied zero-padded and split into its sh*sw phases, rows of ``Wph`` (Q plus the
          widest tap's column offset); a tap (r, s) is then a fixed offset into one phase and
          its contribution one flat loop over P*Wph values (columns past Q computed, dropped):
          forward ``acc += w * window``, dX ``phases += w * g`` then merged into the plane the
          task owns, dW the float64 dot product of g (zero past Q) and the window.

dW and db: the chunks (row blocks or planes) go into ``min(chunks, DW_GROUPS)`` fixed groups,
one task each with its own partial (db in float64), summed in group order afterwards: results
do not depend on the thread count. dX: each dx element is written by exactly one task. Notation
as in ``cpu.py``; ``geo`` is ``math.GEO_FIELDS``'s tuple.
"""
import functools

import numpy as np
from numba import njit

from .. import scalar
from ..cpu import gemm_taps as _gemm_taps
from ..cpu.buffers import aligned as _aligned, output_cache as _out
from ..cpu.launch import blocks, launch, task_kernel
from . import math as conv_math
from . import cpu_depthwise_nchw as _nchw
from . import cpu_depthwise_nhwc as _nhwc
from . import cpu_depthwise_tiles as _tiles
from .cpu_depthwise_nhwc import gate_row as _gate_row
from .cpu_chunks import sum64
from . import cpu_phases as _phases
from .cpu_phases import merge as _merge_phases, split as _split_phases

CHUNK_ELEMENTS = 1 << 15   # output values of one NHWC task's rows (forward, dW), at least a row
DW_GROUPS = 16             # fixed groups of chunks, each with its own dW and db partial
# a*b + c as one fused multiply-add (one rounding): ~20% faster loops, the same on every call
FMA = {"contract"}

_relu = scalar.cpu_scalar(scalar.relu)
_valid_range = scalar.cpu_scalar(conv_math.valid_range)


@njit(cache=True, fastmath=FMA)
def _axpy(out, src, a):
    # out[i] += src[i] * a  (1-d views of one length, indexed from 0: no wraparound checks)
    for i in range(out.shape[0]):
        out[i] += src[i] * a


@njit(cache=True, fastmath=FMA)
def _fma(out, u, v):
    # out[i] += u[i] * v[i]  (1-d views of one length)
    for i in range(out.shape[0]):
        out[i] += u[i] * v[i]


@njit(cache=True, fastmath={"reassoc", "contract"})
def _dot64(u, v):
    # float64 sum of u[i] * v[i], vectorised: reassociated in a fixed, compiled order (the same
    # result on every call, whatever the thread count)
    acc = 0.0
    for i in range(u.shape[0]):
        acc += u[i] * v[i]
    return acc


@njit(cache=True)
def _gate_plane(gp, yp, use_mask, Wph, g):
    # g (P*Wph,) <- the gated (P, Q) plane gp, row p at p*Wph. Columns Q <= q < Wph are not
    # written: the callers zero g once (indices, not row views: a row is 28 values at 56x56
    # stride 2, and five views a row cost more than the gating, 2.6 ms of a 7.2 ms dW)
    P, Q = gp.shape
    for p in range(P):
        o = p * Wph
        if use_mask:
            for q in range(Q):
                g[o + q] = gp[p, q] if yp[p, q] > 0 else 0
        else:
            for q in range(Q):
                g[o + q] = gp[p, q]


is_depthwise = conv_math.is_depthwise     # whether a grouped conv runs these kernels


# --------------------------------------------------------------------------- forward

@task_kernel(fastmath=FMA)
def _forward_nhwc(t0, t1, x, wt, b, relu, geo, rpc, y):
    # x: (N, H, W, C);  wt: (M, R, S, C) taps, channel fastest;  b: (K,);  y: (N, P, Q, K).
    # Task t: output rows [p0, p0 + rpc) of image t // blocks(P, rpc).
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    nb = (P + rpc - 1) // rpc
    acc = np.empty((M, C), wt.dtype)                                  # one output pixel
    for t in range(t0, t1):
        n, p0 = t // nb, (t % nb) * rpc
        for p in range(p0, min(P, p0 + rpc)):
            for q in range(Q):
                acc[:] = 0
                for r in range(R):
                    h = p * sh - ph + r * dh
                    if h < 0 or h >= H:
                        continue
                    for s in range(S):
                        wi = q * sw - pw + s * dw
                        if wi < 0 or wi >= W:
                            continue
                        xv = x[n, h, wi]                              # (C,)
                        for m in range(M):
                            a, wv = acc[m], wt[m, r, s]               # (C,), (C,)
                            for c in range(C):
                                a[c] += xv[c] * wv[c]
                yv = y[n, p, q]                                       # (K,), k = c*M + m
                for m in range(M):
                    for c in range(C):
                        v = acc[m, c] + b[c * M + m]
                        yv[c * M + m] = _relu(v) if relu else v


@task_kernel(fastmath=FMA)
def _forward_nhwc_rows(t0, t1, x, wtile, btile, relu, geo, rpc, y):
    # Stride 1 along w, multiplier 1: each tap of an output row is one loop over Q*C values.
    # x: (N, H, W*C);  wtile, btile: (R, S, Q*C), (Q*C,) each tap's weights and b repeated Q
    # times;  y: (N, P, Q*C).  Tasks as _forward_nhwc's.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nb = (P + rpc - 1) // rpc
    acc = np.empty(Q * C, x.dtype)                                    # one output row
    for t in range(t0, t1):
        n, p0 = t // nb, (t % nb) * rpc
        for p in range(p0, min(P, p0 + rpc)):
            acc[:] = 0
            for r in range(R):
                h = p * sh - ph + r * dh
                if h < 0 or h >= H:
                    continue
                xr = x[n, h]                                          # (W*C,)
                for s in range(S):
                    q0, q1 = _valid_range(s, 1, pw, dw, W, Q)
                    if q1 > q0:
                        x0, m = (q0 - pw + s * dw) * C, (q1 - q0) * C
                        _fma(acc[q0 * C:q1 * C], xr[x0:x0 + m], wtile[r, s, :m])
            yr = y[n, p]
            for i in range(Q * C):
                v = acc[i] + btile[i]
                yr[i] = _relu(v) if relu else v


@task_kernel(fastmath=FMA)
def _forward_nchw(t0, t1, x, w, b, relu, geo, Wph, y):
    # x: (N, C, H, W);  w: (K, R, S);  b: (K,);  y: (N, K, P, Q).  Task t: input plane (n, c) =
    # divmod(t, C), split into its sh*sw phases (zero-padded, rows of Wph): each tap is then one
    # loop over P*Wph values at a fixed offset (columns Q <= q < Wph computed and dropped).
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    L = P * Wph
    xph = np.zeros((sh * sw, (P + (R - 1) * dh // sh + 1) * Wph), x.dtype)   # padding
    acc = np.empty(L, x.dtype)
    for t in range(t0, t1):
        n, c = t // C, t % C
        _split_phases(x[n, c], ph, pw, sh, sw, Wph, xph)
        for k in range(c * M, c * M + M):
            acc[:] = 0
            for r in range(R):
                for s in range(S):
                    off = (r * dh) // sh * Wph + (s * dw) // sw
                    src = xph[(r * dh) % sh * sw + (s * dw) % sw]
                    _axpy(acc, src[off:off + L], w[k, r, s])
            yp, bias = y[n, k], b[k]
            for p in range(P):
                a, yr = acc[p * Wph:p * Wph + Q], yp[p]
                for q in range(Q):
                    v = a[q] + bias
                    yr[q] = _relu(v) if relu else v


def _rows7(geom):
    """NCHW float32 forwards cpu_depthwise_nchw.forward_rows7 runs: 7x7 taps at stride 1 or
    2 in both directions, no dilation (AVX-512's tiles or AVX2's: cpu_depthwise_tiles.
    ROWS7_WIDE)."""
    return geom.R == geom.S == 7 and geom.sh == geom.sw <= 2 and geom.dh == geom.dw == 1


def forward(x, w, b, geom, relu):
    """``y = relu?(depthwise_conv(x, w) + b?)`` for contiguous host arrays of one dtype."""
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    if _nchw.by_nhwc(geom, x.dtype, _nchw.NHWC_FORWARD_MAX_PIXELS):
        return _nchw.forward_by_nhwc(forward, x, w, b, geom, relu)
    y = _out.empty(geom.y_shape, x.dtype)
    b = np.zeros(K, x.dtype) if b is None else b
    work = x.size + y.size
    geo = conv_math.geo_tuple(geom)
    relu = bool(relu)
    if geom.layout == "NHWC":
        rpc = _rows_per_chunk(geom)
        if _tiled(geom, x.dtype):
            wide = bool(_gemm_taps.WIDE)
            row = (*geo, relu, _copied(x, C), wide,
                   _nhwc.slides(wide, C, geom.S, geom.sw, geom.dw),
                   0, P * Q * C, Q * C, C, _nhwc.streams(y, x.nbytes, C))
            _nhwc.run_tiled(x, x, [(_taps_rs(w, geom), _tap_offsets(geom), row)], _aligned(b),
                            rpc, y, work)
        elif _flat_rows(geom):
            launch(_forward_nhwc_rows, N * blocks(P, rpc), x.reshape(N, geom.H, geom.W * C),
                   _tiled_taps(w, geom), np.tile(b, Q), relu, geo, rpc, y.reshape(N, P, Q * K),
                   work=work)
        else:
            launch(_forward_nhwc, N * blocks(P, rpc), x, _taps_nhwc(w, C, K // C), b, relu,
                   geo, rpc, y, work=work)
    elif np.dtype(x.dtype) == np.float32:
        _phases.ready(x.dtype, geom)
        Wpt = _phase_width(geom, vector=True)
        brep = _nchw.lanes(b, K, geom)
        if _rows7(geom):
            launch(_nchw.forward_rows7, N * C, x, w.reshape(K, R * S), brep, relu, geo, Wpt, y,
                   work=work)
        else:
            _tiles.ready(_tiles.TAPS_TILES)
            wrep = _nchw.lanes(w, K * R * S, geom).reshape(K, R * S, -1)
            launch(_nchw.forward_tiled, N * C, x, wrep, brep, relu, geo, Wpt,
                   _phase_tap_offsets(geom, Wpt), _gemm_taps.WIDE, y, work=work)
    else:
        _phases.ready(x.dtype, geom)
        launch(_forward_nchw, N * C, x, w.reshape(K, R, S), b, relu, geo, _phase_width(geom),
               y, work=work)
    return y


def _phase_tap_offsets(geom, Wpt):
    """(R*S,) int64: element offset of tap (r, s), r-major, from a row of the first phase
    plane in the NCHW kernels' phase buffer (planes of rows of ``Wpt``)."""
    R, S, sh, sw, dh, dw = geom.R, geom.S, geom.sh, geom.sw, geom.dh, geom.dw
    plane = (geom.P + (R - 1) * dh // sh + 1) * Wpt
    return np.array([((r * dh) % sh * sw + (s * dw) % sw) * plane + (r * dh) // sh * Wpt
                     + (s * dw) // sw for r in range(R) for s in range(S)], np.int64)


def _copied(x, C):
    """``forward_tiled``'s input mode for a forward: 2 (each task copies the input rows it
    reads into a buffer of its own on a 64-byte boundary) where x is not on one and C % 16 ==
    0 (every pixel's vectors then are: 16 floats a vector), else 0 (x itself). NumPy's large
    arrays start 16 bytes past a cache line, so every 64-byte load of x split two lines: on
    machine A (Zen 4), NumPy's x, best of four alternating processes (ms, x itself ->
    copied): 2 threads, 7x7/2 (32, 96, 28, 28) 1.089 -> 0.888, 7x7 2.59 -> 2.23, 3x3/2 (32,
    64, 56, 56) 1.376 -> 1.282, 3x3 2.35 -> 2.19; one thread 7x7/2 1.50 -> 1.37, 3x3/2 3.01 ->
    2.68. dW's tiles (``dw_tiled``) copy the rows the same way where it is 2: fwd+bwd, 2
    threads, 3x3/2 4.99 -> 4.48 ms, 7x7/2 3.31 -> 3.17. The same sums (the copy changes no
    value)."""
    return 2 if x.ctypes.data % 64 != 0 and C % 16 == 0 else 0


def _tiled(geom, dtype):
    """NHWC forwards the register tiles run: float32, multiplier 1, C a multiple of 8."""
    return np.dtype(dtype) == np.float32 and geom.K == geom.C and geom.C % 8 == 0


def _taps_rs(w, geom):
    """w (C, 1, R, S) as (R*S, C): one row of channel weights per tap, r-major."""
    return _aligned(w.reshape(geom.C, geom.R * geom.S).T)


def _tap_offsets(geom, width=None):
    """(2, R*S) int64: element offsets of the taps (r, s), r-major, in x (NHWC; rows of
    ``width`` pixels, default W) from a pixel's first tap, and in the (R*S, C) taps. One
    array per geometry, made once (the host's part of a small forward), which nobody writes
    (not flagged read-only: a read-only array is another type to Numba, another compilation
    of the kernels that take it)."""
    return _offsets(geom.R, geom.S, geom.C, geom.dh, geom.dw, geom.W if width is None else width)


@functools.lru_cache(maxsize=256)
def _offsets(R, S, C, dh, dw, width):
    return np.array([[(r * dh * width + s * dw) * C for r in range(R) for s in range(S)],
                     [t * C for t in range(R * S)]], np.int64)


def _gate_once(geom, dtype, use_mask, need):
    """Whether the NHWC tiled backward gates g once for dX and dW both (``cpu_depthwise_nhwc.
    dw_tiled`` keeps it, dX reads it in place) instead of in each pass: the tiled case with a
    mask, dX and dW or db needed. 1 thread, machine E, three alternating processes, ms of the
    backward (each pass gating its own -> once): 3x3/2 (32, 64, 56, 56) 5.63 -> 3.99, 7x7/2
    (32, 96, 28, 28) 2.75 -> 2.15, 3x3 11.5 -> 8.4, 7x7 7.39 -> 6.89 (with 24a01a5's tiles)."""
    return (geom.layout == "NHWC" and use_mask and _tiled(geom, dtype) and need[0]
            and (need[1] or need[2]))


def _tiled_dx(geom, dtype, gated=False):
    """NHWC dX by the forward's register tiles, phase by phase (``cpu_depthwise_nhwc.
    dx_phases``): the tiled case at stride 1 or with 25 taps or more. Measured, 1 thread,
    batch 32, ms (the loops of _dx_nhwc_rows / _dx_nhwc against the phases): 3x3 at 56x56,
    64 channels 11.8-12.1 / 6.1-6.3, 7x7 at 28x28, 96 channels 11.8-12.0 / 5.6-6.4 and at
    stride 2 5.1-5.3 / 2.5-3.2; 3x3 stride 2 at 56x56 4.5 / 5.5-6.3 (four phases of 1 to 4
    taps, each gating the rows of g it reads), so that one keeps the loops, unless g is
    ``gated`` once for dW too (_gate_once): then the phases read it in place, 1.83 ms
    (machine E, Zen 5, against the loops' 2.1-2.6)."""
    return _tiled(geom, dtype) and (gated or geom.sh == geom.sw == 1 or geom.R * geom.S >= 25)
    # (elsewhere, multiplier 1: _dx_nhwc_gated, 3x3 stride 2 there 4.7-4.9 -> 3.7 ms, gating
    # each row of g once instead of at every tap)


def _tiled_dw(geom, dtype):
    """NHWC dW by the dW register tiles: the tiled case, at every stride. Measured, 1 thread,
    batch 32, best of 6 (ms, the loops of _dw_nhwc against the tiles): 3x3 at 56x56, 64
    channels 10.4 / 7.5, 7x7 at 28x28, 96 channels 13.5 / 8.8 and at stride 2 3.8 / 2.8. 3x3
    stride 2 at 56x56 had kept the loops (machine A, Zen 4: 2.85 / 3.45) until the tiles'
    gating was one vectorised pass a row (it had been a loop per pixel): machine E, Zen 5,
    aligned x, three alternating processes, dW + db 3.6-3.9 / 1.87."""
    return _tiled(geom, dtype)


def _flat_rows(geom):
    """NHWC with stride 1 along w and multiplier 1: a tap of a row is one flat loop."""
    return geom.sw == 1 and geom.K == geom.C


def _tiled_taps(w, geom):
    """(R, S, Q*C): each tap's C weights repeated Q times (the flat rows' multiplicand)."""
    taps = w.reshape(geom.K, geom.R, geom.S).transpose(1, 2, 0)       # (R, S, C)
    return np.ascontiguousarray(np.tile(taps, (1, 1, geom.Q)))


def _phase_width(geom, vector=False):
    """Row length of the NCHW kernels' phase planes: Q (``vector``: Q rounded up to 8, the
    columns the tiles compute) plus the widest tap's column offset."""
    Q = (geom.Q + 7) // 8 * 8 if vector else geom.Q
    return Q + (geom.S - 1) * geom.dw // geom.sw


def _rows_per_chunk(geom):
    """Output rows of one NHWC forward or dW task: CHUNK_ELEMENTS output values, a row at least."""
    return max(1, min(geom.P, CHUNK_ELEMENTS // max(1, geom.Q * geom.K)))


def _taps_nhwc(w, C, M):
    """w (K, 1, R, S), k = c*M + m, as the NHWC kernels' taps (M, R, S, C)."""
    R, S = w.shape[2], w.shape[3]
    return np.ascontiguousarray(w.reshape(C, M, R, S).transpose(1, 2, 3, 0))


# --------------------------------------------------------------------------- dX

@task_kernel(fastmath=FMA)
def _dx_nhwc(t0, t1, gy, y, use_mask, wt, geo, dx):
    # gy, y: (N, P, Q, K);  wt: (M, R, S, C);  dx: (N, H, W, C).  Task t: input row (n, h) =
    # divmod(t, H), which the task owns: the output rows p whose tap r reaches it
    # (h = p*sh - ph + r*dh) scatter g * w into it, tap by tap.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    zero = np.zeros(1, gy.dtype)[0]
    for t in range(t0, t1):
        n, h = t // H, t % H
        d = dx[n, h]                                                  # (W, C)
        d[:] = 0
        for r in range(R):
            num = h + ph - r * dh                                     # = p * sh
            if num < 0 or num % sh != 0 or num // sh >= P:
                continue
            p = num // sh
            for s in range(S):
                q0, q1 = _valid_range(s, sw, pw, dw, W, Q)
                for q in range(q0, q1):
                    a = d[q * sw - pw + s * dw]                       # (C,)
                    gv, yv = gy[n, p, q], y[n, p, q]                  # (K,), (K,)
                    for m in range(M):
                        wv = wt[m, r, s]                              # (C,)
                        for c in range(C):
                            i = c * M + m
                            a[c] += (gv[i] if not use_mask or yv[i] > 0 else zero) * wv[c]


@njit(inline="always")        # (a call of its own added 0.15 s to a cold first backward)
def _kept_gated_row(gy, y, use_mask, n, p, gs, keys):
    # Row p of image n of g = gy * (y > 0) (gy, y: (N, P, Q*C)), gated into one of the rows
    # of gs unless one holds it already: a row of g serves up to R rows of dx, and the dX
    # loops go through a task's rows of dx in increasing order, so a new row replaces the
    # oldest (keys: n*P + p of each row of gs, -1 for none)
    key, slot = n * gy.shape[1] + p, 0
    for i in range(keys.shape[0]):
        if keys[i] == key:
            return gs[i]
        if keys[i] < keys[slot]:
            slot = i
    g = gs[slot]
    _gate_row(gy[n, p], y[n, p], use_mask, g)
    keys[slot] = key
    return g


@task_kernel(fastmath=FMA)
def _dx_nhwc_gated(t0, t1, gy, y, use_mask, wt, geo, dx):
    # Multiplier 1 at any stride: gy, y: (N, P, Q*C);  wt: (R, S, C);  dx: (N, H, W*C).
    # Task t: input row (n, h) = divmod(t, H), as _dx_nhwc's, but each output row p that
    # reaches it is gated once into g (not at every tap: the loop is then an FMA over two
    # loads, not four and a select), and kept for the next rows of dx that read it.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    gs = np.empty((R, Q * C), gy.dtype)        # gated rows of g (_kept_gated_row)
    keys = np.full(R, -1, np.int64)
    for t in range(t0, t1):
        n, h = t // H, t % H
        d = dx[n, h]                                                  # (W*C,)
        d[:] = 0
        for r in range(R):
            num = h + ph - r * dh                                     # = p * sh
            if num < 0 or num % sh != 0 or num // sh >= P:
                continue
            g = _kept_gated_row(gy, y, use_mask, n, num // sh, gs, keys)
            for s in range(S):
                q0, q1 = _valid_range(s, sw, pw, dw, W, Q)
                wv = wt[r, s]                                         # (C,)
                for q in range(q0, q1):
                    o = (q * sw - pw + s * dw) * C
                    a, gv = d[o:o + C], g[q * C:(q + 1) * C]          # (views from 0: the
                    for c in range(C):                                # loop indexing d[o + c],
                        a[c] += gv[c] * wv[c]                         # wt[r, s, c] took 13 ms)


@task_kernel(fastmath=FMA)
def _dx_nhwc_rows(t0, t1, gy, y, use_mask, wtile, geo, dx):
    # Stride 1 along w, multiplier 1 (see _forward_nhwc_rows): gy, y: (N, P, Q*C);  wtile:
    # (R, S, Q*C);  dx: (N, H, W*C).  Task t: input row (n, h) = divmod(t, H), as _dx_nhwc's.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    gs = np.empty((R, Q * C), gy.dtype)        # gated rows of g (_kept_gated_row)
    keys = np.full(R, -1, np.int64)
    for t in range(t0, t1):
        n, h = t // H, t % H
        d = dx[n, h]                                                  # (W*C,)
        d[:] = 0
        for r in range(R):
            num = h + ph - r * dh                                     # = p * sh
            if num < 0 or num % sh != 0 or num // sh >= P:
                continue
            g = _kept_gated_row(gy, y, use_mask, n, num // sh, gs, keys)
            for s in range(S):
                q0, q1 = _valid_range(s, 1, pw, dw, W, Q)
                if q1 > q0:
                    x0, m = (q0 - pw + s * dw) * C, (q1 - q0) * C
                    _fma(d[x0:x0 + m], g[q0 * C:q1 * C], wtile[r, s, :m])


@task_kernel(fastmath=FMA)
def _dx_nchw(t0, t1, gy, y, use_mask, w, geo, Wph, dx):
    # gy, y: (N, K, P, Q);  w: (K, R, S);  dx: (N, C, H, W).  Task t: input plane (n, c) =
    # divmod(t, C), which the task owns: its filters' gated g (rows of Wph, zero past Q) times
    # each tap added into the plane's phases (_forward_nchw's offsets), then merged into dx.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    M = K // C
    L = P * Wph
    dph = np.empty((sh * sw, (P + (R - 1) * dh // sh + 1) * Wph), gy.dtype)
    g = np.zeros(L, gy.dtype)                                         # (columns >= Q stay 0)
    for t in range(t0, t1):
        n, c = t // C, t % C
        dph[:] = 0
        for k in range(c * M, c * M + M):
            _gate_plane(gy[n, k], y[n, k], use_mask, Wph, g)
            for r in range(R):
                for s in range(S):
                    off = (r * dh) // sh * Wph + (s * dw) // sw
                    dst = dph[(r * dh) % sh * sw + (s * dw) % sw]
                    _axpy(dst[off:off + L], g, w[k, r, s])
        _merge_phases(dph, ph, pw, sh, sw, Wph, dx[n, c])


# --------------------------------------------------------------------------- dW and db

@task_kernel(fastmath=FMA)
def _dw_nhwc(t0, t1, x, gy, y, use_mask, need_dw, geo, plan, dw_parts, db_parts):
    # x: (N, H, W, C);  gy, y: (N, P, Q, K);  dw_parts: (groups, M, R, S, C);  db_parts:
    # (groups, K) float64;  plan: (rpc, nchunks, groups).  Task t: group t, the chunks
    # [t*nchunks//groups, (t+1)*...), a chunk being output rows [p0, p0 + rpc) of one image.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    rpc, nchunks, groups = plan
    M = K // C
    nb = (P + rpc - 1) // rpc
    g = np.empty((M, C), gy.dtype)                                    # one pixel's gated g
    zero = np.zeros(1, gy.dtype)[0]
    for t in range(t0, t1):
        dwp, dbp = dw_parts[t], db_parts[t]
        dwp[:] = 0
        dbp[:] = 0
        for chunk in range(t * nchunks // groups, (t + 1) * nchunks // groups):
            n, p0 = chunk // nb, (chunk % nb) * rpc
            for p in range(p0, min(P, p0 + rpc)):
                for q in range(Q):
                    gv, yv = gy[n, p, q], y[n, p, q]                  # (K,), (K,)
                    for m in range(M):
                        gm = g[m]
                        for c in range(C):
                            i = c * M + m
                            gm[c] = gv[i] if not use_mask or yv[i] > 0 else zero
                            dbp[i] += gm[c]
                    if not need_dw:
                        continue
                    for r in range(R):
                        h = p * sh - ph + r * dh
                        if h < 0 or h >= H:
                            continue
                        for s in range(S):
                            wi = q * sw - pw + s * dw
                            if wi < 0 or wi >= W:
                                continue
                            xv = x[n, h, wi]                          # (C,)
                            for m in range(M):
                                a, gm = dwp[m, r, s], g[m]            # (C,), (C,)
                                for c in range(C):
                                    a[c] += gm[c] * xv[c]


@task_kernel(fastmath=FMA)
def _dw_nchw(t0, t1, x, gy, y, use_mask, need_dw, geo, plan, dw_parts, db_parts):
    # x: (N, C, H, W);  gy, y: (N, K, P, Q);  dw_parts: (groups, K, R, S), db_parts: (groups, K),
    # both float64;  plan: (nchunks, groups, Wph).  Task t: group t, the chunks
    # [t*nchunks//groups, (t+1)*...), a chunk being input plane (n, c) = divmod(chunk, C) and
    # its filters: dw[k, r, s] += the dot product of the gated g (rows of Wph, zero past Q)
    # with the tap's window of the plane's phases (_forward_nchw's offsets).
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    nchunks, groups, Wph = plan
    M = K // C
    L = P * Wph
    xph = np.zeros((sh * sw, (P + (R - 1) * dh // sh + 1) * Wph), x.dtype)   # padding
    g = np.zeros(L, gy.dtype)                                         # (columns >= Q stay 0)
    for t in range(t0, t1):
        dwp, dbp = dw_parts[t], db_parts[t]
        dwp[:] = 0
        dbp[:] = 0
        for chunk in range(t * nchunks // groups, (t + 1) * nchunks // groups):
            n, c = chunk // C, chunk % C
            if need_dw:
                _split_phases(x[n, c], ph, pw, sh, sw, Wph, xph)
            for k in range(c * M, c * M + M):
                _gate_plane(gy[n, k], y[n, k], use_mask, Wph, g)
                dbp[k] += sum64(g)
                if not need_dw:
                    continue
                for r in range(R):
                    for s in range(S):
                        off = (r * dh) // sh * Wph + (s * dw) // sw
                        src = xph[(r * dh) % sh * sw + (s * dw) % sw]
                        dwp[k, r, s] += _dot64(g, src[off:off + L])


def backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``y = relu?(depthwise_conv(x, w) + b)``; ``y`` given: g = gy * (y > 0).
    Only the gradients flagged in ``need`` are computed (the others are None)."""
    need_dx, need_dw, need_db = (bool(v) for v in need)
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    if _nchw.by_nhwc(geom, gy.dtype, _nchw.NHWC_BACKWARD_MAX_PIXELS):
        return _nchw.backward_by_nhwc(backward, gy, x, w, geom, y, need)
    M, use_mask = K // C, y is not None
    y = y if use_mask else gy
    nhwc = geom.layout == "NHWC"
    geo = conv_math.geo_tuple(geom)
    work = x.size + 2 * gy.size
    dx = dw = db = None
    gated = _gate_once(geom, gy.dtype, use_mask, need)
    if need_dw or need_db:                                 # (first: it may gate g for dX)
        dw, db, g = _dw_db(gy, x, y, use_mask, geom, (need_dw, need_db, gated), geo, work)
        if gated:                                          # dX reads g in place
            gy = y = g.reshape(gy.shape)
            use_mask = False
    if need_dx:
        dx = _out.empty(geom.x_shape, gy.dtype)
        H, W = geom.H, geom.W
        if nhwc and _tiled_dx(geom, gy.dtype, gated):
            _nhwc.dx_phases(gy, y, use_mask, w, geom, CHUNK_ELEMENTS, dx)
        elif nhwc and _flat_rows(geom):
            launch(_dx_nhwc_rows, N * H, gy.reshape(N, P, Q * K), y.reshape(N, P, Q * K),
                   use_mask, _tiled_taps(w, geom), geo, dx.reshape(N, H, W * C), work=work)
        elif nhwc and M == 1:
            launch(_dx_nhwc_gated, N * H, gy.reshape(N, P, Q * K), y.reshape(N, P, Q * K),
                   use_mask, _taps_nhwc(w, C, M)[0], geo, dx.reshape(N, H, W * C), work=work)
        elif nhwc:
            launch(_dx_nhwc, N * H, gy, y, use_mask, _taps_nhwc(w, C, M), geo, dx, work=work)
        else:
            _phases.ready(gy.dtype, geom, merging=True)
            launch(_dx_nchw, N * C, gy, y, use_mask, w.reshape(K, R, S), geo,
                   _phase_width(geom), dx, work=work)
    return dx, dw, db


def _dw_db(gy, x, y, use_mask, geom, flags, geo, work):
    """(dw or None, db or None, g): backward's dW and db passes (flags: need_dw, need_db,
    keep); with keep (_gate_once: the dW tiles) the gated g, (N, P, Q*K), is kept for dX."""
    need_dw, need_db, keep = flags
    N, C, K, R, S, P, Q = geom.N, geom.C, geom.K, geom.R, geom.S, geom.P, geom.Q
    M = K // C
    dw = db = g = None
    if geom.layout == "NHWC":
        rpc = _rows_per_chunk(geom)
        nchunks = N * blocks(P, rpc)
        groups = min(nchunks, DW_GROUPS)
        dw_parts = np.empty((groups, M, R, S, C), gy.dtype)
        db_parts = np.empty((groups, K))                              # float64
        if _tiled_dw(geom, x.dtype):
            _tiles.ready(_tiles.DW_TILES)
            g = _out.empty((N, P, Q * K), gy.dtype) if keep else np.empty((0, 0, 0), gy.dtype)
            launch(_nhwc.dw_tiled, groups, x, gy.reshape(N, P, Q * K), y.reshape(N, P, Q * K),
                   use_mask, geo, (rpc, nchunks, groups, _gemm_taps.WIDE, need_dw,
                                   bool(_copied(x, C))),
                   _tap_offsets(geom), dw_parts.reshape(groups, R * S, C), db_parts, g,
                   work=work, grain=1)
        else:
            launch(_dw_nhwc, groups, x, gy, y, use_mask, need_dw, geo,
                   (rpc, nchunks, groups), dw_parts, db_parts, work=work, grain=1)
        if need_dw:                                                   # (M, R, S, C) -> (K, 1, R, S)
            dw = np.ascontiguousarray(
                np.add.reduce(dw_parts, axis=0).transpose(3, 0, 1, 2)).reshape(K, 1, R, S)
    else:
        nchunks = N * C
        groups = min(nchunks, DW_GROUPS)
        dw_parts = np.empty((groups, K, R, S))                        # float64
        db_parts = np.empty((groups, K))                              # float64
        if need_dw:
            _phases.ready(x.dtype, geom)
        launch(_dw_nchw, groups, x, gy, y, use_mask, need_dw, geo,
               (nchunks, groups, _phase_width(geom)), dw_parts, db_parts, work=work, grain=1)
        if need_dw:                                                   # group order
            dw = np.add.reduce(dw_parts, axis=0).astype(gy.dtype).reshape(K, 1, R, S)
    if need_db:
        db = np.add.reduce(db_parts, axis=0).astype(gy.dtype)               # group order
    return dw, db, g
