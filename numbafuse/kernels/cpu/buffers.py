"""Reused CPU output buffers: large outputs without fresh page faults on every call."""
import bisect
import collections
import math
import threading
import tracemalloc
import weakref

import numpy as np

from . import recorded as _recorded


class _Block:
    """A run of a segment's bytes: free, or ``used``: handed out as an owner array (the base
    of every view given away), watched by ``ref``, a weak reference whose callback queues the
    block for release when the last view is gone."""
    __slots__ = ("seg", "off", "size", "prev", "next", "used", "ref", "stashed", "mem",
                 "release")

    def __init__(self, seg, off, size, prev=None, nxt=None):
        self.seg, self.off, self.size, self.prev, self.next = seg, off, size, prev, nxt
        self.used, self.ref, self.stashed = False, None, False
        self.mem = self.release = None      # (its bytes and callback, made when handed out)


class _Segment:
    """One allocation of the cache: ``size`` bytes from ``mem`` (a memoryview starting on an
    ALIGN boundary of ``buffer``), cut into blocks linked in address order. ``high``: the end
    of the highest block ever handed out (the bytes below it may be resident; none above,
    which nobody has touched)."""
    __slots__ = ("buffer", "mem", "size", "first", "pool", "high")

    def __init__(self, size, align, pool):
        self.pool = pool                # the free list its blocks go on
        self.buffer = np.empty(size + align, np.uint8)      # (untouched: no pages yet)
        start = -self.buffer.ctypes.data % align
        self.mem, self.size = memoryview(self.buffer)[start:start + size], size
        self.first = _Block(self, 0, size)
        self.high = 0


