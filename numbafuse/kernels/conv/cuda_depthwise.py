r"""numba.cuda depthwise convolution kernels (``groups == C``): direct stencils, no GEMM.

A depthwise convolution has one input channel per group and ``K = C * M`` filters (M, the
channel multiplier, >= 1): filter ``k = c*M + m`` sees input channel c only; w is
``(K, 1, R, S)``. Each output value is R*S multiply-adds, so the passes are bound by memory,
not arithmetic: one thread per value, reading its taps directly (``cuda_grouped.py`` ran it
as C width-1 GEMMs, each with its copies: 3*C launches a pass). The same kernels take any
grouped conv (Cg = C/groups input channels a group, each value summing its group's channels;
``cuda_grouped`` sends those of few channels a group here: where Cg = 1 that sum is the one
term below). Same semantics as the CPU's ``cpu_depthwise.py``::

    forward  y[n,k,p,q]  = relu?(sum_{r,s} x[n, c, p*sh - ph + r*dh, q*sw - pw + s*dw] w[k,r,s]
                                 + b?[k])
    backward g = gy * (y > 0)  (y given; else g = gy)
             dx[n,c,h,w] = sum_{m,r,s} g[n, c*M + m, p, q] w[c*M + m, r, s]
                           over the (p, q) with h = p*sh - ph + r*dh, w = q*sw - pw + s*dw
             dw[k,r,s]   = sum_{n,p,q} g[n,k,p,q] x[n, c, p*sh - ph + r*dh, q*sw - pw + s*dw]
             db[k]       = sum_{n,p,q} g[n,k,p,q]                (reduce.channel_sums)

Notation as in ``cuda.py`` (N, C, H, W, K, R, S, P, Q, sh/sw, ph/pw top/left padding,
dh/dw dilation); M multiplier. Arrays travel flat; ``strides`` are element strides
``(n, c, h, w)`` of the layout.

**Forward and dx: one value per thread per step of a grid-stride loop, in the layout's own
order**, so consecutive threads write consecutive addresses: NHWC channels (y's digits
``(n, p, q, c, m)``, dx's ``(n, h, w, c)``), NCHW columns (``(n, c, m, p, q)``,
``(n, c, h, w)``). A thread splits its first index into those mixed-radix digits once
(:func:`_digits`, unsigned divisions); every later step adds the grid size's digits, made on
the host, with one carry compare per digit (:func:`_advance`): the loops never divide.
The forward skips the taps in the padding by two compares. dx reads, per input row h, the
taps that reach it from a host table (:func:`dx_taps`): the first tap r0, its output row p0
and their count; the next ones are r0 + i*rstep at p0 - i*pstep (``rstep = sh / gcd(sh,
dh)``), so a strided convolution iterates only the taps that hit, with no divisibility test;
likewise per column w.

**dw deterministic**: block (part, tap, channel group) sums its fixed share ``part`` of the
N*P*Q pixels of one tap (r, s) for a group of CW channels (NHWC: CW = ``config.
depthwise_lanes`` channels across the lanes, coalesced; NCHW: CW = 1, the block's threads on
consecutive pixels), in float64; the block's row groups are combined by a fixed shared-memory
tree, each (k, tap) writes ``partials[k*RS + tap, part]``, and :func:`_sum_parts` adds the
parts in order. No atomics: results repeat bit for bit.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import float32, float64, int32, types, uint32

from ...cuda import empty as pool_empty, flat, numba_cuda as cuda, to_device

from ..cuda import config
from ..cuda import reduce
from ..cuda.launch import launch
from ..elementwise.cuda import fill
from . import math as conv_math

BLOCK = config.BLOCK
LIMIT = 2**30          # elements of one array: the kernels index in int32 (as cuda.py's plans)
MAX_TAPS = 65535       # dW: one grid row (gridDim.y, whose hardware limit this is) per tap

is_depthwise = conv_math.is_depthwise


# --------------------------------------------------------------------------- index digits

@cuda.jit(device=True, inline=True)
def _digits(i, rad):
    """The five mixed-radix digits (most significant first) of 0 <= i < 2**32 in radices
    ``rad`` (rad[0] unbounded): unsigned 32-bit divisions, inline, once per thread."""
    v = uint32(i)
    q = uint32(v // uint32(rad[4]))
    d4 = int32(v - q * uint32(rad[4]))
    v = uint32(q // uint32(rad[3]))
    d3 = int32(q - v * uint32(rad[3]))
    q = uint32(v // uint32(rad[2]))
    d2 = int32(v - q * uint32(rad[2]))
    v = uint32(q // uint32(rad[1]))
    d1 = int32(q - v * uint32(rad[1]))
    return int32(v), d1, d2, d3, d4


@cuda.jit(device=True, inline=True)
def _carry(d, step, carry, radix):
    """(digit, carry out) of digit ``d`` plus ``step`` (< radix) plus ``carry`` (0 or 1)."""
    d = int32(d + step + carry)
    if d >= radix:
        return int32(d - radix), int32(1)
    return d, int32(0)


@cuda.jit(device=True, inline=True)
def _advance(d0, d1, d2, d3, d4, step, rad):
    """The digits of index + S, S's digits ``step``: adds and compares only."""
    d4, c = _carry(d4, int32(step[4]), int32(0), int32(rad[4]))
    d3, c = _carry(d3, int32(step[3]), c, int32(rad[3]))
    d2, c = _carry(d2, int32(step[2]), c, int32(rad[2]))
    d1, c = _carry(d1, int32(step[1]), c, int32(rad[1]))
    return int32(d0 + step[0] + c), d1, d2, d3, d4


