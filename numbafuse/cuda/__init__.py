"""The CUDA backend: the one module of numbafuse that imports ``numba.cuda``.

Every CUDA kernel module takes ``cuda`` from here (``from numbafuse.cuda import numba_cuda as
cuda``), so moving to another compiler is a change to this file alone. The CPU path never
imports it: it is imported when the first device array reaches an op (or a CUDA kernel module
is imported, as the PTX tests do).

Supported compiler
------------------
numba-cuda ``SUPPORTED_NUMBA_CUDA`` (tested: 0.30.4, with numba 0.68, on an H100 and under
the CUDA simulator). numba-cuda is in maintenance mode since June 2026 (security and critical
fixes only, through CUDA 13; NVIDIA/numba-cuda#902). Its successor, numba-cuda-mlir, has no
CUDA simulator and needs a CUDA driver even to emit PTX, so it cannot be tested on machines
without a GPU; numbafuse stays on numba-cuda until that changes.

NumPy 2.5
---------
NumPy 2.5 removed ``np.row_stack``; numba-cuda 0.30 still registers an overload for it, so
every kernel compilation fails inside numba-cuda with ``AttributeError: module 'numpy' has
no attribute 'row_stack'``. The ``cuda`` and ``test`` extras therefore install ``numpy<2.5``,
and importing this module with an incompatible pair raises a ``RuntimeError`` that names the
versions and the fix (:func:`compatibility_error`), instead of that ``AttributeError`` from
deep inside the compiler. The bound can be lifted once a numba-cuda release guards the
overload (numba itself does since 0.67): raise ``FIRST_NUMBA_CUDA_WITH_NUMPY_25`` then.

Two slow loops of numba-cuda 0.30, replaced
-------------------------------------------
Importing this module installs two replacements (``compat.py``), each only while numba-cuda's
method is still the one it replaces (its source is read), each computing what numba-cuda's
does:

- compiling (a GPU, or PTX for sm_90): numba-cuda's lowering looks for the variables assigned
  once by listing, per variable, every assignment of its block, quadratic in a block's length;
  the conv GEMMs' unrolled tiles made that a third of their compile time. The count numba's
  own CPU lowering uses replaces it (the same PTX: ``tests/test_ptx.py``).
- the CUDA simulator: a block's manager polled all its threads in a loop that never slept,
  taking the GIL from the threads it waited for. Blocks now sleep on a condition variable
  until a thread reaches a barrier or finishes; the barrier rules are numba-cuda's
  (``tests/cuda/test_simulator_blocks_cuda.py`` runs its checks under both). The simulator's
  tests took half the time (785 s instead of 1604 in one process). A kernel whose code (and
  the device functions it names) reaches no barrier, shared array, warp vote or shuffle runs
  each block's threads one after another on the launching thread, each under its own ids
  (any order of such threads is one a GPU may run); with that and the tests' tiled matmul
  shrunk to 4 x 4 threads (``tests/conftest.py``), the simulator's tests took 413 s in one
  process instead of 551 (593 -> 435 s of CPU; machine F, each tree alone in turn).
"""
from __future__ import annotations

import numpy as np

from .compat import (FIRST_NUMBA_CUDA_WITH_NUMPY_25, NUMPY_WITHOUT_ROW_STACK,  # noqa: F401
                     SUPPORTED_NUMBA_CUDA, compatibility_error, require_compatible,
                     lock_shared_arrays, speed_up_lowering, speed_up_simulator)

require_compatible()

from numba import config as numba_config  # noqa: E402

try:
    from numba import cuda as numba_cuda  # noqa: E402  (the one import of numba.cuda)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("numbafuse: CUDA arrays need numba-cuda: pip install 'numbafuse[cuda]'"
                      ) from exc

from .. import jit_cache  # noqa: E402
from .arrays import c_array, flat, memory, rows  # noqa: E402,F401  (flat, rows: kernels')

jit_cache.install_numbafuse()   # numba-cuda's cache too, before any CUDA kernel is decorated

SIMULATOR = bool(numba_config.ENABLE_CUDASIM)   # NUMBA_ENABLE_CUDASIM=1: the CUDA simulator
if SIMULATOR:
    from numba.cuda.simulator import kernel as _simulated  # noqa: E402
    speed_up_simulator(_simulated)  # compat.py: blocks that sleep until a thread changes state
    from numba.cuda.simulator import kernelapi as _simulated_api  # noqa: E402
    lock_shared_arrays(_simulated_api)  # compat.py: one shared array a line, however threads run
