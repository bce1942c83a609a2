"""Test configuration: Hypothesis profiles, the injected ``backend`` and the CUDA fixtures.

Profiles (choose with HYPOTHESIS_PROFILE=dev|quick|ci|thorough; default "dev"):
``dev`` is for editing, ``ci`` is what .ci/run uses on the newest Python and ``quick`` on the
oldest (both derandomized), ``thorough`` is for a long local run. Expensive property tests
(gradcheck, the simulator) scale their example counts from the profile
(``tests/harness.py``: ``budget``), so every profile deepens every test; none pins a count.

Backends: a test with a ``backend`` argument runs once per backend of ``tests/harness.py``
(``BACKENDS``): the CPU kernels, and the CUDA kernels under the ``cuda`` marker. Tests in
``tests/cuda/`` (CUDA-only: device arithmetic, modules on the device, the GPU benchmark) are
marked ``cuda`` too. CUDA tests run in their own process, under NUMBA_ENABLE_CUDASIM=1 or on a
GPU (the simulator is chosen when numba is first imported, so never in the CPU process):
``python -m pytest -m "not cuda"`` then ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cuda``.
The fixtures below apply to every ``cuda``-marked test, wherever it lives.
"""
import contextlib
import math
import os
import sys
import threading
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# the kernels under test, not NumPy, on every first call (kernels/cpu/first_calls.py); set
# before numbafuse is imported, and inherited by the tests' subprocesses
os.environ.setdefault("NUMBAFUSE_FIRST_CALL_WAIT", "inf")

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("dev", max_examples=10, **_common)
# quick (CI's oldest leg) and ci (its newest): drawn examples per property test, sized so that
# .ci/run stays under 20 minutes (each example of the ci profile costs the CPU suite ~6 s on
# machine E). 9 and 18 until 2026-11-30: on an AVX2 machine (Zen 3, 2 cores, ~2x slower in
# these suites) .ci/run took 30 min (oldest leg 1805 s: CPU 633, simulator 1045), hence 5 and
# 10 (expensive checks keep harness.MIN_EXAMPLES)
settings.register_profile("quick", max_examples=5, derandomize=True, **_common)
settings.register_profile("ci", max_examples=10, derandomize=True, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
CUDA_ONLY_DIR = os.path.join(os.path.dirname(__file__), "cuda")


def pytest_generate_tests(metafunc):
    """Inject the backends: ``def test_x(backend)`` runs on the CPU and on CUDA."""
    if "backend" in metafunc.fixturenames:
        from .harness import backend_params
        metafunc.parametrize("backend", backend_params())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(CUDA_ONLY_DIR):
            item.add_marker(pytest.mark.cuda)
    keep, drop = [], []
    for item in items:
        cuda = item.get_closest_marker("cuda") is not None
        if SIMULATOR and cuda and SIMULATOR_SHARDS is not None and SIMULATOR_SHARDS[0]:
            out = not in_shard(item.nodeid, SIMULATOR_SHARDS)
        elif not SIMULATOR and not cuda and CPU_SHARDS is not None:
            out = (os.path.basename(str(item.fspath)) not in UNSHARDED
                   and not in_shard(item.nodeid, CPU_SHARDS))
        else:
            out = False
        (drop if out else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# A test that needs PyTorch runs in one CI leg only: .ci/run's torch leg, which selects
# ``-m torch``; the other legs have no torch and skip it. Unmarked, it is skipped in the legs
# without torch and deselected in the one with it: it never runs (until 2026-12-04 the
# compiled launches on PyTorch's team, tests/test_native_launch.py, and
# tests/test_profile_resnet.py were such). So a skip for want of torch fails a test without the
# marker. (A module that skips at import: tests/test_markers.py reads its source.)
TORCH_SKIP_WORDS = ("'torch'", "PyTorch is not installed")


def unmarked_torch_skip(item, skipped):
    """Why the test ``item``, skipped with the exception ``skipped``, fails instead: it was
    skipped for want of PyTorch and has no ``torch`` marker; else None."""
    if item.get_closest_marker("torch") is not None:
        return None
    if not any(w in str(skipped) for w in TORCH_SKIP_WORDS):
        return None
    return (f"{item.nodeid} needs PyTorch ({skipped}) but is not marked torch: no CI leg "
            "would run it (mark it pytest.mark.torch)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and call.excinfo is not None:
        why = unmarked_torch_skip(item, call.excinfo.value)
        if why is not None:
            report.outcome, report.longrepr = "failed", why


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _is_cuda(request):
    return request.node.get_closest_marker("cuda") is not None


def _shards(name, value):
    """NUMBAFUSE_TEST_SIMULATOR / NUMBAFUSE_TEST_CPU: "1" (default) runs every test of the
    kind, "0" none, "i/n" or "i,j,.../n" the shards i (and j, ...) of n. .ci/run splits the
    simulator's tests (the simulated kernels do not depend on the Python version) between two
    legs, and runs the CPU tests whole in a third (they are mostly compiling, which a split
    between processes would repeat) and a small shard of them on the other two Pythons; a
    test's shard is a hash of its id, the same in every process.
    Returns None (all), or (set of shards, n)."""
    if value == "1":
        return None
    if value == "0":
        # simulator: its tests skipped, not deselected (pytest fails a run that selects none);
        # CPU: deselected but for the sm_90 files, which skip themselves unless asked for
        return set(), 1
    try:
        picked, n = value.split("/")
        shards, n = {int(i) for i in picked.split(",")}, int(n)
        if n < 1 or not shards <= set(range(n)):
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"{name} must be 1, 0, 'i/n' or 'i,j/n' "
                                f"with shards below n, got {value!r}") from None
    return shards, n


SIMULATOR_SHARDS = _shards("NUMBAFUSE_TEST_SIMULATOR",
                           os.environ.get("NUMBAFUSE_TEST_SIMULATOR", "1"))
CPU_SHARDS = _shards("NUMBAFUSE_TEST_CPU", os.environ.get("NUMBAFUSE_TEST_CPU", "1"))
# the sm_90 compilations run whole in the leg that has NUMBAFUSE_TEST_SM90 on
UNSHARDED = ("test_ptx.py", "test_sass.py")


def in_shard(nodeid, shards=None):
    picked, n = shards or SIMULATOR_SHARDS
    return zlib.crc32(nodeid.encode()) % n in picked


@pytest.fixture(autouse=True)
def _cuda_available(request):
    if _is_cuda(request) and SIMULATOR and SIMULATOR_SHARDS == (set(), 1):
        pytest.skip("NUMBAFUSE_TEST_SIMULATOR=0")
    if _is_cuda(request) and not SIMULATOR:
        from numba import cuda
        if not cuda.is_available():
            pytest.skip("no GPU and NUMBA_ENABLE_CUDASIM is not set")


@pytest.fixture
def conv_rules():
    """``set(**changes)``: the CPU conv passes of the rest of the test plan by the current rules
    with ``changes`` (``kernels/conv/cpu_plan.using``; undone when the test ends)."""
    from numbafuse.kernels.conv import cpu_plan
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(cpu_plan.using(**changes))


@pytest.fixture(scope="module")
def compiled_in_workers(request):
    """For tests/test_ptx.py and test_sass.py (their ``pytestmark``): the kernels this run's
    tests of the module check, compiled to PTX first, in worker processes side by side
    (``cuda_sass.compile_all``: faster than compiling in this process); the tests read them
    from the cache ``cuda_sass.compile_ptx`` keeps."""
    import numba

    from numbafuse.kernels import catalog
    from numbafuse.testing import cuda_sass
    wanted = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and "kernel" in params:
            sig = params["signature"]
            if "ftype" in params:                       # test_ptx: a signature per dtype
                sig = sig(getattr(numba, params["ftype"]))
            wanted.add((id(params["kernel"]), str(sig)))
    cuda_sass.compile_all([c for c in catalog.cases() if (id(c[1]), str(c[2])) in wanted])


@pytest.fixture(autouse=True)
def small_launches(request, monkeypatch):
    """Shrink launch sizes (simulator only) so several blocks run on tiny inputs."""
    if _is_cuda(request) and SIMULATOR:
        from numbafuse.kernels.cuda import config
        monkeypatch.setattr(config, "threads", 8)
        monkeypatch.setattr(config, "max_blocks", 3)
        monkeypatch.setattr(config, "reduce_blocks", 3)
        # conv GEMMs: an 8 x 8 tile of 16 threads, K-steps of 4, and a few dw splits, so
        # tiny convolutions cross every tile boundary (the production tilings are compiled
        # to sm_90 and checked in tests/test_ptx.py and tests/test_sass.py)
        monkeypatch.setattr(config, "tile_override", config.TINY_TILE)
        monkeypatch.setattr(config, "dw_target_blocks", 24)
        # the tiled matmul's TILE x TILE blocks (compile-time on a GPU, where it is 16: 256
        # threads a block; the simulator reads the module's constant when a kernel runs)
        from numbafuse.kernels.basic import cuda as basic_cuda
        monkeypatch.setattr(basic_cuda, "TILE", 4)
    yield


@pytest.fixture(autouse=True)
def uniform_barriers(request, monkeypatch):
    """Simulator only: fail a test whose kernel lets part of a block skip a ``syncthreads()``
    or reach a different one (a deadlock or undefined behaviour on a GPU).

    The simulator releases a barrier once every *live* thread waits at *some* barrier, so a
    thread that left a grid-stride loop early, or a barrier inside a branch, goes unnoticed
    there. This records, per block, the sequence of barrier call sites of every thread and
    checks after the test that all the block's threads went through the same sequence.
    """
    if not (_is_cuda(request) and SIMULATOR):
        yield
        return
    from numba.cuda.simulator import kernelapi
    logs = {}                  # (block manager, blockIdx) -> {thread_id: [call sites]}
    lock = threading.Lock()
    real = kernelapi.FakeCUDAModule.syncthreads

    def syncthreads(self):
        thread = threading.current_thread()
        caller = sys._getframe(1)
        site = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        b = thread.blockIdx
        with lock:
            logs.setdefault((thread._manager, (b.x, b.y, b.z)), {}) \
                .setdefault(thread.thread_id, []).append(site)
        real(self)

    monkeypatch.setattr(kernelapi.FakeCUDAModule, "syncthreads", syncthreads)
    yield
    problems = []
    for (manager, block), per_thread in logs.items():
        size = math.prod(manager._block_dim)
        sequences = {tuple(sites) for sites in per_thread.values()}
        if len(per_thread) != size or len(sequences) != 1:
            problems.append(
                f"block {block}: {size - len(per_thread)} of {size} threads never reached a "
                f"syncthreads() and {len(sequences)} different barrier sequences were taken: "
                f"{sorted(sequences, key=len)[:2]}")
    if request.node.get_closest_marker("divergent_barriers"):    # the check's own test
        assert problems, "a kernel with divergent barriers was not caught"
    else:
        assert not problems, problems[0]


@pytest.fixture
def warp_shuffles(monkeypatch):
    """Simulator only: ``cuda.shfl_down_sync`` and ``cuda.ballot_sync`` for full warps, so that
    the shuffle and vote paths real GPUs take (behind ``not ENABLE_CUDASIM``; patch the
    module's flag too) can run here.

    Only ``FULL_MASK`` over blocks of whole warps is modelled; every lane of the warp must call
    it (a lane that does not makes the others time out with ``BrokenBarrierError``, where a
    GPU would hang or read garbage).
    """
    from numba.cuda.simulator import kernelapi
    warps = {}                 # (block manager, blockIdx, warp) -> (values, barrier)
    lock = threading.Lock()

    def shfl_down_sync(self, mask, value, delta):
        assert mask == 0xFFFFFFFF, f"only full-warp shuffles are modelled, mask {mask:#x}"
        thread = threading.current_thread()
        assert math.prod(thread._manager._block_dim) % 32 == 0, "a partial warp shuffles"
        b = thread.blockIdx
        key = (thread._manager, (b.x, b.y, b.z), thread.thread_id // 32)
        with lock:
            if key not in warps:
                warps[key] = ([None] * 32, threading.Barrier(32, timeout=30))
        values, barrier = warps[key]
        lane = thread.thread_id % 32
        values[lane] = value
        barrier.wait()         # every lane's value is published
        out = values[lane + delta] if lane + delta < 32 else value
        barrier.wait()         # every lane has read before the next shuffle overwrites
        return out

    def ballot_sync(self, mask, predicate):
        assert mask == 0xFFFFFFFF, f"only full-warp votes are modelled, mask {mask:#x}"
        thread = threading.current_thread()
        assert math.prod(thread._manager._block_dim) % 32 == 0, "a partial warp votes"
        b = thread.blockIdx
        key = (thread._manager, (b.x, b.y, b.z), thread.thread_id // 32, "ballot")
        with lock:
            if key not in warps:
                warps[key] = ([None] * 32, threading.Barrier(32, timeout=30))
        values, barrier = warps[key]
        lane = thread.thread_id % 32
        values[lane] = bool(predicate)
        barrier.wait()         # every lane's predicate is published
        word = np.uint32(sum(1 << i for i, v in enumerate(values) if v))   # a uint32 on a GPU
        barrier.wait()         # every lane has read before the next vote overwrites
        return word

    monkeypatch.setattr(kernelapi.FakeCUDAModule, "shfl_down_sync", shfl_down_sync,
                        raising=False)
    monkeypatch.setattr(kernelapi.FakeCUDAModule, "ballot_sync", ballot_sync, raising=False)
    yield


# tests/mpi runs under mpiexec (tests/test_mpi.py launches it); elsewhere it is not collected.
UNDER_MPI = any(v in os.environ for v in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE"))
collect_ignore = [] if UNDER_MPI else ["mpi"]
