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

@njit(inline="always")
def _pack_mask(y, mask, start, end):
    # bits of y[start:end] > 0 into mask[start//8 : ceil(end/8)]; start is a multiple of 8
    for q in range(start // BITS, (end + BITS - 1) // BITS):
        byte = 0
        for t in range(BITS):
            j = q * BITS + t
            if j < end and y[j] > 0:
                byte |= 1 << t
        mask[q] = byte


@njit(parallel=True, cache=True)
def _apply_nchw(x, z, has_z, mean, scale, beta, relu, y, mask, want_mask, C, HW):
    # x, z, y: (size,) flat NCHW; mean, scale (= gamma*invstd), beta: (C,) float64;
    # mask: (ceil(size/8),) uint8, written when want_mask. One pass: y written once.
    size = x.shape[0]
    for k in prange((size + CHUNK - 1) // CHUNK):
        start = k * CHUNK
        end = min(size, start + CHUNK)
        i = start
        while i < end:  # runs of one channel
            row = i // HW
            c = row % C
            stop = min(end, (row + 1) * HW)
            m, s, b = mean[c], scale[c], beta[c]
            for j in range(i, stop):
                v = _normalize_affine(x[j], m, s, b)
                if has_z:
                    v += z[j]
                if relu:
                    v = _relu(v)
                y[j] = v
            i = stop
        if want_mask:
            _pack_mask(y, mask, start, end)


@njit(parallel=True, cache=True)
def _apply_nhwc(x, z, has_z, mean, scale, beta, relu, y, mask, want_mask, C):
    # as _apply_nchw for flat NHWC: the channel of flat index j is j % C
    size = x.shape[0]
    for k in prange((size + CHUNK - 1) // CHUNK):
        start = k * CHUNK
        end = min(size, start + CHUNK)
        i = start
        while i < end:  # runs within one row of C channels
            row = i // C
            base = row * C
            stop = min(end, base + C)
            for c in range(i - base, stop - base):
                j = base + c
                v = _normalize_affine(x[j], mean[c], scale[c], beta[c])
                if has_z:
                    v += z[j]
                if relu:
                    v = _relu(v)
                y[j] = v
            i = stop
        if want_mask:
            _pack_mask(y, mask, start, end)


# --------------------------------------------------------------------------- fused backward

@njit(inline="always")
def _gated(gy, state_kind, ystate, mask, j):
    # g = gy * (relu was open at flat index j)
    if state_kind == STATE_Y:
        return _gate(gy[j], ystate[j] > 0)
    if state_kind == STATE_MASK:
        return _gate(gy[j], _mask_bit(mask[j >> 3], j) != 0)
    return gy[j] + 0.0


@njit(parallel=True, fastmath=REDUCE_FASTMATH, cache=True)
def _bwd_reduce_nchw(gy, x, mean, state_kind, ystate, mask, C, HW, partials):
    # gy, x, ystate: (size,) flat NCHW; mask: packed (ceil(size/8),) uint8; mean: (C,) f64
    # partials: (N, 2, C) float64 <- sum g, sum g*(x - mean) of each (n, c) row
    N = partials.shape[0]
    for r in prange(N * C):
        n = r // C
        c = r - n * C
        m = mean[c]
        sg = 0.0
        sgx = 0.0
        for j in range(r * HW, (r + 1) * HW):
            g = _gated(gy, state_kind, ystate, mask, j)
            sg += g
            sgx += g * (x[j] - m)
        partials[n, 0, c] = sg
        partials[n, 1, c] = sgx


@njit(parallel=True, fastmath=REDUCE_FASTMATH, cache=True)
def _bwd_reduce_nhwc(gy, x, mean, state_kind, ystate, mask, C, rows_per_task, partials):
    # flat NHWC as above; partials: (P, 2, C) float64, zeroed; task p owns a block of rows
    M = gy.shape[0] // C
    P = partials.shape[0]
    for p in prange(P):
        for row in range(p * rows_per_task, min(M, (p + 1) * rows_per_task)):
            base = row * C
            for c in range(C):
                g = _gated(gy, state_kind, ystate, mask, base + c)
                partials[p, 0, c] += g
                partials[p, 1, c] += g * (x[base + c] - mean[c])


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
def _bwd_apply_nchw(gy, x, mean, cg, cx, c0, state_kind, ystate, mask, C, HW, gx, want_gx,
                    gz, want_gz):
    # flat NCHW; gx, gz: (size,) outputs (written when wanted); per-channel f64 coefficients
    size = gy.shape[0]
    for r in prange(size // HW):
        c = r % C
        m, a, b, d = mean[c], cg[c], cx[c], c0[c]
        for j in range(r * HW, (r + 1) * HW):
            g = _gated(gy, state_kind, ystate, mask, j)
            if want_gz:
                gz[j] = g
            if want_gx:
                gx[j] = _input_grad(g, x[j], m, a, b, d)


@njit(parallel=True, cache=True)
def _bwd_apply_nhwc(gy, x, mean, cg, cx, c0, state_kind, ystate, mask, C, rows_per_task, gx,
                    want_gx, gz, want_gz):
    # flat NHWC as _bwd_apply_nchw; tasks are blocks of rows
    M = gy.shape[0] // C
    for p in prange((M + rows_per_task - 1) // rows_per_task):
        for row in range(p * rows_per_task, min(M, (p + 1) * rows_per_task)):
            base = row * C
            for c in range(C):
                j = base + c
                g = _gated(gy, state_kind, ystate, mask, j)
                if want_gz:
                    gz[j] = g
                if want_gx:
                    gx[j] = _input_grad(g, x[j], mean[c], cg[c], cx[c], c0[c])


# --------------------------------------------------------------------------- host entry points

def _dims(shape, layout):
    """(N, C, HW) of a 4-d activation shape."""
    if layout == "NCHW":
        N, C, H, W = shape
    else:
        N, H, W, C = shape
    return N, C, H * W


def _rows_per_task(C):
    return max(1, REDUCE_CHUNK // C)


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


def apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
    """(y, mask): y = [relu](gamma*xhat + beta [+ z]); mask (packed y > 0) or None."""
    N, C, HW = _dims(x.shape, layout)
    scale = invstd * gamma                          # (C,) float64
    beta64 = beta.astype(np.float64)                # (C,)
    y = np.empty_like(x)
    mask = np.empty(mask_nbytes(x.size), np.uint8) if want_mask else _NO_MASK
    flat = x.reshape(-1)                            # (size,)
    zf = flat if z is None else z.reshape(-1)       # (size,); x stands in when there is no z
    if layout == "NCHW":
        _apply_nchw(flat, zf, z is not None, mean, scale, beta64, bool(relu), y.reshape(-1),
                    mask, bool(want_mask), C, HW)
    else:
        _apply_nhwc(flat, zf, z is not None, mean, scale, beta64, bool(relu), y.reshape(-1),
                    mask, bool(want_mask), C)
    return y, (mask if want_mask else None)


def backward(gy, x, mean, invstd, gamma, state_kind, state, layout, training, need):
    """(gx, ggamma, gbeta, gz), each None unless asked for in ``need`` (4 booleans).

    ``state`` is y (``STATE_Y``), the packed mask (``STATE_MASK``) or None (``STATE_NONE``).
    """
    need_gx, need_ggamma, need_gbeta, need_gz = need
    N, C, HW = _dims(x.shape, layout)
    count = float(N * HW)
    g_flat, x_flat = gy.reshape(-1), x.reshape(-1)              # (size,)
    ystate = state.reshape(-1) if state_kind == STATE_Y else x_flat
    mask = state if state_kind == STATE_MASK else _NO_MASK
    rows = _rows_per_task(C)
    ggamma64, gbeta64 = np.zeros(C), np.zeros(C)
    cg, cx, c0 = np.empty(C), np.empty(C), np.empty(C)
    if need_ggamma or need_gbeta or (need_gx and training):
        # pass 1: gbeta = sum g, ggamma = sum g*xhat (and the dx coefficients)
        if layout == "NCHW":
            partials = np.empty((N, 2, C))
            _bwd_reduce_nchw(g_flat, x_flat, mean, state_kind, ystate, mask, C, HW, partials)
        else:
            partials = np.zeros((-(-N * HW // rows), 2, C))
            _bwd_reduce_nhwc(g_flat, x_flat, mean, state_kind, ystate, mask, C, rows, partials)
    else:
        partials = np.zeros((1, 2, C))
    _finalize_backward(partials, gamma, invstd, count, bool(training), ggamma64, gbeta64,
                       cg, cx, c0)
    gx = gz = None
    if need_gx or need_gz:
        # pass 2: dx = cg*g + cx*(x - mean) + c0 and dz = g, written once each
        gx = np.empty_like(x) if need_gx else np.empty(0, x.dtype)
        gz = np.empty_like(x) if need_gz else np.empty(0, x.dtype)
        if layout == "NCHW":
            _bwd_apply_nchw(g_flat, x_flat, mean, cg, cx, c0, state_kind, ystate, mask, C, HW,
                            gx.reshape(-1), bool(need_gx), gz.reshape(-1), bool(need_gz))
        else:
            _bwd_apply_nhwc(g_flat, x_flat, mean, cg, cx, c0, state_kind, ystate, mask, C,
                            rows, gx.reshape(-1), bool(need_gx), gz.reshape(-1),
                            bool(need_gz))
        gx = gx if need_gx else None
        gz = gz if need_gz else None
    dtype = x.dtype
    return (gx, ggamma64.astype(dtype) if need_ggamma else None,
            gbeta64.astype(dtype) if need_gbeta else None, gz)
