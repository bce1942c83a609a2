r"""Numba CPU kernels of batch norm -> add -> ReLU: statistics, fused apply, two-pass backward.

Notation: N batch, C channels, H, W spatial, M = N*H*W values per channel, ``size`` = N*C*H*W.
Activations arrive C-contiguous in their layout and the kernels see them as

* NCHW: ``x3`` (N, C, HW) for per-channel reductions (one ``prange`` task per (n, c) row,
  a contiguous run of HW values of one channel);
* NHWC: ``x2`` (M, C) for reductions (``prange`` over fixed blocks of rows, each block keeping
  its own per-channel partials);
* both: a flat (size,) view for the elementwise passes, cut into fixed chunks of ``CHUNK``
  elements (a multiple of 8, so each byte of a packed ReLU mask belongs to exactly one chunk).

Every reduction writes per-task partials ``(P, 2, C)`` (float64) that :func:`_finalize_*` sums
over P in a fixed order: results do not depend on the number of threads. The partition (rows,
row blocks of ``REDUCE_CHUNK`` elements) is a function of the shape only.

Relu state codes (``state_kind``) for the backward: ``STATE_NONE`` (plain batch norm),
``STATE_Y`` (the forward output y: open where y > 0), ``STATE_MASK`` (packed bits, bit
``j % 8`` of byte ``j // 8`` for flat index j, set where y > 0).

Host-level entry points (what ``numbafuse.ops.batchnorm`` calls): :func:`stats`,
:func:`inference_stats`, :func:`apply`, :func:`backward`, :func:`update_running`.
"""
import math

import numpy as np
from numba import njit, prange

from .. import batchnorm_math as bm
from .. import scalar
from ..scalar import cpu_scalar

CHUNK = 1 << 14          # elements per parallel task of the elementwise passes; multiple of 8
REDUCE_CHUNK = 1 << 15   # elements per parallel task of the NHWC reductions (rows = this // C)
BITS = 8                 # mask bits per byte
# Reductions may be reassociated (vectorised): the compiled order is fixed, so still
# deterministic; NaN/Inf semantics are kept (no 'nnan'/'ninf').
REDUCE_FASTMATH = {"reassoc", "contract"}

STATE_NONE, STATE_Y, STATE_MASK = 0, 1, 2

_relu = cpu_scalar(scalar.relu)
_finalize_mean = cpu_scalar(bm.finalize_mean)
_finalize_var = cpu_scalar(bm.finalize_var)
_invstd_of = cpu_scalar(bm.invstd_of)
_unbiased_var = cpu_scalar(bm.unbiased_var)
_running_update = cpu_scalar(bm.running_update)
_normalize_affine = cpu_scalar(bm.normalize_affine)
_mask_bit = cpu_scalar(bm.mask_bit)
_gate = cpu_scalar(bm.gate)
_coef_g = cpu_scalar(bm.coef_g)
_coef_x = cpu_scalar(bm.coef_x)
_coef_0 = cpu_scalar(bm.coef_0)
_input_grad = cpu_scalar(bm.input_grad)


# --------------------------------------------------------------------------- statistics

@njit(parallel=True, fastmath=REDUCE_FASTMATH, cache=True)
def _stats_nchw(x3, shift, partials):
    # x3: (N, C, HW); shift: (C,) float64; partials: (N, 2, C) float64 <- shifted sums s1, s2
    N, C, HW = x3.shape
    for r in prange(N * C):
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


@njit(parallel=True, fastmath=REDUCE_FASTMATH, cache=True)
def _stats_nhwc(x2, shift, rows_per_task, partials):
    # x2: (M, C); shift: (C,) float64; partials: (P, 2, C) float64, zeroed; task p owns rows
    # [p*rows_per_task, (p+1)*rows_per_task)
    M, C = x2.shape
    P = partials.shape[0]
    for p in prange(P):
        for row in range(p * rows_per_task, min(M, (p + 1) * rows_per_task)):
            for c in range(C):
                d = x2[row, c] - shift[c]
                partials[p, 0, c] += d
                partials[p, 1, c] += d * d


@njit(cache=True)
def _finalize_stats(partials, shift, count, eps, mean, var, invstd):
    # partials: (P, 2, C) shifted sums; shift, mean, var, invstd: (C,) float64
    P, _, C = partials.shape
    for c in range(C):
        s1 = 0.0
        s2 = 0.0
        for p in range(P):
            s1 += partials[p, 0, c]
            s2 += partials[p, 1, c]
        mean[c] = _finalize_mean(s1, shift[c], count)
        var[c] = _finalize_var(s1, s2, count)
        invstd[c] = _invstd_of(var[c], eps)


