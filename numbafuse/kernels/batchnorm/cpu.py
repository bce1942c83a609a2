r"""Numba CPU kernels of batch norm -> add -> ReLU: statistics, fused apply, two-pass backward.

Notation: N batch, C channels, H, W spatial, M = N*H*W values per channel, ``size`` = N*C*H*W.
Activations arrive C-contiguous in their layout and the kernels see them as

* NCHW: ``x3`` (N, C, HW) for the statistics (one task per (n, c) row, HW values of one
  channel) and ``x2`` (N*C, HW) rows for the other passes (the ``_*_nchw`` kernels);
* NHWC: ``x2`` (M/m, m*C) rows, m NHWC rows walked as one with the per-channel values tiled m
  times (``NHWC_ROW``), cut into fixed blocks of rows, each block keeping its own partials;
* NCHW maps of at most ``FLAT_MAX_HW`` pixels: ``x2`` (N, C*HW) through the NHWC kernels, the
  per-channel values each repeated HW times (``cpu_rows``: the views).

Every task of the elementwise passes starts on a mask byte (``_byte_rows_per_task``). Every
reduction writes per-task partials ``(P, 2, C)`` (float64; NHWC: ``(P, 2, m*C)``, the m tiles
folded in a fixed order; flat NCHW: ``(P, 2, C)``, each channel's HW sums added in order at
the end of a task) that ``cpu_channels.finalize_*`` sums over P in a fixed order: results do
not depend on the number of threads. The partition is a function of the shape only.

Relu state codes (``state_kind``) for the backward: ``STATE_NONE`` (plain batch norm),
``STATE_Y`` (the forward output y: open where y > 0), ``STATE_MASK`` (packed bits, bit
``j % 8`` of byte ``j // 8`` for flat index j, set where y > 0), ``STATE_AFFINE`` (no add:
open where the forward's ``normalize_affine`` of x itself was > 0, evaluated by the same
compiled function on the same per-channel values, so the same bits decide; nothing of y is
kept or rebuilt). The forward packs the mask bytes while its y is in cache, the backward
expands its bytes to one 0/0xFF byte per element with a 256-entry table (so the gate loops
vectorise).

Per-element arithmetic is in x's dtype (see the note above the fused forward); sums are
float64. The backward's pass 1 writes gz = g while it reduces, and pass 2 reads g back from gz:
y (or the mask) is read once. Large outputs come from :data:`output_cache`
(:class:`numbafuse.kernels.cpu.buffers.OutputCache`), which reuses released buffers instead
of faulting in fresh pages.

Host-level entry points (what ``numbafuse.ops.batchnorm`` calls; ``kernels.interfaces.
BatchNormKernels``): :func:`stats`, :func:`stats_update`, :func:`inference_stats`,
:func:`update_running`, :func:`apply`, :func:`apply_running`, :func:`backward`.
"""
import math

import numpy as np
from numba import njit

from ..cpu.buffers import output_cache
from ..cpu.launch import launch, task_kernel
from . import math as bm
from .math import BITS, STATE_AFFINE, STATE_MASK, STATE_NONE, STATE_Y, mask_nbytes  # noqa: F401
from .. import scalar
from ..cpu import recorded as _rec
from .cpu_running import inference_stats, scale_shift, update_running  # noqa: F401
from .cpu_channels import (channel_totals, channel_values, finalize_backward, finalize_stats,
                           fold_sums)
from . import cpu_rows
from .cpu_rows import dims as _dims