def host_digits(v, rad):
    """:func:`_digits` on the host (any v >= 0): a grid size's steps."""
    out = []
    for radix in rad[:0:-1]:
        v, d = divmod(int(v), int(radix))
        out.append(d)
    return (v, *out[::-1])


# --------------------------------------------------------------------------- kernels

@cuda.jit(cache=True)
def _forward(x, w, b, y, dims, strides, rad, step, flags):
    # x: (N*C*H*W,) in layout;  w: (K*Cg*R*S,);  b: (K,) (read under has_bias);  y:
    # (N*K*P*Q,) in layout, i its flat index;  dims: (H, W, R, S, sh, sw, ph, pw, dh, dw, M,
    # Cg): M filters and Cg input channels a group (depthwise: Cg = 1, M the multiplier);
    # strides: x's (n, c, h, w);  rad/step: y's digits (NHWC (n, p, q, grp, m), NCHW
    # (n, grp, m, p, q), grp the group) and the grid size's;  flags: (nhwc, has_bias, relu).
    # Index math in int32 (every sum truncated: numba widens int32 + int32 to int64), the
    # taps walked by increments, a tap in the padding skipped by one unsigned compare.
    H, W, R, S = int32(dims[0]), int32(dims[1]), int32(dims[2]), int32(dims[3])
    sh, sw, ph, pw = int32(dims[4]), int32(dims[5]), int32(dims[6]), int32(dims[7])
    dh, dw, M, Cg = int32(dims[8]), int32(dims[9]), int32(dims[10]), int32(dims[11])
    xs_n, xs_c = int32(strides[0]), int32(strides[1])
    xs_h, xs_w = int32(strides[2]), int32(strides[3])
    row_step, col_step = int32(dh * xs_h), int32(dw * xs_w)
    nhwc, has_bias, relu = flags
    start = cuda.grid(1)
    d0, d1, d2, d3, d4 = _digits(start, rad)
    for i in range(start, y.size, cuda.gridsize(1)):
        if nhwc:
            n, p, q, grp, m = d0, d1, d2, d3, d4
        else:
            n, grp, m, p, q = d0, d1, d2, d3, d4
        k = int32(grp * M + m)
        h0 = int32(p * sh - ph)
        w0 = int32(q * sw - pw)
        xc = int32(int32(n * xs_n + grp * Cg * xs_c) + int32(h0 * xs_h + w0 * xs_w))
        wr = int32(k * Cg * R * S)          # w's rows (k, cc, r) follow one another
        acc = float32(0.0)                  # (y's dtype: float64 + float32 unify to float64)
        cc = int32(0)
        while cc < Cg:
            h = h0
            xr = xc
            r = int32(0)
            while r < R:
                if uint32(h) < uint32(H):
                    xi = xr
                    col = w0
                    s = int32(0)
                    while s < S:
                        if uint32(col) < uint32(W):
                            acc += x[uint32(xi)] * w[uint32(wr + s)]
                        xi = int32(xi + col_step)
                        col = int32(col + dw)
                        s = int32(s + 1)
                h = int32(h + dh)
                xr = int32(xr + row_step)
                wr = int32(wr + S)
                r = int32(r + 1)
            xc = int32(xc + xs_c)
            cc = int32(cc + 1)
        if has_bias:
            acc += b[k]
        if relu:
            acc = reduce.relu(acc)
        y[i] = acc
        d0, d1, d2, d3, d4 = _advance(d0, d1, d2, d3, d4, step, rad)


