"""Compiled launches (kernels/cpu/native.py): a task kernel's launch runs as compiled code on
every thread, on PyTorch's OpenMP team and on numbafuse's own pool, ranges taken from an
atomic counter.

Checked here, on both: every task runs once whatever the task count and the grain (the last
range short, one range, a grain above a thread's share); two threads take ranges, the
caller one of them; a kernel's error reaches the caller with its message and the threads work
on; many launches in a row (helpers joining late, a third thread on two cores). And: a kernel
that returns a value takes the Python job; single-thread launches ready the compiled entry
when asked (what the compiling process of first_calls does); an entry not in the cache is
compiled by first_calls while the Python job runs. The conv and batch-norm passes with and
without compiled launches: tests/test_threading.py.
"""
import ctypes
import threading

import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from numbafuse.kernels.cpu import first_calls
from numbafuse.kernels.cpu import launch as _launch
from numbafuse.kernels.cpu import native
from numbafuse.kernels.cpu import team as cpu_team
from numbafuse.kernels.cpu.sync import cpu_relax

from .teams import share_torch_team

PTHREAD_SELF = ctypes.cast(ctypes.CDLL(None).pthread_self, ctypes.c_void_p).value


@intrinsic
def _call_long(typingctx, fptr):
    sig = types.int64(types.intp)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(64), [])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [])
    return sig, codegen


@njit(nogil=True, cache=True)
def _count(t0, t1, counts, owners, who, spin):
    me = _call_long(who)
    for t in range(t0, t1):
        counts[t] += 1
        owners[t] = me
        for _ in range(spin):
            cpu_relax()


@njit(nogil=True, cache=True)
def _fails_at(t0, t1, bad, out):
    for t in range(t0, t1):
        if t == bad:
            raise ValueError("task failed on purpose")
        out[t] = t


@njit(nogil=True, cache=True)
def _add_one(t0, t1, out):
    for t in range(t0, t1):
        out[t] += 1


@njit(nogil=True, cache=True)
def _add_many(t0, t1, x, pair, flag):
    for t in range(t0, t1):
        x[t] += pair[1] if flag else pair[0][t]


@njit(nogil=True, cache=True)
def _returns(t0, t1, out):
    for t in range(t0, t1):
        out[t] += 1
    return t1


def _spy(monkeypatch, cls, python_name):
    calls = {"python": 0, "native": 0}
    run, run_native = getattr(cls, python_name), cls.run_native

    def spy_run(self, *a):
        calls["python"] += 1
        return run(self, *a)

    def spy_native(self, *a):
        calls["native"] += 1
        return run_native(self, *a)
    monkeypatch.setattr(cls, python_name, spy_run)
    monkeypatch.setattr(cls, "run_native", spy_native)
    return calls


@pytest.fixture(params=[pytest.param("torch-openmp", marks=pytest.mark.torch), "own-pool"])
def where(request, monkeypatch):
    """numbafuse on 2 threads, on PyTorch's team (torch on 2 threads) or on its own pool; the
    calls that reach it counted by kind."""
    monkeypatch.setattr(_launch, "NATIVE", True)
    threads = _launch.num_threads()
    _launch.set_num_threads(2)
    if request.param == "torch-openmp":
        request.addfinalizer(share_torch_team(monkeypatch)[1])
        calls = _spy(monkeypatch, cpu_team.OpenMPTeam, "run")
    else:
        monkeypatch.setattr(_launch, "SHARE_TORCH_TEAM", False)
        for _ in range(50):                      # (a new pool's helper started)
            if len(set(_launch_counts(8, 1, spin=10000)[1][:8].tolist())) == 2:
                break
        calls = _spy(monkeypatch, _launch._Pool, "run")
    assert _launch.backend() == request.param
    yield calls
    _launch.set_num_threads(threads)


def _launch_counts(ntasks, grain, spin=0):
    pad = 16                                    # a range past ntasks would write here
    counts = np.zeros(ntasks + pad, np.int64)
    owners = np.zeros(ntasks + pad, np.int64)
    _launch.launch(_count, ntasks, counts, owners, PTHREAD_SELF, spin, work=10**9,
                   grain=grain)
    return counts, owners


