r"""numba.cuda kernels of batch norm -> add -> ReLU: statistics, fused apply, two-pass backward.

Notation: N batch, C channels, M = N*H*W values per channel, ``size`` = N*C*H*W. An
activation is viewed as (A, C, B): NCHW (N, C, H*W), NHWC (N*H*W, C, 1); flat element j has
channel ``(j // B) % C``.

Reductions (statistics, the backward's two sums) are ``reduce.channel_partials``: a channel
per block row (NCHW: lane-contiguous slices of its (n, c) planes; NHWC: 32 channels across a
warp's lanes), float64 partials per (channel, part) summed in a fixed order by one thread per
channel: deterministic, no atomics. The statistics are shifted sums (``batchnorm_math``).

Elementwise passes (``_apply``, ``_bwd_apply``) walk the flat array in *groups* of 32
lane-contiguous elements (a warp reads 128 bytes of float32 per load), U groups per warp in
flight; each lane tracks its elements' channel with counters (adds and compares, no
division) and keeps that channel's parameters in registers, reloading them only when the
channel changes. Element math runs in x's dtype: the float64 mean is split into
``hi + lo`` (both in x's dtype) so ``(x - hi) - lo`` keeps the digits a large mean would
cost.

Half precision: x, z, y, dy and the gradients dx, dz may be float16, loaded and stored as
half; the element math then runs in float32 (``reduce.widen``; the per-channel parameters
are kept in gamma's dtype, float32: the ops layer hands these kernels float32 gamma, beta
and running statistics for a float16 x) and dgamma, dbeta come out float32.

The 1-bit mask of the forward is one ``ballot_sync`` per group on a GPU (four bytes
written by lanes 0-3); under the simulator, which has no warp votes, the block assembles
the bytes in shared memory (``USE_BALLOT``; tests emulate ``ballot_sync`` to run the GPU
path too).

Relu state codes for the backward are those of the CPU module: ``STATE_NONE``, ``STATE_Y``
(open where y > 0), ``STATE_MASK`` (packed bits, bit ``j % 8`` of byte ``j // 8``),
``STATE_AFFINE`` (no add: open where ``gamma * xhat + beta > 0`` of x itself, computed as the
forward's apply computes it, ``reduce.affine``; Conv-BatchNorm-ReLU's recompute needs no y
or mask rebuilt, one launch and one pass over the activation fewer).

Host-level entry points (same as ``kernels/cpu/batchnorm.py``): :func:`stats`,
:func:`inference_stats`, :func:`apply`, :func:`backward`, :func:`update_running`; and two
that fold launches, used by the ops layer where a backend module has them:
:func:`stats_update` (statistics and the running-statistics update, finished by each
channel's last reduction block) and :func:`apply_running` (inference: the statistics read
from the running ones inside the apply). The backward's sums and coefficients are one launch
the same way (``_finish_bwd``).
"""
import math

import numpy as np
from numba import boolean, float32, float64, int32, int64, types, uint8, uint32

from ... import backend, kernels, validate
from ...cuda import SIMULATOR, empty as pool_empty, flat, numba_cuda as cuda, require_eager, rows
from . import math as bm
from .math import BITS, STATE_AFFINE, STATE_MASK, STATE_NONE, STATE_Y, mask_nbytes  # noqa: F401
from ..scalar import cuda_scalar
from ..cuda import config
from ..cuda.launch import launch
from ..cuda import reduce

