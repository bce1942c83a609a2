"""numbafuse's own CPU thread pool: task kernels run on plain Python threads, GIL released.

Why not Numba's ``prange``: its threading layer is process-wide and each choice hurts someone
(measured on the 2-core CI machine, see docs/threading.md). GNU OpenMP (``omp``, the layer
Numba picks without tbb) kills a ``fork``ed child ("fork() called from a process already using
GNU OpenMP"), spins between parallel regions (slowing PyTorch's own OpenMP pool beside it, and
being slowed 4x by PyTorch's when torch was imported first) unless ``OMP_WAIT_POLICY`` is set
for the whole process; ``workqueue`` aborts on concurrent calls from two Python threads; ``tbb``
needs a wheel and is still one pool for the whole process. And a ``prange`` body cannot call
a single-threaded GEMM per chunk (the BLAS keeps its own pool).

So numbafuse parallelises itself. A *task kernel* is an ``@njit(nogil=True)`` function whose
first two arguments are a task range ``t0, t1``: it does tasks ``t0 <= t < t1`` of a fixed
partition (a function of the shapes only). :func:`launch` runs the tasks of one call on the
calling thread and ``num_threads() - 1`` helper threads, which take ranges of tasks from a
shared counter (dynamic scheduling, so a core taken by another process does not stall the
call). Reductions write one partial per task (or per fixed group of tasks) and sum them in a
fixed order afterwards, so results do not depend on the thread count or on which thread ran
which task. GEMMs inside tasks call numbafuse's private single-threaded BLAS (``_blas.py``).

Between calls a helper first *parks*: for ``SPIN_NS`` (200 us) it watches an atomic
generation counter in compiled code, GIL released, then it sleeps on a condition variable
(no core is held longer: the neighbours keep theirs). The launching thread likewise watches
the helpers' park slots at the end of a call before it sleeps on the job's condition. Why:
on the 2-core VM a sleeping thread woken by a futex (a condition variable, or the GIL) starts
~70-90 us later, a fifth of a 0.4 ms pass, twice per launch for a pool that sleeps; the launches
of a forward or backward come ~60-200 us apart. Parked, a helper starts ~15-25 us after the
launch (the caller publishes the call right before it enters its own first range, where it
releases the GIL, and the helper waits ``LATE_NS`` after it sees the call before it takes the
GIL: asking while the caller holds it puts the helper to sleep on the GIL), and the caller
returns ~10-20 us after the last range instead of up to ~60.
Measured with ``benchmarks/bench_batchnorm_add_relu.py``, fwd+bwd of (32,64,32,32),
alternating with helpers that sleep: 2.62-3.58 ms against 3.80-4.40, and the fused digits
training step 26-27% faster (docs/threading.md, "Waking the helpers: parking"). The cost: up
to SPIN_NS of one core's time after each call (CPU time per fused training step 3% and 14%
higher in two A/B runs). ``NUMBAFUSE_SPIN_US=0`` turns
parking off (every wait sleeps at once); without ``clock_gettime`` (not Linux), or with more
threads than CPUs, it is off.

Fork: the helpers do not exist in a forked child; an ``os.register_at_fork`` hook forgets the
pool there and the child starts its own on its first parallel call. Threads: calls from several
Python threads are safe; one call at a time uses the helpers, a concurrent call runs its tasks
on its own thread (the same tasks, so the same results).

Beside PyTorch: once ``torch`` is imported and its GNU OpenMP runtime is loaded, a call runs
on *PyTorch's* OpenMP team instead (``GOMP_parallel`` of that runtime, each team thread
taking ranges as a helper does; ``cpu.team.OpenMPTeam``). libgomp's workers spin for some
milliseconds after every parallel region (PyTorch does not set ``OMP_WAIT_POLICY``; measured
here: ~7 ms of a core after each torch conv), so with a pool of its own numbafuse's next call
shares its cores with spinning threads: a numbafuse conv forward called between PyTorch calls
takes 10.2 ms against 8.0 alone. On PyTorch's team those spinning workers are the ones that
take the ranges: 8.2 ms (docs/threading.md). The team has ``min(num_threads(), torch's OpenMP
threads)`` threads; with PyTorch on one thread (no workers to spin) or
``NUMBAFUSE_SHARE_TORCH_TEAM=0``, or in a forked child (libgomp's team does not survive
``fork``), numbafuse keeps its own pool.
The same tasks run either way, so the results are bitwise the same.

Compiled launches (``cpu.native``, ``NUMBAFUSE_NATIVE_LAUNCH=0`` turns them off): a launch
of a task kernel (a Numba dispatcher) is one dispatch of ``native.enter``, which runs the
ranges on every thread in compiled code (the kernel's native function called by address),
on PyTorch's team (``GOMP_parallel`` called from compiled code) and on the own pool (helpers
join through a shared int64 flag, and serve consecutive compiled launches without Python).
The Python job below remains for callables that are not dispatchers (``launch_all``,
``concurrently``), kernels returning a value, a call while another holds the threads, and
the first launch of an argument-type tuple whose entry ``first_calls`` is still compiling.

Threads used: ``NUMBAFUSE_NUM_THREADS`` if set, else the CPUs this process may run on;
:func:`set_num_threads` changes it at run time.
"""
import os
import sys
import threading