class OutputCache:
    """A caching allocator for large outputs (y, gx, gz, the mask, im2col columns): released
    bytes are handed out again instead of fresh pages.

    A fresh large NumPy array is backed by fresh pages that the kernel zeroes on first touch
    (page faults): ~1.5 ms per 8 MiB and ~13 ms per 205 MB on the benchmark machine, as much as
    the kernels themselves. The cache owns a few large byte segments, cuts each request from
    a free block of one (the smallest that holds it, the rest left free) and hands out views
    of a block; a block is free again once every array viewing it has been released (a weak
    reference to the block's owner array, the base of those views, queues it from its
    callback: no scan of the blocks in use), and merges with free neighbours at the next
    request. A training loop thus reuses last step's bytes whatever the
    sizes, as PyTorch's CUDA caching allocator does (and like it: requests up to ``SMALL``
    come from segments of ``SMALL_SEGMENT`` bytes, up to ``LARGE`` from ``LARGE_SEGMENT``,
    larger ones from a segment of their own, so that small blocks do not split the large
    ones' segments). At most ``max_bytes`` of segments are owned (free segments are dropped
    first to make room; else a segment of the request's own where that fits, else NumPy's
    array). Bypassed for outputs under ``MIN_BYTES`` and
    while ``tracemalloc`` traces (so peak-memory measurements see every allocation).
    ``max_bytes = 0`` disables it; :meth:`clear` drops the segments nothing uses.

    Why blocks, not buffers of one size each (before 2026-11-30): a buffer served only its own
    byte count, so the cache owned, per size, the most buffers of that size ever in use at
    once, however far apart in time: a fused ResNet-18 step (batch 16, 224x224) owned 545 MiB
    of buffers to serve a peak of 208 MiB in use at once, 89 for 53 at 64x64, and its process
    peaked above PyTorch's (docs/benchmarks.md#resnet_memory).

    Why the large pool's segments are arenas of 256 MiB, not 20 MiB ones with every request
    over 10 MiB in a segment of its own (before 2026-12-01): a segment is address space
    (NumPy's uninitialised array), resident only where blocks have reached (``touched_bytes``),
    so a large one costs nothing until used, and in one segment every released block merges
    with its neighbours whatever their sizes, where separate segments kept a 50 MiB request
    from two free 32 and 16 MiB ones: a fused ResNet-18 step (batch 16, 224x224, machine A)
    owned 362 MiB of segments for 234 in use at once (two 50 MiB segments for the stem's
    output and gradient, a third made by the second step), now 264, all but 10 of them one
    arena, and its process peaked at 1043-1046 MiB against PyTorch's 997-999, now 919-948
    against 997-1022; ResNet-50 stays at ~1800 against ~2300 (its ~860 MiB in use at once
    fill three arenas) (docs/benchmarks.md#resnet_memory). A refused arena (strict
    overcommit) falls back to a segment of the request's own.

    Why a released block waits in a stash by its size (since 2026-12-04): a training step
    asks for the sizes it asked for the step before, so a block of that size freed since is
    handed out again as it is, a dict lookup, where merging it with its free neighbours on
    release and splitting it again on the request cost ~3.6 us a request warm (1.5 now, an
    ``empty`` with its release, a 12-size cycle). A request of a size not stashed merges
    every stashed block first (:meth:`_unstash`), so what other sizes find free is what they
    found before. A recorded step's requests and releases replayed (machine E; ms a step,
    warm / each request after a 32 MiB sweep): ResNet-50's 458 requests 1.35 -> 1.24 and
    10.6 -> 9.2, 1.6 MB more touched; ResNet-18's 189, 0.53 -> 0.47 and no change cold (107
    of them miss: their size's block is still held). Fitting a miss from the free lists
    before merging the stash missed 3 a step, but touched 79.0 MB against 70.6: not done
    (docs/benchmarks.md, "Machine E, 2026-12-04, a second session").

    Why ``MIN_BYTES`` is 64 KiB, not the 1 MiB it was: outputs below glibc's mmap threshold
    come from its heap, and freed together at the heap's top they pass its trim threshold
    (128 KiB, or twice the largest mmapped block freed so far) and go back to the kernel, to
    fault in again on the next call: the digits quick start (batch 32, 24 channels, 8x8:
    196 KB activations) faulted ~300 pages a step, and its step took 3.30-3.93 ms against
    2.99-3.09 with the cache from 64 KiB (machine E, ``python -m numbafuse.train``, three
    alternating runs each; the whole run's minor faults 149-228k against 34k, the floor that
    import and compilation take). Scratch arrays made inside the task kernels still come from
    malloc (docs/benchmarks.md#conv_plan: the Winograd forward at (8, 64, 8, 8)).

    The arrays it hands out start on a 64-byte boundary (``ALIGN``: a cache line, one
    AVX-512 vector), as PyTorch's CPU tensors do; NumPy's large arrays start 16 bytes into a
    page, so that every 64-byte vector load or store of a row crossed two cache lines.
    """
    MIN_BYTES = 1 << 16
    ALIGN = 64
    SMALL, SMALL_SEGMENT = 1 << 20, 2 << 20
    LARGE, LARGE_SEGMENT = 256 << 20, 256 << 20
    ROUND_LARGE = 2 << 20          # a larger request's own segment: a multiple of this

    def __init__(self, max_bytes=1 << 30):
        self.max_bytes = max_bytes
        self._segments = []             # oldest first
        self._used = set()              # blocks handed out and not yet released
        self._gone = collections.deque()    # blocks whose arrays are gone (weakref callbacks)
        self._stash = {}                # size -> free blocks of it not yet merged (_reclaim)
        self._free = ([], [])           # per pool (small, large): (size, serial, block), sorted
        self._serial = 0                # tie-break of equal sizes: the newest free block first
        self._held = 0                  # bytes of the segments
        self._lock = threading.Lock()

    def empty(self, shape, dtype):
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` (one of the call's
        allocations while a prepared call is recorded: ``recorded.py``)."""
        if _recorded.ACTIVE:
            return _recorded.allocated(False, self._empty, shape, dtype)
        return self._empty(shape, dtype)

    def _empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or nbytes > self.max_bytes or tracemalloc.is_tracing():
            return np.empty(shape, dtype)
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        with self._lock:
            if self._gone:
                self._reclaim()
            same = self._stash.get(size)
            if same:                        # a block of this size released since: as it is
                block = same.pop()          # (its bytes' view and callback made before)
                block.stashed = False
            else:
                self._unstash()
                block = self._fit(size)
                if block is None:
                    block = self._grow(size)
                    if block is None:
                        return np.empty(shape, dtype)
                self._split(block, size)
                block.seg.high = max(block.seg.high, block.off + size)
                if block.mem is None or len(block.mem) != size:
                    block.mem = block.seg.mem[block.off:block.off + size]
                    block.release = self._callback(block)
            # the owner's base is a memoryview, not an array, so NumPy's views of it keep it as
            # their base (a view of a view of an array is based on the array that owns the
            # memory): it lives exactly as long as any view the caller holds
            owner = np.frombuffer(block.mem, dtype, nbytes // dtype.itemsize)
            block.used, block.ref = True, weakref.ref(owner, block.release)
            self._used.add(block)
            return owner.reshape(shape)

    # ---------------------------------------------------------------- the blocks

    def _callback(self, block):
        # the weak reference's callback: runs wherever the last view dies (any thread, inside
        # a request too), so it only queues (a deque's append is atomic)
        gone = self._gone
        return lambda ref: gone.append(block)

    def _reclaim(self):
        """Stash the blocks whose arrays are all gone: free, kept by their size for a request
        of that size (the next step's), not yet merged (:meth:`_unstash`)."""
        while self._gone:
            block = self._gone.popleft()
            block.used, block.ref, block.stashed = False, None, True
            self._used.discard(block)
            self._stash.setdefault(block.size, []).append(block)

    def _unstash(self):
        """Free the stashed blocks for good: merged with free neighbours, on the free lists."""
        for same in self._stash.values():
            for block in same:
                block.stashed = False
                self._release(block)
        self._stash.clear()

    def _release(self, block):
        for other in (block.next, block.prev):
            if other is not None and not other.used and not other.stashed \
                    and self._unlist(other):
                if other is block.next:
                    block.size += other.size
                    block.next = other.next
                else:
                    other.size += block.size
                    other.next = block.next
                    block = other
                if block.next is not None:
                    block.next.prev = block
        self._list(block)

    def _list(self, block):
        self._serial += 1
        bisect.insort(self._free[block.seg.pool], (block.size, -self._serial, block))

    def _unlist(self, block):
        """Take a free block off its pool's list; False if it is not on it."""
        free = self._free[block.seg.pool]
        k = bisect.bisect_left(free, (block.size,))
        while k < len(free) and free[k][0] == block.size:
            if free[k][2] is block:
                del free[k]
                return True
            k += 1
        return False

    def _fit(self, size):
        """The smallest free block of the request's pool that holds ``size`` bytes (of those,
        the one freed last: its lines the likeliest still in cache), taken off the list; or
        None."""
        free = self._free[size > self.SMALL]
        k = bisect.bisect_left(free, (size,))
        if k == len(free):
            return None
        return free.pop(k)[2]

    def _split(self, block, size):
        """Cut ``block`` to ``size`` bytes; the rest, if any, a free block after it."""
        if block.size > size:
            rest = _Block(block.seg, block.off + size, block.size - size, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._list(rest)

    def _segment_bytes(self, size):
        if size <= self.SMALL:
            return self.SMALL_SEGMENT
        if size <= self.LARGE:
            return self.LARGE_SEGMENT
        return self._own_bytes(size)

    def _own_bytes(self, size):
        """A segment of a request's own: its bytes rounded up to ROUND_LARGE."""
        return -(-size // self.ROUND_LARGE) * self.ROUND_LARGE

    def _grow(self, size):
        """A new segment for a request of ``size`` bytes, its one block off the free lists;
        or None. Its pool's segment size first (an arena for a large request), else one of
        the request's own where that one would pass the cap (free segments dropped first
        while it would) or its address space is refused (MemoryError: strict overcommit)."""
        for want in dict.fromkeys((self._segment_bytes(size), self._own_bytes(size))):
            i = 0
            while self._held + want > self.max_bytes and i < len(self._segments):
                if not self._drop_if_free(i):
                    i += 1
            if self._held + want > self.max_bytes:
                continue
            try:
                seg = _Segment(want, self.ALIGN, int(size > self.SMALL))
            except MemoryError:
                continue
            self._segments.append(seg)
            self._held += want
            return seg.first
        return None

    def _drop_if_free(self, i):
        """Drop segment i if it is one free block; whether it was."""
        block = self._segments[i].first
        if block.used or block.next is not None or not self._unlist(block):
            return False
        self._held -= self._segments.pop(i).size
        return True

    def clear(self):
        """Drop the segments nothing uses (those with a block in use stay owned)."""
        with self._lock:
            self._reclaim()
            self._unstash()
            i = 0
            while i < len(self._segments):
                if not self._drop_if_free(i):
                    i += 1

    def owned_bytes(self):
        """Bytes of the segments owned, in use or free (address space: an arena's pages
        that no block has reached are not resident)."""
        return self._held

    def touched_bytes(self):
        """Bytes of the segments up to the highest block each has handed out: at most what
        the cache has made resident."""
        with self._lock:
            return sum(seg.high for seg in self._segments)


output_cache = OutputCache()


def aligned(a, align=OutputCache.ALIGN):
    """``a`` as a C-contiguous array starting on an ``align``-byte boundary: ``a`` itself if it
    is one, else a copy. For the small operands that vector kernels load again and again (a
    depthwise conv's taps and bias): NumPy starts them 16 or 48 bytes past a cache line, so
    that every 64-byte load of one crossed two lines (the NHWC 7x7 depthwise forward,
    weights aligned against NumPy's: 8-9% less time, tests/test_cpu_buffers.py)."""
    if a.flags.c_contiguous and a.ctypes.data % align == 0:
        return a
    out = _aligned_view(np.empty(a.nbytes + align, np.uint8), a.nbytes, a.shape, a.dtype,
                        align)
    out[...] = a
    return out


def _aligned_view(buffer, nbytes, shape, dtype, align):
    """The array of ``shape`` and ``dtype`` at the first ``align``-byte boundary of the uint8
    ``buffer`` (``align`` bytes longer than ``nbytes``); its base is ``buffer``."""
    start = -buffer.ctypes.data % align
    return buffer[start:start + nbytes].view(dtype).reshape(shape)
