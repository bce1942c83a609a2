"""Which NumPy and numba-cuda pairs the CUDA backend can run with (see ``numbafuse.cuda``'s
docstring, "NumPy 2.5"): checked before ``numba.cuda`` is imported."""
from __future__ import annotations

import inspect
import threading
import types
from importlib import metadata

import numpy as np

SUPPORTED_NUMBA_CUDA = ">=0.20, tested 0.30.4"
NUMPY_WITHOUT_ROW_STACK = (2, 5)
# No numba-cuda release works with NumPy >= 2.5 yet; the first that does goes here.
FIRST_NUMBA_CUDA_WITH_NUMPY_25 = None


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def compatibility_error(numpy_version: str, numba_cuda_version: str | None) -> str | None:
    """Why this NumPy / numba-cuda pair cannot compile CUDA kernels, or None if it can."""
    if _version_tuple(numpy_version)[:2] < NUMPY_WITHOUT_ROW_STACK:
        return None
    if numba_cuda_version is not None and FIRST_NUMBA_CUDA_WITH_NUMPY_25 is not None and \
            _version_tuple(numba_cuda_version) >= _version_tuple(FIRST_NUMBA_CUDA_WITH_NUMPY_25):
        return None
    return (f"numbafuse: the CUDA backend cannot run with NumPy {numpy_version} and numba-cuda "
            f"{numba_cuda_version or '(version unknown)'}: NumPy 2.5 removed np.row_stack, "
            f"which numba-cuda 0.30 (in maintenance mode) still registers, so every kernel "
            f"compilation fails. Install NumPy < 2.5 in this environment: "
            f"pip install 'numpy<2.5' (or reinstall with pip install 'numbafuse[cuda]', "
            f"which pins it). The CPU path is unaffected.")


def _numba_cuda_version() -> str | None:
    try:
        return metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return None


def require_compatible(numpy_version: str | None = None,
                       numba_cuda_version: str | None = None) -> None:
    """Raise ``RuntimeError`` when the installed NumPy and numba-cuda cannot work together."""
    message = compatibility_error(numpy_version or np.__version__,
                                  numba_cuda_version or _numba_cuda_version())
    if message:
        raise RuntimeError(message)


# numba-cuda's lowering finds the variables assigned once (kept in registers, not stack slots)
# by listing, for every such candidate, every assignment of its block: quadratic in a block's
# length. The conv GEMM kernels' unrolled register tiles make blocks of thousands of
# statements, so that scan was a third of their compilation (conv.gemm_fwd_nchw_32: 24 of 67 s
# under cProfile, numba-cuda 0.30.4). numba's own CPU lowering counts each block's assignments
# once (numba/core/lowering.py in numba 0.68); this is that count, installed on numba-cuda's
# Lower class while its method is still the scanning one (a later numba-cuda that changes it
# keeps its own). The same variables are found, so the same code is generated:
# tests/test_ptx.py compares the PTX both ways.
_SCANNING_LINE = "assign_stmts = self.blocks[defblk].find_insts("
_LOWERING = []                           # numba.cuda.lowering, once speed_up_lowering ran


def _counted_singly_assigned_variable(self):
    from collections import defaultdict

    lowering = _LOWERING[0]
    ir = lowering.ir
    sav = set()
    if not self.func_ir.func_id.is_generator:
        blocks = self.func_ir.blocks
        use_defs = lowering.compute_use_defs(blocks)
        alloca_vars = lowering.must_use_alloca(blocks)
        defined_in = defaultdict(set)
        for blk, names in use_defs.defmap.items():
            for name in names:
                defined_in[name].add(blk)
        used_in = defaultdict(set)
        for blk, names in use_defs.usemap.items():
            for name in names:
                used_in[name].add(blk)
        assignments = {}                 # block label -> {variable name: assignments}
        for label, block in self.blocks.items():
            counts = defaultdict(int)
            for stmt in block.find_insts(ir.assign_types):
                counts[stmt.target.name] += 1
            assignments[label] = counts
        for name, where in defined_in.items():
            if name not in alloca_vars and len(where) == 1 and not used_in[name]:
                [label] = where
                if assignments[label][name] == 1:
                    sav.add(name)
    self._singly_assigned_vars = sav
    self._blk_local_varmap = {}


def _source_has(method, line) -> bool:
    """Whether ``method``'s source (numba-cuda's, before an install here replaced it) has
    ``line``: the installers below replace a method only while it is the one they describe."""
    try:
        return line in inspect.getsource(method)
    except (OSError, TypeError):
        return False


def _replaced(owner, name, replacement, line, kept_as) -> bool:
    """Replace ``owner.name`` (a class of numba-cuda's; None: not there) by ``replacement``
    while its source has ``line``, keeping numba-cuda's method as ``owner.kept_as``; True if
    replaced, now or before."""
    method = getattr(owner, name, None)
    if method is None:
        return False
    if method is replacement:
        return True
    if not _source_has(method, line):
        return False
    setattr(owner, kept_as, method)
    setattr(owner, name, replacement)
    return True