BLOCK = config.BLOCK
# Whether Conv-BatchNorm-ReLU's recompute hands the backward STATE_AFFINE
# (ops.batchnorm.AffineGate) instead of rebuilding the ReLU's mask with the apply kernel.
# GPU run 16 (an H200) timed it slower: its walk loaded g only where the gate was open, each
# load waiting for x's and the compare (the four channel_reduce_bwd_nhwc launches of the
# digits step 164.4 us against 66.8). With g loaded first (reduce._elem), runs 17 and 18 (an
# H200, benchmarks/gpu_step_kernels.py --affine-gate on/off, one machine each) timed the
# fused digits step's kernels at 703.5 / 704.3 us on against 728.2 / 728.4 off, replayed from a
# graph 731.6 / 719.6 against 767.4 / 743.7 (47 launches against 49): on.
AFFINE_GATE = True
WARP = 32
FULL_MASK = 0xFFFFFFFF
U = 4                    # groups of 32 elements in flight per warp
# Warp votes on a real GPU only; the simulator assembles mask bytes in shared memory.
USE_BALLOT = not SIMULATOR

_finalize_mean = cuda_scalar(bm.finalize_mean)
_finalize_var = cuda_scalar(bm.finalize_var)
_invstd_of = cuda_scalar(bm.invstd_of)
_unbiased_var = cuda_scalar(bm.unbiased_var)
_running_update = cuda_scalar(bm.running_update)
_coef_g = cuda_scalar(bm.coef_g)
_coef_x = cuda_scalar(bm.coef_x)
_coef_0 = cuda_scalar(bm.coef_0)


# --------------------------------------------------------------------------- flat walks

