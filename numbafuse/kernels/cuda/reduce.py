r"""Deterministic reductions shared by the numba.cuda kernels: block sums and per-channel sums.

Every reduction here adds in an order fixed by the launch shape (``config``), never by
timing, so a result repeats bit for bit; no float atomics. Partials are float64.

**Per-channel sums** (batch-norm statistics and backward, conv's bias gradient) view an
activation as (A, C, B): NCHW is (N, C, H*W), NHWC is (N*H*W, C, 1); value (a, c, b) sits at
flat offset ``(a*C + c)*B + b``. One launch writes ``partials[c, part, 0:2]``, the sums of two
per-element quantities over a fixed share (``part``) of channel c's M = A*B values; a
per-channel finish adds the parts in order. With a ``finish`` the finish runs in the same
launch: each block's writers fence, thread 0 counts the block on its row's int32 counter, and
the row's last block reads the parts through L2 and finishes it (:func:`last_block`; integer
atomics only, the sums stay in a fixed order).

- NCHW: a block per (part, channel): its threads walk the channel's values ``j`` (a slice of
  each (n, c) plane, planes one after another), lane-contiguous, U independent loads in flight
  per thread; the offset and the plane position advance by adds and compares (no division).
- NHWC: a block per (part, group of CW = 32 channels): lane l reads channel ``c0 + l`` of a
  row, so a warp reads 32 consecutive values (128 bytes of float32); the block's row groups
  take rows ``rg, rg + RG, ...``, U rows' loads in flight, combined in shared memory in
  row-group order.

Parts: at most ``reduce_blocks`` per block row, at least U values per thread, and at most
``reduce_target_blocks`` blocks in all (``cuda.config``).

The element quantities (``ELEM_*``): statistics ``(x - shift, (x - shift)**2)`` with shift the
channel's first value; backward ``(g, g*(x - mean))`` with ``g = gy`` gated by the ReLU state;
bias gradient ``(g, 0)``. Element math runs in x's dtype (float32 for a float16 x:
:func:`widen`), sums in float64.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import boolean, float32, float64, int32, int64, types, uint32
from numba.core.extending import overload

from ...cuda import SIMULATOR, capture_in_progress, empty as pool_empty, flat, numba_cuda as cuda

from . import config
from .launch import launch
from ..batchnorm import math as bm
from ..batchnorm.math import STATE_AFFINE, STATE_MASK, STATE_NONE, STATE_Y  # noqa: F401
from ..scalar import cuda_scalar

BLOCK = config.BLOCK
WARP = 32
FULL_MASK = 0xFFFFFFFF
U = 4                    # independent loads in flight per thread in a channel walk
ELEM_STATS, ELEM_BWD, ELEM_GRAD = 0, 1, 2
ELEM_NAMES = ("stats", "bwd", "grad")
# Warp shuffles on a real GPU only; the simulator takes the shared-memory tree (tests patch
# this flag together with an emulated shfl_down_sync, so the GPU path runs there too).
USE_SHUFFLE = not SIMULATOR

_mask_bit = cuda_scalar(bm.mask_bit)


@cuda.jit(device=True, inline=True)
def block_sum(buf, value):
    """The sum of ``value`` over the block's threads, returned to every thread.

    ``buf``: a shared float64 array of at least blockDim.x elements (blockDim.x a power of
    two). The block's threads must all call it (it synchronises).
    """
    t = cuda.threadIdx.x
    buf[t] = value
    cuda.syncthreads()  # every thread's value is in buf
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            buf[t] += buf[t + step]
        cuda.syncthreads()  # this level of the tree is complete before the next reads it
        step //= 2
    total = buf[0]
    cuda.syncthreads()  # everyone has read buf[0] before buf is reused
    return total


@cuda.jit(device=True, inline=True)
def block_sum2(a, b, buf_a, buf_b):
    """Sums of ``a`` and ``b`` over the block (valid in thread 0); buf_*: shared (BLOCK,)
    float64. Every thread of the block must call it (it synchronises); it may be called again
    with the same buffers (it ends with a barrier). Fixed order: deterministic."""
    t = cuda.threadIdx.x
    if USE_SHUFFLE and cuda.blockDim.x % WARP == 0:
        off = WARP // 2
        while off > 0:  # within each warp, fixed order
            a += cuda.shfl_down_sync(FULL_MASK, a, off)
            b += cuda.shfl_down_sync(FULL_MASK, b, off)
            off //= 2
        lane = t % WARP
        warp = t // WARP
        if lane == 0:
            buf_a[warp] = a
            buf_b[warp] = b
        cuda.syncthreads()  # every warp's sum is in buf_*
        nwarps = cuda.blockDim.x // WARP
        if warp == 0:
            a = buf_a[lane] if lane < nwarps else 0.0
            b = buf_b[lane] if lane < nwarps else 0.0
            off = WARP // 2
            while off > 0:
                a += cuda.shfl_down_sync(FULL_MASK, a, off)
                b += cuda.shfl_down_sync(FULL_MASK, b, off)
                off //= 2
        cuda.syncthreads()  # warp 0 has read buf_* before a next call overwrites it
        return a, b
    # portable path: shared-memory tree (blockDim.x is a power of two <= BLOCK)
    buf_a[t] = a
    buf_b[t] = b
    cuda.syncthreads()  # every thread's values are in buf_*
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            buf_a[t] += buf_a[t + step]
            buf_b[t] += buf_b[t + step]
        cuda.syncthreads()  # this level of the tree is complete before the next reads it
        step //= 2
    a, b = buf_a[0], buf_b[0]
    cuda.syncthreads()  # everyone has read buf_*[0] before a next call overwrites it
    return a, b


def widen(v):
    """``v`` in the dtype element math runs in: float32 for a float16 value (half arrays are
    loaded and stored as half, computed in float32, as cuDNN does), else ``v`` itself (no
    instruction for float32 and float64). This body is the simulator's; kernels compiled for
    a GPU get the typed one below."""
    return np.float32(v) if isinstance(v, np.float16) else v


@overload(widen, target="cuda")
def _widen_typed(v):
    if v == types.float16:
        return lambda v: float32(v)
    return lambda v: v


@cuda.jit(device=True, inline=True)
def relu(v):
    """``scalar.relu`` in v's own dtype (its literal 0.0 would turn float32 into float64)."""
    return v if v > 0 or v != v else float32(0.0)


