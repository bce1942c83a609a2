r"""numba.cuda convolution kernels: register-blocked implicit GEMMs with fused epilogues.

Notation: N batch, C input channels, H/W input size, K filters, R/S filter size, P/Q output
size, M = N*P*Q output pixels, CRS = C*R*S, sh/sw stride, ph/pw top/left padding, dh/dw
dilation. Arrays travel flat (1-d, C-contiguous) in either layout; strides are element
strides ``(n, c, h, w)`` of the layout.

Three implicit GEMMs on the one skeleton of ``gemm.py``, none materialising its matrix:

    forward  y (M, K)          = cols (M, CRS) @ w^T (CRS, K);  relu(. + b), one store
    dx       dx[phase] (Mph, C) = G_ph (Mph, T_ph*K) @ W'_ph (T_ph*K, C)   per output phase
    dw       dw[split] (CRS, K) = cols^T (CRS, M_split) @ g (M_split, K)    per split of M
    db       db (K,)            = sum over M of g          (reduce.channel_sums)

with g = gy * (y > 0) applied as gy is loaded. The reduction index k of forward and dw runs
over the taps in the order best for the layout's memory: (c, r, s) for NCHW (consecutive q
are contiguous), (r, s, c) for NHWC (consecutive c are). A host-built **tap table** (T, 4)
int32 per geometry gives for each k ``(toff, th, tw, woff)``: the tap's offset in the
source, its row and column displacement (for the padding test) and its offset in w; padded
with taps that read nothing (``th = PAD_TAP``) to whole K-steps and tiles.

**dx by output phase.** Input row h is reached from output row p through tap r iff
``h + ph - r*dh = p*sh``. Split the input rows by phase ``ha = h % sh`` (and columns by
``wb = w % sw``): in phase (ha, wb), h = ha + sh*i and only the taps with
``(ha + ph - r*dh) % sh == 0`` contribute, each from output row ``p = i + poff[r]``. So each
phase is a dense implicit GEMM over its own taps, like a forward with stride 1: strided
convolutions iterate only the taps that hit (a phase with none writes zeros). The phases are
slices z of one launch (gridDim.z = sh*sw); ``geo[z]`` holds each one's sizes and offsets.

**dw and db are deterministic**: M is cut into fixed splits, each (tile, split) writes its
own partial, and ``_sum_splits`` adds the partials in split order in float64. No atomics.
(Summing them in the dw GEMM instead, by each tile's last block, saves that launch but was
slower at every shape GPU run 15 timed, 1.01-1.09x at 2-8 splits and up to 4.1x at 251: one
block reads its tile's n_splits partials serially while ``_sum_splits`` spreads them over the
GPU.)
"""
from __future__ import annotations

import functools

import numpy as np
from numba import float64, int32, types, uint32

from ...cuda import empty as pool_empty, flat, numba_cuda as cuda

from ..cuda import config
from ..cuda.launch import launch
from ..cuda import gemm
from ..cuda import reduce
from ..elementwise.cuda import fill
from .plans import (FIELDS, PAD_TAP, dw_plan, dx_plan, forward_plan,  # noqa: F401
                    splits)

device = gemm.device

(F_ROWS, F_COLS, F_K_LO, F_K_HI, F_PM, F_QM, F_MUL_H, F_ADD_H, F_MUL_W, F_ADD_W,
 F_SRC_NS, F_SRC_HS, F_SRC_WS, F_SRC_H, F_SRC_W, F_USE_MASK, F_LDW,
 F_OUT_BASE, F_OUT_NS, F_OUT_HS, F_OUT_WS, F_OUT_CS, F_OUT_ZS, F_E0, F_E1,
 F_G_NS, F_G_HS, F_G_WS, F_G_KS, F_M, F_SPLIT_LEN, F_DQ, F_DP, F_DN) = range(len(FIELDS))