def speed_up_lowering(lowering) -> bool:
    """Install the linear count on ``numba.cuda.lowering.Lower`` (the module is passed: this
    package imports numba.cuda in its ``__init__`` only) if it still scans; True if installed,
    now or before. Not for the simulator, which lowers nothing."""
    _LOWERING[:] = [lowering]        # (read by the count at call time only)
    return _replaced(getattr(lowering, "Lower", None), "_find_singly_assigned_variable",
                     _counted_singly_assigned_variable, _SCANNING_LINE,
                     "_scanning_singly_assigned_variable")    # kept for the PTX comparison


# numba-cuda's simulator runs a block as one Python thread per GPU thread, and its
# BlockManager.run finds out when every live thread waits at a barrier (to release them) or
# has finished by polling all of them in a loop that never sleeps (is_alive() and
# syncthreads_blocked of each, over and over) while the threads wait for the GIL: profiling
# benchmarks/bench_gpu.py --smoke under the simulator (numba-cuda 0.30.4) counted 24 million
# is_alive() calls. speed_up_simulator replaces that loop, and the two places where a thread
# changes state (reaching a barrier, finishing), with a condition variable the block's threads
# notify; the manager sleeps until one does. numba-cuda's rules are kept: a barrier is released
# once every live thread of the block waits at *some* syncthreads() (tests/conftest.py's
# uniform_barriers checks they waited at the same one), and a thread's exception aborts the
# others and is raised by the launch. Installed while numba-cuda's loop is the one described
# (its source is read). The simulator's tests took 785 s in one process instead of 1604
# (machine F), a replayed training step's test 54 s instead of 188.
_POLLING_LINE = "livethreads = set([t for t in livethreads if t.is_alive()])"
_SIMULATOR = []                          # numba.cuda.simulator.kernel, once installed


def _barrier(self):
    """``BlockThread.syncthreads``: wait at a barrier, telling the manager."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    changed = self._manager._changed
    with changed:
        self.syncthreads_blocked = True
        changed.notify()
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _thread_body(run):
    def body(self):
        """``BlockThread.run``: the thread's function, then tell the manager it finished."""
        try:
            run(self)
        finally:
            changed = self._manager._changed
            with changed:
                self._finished = True
                changed.notify()
    return body


def _abort(threads):
    for t in threads:
        t.abort = True
        t.syncthreads_blocked = False
        t.syncthreads_event.set()


# A kernel that reaches no barrier (and no shared array, warp vote or shuffle) has no
# order between its threads to keep: any order of them is one a GPU may run. Such a block
# runs its threads one after another on the launching thread, each under its own
# threadIdx (``threading.current_thread()`` is where the simulator's ``cuda.threadIdx``
# looks), instead of a Python thread each: starting and switching threads was most of the
# simulator's time for the elementwise and batch-norm kernels. What the kernel's code (its
# nested functions, and the device functions and closures it names, followed) could reach is
# read from its bytecode's names: any name with one of these in it keeps the threads.
_THREAD_MARKERS = ("sync", "shared", "shfl", "ballot", "activemask", "lanemask", "match_",
                   "vote", "threadfence")
_SEQUENTIAL = {}                         # kernel function -> runs its blocks sequentially