@cuda.jit(device=True, inline=True)
def _walk_start(C, B, U_, lanes):
    """The flat walk of this thread: (j, jstride, rounds, pos, c, dpos, dc, gpos, gc).

    A warp takes U_ consecutive groups of ``lanes`` elements per round; j is this lane's
    first element, jstride the advance per round; (pos, c) = (j % B, (j // B) % C) and
    (dpos, dc), (gpos, gc) the same decomposition of jstride and of one group (``lanes``).
    Divisions here, once per thread; the loop only adds.
    """
    t = int32(cuda.threadIdx.x)
    wpb = int32(cuda.blockDim.x // lanes)
    warp = int32(t // lanes)
    lane = int32(t - warp * lanes)
    j = int64((cuda.blockIdx.x * wpb + warp) * U_ * lanes + lane)
    jstride = int64(cuda.gridDim.x * wpb * U_ * lanes)
    return j, jstride, lane, warp


@cuda.jit(device=True, inline=True)
def _split(j, C, B):
    """(j % B, (j // B) % C) for j >= 0 (once per thread: a division)."""
    q = j // B
    return int32(j - q * B), int32(q % C)


@cuda.jit(device=True, inline=True)
def _step(pos, c, dpos, dc, C, B):
    """Channel counters advanced by a stride whose split is (dpos, dc): adds and compares."""
    pos = int32(pos + dpos)
    c = int32(c + dc)
    if pos >= B:
        pos = int32(pos - B)
        c = int32(c + 1)
    if c >= C:
        c = int32(c - C)
    return pos, c


# --------------------------------------------------------------------------- statistics

@cuda.jit(device=True, inline=True)
def _finish_stats(c, x, B, partials, parts, fin):
    # run by channel c's last reduction block: x (A*C*B,) flat; fin = (stats (3, C) float64
    # rows mean, var (biased), invstd; running_mean, running_var (C,) x's dtype, updated in
    # place when ``update``; eps, count (M), momentum, update)
    stats, running_mean, running_var, eps, count, momentum, update = fin
    s1, s2 = reduce.part_sums(partials, c, parts)              # parts in order
    mean = _finalize_mean(s1, float64(x[c * B]), count)        # shift: channel's first
    var = _finalize_var(s1, s2, count)
    stats[0, c] = mean
    stats[1, c] = var
    stats[2, c] = _invstd_of(var, eps)
    if update:
        running_mean[c] = _running_update(float64(running_mean[c]), mean, momentum)
        running_var[c] = _running_update(float64(running_var[c]), _unbiased_var(var, count),
                                         momentum)


@cuda.jit(cache=True)
def _inference_stats(running_mean, running_var, eps, mean, invstd):
    # running_*: (C,); mean, invstd: (C,) float64
    for c in range(cuda.grid(1), mean.shape[0], cuda.gridsize(1)):
        mean[c] = running_mean[c]
        invstd[c] = _invstd_of(float64(running_var[c]), eps)


@cuda.jit(cache=True)
def _update_running(running_mean, running_var, mean, var, count, momentum):
    # running_*: (C,) updated in place; mean, var: (C,) float64 (var biased)
    for c in range(cuda.grid(1), mean.shape[0], cuda.gridsize(1)):
        running_mean[c] = _running_update(float64(running_mean[c]), mean[c], momentum)
        running_var[c] = _running_update(float64(running_var[c]),
                                         _unbiased_var(var[c], count), momentum)


# --------------------------------------------------------------------------- fused forward

@cuda.jit(cache=True)
def _apply(x, z, mean, invstd, gamma, beta, dims, y, mask, flags):
    # x, z, y: (size,) flat; mean, invstd: (C,) float64; gamma, beta: (C,); dims = (C, B);
    # mask: (ceil(size/8),) uint8, bit j%8 of byte j//8 set where y[j] > 0;
    # flags = (has_z, relu, want_mask)
    _apply_walk(x, z, mean, invstd, False, 0.0, gamma, beta, dims, y, mask, flags)


@cuda.jit(cache=True)
def _apply_running(x, z, running_mean, running_var, eps, gamma, beta, dims, y, mask, flags,
                   saved):
    # inference: ``_apply`` with each channel's mean and invstd taken from the running
    # statistics (C,) as the walk meets it, and also written to saved (2, C) float64, rows
    # mean, invstd (saved for backward), by the first C threads of the grid: no statistics
    # kernel
    for c in range(cuda.grid(1), dims[0], cuda.gridsize(1)):
        saved[0, c] = running_mean[c]
        saved[1, c] = _invstd_of(float64(running_var[c]), eps)
    _apply_walk(x, z, running_mean, running_var, True, eps, gamma, beta, dims, y, mask, flags)


@cuda.jit(device=True, inline=True)
def _apply_walk(x, z, src_m, src_v, from_running, eps, gamma, beta, dims, y, mask, flags):
    # the flat walk of the apply kernels; channel c's (mean, invstd) is (src_m[c], src_v[c])
    # or, ``from_running``, (running_mean[c], invstd_of(running_var[c], eps)). Element
    # offsets are uint32 (the host keeps size < 2**31: ``_flat_grid``): no 64-bit index math
    # and no negative-index wraparound code per element
    C, B = dims
    has_z, relu, want_mask = flags
    bits = cuda.shared.array(BLOCK, int32)          # portable mask assembly
    prm = cuda.local.array((U, 4), gamma.dtype)     # per group: m_hi, m_lo, scale, beta
    chan = cuda.local.array(U, int32)               # ... of this channel (-1: none yet)
    xv = cuda.local.array(U, x.dtype)
    zv = cuda.local.array(U, x.dtype)
    lanes = int32(min(WARP, cuda.blockDim.x))
    j0, jstride0, lane, warp = _walk_start(C, B, U, lanes)
    pos, c = _split(j0, C, B)
    dpos, dc = _split(jstride0, C, B)
    gpos, gc = _split(int64(lanes), C, B)
    rounds = int32((x.size + jstride0 - 1) // jstride0)  # block-uniform: every barrier is met
    size = uint32(x.size)
    nbytes = uint32(mask.size)
    j = uint32(j0)
    jstride = uint32(jstride0)
    ulanes = uint32(lanes)
    ulane = uint32(lane)
    for u in range(U):
        chan[u] = -1
    for _ in range(rounds):
        for u in range(U):                           # U loads of x (and z) in flight
            ju = uint32(j + uint32(u) * ulanes)
            if ju < size:
                xv[u] = x[ju]
                if has_z:
                    zv[u] = z[ju]
        upos, uc = pos, c
        for u in range(U):
            ju = uint32(j + uint32(u) * ulanes)
            v = reduce.widen(xv[u])                  # float32 for a float16 x
            if ju < size:
                if chan[u] != uc:                    # channel parameters, in registers
                    chan[u] = uc
                    ch = uint32(uc)
                    m = float64(src_m[ch])
                    if from_running:
                        s = float64(_invstd_of(float64(src_v[ch]), eps))
                    else:
                        s = float64(src_v[ch])
                    prm[u, 0] = m
                    prm[u, 1] = m - float64(prm[u, 0])
                    prm[u, 2] = gamma[ch] * s
                    prm[u, 3] = beta[ch]
                v = reduce.affine(v, prm[u, 0], prm[u, 1], prm[u, 2], prm[u, 3])
                if has_z:
                    v += reduce.widen(zv[u])
                if relu:
                    v = reduce.relu(v)
                y[ju] = v
            if want_mask:
                open_ = ju < size and v > 0
                g0 = uint32(uint32(ju - ulane) >> uint32(3))    # first mask byte of the group
                if USE_BALLOT and lanes == WARP:
                    word = cuda.ballot_sync(FULL_MASK, open_)
                    if lane < 4 and uint32(g0 + ulane) < nbytes:
                        mask[uint32(g0 + ulane)] = (word >> (8 * lane)) & 0xFF
                else:
                    t = cuda.threadIdx.x
                    bits[t] = 1 if open_ else 0
                    cuda.syncthreads()  # every lane's bit of this group is in bits
                    if lane < lanes // BITS and uint32(g0 + ulane) < nbytes:
                        byte = 0
                        for i in range(BITS):
                            byte |= bits[warp * lanes + lane * BITS + i] << i
                        mask[uint32(g0 + ulane)] = byte
                    cuda.syncthreads()  # bits read before the next group overwrites them
            upos, uc = _step(upos, uc, gpos, gc, C, B)
        j = uint32(j + jstride)
        pos, c = _step(pos, c, dpos, dc, C, B)


# --------------------------------------------------------------------------- fused backward

@cuda.jit(device=True, inline=True)
def _finish_bwd(c, x, B, partials, parts, fin):
    # run by channel c's last reduction block: fin = (gamma (C,), invstd (C,) float64, count,
    # training, ggamma, gbeta (C,) x's dtype, coefs (3, C) float64 rows cg, cx, c0, beta (C,))
    # with dx = cg*g + cx*(x - mean) + c0; beta is read by the walk's STATE_AFFINE gate
    # (``reduce._bwd_gate_source``), gamma there too
    gamma, invstd, count, training, ggamma, gbeta, coefs, _ = fin
    sg, sgx = reduce.part_sums(partials, c, parts)             # parts in order
    dgamma = sgx * invstd[c]
    gbeta[c] = sg
    ggamma[c] = dgamma
    gam = float64(gamma[c])
    coefs[0, c] = _coef_g(gam, invstd[c])
    coefs[1, c] = _coef_x(gam, invstd[c], dgamma, count, training)
    coefs[2, c] = _coef_0(gam, invstd[c], sg, count, training)


@cuda.jit(cache=True)
def _bwd_finalize(partials, nparts, gamma, invstd, count, training, ggamma, gbeta, cg, cx,
                  c0):
    # partials: (C, >= nparts, 2); ggamma, gbeta: (C,) dtype of x; cg, cx, c0: (C,) float64
    # with dx = cg*g + cx*(x - mean) + c0
    for c in range(cuda.grid(1), invstd.shape[0], cuda.gridsize(1)):
        sg = 0.0
        sgx = 0.0
        for p in range(nparts):  # fixed order: deterministic
            sg += partials[c, p, 0]
            sgx += partials[c, p, 1]
        dgamma = sgx * invstd[c]
        gbeta[c] = sg
        ggamma[c] = dgamma
        gam = float64(gamma[c])
        cg[c] = _coef_g(gam, invstd[c])
        cx[c] = _coef_x(gam, invstd[c], dgamma, count, training)
        c0[c] = _coef_0(gam, invstd[c], sg, count, training)


@cuda.jit(cache=True)
def _bwd_apply(gy, x, mean, coefs, affine, state_kind, ystate, mask, dims, gx, gz, wants):
    # gy, x, ystate, gx, gz: (size,) flat; per-channel float64 mean (C,) and coefficients
    # coefs (3, C) rows cg, cx, c0; affine = (gamma (C,), invstd (C,) float64, beta (C,)),
    # gamma and beta in the dtype the element math runs in (x's, float32 for a float16 x),
    # read for the STATE_AFFINE gate (gamma * xhat + beta > 0 of x, as the forward decided
    # it: ``reduce.affine``); dims = (C, B); wants = (want_gx, want_gz). Offsets uint32 (as
    # in _apply_walk); the ReLU gate's y (or mask byte, or x) is loaded beside gy and applied
    # after every load of the round is issued
    C, B = dims
    want_gx, want_gz = wants
    gamma, invstd, beta = affine
    re_derive = state_kind == STATE_AFFINE
    prm = cuda.local.array((U, 7), gamma.dtype)     # per group: m_hi, m_lo, cg, cx, c0 and
    chan = cuda.local.array(U, int32)               # the gate's scale, shift
    gv = cuda.local.array(U, x.dtype)
    xv = cuda.local.array(U, x.dtype)
    sv = cuda.local.array(U, ystate.dtype)          # the gate's y (STATE_Y)
    bv = cuda.local.array(U, int32)                 # ... or its mask byte (STATE_MASK)
    lanes = int32(min(WARP, cuda.blockDim.x))
    j0, jstride0, lane, warp = _walk_start(C, B, U, lanes)
    pos, c = _split(j0, C, B)
    dpos, dc = _split(jstride0, C, B)
    gpos, gc = _split(int64(lanes), C, B)
    size = uint32(x.size)
    j = uint32(j0)
    jstride = uint32(jstride0)
    ulanes = uint32(lanes)
    for u in range(U):
        chan[u] = -1
    while j < size:
        for u in range(U):                           # U rounds of loads in flight
            ju = uint32(j + uint32(u) * ulanes)
            if ju < size:
                gv[u] = gy[ju]
                if state_kind == STATE_Y:
                    sv[u] = ystate[ju]
                elif state_kind == STATE_MASK:
                    bv[u] = int32(mask[ju >> uint32(3)])
                if want_gx or re_derive:
                    xv[u] = x[ju]
        upos, uc = pos, c
        for u in range(U):
            ju = uint32(j + uint32(u) * ulanes)
            if ju < size:
                if (want_gx or re_derive) and chan[u] != uc:
                    chan[u] = uc
                    ch = uint32(uc)
                    prm[u, 0] = mean[ch]
                    prm[u, 1] = mean[ch] - float64(prm[u, 0])
                    prm[u, 2] = coefs[0, ch]
                    prm[u, 3] = coefs[1, ch]
                    prm[u, 4] = coefs[2, ch]
                    prm[u, 5] = gamma[ch] * invstd[ch]
                    prm[u, 6] = beta[ch]
                if re_derive:
                    open_ = reduce.affine(reduce.widen(xv[u]), prm[u, 0], prm[u, 1],
                                          prm[u, 5], prm[u, 6]) > 0
                    g = gv[u] if open_ else float32(0.0)
                else:
                    g = reduce.gate_loaded(gv[u], state_kind, sv[u], bv[u], ju)
                if want_gz:
                    gz[ju] = g
                if want_gx:
                    gx[ju] = (prm[u, 2] * reduce.widen(g)
                              + prm[u, 3] * (reduce.widen(xv[u]) - prm[u, 0] - prm[u, 1])
                              + prm[u, 4])
            upos, uc = _step(upos, uc, gpos, gc, C, B)
        j = uint32(j + jstride)
        pos, c = _step(pos, c, dpos, dc, C, B)


# --------------------------------------------------------------------------- host entry points

def _empty(shape, dtype):
    """Every device buffer of this module comes from here: numbafuse's memory pool."""
    return pool_empty(shape, dtype)


MAX_SIZE = 2**31 - 1     # elements of one tensor: the walks' offsets are uint32 (j + stride)


def _check_size(size):
    """A ValueError, before anything is launched, for a tensor the kernels cannot index."""
    if size > MAX_SIZE:
        raise ValueError(f"batch norm (cuda): x has {size} elements; the device kernels take "
                         f"at most {MAX_SIZE} (2**31 - 1) per tensor")


def _flat_grid(size, C, B):
    """(blocks, threads) of a flat walk; for NHWC (B == 1) the round stride is made a
    multiple of C where that is cheap, so each lane keeps one channel (no reloads)."""
    _check_size(size)
    threads = config.block_threads()
    per_block = threads * U
    blocks = max(1, min(config.max_blocks, -(-size // per_block)))
    if B == 1 and C > 1:
        unit = C // math.gcd(C, per_block)            # blocks must be a multiple of this
        if unit <= config.max_blocks:
            blocks = max(unit, blocks // unit * unit)
    return blocks, threads


def stats(x, layout, eps):
    """(mean, var, invstd) float64 (C,) device arrays of a C-contiguous device ``x``."""
    return stats_update(x, layout, eps, None, None, 0.0)


def stats_update(x, layout, eps, running_mean, running_var, momentum):
    """:func:`stats`, and the running statistics (contiguous, x's dtype; None: none) updated
    in place with PyTorch's rule, all in one launch: each channel's last reduction block
    finishes it (``reduce.channel_partials`` with ``_finish_stats``)."""
    _check_size(x.size)                              # before the running statistics change
    A, C, B = reduce.view(x.shape, layout)
    out = _empty((3, C), np.float64)                 # rows: mean, var, invstd
    update = running_mean is not None
    if update:
        rm, rv = backend.as_device_array(running_mean), backend.as_device_array(running_var)
    else:                       # (a float16 x's running statistics are float32)
        rm = rv = reduce.placeholder(validate.compute_dtype(x.dtype))
    reduce.channel_partials(reduce.ELEM_STATS, x, x, x, reduce._NO_MASK(), reduce._NO_MEAN(),
                            STATE_NONE, layout, _empty, _finish_stats,
                            (out, rm, rv, float(eps), float(A * B), float(momentum), update))
    return rows(out)


def inference_stats(running_mean, running_var, eps):
    C = running_mean.shape[0]
    mean, invstd = _empty(C, np.float64), _empty(C, np.float64)
    launch(_inference_stats, *config.grid_1d(C), kernels.contiguous(running_mean),
           kernels.contiguous(running_var), float(eps), mean, invstd)
    return mean, invstd


def update_running(running_mean, running_var, mean, var, count, momentum):
    """In place on the device (contiguous running statistics)."""
    launch(_update_running, *config.grid_1d(mean.shape[0]),
        backend.as_device_array(running_mean), backend.as_device_array(running_var), mean, var,
        float(count), float(momentum))


def apply(x, mean, invstd, gamma, beta, z, relu, layout, want_mask):
    """(y, mask or None) on the device; see the CPU module."""
    A, C, B = reduce.view(x.shape, layout)
    y = _empty(x.shape, x.dtype)
    mask = _empty(mask_nbytes(x.size), np.uint8) if want_mask else reduce._NO_MASK()
    if x.size:
        xf = flat(x)                                              # (size,)
        zf = xf if z is None else flat(z)             # x stands in for "no z"
        launch(_apply, *_flat_grid(x.size, C, B), xf, zf, mean, invstd, gamma, beta, (C, B),
               flat(y), mask, (z is not None, bool(relu), bool(want_mask)))
    return y, (mask if want_mask else None)


def apply_running(x, running_mean, running_var, eps, gamma, beta, z, relu, layout, want_mask):
    """Inference: :func:`inference_stats` and :func:`apply` in one launch; returns
    (y, mask or None, mean, invstd)."""
    A, C, B = reduce.view(x.shape, layout)
    y = _empty(x.shape, x.dtype)
    mask = _empty(mask_nbytes(x.size), np.uint8) if want_mask else reduce._NO_MASK()
    saved = _empty((2, C), np.float64)               # rows: mean, invstd
    xf = flat(x)                                                  # (size,)
    zf = xf if z is None else flat(z)                 # x stands in for "no z"
    blocks, threads = _flat_grid(x.size, C, B)
    blocks = max(blocks, -(-C // threads))                         # and C threads for the stats
    launch(_apply_running, blocks, threads,
        xf, zf, kernels.contiguous(running_mean), kernels.contiguous(running_var), float(eps),
        gamma, beta, (C, B), flat(y), mask, (z is not None, bool(relu), bool(want_mask)),
        saved)
    mean, invstd = rows(saved)
    return y, (mask if want_mask else None), mean, invstd


def backward(gy, x, mean, invstd, gamma, state_kind, state, layout, training, need,
             sync=None, sums=None):
    """(gx, ggamma, gbeta, gz) on the device, each None unless asked for in ``need``.

    ``sync``: as in the CPU module (synchronized batch norm): called with this call's (2, C)
    float64 host sums (sum g, sum g*(x - mean)), it returns the global sums and count, from
    which the dx coefficients are made; ggamma and gbeta stay this call's own. ``sums``: never
    given here (the device conv has no batch-norm epilogue: ``conv/cuda.forward_bn_sums``
    returns None); a ValueError if it is.
    """
    if sums is not None:
        raise ValueError("batch-norm backward (cuda): precomputed sums come from a conv "
                         "epilogue the device kernels do not have")
    need_gx, need_ggamma, need_gbeta, need_gz = need
    _check_size(x.size)
    A, C, B = reduce.view(x.shape, layout)
    dtype = x.dtype
    ystate = state if state_kind == STATE_Y else x
    mask = state if state_kind == STATE_MASK else reduce._NO_MASK()
    beta = state if state_kind == STATE_AFFINE else gamma    # (unread unless STATE_AFFINE)
    ggamma, gbeta = _empty(C, gamma.dtype), _empty(C, gamma.dtype)   # float32 for half x
    coefs = _empty((3, C), np.float64)               # rows: cg, cx, c0
    cg, cx, c0 = rows(coefs)
    parts = 0
    # (an empty rank's count is 0: with sync its coefficients are replaced below)
    count = float(A * B) or 1.0
    if (need_ggamma or need_gbeta or (need_gx and training) or sync is not None) and x.size:
        # the sums and, by each channel's last block, the coefficients: one launch
        partials, parts = reduce.channel_partials(
            reduce.ELEM_BWD, gy, x, ystate, mask, mean, state_kind, layout, _empty,
            _finish_bwd, (gamma, invstd, count, bool(training), ggamma, gbeta, coefs, beta))
    else:  # inference dx/dz only (the coefficients need no sums), or nothing to sum
        partials = _empty((C, 1, 2), np.float64)
        launch(_bwd_finalize, *config.grid_1d(C), partials, 0, gamma, invstd, count,
               bool(training), ggamma, gbeta, cg, cx, c0)
    if sync is not None:           # synchronized: the dx coefficients from the global sums
        require_eager("synchronized batch norm (its sums go through the host)")
        local = (partials.copy_to_host()[:, :parts].sum(axis=1) if parts
                 else np.zeros((C, 2)))                           # (C, 2) float64
        total, global_count = sync(np.ascontiguousarray(local.T))  # (2, C): sum g, g*(x-m)
        total = np.ascontiguousarray(np.asarray(total).T.reshape(C, 1, 2))
        launch(_bwd_finalize, *config.grid_1d(C), backend.to_device(total), 1, gamma, invstd,
               float(global_count), bool(training), _empty(C, gamma.dtype),
               _empty(C, gamma.dtype), cg, cx, c0)
    gx = gz = None
    if need_gx or need_gz:
        gx = _empty(x.shape if need_gx else 1, dtype)
        gz = _empty(x.shape if need_gz else 1, dtype)
        if x.size:
            launch(_bwd_apply, *_flat_grid(x.size, C, B),
                flat(gy), flat(x), mean, coefs, (gamma, invstd, beta), state_kind,
                flat(ystate), mask, (C, B), flat(gx), flat(gz),
                (bool(need_gx), bool(need_gz)))
        gx = gx if need_gx else None
        gz = gz if need_gz else None
    return (gx, ggamma if need_ggamma else None, gbeta if need_gbeta else None, gz)


# Every kernel above with its signature as a function of the numba float type f; compiled to
# PTX for a real target by tests/test_ptx.py and read as SASS by tests/test_sass.py.
_STATS_FIN = lambda f: types.Tuple((float64[:, ::1], f[::1], f[::1], float64, float64,  # noqa
                                      float64, boolean))
_BWD_FIN = lambda f: types.Tuple((f[::1], float64[::1], float64, boolean, f[::1], f[::1],  # noqa
                                    float64[:, ::1], f[::1]))
_H = types.float16
_DIMS = types.UniTuple(int64, 2)        # (C, B) of the (A, C, B) view
_FLAGS = types.UniTuple(boolean, 3)     # _apply's (has_z, relu, want_mask)
_WANTS = types.UniTuple(boolean, 2)     # _bwd_apply's (want_gx, want_gz)
_AFFINE = lambda f: types.Tuple((f[::1], float64[::1], f[::1]))  # noqa: E731  (gamma, invstd, beta)


def _half(signature):
    """A float16-activation signature (float32 parameters), listed for f = float32 only."""
    return lambda f: signature if f == float32 else None


PTX_SIGNATURES = reduce.ptx_signatures([(reduce.ELEM_STATS, _finish_stats, _STATS_FIN),
                                        (reduce.ELEM_BWD, _finish_bwd, _BWD_FIN)],
                                       half=True) + [
    (_inference_stats, lambda f: (f[::1], f[::1], float64, float64[::1], float64[::1])),
    (_update_running, lambda f: (f[::1], f[::1], float64[::1], float64[::1], float64,
                                 float64)),
    (_apply, lambda f: (f[::1], f[::1], float64[::1], float64[::1], f[::1], f[::1], _DIMS,
                        f[::1], uint8[::1], _FLAGS)),
    (_apply_running, lambda f: (f[::1], f[::1], f[::1], f[::1], float64, f[::1], f[::1],
                                _DIMS, f[::1], uint8[::1], _FLAGS, float64[:, ::1])),
    (_bwd_finalize, lambda f: (float64[:, :, ::1], int64, f[::1], float64[::1], float64,
                               boolean, f[::1], f[::1], float64[::1], float64[::1],
                               float64[::1])),
    (_bwd_apply, lambda f: (f[::1], f[::1], float64[::1], float64[:, ::1], _AFFINE(f), int64,
                            f[::1], uint8[::1], _DIMS, f[::1], f[::1], _WANTS)),
    # float16 activations with float32 parameters (the ops convert half parameters)
    (_apply, _half((_H[::1], _H[::1], float64[::1], float64[::1], float32[::1], float32[::1],
                    _DIMS, _H[::1], uint8[::1], _FLAGS))),
    (_apply_running, _half((_H[::1], _H[::1], float32[::1], float32[::1], float64,
                            float32[::1], float32[::1], _DIMS, _H[::1], uint8[::1], _FLAGS,
                            float64[:, ::1]))),
    (_bwd_apply, _half((_H[::1], _H[::1], float64[::1], float64[:, ::1], _AFFINE(float32),
                        int64, _H[::1], uint8[::1], _DIMS, _H[::1], _H[::1], _WANTS))),
]