@pytest.mark.parametrize("ntasks,grain", [(1, 1), (2, 1), (7, 3), (8, 3), (9, 4), (9, 5),
                                          (16, 16), (33, 8), (5, 100)])
def test_every_task_runs_once_whatever_the_grain(where, ntasks, grain):
    counts, _ = _launch_counts(ntasks, grain)
    assert counts[:ntasks].tolist() == [1] * ntasks
    assert not counts[ntasks:].any()
    assert where == {"python": 0, "native": int(ntasks > 1)}


def test_two_threads_take_ranges_the_caller_one_of_them(where):
    _, owners = _launch_counts(24, 1, spin=40000)          # ~0.5-2 ms a task
    assert len(set(owners[:24].tolist())) == 2
    assert threading.get_ident() in set(owners[:24].tolist())    # (pthread_self on Linux)
    assert where["native"] == 1


def test_a_kernels_error_reaches_the_caller_and_the_threads_work_on(where):
    out = np.zeros(12, np.int64)
    with pytest.raises(ValueError, match="task failed on purpose"):
        _launch.launch(_fails_at, 12, 7, out, work=10**9, grain=1)
    counts, _ = _launch_counts(10, 2)
    assert counts[:10].tolist() == [1] * 10
    assert where["native"] == 2


def test_many_launches_in_a_row(where):
    # helpers that wake late find the launch closed or join the next one; none may run a
    # closed launch's record (it is gone with the launching call's stack)
    counts = np.zeros(64, np.int64)
    for i in range(600):
        ntasks = 2 + i % 60
        _launch.launch(_add_one, ntasks, counts, work=10**9, grain=1 + i % 3)
    expected = np.zeros(64, np.int64)
    for i in range(600):
        expected[:2 + i % 60] += 1
    assert counts.tolist() == expected.tolist()
    assert where["native"] == 600


def test_python_jobs_between_compiled_launches_still_get_both_threads(where, monkeypatch):
    # a pool helper serving compiled launches in compiled code (native.serve) goes back to
    # Python for a Python job (a closure's launch), and on to compiled launches after it
    # (parked for up to 0.3 s here, so that it sees the Python job there)
    import time
    monkeypatch.setattr(_launch, "SPIN_NS", 300_000_000)
    ran = []

    def kernel(t0, t1):
        for t in range(t0, t1):
            time.sleep(0.002)
            ran.append((t, threading.get_ident()))
    counts = np.zeros(16, np.int64)
    for i in range(3):
        _launch.launch(_add_one, 16, counts, work=10**9, grain=2)
        _launch.launch(kernel, 12, work=10**9, grain=1)      # (within the helper's park)
        assert sorted(t for t, _ in ran) == list(range(12))
        assert len({ident for _, ident in ran}) == 2
        ran.clear()
    assert counts.tolist() == [3] * 16
    assert where == {"python": 3, "native": 3}


@pytest.mark.parametrize("fresh", [True, False])
def test_a_helper_waits_for_a_launch_whose_caller_is_slow_to_open_it(monkeypatch, fresh):
    # the helper, woken for a launch whose caller is still in Python (a first dispatch of
    # enter loads its code: here 20 ms of sleep), waits for it to open (it once found it not
    # yet open, went back to sleep, and the caller ran alone); on a new pool and an old one
    import time
    monkeypatch.setattr(_launch, "NATIVE", True)
    monkeypatch.setattr(_launch, "SHARE_TORCH_TEAM", False)
    threads = _launch.num_threads()
    enter = native.enter

    def slow_enter(*args):
        time.sleep(0.02)
        return enter(*args)
    try:
        _launch.set_num_threads(1 if fresh else 2)
        _launch_counts(4, 1)                              # (compiled)
        _launch.set_num_threads(2)                        # fresh: a new pool at the next
        monkeypatch.setattr(native, "enter", slow_enter)
        _, owners = _launch_counts(24, 1, spin=40000)
        assert len(set(owners[:24].tolist())) == 2
    finally:
        _launch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "sched_yield"), reason="no sched_yield")
