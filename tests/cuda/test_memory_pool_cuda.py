"""numbafuse's device memory pool (numbafuse/cuda/): reuse after release, never while alive,
and memory_stats(). Under the simulator the pool keeps CUDA's accounting over
cuda.device_array; on a GPU it is CUDA's stream-ordered pool."""
import gc

import numpy as np

from numbafuse import cuda as nfcuda


def _stats():
    gc.collect()
    return nfcuda.memory_stats()


def test_a_released_block_is_reused_and_a_live_one_is_not():
    before = _stats()
    a = nfcuda.empty((64, 3), np.float32)
    b = nfcuda.empty((64, 3), np.float32)                 # a is alive: a new block
    after_two = _stats()
    assert after_two["requests"] - before["requests"] == 2
    new = after_two["allocations"] - before["allocations"]
    assert new <= 2
    assert after_two["bytes_in_use"] - before["bytes_in_use"] == 2 * 64 * 3 * 4
    del a, b
    released = _stats()
    assert released["bytes_in_use"] == before["bytes_in_use"]
    c = nfcuda.empty((3, 64), np.float32)                 # same bytes: served from the pool
    d = nfcuda.empty((192,), np.float32)
    again = _stats()
    assert again["allocations"] == after_two["allocations"]
    assert again["bytes_reserved"] == after_two["bytes_reserved"]
    del c, d


def test_a_view_keeps_its_block_in_use():
    start = _stats()
    a = nfcuda.empty((8, 8), np.float64)
    view = a.reshape(64)
    del a
    mid = _stats()
    assert mid["bytes_in_use"] - start["bytes_in_use"] == 64 * 8
    del view
    assert _stats()["bytes_in_use"] == start["bytes_in_use"]


def test_pool_arrays_hold_what_is_written():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    d = nfcuda.to_device(x)
    np.testing.assert_array_equal(d.copy_to_host(), x)
    assert d.is_c_contiguous()


def test_flat_and_rows_view_the_array():
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    d = nfcuda.to_device(x)
    np.testing.assert_array_equal(nfcuda.flat(d).copy_to_host(), x.ravel())
    for i, row in enumerate(nfcuda.rows(d)):
        np.testing.assert_array_equal(row.copy_to_host(), x[i])


def test_empty_cache_hands_the_free_blocks_back():
    a = nfcuda.empty(1000, np.float32)
    held = _stats()["bytes_cached"]
    del a
    assert _stats()["bytes_cached"] == held + 4000           # kept for the next request
    nfcuda.empty_cache()
    after = _stats()
    assert after["bytes_cached"] == 0
    b = nfcuda.empty(1000, np.float32)                        # a new block again
    assert _stats()["bytes_in_use"] == after["bytes_in_use"] + 4000
    del b
