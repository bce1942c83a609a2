"""CUDA tests: run under the simulator (NUMBA_ENABLE_CUDASIM=1) or on a real GPU.

Every test here is marked ``cuda``. Launch sizes are shrunk so tiny inputs span several
blocks, and the simulator's per-thread cost stays small.
"""
import math
import os
import sys
import threading

import numpy as np
import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True)
def _cuda_available():
    from numba import cuda
    if not SIMULATOR and not cuda.is_available():
        pytest.skip("no GPU and NUMBA_ENABLE_CUDASIM is not set")


@pytest.fixture(autouse=True)
def small_launches(monkeypatch):
    """Shrink launch sizes (simulator only) so several blocks run on tiny inputs."""
    if SIMULATOR:
        from numbafuse.kernels import cuda_config as config
        monkeypatch.setattr(config, "threads", 8)
        monkeypatch.setattr(config, "max_blocks", 3)
        monkeypatch.setattr(config, "reduce_blocks", 3)
        # conv GEMMs: an 8 x 8 tile of 16 threads, K-steps of 4, and a few dw splits, so
        # tiny convolutions cross every tile boundary (the production tilings are compiled
        # to sm_90 and checked in tests/test_ptx.py and tests/test_sass.py)
        monkeypatch.setattr(config, "tile_override", config.TINY_TILE)
        monkeypatch.setattr(config, "dw_target_blocks", 24)
    yield


@pytest.fixture(autouse=True)
def uniform_barriers(monkeypatch):
    """Simulator only: fail a test whose kernel lets part of a block skip a ``syncthreads()``
    or reach a different one (a deadlock or undefined behaviour on a GPU).

    The simulator releases a barrier once every *live* thread waits at *some* barrier, so a
    thread that left a grid-stride loop early, or a barrier inside a branch, goes unnoticed
    there. This records, per block, the sequence of barrier call sites of every thread and
    checks after the test that all the block's threads went through the same sequence.
    """
    if not SIMULATOR:
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
    for (manager, block), per_thread in logs.items():
        size = math.prod(manager._block_dim)
        sequences = {tuple(sites) for sites in per_thread.values()}
        assert len(per_thread) == size and len(sequences) == 1, (
            f"block {block}: {size - len(per_thread)} of {size} threads never reached a "
            f"syncthreads() and {len(sequences)} different barrier sequences were taken: "
            f"{sorted(sequences, key=len)[:2]}")


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