@njit(cache=True)
def _inference_stats(running_mean, running_var, eps, mean, invstd):
    # running_*: (C,) any float dtype; mean, invstd: (C,) float64
    for c in range(running_mean.shape[0]):
        mean[c] = running_mean[c]
        invstd[c] = _invstd_of(np.float64(running_var[c]), eps)


@njit(cache=True)
def _update_running(running_mean, running_var, mean, var, count, momentum):
    # running_*: (C,) updated in place; mean, var: (C,) float64 batch statistics (var biased)
    for c in range(running_mean.shape[0]):
        running_mean[c] = _running_update(np.float64(running_mean[c]), mean[c], momentum)
        running_var[c] = _running_update(np.float64(running_var[c]),
                                         _unbiased_var(var[c], count), momentum)


# --------------------------------------------------------------------------- fused forward
# Elementwise kernels walk 2-d row views with 0-based inner ranges (``xr = x2[r]``,
# ``for k in range(L)``): Numba then knows the index is non-negative and LLVM vectorises the
# loop; flat ``x[r*L + k]`` indexing keeps a wraparound check per access and does not.

@njit(inline="always")
def _pack_mask(yflat, mask, start, end):
    # bits of yflat[start:end] > 0 into mask[start//8 : ceil(end/8)]; start % 8 == 0
    n = end - start
    full = n // BITS
    bytes8 = yflat[start:start + full * BITS].reshape(full, BITS)   # (full, 8)
    out = mask[start // BITS:start // BITS + full]                 # (full,)
    for q in range(full):
        row = bytes8[q]
        byte = 0
        for t in range(BITS):
            byte |= (1 << t) if row[t] > 0 else 0
        out[q] = byte
    if full * BITS < n:  # a last, partial byte
        byte = 0
        for t in range(n - full * BITS):
            byte |= (1 << t) if yflat[start + full * BITS + t] > 0 else 0
        mask[start // BITS + full] = byte


@njit(parallel=True, cache=True)
def _apply_nchw(x2, z2, has_z, mean, scale, beta, relu, y2, mask, want_mask, C,
                rows_per_task):
    # x2, z2, y2: (N*C, HW), row r is channel r % C; mean, scale (= gamma*invstd), beta: (C,)
    # float64; mask: (ceil(size/8),) uint8, written when want_mask. y is written once; a task's
    # rows start on a mask byte, so its mask bytes are its own.
    R, L = x2.shape
    yflat = y2.reshape(R * L)                                     # (size,)
    for p in prange((R + rows_per_task - 1) // rows_per_task):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        for r in range(r0, r1):
            c = r % C
            m, s, b = mean[c], scale[c], beta[c]
            xr, zr, yr = x2[r], z2[r], y2[r]                      # (HW,) each
            for k in range(L):
                v = _normalize_affine(xr[k], m, s, b)
                if has_z:
                    v += zr[k]
                if relu:
                    v = _relu(v)
                yr[k] = v
        if want_mask:
            _pack_mask(yflat, mask, r0 * L, r1 * L)


@njit(parallel=True, cache=True)
def _apply_nhwc(x2, z2, has_z, mean, scale, beta, relu, y2, mask, want_mask, rows_per_task):
    # as _apply_nchw for x2, z2, y2: (M, C), element (r, k) is channel k
    R, L = x2.shape
    yflat = y2.reshape(R * L)                                     # (size,)
    for p in prange((R + rows_per_task - 1) // rows_per_task):
        r0 = p * rows_per_task
        r1 = min(R, r0 + rows_per_task)
        for r in range(r0, r1):
            xr, zr, yr = x2[r], z2[r], y2[r]                      # (C,) each
            for k in range(L):
                v = _normalize_affine(xr[k], mean[k], scale[k], beta[k])
                if has_z:
                    v += zr[k]
                if relu:
                    v = _relu(v)
                yr[k] = v
        if want_mask:
            _pack_mask(yflat, mask, r0 * L, r1 * L)


# --------------------------------------------------------------------------- fused backward

@njit(inline="always")
def _gate_row(gyr, state_kind, yr, mask, base, g):
    # g[k] = gy[k] * (relu open at flat index base + k): the state branch is taken once per
    # row, so each of the three loops below vectorises
    L = g.shape[0]
    if state_kind == STATE_Y:
        for k in range(L):
            g[k] = _gate(gyr[k], yr[k] > 0)
    elif state_kind == STATE_MASK:
        done = 0
        if base % BITS == 0:  # whole bytes: constant shifts, vectorises
            mrow = mask[base // BITS:base // BITS + L // BITS]      # (L // 8,) this row's bytes
            for q in range(L // BITS):
                byte = mrow[q]
                for t in range(BITS):
                    g[q * BITS + t] = _gate(gyr[q * BITS + t], _mask_bit(byte, t) != 0)
            done = L // BITS * BITS
        for k in range(done, L):  # a row not starting on a byte, or the last partial byte
            j = base + k
            g[k] = _gate(gyr[k], _mask_bit(mask[j >> 3], j) != 0)
    else:
        for k in range(L):
            g[k] = gyr[k]


@njit(parallel=True, fastmath=REDUCE_FASTMATH, cache=True)
def _bwd_reduce_nchw(gy2, x2, mean, state_kind, y2, mask, C, rows_per_task, partials):
    # gy2, x2, y2: (N*C, HW), row r is channel r % C; mask: packed (ceil(size/8),) uint8;
    # partials: (N, 2, C) float64 <- sum g, sum g*(x - mean) of each (n, c) row
    R, L = x2.shape
    for p in prange((R + rows_per_task - 1) // rows_per_task):
        g = np.empty(L)                                           # (HW,) this task's g row
        for r in range(p * rows_per_task, min(R, (p + 1) * rows_per_task)):
            n = r // C
            c = r - n * C
            m = mean[c]
            xr = x2[r]                                            # (HW,)
            _gate_row(gy2[r], state_kind, y2[r], mask, r * L, g)
            sg = 0.0
            sgx = 0.0
            for k in range(L):
                sg += g[k]
                sgx += g[k] * (xr[k] - m)
            partials[n, 0, c] = sg
            partials[n, 1, c] = sgx


@njit(parallel=True, fastmath=REDUCE_FASTMATH, cache=True)
def _bwd_reduce_nhwc(gy2, x2, mean, state_kind, y2, mask, rows_per_task, partials):
    # gy2, x2, y2: (M, C); partials: (P, 2, C) float64, zeroed; task p owns a block of rows
    R, L = x2.shape
    for p in prange(partials.shape[0]):
        g = np.empty(L)                                           # (C,) this task's g row
        sg, sgx = partials[p, 0], partials[p, 1]                  # (C,) each
        for r in range(p * rows_per_task, min(R, (p + 1) * rows_per_task)):
            xr = x2[r]                                            # (C,)
            _gate_row(gy2[r], state_kind, y2[r], mask, r * L, g)
            for k in range(L):
                sg[k] += g[k]
                sgx[k] += g[k] * (xr[k] - mean[k])


@njit(cache=True)
def _finalize_backward(partials, gamma, invstd, count, training, ggamma, gbeta, cg, cx, c0):
    # partials: (P, 2, C) sums of g and g*(x - mean); all others (C,) float64:
    # ggamma = invstd * sum g*(x - mean), gbeta = sum g, and dx = cg*g + cx*(x - mean) + c0
    P, _, C = partials.shape
    for c in range(C):
        sg = 0.0
        sgx = 0.0
        for p in range(P):
            sg += partials[p, 0, c]
            sgx += partials[p, 1, c]
        gbeta[c] = sg
        ggamma[c] = sgx * invstd[c]
        gam = np.float64(gamma[c])
        cg[c] = _coef_g(gam, invstd[c])
        cx[c] = _coef_x(gam, invstd[c], ggamma[c], count, training)
        c0[c] = _coef_0(gam, invstd[c], gbeta[c], count, training)


@njit(parallel=True, cache=True)
def _bwd_apply_nchw(gy2, x2, mean, cg, cx, c0, state_kind, y2, mask, C, rows_per_task, gx2,
                    want_gx, gz2, want_gz):
    # gy2, x2, y2, gx2, gz2: (N*C, HW) (gx2/gz2 written when wanted); per-channel float64
    # coefficients: dx = cg*g + cx*(x - mean) + c0, dz = g
    R, L = x2.shape
    for p in prange((R + rows_per_task - 1) // rows_per_task):
        g = np.empty(L)                                           # (HW,) this task's g row
        for r in range(p * rows_per_task, min(R, (p + 1) * rows_per_task)):
            c = r % C
            m, a, b, d = mean[c], cg[c], cx[c], c0[c]
            xr = x2[r]                                            # (HW,)
            gxr = gx2[r] if want_gx else gx2[0]                   # (HW,)
            gzr = gz2[r] if want_gz else gz2[0]                   # (HW,)
            _gate_row(gy2[r], state_kind, y2[r], mask, r * L, g)
            for k in range(L):
                if want_gz:
                    gzr[k] = g[k]
                if want_gx:
                    gxr[k] = _input_grad(g[k], xr[k], m, a, b, d)


@njit(parallel=True, cache=True)
def _bwd_apply_nhwc(gy2, x2, mean, cg, cx, c0, state_kind, y2, mask, rows_per_task, gx2,
                    want_gx, gz2, want_gz):
    # as _bwd_apply_nchw for (M, C) rows, element (r, k) is channel k
    R, L = x2.shape
    for p in prange((R + rows_per_task - 1) // rows_per_task):
        g = np.empty(L)                                           # (C,) this task's g row
        for r in range(p * rows_per_task, min(R, (p + 1) * rows_per_task)):
            xr = x2[r]                                            # (C,)
            gxr = gx2[r] if want_gx else gx2[0]                   # (C,)
            gzr = gz2[r] if want_gz else gz2[0]                   # (C,)
            _gate_row(gy2[r], state_kind, y2[r], mask, r * L, g)
            for k in range(L):
                if want_gz:
                    gzr[k] = g[k]
                if want_gx:
                    gxr[k] = _input_grad(g[k], xr[k], mean[k], cg[k], cx[k], c0[k])


# --------------------------------------------------------------------------- host entry points

def _dims(shape, layout):
    """(N, C, HW) of a 4-d activation shape."""
    if layout == "NCHW":
        N, C, H, W = shape
    else:
        N, H, W, C = shape
    return N, C, H * W


def _rows_per_task(L):
    """Rows of length L per task of the reductions and the backward: ~REDUCE_CHUNK elements."""
    return max(1, REDUCE_CHUNK // L)


def _shift(x, layout, C):
    """One value of each channel (its first), as the float64 shift of the accumulation."""
    first = x[0, :, 0, 0] if layout == "NCHW" else x[0, 0, 0, :]   # (C,)
    return np.ascontiguousarray(first, dtype=np.float64)


def stats(x, layout, eps):
    """(mean, var, invstd) float64 (C,) of a C-contiguous 4-d ``x``; var is biased."""
    N, C, HW = _dims(x.shape, layout)
    shift = _shift(x, layout, C)
    if layout == "NCHW":
        partials = np.empty((N, 2, C))
        _stats_nchw(x.reshape(N, C, HW), shift, partials)                     # (N, C, HW)
    else:
        rows = _rows_per_task(C)
        partials = np.zeros((-(-N * HW // rows), 2, C))
        _stats_nhwc(x.reshape(N * HW, C), shift, rows, partials)              # (M, C)
    mean, var, invstd = np.empty(C), np.empty(C), np.empty(C)
    _finalize_stats(partials, shift, float(N * HW), float(eps), mean, var, invstd)
    return mean, var, invstd


def inference_stats(running_mean, running_var, eps):
    """(mean, invstd) float64 (C,) from the running statistics."""
    C = running_mean.shape[0]
    mean, invstd = np.empty(C), np.empty(C)
    _inference_stats(np.ascontiguousarray(running_mean), np.ascontiguousarray(running_var),
                     float(eps), mean, invstd)
    return mean, invstd


def update_running(running_mean, running_var, mean, var, count, momentum):
    """In place: r_mean = (1-m) r_mean + m mean, r_var = (1-m) r_var + m var*M/(M-1)."""
    rm = np.ascontiguousarray(running_mean)
    rv = np.ascontiguousarray(running_var)
    _update_running(rm, rv, mean, var, float(count), float(momentum))
    if rm is not running_mean:   # a strided view: write the values back through it
        running_mean[...] = rm
    if rv is not running_var:
        running_var[...] = rv


_NO_MASK = np.zeros(1, np.uint8)   # stands for "no mask" (kernels keep one signature)


def mask_nbytes(size):
    """Bytes of the packed ReLU mask of ``size`` elements."""
    return -(-size // BITS)


def _rows(x, layout):
    """The (R, L) row view of the elementwise kernels: NCHW (N*C, HW), NHWC (N*H*W, C)."""
    N, C, HW = _dims(x.shape, layout)
    return x.reshape(N * C, HW) if layout == "NCHW" else x.reshape(N * HW, C)


def _apply_rows_per_task(L):
    """Rows per forward task: ~CHUNK elements, a multiple of 8/gcd(L, 8) rows so that every
    task starts on a mask byte."""
    group = BITS // math.gcd(L, BITS)
    return -(-max(1, CHUNK // L) // group) * group


def apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
    """(y, mask): y = [relu](gamma*xhat + beta [+ z]); mask (packed y > 0) or None."""
    y = np.empty_like(x)
    mask = np.empty(mask_nbytes(x.size), np.uint8) if want_mask else _NO_MASK
    x2, y2 = _rows(x, layout), _rows(y, layout)                   # (R, L)
    z2 = x2 if z is None else _rows(z, layout)                    # x stands in for "no z"
    scale = invstd * gamma                                        # (C,) float64
    beta64 = beta.astype(np.float64)                              # (C,)
    rows = _apply_rows_per_task(x2.shape[1])
    if layout == "NCHW":
        _apply_nchw(x2, z2, z is not None, mean, scale, beta64, bool(relu), y2, mask,
                    bool(want_mask), mean.shape[0], rows)
    else:
        _apply_nhwc(x2, z2, z is not None, mean, scale, beta64, bool(relu), y2, mask,
                    bool(want_mask), rows)
    return y, (mask if want_mask else None)


def backward(gy, x, mean, invstd, gamma, state_kind, state, layout, training, need):
    """(gx, ggamma, gbeta, gz), each None unless asked for in ``need`` (4 booleans).

    ``state`` is y (``STATE_Y``), the packed mask (``STATE_MASK``) or None (``STATE_NONE``).
    """
    need_gx, need_ggamma, need_gbeta, need_gz = need
    N, C, HW = _dims(x.shape, layout)
    count = float(N * HW)
    gy2, x2 = _rows(gy, layout), _rows(x, layout)                 # (R, L)
    y2 = _rows(state, layout) if state_kind == STATE_Y else x2    # x stands in for "no y"
    mask = state if state_kind == STATE_MASK else _NO_MASK
    rows = _rows_per_task(x2.shape[1])                            # rows of L = HW or C
    ggamma64, gbeta64 = np.zeros(C), np.zeros(C)
    cg, cx, c0 = np.empty(C), np.empty(C), np.empty(C)
    if need_ggamma or need_gbeta or (need_gx and training):
        # pass 1: gbeta = sum g, ggamma = sum g*xhat (and the dx coefficients)
        if layout == "NCHW":
            partials = np.empty((N, 2, C))
            _bwd_reduce_nchw(gy2, x2, mean, state_kind, y2, mask, C, rows, partials)
        else:
            partials = np.zeros((-(-N * HW // rows), 2, C))
            _bwd_reduce_nhwc(gy2, x2, mean, state_kind, y2, mask, rows, partials)
    else:  # inference, gx/gz only: the coefficients need no reduction
        partials = np.zeros((1, 2, C))
    _finalize_backward(partials, gamma, invstd, count, bool(training), ggamma64, gbeta64,
                       cg, cx, c0)
    gx = gz = None
    if need_gx or need_gz:
        # pass 2: dx = cg*g + cx*(x - mean) + c0 and dz = g, written once each
        unused = np.empty((1, x2.shape[1]), x.dtype)              # stands in for a skipped output
        gx = np.empty_like(x) if need_gx else None
        gz = np.empty_like(x) if need_gz else None
        gx2 = _rows(gx, layout) if need_gx else unused
        gz2 = _rows(gz, layout) if need_gz else unused
        if layout == "NCHW":
            _bwd_apply_nchw(gy2, x2, mean, cg, cx, c0, state_kind, y2, mask, C, rows, gx2,
                            bool(need_gx), gz2, bool(need_gz))
        else:
            _bwd_apply_nhwc(gy2, x2, mean, cg, cx, c0, state_kind, y2, mask, rows, gx2,
                            bool(need_gx), gz2, bool(need_gz))
    dtype = x.dtype
    return (gx, ggamma64.astype(dtype) if need_ggamma else None,
            gbeta64.astype(dtype) if need_gbeta else None, gz)
