"""Depthwise NHWC task kernels over the register tiles of ``cpu_depthwise_tiles`` (float32,
multiplier 1, C % 8 == 0; ``cpu_depthwise`` launches them and has the loops for every other
case, and the notation):

    forward_tiled  every output pixel through ``depthwise_taps``, addressed in x itself with
                   the taps that lie inside the image (an output row's interior run shares one
                   tap table, and with 7 tap columns on AVX-512, 5 too on Zen 4, it goes
                   through the sliding tiles, ``cpu_depthwise_slide``; in rows whose tap rows
                   all lie inside, a
                   border column's pixels share one down the rows; any other pixel gets its
                   own); with a mask, over
                   x gated by it,
                   its rows gated per task into a buffer of its own: dX (``dx_phases``) is
                   this kernel over g = gy * (y > 0) with the taps flipped, one launch per
                   phase of dx (at stride 1 one, padding (R-1)*dh - ph, (S-1)*dw - pw), so
                   the two passes share one compiled kernel
    dw_tiled       per output row the gated g (and db from it), then ``depthwise_dw_taps`` over
                   the interior run's pixels and every tap inside, each border pixel over its own;
                   it keeps g for dX where both are computed (dX then reads it in place: g
                   gated once)

``gate_row`` is the ReLU gradient's gate that every depthwise kernel uses.
"""
import os

import numpy as np
from numba import njit

from .. import scalar
from ..cpu import gemm_taps as _gemm_taps
from ..cpu.buffers import aligned as _aligned
from ..cpu.launch import blocks, launch, task_kernel
from . import math as conv_math
from . import cpu_depthwise_slide as _slide
from . import cpu_depthwise_tiles as _tiles

# a*b + c as one fused multiply-add (one rounding), as cpu_depthwise's loops
FMA = {"contract"}

_valid_range = scalar.cpu_scalar(conv_math.valid_range)


@njit(cache=True)
def gate_row(gv, yv, use_mask, g):
    # g[i] <- gv[i] * (yv[i] > 0), or gv[i] (no mask): the ReLU's gradient, 1-d views (a
    # select, not a branch: the loop vectorises)
    if use_mask:
        for i in range(g.shape[0]):
            g[i] = gv[i] if yv[i] > 0 else 0
    else:
        for i in range(g.shape[0]):
            g[i] = gv[i]


