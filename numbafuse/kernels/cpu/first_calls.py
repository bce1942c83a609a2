"""First calls while Numba compiles: NumPy serves a pass while another process compiles it.

A CPU conv pass compiles 6-40 Numba functions the first time it runs with an empty cache
(3-8 s of CPU on the 2-core machine, docs/benchmarks.md#compile), and a new user, a fresh
container or every MPI rank on a new node waits for them. :func:`run` takes that wait away.
The first call of a *key* (a pass, its dtypes, flags and geometry, the plan rules) hands the
compiled call to one background thread, the *worker*, and waits for it:

- the worker first *probes*: it runs the call with Numba's compilations refused (a
  ``numba:compile`` event, which fires for a compilation and not for a load from the cache,
  raises there). Everything loaded (a warm cache: ~0.1-0.4 s): the result is the call's.
- At the probe's first compilation, or after ``WAIT_S`` seconds, or at once where the worker
  is still busy with an earlier key or another thread compiled within ``QUIET_S``, the call
  returns ``fallback()`` instead: plain NumPy, which compiles nothing (the conv's
  ``cpu_numpy.py``), or None for a fused epilogue the op can do without. Later calls of the
  key take the fallback too until the worker is done.
- The worker sends the call's *spec* (its function, shapes, dtypes and flags:
  ``compile_child.py``) to a compiling process, started once, which runs it on zeros and so
  compiles its functions into Numba's on-disk cache; then the worker probes again, which now
  loads them. From then on every call of the key runs the compiled kernels directly, on the
  calling thread. This process compiles none of them: a compilation here would hold Numba's
  compiler lock for seconds (one function at a time) and the GIL in 5 ms slices, and the
  caller's own first calls of other kernels (batch norm's, say) would wait behind it. Where
  the compiling process fails (twice it could not start, died, or gave no answer within
  ``CHILD_TIMEOUT_S``: then it is killed), or for a call without a spec, the worker compiles
  on its own thread, after the other threads' compilations.

The two paths compute the same function (tests compare both with the float64 reference) but
round differently, so with an empty cache the first steps of a training run are not bitwise
those of a run with a warm cache. ``NUMBAFUSE_FIRST_CALL_WAIT=inf`` (or :func:`set_wait`)
waits for the compiled kernels always, compiling on the calling thread, as before this module:
the test suite, :mod:`numbafuse.precompile` and the benchmark runner's warm-up do. ``0`` never
waits (a warm cache's first calls run NumPy too). Default: 5 seconds at most (loads are what
it waits for). ``NUMBAFUSE_FIRST_CALL_PROCESS=0``: no compiling process (the worker
compiles), as where ``sys.executable`` is not a plain Python (a frozen or embedding program).

The probe holds the thread pool (``launch._busy``), so its launches run on the worker alone
and no helper thread compiles for it; a launch on another thread meanwhile runs on its own
thread. The compiled call runs in a copy of the caller's ``contextvars`` context (the plan
rules, the weight cache's state) on the same arrays (nothing is copied: the caller is blocked
while the result can still be used, and a result that comes too late is dropped). A key whose
compiled run raised runs compiled on the calling thread from then on (the error is raised
there). At interpreter exit the compiling process finishes the spec it is on and gets no
more (a short-lived process still leaves the cache one call further; the compiling process may
outlive it by that one compilation); the worker finishes a probe it is in. A forked child
forgets the calls in flight and the compiling process (they run again there).
"""
import contextvars
import math
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time

from . import compile_child, native, recorded

_READY, _PENDING = "ready", "pending"