else:
    from numba.cuda import lowering as _lowering  # noqa: E402
    speed_up_lowering(_lowering)  # compat.py: numba-cuda's quadratic scan of long blocks, linear


def is_available() -> bool:
    """True when a CUDA device (or the simulator) can run kernels."""
    return bool(numba_cuda.is_available())


def current_device_id() -> int:
    """The id of numba's current CUDA device: where numbafuse's kernels run."""
    return int(numba_cuda.get_current_device().id)


def as_device_array(a):
    """A numba device array viewing ``a`` (zero-copy for ``__cuda_array_interface__`` objects)."""
    if getattr(a, "__cuda_ndarray__", False):
        return a
    return numba_cuda.as_cuda_array(a)


def device_array(shape, dtype):
    """An uninitialised device array (from numbafuse's pool: see :func:`empty`)."""
    return empty(shape, dtype)


def to_device(a: np.ndarray):
    """A device copy of the C-contiguous host array ``a`` (in pool memory)."""
    require_eager("a copy from the host to the device")
    out = empty(a.shape, a.dtype)
    out.copy_to_device(a)
    return out


def upload(a: np.ndarray):
    """A device copy of the host array ``a`` (pool memory) by an asynchronous copy on numba's
    default stream, ordered before the kernels launched after it. From pageable memory the
    driver stages ``a`` before the call returns (so ``a`` may be changed at once), and CUDA's
    documentation allows it to synchronize with the stream to do so; whether it waits for
    the kernels queued before it on a given driver is for a GPU to measure (``gpu_probe.py
    labels``). :func:`to_device`'s synchronous copy always waits for them."""
    require_eager("a copy from the host to the device")
    a = np.ascontiguousarray(a)
    out = empty(a.shape, a.dtype)
    if a.size:
        if not _NUMBA_STREAM:            # (numba makes it from the current context: ~us)
            _NUMBA_STREAM.append(numba_cuda.default_stream())
        out.copy_to_device(a, stream=_NUMBA_STREAM[0])
    return out


_NUMBA_STREAM = []      # numba's default-stream object (the legacy stream), made once


def to_host(a) -> np.ndarray:
    require_eager("a copy from the device to the host")
    return as_device_array(a).copy_to_host()


def copy_device(src):
    """A new pool array holding the C-contiguous device array ``src``'s values (a device to
    device copy; inside a graph capture, a copy node of the graph)."""
    out = empty(src.shape, src.dtype)
    capture = _CAPTURE[0]
    if capture is None:
        out.copy_to_device(src)
    elif SIMULATOR:
        capture.launches.append(lambda: out.copy_to_device(src))
    else:
        capture.use((src, out))
        out.copy_to_device(src, stream=capture.numba_stream())
    return out


def argument_type(value):
    """The numba type numba-cuda gives ``value`` as a kernel argument (its own ``typeof``)."""
    from numba.cuda.typing.typeof import Purpose, typeof
    return typeof(value, Purpose.argument)


def default_stream():
    """numba's default (legacy) stream, where its launches go, as a cuda.core stream."""
    from numba.cuda.cudadrv import driver
    return driver._to_core_stream(0)


# --------------------------------------------------------------------------- the memory pool

class _Stats:
    def __init__(self):
        self.requests = 0          # device arrays asked for
        self.allocations = 0       # new device memory reserved by the pool (not reused)
        self.bytes_reserved = 0
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0
        self.bytes_cached = 0      # of bytes_reserved: free blocks kept for reuse

    def as_dict(self):
        return dict(allocations=self.allocations, requests=self.requests,
                    bytes_reserved=self.bytes_reserved, bytes_in_use=self.bytes_in_use,
                    peak_bytes_in_use=self.peak_bytes_in_use, bytes_cached=self.bytes_cached)