import numpy as np
from numba import njit
from numba.core.dispatcher import Dispatcher

from . import native
from . import recorded as _recorded

from .sync import CLOCK as _CLOCK
from .sync import SLOT as _SLOT
from .sync import await_parked as _await_parked
from .sync import park as _park
from .sync import publish as _publish
from .team import find_torch_team

# Below this many elements touched, a call runs on the calling thread only: waking a helper
# costs ~20-60 us, more than a small pass takes.
PARALLEL_MIN_ELEMENTS = 1 << 16
# Task ranges handed out per thread and call: more ranges balance better (a core taken by
# another process delays only a small range), but each range costs a dispatch from Python
# (~4 us measured: 64 ranges of a 56 us task took 2.31 ms, 2 ranges 2.07) and each return to
# Python may wait for the GIL. 16 ranges a thread and 64 Ki elements at least cost batch
# norm's fwd+bwd ~15% (0.4-0.7 ms of 3.5-4.5); 4 and 256 Ki: a late core delays 1/8 of a pass.
RANGES_PER_THREAD = 4
# ... and no range smaller than this many elements touched (when the caller says how many).
MIN_RANGE_ELEMENTS = 1 << 18
# How long a helper parks (watches for the next call, compiled, GIL released) before it sleeps,
# and the launching thread watches for the helpers at the end of a call; 0: never (module
# docstring). NUMBAFUSE_SPIN_US sets it in microseconds.
SPIN_NS = int(float(os.environ.get("NUMBAFUSE_SPIN_US", "200")) * 1000)
# A parked helper's wait from seeing a call to asking for the GIL (module docstring).
LATE_NS = 10_000


def _usable_cpus():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                      # not on Linux
        return max(1, os.cpu_count() or 1)


_CPUS = _usable_cpus()


def _default_threads():
    env = os.environ.get("NUMBAFUSE_NUM_THREADS")
    return max(1, int(env)) if env else _CPUS


_num_threads = _default_threads()


def num_threads():
    """Threads numbafuse's CPU kernels use (the caller's thread included)."""
    return _num_threads


def set_num_threads(n):
    """Use ``n >= 1`` threads from the next call on (results do not depend on it)."""
    global _num_threads, _pool
    n = int(n)
    if n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
    with _pool_lock:
        if _pool is not None and _pool.helpers != n - 1:
            _pool.shutdown()
            _pool = None
        _num_threads = n


def task_kernel(fn=None, **options):
    """Decorator: ``fn(t0, t1, *args)`` compiled with ``njit(nogil=True, cache=True)``."""
    if fn is None:
        return lambda f: task_kernel(f, **options)
    return njit(nogil=True, cache=True, **options)(fn)


# --------------------------------------------------------------------------- spinning

def _spinning():
    """Whether threads park before they sleep: SPIN_NS > 0, a clock, and no more threads than
    CPUs this process may run on (oversubscribed, a parked thread takes the CPU that another
    of the pool's threads needs: BN fwd+bwd at (32,64,32,32) on 4 threads and 2 CPUs took 4.26
    ms parking against 3.61 sleeping)."""
    return SPIN_NS > 0 and _CLOCK != 0 and _num_threads <= _CPUS


# --------------------------------------------------------------------------- jobs and pool

