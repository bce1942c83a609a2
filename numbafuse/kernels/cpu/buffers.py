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

    The arrays it hands out start on a 64-byte boundary (``ALIGN``: a cache line, one
    AVX-512 vector), as PyTorch's CPU tensors do; NumPy's large arrays start 16 bytes into a
    page, so that every 64-byte vector load or store of a row crossed two cache lines.
    """
    MIN_BYTES = 1 << 20
    ALIGN = 64

    def __init__(self, max_bytes=1 << 30):
        self.max_bytes = max_bytes
        self._buffers = []              # uint8 (nbytes,) each, oldest first
        self._lock = threading.Lock()

    def _free(self, i):
        # only the list references buffer i (getrefcount counts its own argument too)
        return sys.getrefcount(self._buffers[i]) == 2

    def empty(self, shape, dtype):
        """An uninitialised C-contiguous array of ``shape`` and ``dtype``."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or nbytes > self.max_bytes or tracemalloc.is_tracing():
            return np.empty(shape, dtype)
        size = nbytes + self.ALIGN              # each buffer: ALIGN bytes of slack
        with self._lock:
            for i in range(len(self._buffers)):
                if self._buffers[i].nbytes == size and self._free(i):
                    return self._view(self._buffers[i], nbytes, shape, dtype)
            held = self.owned_bytes()
            i = 0
            while held + nbytes > self.max_bytes and i < len(self._buffers):
                if self._free(i):                    # the oldest free buffers make room
                    held -= self._buffers.pop(i).nbytes - self.ALIGN
                else:
                    i += 1
            if held + nbytes > self.max_bytes:
                return np.empty(shape, dtype)
            self._buffers.append(np.empty(size, np.uint8))
            return self._view(self._buffers[-1], nbytes, shape, dtype)

    def _view(self, buffer, nbytes, shape, dtype):
        """The array of ``shape`` and ``dtype`` at ``buffer``'s first ALIGN-byte boundary
        (its base is ``buffer`` itself, whose reference count says whether it is in use)."""
        return _aligned_view(buffer, nbytes, shape, dtype, self.ALIGN)

    def clear(self):
        """Drop the free buffers (those in use stay owned until released)."""
        with self._lock:
            self._buffers = [self._buffers[i] for i in range(len(self._buffers))
                             if not self._free(i)]

    def owned_bytes(self):
        """Bytes of the buffers owned, in use or free (the arrays' bytes; each buffer has
        ALIGN bytes more)."""
        return sum(b.nbytes - self.ALIGN for b in self._buffers)


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
