"""numbafuse's CPU threading: thread-count independence, concurrent callers, fork, neighbours.

The CPU kernels run on numbafuse's own pool (``kernels/cpu/launch.py``) with GEMMs on a
private one-thread OpenBLAS (``kernels/cpu/blas.py``). Checked here:

* results are bitwise the same on 1, 2, 3 and 5 threads (fixed task partitions, per-task
  partials summed in a fixed order);
* several Python threads calling at once get the results a lone caller gets;
* a child ``fork``ed after numbafuse ran (its pool threads alive) computes the same results;
* numbafuse starts no Numba threading layer (no OpenMP in the process), sets no environment
  variable, and leaves NumPy's and SciPy's BLAS thread counts as they were.

The speed side of "neighbours" (PyTorch in the same process, torch imported first) is measured
by ``benchmarks/bench_conv_bias_relu.py --mode neighbours`` and ``--mode import-order``.
"""
import contextvars
import multiprocessing
import os
import queue as queue_module
import subprocess
import sys
import threading

import numpy as np
import pytest

import numbafuse as nf
from numbafuse.kernels.cpu import launch as _launch
from numbafuse.kernels.cpu import team as cpu_team
from numbafuse.kernels.batchnorm import cpu as cpu_bn

from .teams import share_torch_team

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_COUNTS = (1, 2, 3, 5)
CALLERS = 4                 # Python threads calling at once
CALLS_PER_CALLER = 3
FORK_TIMEOUT_S = 60        # a child computes in seconds (its kernels compiled by the parent)


def _inputs(layout, seed):
    rng = np.random.default_rng(seed)
    shape = (3, 5, 9, 11) if layout == "NCHW" else (3, 9, 11, 5)
    x = rng.standard_normal(shape).astype(np.float32)
    z = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((5, 5, 3, 3)) / 5).astype(np.float32)
    w2 = (rng.standard_normal((5, 5, 3, 3)) / 5).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, 5).astype(np.float32)
    beta = rng.standard_normal(5).astype(np.float32)
    return x, z, w, w2, b, gamma, beta


def _work(layout, seed=0):
    """Conv (stride 1 and 2) and BatchNorm-Add-ReLU, forward and backward: a list of arrays."""
    x, z, w, w2, b, gamma, beta = _inputs(layout, seed)
    out = []
    for stride in (1, 2):
        kw = dict(padding=1, stride=stride, layout=layout)
        y = nf.conv_bias_relu(x, w, b, **kw)
        gy = np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape)
        out += [y, *nf.conv_bias_relu_backward(gy, x, w, y, **kw)]
    h = nf.conv_bias_relu(x, w2, b, padding=1, layout=layout)
    rm, rv = np.zeros(5, np.float32), np.ones(5, np.float32)
    o = nf.batchnorm_add_relu(h, z, gamma, beta, running_mean=rm, running_var=rv,
                              layout=layout)
    go = np.sin(np.arange(o.size, dtype=np.float32)).reshape(o.shape)
    out += [o, rm, rv, *nf.batchnorm_add_relu_backward(go, h, z, gamma, beta, layout=layout,
                                                        y=o)]
    # a 2x2 map: NCHW walks it as one row a sample (kernels/batchnorm/cpu_rows, "flat")
    corner = (slice(None),) * (2 if layout == "NCHW" else 1) + (slice(0, 2), slice(0, 2))
    hs, zs, gs = (np.ascontiguousarray(a[corner]) for a in (h, z, go))
    os_ = nf.batchnorm_add_relu(hs, zs, gamma, beta, layout=layout)
    out += [os_, *nf.batchnorm_add_relu_backward(gs, hs, zs, gamma, beta, layout=layout, y=os_)]
    return [np.array(a, copy=True) for a in out]


@pytest.fixture
def small_tasks(monkeypatch, conv_rules):
    """Every kernel on the pool, in many small tasks."""
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    conv_rules(chunk_bytes=1, dw_groups=3)
    monkeypatch.setattr(cpu_bn, "CHUNK", 64)
    monkeypatch.setattr(cpu_bn, "REDUCE_CHUNK", 64)
    monkeypatch.setattr(cpu_bn, "FLAT_CHUNK", 1)          # (3, 5, 2, 2) NCHW: 2 tasks
    threads = _launch.num_threads()
    yield
    _launch.set_num_threads(threads)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_results_do_not_depend_on_thread_count(layout, small_tasks):
    results = {}
    for n in THREAD_COUNTS:
        _launch.set_num_threads(n)
        results[n] = _work(layout)
    for n in THREAD_COUNTS[1:]:
        for a, b in zip(results[THREAD_COUNTS[0]], results[n]):
            assert a.tobytes() == b.tobytes(), n


