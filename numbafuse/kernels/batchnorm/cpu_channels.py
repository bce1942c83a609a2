"""Numba CPU functions of batch norm's per-channel host steps: the statistics and the
backward's sums finalized from the kernels' per-task partials (the NHWC tiles folded in a fixed
order), and the per-channel values the elementwise kernels read (re-exported by
``kernels/batchnorm/cpu.py``, whose module docstring gives the notation)."""
import numpy as np
from numba import njit

from . import math as bm
from ..scalar import cpu_scalar
from .cpu_running import invstd_of

_finalize_mean = cpu_scalar(bm.finalize_mean)
_finalize_var = cpu_scalar(bm.finalize_var)
_coef_g = cpu_scalar(bm.coef_g)
_coef_x = cpu_scalar(bm.coef_x)
_coef_0 = cpu_scalar(bm.coef_0)


@njit(inline="always")
def _channel_sums(partials, c, m, C):
    # (sum over p of partials[p, 0], the same of partials[p, 1]) for channel c: the m tiles of
    # each task's sums folded first, in tile order, then the tasks in order
    s0 = 0.0
    s1 = 0.0
    for p in range(partials.shape[0]):
        f0 = partials[p, 0, c]
        f1 = partials[p, 1, c]
        for j in range(1, m):
            f0 += partials[p, 0, j * C + c]
            f1 += partials[p, 1, j * C + c]
        s0 += f0
        s1 += f1
    return s0, s1


@njit(cache=True)
def channel_totals(partials, m, out):
    # out: (2, C) float64 <- the two sums of every channel over the tasks (_channel_sums):
    # a rank's own sums, which synchronized batch norm all-reduces
    C = out.shape[1]
    for c in range(C):
        out[0, c], out[1, c] = _channel_sums(partials, c, m, C)


@njit(cache=True)
def finalize_stats(partials, m, shift, count, eps, mean, var, invstd):
    # partials: (P, 2, m*C) shifted sums, the m tiles of each channel (NHWC_ROW) folded here;
    # shift, mean, var, invstd: (C,) float64
    C = shift.shape[0]
    for c in range(C):
        s1, s2 = _channel_sums(partials, c, m, C)
        mean[c] = _finalize_mean(s1, shift[c], count)
        var[c] = _finalize_var(s1, s2, count)
        invstd[c] = invstd_of(var[c], eps)


@njit(cache=True)
def finalize_backward(partials, pm, gamma, invstd, count, training, ggamma, gbeta, coefs, m):
    # partials: (P, 2, pm*C) sums of g and g*(x - mean), the pm tiles of each channel folded
    # here; gamma, invstd: (C,); ggamma = invstd * sum g*(x - mean), gbeta = sum g: (C,), their
    # dtype; coefs: (3, m*C) in x's dtype <- cg, cx, c0 of dx = cg*g + cx*(x - mean) + c0, each
    # rounded once from float64 and tiled m times
    C = invstd.shape[0]
    for c in range(C):
        sg, sgx = _channel_sums(partials, c, pm, C)
        gg = sgx * invstd[c]                                      # float64
        gbeta[c] = sg
        ggamma[c] = gg
        gam = np.float64(gamma[c])
        coefs[0, c] = _coef_g(gam, invstd[c])
        coefs[1, c] = _coef_x(gam, invstd[c], gg, count, training)
        coefs[2, c] = _coef_0(gam, invstd[c], sg, count, training)
    _tile_in_place(coefs, m, C)


@njit(inline="always")
def _tile_in_place(rows, m, C):
    # rows: (k, m*C): copy columns [0, C) to the other m - 1 tiles
    for j in range(1, m):
        for i in range(rows.shape[0]):
            for c in range(C):
                rows[i, j * C + c] = rows[i, c]


@njit(inline="always")
def fold_sums(s1, s2, rep, p0, p1):
    # p0, p1 (L/rep,) <- a task's two (L,) sums, each run of rep values added in order (rep
    # 1: copied). Element by element: an array assigned to a slice compiles numba's
    # shape-mismatch message, 2 s.
    for c in range(p0.shape[0]):
        a0 = 0.0
        a1 = 0.0
        for j in range(c * rep, (c + 1) * rep):
            a0 += s1[j]
            a1 += s2[j]
        p0[c] = a0
        p1[c] = a1


@njit(cache=True)
def spread_in_place(rows, m, rep, C):
    # rows: (k, m*rep*C), columns [0, C) the per-channel values: tiled m times (NHWC) or each
    # repeated rep times in place (flat NCHW: column c*rep + j <- c, from the last channel
    # down, so that no column is overwritten before it is read); one of m, rep is 1
    # (a slice filled per channel, not a loop of rep stores, which ran scalar at ResNet's 4x4
    # and 2x2 maps, rep 16 and 4: (4, 16384) values 44 -> 25 us, (4, 4096) 8.3 -> 4.2 alone;
    # in the training step, one process alternating, machine A: ResNet-50 5.39 -> 2.77 ms a
    # step, ResNet-18 0.74 -> 0.46)
    _tile_in_place(rows, m, C)
    if rep > 1:
        for i in range(rows.shape[0]):
            r = rows[i]
            for c in range(C - 1, -1, -1):
                v = r[c]
                r[c * rep:(c + 1) * rep] = v


@njit(cache=True)
def channel_values(mean, invstd, gamma, beta, m, out):
    # out: (4, m*C) in x's dtype <- the per-channel values of the elementwise kernels, each
    # tiled m times: mean_hi = mean rounded, mean_lo = (mean - mean_hi) rounded (so that
    # (x - mean_hi) - mean_lo is x - mean to a rounding of the result), scale = gamma*invstd
    # rounded once, beta rounded. The forward and the STATE_AFFINE backward both take them
    # from here, so the gate's arithmetic sees the forward's very values.
    C = mean.shape[0]
    for c in range(C):
        out[0, c] = mean[c]
        out[1, c] = mean[c] - out[0, c]
        out[2, c] = invstd[c] * gamma[c]
        out[3, c] = beta[c]
    _tile_in_place(out, m, C)