class _CudaPool:
    """numbafuse's own stream-ordered pool (``cudaMallocAsync``) through ``cuda.core``.

    A pool of its own, not the device's default one, so the user's other numba allocations
    are untouched. Its release threshold is raised so that freed memory stays reserved for
    reuse instead of going back to the driver at every synchronization. A buffer is free when
    the last device array viewing it dies (numba's ``MemoryPointer`` finalizer); it is kept,
    by size, for the next request of that size (``cached``: a training step asks for the
    same sizes every step, and a request served from here makes no driver call), and handed
    back to the driver's pool (in the order of numba's default stream, where numbafuse
    launches) by :func:`empty_cache`, or when an allocation fails (then retried once). Reuse
    is safe for the same reason the stream-ordered pool's is: every numbafuse launch and copy
    goes to the one legacy stream, so the new holder's work runs after the old one's.

    Accounting: ``bytes_in_use`` is the requested bytes of live arrays (kept here, no driver
    call); ``bytes_reserved`` the pool's ``reserved_mem_current`` (one driver query per
    allocation), and an allocation counts as new when it raised that figure. The release
    threshold keeps the pool from trimming itself, so the figure only grows.

    Run on an H100 (``tests/cuda/test_memory_pool_cuda.py`` and every CUDA test,
    docs/benchmarks.md#gpu). CUDA graphs: see :class:`_Block` and :func:`graph`.
    """

    def __init__(self):
        from cuda.core import LEGACY_DEFAULT_STREAM, Device, DeviceMemoryResource, \
            DeviceMemoryResourceOptions
        device = Device(numba_cuda.get_current_device().id)
        device.set_current()
        resource = DeviceMemoryResource(device, DeviceMemoryResourceOptions())
        # numba's context, looked up once: current_context() asks the driver each time
        # (context look-ups were about a third of a pool request's host time under cProfile
        # on an H100 host: docs/gpu_runs/run2_profile.txt)
        self._start(resource, numba_cuda.current_context(), LEGACY_DEFAULT_STREAM)
        self._keep_reserved()

    @classmethod
    def over(cls, resource, context, stream=None):
        """A pool over ``resource`` (anything with cuda.core's ``allocate(nbytes, stream)``
        and ``attributes.reserved_mem_current``): the tests' and benchmarks/host_path.py's
        stand-ins for the device."""
        pool = cls.__new__(cls)
        pool._start(resource, context, stream)
        return pool

    def _start(self, resource, context, stream):
        self.stream = stream                      # numba's default stream: where kernels run
        self.resource = resource
        self._attributes = resource.attributes
        self.context = context
        self.stats = _Stats()
        self.live = {}                            # device address -> _Block, not yet freed
        self.cached = {}                          # nbytes -> [free _Block], for reuse
        self._requests = {}                       # (shape, dtype) -> (shape, dtype, nbytes)

    def _keep_reserved(self):
        from cuda.bindings import driver
        attribute = driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
        handle = driver.CUmemoryPool(int(self.resource.handle))
        err, = driver.cuMemPoolSetAttribute(handle, attribute, driver.cuuint64_t(2 ** 63 - 1))
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"numbafuse.cuda: cannot set the pool's release threshold: "
                               f"{err}")

    def empty(self, shape, dtype):
        try:                                   # (shape, dtype) as asked: seen before?
            shape, dtype, nbytes = self._requests[(shape, dtype)]
        except (KeyError, TypeError):          # (a list shape is not hashable)
            key = (shape, dtype)
            dtype = np.dtype(dtype)
            shape = tuple(int(n) for n in (shape if isinstance(shape, tuple) else (shape,)))
            nbytes = dtype.itemsize
            for n in shape:
                nbytes *= n
            if key[0].__class__ in (tuple, int):
                self._requests[key] = shape, dtype, nbytes
        stats = self.stats
        stats.requests += 1
        if nbytes == 0:
            return numba_cuda.device_array(shape, dtype)
        capture = _CAPTURE[0]
        block = capture.reuse(nbytes) if capture is not None else None
        if block is None:
            # (during a capture too: a relaxed capture lets the pool allocate at once, in
            # the legacy stream's order, outside the graph; the graph holds the block)
            free = self.cached.get(nbytes)
            if free:
                block = free.pop()
                stats.bytes_cached -= nbytes
            else:
                block = _Block(self._allocate(nbytes), nbytes, self.stream, stats, self)
            self.live[block.address] = block
            if capture is not None:
                capture.hold(block)
        return self._array(block, shape, dtype)

    def _allocate(self, nbytes):
        """A new buffer from the driver's pool (after handing back the cached blocks and
        retrying once, if it fails)."""
        try:
            buffer = self.resource.allocate(nbytes, stream=self.stream)
        except Exception:
            if not self.cached:
                raise
            self.empty_cache()
            buffer = self.resource.allocate(nbytes, stream=self.stream)
        stats = self.stats
        reserved = self._attributes.reserved_mem_current
        stats.allocations += reserved > stats.bytes_reserved
        stats.bytes_reserved = reserved
        return buffer

    def take_back(self, block):
        """A block no array views and no graph holds: kept for the next request of its
        size."""
        self.live.pop(block.address, None)
        self.cached.setdefault(block.nbytes, []).append(block)
        self.stats.bytes_cached += block.nbytes

    def empty_cache(self):
        """Hand every cached block back to the driver's pool (stream-ordered frees)."""
        cached, self.cached = self.cached, {}
        for blocks in cached.values():
            for block in blocks:
                self.stats.bytes_cached -= block.nbytes
                block.close()

    def _array(self, block, shape, dtype):
        stats = self.stats
        stats.bytes_in_use += block.nbytes
        stats.peak_bytes_in_use = max(stats.peak_bytes_in_use, stats.bytes_in_use)
        block.alive = True
        return c_array(shape, dtype, memory(self.context, block.pointer(), block.nbytes,
                                            release=block.release), block.address)

    def block_at(self, address):
        """The live block holding device ``address``, or None (memory not from this pool)."""
        block = self.live.get(address)
        if block is None:
            for start, candidate in self.live.items():
                if start <= address < start + candidate.nbytes:
                    return candidate
        return block