def _concurrent_callers(layout):
    """CALLERS Python threads, started together, each calling _work CALLS_PER_CALLER times:
    each must get what a lone caller gets."""
    expected = {i: _work(layout, seed=i) for i in range(CALLERS)}
    got, errors = {}, []
    start = threading.Barrier(CALLERS)

    def caller(i):
        try:
            start.wait()
            for _ in range(CALLS_PER_CALLER):
                got[i] = _work(layout, seed=i)
                for a, b in zip(expected[i], got[i]):
                    assert a.tobytes() == b.tobytes()
        except BaseException as e:   # reported below, on the test's thread
            errors.append(e)

    # each thread in a copy of this one's context: the conv rules (a context variable) the
    # fixtures set hold there too
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(caller, i))
               for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(got) == list(range(CALLERS))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_concurrent_calls_from_python_threads(layout, small_tasks):
    _launch.set_num_threads(2)
    _concurrent_callers(layout)


def _child(layout, queue):
    queue.put([a.tobytes() for a in _work(layout)])


def _in_forked_child(target, *args):
    """target(*args, queue) in a forked child: what it put on the queue. A child that dies or
    gives no answer within FORK_TIMEOUT_S (a hang: killed) fails the test."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, queue))
    child.start()
    result = None
    for _ in range(FORK_TIMEOUT_S):          # until the child answers, dies or times out
        try:
            result = queue.get(timeout=1)
            break
        except queue_module.Empty:
            if not child.is_alive():
                break
    child.join(10)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"the forked child hung (no answer within {FORK_TIMEOUT_S} s)")
    assert child.exitcode == 0, f"the forked child died (exit code {child.exitcode})"
    return result


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_forked_child_keeps_working(layout, small_tasks, monkeypatch):
    monkeypatch.setattr(_launch, "SHARE_TORCH_TEAM", False)    # numbafuse's own pool (torch's
    _launch.set_num_threads(2)                                  # team: a test below)
    parent = _work(layout)                          # the pool's helper threads are alive now
    assert any(t.name.startswith("numbafuse-") for t in threading.enumerate())
    assert _in_forked_child(_child, layout) == [a.tobytes() for a in parent]


def test_no_process_wide_side_effects():
    """In a fresh process: no Numba threading layer started (no OpenMP, so fork stays safe),
    no environment variable set, NumPy's and SciPy's BLAS thread counts untouched."""
    code = """
import os, json
from threadpoolctl import threadpool_info   # sets KMP_DUPLICATE_LIB_OK itself: env after it
import numpy, scipy.linalg
env = dict(os.environ)
def blas():
    return sorted((d["filepath"], d["num_threads"]) for d in threadpool_info()
                  if "numbafuse" not in d["filepath"] and "scipy_openblas32" not in d["filepath"])
before = blas()
import numbafuse as nf
from numbafuse.kernels.cpu import launch as _launch
from numbafuse.kernels.cpu import team as cpu_team
_launch.PARALLEL_MIN_ELEMENTS = 0
x = numpy.random.default_rng(0).standard_normal((4, 8, 16, 16)).astype(numpy.float32)
w = numpy.ones((8, 8, 3, 3), numpy.float32)
y = nf.conv_bias_relu(x, w, None, padding=1)
nf.conv_bias_relu_backward(y, x, w, y, padding=1)
nf.batchnorm_add_relu(x, x, numpy.ones(8, numpy.float32), numpy.zeros(8, numpy.float32))
import numba.np.ufunc.parallel as numba_parallel
print(json.dumps(dict(numba_layer_started=bool(numba_parallel._is_initialized),
                      env_changed=sorted(set(os.environ.items()) ^ set(env.items())),
                      blas_before=before, blas_after=blas())))