class _Job:
    """One call's tasks [0, ntasks), handed out in ranges of ``grain`` tasks."""

    def __init__(self, kernel, ntasks, grain, args):
        self.kernel, self.ntasks, self.grain, self.args = kernel, ntasks, grain, args
        self.next = 0
        self.active = 0                          # helpers working on this job
        self.joined = []                         # their flag slots
        self.error = None
        self.caller = None                       # the launching thread's id (on a team)
        self.lock = threading.Lock()
        self.idle = None                         # a Condition, made once someone sleeps on it
        self.exhausted = None                    # called once the last range is handed out

    def _grab(self):
        with self.lock:
            t0 = self.next
            if t0 >= self.ntasks or self.error is not None:
                return None
            self.next = min(self.ntasks, t0 + self.grain)
            if self.next >= self.ntasks and self.exhausted is not None:
                self.exhausted()
            return t0, self.next

    def work(self, before_first=None):
        """Run ranges until none is left; the first error stops the job. ``before_first()``
        runs right before the first range (or the return, when there is none)."""
        while True:
            r = self._grab()
            if before_first is not None:
                before_first()
                before_first = None
            if r is None:
                return
            try:
                self.kernel(r[0], r[1], *self.args)
            except BaseException as e:          # re-raised on the calling thread
                with self.lock:
                    if self.error is None:
                        self.error = e
                return

    def join_as_helper(self, slot, generation=None):
        with self.lock:
            if self.next >= self.ntasks:         # (final once the caller's work() is done)
                return False
            self.active += 1
            self.joined.append(slot)
        try:
            self.work()
        finally:
            with self.lock:
                self.active -= 1
                if self.active == 0 and self.idle is not None:
                    self.idle.notify_all()
        return True

    def wait_helpers(self):
        with self.lock:
            if self.active and self.idle is None:
                self.idle = threading.Condition(self.lock)
            while self.active:
                self.idle.wait()


class _NativeJob:
    """What a pool's helper joins for a compiled launch: the ranges of the launch open in
    ``flag``, if it still is (``native.join``, GIL released)."""

    def __init__(self, flag):
        self.flag = flag

    def join_as_helper(self, slot, generation):
        return native.join(self.flag, generation)


class _Pool:
    def __init__(self, helpers):
        self.helpers = helpers
        self.cv = threading.Condition()
        self.job = None
        self.generation = 0
        self.closed = False
        # flag[0]: the generation (for spinning helpers); flag[(i + 1) * _SLOT]: the last
        # generation helper i finished and is parked after
        self.flag = np.zeros((helpers + 1) * _SLOT, np.int64)
        # a compiled launch's (cpu.native): the record helpers join, the ranges' counter
        self.native = _NativeJob(native.pool_flag())
        self.state = np.zeros(native.STATE_SIZE, np.int64)
        # the helpers' compiled code loaded here, before they start: a helper loading it
        # itself (tens of ms with the cache, the GIL taken by turns) missed the first launches
        if NATIVE:
            native.join(self.native.flag, 0)      # (no launch open: returns)
        if _spinning():
            _park(self.flag, 0, 0, _CLOCK, 0, 0)  # (generation 0: returns)
            if NATIVE:
                native.serve(self.flag, self.native.flag, 0, 0, _CLOCK, 0)     # (returns)
        self.threads = [threading.Thread(target=self._helper, args=((i + 1) * _SLOT,),
                                         name=f"numbafuse-{i}", daemon=True)
                        for i in range(helpers)]
        for t in self.threads:
            t.start()

    def _helper(self, slot):
        seen, parked = 0, False
        while True:
            if _spinning() and not parked:       # the next job often comes within microseconds
                _park(self.flag, seen, slot, _CLOCK, SPIN_NS, LATE_NS)
            with self.cv:
                while self.generation == seen and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                seen, job = self.generation, self.job
            parked = job is self.native and _spinning()
            if parked:                           # compiled launches, one after another, and
                seen = native.serve(self.flag, job.flag, seen, slot, _CLOCK, SPIN_NS)   # park
            else:
                job.join_as_helper(slot, seen)

    def run(self, job):
        with self.cv:
            self.job = job
            self.generation += 1
            self.cv.notify_all()
            gen = self.generation
        # parked helpers see the job once this thread is about to release the GIL (entering
        # its first range), so that they seldom ask for the GIL while it is held
        job.work(before_first=lambda: _publish(self.flag, gen))
        if job.joined and _spinning():          # helpers park within microseconds of the end
            _await_parked(self.flag, np.array(job.joined, np.int64), gen, _CLOCK, SPIN_NS)
        job.wait_helpers()

    def run_native(self, kaddr, ntasks, grain, args):
        """A compiled launch (``cpu.native``): the helpers, woken as for a job, join it in
        compiled code; it returns once every helper that joined has finished."""
        flag = self.native.flag
        with self.cv:
            self.job = self.native
            self.generation += 1
            self.cv.notify_all()
            gen = flag[native.NEXT] = self.generation
        try:
            _publish(self.flag, gen)
            return native.enter(kaddr, 0, 0, flag, self.state, ntasks, grain, *args)
        finally:
            if flag[native.SEQUENCE] < gen:       # (raised before it opened: helpers go)
                _publish(flag[native.SEQUENCE:], gen)

    def shutdown(self):
        with self.cv:
            self.closed = True
            self.generation += 1
            _publish(self.flag, self.generation)
            self.cv.notify_all()


