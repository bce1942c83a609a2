"""First calls while Numba compiles: NumPy serves a compiled kernel's first call meanwhile.

A CPU conv pass compiles 6-40 Numba functions the first time it runs with an empty cache
(3-8 s of CPU on the 2-core machine, docs/benchmarks.md#compile), and a new user, a fresh
container or every MPI rank on a new node waits for them. :func:`run` takes that wait away:
the first call of a *key* (a pass, its dtypes, flags and geometry, the plan rules) hands the
compiled call to one background thread, which loads what it needs from Numba's cache, or
compiles it, and then runs it. The caller waits for it until one of:

- it is done (a warm cache: ~0.1-0.4 s of loads): its result is the call's result;
- Numba starts to *compile* a function for it (a ``numba:compile`` event: those fire for
  compilations, not for loads from the cache), ``WAIT_S`` seconds passed, or the thread was
  still busy with an earlier key's call when this one came (no wait then): the call returns
  ``fallback()`` instead (plain NumPy, which compiles nothing: the conv's ``cpu_numpy.py``;
  or None for a fused epilogue the op can do without), and later calls of the key take the
  fallback too until the background call has finished. From then on every call of the key
  runs the compiled kernels directly, on the calling thread.

The two paths compute the same function (tests compare both with the float64 reference) but
round differently, so with an empty cache the first steps of a training run are not bitwise
those of a run with a warm cache. ``NUMBAFUSE_FIRST_CALL_WAIT=inf`` (or :func:`set_wait`)
waits for the compiled kernels always, as before this module: the test suite and
:mod:`numbafuse.precompile` do; ``0`` never waits (a warm cache's first calls run NumPy too).
Default: 5 seconds at most (loads are what it waits for).

The compiled call runs in a copy of the caller's ``contextvars`` context (the plan rules, the
weight cache's state) on the same arrays (nothing is copied: the caller is blocked while the
result can still be used, and a result that comes too late is dropped). One thread runs the
background calls in order. While it compiles, Python code on the other threads runs slower
(Numba's compiler is Python and holds the GIL in 5 ms slices; the fallback's GEMMs release
it), and a call on the calling thread that needs a compilation of its own (a batch-norm
kernel, say) waits for the function being compiled, since Numba compiles one at a time. A key
whose compiled run raised runs compiled on the calling thread from then on (the error is
raised there). At interpreter exit the thread finishes the function it is in and drops the
rest; a forked child forgets the calls in flight (they run again there).
"""
import contextvars
import math
import os
import queue
import threading

_READY, _PENDING = "ready", "pending"


def _wait_from_env():
    value = os.environ.get("NUMBAFUSE_FIRST_CALL_WAIT", "5").strip().lower()
    try:
        wait = float(value)
    except ValueError:
        raise ValueError(f"NUMBAFUSE_FIRST_CALL_WAIT must be a number of seconds or 'inf', "
                         f"got {value!r}") from None
    if math.isnan(wait) or wait < 0:
        raise ValueError(f"NUMBAFUSE_FIRST_CALL_WAIT must be >= 0, got {value!r}")
    return wait


WAIT_S = _wait_from_env()

_states = {}                # key -> _READY | _PENDING (absent: not called yet)
_lock = threading.Lock()
_jobs = queue.SimpleQueue()
_worker = None
_running = None             # the job the background thread is in
_stopping = False
_listening = False
_stats = {"compiled": 0, "fallback": 0, "background": 0}


def set_wait(seconds):
    """Set ``WAIT_S`` (``math.inf``: always wait for the compiled kernels); returns the old."""
    global WAIT_S
    seconds = float(seconds)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"set_wait: seconds must be >= 0, got {seconds!r}")
    old, WAIT_S = WAIT_S, seconds
    return old


def stats():
    """Counts of calls run compiled, run by the fallback, and handed to the background."""
    return dict(_stats)


def pending():
    """The keys whose background call has not finished (a list)."""
    with _lock:
        return [k for k, state in _states.items() if state is _PENDING]


def join(timeout=None):
    """Wait until no background call is pending (``timeout`` seconds at most); True if none."""
    done = threading.Event()
    _jobs.put(done)                         # a marker: the worker sets it when it reaches it
    _start_worker()
    return done.wait(timeout)


class _Job:
    __slots__ = ("key", "call", "context", "done", "wake", "result", "error")

    def __init__(self, key, call):
        self.key, self.call, self.context = key, call, contextvars.copy_context()
        self.done, self.wake = threading.Event(), threading.Event()   # wake: done or compiling
        self.result = self.error = None


def _listen():
    """Wake the caller of the background job when Numba starts a compilation for it."""
    global _listening
    from numba.core import event

    class CompileStarts(event.Listener):
        def on_start(self, ev):
            job = _running
            if job is not None and threading.current_thread() is _worker:
                job.wake.set()

        def on_end(self, ev):
            pass

    event.register("numba:compile", CompileStarts())
    _listening = True


def run(key, compiled, fallback):
    """``compiled()``, or ``fallback()`` while ``compiled``'s first run for ``key`` compiles in
    the background (module docstring). ``key``: hashable, equal for calls that run the same
    compiled functions."""
    state = _states.get(key)
    if state is _READY or WAIT_S == math.inf:
        _stats["compiled"] += 1
        return compiled()
    if state is None:
        with _lock:
            state = _states.get(key)
            if state is None:
                _states[key] = _PENDING
                job = _Job(key, compiled)
        if state is None:
            _stats["background"] += 1
            if not _listening:
                _listen()
            busy = _running is not None or not _jobs.empty()    # behind another: no wait
            _jobs.put(job)
            _start_worker()
            if not busy:
                job.wake.wait(WAIT_S)
            if job.done.is_set():
                if job.error is not None:
                    raise job.error
                return job.result
        elif state is _READY:
            _stats["compiled"] += 1
            return compiled()
    _stats["fallback"] += 1
    return fallback()


def _start_worker():
    global _worker
    with _lock:
        if _worker is None:
            _worker = threading.Thread(target=_work, name="numbafuse-first-calls")
            _worker.start()


def _work():
    """The background thread: runs the queued calls in order; ends when idle for a second
    (:func:`_start_worker` starts another), at exit, or when the main thread has ended."""
    global _worker, _running
    while not _stopping:
        try:
            job = _jobs.get(timeout=1.0)
        except queue.Empty:
            with _lock:
                if _jobs.empty() or not threading.main_thread().is_alive():
                    _worker = None
                    return
            continue
        if isinstance(job, threading.Event):
            job.set()
            continue
        _running = job
        try:
            job.result = job.context.run(job.call)
        except BaseException as error:      # raised again by the caller, or on its next call
            job.error = error
        _running = None
        with _lock:
            _states[job.key] = _READY
        job.call = job.context = None
        job.done.set()
        job.wake.set()


def _stop():
    global _stopping
    _stopping = True


def _forget_in_child():
    global _worker, _jobs, _lock
    _worker, _jobs, _lock = None, queue.SimpleQueue(), threading.Lock()
    for key in [k for k, state in _states.items() if state is _PENDING]:
        del _states[key]


if hasattr(threading, "_register_atexit"):     # before the interpreter joins its threads
    threading._register_atexit(_stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