class _Block:
    """One pool buffer and who holds it. Held by no CUDA graph, it goes back to the pool (in
    the legacy stream's order) when its last array dies. Held by graphs (``holders``: their
    captures), it stays theirs until the last of them is closed: their kernels read and write
    it at every replay, whatever became of the arrays."""
    __slots__ = ("buffer", "nbytes", "stream", "stats", "pool", "holders", "alive", "_pointer",
                 "address")

    def __init__(self, buffer, nbytes, stream, stats, pool):
        self.buffer, self.nbytes, self.stream, self.stats = buffer, nbytes, stream, stats
        self.address = int(buffer.handle)
        self.pool = pool
        self.holders = set()
        self.alive = False
        self._pointer = None

    def pointer(self):
        """The buffer's address as the cuda.bindings CUdeviceptr numba's memory holds (made
        once: a cached block serves many arrays)."""
        if self._pointer is None:
            from numba.cuda.cudadrv.driver import binding
            self._pointer = binding.CUdeviceptr(self.address)
        return self._pointer

    def release(self):
        """The finalizer of the block's array memory (its last array died)."""
        self.stats.bytes_in_use -= self.nbytes
        self.alive = False
        capture = _CAPTURE[0]
        if capture is not None:          # died during a capture: captured kernels may use it
            capture.hold(self)
            if self.holders == {capture}:
                capture.released(self)   # later requests of this capture may take it
        if not self.holders:
            self.free()

    def free(self):
        """Back to the pool (no array views it, no graph holds it)."""
        self.pool.take_back(self)

    def close(self):
        """Hand the buffer back to the driver's pool, in the stream's order."""
        try:
            self.buffer.close(self.stream)
        except Exception:   # at interpreter exit the driver may be gone before the arrays
            import sys
            if not sys.is_finalizing():
                raise


class _SimulatedPool:
    """The pool under the CUDA simulator, backed by ``cuda.device_array``: it keeps the
    accounting CUDA's pool would (a freed block of a size is reused by the next request of that
    size, so ``allocations`` counts only new reservations); the simulator's memory is host
    memory, so each array still gets storage of its own. A block is freed when the last view of
    its storage dies (a ``weakref.finalize`` on it), never while an array uses it."""

    def __init__(self):
        self.free = {}             # nbytes -> number of reserved, unused blocks
        self.stats = _Stats()

    def empty(self, shape, dtype):
        import weakref
        array = numba_cuda.device_array(shape, dtype)
        nbytes = int(array.size) * np.dtype(dtype).itemsize
        self.stats.requests += 1
        if self.free.get(nbytes, 0):
            self.free[nbytes] -= 1
            self.stats.bytes_cached -= nbytes
        else:
            self.stats.allocations += 1
            self.stats.bytes_reserved += nbytes
        self.stats.bytes_in_use += nbytes
        self.stats.peak_bytes_in_use = max(self.stats.peak_bytes_in_use,
                                           self.stats.bytes_in_use)
        weakref.finalize(array._ary, self._release, nbytes)
        return array

    def _release(self, nbytes):
        self.free[nbytes] = self.free.get(nbytes, 0) + 1
        self.stats.bytes_in_use -= nbytes
        self.stats.bytes_cached += nbytes

    def empty_cache(self):
        self.stats.bytes_reserved -= self.stats.bytes_cached
        self.stats.bytes_cached = 0
        self.free = {}