@cuda.jit(device=True, inline=True)
def gate(g, state_kind, aux, mask, off):
    """g where the forward's ReLU was open at flat offset ``off`` (y > 0 or its mask bit),
    else 0; STATE_NONE: g. ``g`` keeps its dtype (typed stores, no float64 round trip)."""
    if state_kind == STATE_Y:
        return gate_loaded(g, state_kind, aux[off], 0, off)
    if state_kind == STATE_MASK:
        return gate_loaded(g, state_kind, g, mask[off >> 3], off)
    return g


@cuda.jit(device=True, inline=True)
def gate_loaded(g, state_kind, yval, mbyte, off):
    """:func:`gate` on values already loaded: ``yval`` = y at ``off`` (STATE_Y) or ``mbyte``
    = its mask byte (STATE_MASK), so a walk can issue every load of a round before the first
    gate waits for one."""
    if state_kind == STATE_Y:
        return g if yval > 0 else float32(0.0)
    if state_kind == STATE_MASK:
        return g if _mask_bit(mbyte, off) != 0 else float32(0.0)
    return g


@cuda.jit(device=True, inline=True)
def affine(v, m_hi, m_lo, scale, shift):
    """Batch norm's ``gamma * xhat + beta`` of a value ``v`` as the kernels round it: the
    mean split ``m_hi + m_lo``, ``scale = gamma * invstd``, each in the element math's dtype.
    The forward's apply and the backward's re-derived gate (``STATE_AFFINE``) both call it,
    so the gate opens exactly where the forward's y > 0."""
    return (v - m_hi - m_lo) * scale + shift