def _seconds(value, what):
    """``value`` as seconds to wait: a number >= 0 or inf (a ValueError naming ``what``)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds or 'inf', got {value!r}") \
            from None
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return seconds


WAIT_S = _seconds(os.environ.get("NUMBAFUSE_FIRST_CALL_WAIT", "5").strip().lower(),
                  "NUMBAFUSE_FIRST_CALL_WAIT")

_states = {}                # key -> _READY | _PENDING (absent: not called yet)
_lock = threading.Lock()
_jobs = queue.SimpleQueue()
_worker = None
_running = None             # the job the background thread is in
_stopping = False
_waiting_child = False      # the worker waits for the compiling process (no code of its own)
_probing = False            # the worker's probe is on: a compilation raises _Cold
_child = None               # the compiling process (subprocess.Popen), started when needed
_child_failures = 0         # after two, the worker compiles on its own thread
_child_calls = 0
CHILD_TIMEOUT_S = 300       # a spec's compilation takes ~1-15 s; past this the process hangs


def _python_executable():
    """The interpreter to start the compiling process with, or None where ``sys.executable``
    is not a plain Python (a frozen application, or an embedding program such as uWSGI or a
    3-D editor, which ``-m`` would start again)."""
    exe = sys.executable
    if not exe or getattr(sys, "frozen", False):
        return None
    return exe if "python" in os.path.basename(exe).lower() else None


USE_PROCESS = (os.environ.get("NUMBAFUSE_FIRST_CALL_PROCESS", "1") != "0"
               and _python_executable() is not None)
_others_compiling = 0       # Numba compilations in progress on threads other than the worker
_others_ended = -math.inf   # time.monotonic() when the last of them ended
QUIET_S = 0.5               # the worker starts a call this long after the others' last one
_stats = {"compiled": 0, "fallback": 0, "background": 0, "child errors": 0}
_child_errors = []          # the compiling process's last few errors (text)


def set_wait(seconds):
    """Set ``WAIT_S`` (``math.inf``: always wait for the compiled kernels); returns the old."""
    global WAIT_S
    old, WAIT_S = WAIT_S, _seconds(seconds, "set_wait: seconds")
    return old


def stats():
    """Counts of the calls :func:`run` ran compiled (not those a caller ran itself after
    :func:`is_ready`, as ``conv/cpu_first.py`` does), ran by the fallback and handed to the
    background, and of the compiling process's errors (``first_calls._child_errors``)."""
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
    __slots__ = ("key", "call", "spec", "context", "done", "wake", "result", "error")

    def __init__(self, key, call, spec):
        self.key, self.call, self.spec = key, call, spec
        self.context = contextvars.copy_context()
        self.done, self.wake = threading.Event(), threading.Event()   # wake: done or compiling
        self.result = self.error = None


class _Cold(BaseException):
    """Raised in the worker, while it probes, where Numba would start a compilation."""


class _Listener:
    """Follows Numba's compilations (``numba:compile`` fires for those, not for loads from
    the cache): a probe's first one raises :class:`_Cold` on the worker; an unprobed one wakes
    the job's caller; the other threads' are counted (the worker keeps out of their way)."""

    instance = None

    @classmethod
    def register(cls):
        """Registered once, at the first call handed over: after the listeners registered
        before it (Numba's trace, a profiler), which see a refused compilation's start and
        end as usual; one registered later sees its end only."""
        from numba.core import event

        class CompileStarts(event.Listener):
            def on_start(self, ev):
                cls.on_start()

            def on_end(self, ev):
                cls.on_end()
        cls.instance = CompileStarts()
        event.register("numba:compile", cls.instance)

    @staticmethod
    def on_start():
        global _others_compiling
        if threading.current_thread() is not _worker:
            _others_compiling += 1
        elif _probing:
            raise _Cold()
        elif _running is not None:
            _running.wake.set()

    @staticmethod
    def on_end():
        global _others_compiling, _others_ended
        if threading.current_thread() is not _worker:
            _others_compiling = max(0, _others_compiling - 1)   # (one begun before we listened)
            _others_ended = time.monotonic()


def _others_busy():
    """Whether another thread compiles, or did within ``QUIET_S``."""
    return _others_compiling > 0 or time.monotonic() - _others_ended < QUIET_S


def is_ready(key):
    """Whether ``key``'s calls run compiled on the calling thread (the fast path: no
    partial objects made)."""
    return WAIT_S == math.inf or _states.get(key) is _READY


def run(key, compiled, fallback, spec=None):
    """``compiled()``, or ``fallback()`` while ``compiled``'s first run for ``key`` compiles in
    the background (module docstring). ``key``: hashable, equal for calls that run the same
    compiled functions. ``spec``: the call for the compiling process (``compile_child.py``),
    or None (compiled on the worker thread)."""
    if is_ready(key):
        _stats["compiled"] += 1
        return compiled()
    # (a call recorded for a prepared call: not while its kernels compile, recorded.py)
    recorded.taint("a kernel still compiling", transient=True)
    with _lock:
        state = _states.get(key)
        if state is None:
            _states[key] = _PENDING
            job = _Job(key, compiled, spec)
    if state is _READY:                     # (done since is_ready looked)
        _stats["compiled"] += 1
        return compiled()
    if state is None:
        _stats["background"] += 1
        if _Listener.instance is None:
            _Listener.register()
        # behind another call, or after another thread's compilation: no wait
        busy = _running is not None or not _jobs.empty() or _others_busy()
        _jobs.put(job)
        _start_worker()
        if not busy:
            job.wake.wait(WAIT_S)
        if job.done.is_set():
            if job.error is not None:
                raise job.error
            return job.result
    _stats["fallback"] += 1
    return fallback()