_pool = None


def _the_pool():
    global _pool
    if _pool is None:
        _pool = _SimulatedPool() if SIMULATOR else _CudaPool()
    return _pool


def empty(shape, dtype):
    """An uninitialised device array from numbafuse's memory pool (outputs, workspaces,
    partials). Its memory returns to the pool when the last array viewing it is gone."""
    return _the_pool().empty(shape, dtype)


def memory_stats() -> dict:
    """Counters of numbafuse's device memory pool, in the spirit of ``torch.cuda.memory_stats``:

    ``allocations``: device memory reservations made so far (a request served from memory the
    pool already holds does not count); ``requests``: device arrays asked for;
    ``bytes_reserved``: memory the pool holds; ``bytes_in_use``: memory of live arrays;
    ``peak_bytes_in_use``; ``bytes_cached``: free blocks the pool keeps for requests of their
    size (see :func:`empty_cache`). All zero before the first device array.
    """
    return (_pool.stats if _pool is not None else _Stats()).as_dict()


def empty_cache() -> None:
    """Hand the free blocks numbafuse's pool keeps for reuse back to the device's memory pool
    (as ``torch.cuda.empty_cache`` does); arrays in use are untouched. The pool does this by
    itself when an allocation fails, before retrying it."""
    if _pool is not None:
        _pool.empty_cache()


# --------------------------------------------------------------------------- CUDA graphs

_CAPTURE = [None]       # the capture in progress (a _Capture), if any


class _Capture:
    """What a captured CUDA graph holds: the pool blocks its kernels use (``blocks``), so
    that none goes back to the pool while the graph can be replayed; during the capture, the
    blocks whose arrays died (``free``, by size), which later requests of the same capture
    take again (safe: the graph runs its kernels in capture order, on one stream). Under the
    simulator, the work itself (``launches``: callables, each a launch or a copy)."""

    def __init__(self, builder):
        self.builder = builder          # cuda.core GraphBuilder (None under the simulator)
        self.launches = []
        self.blocks = []
        self.free = {}

    def numba_stream(self):
        """The capturing stream as a numba stream (for numba's own copies)."""
        return numba_cuda.external_stream(int(self.builder.stream.handle))

    def hold(self, block):
        if self not in block.holders:
            block.holders.add(self)
            self.blocks.append(block)

    def released(self, block):
        self.free.setdefault(block.nbytes, []).append(block)

    def reuse(self, nbytes):
        blocks = self.free.get(nbytes)
        return blocks.pop() if blocks else None

    def use(self, args):
        """A captured launch reads and writes ``args``: hold each pool block among them."""
        pool = _pool
        for a in args:
            if a.__class__ is tuple:
                self.use(a)
            elif hasattr(a, "device_ctypes_pointer") and pool is not None and \
                    not SIMULATOR:
                block = pool.block_at(a.device_ctypes_pointer.value or 0)
                if block is not None:
                    self.hold(block)

    def close(self):
        """Give the blocks back: one that no array views goes to the pool now, one still
        viewed when its last array dies (unless another graph holds it)."""
        for block in self.blocks:
            block.holders.discard(self)
            if not block.holders and not block.alive:
                block.free()
        self.blocks, self.free, self.launches = [], {}, []


def capture_in_progress():
    """The capture that launches go to (a ``_Capture``), or None: kernels/cuda/launch.py
    asks at every launch."""
    return _CAPTURE[0]


def require_eager(what: str) -> None:
    """A RuntimeError if a CUDA graph is being captured: ``what`` (a copy between host and
    device, a synchronization) would run once now instead of at every replay."""
    if _CAPTURE[0] is not None:
        raise RuntimeError(f"numbafuse.cuda.graph: {what} inside a captured function; a CUDA "
                           f"graph replays device work only. Do it outside the function (copy "
                           f"new inputs into the captured arrays before a replay), or run the "
                           f"function eagerly first (warmup) so that one-time uploads happen "
                           f"before the capture")