# --------------------------------------------------------------------------- PyTorch's team

SHARE_TORCH_TEAM = os.environ.get("NUMBAFUSE_SHARE_TORCH_TEAM", "1") != "0"
# A launch of a task kernel runs as compiled code on every thread (``cpu.native``), on
# PyTorch's team and on the own pool; 0: through the Python job below (NUMBAFUSE_NATIVE_LAUNCH).
NATIVE = os.environ.get("NUMBAFUSE_NATIVE_LAUNCH", "1") != "0"
# Single-thread launches ready ``cpu.native``'s entry too (the compiling process of
# ``first_calls`` and ``numbafuse.precompile``: what a team's launch will load).
NATIVE_WARM = os.environ.get("NUMBAFUSE_NATIVE_WARM", "0") == "1"


_team_for = None           # the torch module _team was looked up for
_team = None
_forked = False


def torch_team():
    """PyTorch's OpenMP team when numbafuse's calls run on it (module docstring), else None."""
    global _team_for, _team
    if not SHARE_TORCH_TEAM or _forked:
        return None
    torch = sys.modules.get("torch")
    if torch is not _team_for:
        _team_for, _team = torch, (None if torch is None else find_torch_team(torch))
    return _team


def _usable_team(threads):
    """(PyTorch's team, its size) for a call on ``threads`` threads, or (None, ``threads``)
    when the call uses numbafuse's own pool: no team, or a team of one (PyTorch on one
    thread: nothing spins)."""
    team = torch_team()
    if team is not None:
        size = min(threads, team.threads())
        if size > 1:
            return team, size
    return None, threads


def backend():
    """Where the next parallel call runs: ``"torch-openmp"`` or ``"own-pool"``."""
    team, _ = _usable_team(_num_threads)
    return "own-pool" if team is None else "torch-openmp"


_pool = None
_pool_lock = threading.Lock()
_busy = threading.Lock()   # held by the call using the helpers (or PyTorch's team)


def _get_pool():
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool(_num_threads - 1)
        return _pool


def _forget_pool_after_fork():
    # In a forked child the helper threads are gone, and a lock may have been held by a thread
    # of the parent: start afresh.
    global _pool, _pool_lock, _busy, _forked
    _pool, _pool_lock, _busy, _forked = None, threading.Lock(), threading.Lock(), True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def launch(kernel, ntasks, *args, work=None, grain=None, parallel_min=None):
    """Run ``kernel(t0, t1, *args)`` over the tasks ``[0, ntasks)``; ``work`` (elements
    touched) below ``parallel_min`` (default ``PARALLEL_MIN_ELEMENTS``; a kernel whose
    elements cost more or less than a pass's says so) or a single thread: one call on this
    thread. ``grain``: tasks per range handed out (default: from RANGES_PER_THREAD and
    MIN_RANGE_ELEMENTS), at most a thread's share. (Recorded for a prepared call while one
    is recorded: ``recorded.py``.)"""
    if _recorded.ACTIVE:
        return _recorded.recorded(_launch, kernel, ntasks, *args, work=work, grain=grain,
                                  parallel_min=parallel_min)
    return _launch(kernel, ntasks, *args, work=work, grain=grain, parallel_min=parallel_min)