def _start_worker():
    global _worker
    with _lock:
        if _worker is None:
            _worker = threading.Thread(target=_work, name="numbafuse-first-calls",
                                       daemon=True)     # (at exit: _stop)
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
            job.result = _execute(job)
        except BaseException as error:      # raised again by the caller, or on its next call
            job.error = error
        _running = None
        with _lock:
            _states[job.key] = _READY
        job.call = job.context = job.spec = None
        job.done.set()
        job.wake.set()


def _execute(job):
    """The job's compiled call on this thread: first a probe that only loads from the cache;
    at its first compilation the caller is woken, the compiling process compiles the spec,
    and a second probe loads that. What is still missing then compiles here."""
    if job.spec is not None and USE_PROCESS:
        try:
            return _probe(job)
        except _Cold:
            job.wake.set()
            compiled = _child_compile(job.spec)
            if compiled and not _stopping:
                try:
                    return _probe(job)
                except _Cold:
                    pass
    waited = 0.0
    while _others_busy() and not _stopping and waited < 30:   # one at a time: theirs first
        time.sleep(0.02)
        waited += 0.02
    if _stopping:                                   # exiting: the result is not needed
        raise _Cold()
    return job.context.run(job.call)


def _probe(job):
    """The call with compilations refused (:class:`_Cold`), holding the launcher's pool: its
    launches run on this thread, so no helper thread compiles for it meanwhile."""
    global _probing
    from . import launch
    with launch._busy:
        _probing = True
        try:
            return job.context.run(job.call)
        finally:
            _probing = False


def _child_compile(spec):
    """Have the compiling process run ``spec``; True when it did (without an error)."""
    global _child, _child_failures, _child_calls, _waiting_child
    if _child_failures >= 2:
        return False
    try:
        if _child is None or _child.poll() is not None:
            here = os.path.abspath(__file__)                # <root>/numbafuse/kernels/cpu/
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
            path = os.environ.get("PYTHONPATH")
            from . import launch                 # (the compiled launches' entries too)
            env = {**os.environ, "NUMBAFUSE_FIRST_CALL_WAIT": "inf",
                   "NUMBAFUSE_NUM_THREADS": "1",
                   "NUMBAFUSE_NATIVE_WARM": str(int(launch.NATIVE)),
                   "PYTHONPATH": root + (os.pathsep + path if path else "")}
            _child = subprocess.Popen(       # (stderr: none; it may outlive this process)
                [_python_executable(), "-m", "numbafuse.kernels.cpu.compile_child"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=env)
        _child_calls += 1
        compile_child.write_message(_child.stdin, (_child_calls, spec))
        _waiting_child = True           # sent: from here an exit need not wait for this thread
        reply = (compile_child.read_message(_child.stdout)
                 if _replies_within(_child.stdout, CHILD_TIMEOUT_S) else None)
    except (OSError, ValueError, pickle.PicklingError):
        reply = None
    finally:
        _waiting_child = False
    if reply is None:                   # it could not start, died, or hangs: the worker compiles
        _child_failures += 1
        child, _child = _child, None
        if child is not None and child.poll() is None:
            child.kill()
        return False
    if reply[1] is not None:
        _stats["child errors"] += 1
        _child_errors.append(reply[1])
        del _child_errors[:-8]
    return reply[1] is None


def _replies_within(stream, seconds):
    """Whether ``stream`` (the compiling process's stdout) has something to read within
    ``seconds`` (where ``select.poll`` exists; elsewhere it is not timed)."""
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(stream.fileno(), select.POLLIN | select.POLLHUP)
    return bool(poller.poll(seconds * 1000))


def _stop():
    """At exit (before the interpreter joins its threads): the worker takes no more calls. It
    is waited for while it runs code of its own (a probe, or sending the call in flight to
    the compiling process), not while it waits for that process's answer; then the compiling
    process's input is closed: it finishes the spec it has, writing its cache files, and ends
    (so that a short-lived process leaves the cache one call further each time)."""
    global _stopping
    _stopping = True
    _jobs.put(threading.Event())            # wakes an idle worker, which then ends
    worker = _worker
    while worker is not None and worker.is_alive() and not _waiting_child:
        worker.join(0.05)
    child = _child
    if child is not None:
        try:
            child.stdin.close()
        except OSError:
            pass


def _forget_in_child():
    global _worker, _jobs, _lock, _child, _running, _probing
    _worker, _jobs, _lock = None, queue.SimpleQueue(), threading.Lock()
    _child, _running, _probing = None, None, False
    for key in [k for k, state in _states.items() if state is _PENDING]:
        del _states[key]


if hasattr(threading, "_register_atexit"):     # before the interpreter joins its threads
    threading._register_atexit(_stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
native.first_calls_run = run       # a compiled launch's entry: compiled as a first call