CHUNK = 1 << 14          # elements per parallel task of the elementwise passes; multiple of 8
REDUCE_CHUNK = 1 << 15   # elements per parallel task of the NHWC reductions (rows = this // C)
# the passes of a smaller x run on the calling thread: a helper's hand-off costs more than
# it saves. BatchNorm-Add-ReLU through the NumPy API, own pool, machine E, us on 1 / 2
# threads, forward and backward (NCHW; NHWC): 65,536 elements (16, 256, 4, 4) 63 / 88 and
# 98 / 158 (44 / 74, 74 / 119); 131,072 60 / 90, 92 / 155 (65 / 88, 123 / 175); 262,144 77 /
# 114, 131 / 175 (98 / 135, 213 / 230); 524,288 126 / 142, 243 / 256 (171 / 172, 398 / 337);
# 1,048,576 193 / 207, 454 / 394 (289 / 253, 787 / 568). 2^18 since 2026-12-02 (machine A,
# PyTorch's OpenMP team; the NCHW backward's mask gate vectorised, which had run slower on
# two threads than on one): the fused BatchNorm-Add-ReLU module's forward and backward, us
# serial / two threads, (16, 64, 16, 16) 746 / 637, (16, 128, 8, 8) 495 / 534, (16, 256, 4, 4)
# 501 / 542; in the 64x64 training step (one process alternating 2^19 and 2^18, medians) the
# batch-norm kernels 23.4 -> 21.2 ms a ResNet-50 step, 6.26 -> 5.68 a ResNet-18 step.
PARALLEL_MIN = 1 << 18
# NHWC rows shorter than this walk m = 2^k rows at a time as one row of m*C elements with the
# per-channel values tiled m times: LLVM's vector loops (8 float32 x 4 unrolled) skip rows of
# fewer than 32 elements. Measured on (2048, 24): backward reduce 113 -> 36 us, apply 64 -> 19.
NHWC_ROW = 256
# NCHW maps of at most FLAT_MAX_HW pixels and FLAT_MAX_ROW values a sample: the NHWC kernels
# on (N, C*HW) rows (cpu_rows), reductions in tasks of ~FLAT_CHUNK values (a task's sums, a
# row of float64, are zeroed and folded once a task). docs/benchmarks.md, "Small maps as ..."
FLAT_MAX_HW = 16
FLAT_MAX_ROW = 1 << 14
FLAT_CHUNK = 1 << 17
# Reductions may be reassociated (vectorised): the compiled order is fixed, so still
# deterministic; NaN/Inf semantics are kept (no 'nnan'/'ninf').
REDUCE_FASTMATH = {"reassoc", "contract"}


_relu = scalar.cpu_scalar(scalar.relu)
_normalize_affine = scalar.cpu_scalar(bm.normalize_affine)
_mask_bit = scalar.cpu_scalar(bm.mask_bit)
_gate = scalar.cpu_scalar(bm.gate)
_input_grad = scalar.cpu_scalar(bm.input_grad)


# --------------------------------------------------------------------------- statistics

@task_kernel(fastmath=REDUCE_FASTMATH)
def _stats_nchw(t0, t1, x3, shift, partials):
    # x3: (N, C, HW); shift: (C,) float64; partials: (N, 2, C) float64 <- shifted sums s1, s2
    N, C, HW = x3.shape
    for r in range(t0, t1):
        n = r // C
        c = r - n * C
        s = shift[c]
        s1 = 0.0
        s2 = 0.0
        for b in range(HW):
            d = x3[n, c, b] - s
            s1 += d
            s2 += d * d
        partials[n, 0, c] = s1
        partials[n, 1, c] = s2


@task_kernel(fastmath=REDUCE_FASTMATH)
def _stats_nhwc(t0, t1, x2, shift, rows_per_task, rep, partials):
    # x2: (M/m, L = m*C) rows (NHWC_ROW), element (r, k) of channel k % C; shift: (L,)
    # float64, tiled; partials: (P, 2, L) float64 (folded by the caller); task p owns rows
    # [p*rows_per_task, (p+1)*rows_per_task). Flat NCHW (cpu_rows): rows (N, C*HW), element
    # k of channel k // rep, shift repeated, partials (P, 2, C): each channel's rep sums
    # added here in order
    R, L = x2.shape
    for p in range(t0, t1):
        # task-local sums vectorise (accumulating into partials rows is 1.4x slower)
        s1, s2 = np.zeros(L), np.zeros(L)                         # (L,) each
        for row in range(p * rows_per_task, min(R, (p + 1) * rows_per_task)):
            for k in range(L):                    # (x2[row, k]: rows by index, _ROWS_BY_INDEX)
                d = x2[row, k] - shift[k]
                s1[k] += d
                s2[k] += d * d
        fold_sums(s1, s2, rep, partials[p, 0], partials[p, 1])


# --------------------------------------------------------------------------- fused forward
# Elementwise kernels index 2-d rows with 0-based inner ranges (``x2[r, k]``, ``for k in
# range(L)``): Numba then knows the index is non-negative and LLVM vectorises the loop; flat
# ``x[r*L + k]`` indexing keeps a wraparound check per access and does not.
#
# _ROWS_BY_INDEX: no view of a row (``x2[r]``: its count is an atomic all threads share): the
# NHWC backward's apply at (16, 16, 16, 256) on 1 / 2 threads 0.55 / 0.93 ms, by index 0.38 / 0.25.
#
# Per-element arithmetic runs in the dtype of x (float32 vectors are twice as wide as float64
# ones) with every per-channel coefficient rounded to that dtype, except the mean, which is
# split into ``mean_hi + mean_lo`` (both in x's dtype): ``(x - mean_hi) - mean_lo`` is x - mean
# to a rounding of the *result* (x - mean_hi is exact when x is within a factor 2 of the mean,
# Sterbenz), so large channel means lose no digits. Sums accumulate in float64.