"""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    import json
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["numba_layer_started"] is False
    assert res["env_changed"] == []
    assert res["blas_before"] == res["blas_after"]


def test_set_num_threads_refuses_zero():
    with pytest.raises(ValueError, match="set_num_threads"):
        _launch.set_num_threads(0)


# ------------------------------------------------------------------ on PyTorch's OpenMP team

def test_own_pool_unless_torchs_openmp_runtime_is_loaded(monkeypatch, tmp_path):
    """A ``torch`` module whose libgomp is not loaded in this process (a copy of the system's
    libgomp where there is one, else an empty file), or one without a file: numbafuse keeps
    its own pool (and loads no OpenMP runtime itself)."""
    import glob
    import shutil
    import types
    (tmp_path / "lib").mkdir()
    system = sorted(glob.glob("/usr/lib*/libgomp.so.1") + glob.glob("/usr/lib*/*/libgomp.so.1"))
    if system:
        shutil.copy(system[0], tmp_path / "lib" / "libgomp.so.1")
    else:
        (tmp_path / "lib" / "libgomp.so.1").write_bytes(b"")
    fake = types.ModuleType("torch")
    fake.__file__ = str(tmp_path / "__init__.py")
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert _launch.torch_team() is None and _launch.backend() == "own-pool"
    assert str(tmp_path) not in open("/proc/self/maps").read() if os.path.exists(
        "/proc/self/maps") else True
    fake.__file__ = None
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert _launch.torch_team() is None
    monkeypatch.delitem(sys.modules, "torch")
    assert _launch.backend() == "own-pool"


@pytest.mark.torch
def test_sharing_turned_off_keeps_the_own_pool(monkeypatch):
    pytest.importorskip("torch", reason="PyTorch is not installed")
    monkeypatch.setattr(_launch, "SHARE_TORCH_TEAM", False)
    assert _launch.torch_team() is None and _launch.backend() == "own-pool"

@pytest.fixture
def torch_team(small_tasks, monkeypatch):
    """torch imported (so numbafuse's calls run on its OpenMP team), torch and numbafuse on 2
    threads; both thread counts restored afterwards."""
    _launch.set_num_threads(2)
    torch, undo = share_torch_team(monkeypatch)
    yield torch
    undo()


def _spy_team_runs(monkeypatch, native=None):
    """The team size of each region run on torch's team (a Python job's or, where ``native``
    is a list, a compiled launch's, which ``native`` gets instead)."""
    runs = []
    original, original_native = cpu_team.OpenMPTeam.run, cpu_team.OpenMPTeam.run_native

    def run(self, job, threads, *waits):
        runs.append(threads)
        return original(self, job, threads, *waits)

    def run_native(self, kaddr, threads, *rest):
        (runs if native is None else native).append(threads)
        return original_native(self, kaddr, threads, *rest)
    monkeypatch.setattr(cpu_team.OpenMPTeam, "run", run)
    monkeypatch.setattr(cpu_team.OpenMPTeam, "run_native", run_native)
    return runs


def _sleepy_launch(ntasks):
    """A launch whose tasks each sleep 2 ms (GIL released): which threads ran which tasks."""
    import time
    ran = []

    def kernel(t0, t1):
        for t in range(t0, t1):
            time.sleep(0.002)
            ran.append((t, threading.get_ident()))
    _launch.launch(kernel, ntasks, work=10**9, grain=1)
    return ran


def test_a_job_says_once_when_its_last_range_is_handed_out():
    calls = []
    job = _launch._Job(lambda t0, t1: None, 5, 2, ())
    job.exhausted = lambda: calls.append(job.next)
    assert job._grab() == (0, 2) and job._grab() == (2, 4) and calls == []
    assert job._grab() == (4, 5) and calls == [5]
    assert job._grab() is None and calls == [5]


def test_a_team_worker_skips_the_python_body_once_every_range_is_handed_out():
    # cpu.team._team_entry, called as a GOMP region's threads call it: a worker (thread number
    # 1) that finds the job's "done" flag set returns without calling the body (which would
    # take the GIL); the caller (thread number 0) always calls it
    import ctypes
    entry = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(cpu_team._team_entry_address())
    bodies = []
    body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda address: bodies.append(address))
    for thread_num in (0, 1):
        number = ctypes.CFUNCTYPE(ctypes.c_int)(lambda n=thread_num: n)
        for done in (0, 1):
            data = np.zeros(cpu_team._ENTRY_DONE + cpu_team.SLOT, np.int64)
            data[cpu_team._ENTRY_BODY] = ctypes.cast(body, ctypes.c_void_p).value
            data[cpu_team._ENTRY_THREAD_NUM] = ctypes.cast(number, ctypes.c_void_p).value
            data[cpu_team._ENTRY_DONE] = done          # clock 0: no waits
            bodies.clear()
            entry(data.ctypes.data)
            assert bodies == ([] if thread_num and done else [data.ctypes.data]), \
                (thread_num, done)