@cuda.jit(cache=True)
def _dx(gy, y, w, dx, rtab, stab, dims, strides, rad, step, flags):
    # gy, y: (N*K*P*Q,) in layout (y read under use_mask: g = gy * (y > 0));  w:
    # (K*Cg*R*S,);  dx: (N*C*H*W,) in layout, i its flat index;  rtab: (H, 3), stab: (W, 3)
    # (dx_taps);  dims: (R*S, S, M, rstep, pstep, sstep, qstep, Cg): M filters and Cg
    # channels a group (depthwise: Cg = 1);  strides: gy's (n, k, p, q);  rad/step: dx's
    # digits (NHWC (n, h, w, group, cc), NCHW (n, group, cc, h, w); channel c = group*Cg +
    # cc) and the grid size's;  flags: (nhwc, use_mask)
    RS, S, M, rstep, pstep, sstep, qstep, Cg = dims
    gs_n, gs_k, gs_p, gs_q = strides
    nhwc, use_mask = flags
    start = cuda.grid(1)
    d0, d1, d2, d3, d4 = _digits(start, rad)
    for i in range(start, dx.size, cuda.gridsize(1)):
        if nhwc:
            n, h, col, grp, cc = d0, d1, d2, d3, d4
        else:
            n, grp, cc, h, col = d0, d1, d2, d3, d4
        r0, p0, nr = rtab[h, 0], rtab[h, 1], rtab[h, 2]
        s0, q0, ns = stab[col, 0], stab[col, 1], stab[col, 2]
        acc = float32(0.0)                  # (dx's dtype)
        for m in range(M):
            k = int32(grp * M + m)
            gk = int32(n * gs_n + k * gs_k)
            wk = int32(int32(k * Cg + cc) * RS)
            r = r0
            p = p0
            for _ in range(nr):             # the taps reaching row h, from output rows p
                grow = int32(gk + p * gs_p)
                wr = int32(wk + r * S)
                s = s0
                q = q0
                for _ in range(ns):         # ... and column col, from output columns q
                    off = uint32(grow + q * gs_q)
                    g = gy[off]
                    if use_mask and not y[off] > 0:
                        g = float32(0.0)
                    acc += g * w[uint32(wr + s)]
                    s = int32(s + sstep)
                    q = int32(q - qstep)
                r = int32(r + rstep)
                p = int32(p - pstep)
        dx[i] = acc
        d0, d1, d2, d3, d4 = _advance(d0, d1, d2, d3, d4, step, rad)


@cuda.jit(device=True, inline=True)
def _next_pixel(n, p, q, step, rad):
    """(n, p, q) plus the pixel step whose digits are ``step`` (rad: (_, _, N, P, Q))."""
    q, c = _carry(q, int32(step[4]), int32(0), int32(rad[4]))
    p, c = _carry(p, int32(step[3]), c, int32(rad[3]))
    return int32(n + step[2] + c), p, q