@njit(inline="always")
def _zero_of(a):
    # a zero of a's dtype (a float64 literal would promote float32 arithmetic); a typed
    # constant, no allocation: ``np.zeros(1, a.dtype)[0]`` here allocated once per row of the
    # gates, ~55 ns a row, 3x the time of the whole backward of a 24-channel NHWC row
    return a.dtype.type(0)


@njit(inline="always")
def _relu_t(v, zero):
    # max(v, 0) in v's dtype, NaN kept (as scalar.relu)
    return zero if v <= zero else v


@njit(inline="always")
def _pack_mask(yt, mt):
    # mt[q] = bits (yt[8q + t] > 0) for t < 8; yt: (n,) a task's flat y, mt: (ceil(n/8),) its
    # bytes. One byte per iteration with constant shifts: ~0.1 ns per element.
    n = yt.shape[0]
    full = n // BITS
    for q in range(full):
        byte = 0
        for t in range(BITS):
            byte |= (1 << t) if yt[q * BITS + t] > 0 else 0
        mt[q] = byte
    if full * BITS < n:  # a last, partial byte
        byte = 0
        for t in range(n - full * BITS):
            byte |= (1 << t) if yt[full * BITS + t] > 0 else 0
        mt[full] = byte


@task_kernel
def _apply_nchw(t0, t1, x2, z2, has_z, vals, relu, y2, mask, want_mask, C, rows_per_task):
    # x2, z2, y2: (N*C, HW), row r is channel r % C; vals (4, C) in x's dtype: mean_hi, mean_lo,
    # scale (= gamma*invstd), beta (_values); mask: (ceil(size/8),) uint8, written when
    # want_mask. y is written once; a task's rows start on a mask byte, so its mask bytes are
    # its own.
    mean_hi, mean_lo, scale, beta = vals[0], vals[1], vals[2], vals[3]
    R, L = x2.shape
    yflat = y2.reshape(R * L)                                     # (size,)
    zero = _zero_of(x2)
    for p in range(t0, t1):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        for r in range(r0, r1):
            c = r % C
            mh, ml, s, b = mean_hi[c], mean_lo[c], scale[c], beta[c]
            for k in range(L):                                    # (_ROWS_BY_INDEX)
                v = _normalize_affine(x2[r, k] - mh, ml, s, b)
                if has_z:
                    v += z2[r, k]
                if relu:
                    v = _relu_t(v, zero)
                y2[r, k] = v
        if want_mask:
            _pack_mask(yflat[r0 * L:r1 * L], mask[r0 * L // BITS:-(-r1 * L // BITS)])


@task_kernel
def _apply_nhwc(t0, t1, x2, z2, has_z, vals, relu, y2, mask, want_mask, rows_per_task):
    # as _apply_nchw for x2, z2, y2: (M/m, m*C) rows, element (r, k) of channel k % C; the
    # per-channel values are tiled to (4, m*C), so element k's values are at index k. Rows
    # by index (_ROWS_BY_INDEX)
    mean_hi, mean_lo, scale, beta = vals[0], vals[1], vals[2], vals[3]
    R, L = x2.shape
    yflat = y2.reshape(R * L)                                     # (size,)
    zero = _zero_of(x2)
    for p in range(t0, t1):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        for r in range(r0, r1):
            for k in range(L):
                v = _normalize_affine(x2[r, k] - mean_hi[k], mean_lo[k], scale[k], beta[k])
                if has_z:
                    v += z2[r, k]
                if relu:
                    v = _relu_t(v, zero)
                y2[r, k] = v
        if want_mask:
            _pack_mask(yflat[r0 * L:r1 * L], mask[r0 * L // BITS:-(-r1 * L // BITS)])


# --------------------------------------------------------------------------- fused backward

def _expand_table():
    # (256, 8) uint8: entry [b, t] is 0xFF where bit t of b is set
    table = np.zeros((256, BITS), np.uint8)
    for b in range(256):
        for t in range(BITS):
            if (b >> t) & 1:
                table[b, t] = 0xFF
    return table


_EXPAND = _expand_table()


@njit(inline="always")
def _expand_mask(mask, start, n):
    # the mask bits of flat indices [start, start + n) as one uint8 (0 or 0xFF) per element,
    # (>= n,); start % 8 == 0. A table lookup per byte, so the gate loops below vectorise
    # (decoding bits inside them with shifts does not: ~4x slower). Bytes, not a uint64 view
    # of them: an array .view() costs a cold start ~0.2-0.8 s of compiling.
    nb = -(-n // BITS)
    e8 = np.empty(nb * BITS, np.uint8)                            # (8 * nb,)
    mb = mask[start // BITS:start // BITS + nb]                   # (nb,) this range's bytes
    for q in range(nb):
        row = _EXPAND[mb[q]]                                      # (8,)
        for t in range(BITS):
            e8[q * BITS + t] = row[t]
    return e8


@njit(inline="always")
def _task_mask(state_kind, mask, r0, r1, L):
    # the expanded mask of rows [r0, r1) of length L, or a stand-in
    if state_kind == STATE_MASK:
        return _expand_mask(mask, r0 * L, (r1 - r0) * L)
    return np.empty(0, np.uint8)


@task_kernel(fastmath=REDUCE_FASTMATH)
def _bwd_reduce_nchw(t0, t1, gy2, x2, vals, state_kind, y2, mask, dims, gz2, want_gz, partials):
    # gy2, x2, y2, gz2: (N*C, HW), row r is channel r % C; mask: packed (ceil(size/8),) uint8;
    # vals: (4, C) as _apply_nchw's (scale and beta read with STATE_AFFINE only); dims: (C,
    # rows per task); partials: (N, 2, C) float64 <- sum g, sum g*(x - mean) of each (n, c)
    # row; gz2 <- g when want_gz (pass 2 then reads g from it instead of gating again).
    # Rows by index, no view per row, and (n, c) counted along, no division per row: at HW =
    # 4 (a 2x2 map) the views and divisions had cost 63 ns a row, 4-6x the row's work; the
    # same operations in the same order, so the same bits (_bwd_apply_nchw likewise).
    mean_hi, mean_lo, scale, beta = vals[0], vals[1], vals[2], vals[3]
    C, rows_per_task = dims
    R, L = x2.shape
    for p in range(t0, t1):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        e = _task_mask(state_kind, mask, r0, r1, L)               # (>= (r1-r0)*L,) or (0,)
        g = np.empty(L, x2.dtype)                                 # (HW,) one row's g
        zero = _zero_of(g)
        n = r0 // C
        c = r0 - n * C
        eo = 0                                    # row r's offset in e: (r - r0) * L
        for r in range(r0, r1):
            mh, ml = mean_hi[c], mean_lo[c]
            # g = gy where the ReLU was open: the state branch once per row (the loops written
            # out here: through an inlined helper the kernel took 4.7x as long, 420 us
            # against 90 at (8192, 4), measured)
            if state_kind == STATE_AFFINE:
                s, b = scale[c], beta[c]
                for k in range(L):
                    g[k] = gy2[r, k] if _normalize_affine(x2[r, k] - mh, ml, s, b) > zero else zero
            elif state_kind == STATE_Y:
                for k in range(L):
                    g[k] = gy2[r, k] if y2[r, k] > zero else zero
            elif state_kind == STATE_MASK:
                # (the row's view of e: indexed e[(r - r0) * L + k], or e[eo + k], this loop
                # was not vectorised: 3-4x the STATE_Y loop's time, and slower on 2 threads
                # than on 1; (16, 64, 16, 16), machine A, us on 1 / 2 threads: 270 / 680,
                # with the view 85 / 79, STATE_Y 73 / 43. A row here has more than
                # FLAT_MAX_HW values, so the view costs little.)
                er = e[eo:eo + L]
                for k in range(L):
                    g[k] = gy2[r, k] if er[k] != 0 else zero
            else:
                for k in range(L):
                    g[k] = gy2[r, k]
            eo += L
            if want_gz:
                for k in range(L):
                    gz2[r, k] = g[k]
            sg = 0.0
            sgx = 0.0
            for k in range(L):
                gk = g[k]
                sg += gk
                sgx += gk * ((x2[r, k] - mh) - ml)
            partials[n, 0, c] = sg
            partials[n, 1, c] = sgx
            c += 1
            if c == C:
                c = 0
                n += 1


@task_kernel(fastmath=REDUCE_FASTMATH)
def _bwd_reduce_nhwc(t0, t1, gy2, x2, vals, state_kind, y2, mask, dims, gz2, want_gz, partials):
    # gy2, x2, y2, gz2: (M/m, m*C) rows, per-channel values tiled (as _apply_nhwc); partials:
    # (P, 2, m*C) float64 <- per-task sums (folded by the caller); task p owns rows from a
    # mask byte on; dims: (rows per task, rep). Flat NCHW: as _stats_nhwc's. _ROWS_BY_INDEX.
    mean_hi, mean_lo, scale, beta = vals[0], vals[1], vals[2], vals[3]
    rows_per_task, rep = dims
    R, L = x2.shape
    for p in range(t0, t1):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        e = _task_mask(state_kind, mask, r0, r1, L)
        g = np.empty(L, x2.dtype)                                 # (L,) one row's g
        zero = _zero_of(g)
        sg, sgx = np.zeros(L), np.zeros(L)                        # (L,) each, task-local
        eo = 0                                    # row r's offset in e: (r - r0) * L
        for r in range(r0, r1):
            if state_kind == STATE_AFFINE:
                for k in range(L):
                    g[k] = gy2[r, k] if _normalize_affine(x2[r, k] - mean_hi[k], mean_lo[k],
                                                          scale[k], beta[k]) > zero else zero
            elif state_kind == STATE_Y:
                for k in range(L):
                    g[k] = gy2[r, k] if y2[r, k] > zero else zero
            elif state_kind == STATE_MASK:
                er = e[eo:eo + L]
                for k in range(L):
                    g[k] = gy2[r, k] if er[k] != 0 else zero
            else:
                for k in range(L):
                    g[k] = gy2[r, k]
            eo += L
            if want_gz:
                for k in range(L):
                    gz2[r, k] = g[k]
            for k in range(L):
                gk = g[k]
                sg[k] += gk
                sgx[k] += gk * ((x2[r, k] - mean_hi[k]) - mean_lo[k])
        fold_sums(sg, sgx, rep, partials[p, 0], partials[p, 1])


@task_kernel
def _bwd_apply_nchw(t0, t1, gy2, x2, vals, coefs, flags, y2, mask, dims, gx2, gz2):
    # gy2, x2, y2, gx2, gz2: (N*C, HW) (gx2/gz2 written when wanted); vals (4, C) as
    # _apply_nchw's; coefs (3, C), per-channel coefficients in x's dtype: dx = cg*g + cx*(x -
    # mean) + c0, dz = g; flags: (state_kind, want_gx, want_gz); dims: (C, rows per task).
    # With STATE_NONE, gy2 may be the g that pass 1 wrote to gz. Rows by index, as
    # _bwd_reduce_nchw's.
    mean_hi, mean_lo, scale, beta = vals[0], vals[1], vals[2], vals[3]
    cg, cx, c0 = coefs[0], coefs[1], coefs[2]
    state_kind, want_gx, want_gz = flags
    C, rows_per_task = dims
    R, L = x2.shape
    for p in range(t0, t1):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        e = _task_mask(state_kind, mask, r0, r1, L)
        g = np.empty(L, x2.dtype)                                 # (HW,) one row's g
        zero = _zero_of(g)
        c = r0 % C
        eo = 0                                    # row r's offset in e (_bwd_reduce_nchw's)
        for r in range(r0, r1):
            mh, ml, a, b, d = mean_hi[c], mean_lo[c], cg[c], cx[c], c0[c]
            if state_kind == STATE_NONE and not want_gz:          # g is gy
                if want_gx:
                    for k in range(L):
                        gx2[r, k] = _input_grad(gy2[r, k], x2[r, k] - mh, ml, a, b, d)
            else:                                                 # as _bwd_reduce_nchw
                if state_kind == STATE_AFFINE:
                    s, bt = scale[c], beta[c]
                    for k in range(L):
                        g[k] = gy2[r, k] if _normalize_affine(x2[r, k] - mh, ml, s, bt) > zero \
                            else zero
                elif state_kind == STATE_Y:
                    for k in range(L):
                        g[k] = gy2[r, k] if y2[r, k] > zero else zero
                elif state_kind == STATE_MASK:                    # (as _bwd_reduce_nchw)
                    er = e[eo:eo + L]
                    for k in range(L):
                        g[k] = gy2[r, k] if er[k] != 0 else zero
                else:
                    for k in range(L):
                        g[k] = gy2[r, k]
                if want_gz:
                    for k in range(L):
                        gz2[r, k] = g[k]
                if want_gx:
                    for k in range(L):
                        gx2[r, k] = _input_grad(g[k], x2[r, k] - mh, ml, a, b, d)
            eo += L
            c += 1
            if c == C:
                c = 0


@task_kernel
def _bwd_apply_nhwc(t0, t1, gy2, x2, vals, coefs, flags, y2, mask, rows_per_task, gx2, gz2):
    # as _bwd_apply_nchw for (M/m, m*C) rows, per-channel values tiled (as _apply_nhwc); gates
    # written out (an inlined helper counted its arrays' references a row: 2.8x the time)
    mean_hi, mean_lo, scale, beta = vals[0], vals[1], vals[2], vals[3]
    cg, cx, c0 = coefs[0], coefs[1], coefs[2]
    state_kind, want_gx, want_gz = flags
    R, L = x2.shape
    for p in range(t0, t1):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        e = _task_mask(state_kind, mask, r0, r1, L)
        g = np.empty(L, x2.dtype)                                 # (L,)
        zero = _zero_of(g)
        eo = 0
        for r in range(r0, r1):
            if state_kind == STATE_NONE and not want_gz:          # g is gy
                if want_gx:
                    for k in range(L):
                        gx2[r, k] = _input_grad(gy2[r, k], x2[r, k] - mean_hi[k], mean_lo[k],
                                                cg[k], cx[k], c0[k])
            else:
                if state_kind == STATE_AFFINE:
                    for k in range(L):
                        g[k] = gy2[r, k] if _normalize_affine(x2[r, k] - mean_hi[k], mean_lo[k],
                                                              scale[k], beta[k]) > zero else zero
                elif state_kind == STATE_Y:
                    for k in range(L):
                        g[k] = gy2[r, k] if y2[r, k] > zero else zero
                elif state_kind == STATE_MASK:
                    er = e[eo:eo + L]
                    for k in range(L):
                        g[k] = gy2[r, k] if er[k] != 0 else zero
                else:
                    for k in range(L):
                        g[k] = gy2[r, k]
                if want_gz:
                    for k in range(L):
                        gz2[r, k] = g[k]
                if want_gx:
                    for k in range(L):
                        gx2[r, k] = _input_grad(g[k], x2[r, k] - mean_hi[k], mean_lo[k], cg[k],
                                                cx[k], c0[k])
            eo += L


# --------------------------------------------------------------------------- host entry points

def _shift(x, layout, C):
    """One value of each channel (its first), as the float64 shift of the accumulation."""
    first = x[0, :, 0, 0] if layout == "NCHW" else x[0, 0, 0, :]   # (C,)
    return _rec.copy(np.empty(C), first)


def stats(x, layout, eps):
    """(mean, var, invstd) float64 (C,) of a C-contiguous 4-d ``x``; var is biased."""
    N, C, HW = _dims(x.shape, layout)
    shift = _shift(x, layout, C)
    v = _view(x.shape, layout)
    if v.family == "nchw":
        partials = np.empty((N, 2, C))
        launch(_stats_nchw, N * C, x.reshape(N, C, HW), shift, partials, work=x.size,
               parallel_min=PARALLEL_MIN)
    else:
        R, L = v.shape
        rows = max(1, _reduce_chunk(v) // L) if L else 1          # ~that many elements a task
        partials = np.empty((-(-R // rows), 2, L // v.rep))
        launch(_stats_nhwc, partials.shape[0], v.rows(x), v.spread(shift[None])[0], rows,
               v.rep, partials, work=x.size, parallel_min=PARALLEL_MIN)
    out = np.empty((3, C))                                        # mean, var, invstd
    _rec.step(finalize_stats, partials, v.m, shift, float(N * HW), float(eps), *out)
    return out[0], out[1], out[2]


def stats_update(x, layout, eps, running_mean, running_var, momentum):
    """:func:`stats`, and the running statistics (None: none) updated in place with PyTorch's
    rule (:func:`update_running`, with the batch's count of values per channel)."""
    mean, var, invstd = stats(x, layout, eps)
    if running_mean is not None:
        N, C, HW = _dims(x.shape, layout)
        update_running(running_mean, running_var, mean, var, N * HW, momentum)
    return mean, var, invstd


def apply_running(x, running_mean, running_var, eps, gamma, beta, z, relu, layout, want_mask):
    """Inference: :func:`inference_stats` then :func:`apply`; (y, mask or None, mean,
    invstd)."""
    mean, invstd = inference_stats(running_mean, running_var, eps)
    y, mask = apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask)
    return y, mask, mean, invstd


_NO_MASK = np.zeros(1, np.uint8)   # stands for "no mask" (kernels keep one signature)
AFFINE_GATE = True                 # backward takes STATE_AFFINE (ops.batchnorm.AffineGate)


def _view(shape, layout):
    """The shape's cpu_rows.RowView at this module's knobs."""
    return cpu_rows.view(shape, layout, NHWC_ROW, FLAT_MAX_HW, FLAT_MAX_ROW)


def _reduce_chunk(v):   # elements per task of a reduction over the view v
    return FLAT_CHUNK if v.family == "flat" else REDUCE_CHUNK


def _byte_rows_per_task(L, chunk):
    """Rows of length L per task: ~chunk elements, a multiple of 8/gcd(L, 8) rows so that
    every task starts on a mask byte."""
    group = BITS // math.gcd(L, BITS)
    return -(-max(1, chunk // L) // group) * group


def _values(mean, invstd, gamma, beta, v, dtype):
    """(4, L) in ``dtype``: rows mean_hi, mean_lo, scale, beta (see channel_values), laid
    along the rows of the view ``v``."""
    out = np.empty((4, v.m * v.rep * mean.shape[0]), dtype)
    _rec.step(channel_values, mean, invstd, gamma, beta, 1, out)
    return v.fill(out)


def apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
    """(y, mask): y = [relu](gamma*xhat + beta [+ z]); mask (packed y > 0) or None."""
    y = output_cache.empty(x.shape, x.dtype)
    mask = output_cache.empty(mask_nbytes(x.size), np.uint8) if want_mask else _NO_MASK
    v = _view(x.shape, layout)
    x2, y2 = v.rows(x), v.rows(y)                                 # (R, L)
    z2 = x2 if z is None else v.rows(z)                           # x stands in for "no z"
    vals = _values(mean, invstd, gamma, beta, v, x.dtype)         # (4, L) | (4, C)
    rows = _byte_rows_per_task(x2.shape[1], CHUNK)
    tasks = -(-x2.shape[0] // rows)
    if v.family == "nchw":
        launch(_apply_nchw, tasks, x2, z2, z is not None, vals, bool(relu), y2, mask,
               bool(want_mask), mean.shape[0], rows, work=x.size, parallel_min=PARALLEL_MIN)
    else:
        launch(_apply_nhwc, tasks, x2, z2, z is not None, vals, bool(relu), y2, mask,
               bool(want_mask), rows, work=x.size, parallel_min=PARALLEL_MIN)
    return y, (mask if want_mask else None)


def backward(gy, x, mean, invstd, gamma, state_kind, state, layout, training, need,
             sync=None, sums=None):
    """(gx, ggamma, gbeta, gz), each None unless asked for in ``need`` (4 booleans).

    ``state`` is y (``STATE_Y``), the packed mask (``STATE_MASK``), beta (``STATE_AFFINE``:
    the ReLU's input was ``gamma*xhat + beta`` of this x, no add) or None (``STATE_NONE``).
    Pass 1 reduces the two sums and, when gz is wanted, writes gz = g; pass 2 then reads g
    back from gz (no second gating, no second read of y or the mask) and writes gx.

    ``sync`` (synchronized batch norm): a callable taking this call's per-channel sums, a
    float64 (2, C) array (sum g, sum g*(x - mean)), and returning the global sums and the
    global count; gx then uses those, while ggamma and gbeta stay this call's own. With
    ``sync`` the reduction always runs (every rank must take part), also on an empty ``x``.

    ``sums``: pass 1's sums made elsewhere, a (P, 2, C) float64 array of partials added in
    order (the conv epilogue of ``kernels/conv/cpu_epilogue``); pass 1 is then skipped.
    """
    need_gx, need_ggamma, need_gbeta, need_gz = need
    N, C, HW = _dims(x.shape, layout)
    count = float(N * HW)
    dtype = x.dtype
    v = _view(x.shape, layout)
    gy2, x2 = v.rows(gy), v.rows(x)                               # (R, L)
    L = x2.shape[1]
    y2 = v.rows(state) if state_kind == STATE_Y else x2           # x stands in for "no y"
    mask = state if state_kind == STATE_MASK else _NO_MASK
    state_beta = state if state_kind == STATE_AFFINE else gamma   # (unread unless AFFINE)
    # the forward's per-channel values (see apply); scale and beta read with STATE_AFFINE only
    vals = _values(mean, invstd, gamma, state_beta, v, dtype)     # (4, L) | (4, C)
    rows = _byte_rows_per_task(L, _reduce_chunk(v))               # rows of L values
    tasks = -(-x2.shape[0] // rows)                               # row blocks of pass 1 and 2
    unused = np.empty((1, L), dtype)                              # stands in for a skipped output
    gz = output_cache.empty(x.shape, dtype) if need_gz else None
    gz2 = v.rows(gz) if need_gz else unused
    grads = np.empty((2, C), dtype)                               # ggamma, gbeta
    coefs = np.empty((3, v.m * v.rep * C), dtype)                 # cg, cx, c0, spread
    g_written = False
    pm = 1                                                        # tiles in the partials
    if sums is not None:                                          # pass 1 made elsewhere
        partials = sums
    elif sync is not None and x.size == 0:                        # an empty rank: zero sums
        partials = np.zeros((1, 2, C))
    elif need_ggamma or need_gbeta or (need_gx and training) or sync is not None:
        # pass 1: gbeta = sum g, ggamma = sum g*xhat (and the dx coefficients); gz = g
        if v.family == "nchw":
            partials = np.empty((N, 2, C))
            launch(_bwd_reduce_nchw, tasks, gy2, x2, vals, state_kind, y2, mask, (C, rows),
                   gz2, bool(need_gz), partials, work=x.size, parallel_min=PARALLEL_MIN)
        else:
            partials = np.empty((tasks, 2, L // v.rep))
            launch(_bwd_reduce_nhwc, tasks, gy2, x2, vals, state_kind, y2, mask, (rows, v.rep),
                   gz2, bool(need_gz), partials, work=x.size, parallel_min=PARALLEL_MIN)
            pm = v.m
        g_written = need_gz
    else:  # inference, gx/gz only: the coefficients need no reduction
        partials = np.zeros((1, 2, C))
    # (an empty rank's count is 0: its own coefficients are replaced below, and ggamma,
    # gbeta do not depend on the count)
    _rec.step(finalize_backward, partials, pm, gamma, invstd, count or 1.0, bool(training),
              grads[0], grads[1], coefs, 1)
    if sync is not None:            # the dx coefficients from the global sums and count
        local = np.empty((2, C))
        _rec.step(channel_totals, partials, pm, local)
        total, count = sync(local)                                # (2, C) float64
        _rec.step(finalize_backward, total[None], 1, gamma, invstd, float(count),
                  bool(training), np.empty(C, dtype), np.empty(C, dtype), coefs, 1)
    v.fill(coefs)                                                 # (3, L) | (3, C)
    gx = None
    if (need_gx or (need_gz and not g_written)) and x.size:
        # pass 2: dx = cg*g + cx*(x - mean) + c0 (and dz = g if pass 1 did not write it)
        gx = output_cache.empty(x.shape, dtype) if need_gx else None
        gx2 = v.rows(gx) if need_gx else unused
        if g_written:   # g is in gz: read it back as an ungated gy
            g_in, kind, y_in, mask_in, want_gz = gz2, STATE_NONE, x2, _NO_MASK, False
        else:
            g_in, kind, y_in, mask_in, want_gz = gy2, state_kind, y2, mask, bool(need_gz)
        if v.family == "nchw":
            launch(_bwd_apply_nchw, tasks, g_in, x2, vals, coefs,
                   (kind, bool(need_gx), want_gz), y_in, mask_in, (C, rows), gx2, gz2,
                   work=x.size, parallel_min=PARALLEL_MIN)
        else:
            launch(_bwd_apply_nhwc, tasks, g_in, x2, vals, coefs,
                   (kind, bool(need_gx), want_gz), y_in, mask_in, rows, gx2, gz2, work=x.size,
               parallel_min=PARALLEL_MIN)
    if gx is None and need_gx:                                    # an empty rank
        gx = np.empty(x.shape, dtype)
    return (gx, grads[0] if need_ggamma else None, grads[1] if need_gbeta else None, gz)