# --------------------------------------------------------------------------- operand loaders
# Each factory returns a gemm.Operand for a thread mapping (LK, LR, NK, NR) (gemm.mapping).

@device
def _pixel(m, Q, PQ):
    """(n, p, q) of pixel m = (n*P + p)*Q + q (m >= 0). Unsigned 32-bit divisions (inline,
    no call): for prep and the epilogue, never the K-loop."""
    n = int32(uint32(m) // uint32(PQ))
    pq = int32(m - n * PQ)
    p = int32(uint32(pq) // uint32(Q))
    return n, p, int32(pq - p * Q)


@functools.lru_cache(maxsize=None)
def gather_rows(LK, LR, NK, NR, k_fastest, gated=False):
    """Rows fixed per tile, k from the tap table: forward's cols (x), dx's G (gy masked by y:
    ``gated``).

    st: [SRC_H, SRC_W, USE_MASK] + per own row jr: [base, hh, ww] (hh = PAD_TAP past the
    last row). Element (k, row) = src[base + toff[k]] where 0 <= hh + th[k] < SRC_H and
    0 <= ww + tw[k] < SRC_W, gated by aux (y) at the same offset under USE_MASK.
    """
    @device
    def prep(src, aux, geo, table, z, r0, k_lo, k_hi, lr, lk, st):
        st[0] = geo[z, F_SRC_H]
        st[1] = geo[z, F_SRC_W]
        st[2] = geo[z, F_USE_MASK]
        rows, PM, QM = geo[z, F_ROWS], geo[z, F_PM], geo[z, F_QM]
        for jr in range(NR):
            m = int32(r0 + lr + LR * jr)
            n, p, q = _pixel(m, QM, int32(PM * QM))        # once per tile, not in the K-loop
            hh = int32(p * geo[z, F_MUL_H] + geo[z, F_ADD_H])
            ww = int32(q * geo[z, F_MUL_W] + geo[z, F_ADD_W])
            st[3 + 3 * jr] = int32(n * geo[z, F_SRC_NS] + hh * geo[z, F_SRC_HS]
                                   + ww * geo[z, F_SRC_WS])
            st[4 + 3 * jr] = hh if m < rows else int32(PAD_TAP)
            st[5 + 3 * jr] = ww

    @device
    def fetch(src, aux, geo, table, z, st, k0, lr, lk, regs, gates):
        H, W, use_mask = st[0], st[1], st[2]
        for jk in range(NK):
            k = uint32(k0 + lk + LK * jk)           # unsigned: no wraparound code per read
            toff, th, tw = table[k, 0], table[k, 1], table[k, 2]
            for jr in range(NR):
                h = int32(st[4 + 3 * jr] + th)
                w = int32(st[5 + 3 * jr] + tw)
                regs[jk, jr] = 0.0
                if gated:
                    gates[jk, jr] = 1.0
                if 0 <= h and h < H and 0 <= w and w < W:
                    off = uint32(st[3 + 3 * jr] + toff)
                    regs[jk, jr] = src[off]
                    if gated and use_mask != 0:     # applied at the shared store (gemm.py)
                        gates[jk, jr] = aux[off]

    return gemm.Operand(prep, fetch, 3 + 3 * NR, k_fastest, gated)


@functools.lru_cache(maxsize=None)
def weights(LK, LR, NK, NR, k_fastest):
    """Element (k, col) = w[col*LDW + woff[k]] (forward: w^T; dx: W'); 0 where woff < 0.

    st: per own column jr: col*LDW, or -1 past the last column.
    """
    @device
    def prep(src, aux, geo, table, z, c0, k_lo, k_hi, lr, lk, st):
        for jr in range(NR):
            col = int32(c0 + lr + LR * jr)
            st[jr] = int32(col * geo[z, F_LDW]) if col < geo[z, F_COLS] else int32(-1)

    @device
    def fetch(src, aux, geo, table, z, st, k0, lr, lk, regs, gates):
        for jk in range(NK):
            woff = table[uint32(k0 + lk + LK * jk), 3]
            for jr in range(NR):
                regs[jk, jr] = 0.0
                if st[jr] >= 0 and woff >= 0:
                    regs[jk, jr] = src[uint32(st[jr] + woff)]

    return gemm.Operand(prep, fetch, NR, k_fastest)


@device
def _advance(n, p, q, DN, DP, DQ, P, Q):
    """(n, p, q) of the pixel BK = (DN*P + DP)*Q + DQ further on: adds and compares only."""
    q = int32(q + DQ)
    p = int32(p + DP)
    n = int32(n + DN)
    if q >= Q:
        q = int32(q - Q)
        p = int32(p + 1)
    if p >= P:
        p = int32(p - P)
        n = int32(n + 1)
    return n, p, q


# dw loaders: the reduction runs over pixels m, k = m; both track their pixels (n, p, q) with
# counters, one set per jk, advanced by BK after each fetch.
# st layout shared by both: per jk [n, p, q, m] at 4*jk; then loader-specific entries.

@device
def _dw_counters_prep(geo, k_lo, lk, LK, jk, st):
    m = int32(k_lo + lk + LK * jk)
    n, p, q = _pixel(m, geo[0, F_QM], int32(geo[0, F_PM] * geo[0, F_QM]))
    st[4 * jk] = n
    st[4 * jk + 1] = p
    st[4 * jk + 2] = q
    st[4 * jk + 3] = m


@functools.lru_cache(maxsize=None)
def dw_cols(LK, LR, NK, NR, k_fastest):
    """dw's A: element (m, row k) = x[n*NS + hh*HS + ww*WS + toff[k]] (im2col transposed),
    hh = p*sh - ph + th[k], ww = q*sw - pw + tw[k]; rows k fixed per tile (table in st).

    st: counters (4*NK), then per jr [toff, th, tw] (3*NR), then [k_hi, H, W, P, Q, DN, DP,
    DQ, sh, ph, sw, pw, NS, HS, WS] (15).
    """
    S0 = 4 * NK
    C0 = S0 + 3 * NR

    @device
    def prep(src, aux, geo, table, z, r0, k_lo, k_hi, lr, lk, st):
        for jk in range(NK):
            _dw_counters_prep(geo, k_lo, lk, LK, jk, st)
        for jr in range(NR):
            k = int32(r0 + lr + LR * jr)        # the table is padded to whole row tiles
            st[S0 + 3 * jr] = table[k, 0]
            st[S0 + 3 * jr + 1] = table[k, 1]
            st[S0 + 3 * jr + 2] = table[k, 2]
        st[C0] = k_hi
        st[C0 + 1] = geo[0, F_SRC_H]
        st[C0 + 2] = geo[0, F_SRC_W]
        st[C0 + 3] = geo[0, F_PM]
        st[C0 + 4] = geo[0, F_QM]
        st[C0 + 5] = geo[0, F_DN]
        st[C0 + 6] = geo[0, F_DP]
        st[C0 + 7] = geo[0, F_DQ]
        st[C0 + 8] = geo[0, F_MUL_H]
        st[C0 + 9] = geo[0, F_ADD_H]
        st[C0 + 10] = geo[0, F_MUL_W]
        st[C0 + 11] = geo[0, F_ADD_W]
        st[C0 + 12] = geo[0, F_SRC_NS]
        st[C0 + 13] = geo[0, F_SRC_HS]
        st[C0 + 14] = geo[0, F_SRC_WS]

    @device
    def fetch(src, aux, geo, table, z, st, k0, lr, lk, regs, gates):
        k_hi, H, W = st[C0], st[C0 + 1], st[C0 + 2]
        for jk in range(NK):
            n, p, q, m = st[4 * jk], st[4 * jk + 1], st[4 * jk + 2], st[4 * jk + 3]
            hh = int32(p * st[C0 + 8] + st[C0 + 9])
            ww = int32(q * st[C0 + 10] + st[C0 + 11])
            base = int32(n * st[C0 + 12] + hh * st[C0 + 13] + ww * st[C0 + 14])
            for jr in range(NR):
                h = int32(hh + st[S0 + 3 * jr + 1])
                w = int32(ww + st[S0 + 3 * jr + 2])
                regs[jk, jr] = 0.0
                if m < k_hi and 0 <= h and h < H and 0 <= w and w < W:
                    regs[jk, jr] = src[uint32(base + st[S0 + 3 * jr])]
            n, p, q = _advance(n, p, q, st[C0 + 5], st[C0 + 6], st[C0 + 7], st[C0 + 3],
                               st[C0 + 4])
            st[4 * jk] = n
            st[4 * jk + 1] = p
            st[4 * jk + 2] = q
            st[4 * jk + 3] = int32(m + LK * NK)

    return gemm.Operand(prep, fetch, C0 + 15, k_fastest)


@functools.lru_cache(maxsize=None)
def dw_grads(LK, LR, NK, NR, k_fastest):
    """dw's B (gated): element (m, col kout) = g = gy[n*G_NS + p*G_HS + q*G_WS + kout*G_KS],
    gated by aux (y) at the same offset under USE_MASK.

    st: counters (4*NK), then per jr kout*G_KS or -1 (NR), then [k_hi, P, Q, DN, DP, DQ,
    G_NS, G_HS, G_WS, USE_MASK] (10).
    """
    S0 = 4 * NK
    C0 = S0 + NR

    @device
    def prep(src, aux, geo, table, z, c0, k_lo, k_hi, lr, lk, st):
        for jk in range(NK):
            _dw_counters_prep(geo, k_lo, lk, LK, jk, st)
        for jr in range(NR):
            col = int32(c0 + lr + LR * jr)
            st[S0 + jr] = int32(col * geo[0, F_G_KS]) if col < geo[0, F_COLS] else int32(-1)
        st[C0] = k_hi
        st[C0 + 1] = geo[0, F_PM]
        st[C0 + 2] = geo[0, F_QM]
        st[C0 + 3] = geo[0, F_DN]
        st[C0 + 4] = geo[0, F_DP]
        st[C0 + 5] = geo[0, F_DQ]
        st[C0 + 6] = geo[0, F_G_NS]
        st[C0 + 7] = geo[0, F_G_HS]
        st[C0 + 8] = geo[0, F_G_WS]
        st[C0 + 9] = geo[0, F_USE_MASK]

    @device
    def fetch(src, aux, geo, table, z, st, k0, lr, lk, regs, gates):
        k_hi, use_mask = st[C0], st[C0 + 9]
        for jk in range(NK):
            n, p, q, m = st[4 * jk], st[4 * jk + 1], st[4 * jk + 2], st[4 * jk + 3]
            base = int32(n * st[C0 + 6] + p * st[C0 + 7] + q * st[C0 + 8])
            for jr in range(NR):
                regs[jk, jr] = 0.0
                gates[jk, jr] = 1.0
                if m < k_hi and st[S0 + jr] >= 0:
                    off = uint32(base + st[S0 + jr])
                    regs[jk, jr] = src[off]
                    if use_mask != 0:               # applied at the shared store (gemm.py)
                        gates[jk, jr] = aux[off]
            n, p, q = _advance(n, p, q, st[C0 + 3], st[C0 + 4], st[C0 + 5], st[C0 + 1],
                               st[C0 + 2])
            st[4 * jk] = n
            st[4 * jk + 1] = p
            st[4 * jk + 2] = q
            st[4 * jk + 3] = int32(m + LK * NK)

    return gemm.Operand(prep, fetch, C0 + 10, k_fastest, True)


# --------------------------------------------------------------------------- problems, epilogues

@device
def _problem_slices(geo, z):
    # forward (z = 0) and the dx phases: everything per slice in geo[z]
    return (geo[z, F_ROWS], geo[z, F_COLS], geo[z, F_K_LO], geo[z, F_K_HI], geo[z, F_E0],
            geo[z, F_E1])


@device
def _problem_split(geo, z):
    # dw: slice z is split z of the output pixels
    k_lo = int32(z * geo[0, F_SPLIT_LEN])
    return (geo[0, F_ROWS], geo[0, F_COLS], k_lo,
            min(geo[0, F_M], int32(k_lo + geo[0, F_SPLIT_LEN])), 0, 0)


@device
def _pixel_row_base(geo, table, z, row):
    # forward / dx: row (n, p, q) of the slice's pixel grid
    n, p, q = _pixel(row, geo[z, F_QM], int32(geo[z, F_PM] * geo[z, F_QM]))
    return int32(geo[z, F_OUT_BASE] + n * geo[z, F_OUT_NS] + p * geo[z, F_OUT_HS]
                 + q * geo[z, F_OUT_WS])


@device
def _tap_row_base(geo, table, z, row):
    # dw: row k is the tap whose w offset is woff[k]; split z's partial block
    return int32(z * geo[0, F_OUT_ZS] + table[row, 3])


@device
def _col_offset(geo, z, col):
    return int32(col * geo[z, F_OUT_CS])


@device
def _col_offset_0(geo, z, col):
    return int32(col * geo[0, F_OUT_CS])


@device
def _store_bias_relu(out, bias, off, col, v, has_bias, relu):
    # forward: relu?(v + b?) before the single store
    if has_bias:
        v += bias[col]
    if relu:
        v = reduce.relu(v)
    out[off] = v


@device
def _store(out, bias, off, col, v, e0, e1):
    out[off] = v


@device
def _store_dx(out, addend, off, col, v, e0, e1):
    # dx: e0 set, the tape's pending gradient of x (``addend``, x's shape) added before the
    # single store (``conv_backward``'s dx_addend: no separate sum kernel); each element of
    # dx is written by one thread of one phase, so the addend may be dx itself
    if e0 != 0:
        v += addend[off]
    out[off] = v


# --------------------------------------------------------------------------- kernels

KINDS = ("fwd", "dx", "dw")


def loader_kinds(kind, layout):
    """(A loader factory, its k_fastest, B loader factory, its k_fastest) of a GEMM."""
    nhwc = layout == "NHWC"
    if kind == "fwd":      # A: x (NCHW: consecutive q contiguous; NHWC: consecutive c)
        return gather_rows, nhwc, weights, True
    if kind == "dx":       # A: g = gy * (y > 0) (NCHW: consecutive q; NHWC: consecutive k)
        return functools.partial(gather_rows, gated=True), nhwc, weights, True
    return dw_cols, not nhwc, dw_grads, not nhwc   # dw: k = pixels (NCHW contiguous)


@functools.lru_cache(maxsize=None)
def gemm_kernel(kind, layout, tile):
    """The compiled-on-first-launch GEMM kernel of one conv pass, layout and tiling."""
    a_fac, a_kf, b_fac, b_kf = loader_kinds(kind, layout)
    threads = tile.threads
    a = a_fac(*gemm.mapping(tile.BM, tile.BK, threads, a_kf), a_kf)
    b = b_fac(*gemm.mapping(tile.BN, tile.BK, threads, b_kf), b_kf)
    name = (f"gemm_{kind}_{layout.lower()}_{tile.BM}x{tile.BN}x{tile.BK}_{tile.TM}x{tile.TN}"
            f"_v{tile.VEC}_b{tile.min_blocks or 0}")      # one disk-cache index each
    if kind == "dw":
        return gemm.build(tile, a, b, _problem_split, _tap_row_base, _col_offset_0, _store,
                          name)
    store = _store_bias_relu if kind == "fwd" else _store_dx
    return gemm.build(tile, a, b, _problem_slices, _pixel_row_base, _col_offset, store, name)


@cuda.jit(cache=True)
def _sum_splits(partials, n_splits, out):
    # partials: (n_splits * n,) in x's dtype, split-major;  out: (n,) = their sum over the
    # splits in split order, in float64 (deterministic)
    n = out.size
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        acc = float64(0.0)
        for s in range(n_splits):
            acc += partials[s * n + i]
        out[i] = acc


@cuda.jit(cache=True)
def _bias_add(x, b, out, C, HW, nhwc):
    # x, out: (N*C*H*W,) in layout;  b: (C,). Channel of element i: i % C (NHWC) or
    # (i // HW) % C (NCHW), tracked with counters: the loop adds and compares, never divides.
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    if nhwc:
        c, dc = start % C, stride % C
        pos, dpos = 0, 0
        HW = 1
    else:
        pos, dpos = start % HW, stride % HW
        c, dc = (start // HW) % C, (stride // HW) % C
    for i in range(start, out.size, stride):
        out[i] = x[i] + b[c]
        pos += dpos
        c += dc
        if pos >= HW:
            pos -= HW
            c += 1
        if c >= C:
            c -= C


# --------------------------------------------------------------------------- host entry points

def _empty(shape, dtype):
    """Every device buffer of this module comes from here: numbafuse's memory pool."""
    return pool_empty(shape, dtype)


def _tile(kind, dtype, layout, cols=None):
    return config.conv_tile(kind, np.dtype(dtype), cols, layout)


def _geometry_key(geom):
    return geom   # ConvGeometry is a frozen dataclass: hashable, the cache key


def conv_forward(x, w, b, geom, relu):
    """``relu?(conv(x, w) + b?)`` for contiguous device arrays; y stays on the device."""
    y = _empty(geom.y_shape, x.dtype)
    if y.size == 0:
        return y
    tile = _tile("fwd", x.dtype, geom.layout, geom.K)
    has_bias = b is not None
    geo, table, grid = forward_plan(_geometry_key(geom), tile, has_bias, bool(relu))
    kern = gemm_kernel("fwd", geom.layout, tile)
    launch(kern, grid, tile.threads, flat(x), flat(w), flat(x), flat(y),
                             flat(b) if has_bias else flat(w), geo, table)
    return y


DX_ADDEND = True    # conv_backward takes dx_addend (interfaces.ConvKernels)


def conv_backward(gy, x, w, geom, y=None, need=(True, True, True), dx_addend=None):
    """``(dx, dw, db)`` on the device; ``y`` given: g = gy * (y > 0). Only ``need`` computed.
    ``dx_addend``: a contiguous device array of x's shape and gy's dtype that dx comes back
    plus, added by the dx GEMM's epilogue (the tape's sum of two gradients of x, without a
    kernel of its own); given only with dx needed and gy non-empty."""
    need_dx, need_dw, need_db = (bool(v) for v in need)
    adding = dx_addend is not None
    if adding and not (need_dx and gy.size and dx_addend.shape == tuple(geom.x_shape)
                       and dx_addend.dtype == gy.dtype):
        raise ValueError("conv backward (cuda): dx_addend must be x's shape and gy's dtype, "
                         "with dx needed and gy non-empty")
    use_mask = y is not None
    gy_f = flat(gy)
    y_f = flat(y) if use_mask else gy_f
    dx = dw = db = None
    if need_dx:
        dx = _empty(geom.x_shape, gy.dtype)
        if dx.size and gy.size:
            tile = _tile("dx", gy.dtype, geom.layout, geom.C)
            geo, table, grid = dx_plan(_geometry_key(geom), tile, use_mask, adding)
            launch(gemm_kernel("dx", geom.layout, tile), grid, tile.threads,
                gy_f, flat(w), y_f, flat(dx), flat(dx_addend) if adding else gy_f, geo, table)
        elif dx.size:
            fill(dx, 0.0)
    if need_dw:
        dw = _empty(geom.w_shape, gy.dtype)
        if gy.size and x.size:
            tile = _tile("dw", gy.dtype, geom.layout)
            geo, table, grid, n_splits = dw_plan(_geometry_key(geom), tile, use_mask,
                                                 config.dw_max_splits)
            # (splits, K*C*R*S) partials summed in order by _sum_splits (one split: written
            # into dw itself)
            partials = _empty(n_splits * dw.size, gy.dtype) if n_splits > 1 else flat(dw)
            launch(gemm_kernel("dw", geom.layout, tile), grid, tile.threads,
                   flat(x), gy_f, y_f, partials, gy_f, geo, table)
            if n_splits > 1:
                launch(_sum_splits, *config.grid_1d(dw.size), partials, n_splits, flat(dw))
        elif dw.size:
            fill(dw, 0.0)
    if need_db:
        db = reduce.channel_sums(gy, y, geom.layout)
    return dx, dw, db


def bias_add(x, b, layout):
    """``x + b[c]`` for a contiguous 4-d device ``x`` in ``layout``."""
    out = _empty(x.shape, x.dtype)
    if out.size == 0:
        return out
    nhwc = int(layout == "NHWC")
    C = x.shape[3] if nhwc else x.shape[1]
    HW = x.shape[1] * x.shape[2] if nhwc else x.shape[2] * x.shape[3]
    blocks, threads = config.grid_1d(x.size)
    launch(_bias_add, blocks, threads, flat(x), b, flat(out), C, HW, nhwc)
    return out


def channel_sum(gy, layout):
    """Per-channel sum of a 4-d device ``gy`` over N, H, W; deterministic; shape (C,)."""
    return reduce.channel_sums(gy, None, layout)


def forward_stats(x, w, geom, eps):
    """None: the device GEMMs have no batch-norm epilogue (the op runs the statistics pass)."""
    return None


def forward_bn_sums(x, w, geom, dy, mean, invstd, gamma, beta):
    """None: the device GEMMs have no batch-norm epilogue (the op recomputes, then runs the
    batch-norm backward's passes)."""
    return None


def forward_scaled(x, w, values, geom, relu, z=None):
    """None: the device GEMMs scale no output channel (the op folds the batch norm into w)."""
    return None


# --------------------------------------------------------------------------- compiled kernels

def _production_gemms():
    """Every production GEMM kernel (kind x layout) at the float32 and float64 tilings, and
    the narrow float32 ones by column count (tags "n", "n2": config.CONV_TILE_TIERS)."""
    out = []
    for kind in KINDS:
        for layout in ("NCHW", "NHWC"):
            for dt in ("float32", "float64"):
                out.append((kind, layout, dt, "", gemm_kernel(kind, layout,
                                                              _tile(kind, dt, layout))))
            tiers = config.CONV_TILE_TIERS.get((kind, layout), ())
            for i, (most, _) in enumerate(tiers):
                out.append((kind, layout, "float32", "n" + (str(i + 1) if i else ""),
                            gemm_kernel(kind, layout, _tile(kind, "float32", layout, most))))
    return out


_GEO = types.int32[:, ::1]
_TAB = types.int32[:, ::1]
GEMM_KERNELS = []
PTX_SIGNATURES = []
for _kind, _layout, _dt, _tag, _k in _production_gemms():
    _k.__name__ = f"gemm_{_kind}_{_layout.lower()}_{_dt[-2:]}{_tag}"
    GEMM_KERNELS.append(_k)
    # each tiling is compiled only for its own dtype: the other is a "wrong" dtype entry
    PTX_SIGNATURES.append((_k, (lambda dt: lambda f: (f[::1],) * 5 + (_GEO, _TAB)
                                if str(f) == dt else None)(_dt)))
PTX_SIGNATURES += [
    (_sum_splits, lambda f: (f[::1], types.int64, f[::1])),
    (_bias_add, lambda f: (f[::1], f[::1], f[::1], types.int64, types.int64, types.int64)),
]