@cuda.jit(device=True, inline=True)
def _elem(kind, a, b, aux, mask, state_kind, off, prm):
    """The two float64 quantities summed for the value at flat offset ``off``; ``prm``: the
    channel's (p0, p1, gate's m_hi, m_lo, scale, shift) (:func:`_channel_params`)."""
    p0, p1, q0, q1, q2, q3 = prm
    if kind == ELEM_STATS:                 # shifted sums: p0 is the shift
        d = float64(widen(a[off]) - widen(p0))
        return d, d * d
    if state_kind == STATE_AFFINE:         # the gate re-derived from x (b) itself
        # g is loaded whatever the gate: loaded only where it is open, its load waited for
        # x's and the compare (two memory round trips in turn a value; GPU run 16 timed the
        # reduction ~4x slower a launch than the mask's gate, whose loads are issued together)
        gv = a[off]
        g = gv if affine(widen(b[off]), q0, q1, q2, q3) > 0 else float32(0.0)
    else:
        g = gate(a[off], state_kind, aux, mask, off)
    if kind == ELEM_BWD:                   # p0 + p1 is the mean, split: x - p0 is exact
        return float64(g), float64(g) * float64((widen(b[off]) - widen(p0)) - widen(p1))
    return float64(g), 0.0


@cuda.jit(device=True, inline=True)
def _add_at(kind, a, b, aux, mask, state_kind, offs, prm, s1, s2):
    """(s1, s2) plus the ``kind`` quantities of the values at the U offsets ``offs`` (-1:
    none), in u order: the second half of a walk step, whose loads were issued together."""
    for u in range(U):
        if offs[u] >= 0:
            v1, v2 = _elem(kind, a, b, aux, mask, state_kind, uint32(offs[u]), prm)
            s1 += v1
            s2 += v2
    return s1, s2


@cuda.jit(device=True, inline=True)
def _channel_params(kind, a, mean, c, B, cvt, gate_of):
    """Channel c's (p0, p1, q0, q1, q2, q3): p0, p1 in a's dtype, the shift (its first value)
    for statistics or the mean split hi + lo for the backward (``cvt``: a (2,) local array of
    a's dtype); q0..q3 the ``STATE_AFFINE`` gate's mean split, scale and shift in the element
    math's dtype, from ``gate_of`` = (gamma, invstd, beta, qv: a (4,) local array of gamma's
    dtype), read only by a backward whose gate is re-derived (else zeros)."""
    gamma, invstd, beta, qv = gate_of
    if kind != ELEM_BWD:                   # the gradient sum reads neither
        return a[c * B], a[c * B], qv[0], qv[1], qv[2], qv[3]
    cvt[0] = mean[c]
    cvt[1] = mean[c] - float64(cvt[0])
    qv[0] = mean[c]                        # as the forward's apply rounds them
    qv[1] = mean[c] - float64(qv[0])
    qv[2] = gamma[c] * invstd[c]
    qv[3] = beta[c]
    return cvt[0], cvt[1], qv[0], qv[1], qv[2], qv[3]