def _code_names(code, names):
    names.update(code.co_names)
    names.update(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_names(const, names)
    return names


def _python_function(obj):
    fn = getattr(obj, "fn", None) if not isinstance(obj, types.FunctionType) else obj
    return fn if isinstance(fn, types.FunctionType) else None


def _needs_threads(fn, seen) -> bool:
    """Whether ``fn`` (a kernel's or device function's Python function) or anything it names
    may reach a barrier or another block-wide operation (conservatively: by name)."""
    if fn in seen:
        return False
    seen.add(fn)
    names = _code_names(fn.__code__, set())
    if any(marker in name for name in names for marker in _THREAD_MARKERS):
        return True
    reached = [fn.__globals__.get(name) for name in names]
    reached += [cell.cell_contents for cell in fn.__closure__ or ()]   # (empty: raises)
    for obj in list(reached):
        if isinstance(obj, types.ModuleType):          # module.device_function(...)
            reached += [getattr(obj, name, None) for name in names]
    for obj in reached:
        callee = _python_function(obj)
        if callee is not None and _needs_threads(callee, seen):
            return True
    return False


def _sequential(fn) -> bool:
    runs = _SEQUENTIAL.get(fn)
    if runs is None:
        try:
            runs = not _needs_threads(fn, set())
        except Exception:                    # anything unexpected: the threads
            runs = False
        _SEQUENTIAL[fn] = runs
    return runs


def _run_sequentially(self, grid_point, args):
    """One block of a barrier-free kernel, its threads in order on this thread; a thread's
    exception is raised as the simulator's BlockThread words it."""
    Dim3 = _SIMULATOR[0].Dim3
    here = threading.current_thread()
    kept = {name: here.__dict__[name] for name in ("blockIdx", "threadIdx", "thread_id")
            if name in here.__dict__}
    bx, by, bz = self._block_dim
    here.blockIdx = Dim3(*grid_point)
    try:
        for block_point in np.ndindex(*self._block_dim):
            x, y, z = block_point
            here.threadIdx = Dim3(x, y, z)
            here.thread_id = x + bx * (y + by * z)
            try:
                self._f(*args)
            except Exception as e:
                tid, ctaid = f"tid={list(block_point)}", f"ctaid={list(grid_point)}"
                msg = f"{tid} {ctaid}" if str(e) == "" else f"{tid} {ctaid}: {e}"
                raise type(e)(msg).with_traceback(e.__traceback__) from None
    finally:
        for name in ("blockIdx", "threadIdx", "thread_id"):
            here.__dict__.pop(name, None)
        here.__dict__.update(kept)


def _run_block(self, grid_point, *args):
    """``BlockManager.run``: one block, its threads' barriers released as they all arrive
    (a barrier-free kernel's threads one after another: :func:`_sequential`)."""
    if not self._debug and _sequential(self._f):
        return _run_sequentially(self, grid_point, args)
    BlockThread = _SIMULATOR[0].BlockThread
    self._changed = threading.Condition()
    threads = []
    for block_point in np.ndindex(*self._block_dim):
        def target():
            self._f(*args)
        t = BlockThread(target, self, grid_point, block_point, self._debug)
        t._finished = False
        threads.append(t)
    for t in threads:
        t.start()
    live = threads
    with self._changed:
        while live:
            for t in live:
                if t.exception:
                    _abort(threads)
                    raise t.exception[0].with_traceback(t.exception[1])
            live = [t for t in live if not t._finished]
            if live and all(t.syncthreads_blocked for t in live):
                for t in live:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
            elif live:
                self._changed.wait()
    for t in threads:
        t.join()
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def speed_up_simulator(kernel) -> bool:
    """Install :func:`_run_block` on ``numba.cuda.simulator.kernel`` (the module is passed,
    as for :func:`speed_up_lowering`) if its ``BlockManager.run`` still polls; True if
    installed, now or before. numba-cuda's own methods are kept as ``_polling_*``."""
    manager = getattr(kernel, "BlockManager", None)
    if manager is None or not hasattr(kernel, "BlockThread"):
        return False
    if manager.run is _run_block:
        return True
    if not _source_has(manager.run, _POLLING_LINE):
        return False
    _SIMULATOR[:] = [kernel]
    thread = kernel.BlockThread
    manager._polling_run = manager.run
    thread._polling_syncthreads, thread._polling_body = thread.syncthreads, thread.run
    manager.run = _run_block
    thread.syncthreads = _barrier
    thread.run = _thread_body(thread.run)
    return True


# numba-cuda's simulator finds a block's shared array by its line (FakeCUDAShared.array):
# it looks the line up in the launch's allocations and, missing, makes the array and stores
# it, with no lock between the look-up and the store. A thread switch between them (Python
# may switch after any bytecode; the block's threads all reach the line together) gives two
# threads arrays of their own, so a reduction through shared memory sums part of the block.
# The one cause found for tests/cuda/test_graph_cuda.py's fit test failing once in CI (a loss
# 0.98053 against 0.98316; it passed alone, 30 of 30 times) and in one of ten runs here under
# sys.setswitchinterval(1e-6). _shared_array is the same look-up under a lock, the caller's
# line read from its frame (numba-cuda reads it from a traceback of the whole stack);
# installed while FakeCUDAShared.array is the unlocked one. tests/cuda/
# test_simulator_blocks_cuda.py forces the switch: numba-cuda's method loses values there.
_UNLOCKED_LINE = "res = self._allocations.get(caller)"
_SHARED_LOCK = threading.Lock()
_SIMULATOR_API = []                      # numba.cuda.simulator.kernelapi, lock_shared_arrays's


def _shared_array(self, shape, dtype, alignment=None):
    """``FakeCUDAShared.array``: the block's array made at the caller's line, made once."""
    import sys
    if alignment is not None or shape == 0:       # refused / the dynamic array: no look-up
        return self._unlocked_array(shape, dtype, alignment)
    api = _SIMULATOR_API[0]
    if isinstance(dtype, api.types.Type):         # as numba-cuda converts it
        dtype = api.numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    with _SHARED_LOCK:
        array = self._allocations.get(caller)
        if array is None:
            array = self._allocations[caller] = np.empty(shape, dtype)
    return array


def lock_shared_arrays(kernelapi) -> bool:
    """Install :func:`_shared_array` on ``numba.cuda.simulator.kernelapi.FakeCUDAShared``
    (the module is passed) if its ``array`` is still the unlocked look-up; True if installed,
    now or before. numba-cuda's own method is kept as ``_unlocked_array``."""
    _SIMULATOR_API[:] = [kernelapi]  # (read by _shared_array at call time only)
    return _replaced(getattr(kernelapi, "FakeCUDAShared", None), "array", _shared_array,
                     _UNLOCKED_LINE, "_unlocked_array")
