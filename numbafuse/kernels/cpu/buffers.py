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
    """
    MIN_BYTES = 1 << 20

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
        with self._lock:
            for i in range(len(self._buffers)):
                if self._buffers[i].nbytes == nbytes and self._free(i):
                    return self._buffers[i].view(dtype).reshape(shape)
            held = self.owned_bytes()
            i = 0
            while held + nbytes > self.max_bytes and i < len(self._buffers):
                if self._free(i):                    # the oldest free buffers make room
                    held -= self._buffers.pop(i).nbytes
                else:
                    i += 1
            if held + nbytes > self.max_bytes:
                return np.empty(shape, dtype)
            self._buffers.append(np.empty(nbytes, np.uint8))
            return self._buffers[-1].view(dtype).reshape(shape)

    def clear(self):
        """Drop the free buffers (those in use stay owned until released)."""
        with self._lock:
            self._buffers = [self._buffers[i] for i in range(len(self._buffers))
                             if not self._free(i)]

    def owned_bytes(self):
        """Bytes of the buffers owned, in use or free."""
        return sum(b.nbytes for b in self._buffers)


output_cache = OutputCache()