class CudaGraph:
    """A function's device work, captured once, replayed by :meth:`replay`.

    Made by :func:`graph`. A replay runs the captured kernels on the same memory: the arrays
    the function read (its inputs: copy new values into them first, e.g. with
    ``copy_to_device``), the arrays it wrote (parameters, running statistics, momentum) and
    the arrays it returned (``outputs``, rewritten by each replay). No Python runs during a
    replay, so host-side state the function would have changed (a step counter, a learning
    rate passed as a number) keeps its captured value.
    """

    def __init__(self, capture, executable, outputs):
        self._capture = capture
        self._executable = executable
        self.outputs = outputs
        self.launches = len(capture.launches) if SIMULATOR else None

    def replay(self):
        """Run the captured work once more, in order after the work already issued; returns
        :attr:`outputs` (the same arrays each time)."""
        capture = self._capture
        if capture is None:
            raise RuntimeError("numbafuse.cuda.graph: replay of a closed graph")
        if SIMULATOR:
            for run in capture.launches:
                run()
        else:
            self._executable.launch(_the_pool().stream)
        return self.outputs

    def close(self):
        """Release the graph and the memory it held (safe after replays still in flight:
        the memory goes back in the legacy stream's order)."""
        if self._capture is not None:
            if self._executable is not None:
                self._executable.close()
            self._capture.close()
            self._capture = self._executable = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:     # at interpreter exit the driver may be gone
            pass


def graph(fn, *args, warmup=2, **kwargs):
    """Capture the device work of ``fn(*args, **kwargs)`` in a CUDA graph; a
    :class:`CudaGraph` replays it.

    ``fn`` first runs ``warmup`` times eagerly (compilation, one-time uploads, the
    optimizer's momentum buffers), then once under capture: its kernels are recorded, not
    run, so its returned arrays (``CudaGraph.outputs``) hold the first replay's values only
    after :meth:`CudaGraph.replay`. Inside the captured call a copy between host and device
    raises a RuntimeError (it would happen once, not at each replay); so does a labels check
    that needs the host: cross-entropy then skips its bad-label check, and a bad label gives
    a NaN loss instead of a ValueError.

    Memory: the graph holds every pool block its kernels use until it is closed; blocks
    freed during the capture serve later requests of the same capture.

    On a GPU the capture goes through cuda.core's stream capture (relaxed mode) on a stream of
    its own; replays run on the legacy default stream, in order with numbafuse's other work.
    Under the CUDA simulator the launches are recorded and replayed one by one.

    Example (a training step; ``xb``, ``yb`` device arrays that each step's data is copied
    into)::

        step = numbafuse.cuda.graph(train_step, model, opt, xb, yb)
        for images, labels in batches:
            xb.copy_to_device(images); yb.copy_to_device(labels)
            loss = step.replay()[0]
    """
    if warmup < 0:
        raise ValueError(f"numbafuse.cuda.graph: warmup must be >= 0, got {warmup}")
    if _CAPTURE[0] is not None:
        raise RuntimeError("numbafuse.cuda.graph: a capture is already in progress (graphs "
                           "do not nest)")
    for _ in range(warmup):
        fn(*args, **kwargs)
    _the_pool()
    builder = None
    if not SIMULATOR:
        numba_cuda.synchronize()          # an error of the warm-up surfaces here, not later
        from cuda.core import Device
        device = Device(numba_cuda.get_current_device().id)
        device.set_current()
        builder = device.create_graph_builder()
        builder.begin_building("relaxed")
    capture = _CAPTURE[0] = _Capture(builder)
    try:
        outputs = fn(*args, **kwargs)
    except BaseException:
        _CAPTURE[0] = None
        _abandon(builder)
        capture.close()
        raise
    _CAPTURE[0] = None
    executable = None
    if builder is not None:
        builder.end_building()
        executable = builder.complete()
        executable.upload(_the_pool().stream)
        builder.close()
    return CudaGraph(capture, executable, outputs)


def _abandon(builder):
    """End a capture that failed, whatever state it is in (an invalidated capture refuses
    ``end_building``: it is ended through the driver)."""
    if builder is None:
        return
    try:
        builder.end_building()
    except Exception:
        from cuda.bindings import driver
        err, g = driver.cuStreamEndCapture(driver.CUstream(int(builder.stream.handle)))
        if err == driver.CUresult.CUDA_SUCCESS and g is not None and int(g):
            driver.cuGraphDestroy(g)
    try:
        builder.close()
    except Exception:
        pass