@pytest.mark.torch
def test_with_torch_imported_calls_run_on_its_team(torch_team, monkeypatch):
    runs = _spy_team_runs(monkeypatch)
    assert _launch.backend() == "torch-openmp"
    ran = _sleepy_launch(12)
    assert runs == [2]
    assert sorted(t for t, _ in ran) == list(range(12))             # every task once
    workers = {ident for _, ident in ran}
    assert len(workers) == 2 and threading.get_ident() in workers   # the caller and one more
    pool_threads = {t.ident for t in threading.enumerate() if t.name.startswith("numbafuse-")}
    assert not workers & pool_threads                               # not numbafuse's helpers


@pytest.mark.torch
def test_the_team_has_at_most_numbafuses_and_torchs_threads(torch_team, monkeypatch):
    runs = _spy_team_runs(monkeypatch)
    torch_team.set_num_threads(3)                       # numbafuse has 2: a team of 2
    assert len({ident for _, ident in _sleepy_launch(12)}) == 2
    _launch.set_num_threads(3)                          # both 3
    assert len({ident for _, ident in _sleepy_launch(12)}) == 3
    assert runs == [2, 3]
    torch_team.set_num_threads(1)                       # torch on one thread: own pool
    assert _launch.backend() == "own-pool"
    assert sorted(t for t, _ in _sleepy_launch(6)) == list(range(6))
    assert runs == [2, 3]


@pytest.mark.torch
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_torch_team_and_own_pool_agree_bitwise(layout, torch_team, monkeypatch):
    runs = _spy_team_runs(monkeypatch)
    on_team = _work(layout)
    assert runs, "no call ran on torch's team"
    monkeypatch.setattr(_launch, "SHARE_TORCH_TEAM", False)
    assert _launch.backend() == "own-pool"
    own = _work(layout)
    _launch.set_num_threads(1)
    serial = _work(layout)
    for a, b, c in zip(on_team, own, serial):
        assert a.tobytes() == b.tobytes() == c.tobytes()


@pytest.mark.torch
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_compiled_and_python_launches_on_the_team_agree_bitwise(layout, torch_team,
                                                                  monkeypatch):
    # kernels/cpu/native.py: the same tasks, run by compiled code on each team thread
    native = []
    runs = _spy_team_runs(monkeypatch, native=native)
    monkeypatch.setattr(_launch, "NATIVE", True)
    compiled = _work(layout)
    assert native and not runs or len(runs) < len(native)       # (concurrently's: Python)
    monkeypatch.setattr(_launch, "NATIVE", False)
    count = len(native)
    python = _work(layout)
    assert len(native) == count and runs
    for a, b in zip(compiled, python):
        assert a.tobytes() == b.tobytes()


@pytest.mark.torch
def test_an_error_on_torchs_team_reaches_the_caller(torch_team):
    def kernel(t0, t1):
        if t0 <= 5 < t1:
            raise KeyError("task 5")
    with pytest.raises(KeyError, match="task 5"):
        _launch.launch(kernel, 8, work=10**9, grain=1)
    assert sorted(t for t, _ in _sleepy_launch(4)) == list(range(4))   # the team still works


@pytest.mark.torch
def test_team_regions_from_two_threads_at_once_each_run_their_job(torch_team, monkeypatch):
    # one region at a time runs on the team's one data buffer (launch's own calls); a region
    # that meets it in use (run called from two threads at once) gets data of its own: both
    # jobs run every task once, on two threads each
    import time
    team = _launch.torch_team()
    made = []
    original = team._region_data
    monkeypatch.setattr(team, "_region_data", lambda: made.append(1) or original())
    ran = {0: [], 1: []}
    started = threading.Barrier(2)

    def call(i):
        def kernel(t0, t1):
            for t in range(t0, t1):
                time.sleep(0.02)
                ran[i].append((t, threading.get_ident()))
        started.wait()
        team.run(_launch._Job(kernel, 8, 1, ()), 2, 0, 0, 0)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [1]                                  # one region on data of its own
    for i in range(2):
        assert sorted(t for t, _ in ran[i]) == list(range(8))
        assert len({ident for _, ident in ran[i]}) == 2


@pytest.mark.torch
def test_concurrent_calls_beside_torch(torch_team):
    _concurrent_callers("NHWC")


def _child_backend(queue):
    queue.put((_launch.backend(), [a.tobytes() for a in _work("NCHW")]))


@pytest.mark.torch
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX-only")
def test_forked_child_of_a_torch_process_uses_its_own_pool(torch_team, monkeypatch):
    runs = _spy_team_runs(monkeypatch)
    parent = _work("NCHW")                  # torch's team has run numbafuse's tasks
    assert runs
    assert _in_forked_child(_child_backend) == ("own-pool", [a.tobytes() for a in parent])