@cuda.jit(cache=True)
def _dw_partials(x, gy, y, partials, dims, xstrides, gstrides, rad, use_mask):
    # x: (N*C*H*W,), gy, y: (N*K*P*Q,) in layout (y read under use_mask);  partials:
    # (K*Cg*R*S*parts,) float64, [(kc*RS + tap)*parts + part], kc = k*Cg + cc a row of w;
    # dims: (H, W, S, RS, sh, sw, ph, pw, dh, dw, M, KC, CW, kblocks, NPQ, chunk, Cg): M
    # filters and Cg channels a group, KC = K*Cg rows;  x's and gy's strides (n, c, h, w);
    # rad: (1, 1, N, P, Q), the pixel digits. Block (part, tap, row group): lane l of CW
    # takes row kb*CW + l, row group rg of RG = threads / CW the pixels lo + rg, + RG, ...
    # of [lo, hi), part's fixed share of the N*P*Q; grid.y = R*S taps
    buf = cuda.shared.array(BLOCK, float64)
    H, W, S, RS, sh, sw, ph, pw, dh, dw, M, KC, CW, kblocks, NPQ, chunk, Cg = dims
    xs_n, xs_c, xs_h, xs_w = xstrides
    gs_n, gs_k, gs_p, gs_q = gstrides
    t = int32(cuda.threadIdx.x)
    lane = int32(uint32(t) % uint32(CW))
    rg = int32(uint32(t) // uint32(CW))
    RG = int32(uint32(cuda.blockDim.x) // uint32(CW))
    parts = int32(cuda.gridDim.x)
    part = int32(cuda.blockIdx.x)
    lo = int32(part * chunk)
    hi = int32(min(NPQ, lo + chunk))
    _, _, n0, p0, q0 = _digits(lo + rg, rad)        # this thread's first pixel
    pix_step = _digits(RG, rad)                      # and the step to its next
    tap = int32(cuda.blockIdx.y)                     # (r, s), this block's tap
    r = int32(uint32(tap) // uint32(S))
    hr = int32(r * dh - ph)
    ws = int32((tap - r * S) * dw - pw)
    kc = int32(cuda.blockIdx.z * CW + lane)          # this lane's row of w (k, cc) ...
    kb = int32(cuda.blockIdx.z)
    while kb < kblocks:     # ... and the next ones, gridDim.z*CW further on
        k = int32(uint32(kc) // uint32(Cg))          # filter k, its channel cc of group
        c = int32(int32(uint32(k) // uint32(M)) * Cg + (kc - k * Cg))   # k // M: input c
        acc = float64(0.0)
        if kc < KC:
            gk = int32(k * gs_k)
            xc = int32(c * xs_c)
            n, p, q = n0, p0, q0
            j = int32(lo + rg)
            while j < hi:
                h = int32(p * sh + hr)
                col = int32(q * sw + ws)
                if 0 <= h and h < H and 0 <= col and col < W:
                    off = uint32(n * gs_n + gk + p * gs_p + q * gs_q)
                    g = gy[off]
                    if use_mask and not y[off] > 0:
                        g = float32(0.0)
                    acc += float64(g) * float64(
                        x[uint32(n * xs_n + xc + h * xs_h + col * xs_w)])
                n, p, q = _next_pixel(n, p, q, pix_step, rad)
                j = int32(j + RG)
        buf[t] = acc
        cuda.syncthreads()  # every row group's sum is in buf
        half = int32(RG >> 1)
        while half > 0:     # a fixed tree over the row groups: deterministic
            if rg < half:
                buf[t] += buf[t + half * CW]
            cuda.syncthreads()  # this level is complete before the next reads it
            half = int32(half >> 1)
        if rg == 0 and kc < KC:
            partials[uint32((kc * RS + tap) * parts + part)] = buf[t]
        cuda.syncthreads()  # buf is read before the next channel group writes it
        kb = int32(kb + cuda.gridDim.z)
        kc = int32(kc + cuda.gridDim.z * CW)


@cuda.jit(cache=True)
def _sum_parts(partials, parts, out):
    # partials: (n*parts,) float64, row-major;  out: (n,) = each row's parts summed in part
    # order, in float64 (deterministic), stored in out's dtype
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        acc = float64(0.0)
        base = i * parts
        for j in range(parts):
            acc += partials[base + j]
        out[i] = acc


# --------------------------------------------------------------------------- host plans

def _strides(layout, C, H, W):
    """Element strides (n, c, h, w) of a contiguous activation."""
    if layout == "NHWC":
        return H * W * C, 1, W * C, C
    return C * H * W, H * W, W, 1


def _check_size(op, geom):
    if max(geom.N * geom.C * geom.H * geom.W, geom.N * geom.K * geom.P * geom.Q) >= LIMIT:
        raise ValueError(f"{op}: tensors of 2**30 elements or more are not supported on the "
                         f"device (the kernels index in int32)")


@functools.lru_cache(maxsize=256)
def _grid_steps(rad, grid_size):
    """The digits of a grid-stride loop's step (``grid_size`` threads) in radices ``rad``."""
    return host_digits(grid_size, rad)


def dx_taps(size_in, taps, stride, pad, dil, size_out):
    """``(table (size_in, 3) int32, tstep, ostep)``: per input position i, the first tap t0
    reaching it from an output position 0 <= o0 < size_out (``conv_math.output_coord``), o0,
    and how many taps do; the others are ``t0 + j*tstep`` at ``o0 - j*ostep``
    (``tstep = stride / gcd(stride, dil)``). Count 0: no tap reaches i."""
    g = math.gcd(stride, dil)
    tstep, ostep = stride // g, dil // g
    table = np.zeros((size_in, 3), np.int32)
    for i in range(size_in):
        hits = [(t, conv_math.output_coord(i, t, stride, pad, dil, size_out))
                for t in range(taps)]
        hits = [(t, o) for t, o in hits if o >= 0]
        if hits:
            t0, o0 = hits[0]
            if hits != [(t0 + j * tstep, o0 - j * ostep) for j in range(len(hits))]:
                raise AssertionError(f"dx_taps: {hits} is no progression")
            table[i] = (t0, o0, len(hits))
    return table, tstep, ostep


@functools.lru_cache(maxsize=256)
def _dx_plan(geom):
    """(rtab, stab on the device, dims, gy's strides, dx's radices) of dx (once per geometry)."""
    rtab, rstep, pstep = dx_taps(geom.H, geom.R, geom.sh, geom.ph, geom.dh, geom.P)
    stab, sstep, qstep = dx_taps(geom.W, geom.S, geom.sw, geom.pw, geom.dw, geom.Q)
    G, Cg = geom.groups, geom.C // geom.groups
    dims = (geom.R * geom.S, geom.S, geom.K // G, rstep, pstep, sstep, qstep, Cg)
    N, H, W = geom.N, geom.H, geom.W
    rad = (N, H, W, G, Cg) if geom.layout == "NHWC" else (N, G, Cg, H, W)
    return (to_device(rtab), to_device(stab), dims,
            _strides(geom.layout, geom.K, geom.P, geom.Q), rad)


@functools.lru_cache(maxsize=256)
def _forward_plan(geom):
    """(dims, x's strides, y's radices) of the forward (any groups: the direct stencil)."""
    g = geom
    M, G = g.K // g.groups, g.groups
    dims = (g.H, g.W, g.R, g.S, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, M, g.C // G)
    rad = (g.N, g.P, g.Q, G, M) if g.layout == "NHWC" else (g.N, G, M, g.P, g.Q)
    return dims, _strides(g.layout, g.C, g.H, g.W), rad


def dw_launch(geom, threads):
    """(grid, dims, parts) of dW's partials at ``threads`` a block (``config``'s knobs)."""
    g = geom
    nhwc = g.layout == "NHWC"
    CW = min(config.depthwise_lanes, threads) if nhwc else 1
    if CW < 1 or CW & (CW - 1):
        raise ValueError(f"kernels.cuda.config: depthwise_lanes must be a power of two, "
                         f"got {config.depthwise_lanes}")
    RG, RS, NPQ = threads // CW, g.R * g.S, g.N * g.P * g.Q
    Cg = g.C // g.groups
    kblocks = -(-g.K * Cg // CW)
    parts = max(1, min(config.reduce_blocks, -(-NPQ // (RG * reduce.U)),
                       -(-config.reduce_target_blocks // (RS * kblocks))))
    chunk = -(-NPQ // parts)
    parts = -(-NPQ // chunk)                          # no empty part
    if RS > MAX_TAPS:
        raise ValueError(f"conv_bias_relu_backward: a grouped filter of {RS} taps; at most "
                         f"{MAX_TAPS} on the device")
    grid = (parts, RS, min(kblocks, config.max_grid_y))
    dims = (g.H, g.W, g.S, RS, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, g.K // g.groups,
            g.K * Cg, CW, kblocks, NPQ, chunk, Cg)
    return grid, dims, parts


# --------------------------------------------------------------------------- host entry points

def forward(x, w, b, geom, relu):
    """``y = relu?(depthwise_conv(x, w) + b?)`` for contiguous device arrays of one dtype;
    also any grouped conv (``cuda_grouped`` sends those of few channels a group: each output
    value sums its group's C/groups channels' taps)."""
    _check_size("conv_bias_relu", geom)
    y = pool_empty(geom.y_shape, x.dtype)
    if y.size == 0:
        return y
    dims, strides, rad = _forward_plan(geom)
    blocks, threads = config.grid_1d(y.size)
    has_bias = b is not None
    flags = (int(geom.layout == "NHWC"), int(has_bias), int(bool(relu)))
    launch(_forward, blocks, threads, flat(x), flat(w), flat(b) if has_bias else flat(w),
           flat(y), dims, strides, rad, _grid_steps(rad, blocks * threads), flags)
    return y


def backward(gy, x, w, geom, y=None, need=(True, True, True)):
    """``(dx, dw, db)`` of ``y = relu?(depthwise_conv(x, w) + b?)`` on the device; ``y``
    given: g = gy * (y > 0). Only the gradients flagged in ``need`` are computed. Any grouped
    conv too (``cuda_grouped`` sends those of few channels a group)."""
    need_dx, need_dw, need_db = (bool(v) for v in need)
    _check_size("conv_bias_relu_backward", geom)
    use_mask = y is not None
    gy_f = flat(gy)
    y_f = flat(y) if use_mask else gy_f
    dx = dw = db = None
    if need_dx:
        dx = pool_empty(geom.x_shape, gy.dtype)
        if dx.size and gy.size:
            rtab, stab, dims, strides, rad = _dx_plan(geom)
            blocks, threads = config.grid_1d(dx.size)
            launch(_dx, blocks, threads, gy_f, y_f, flat(w), flat(dx), rtab, stab, dims,
                   strides, rad, _grid_steps(rad, blocks * threads),
                   (int(geom.layout == "NHWC"), int(use_mask)))
        elif dx.size:
            fill(dx, 0.0)
    if need_dw:
        dw = pool_empty(geom.w_shape, gy.dtype)
        if gy.size and x.size:
            threads = config.block_threads()
            grid, dims, parts = dw_launch(geom, threads)
            partials = pool_empty(dw.size * parts, np.float64)
            launch(_dw_partials, grid, threads, flat(x), gy_f, y_f, partials, dims,
                   _strides(geom.layout, geom.C, geom.H, geom.W),
                   _strides(geom.layout, geom.K, geom.P, geom.Q),
                   (1, 1, geom.N, geom.P, geom.Q), int(use_mask))
            launch(_sum_parts, *config.grid_1d(dw.size), partials, parts, flat(dw))
        elif dw.size:
            fill(dw, 0.0)
    if need_db:
        db = reduce.channel_sums(gy, y, geom.layout)
    return dx, dw, db


# --------------------------------------------------------------------------- compiled kernels

_DIGITS = types.UniTuple(types.int64, 5)
_STRIDES = types.UniTuple(types.int64, 4)
PTX_SIGNATURES = [
    (_forward, lambda f: (f[::1],) * 4 + (types.UniTuple(types.int64, 12), _STRIDES, _DIGITS,
                                         _DIGITS, types.UniTuple(types.int64, 3))),
    (_dx, lambda f: (f[::1],) * 4 + (types.int32[:, ::1],) * 2
     + (types.UniTuple(types.int64, 8), _STRIDES, _DIGITS, _DIGITS,
        types.UniTuple(types.int64, 2))),
    (_dw_partials, lambda f: (f[::1],) * 3 + (float64[::1], types.UniTuple(types.int64, 17),
                                              _STRIDES, _STRIDES, _DIGITS, types.int64)),
    (_sum_parts, lambda f: (float64[::1], types.int64, f[::1])),
]
