"""numbafuse's tasks on a loaded GNU OpenMP runtime's team (PyTorch's): see ``cpu.launch``.

:class:`OpenMPTeam` runs one job as one ``GOMP_parallel`` region of that runtime: every team
thread (the caller's included) enters :func:`_team_entry`, compiled and GIL-free, and then a
ctypes callback that takes the GIL and calls ``job.work()``, whose task kernels release it.
:func:`find_torch_team` finds PyTorch's runtime among the libraries already loaded (it never
loads one).
"""
import ctypes
import glob
import os
import threading

import numpy as np
from numba import carray, cfunc, types

from . import native
from .sync import SLOT, call_int, call_void, cpu_relax, load_acquire, monotonic_ns, publish


# A team region's data: _ENTRY_* int64 fields, then the caller's "in my first range" flag and
# the job's "every range handed out" flag, each on its own cache line.
_ENTRY_BODY, _ENTRY_THREAD_NUM, _ENTRY_CLOCK, _ENTRY_WAIT_NS, _ENTRY_LATE_NS = range(5)
_ENTRY_FLAG = SLOT
_ENTRY_DONE = 2 * SLOT


def _team_entry(data):
    """Every team thread enters here, GIL-free. A worker (thread number > 0) first waits, at
    most WAIT_NS, until the calling thread is in its first range (it holds the GIL until then:
    asking for it puts a thread to sleep on it, ~70 us to wake here), and LATE_NS more, like
    a parked helper; then each thread calls the Python body (which takes the GIL). A worker
    that finds every range handed out returns at once, without the GIL: a short job's caller
    would otherwise wait at the region's end for a worker that asked for the GIL while the
    caller held it, and slept (a fused ResNet-18 step's 143 launches waited 4.1 ms in all after
    their callers' last ranges)."""
    d = carray(data, _ENTRY_DONE + 1)
    if call_int(d[_ENTRY_THREAD_NUM]) != 0:
        clock = d[_ENTRY_CLOCK]
        if clock != 0:
            end = monotonic_ns(clock) + d[_ENTRY_WAIT_NS]
            while load_acquire(d[_ENTRY_FLAG:]) == 0 and monotonic_ns(clock) < end:
                for _ in range(64):
                    cpu_relax()
            end = monotonic_ns(clock) + d[_ENTRY_LATE_NS]
            while monotonic_ns(clock) < end and load_acquire(d[_ENTRY_DONE:]) == 0:
                cpu_relax()
        if load_acquire(d[_ENTRY_DONE:]) != 0:
            return
    call_void(d[_ENTRY_BODY], data)


_team_entry_cfunc = None


def _team_entry_address():
    """Address of the compiled :func:`_team_entry` (compiled on first use: a process without
    torch does not pay for it at import)."""
    global _team_entry_cfunc
    if _team_entry_cfunc is None:
        _team_entry_cfunc = cfunc(types.void(types.CPointer(types.int64)), nopython=True,
                                  cache=True)(_team_entry)
    return _team_entry_cfunc.address


