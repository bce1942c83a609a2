"""Reused CPU output buffers: large outputs without fresh page faults on every call."""
import math
import sys
import threading
import tracemalloc

import numpy as np


class OutputCache:
    """Reuses the buffers of large outputs (y, gx, gz, the mask) once nobody references them.

    A fresh large NumPy array is backed by fresh pages that the kernel zeroes on first touch
    (page faults): ~1.5 ms per 8 MiB and ~13 ms per 205 MB on the benchmark machine, as much as
    the kernels themselves. The cache owns byte buffers and hands out views of them; a buffer
    is free again when the cache holds its only reference (``sys.getrefcount``), i.e. when every
    array viewing it has been released, so a training loop reuses last step's buffers, as
    PyTorch's CUDA caching allocator does. At most ``max_bytes`` are owned (in use or free;
    free buffers of other sizes are dropped first to make room). Bypassed for outputs under
    ``MIN_BYTES`` and while ``tracemalloc`` traces (so peak-memory measurements see every
    allocation). ``max_bytes = 0`` disables it; :meth:`clear` drops the free buffers.

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

    def __init__(self, max_bytes=1 << 30):
        self.max_bytes = max_bytes
        self._buffers = []              # [buffer, start] each, oldest first
        self._by_size = {}              # buffer bytes -> its entries, oldest first
        self._held = 0                  # bytes owned (the arrays' bytes)
        self._lock = threading.Lock()

    @staticmethod
    def _free(entry):
        # only the cache references the buffer: its entry's list holds it once (getrefcount
        # counts its own argument too)
        return sys.getrefcount(entry[0]) == 2

    def empty(self, shape, dtype):
        """An uninitialised C-contiguous array of ``shape`` and ``dtype``."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or nbytes > self.max_bytes or tracemalloc.is_tracing():
            return np.empty(shape, dtype)
        size = nbytes + self.ALIGN              # each buffer: ALIGN bytes of slack
        with self._lock:
            for entry in self._by_size.get(size, ()):
                if self._free(entry):
                    return self._view(entry, nbytes, shape, dtype)
            i = 0
            while self._held + nbytes > self.max_bytes and i < len(self._buffers):
                if self._free(self._buffers[i]):     # the oldest free buffers make room
                    self._drop(i)
                else:
                    i += 1
            if self._held + nbytes > self.max_bytes:
                return np.empty(shape, dtype)
            buffer = np.empty(size, np.uint8)
            entry = [buffer, -buffer.ctypes.data % self.ALIGN]     # its first ALIGN boundary
            self._buffers.append(entry)
            self._by_size.setdefault(size, []).append(entry)
            self._held += nbytes
            return self._view(entry, nbytes, shape, dtype)

    def _drop(self, i):
        entry = self._buffers.pop(i)
        size = entry[0].nbytes
        same = self._by_size[size]
        del same[next(j for j, e in enumerate(same) if e is entry)]   # (== compares arrays)
        if not same:
            del self._by_size[size]
        self._held -= size - self.ALIGN

    @staticmethod
    def _view(entry, nbytes, shape, dtype):
        """The array of ``shape`` and ``dtype`` at the entry's buffer's first ALIGN-byte
        boundary (its base is that buffer, whose reference count says whether it is in
        use)."""
        start = entry[1]
        return entry[0][start:start + nbytes].view(dtype).reshape(shape)

    def clear(self):
        """Drop the free buffers (those in use stay owned until released)."""
        with self._lock:
            for i in range(len(self._buffers) - 1, -1, -1):
                if self._free(self._buffers[i]):
                    self._drop(i)

    def owned_bytes(self):
        """Bytes of the buffers owned, in use or free (the arrays' bytes; each buffer has
        ALIGN bytes more)."""
        return self._held


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