def _launch(kernel, ntasks, *args, work=None, grain=None, parallel_min=None):
    ntasks = int(ntasks)
    if ntasks <= 0:
        return
    threads = _num_threads
    least = PARALLEL_MIN_ELEMENTS if parallel_min is None else parallel_min
    if threads == 1 or ntasks == 1 or (work is not None and work < least):
        if NATIVE_WARM and isinstance(kernel, Dispatcher):
            native.address(kernel, args)         # (compiles what a team's launch would)
        kernel(0, ntasks, *args)
        return
    team, threads = _usable_team(threads)
    if grain is None:
        grain = ntasks // (threads * RANGES_PER_THREAD)
        if work is not None:
            grain = max(grain, -(-ntasks * MIN_RANGE_ELEMENTS // max(int(work), 1)))
    grain = max(1, min(int(grain), -(-ntasks // threads)))
    if NATIVE and isinstance(kernel, Dispatcher) and not _busy.locked():
        # (not while another call, or first_calls' probe, holds the threads: address() may
        # hand a compilation to first_calls, whose probe takes _busy)
        kaddr = native.address(kernel, args)
        if kaddr and _busy.acquire(blocking=False):
            try:
                failed = (_get_pool().run_native(kaddr, ntasks, grain, args) if team is None
                          else team.run_native(kaddr, threads, ntasks, grain, args))
            finally:
                _busy.release()
            if failed:                           # the kernel's error, with its message
                kernel(0, ntasks, *args)
                raise RuntimeError(f"launch: {kernel.__name__} failed in a compiled launch "
                                   "and not when run again on this thread")
            return
    job = _Job(kernel, ntasks, grain, args)
    if not _busy.acquire(blocking=False):       # another thread's call has the helpers
        job.work()
    else:
        try:
            if team is not None:
                team.run(job, threads, _CLOCK if SPIN_NS > 0 else 0, SPIN_NS, LATE_NS)
            else:
                _get_pool().run(job)
        finally:
            _busy.release()
    # the pool (and a helper back from it) keep the last job: drop what it references, so
    # that the arrays of a finished call (its output among them) are released with the
    # caller's (cpu.buffers.OutputCache reuses a buffer only when nothing views it). A late
    # helper finds no task left and touches neither.
    job.kernel = job.args = None
    if job.error is not None:
        raise job.error


def launch_all(launches, work=None):
    """Run several launches, each ``(kernel, ntasks, args)``, as one job: their tasks in one
    list (the first launch's, then the next's...), each range handed to whichever thread asks
    first (ranges of one task on the pool; on one thread, each launch whole). For independent
    passes that are each too short to split well, such as a small conv backward's dX and dW:
    both threads share all their tasks, instead of one pass per thread (:func:`concurrently`:
    the longer pass decides, and each thread's Python between its launches waits for the GIL).
    The same tasks as separate launches, so the same results. ``work`` as for :func:`launch`."""
    if _recorded.ACTIVE:
        return _recorded.recorded(_launch_all, launches, work=work)
    return _launch_all(launches, work)


def _launch_all(launches, work=None):
    launches = [(k, int(n), tuple(a)) for k, n, a in launches if int(n) > 0]
    starts = [0]
    for _, n, _ in launches:
        starts.append(starts[-1] + n)

    def kernel(t0, t1):
        for i, (k, n, args) in enumerate(launches):    # the launches overlapping [t0, t1)
            lo, hi = max(t0, starts[i]), min(t1, starts[i + 1])
            if lo < hi:
                k(lo - starts[i], hi - starts[i], *args)
    launch(kernel, starts[-1], work=work, grain=1)


def concurrently(*calls, work=None):
    """Run the argument-less callables ``calls`` at once, each whole on one thread: one job
    whose tasks are the calls, so each call's own launches find the helpers busy and run on its
    thread (the same tasks, so the same results). For independent passes too short to gain
    from splitting, where waking a helper per launch costs what the split saves (a conv
    backward's dX and dW at 8x8 images). ``work`` as for :func:`launch`. Returns the calls'
    results in order."""
    if _recorded.ACTIVE and _recorded.outermost():
        # recorded for a prepared call: one call after another, each launch recorded (the
        # same tasks, so the same results; the replay runs them so)
        return [call() for call in calls]
    return _concurrently(calls, work)


def _concurrently(calls, work=None):
    results = [None] * len(calls)

    def task(t0, t1):
        for t in range(t0, t1):
            results[t] = calls[t]()
    launch(task, len(calls), work=work, grain=1)
    return results


def blocks(n, block):
    """Number of blocks of ``block`` items covering ``n`` items."""
    return -(-int(n) // int(block))
