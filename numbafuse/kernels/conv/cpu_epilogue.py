r"""Batch-norm sums in the Winograd forward's epilogue (Conv-BatchNorm-ReLU on the CPU).

A conv followed by batch norm reads its output h twice more after the conv wrote it: the
forward for the batch statistics, the recompute backward for the two sums of batch norm's
backward. Both are reductions over h per output channel, so the conv's chunks can make them
while their output rows are still in cache: one pass and one launch fewer each.

Per chunk (``cpu_winograd.forward_epilogue_tasks``), over the output pixels it wrote, in its own
order:

* ``EPI_STATS``: ``s1 = sum(h - shift)``, ``s2 = sum((h - shift)^2)`` in float64 with
  ``shift`` the chunk's first pixel (batch norm's shifted sums, ``kernels/batchnorm/math``),
  and the chunk's pixel count. :func:`merge_stats` turns every chunk's (count, mean, M2) into
  the batch's with Chan's parallel formula, chunk by chunk in chunk order.
* ``EPI_BN_SUMS``: ``sum g`` and ``sum g*(h - mean)`` with ``g = dy`` where the forward's ReLU
  was open (``normalize_affine(h - mean_hi, mean_lo, scale, beta) > 0``, the very function
  and per-channel values of the batch-norm kernels, so the same bits decide) or ``g = dy``
  without ReLU, and g itself: pass 1 of ``kernels/batchnorm/cpu.backward``, whose pass 2
  then takes the per-chunk sums (``sums=``) and g as an ungated gradient.

Chunks are a function of the shapes only and their partials are added in chunk order, so the
results do not depend on the thread count. A block of output pixels is walked as rows of
``m * K`` values (``m`` a power of two dividing the block's pixels, ``m * K`` at least
``NHWC_ROW`` where possible) with the per-channel values tiled m times: rows of K = 24 values
are too short for LLVM's vector loops (as in the batch-norm kernels).
"""
from numba import njit, types

from ..batchnorm import math as bm
from ..batchnorm.cpu import NHWC_ROW
from ..batchnorm.cpu_running import invstd_of
from ..cpu.steps import Step, array
from ..scalar import cpu_scalar

EPI_NONE, EPI_STATS, EPI_BN_SUMS = 0, 1, 2

_normalize_affine = cpu_scalar(bm.normalize_affine)
_finalize_mean = cpu_scalar(bm.finalize_mean)
_finalize_var = cpu_scalar(bm.finalize_var)


def tiles(K):
    """m of the widest rows (m * K values, m a power of two, the first at least NHWC_ROW)."""
    m = 1
    while m * K < NHWC_ROW:
        m *= 2
    return m


@njit(inline="always")
def start_chunk(acc, counts, t):
    # a chunk's accumulators to zero (the shift is set by its first block)
    acc[:] = 0
    counts[t] = 0


def block(flat, dflat, gflat, K, first, epi, affine, ev, shift, acc, counts, t):
    # flat, dflat, gflat: (npix*K,) the values of npix output pixels (NHWC rows) of h, of dy
    # and of g, written here (EPI_BN_SUMS); ev: (4, mt*K) mean_hi, mean_lo, scale, beta in
    # h's dtype, tiled;
    # shift: (mt*K,) float64, tiled, set here from the chunk's first pixel (first, EPI_STATS);
    # acc: (2, mt*K) float64 += this block's sums, tile j of channel k at j*K + k
    npix = flat.shape[0] // K
    mt = acc.shape[1] // K
    if epi == EPI_STATS and first:
        for j in range(mt):
            for k in range(K):
                shift[j * K + k] = flat[k]
    m = 1
    while 2 * m <= mt and npix % (2 * m) == 0:
        m *= 2
    L = m * K
    a0, a1 = acc[0], acc[1]                                       # (mt*K,) each
    zero = flat.dtype.type(0)
    if epi == EPI_STATS:
        for r in range(npix // m):
            row = flat[r * L:(r + 1) * L]                         # (L,)
            for k in range(L):
                d = row[k] - shift[k]                             # float64
                a0[k] += d
                a1[k] += d * d
    else:
        mh, ml, sc, be = ev[0], ev[1], ev[2], ev[3]               # (mt*K,) each
        for r in range(npix // m):
            row, drow = flat[r * L:(r + 1) * L], dflat[r * L:(r + 1) * L]
            grow = gflat[r * L:(r + 1) * L]
            # three loops of few arrays each: LLVM vectorises a loop only while its runtime
            # alias checks stay few (one loop over all nine arrays ran scalar: +44 us a call)
            if affine:
                for k in range(L):
                    grow[k] = drow[k] if _normalize_affine(row[k] - mh[k], ml[k], sc[k],
                                                           be[k]) > zero else zero
            else:
                for k in range(L):
                    grow[k] = drow[k]
            for k in range(L):
                a0[k] += grow[k]
            for k in range(L):
                a1[k] += grow[k] * ((row[k] - mh[k]) - ml[k])
    counts[t] += npix


# block as a step called through a slot (kernels/cpu/steps.py): compiled once per dtype, not
# again inside cpu_winograd.forward_epilogue_tasks (issue 33: that kernel was the slowest
# compiled function of a cold Conv-BN forward, 2.5 s of self CPU)
_I, _B = types.int64, types.boolean
BLOCK = Step(block, lambda f: [
    (array(f, 1), array(f, 1), array(f, 1), _I, _B, _I, _I, array(f, 2),
     array(types.float64, 1), array(types.float64, 2), array(types.float64, 1), _I)])
block_step = BLOCK.call


@njit(inline="always")
def end_chunk(epi, shift, acc, parts, t):
    # parts[t] (3, K) float64 <- the chunk's two sums (the tiles folded in tile order) and
    # its shift (EPI_STATS)
    K = parts.shape[2]
    mt = acc.shape[1] // K
    for k in range(K):
        s0 = 0.0
        s1 = 0.0
        for j in range(mt):
            s0 += acc[0, j * K + k]
            s1 += acc[1, j * K + k]
        parts[t, 0, k] = s0
        parts[t, 1, k] = s1
        parts[t, 2, k] = shift[k] if epi == EPI_STATS else 0.0


@njit(cache=True)
def merge_stats(parts, counts, eps, mean, var, invstd):
    # parts: (chunks, 3, K) float64 shifted sums s1, s2 and the shift of every chunk; counts:
    # (chunks,) pixels; mean, var (biased), invstd: (K,) float64 <- the batch's, chunks merged
    # in order (Chan et al.): n = na + nb, d = mb - ma, mean = ma + d*nb/n,
    # M2 = M2a + M2b + d^2*na*nb/n
    K = mean.shape[0]
    for k in range(K):
        n = 0.0
        mu = 0.0
        m2 = 0.0
        for t in range(parts.shape[0]):
            nb = counts[t]
            if nb == 0:
                continue
            s1, s2 = parts[t, 0, k], parts[t, 1, k]
            mb = _finalize_mean(s1, parts[t, 2, k], nb)
            m2b = _finalize_var(s1, s2, nb) * nb
            total = n + nb
            d = mb - mu
            mu += d * (nb / total)
            m2 += m2b + d * d * (n * nb / total)
            n = total
        mean[k] = mu
        var[k] = max(m2 / n, 0.0)
        invstd[k] = invstd_of(var[k], eps)