@njit(inline="always")         # (each its own compiled call: a cold first forward +0.35 s)
def _aligned_floats(n):
    """A float32 buffer of n values starting on a 64-byte boundary (a task's rows: each
    16-float vector of a row of C % 16 == 0 channels then starts on one)."""
    a = np.empty(n + 16, np.float32)
    return a[(16 - (a.ctypes.data // 4) % 16) % 16:][:n]


@njit(inline="always")
def _input_band(x, mask, gate, n, p0, p1, rows, buf):
    # The input rows of image n that output rows [p0, p1) read, into buf (flat, rows of
    # W*C), gated by mask (gate) or copied; rows = (sh, ph, dh, R). Returns the first row h0:
    # input row h is then at element (h - h0)*W*C of buf.
    sh, ph, dh, R = rows
    H, L = x.shape[1], x.shape[2] * x.shape[3]
    h0 = max(0, p0 * sh - ph)
    h1 = min(H, (p1 - 1) * sh - ph + (R - 1) * dh + 1)
    for h in range(h0, h1):
        gate_row(x[n, h].reshape(L), mask[n, h].reshape(L), gate,
                 buf[(h - h0) * L:(h - h0 + 1) * L])
    return h0


@njit(cache=True, nogil=True)
def _interior(S, W, Q, sw, pw, dw):
    """(qa, qb): the output columns whose every tap column lies inside a row of W."""
    qa = max(0, min(Q, (pw + sw - 1) // sw))                # (pw < 0: a phase of dX)
    last = W - 1 - (S - 1) * dw + pw
    return qa, (max(qa, min(Q, last // sw + 1)) if last >= 0 else qa)


@njit(cache=True, nogil=True)
def _full_rows(p, dh, ph, sh, H, R):
    """Whether every tap row of output row p lies inside the image (and there is one: a
    phase of dX may have none)."""
    r0, r1 = _valid_range(p, dh, ph, sh, H, R)
    return R > 0 and r0 == 0 and r1 == R


@njit(cache=True, nogil=True)
def _run_at(q, lo, hi, r0, r1, cols, aoff, own, tables):
    # The pixels from output column q that one tile call takes, with their tap table, for
    # forward_tiled and dw_tiled: (m, k, x offsets, w offsets) of the interior run [lo, hi)
    # (every tap of rows [r0, r1), the shared table) if q starts it, else of pixel q alone
    # (its own taps inside, written into own). cols = (S, W, sw, pw, dw); tables = the
    # addresses of aoff's and own's two rows.
    S, W, sw, pw, dw = cols
    pxo, pwo, pown, pownw = tables
    if q == lo and hi > lo:
        return hi - lo, (r1 - r0) * S, pxo + 8 * r0 * S, pwo + 8 * r0 * S
    s0, s1 = _valid_range(q, dw, pw, sw, W, S)                      # tap columns inside
    k = 0
    for r in range(r0, r1):
        for s in range(s0, s1):
            own[0, k], own[1, k] = aoff[0, r * S + s], aoff[1, r * S + s]
            k += 1
    return 1, k, pown, pownw


@task_kernel(fastmath=FMA)
def forward_tiled(t0, t1, x, mask, wts, b, table, plan, aoffs, y):
    # Multiplier 1, float32, C % 8 == 0, every pixel through the register tiles
    # (cpu_depthwise_tiles), addressed in x itself with the taps that lie inside the image: an
    # output row's rows of taps [r0, r1); its interior columns (every tap column inside) share
    # one tap table, a border column gets a table of its own taps. x, mask: (N, H, W, C);
    # b: (C,). Each value is the sum over the valid taps in (r, s) order, as the other NHWC
    # kernels make it. With use_mask the input is x where mask > 0, else 0, its rows gated
    # per task into a buffer of the task's own (on a 64-byte boundary); use_mask 2: the rows
    # copied there, not gated (a forward's x off a cache line: cpu_depthwise._copied). One
    # launch runs one or more problems f (the
    # forward: one; dX: one per phase of dx, x = g, mask = y, a phase's taps flipped, its
    # pixels strided in dx: dx_phases), one compiled kernel for both passes: table[f] = geo
    # (16), flags (relu, use_mask, wide, slide), yl = (y0, yimg, yrow, ypix) and stream
    # (_tiles.STREAM: y by non-temporal stores, the same in every row; else 0) (output pixel
    # (n, p, q) at element y0 + n*yimg + p*yrow + q*ypix of y; (0, P*Q*C, Q*C, C): a (N, P,
    # Q, C) y);  wts[f]: (>= R*S, C) its taps' weights;  aoffs[f]: (2, >= R*S) int64 element
    # offsets of each tap in x and in wts[f]. Task t = (image n, block blk of rpc output rows;
    # plan = (nb, rpc)) runs block blk of every problem in turn: dX's phases of one block lie
    # together in dx (sh*rpc of its rows: written while in cache).
    nb, rpc = plan
    px, py, pb = np.int64(x.ctypes.data), np.int64(y.ctypes.data), np.int64(b.ctypes.data)
    streamed = table.shape[0] > 0 and table[0, 24] != 0
    # a task's buffers, made once for every problem: pixel addresses in x, a border pixel's
    # taps, the gated input rows (flat, rows of the problem's W*C)
    qmax, gmax = rpc, 0
    for f in range(table.shape[0]):
        e = table[f]
        qmax = max(qmax, e[8])
        if e[17] != 0:
            gmax = max(gmax, ((rpc - 1) * e[9] + (e[5] - 1) * e[13] + 1) * e[3] * e[1])
    rows = np.empty(qmax, np.int64)
    own = np.empty((2, aoffs.shape[2]), np.int64)
    gbuf = _aligned_floats(gmax)
    pr, pbuf = np.int64(rows.ctypes.data), np.int64(gbuf.ctypes.data)
    for t in range(t0, t1):
        n, blk = t // nb, t % nb
        for f in range(table.shape[0]):
            e, wt, aoff = table[f], wts[f], aoffs[f]
            C, H, W, R, S, P, Q = e[1], e[2], e[3], e[5], e[6], e[7], e[8]     # (geo's order)
            sh, sw, ph, pw, dh, dw = e[9], e[10], e[11], e[12], e[13], e[14]
            relu, use_mask, wide, slide = e[16] != 0, e[17] != 0, e[18], e[19] != 0
            gate = e[17] == 1                   # 2: rows copied, not gated (aligned)
            y0, yimg, yrow, ypix = e[20], e[21], e[22], e[23]
            stream = e[24]                                  # 0 or _tiles.STREAM
            p0 = blk * rpc
            if p0 >= P:
                continue
            p1 = min(P, p0 + rpc)
            qa, qb = _interior(S, W, Q, sw, pw, dw)
            tables = (np.int64(aoff[0].ctypes.data), np.int64(aoff[1].ctypes.data),
                      np.int64(own[0].ctypes.data), np.int64(own[1].ctypes.data))
            cols = (S, W, sw, pw, dw)
            pwt = np.int64(wt.ctypes.data)
            rel, wid = np.int64(relu) | stream, np.int64(wide)
            base = px + 4 * n * H * W * C                              # input row h at base + 4hWC
            if use_mask:                       # the input rows these output rows read, gated
                h0 = _input_band(x, mask, gate, n, p0, p1, (sh, ph, dh, R), gbuf)
                base = pbuf - 4 * h0 * W * C
            # Rows whose every tap row lies inside (all but a few at the top and bottom) take
            # their border columns column by column down the rows: the pixels (p, q) of one
            # column share its tap table, so they are one run of tiles like an interior run (at
            # 7x7, 6 of a 28-pixel row's columns are border: one pixel per tile call otherwise).
            # One call site of the tiles (one inlined copy): each step below is a run of pixels
            # (m, its tap table, its addresses, its output and output stride).
            p = p0
            while p < p1:
                g1 = p
                while g1 < p1 and _full_rows(g1, dh, ph, sh, H, R):
                    g1 += 1
                down = g1 > p                   # rows [p, g1): interiors here, borders below
                last = g1 if down else p + 1
                zero = np.int64(0)          # (a literal 0 reaching _run_at compiles it again)
                pp, q, end, pc, lo, hi, r0, r1 = p - 1, zero, zero, py, Q, Q, zero, zero
                while True:
                    if pp < last and q >= end:                          # the next row
                        pp += 1
                        if pp < last:
                            r0, r1 = _valid_range(pp, dh, ph, sh, H, R)
                            r1 = max(r0, r1)
                            for u in range(Q):                          # first taps' addresses
                                rows[u] = base + 4 * ((pp * sh - ph) * W + u * sw - pw) * C
                            pc = py + 4 * (y0 + n * yimg + pp * yrow)
                            lo, hi = (qa, qb) if r1 > r0 else (Q, Q)
                            q, end = (lo, hi) if down else (0, Q)
                        else:
                            q = zero                                    # then the border columns
                        continue
                    if pp < last:          # the interior run, else one border pixel at a time
                        m, k, tx, tw = _run_at(q, lo, hi, r0, r1, cols, aoff, own, tables)
                        prow, pcq, ldc = pr + 8 * q, pc + 4 * q * ypix, ypix
                        if slide and q == lo:   # its first pixels by the sliding tiles
                            done = _slide.slid(m)
                            args = (m, C, r1 - r0, S, sw, rows[q] + 4 * r0 * dh * W * C,
                                    dh * W * C, pwt + 4 * r0 * S * C, pcq, ldc, pb, rel & 1)
                            if S == 5:
                                _slide.slide5_step(args)
                            else:
                                _slide.slide_step(args)
                            m, prow, pcq = m - done, prow + 8 * done, pcq + 4 * done * ldc
                            q += done
                        q += m
                    else:                  # a border column of rows [p, g1)
                        if not down or q >= Q:
                            break
                        if q == qa and qb > qa:
                            q = qb
                            continue
                        for u in range(g1 - p):
                            rows[u] = base + 4 * (((p + u) * sh - ph) * W + q * sw - pw) * C
                        c0, c1 = _valid_range(p, dh, ph, sh, H, R)      # (0, R): full rows
                        _, k, tx, tw = _run_at(q, Q, Q, c0, c1, cols, aoff, own, tables)
                        m, prow, ldc = g1 - p, pr, yrow
                        pcq = py + 4 * (y0 + n * yimg + p * yrow + q * ypix)
                        q += 1
                    _tiles.taps_step((m, C, k, prow, tx, tw, pwt, pcq, ldc, pb, rel, wid))
                p = last
        if streamed:
            _tiles.store_fence()


@njit(cache=True)
def _add_pixels(g, db):
    # db (C,) float64 += each pixel of the row g (Q*C,) in turn (views from 0: vectorised)
    C = db.shape[0]
    for q in range(g.shape[0] // C):
        gq = g[q * C:(q + 1) * C]
        for c in range(C):
            db[c] += gq[c]


@task_kernel(fastmath=FMA)
def dw_tiled(t0, t1, x, gy, y, use_mask, geo, plan, aoff, dw_parts, db_parts, gout):
    # Multiplier 1, float32, C % 8 == 0: dW by the register tiles (cpu_depthwise_tiles.
    # depthwise_dw_taps), addressed in x itself as forward_tiled's forward. x: (N, H, W, C);
    # gy, y: (N, P, Q*C);  aoff: cpu_depthwise._tap_offsets;  dw_parts: (groups, R*S, C);
    # db_parts: (groups, C) float64;  plan: (rpc, nchunks, groups, wide, need_dw), the tasks
    # those of cpu_depthwise's _dw_nhwc. Per output row: the gated g row (db from it, pixel by
    # pixel as _dw_nhwc), then its interior pixels over every tap inside in one run of tiles,
    # and each border pixel over its own taps. gout (N, P, Q*C), or no rows: g is gated into
    # it, not into a row buffer of the task's own, for dX to read afterwards (dx_phases
    # unmasked: g gated once for both passes). With copy, each chunk's input rows are copied
    # into a buffer of the task's own on a 64-byte boundary first (x off one, as the
    # forward's input mode 2: cpu_depthwise._copied), the same sums.
    N, C, H, W, K, R, S, P, Q, sh, sw, ph, pw, dh, dw, nhwc = geo
    rpc, nchunks, groups, wide, need_dw, copy = plan
    keep = gout.shape[0] > 0
    wid = np.int64(wide)
    nb = (P + rpc - 1) // rpc
    L = W * C
    g = _aligned_floats(Q * C)                                        # one gated row
    xbuf = _aligned_floats(((rpc - 1) * sh + (R - 1) * dh + 1) * L if copy and need_dw else 0)
    pxbuf = np.int64(xbuf.ctypes.data)
    own = np.empty((2, R * S), np.int64)                              # a border pixel's taps
    qa, qb = _interior(S, W, Q, sw, pw, dw)
    px = np.int64(x.ctypes.data)
    tables = (np.int64(aoff[0].ctypes.data), np.int64(aoff[1].ctypes.data),
              np.int64(own[0].ctypes.data), np.int64(own[1].ctypes.data))
    cols = (S, W, sw, pw, dw)
    for t in range(t0, t1):
        dwp, dbp = dw_parts[t], db_parts[t]
        dwp[:] = 0
        dbp[:] = 0
        pacc = np.int64(dwp.ctypes.data)
        for chunk in range(t * nchunks // groups, (t + 1) * nchunks // groups):
            n, p0 = chunk // nb, (chunk % nb) * rpc
            p1 = min(P, p0 + rpc)
            base = px + 4 * n * H * L                           # input row h at base + 4hL
            if copy and need_dw:                    # the rows these output rows read
                h0 = _input_band(x, x, False, n, p0, p1, (sh, ph, dh, R), xbuf)
                base = pxbuf - 4 * h0 * L
            for p in range(p0, p1):
                gp = gout[n, p] if keep else g
                gate_row(gy[n, p], y[n, p], use_mask, gp)       # g = gy * (y > 0)
                _add_pixels(gp, dbp)                # db += g pixel by pixel, as _dw_nhwc
                pg = np.int64(gp.ctypes.data)
                if not need_dw:
                    continue
                r0, r1 = _valid_range(p, dh, ph, sh, H, R)          # tap rows inside
                if r1 <= r0:
                    continue
                first = base + 4 * (((p * sh - ph) * W - pw) * C)
                q = np.int64(0)        # (not a literal: see forward_tiled)
                while q < Q:           # the interior run, else one border pixel at a time
                    m, k, tx, tw = _run_at(q, qa, qb, r0, r1, cols, aoff, own, tables)
                    if k > 0:                                       # (one call site)
                        _tiles.dw_taps_step((m, C, k, first + 4 * q * sw * C, sw * C, tx,
                                             pg + 4 * q * C, C, pacc, tw, wid))
                    q += m


# --------------------------------------------------------------------------- host

def slides(wide, C, S, sw, dw):
    """Whether :func:`forward_tiled`'s interior runs start with the sliding tiles
    (``cpu_depthwise_slide``): AVX-512 tiles, C a multiple of 16, S taps in SLIDE_TAPS one
    column apart, stride 1 or 2 along the row."""
    return bool(wide) and C % 16 == 0 and S in _slide.SLIDE_TAPS and sw in (1, 2) and dw == 1


def dx_phases(gy, y, use_mask, w, geom, chunk, dx):
    """NHWC dX by :func:`forward_tiled`, one launch per phase (a, b) of dx: the pixels (h, w)
    = (a + sh*i, b + sw*j). A phase's taps are the rows r with (a + ph - r*dh) % sh == 0 (and
    the columns likewise), each reading g row i + e_r, e_r = (a + ph - r*dh) // sh: in
    reverse order a correlation with stride 1, top padding -min(e_r) and dilation the step
    of e_r, over g = gy * (y > 0) with the taps flipped, its output written at stride (sh,
    sw) into dx. Stride 1: one phase, every tap, padding (R-1)*dh - ph. Tasks: ``chunk``
    output values of a phase's rows, each gating the rows of gy it reads (forming g once,
    before the phases, measured slower: 7x7 stride 2, 1 thread, 3.7-3.8 ms against 2.5-3.2).
    """
    N, C, H, W, P, Q = geom.N, geom.C, geom.H, geom.W, geom.P, geom.Q
    sh, sw, dh, dw = geom.sh, geom.sw, geom.dh, geom.dw
    taps = w.reshape(C, geom.R, geom.S)
    zeros = _aligned(np.zeros(C, np.float32))
    wide = bool(_gemm_taps.WIDE)

    def phase(start, stride, pad, dil, size, ntaps):
        # (taps in reverse order, first offset e, its step), the phase's length
        ts = [t for t in range(ntaps) if (start + pad - t * dil) % stride == 0][::-1]
        offs = [(start + pad - t * dil) // stride for t in ts]
        step = offs[1] - offs[0] if len(offs) > 1 else 1
        return ts, (offs[0] if offs else 0), step, max(0, -(-(size - start) // stride))

    phases = []                         # (wf, aoff, the table row) of each phase
    for a in range(sh):
        rs, e0, de, Hph = phase(a, sh, geom.ph, dh, H, geom.R)
        for b in range(sw):
            ss, f0, df, Wph = phase(b, sw, geom.pw, dw, W, geom.S)
            if Hph == 0 or Wph == 0:
                continue
            wf = taps[:, rs][:, :, ss].reshape(C, len(rs) * len(ss)).T
            aoff = np.array([[(u * de * Q + v * df) * C for u in range(len(rs))
                              for v in range(len(ss))],
                             [t * C for t in range(len(rs) * len(ss))]], np.int64).reshape(2, -1)
            row = (N, C, P, Q, C, len(rs), len(ss), Hph, Wph, 1, 1, -e0, -f0, de, df, 1,
                   0, bool(use_mask), wide, slides(wide, C, len(ss), 1, df),
                   (a * W + b) * C, H * W * C, sh * W * C, sw * C,
                   streams(dx, gy.nbytes, C))
            phases.append((wf, aoff, row))
    if phases:
        Hmax = max(row[7] for _, _, row in phases)
        Wmax = max(row[8] for _, _, row in phases)
        run_tiled(gy, y, phases, zeros, max(1, min(Hmax, chunk // max(1, Wmax * C))), dx,
                  N * H * W * C * (1 + geom.R * geom.S // (sh * sw)))


def _last_level_cache():
    """The last-level cache's bytes (the L3 this process's first CPU shares; 32 MiB if the
    system does not say)."""
    try:
        size = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        size = 0
    return size if size > 0 else 32 << 20


LLC_BYTES = _last_level_cache()


def streams(y, in_bytes, C):
    """``_tiles.STREAM`` where :func:`forward_tiled` stores y by non-temporal stores, else 0:
    y over half the last-level cache (it would mostly leave the cache before anyone read it,
    and a plain store reads each line from memory before it writes it), y on a 64-byte
    boundary and C a multiple of 16 (each stored vector aligned, as non-temporal stores
    must be), float32, on x86. ``in_bytes``, the pass's input, is not counted: outputs
    smaller than that with large inputs measured the same either way. One thread, machine E
    (Zen 5, 32 MiB L3): the tile kernel alone writing 25.7 MB 1.62 -> 0.86 ms at one tap,
    2.18 -> 1.28 at nine; 3x3 (32, 64, 56, 56) forward 2.26 -> 1.61 ms, its dX 4.09 -> 3.43,
    3x3/2 backward (dx 25.7 MB) 4.24-4.55 -> 3.55-3.63. Not streamed: the 3x3/2 forward (y 6.4
    MB, x 25.7) and 7x7 (32, 96, 28, 28) (y 9.6 MB), the same either way (with the caches
    flushed first, 3x3/2 1.35-1.63 / 1.39-1.46 ms, 7x7 on 2 threads 1.40-1.45 / 1.36-1.38)."""
    big = y.nbytes > LLC_BYTES // 2
    ok = (_tiles.X86 and y.dtype == np.float32 and y.ctypes.data % 64 == 0 and C % 16 == 0)
    return _tiles.STREAM if big and ok else 0


def run_tiled(x, mask, problems, b, rpc, y, work):
    """Launch :func:`forward_tiled` over ``problems`` (wt (taps, C), aoff (2, taps), its
    table row: geo, flags, yl), blocks of ``rpc`` output rows."""
    C = x.shape[-1]
    if len(problems) == 1 and problems[0][0].shape[0] > 0:     # (the forward: no copies)
        wt, aoff, row = problems[0]
        wts, aoffs = _aligned(wt)[None], aoff[None]
    else:
        T = max(1, max(wt.shape[0] for wt, _, _ in problems))
        wts = _aligned(np.zeros((len(problems), T, C), np.float32))
        aoffs = np.zeros((len(problems), 2, T), np.int64)
        for f, (wt, aoff, _) in enumerate(problems):
            wts[f, :wt.shape[0]], aoffs[f, :, :aoff.shape[1]] = wt, aoff
    table = np.array([row for _, _, row in problems], np.int64)
    nb = blocks(max(row[7] for _, _, row in problems), rpc)
    # the sliding tiles' steps only where a problem slides (7 or 5 tap columns), each for its
    # tap count: a 3x3's first call compiles none
    _tiles.ready(_tiles.TAPS_TILES)
    _slide.ready(*_slide.steps_for({int(row[6]) for row in table if row[19]}))
    launch(forward_tiled, x.shape[0] * nb, x, mask, wts, b, table, (nb, rpc), aoffs, y,
           work=work)