@functools.lru_cache(maxsize=None)
def nchw_walk(kind):
    """``walk(a, b, aux, mask, state_kind, C, B, c, span, prm, offs)``: this thread's two
    sums of the ``kind`` quantities over values [lo, hi) = ``span`` of channel c (of M =
    A*B), lane-contiguous, U loads in flight; ``prm``: the channel's :func:`_channel_params`;
    ``offs``: a (U,) int32 local array."""
    @cuda.jit(device=True, inline=True)
    def walk(a, b, aux, mask, state_kind, C, B, c, span, prm, offs):
        lo, hi = span
        t = int32(cuda.threadIdx.x)
        T = int32(cuda.blockDim.x)
        CB = int32(C * B)
        da = int32(uint32(T) // uint32(B))          # a step of T values: da planes ...
        db = int32(T - da * B)                       # ... and db positions
        s1 = float64(0.0)
        s2 = float64(0.0)
        j = int32(lo + t)
        pa = int32(uint32(j) // uint32(B))          # once per channel, outside the walk
        pb = int32(j - pa * B)
        off = int32((pa * C + c) * B + pb)
        while j < hi:
            for u in range(U):                       # U loads in flight
                offs[u] = off if j + u * T < hi else int32(-1)
                pb = int32(pb + db)
                off = int32(off + da * CB + db)
                if pb >= B:
                    pb = int32(pb - B)
                    off = int32(off + CB - B)
            s1, s2 = _add_at(kind, a, b, aux, mask, state_kind, offs, prm, s1, s2)
            j = int32(j + U * T)
        return s1, s2
    return walk


@functools.lru_cache(maxsize=None)
def nhwc_walk(kind):
    """``walk(a, b, aux, mask, state_kind, C, c, span, prm, groups, offs)``: this thread's
    two sums over rows rg, rg + RG, ... (``groups`` = (rg, RG)) of [lo, hi) = ``span`` of
    channel c (lane = channel), U rows' loads in flight; ``prm``: the channel's (p0, p1);
    ``offs``: a (U,) int32 local array."""
    @cuda.jit(device=True, inline=True)
    def walk(a, b, aux, mask, state_kind, C, c, span, prm, groups, offs):
        lo, hi = span
        rg, RG = groups
        s1 = float64(0.0)
        s2 = float64(0.0)
        m = int32(lo + rg)
        off = int32(m * C + c)
        step = int32(RG * C)
        while m < hi:
            for u in range(U):                       # U loads in flight
                offs[u] = int32(off + u * step) if m + u * RG < hi else int32(-1)
            s1, s2 = _add_at(kind, a, b, aux, mask, state_kind, offs, prm, s1, s2)
            m = int32(m + U * RG)
            off = int32(off + U * step)
        return s1, s2
    return walk


@cuda.jit(device=True, inline=True)
def part_range(M, part, parts):
    """[lo, hi) of part ``part`` of ``parts`` fixed shares of M values."""
    chunk = int32((M + parts - 1) // parts)
    lo = int32(part * chunk)
    return lo, int32(min(M, lo + chunk))


if SIMULATOR:   # the simulator has no cache-hinted loads; its memory is coherent anyway
    @cuda.jit(device=True, inline=True)
    def load_l2(a, i):
        """a[i] read through L2 (``ld.global.cg``): values other blocks of this launch wrote."""
        return a[i]
else:
    @cuda.jit(device=True, inline=True)
    def load_l2(a, i):
        """a[i] read through L2 (``ld.global.cg``): values other blocks of this launch wrote."""
        return cuda.ldcg(a, i)


@cuda.jit(device=True, inline=True)
def part_sums(partials, c, parts):
    """The sums over parts 0..parts-1 of partials[c, :, 0:2], in order (deterministic)."""
    s1 = float64(0.0)
    s2 = float64(0.0)
    for p in range(parts):
        s1 += load_l2(partials, (int64(c), int64(p), int64(0)))
        s2 += load_l2(partials, (int64(c), int64(p), int64(1)))
    return s1, s2


@cuda.jit(device=True, inline=True)
def last_block(counters, row, parts, flag):
    """Thread 0 counts this block's partials of ``row`` as done (after a fence that makes
    them visible device-wide) and ``flag[0]`` tells the whole block whether it was the last of
    the row's ``parts`` blocks; that block then finishes the row and resets its counter.
    Every thread of the block must call it (it synchronises), after fencing its own writes."""
    if cuda.threadIdx.x == 0:
        cuda.threadfence()  # this block's partials are visible before it is counted
        flag[0] = cuda.atomic.add(counters, row, 1) == parts - 1
    cuda.syncthreads()  # flag[0] is set
    last = flag[0]
    if last:
        cuda.threadfence()  # every other block's partials are seen after the count
    return last


@cuda.jit(device=True, inline=True)
def _bwd_gate_source(fin, mean):
    # the backward's finish tuple (kernels/batchnorm/cuda._finish_bwd): gamma, invstd, beta
    return fin[0], fin[1], fin[7]


@cuda.jit(device=True, inline=True)
def _no_gate_source(fin, mean):
    # the other reductions re-derive no gate: float64 stand-ins, never read
    return mean, mean, mean


@functools.lru_cache(maxsize=None)
def channel_partials_kernel(kind, nhwc, finish=None):
    """``kernel(a, b, aux, mask, mean, state_kind, C, B, partials, counters, fin)``: partials
    (C, parts, 2) float64 of the ``kind`` quantities; a, b, aux: (A, C, B) flat ((A*C*B,));
    mask: packed uint8; mean: (C,) float64. Launch: grid (parts, min(channel blocks,
    max_grid_y)), threads a power of two; NCHW one channel per block row, NHWC CW channels.

    ``finish`` (a device function ``finish(c, a, B, partials, parts, fin)``, or None): the
    last block of each channel (``counters``: int32 zeros, one per block row, left zero)
    finishes it in the same launch, reading the parts in order, so no second kernel is
    launched; ``fin`` is the tuple of its arrays and scalars.
    """
    gate_source = _bwd_gate_source if kind == ELEM_BWD else _no_gate_source
    if not nhwc:
        walk = nchw_walk(kind)

        def nchw(a, b, aux, mask, mean, state_kind, C, B, partials, counters, fin):
            # (A, C, B) with A*C*B = a.size; block (part, c): its chunk of channel c's values
            buf_a = cuda.shared.array(BLOCK, float64)
            buf_b = cuda.shared.array(BLOCK, float64)
            flag = cuda.shared.array(1, boolean)
            cvt = cuda.local.array(2, a.dtype)
            offs = cuda.local.array(U, int32)
            gamma, invstd, beta = gate_source(fin, mean)
            qv = cuda.local.array(4, gamma.dtype)
            parts = int32(cuda.gridDim.x)
            lo, hi = part_range(int32(a.size // C), int32(cuda.blockIdx.x), parts)
            for c in range(cuda.blockIdx.y, C, cuda.gridDim.y):   # block-uniform bounds
                prm = _channel_params(kind, a, mean, c, B, cvt, (gamma, invstd, beta, qv))
                s1, s2 = walk(a, b, aux, mask, state_kind, C, B, c, (lo, hi), prm, offs)
                s1, s2 = block_sum2(s1, s2, buf_a, buf_b)
                if cuda.threadIdx.x == 0:
                    partials[c, cuda.blockIdx.x, 0] = s1
                    partials[c, cuda.blockIdx.x, 1] = s2
                if finish is not None:
                    if last_block(counters, c, parts, flag):
                        if cuda.threadIdx.x == 0:
                            finish(c, a, B, partials, parts, fin)
                            counters[c] = 0            # ready for the next launch
                    cuda.syncthreads()  # flag read by all before the next channel sets it
        return _named_kernel(nchw, kind, finish, "nchw")

    walk = nhwc_walk(kind)

    def nhwc_kernel(a, b, aux, mask, mean, state_kind, C, B, partials, counters, fin):
        # (M, C, 1): block (part, channel group): lanes on channels, row groups on rows
        buf_a = cuda.shared.array(BLOCK, float64)
        buf_b = cuda.shared.array(BLOCK, float64)
        flag = cuda.shared.array(1, boolean)
        cvt = cuda.local.array(2, a.dtype)
        offs = cuda.local.array(U, int32)
        gamma, invstd, beta = gate_source(fin, mean)
        qv = cuda.local.array(4, gamma.dtype)
        t = int32(cuda.threadIdx.x)
        CW = int32(min(WARP, int32(cuda.blockDim.x)))
        RG = int32(cuda.blockDim.x // CW)
        lane = int32(t % CW)
        rg = int32(t // CW)
        parts = int32(cuda.gridDim.x)
        lo, hi = part_range(int32(a.size // C), int32(cuda.blockIdx.x), parts)
        n_groups = int32((C + CW - 1) // CW)
        for grp in range(cuda.blockIdx.y, n_groups, cuda.gridDim.y):   # block-uniform
            c = int32(grp * CW + lane)
            s1 = float64(0.0)
            s2 = float64(0.0)
            if c < C:
                prm = _channel_params(kind, a, mean, c, 1, cvt, (gamma, invstd, beta, qv))
                s1, s2 = walk(a, b, aux, mask, state_kind, C, c, (lo, hi), prm, (rg, RG), offs)
            buf_a[t] = s1
            buf_b[t] = s2
            cuda.syncthreads()  # every row group's sums are in buf_*
            if rg == 0 and c < C:
                for r in range(1, RG):           # row groups in order: deterministic
                    s1 += buf_a[r * CW + lane]
                    s2 += buf_b[r * CW + lane]
                partials[c, cuda.blockIdx.x, 0] = s1
                partials[c, cuda.blockIdx.x, 1] = s2
            if finish is not None:
                if rg == 0 and c < C:
                    cuda.threadfence()  # this lane's partials are visible before the count
                cuda.syncthreads()  # every lane has written and fenced
                if last_block(counters, grp, parts, flag):
                    if rg == 0 and c < C:
                        finish(c, a, 1, partials, parts, fin)
                    if t == 0:
                        counters[grp] = 0              # ready for the next launch
            cuda.syncthreads()  # buf_* and flag read before the next channel group
    return _named_kernel(nhwc_kernel, kind, finish, "nhwc")


def _named_kernel(fn, kind, finish, layout):
    """The kernel of ``fn`` named for what it reduces: the name is its qualified name too, so
    each variant has a disk-cache index of its own (Numba keeps one per qualified name, and
    processes compiling variants at once would overwrite each other's entries)."""
    fn.__name__ = fn.__qualname__ = \
        f"channel_{'reduce' if finish else 'partials'}_{ELEM_NAMES[kind]}_{layout}"
    return cuda.jit(cache=True)(fn)


def view(shape, layout):
    """(A, C, B) of the reduction view: NCHW (N, C, H*W), NHWC (N*H*W, C, 1)."""
    if layout == "NCHW":
        N, C, H, W = shape
        return N, C, H * W
    N, H, W, C = shape
    return N * H * W, C, 1


def channel_partials(kind, a, b, aux, mask, mean, state_kind, layout, empty, finish=None,
                     fin=()):
    """(partials (C, parts, 2) float64, parts) of the ``kind`` sums of 4-d device arrays.

    ``b``/``aux``/``mask``/``mean`` may be placeholders of the right type where ``kind`` and
    ``state_kind`` do not read them. ``empty(shape, dtype)`` allocates (the caller's helper).
    ``finish``/``fin``: the per-channel finish done by each channel's last block in the same
    launch (see :func:`channel_partials_kernel`).
    """
    A, C, B = view(a.shape, layout)
    nhwc = layout == "NHWC"
    threads = config.block_threads()
    per_block = threads * U
    rows = -(-C // min(WARP, threads)) if nhwc else C
    parts = max(1, min(config.reduce_blocks, -(-(A * B) // per_block),
                       -(-config.reduce_target_blocks // rows)))
    partials = empty((C, parts, 2), np.float64)
    launch(channel_partials_kernel(kind, nhwc, finish), (parts, min(rows, config.max_grid_y)),
           threads,
        flat(a), flat(b), flat(aux), mask, mean, state_kind,
        C, B, partials, counters(rows), fin)
    return partials, parts


_COUNTERS = []      # the one zeroed int32 counter array, grown as needed


def counters(n):
    """An int32 device array of at least ``n`` zeros for the last-block counts (each launch
    leaves it zero again; kernels run in stream order, so launches do not share counts).
    One needed first inside a CUDA graph capture is the graph's own (its memory and its
    zeroing belong to the graph, which releases them when closed): not kept for later."""
    if not _COUNTERS or _COUNTERS[0].size < n:
        size = 1 << max(4, (max(n, 1) - 1).bit_length())
        array = pool_empty(size, np.int32)
        launch(_zero_int, *config.grid_1d(size), array)
        if capture_in_progress() is not None:
            return array
        _COUNTERS[:] = [array]
    return _COUNTERS[0]


@cuda.jit(cache=True)
def _zero_int(a):
    # a: (n,) int32 set to 0
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = 0


@cuda.jit(device=True, inline=True)
def _finish_sums(c, a, B, partials, parts, fin):
    # fin = (out,): out[c] = the sum over the parts of partials[c, :, 0], in order
    s1, _ = part_sums(partials, c, parts)
    out = fin[0]
    out[c] = s1


@cuda.jit(cache=True)
def _finalize_sums(partials, out):
    # partials: (C, parts, 2) float64; out: (C,) = sum over parts of [:, :, 0], in order
    for c in range(cuda.grid(1), out.shape[0], cuda.gridsize(1)):
        acc = float64(0.0)
        for p in range(partials.shape[1]):
            acc += partials[c, p, 0]
        out[c] = acc


def channel_sums(gy, y, layout, empty=None):
    """Per-channel sum over N, H, W of ``g = gy * (y > 0)`` (``y`` None: of gy), shape (C,),
    gy's dtype; deterministic (fixed parts, fixed order)."""
    empty = empty or pool_empty
    C = gy.shape[3] if layout == "NHWC" else gy.shape[1]
    out = empty(C, gy.dtype)
    if C == 0:
        return out
    if gy.size == 0:                                    # N, H or W is 0: the sums are 0
        zeros = empty((C, 1, 2), np.float64)
        launch(_zero3, *config.grid_1d(C), zeros)
        partials = zeros
    else:
        state = STATE_Y if y is not None else STATE_NONE
        aux = y if y is not None else gy
        channel_partials(ELEM_GRAD, gy, gy, aux, _NO_MASK(), _NO_MEAN(), state, layout,
                         empty, _finish_sums, (out,))    # finished in the same launch
        return out
    launch(_finalize_sums, *config.grid_1d(C), partials, out)
    return out


@cuda.jit(cache=True)
def _zero3(a):
    # a: (C, parts, 2) float64 set to 0
    for c in range(cuda.grid(1), a.shape[0], cuda.gridsize(1)):
        for p in range(a.shape[1]):
            a[c, p, 0] = 0.0
            a[c, p, 1] = 0.0


_PLACEHOLDERS = {}      # (dtype as asked, ndim) -> a one-element device array, kept


def placeholder(dtype, ndim=1):
    """A one-element device array of ``ndim`` dimensions standing in for an argument a kernel
    does not read or write; made once per (dtype, ndim) and kept for the process. One first
    needed inside a CUDA graph capture is the graph's memory (released with it): not kept."""
    key = (dtype, ndim)
    a = _PLACEHOLDERS.get(key)
    if a is None:
        a = pool_empty((1,) * ndim, dtype)
        if capture_in_progress() is None:
            _PLACEHOLDERS[key] = a
    return a


def _NO_MASK():
    """A one-byte mask array for kernels that do not read the mask."""
    return placeholder(np.uint8)


def _NO_MEAN():
    """A one-element float64 array for kernels that do not read the mean."""
    return placeholder(np.float64)


def _partials_signature(f, fin):
    return (f[::1], f[::1], f[::1], types.uint8[::1], float64[::1], types.int64, types.int64,
            types.int64, float64[:, :, ::1], types.int32[::1], fin)


def _sig(fin_of):
    return lambda f: _partials_signature(f, fin_of(f))


def _half_sig(fin_of):
    # a float16 activation with float32 parameters (fin_of(float32)): built once, for f32
    return lambda f: _partials_signature(types.float16, fin_of(f)) if f == float32 else None


# (kind, finish, fin tuple type as a function of f): every reduction kernel that is launched
# (the batch-norm ones are listed by kernels/batchnorm/cuda.py, with their finishes)
REDUCTIONS = [(ELEM_GRAD, _finish_sums, lambda f: types.Tuple((f[::1],)))]


def ptx_signatures(reductions, half=False):
    """PTX_SIGNATURES entries of ``(kind, finish, fin type)`` reductions, both layouts; with
    ``half`` also float16 activations with the float32 ``fin`` (listed for f = float32)."""
    sigs = (_sig, _half_sig) if half else (_sig,)
    return [(channel_partials_kernel(kind, nhwc, finish), sig(fin))
            for kind, finish, fin in reductions for nhwc in (False, True) for sig in sigs]


PTX_SIGNATURES = ptx_signatures(REDUCTIONS) + [
    (_finalize_sums, lambda f: (float64[:, :, ::1], f[::1])),
    (_zero3, lambda f: (float64[:, :, ::1],)),
    (_zero_int, lambda f: (types.int32[::1],)),
]