def test_more_threads_than_cores_on_the_own_pool(monkeypatch):
    # the launching thread waits for the helpers in compiled code, yielding its core
    monkeypatch.setattr(_launch, "NATIVE", True)
    monkeypatch.setattr(_launch, "SHARE_TORCH_TEAM", False)
    threads = _launch.num_threads()
    _launch.set_num_threads(5)
    try:
        counts = np.zeros(40, np.int64)
        for i in range(200):
            _launch.launch(_add_one, 40, counts, work=10**9, grain=1)
        assert counts.tolist() == [200] * 40
    finally:
        _launch.set_num_threads(threads)


def test_kernels_native_cannot_call_take_the_python_job(where):
    out = np.zeros(9, np.int64)
    _launch.launch(_returns, 9, out, work=10**9, grain=2)       # returns a value
    assert out.tolist() == [1] * 9
    assert native.address(_returns, (out,)) == 0
    assert where == {"python": 1, "native": 0}


def test_single_thread_launches_ready_the_entry_when_asked(monkeypatch):
    # the compiling process of first_calls runs on one thread with NATIVE_WARM: the entry a
    # team's launch needs is compiled (into the cache) there, not at the first parallel launch
    args = (np.zeros(4, np.int64),)
    monkeypatch.setattr(native, "_addresses", {})
    monkeypatch.setattr(_launch, "NATIVE_WARM", False)
    _launch.launch(_add_one, 4, *args, work=1)
    assert native._addresses == {}
    monkeypatch.setattr(_launch, "NATIVE_WARM", True)
    _launch.launch(_add_one, 4, *args, work=1)
    (key, (address, entry, ready)), = native._addresses.items()
    assert key[0] is _add_one and address != 0 and ready
    argtypes = tuple(native.typeof(a) for a in args)
    assert any(tuple(s[-1]) == argtypes for s in native.enter.signatures)
    assert args[0].tolist() == [2, 2, 2, 2]


def test_an_entry_not_in_the_cache_compiles_by_first_calls_meanwhile_the_python_job(
        monkeypatch, where):
    # first_calls.run decides: pending (the fallback): 0, the launch runs the Python job;
    # ready: the address, the launch runs compiled
    assert native.first_calls_run is first_calls.run         # (set when first_calls loads)
    monkeypatch.setattr(native, "_addresses", {})
    monkeypatch.setattr(native, "_ready", set())
    answers = []

    def run(key, compiled, fallback, spec=None):
        answers.append((key[0], spec[:2]))
        return fallback() if len(answers) == 1 else compiled()
    monkeypatch.setattr(native, "first_calls_run", run)
    counts = np.zeros(8, np.int64)
    for _ in range(3):
        _launch.launch(_add_one, 8, counts, work=10**9, grain=1)
    assert counts.tolist() == [3] * 8
    assert answers == [("native entry", ("numbafuse.kernels.cpu.native", "compile_entry"))] * 2
    assert where == {"python": 1, "native": 2}


def test_an_entry_compiles_from_a_pickled_spec_as_the_compiling_process_runs_it(monkeypatch):
    # what first_calls sends its compiling process for an entry: (module, function, args,
    # rules), pickled; run there by compile_child.run_spec
    import pickle

    from numbafuse.kernels.cpu import compile_child
    args = (np.zeros((2, 3), np.float32), (np.zeros(2, np.int64), 1.5), True)
    _, entry = native._resolve(_add_many, args)
    spec = pickle.loads(pickle.dumps((native.__name__, "compile_entry", (entry,), None)))
    compile_child.run_spec(spec)
    assert any(tuple(s) == entry for s in native.enter.signatures)


def test_an_entry_that_does_not_compile_turns_compiled_launches_off_for_its_types(
        monkeypatch, where):
    def broken(entry):
        raise RuntimeError("planted")
    monkeypatch.setattr(native, "compile_entry", broken)
    monkeypatch.setattr(native, "_addresses", {})
    monkeypatch.setattr(native, "_ready", set())
    monkeypatch.setattr(native, "_failed", set())
    monkeypatch.setattr(native, "first_calls_run", None)
    counts = np.zeros(8, np.int64)
    with pytest.warns(RuntimeWarning, match="compiled launches are off"):
        _launch.launch(_add_one, 8, counts, work=10**9, grain=1)
    import warnings
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        _launch.launch(_add_one, 8, counts, work=10**9, grain=1)
    assert not again                                               # (said once)
    assert counts.tolist() == [2] * 8
    assert where == {"python": 2, "native": 0}
