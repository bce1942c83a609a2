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
call) and sleep on a condition variable between calls (no spinning: the neighbours keep their
cores). Reductions write one partial per task (or per fixed group of tasks) and sum them in a
fixed order afterwards, so results do not depend on the thread count or on which thread ran
which task. GEMMs inside tasks call numbafuse's private single-threaded BLAS (``_blas.py``).

Fork: the helpers do not exist in a forked child; an ``os.register_at_fork`` hook forgets the
pool there and the child starts its own on its first parallel call. Threads: calls from several
Python threads are safe; one call at a time uses the helpers, a concurrent call runs its tasks
on its own thread (the same tasks, so the same results).

Threads used: ``NUMBAFUSE_NUM_THREADS`` if set, else the CPUs this process may run on;
:func:`set_num_threads` changes it at run time.
"""
import os
import threading

from numba import njit

# Below this many elements touched, a call runs on the calling thread only: waking a helper
# costs ~20-60 us, more than a small pass takes.
PARALLEL_MIN_ELEMENTS = 1 << 16
# Task ranges handed out per thread and call: more ranges balance better (a core taken by
# another process delays only a small range), but each range costs a dispatch (~5-20 us).
RANGES_PER_THREAD = 16
# ... and no range smaller than this many elements touched (when the caller says how many).
MIN_RANGE_ELEMENTS = 1 << 16


def _default_threads():
    env = os.environ.get("NUMBAFUSE_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                      # not on Linux
        return max(1, os.cpu_count() or 1)


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


class _Job:
    """One call's tasks [0, ntasks), handed out in ranges of ``grain`` tasks."""

    def __init__(self, kernel, ntasks, grain, args):
        self.kernel, self.ntasks, self.grain, self.args = kernel, ntasks, grain, args
        self.next = 0
        self.active = 0                          # helpers working on this job
        self.error = None
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)

    def _grab(self):
        with self.lock:
            t0 = self.next
            if t0 >= self.ntasks or self.error is not None:
                return None
            self.next = min(self.ntasks, t0 + self.grain)
            return t0, self.next

    def work(self):
        """Run ranges until none is left; the first error stops the job."""
        while True:
            r = self._grab()
            if r is None:
                return
            try:
                self.kernel(r[0], r[1], *self.args)
            except BaseException as e:          # re-raised on the calling thread
                with self.lock:
                    if self.error is None:
                        self.error = e
                return

    def join_as_helper(self):
        with self.lock:
            if self.next >= self.ntasks:
                return False
            self.active += 1
        try:
            self.work()
        finally:
            with self.lock:
                self.active -= 1
                if self.active == 0:
                    self.idle.notify_all()
        return True

    def wait_helpers(self):
        with self.lock:
            while self.active:
                self.idle.wait()


class _Pool:
    def __init__(self, helpers):
        self.helpers = helpers
        self.busy = threading.Lock()             # held by the call using the helpers
        self.cv = threading.Condition()
        self.job = None
        self.generation = 0
        self.closed = False
        self.threads = [threading.Thread(target=self._helper, name=f"numbafuse-{i}",
                                         daemon=True) for i in range(helpers)]
        for t in self.threads:
            t.start()

    def _helper(self):
        seen = 0
        while True:
            with self.cv:
                while self.generation == seen and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                seen, job = self.generation, self.job
            job.join_as_helper()

    def run(self, job):
        with self.cv:
            self.job = job
            self.generation += 1
            self.cv.notify_all()
        job.work()
        job.wait_helpers()

    def shutdown(self):
        with self.cv:
            self.closed = True
            self.cv.notify_all()


_pool = None
_pool_lock = threading.Lock()


def _get_pool():
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool(_num_threads - 1)
        return _pool


def _forget_pool_after_fork():
    # In a forked child the helper threads are gone, and a lock may have been held by a thread
    # of the parent: start afresh.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def launch(kernel, ntasks, *args, work=None, grain=None):
    """Run ``kernel(t0, t1, *args)`` over the tasks ``[0, ntasks)``; ``work`` (elements
    touched) below ``PARALLEL_MIN_ELEMENTS`` or a single thread: one call on this thread.
    ``grain``: tasks per range handed out (default: from RANGES_PER_THREAD and
    MIN_RANGE_ELEMENTS)."""
    ntasks = int(ntasks)
    if ntasks <= 0:
        return
    threads = _num_threads
    if threads == 1 or ntasks == 1 or (work is not None and work < PARALLEL_MIN_ELEMENTS):
        kernel(0, ntasks, *args)
        return
    if grain is None:
        grain = ntasks // (threads * RANGES_PER_THREAD)
        if work is not None:
            grain = max(grain, -(-ntasks * MIN_RANGE_ELEMENTS // max(int(work), 1)))
    grain = max(1, min(int(grain), -(-ntasks // threads)))
    job = _Job(kernel, ntasks, grain, args)
    pool = _get_pool()
    if not pool.busy.acquire(blocking=False):   # another thread's call has the helpers
        job.work()
    else:
        try:
            pool.run(job)
        finally:
            pool.busy.release()
    if job.error is not None:
        raise job.error


def concurrently(*calls, work=None):
    """Run the argument-less callables ``calls`` at once, each whole on one thread: one job
    whose tasks are the calls, so each call's own launches find the helpers busy and run on its
    thread (the same tasks, so the same results). For independent passes too short to gain
    from splitting, where waking a helper per launch costs what the split saves (a conv
    backward's dX and dW at 8x8 images). ``work`` as for :func:`launch`. Returns the calls'
    results in order."""
    results = [None] * len(calls)

    def task(t0, t1):
        for t in range(t0, t1):
            results[t] = calls[t]()
    launch(task, len(calls), work=work, grain=1)
    return results


def blocks(n, block):
    """Number of blocks of ``block`` items covering ``n`` items."""
    return -(-int(n) // int(block))