class OpenMPTeam:
    """A loaded GNU OpenMP runtime's team: ``run(job, threads)`` is one ``GOMP_parallel``
    region whose threads (the caller's included) each call ``job.work()``. They enter through
    :func:`_team_entry` (compiled, GIL-free), then a ctypes callback takes the GIL; the task
    kernels release it. A team thread keeps the Python thread state it first got (one per
    thread, instead of one made and freed per region)."""

    def __init__(self, lib):
        self._parallel = lib.GOMP_parallel
        self._parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                                   ctypes.c_uint]
        self._parallel.restype = None
        self._max_threads = lib.omp_get_max_threads
        self._max_threads.argtypes = []
        self._max_threads.restype = ctypes.c_int
        self._thread_num = ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value
        self._callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._body)
        self._body_address = ctypes.cast(self._callback, ctypes.c_void_p).value
        self._entry = _team_entry_address()
        self._jobs = {}
        self._adopted = set()
        # the regions' data: one buffer, made once, for the region that holds ``_shared``
        # (``launch`` runs one at a time; GOMP_parallel returns once every team thread has left
        # the region), a new one for a region that meets it held. A buffer made per region
        # cost 4-5 us a launch warm and ~40 with the caches cold (NumPy's ``ctypes`` view of a
        # new array; in one process alternating, median of 600 launches of 2 x 14 us of tasks,
        # each after a 64 MiB sweep: 156-168 -> 117-127 us; in ResNet-50's training step the
        # caller's first range 25.5 -> 18.7 us after the launch began, the other thread's 43.6
        # -> 35.8, medians of 10 steps each, alternating, ~300 launches a step)
        self._shared = threading.Lock()
        self._region = self._region_data()
        self._gomp = ctypes.cast(self._parallel, ctypes.c_void_p).value
        self._state = np.zeros(native.STATE_SIZE, np.int64)     # run_native's, as _region
        ensure = ctypes.pythonapi.PyGILState_Ensure
        ensure.restype = ctypes.c_int
        self._ensure = ensure

    def threads(self):
        """The team size PyTorch's parallel regions get on this thread."""
        return int(self._max_threads())

    def _body(self, address):
        job, flag, done = self._jobs.get(address, (None, None, None))
        if job is None:
            return
        ident = threading.get_ident()
        if ident == job.caller:                  # team thread 0: a Python thread already
            job.exhausted = lambda: publish(done, 1)
            job.work(before_first=lambda: publish(flag, 1))
            return
        if ident not in self._adopted:           # a runtime's worker: keep the thread state
            self._adopted.add(ident)             # ctypes made for this callback
            self._ensure()
        job.work()

    def run(self, job, threads, clock, wait_ns, late_ns):
        """``job.work()`` on ``threads`` team threads; a worker waits for the caller's first
        range at most ``wait_ns`` by the clock_gettime at ``clock`` (0: it does not wait), and
        ``late_ns`` more."""
        shared = self._shared.acquire(blocking=False)
        try:
            data, address, flags = self._region if shared else self._region_data()
            data[_ENTRY_CLOCK] = clock
            data[_ENTRY_WAIT_NS] = wait_ns
            data[_ENTRY_LATE_NS] = late_ns
            data[_ENTRY_FLAG] = data[_ENTRY_DONE] = 0       # (the last region's, set)
            job.caller = threading.get_ident()
            self._jobs[address] = (job, *flags)
            try:
                self._parallel(self._entry, address, threads, 0)   # GIL released
            finally:
                del self._jobs[address]
        finally:
            if shared:
                self._shared.release()

    def run_native(self, kaddr, threads, ntasks, grain, args):
        """The task kernel at native address ``kaddr`` (``native.address``) on ``args``,
        tasks [0, ntasks) in ranges of ``grain``, as one region of ``threads`` team threads
        that run compiled code only (``cpu.native``); the count of failed kernel calls."""
        shared = self._shared.acquire(blocking=False)
        try:
            state = self._state if shared else np.zeros(native.STATE_SIZE, np.int64)
            return native.enter(kaddr, self._gomp, threads, native.NO_FLAG, state, ntasks,
                                grain, *args)
        finally:
            if shared:
                self._shared.release()

    def _region_data(self):
        """(a region's int64 data, its address, its (flag, done) views)."""
        data = np.zeros(_ENTRY_DONE + SLOT, np.int64)
        data[_ENTRY_BODY] = self._body_address
        data[_ENTRY_THREAD_NUM] = self._thread_num
        return data, data.ctypes.data, (data[_ENTRY_FLAG:], data[_ENTRY_DONE:])


def find_torch_team(torch):
    """PyTorch's GNU OpenMP runtime, if this process has loaded it (Linux; never loads one)."""
    init = getattr(torch, "__file__", None)
    noload = getattr(os, "RTLD_NOLOAD", None)
    if not isinstance(init, str) or noload is None:
        return None
    root = os.path.dirname(init)
    candidates = sorted(glob.glob(os.path.join(root, "lib", "libgomp*.so*"))
                        + glob.glob(os.path.join(os.path.dirname(root), "torch.libs",
                                                 "libgomp*.so*")))
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=noload | os.RTLD_LAZY)      # OSError: not loaded
        except OSError:
            continue
        if hasattr(lib, "GOMP_parallel") and hasattr(lib, "omp_get_max_threads"):
            return OpenMPTeam(lib)
    return None
