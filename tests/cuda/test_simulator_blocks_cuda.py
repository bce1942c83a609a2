"""The simulator's thread blocks as numbafuse.cuda runs them (``compat.speed_up_simulator``:
a condition variable instead of numba-cuda's polling loop) keep numba-cuda's rules: barriers
in loops and branches, threads that leave early, ``syncthreads_count``, a thread's exception
raised by the launch, and (tests/conftest.py's ``uniform_barriers``) a block whose threads
take different barriers is caught. Each check runs under both schedulers."""
import numpy as np
import pytest
from numba import float64, int32

from numbafuse.cuda import SIMULATOR, compat
from numbafuse.cuda import numba_cuda as cuda

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the simulator's scheduler")

THREADS = 8


@pytest.fixture(params=["sleeping", "polling"])
def scheduler(request, monkeypatch):
    from numba.cuda.simulator import kernel
    if request.param == "polling":          # numba-cuda's own methods, kept by compat
        monkeypatch.setattr(kernel.BlockManager, "run", kernel.BlockManager._polling_run)
        monkeypatch.setattr(kernel.BlockThread, "syncthreads",
                            kernel.BlockThread._polling_syncthreads)
        monkeypatch.setattr(kernel.BlockThread, "run", kernel.BlockThread._polling_body)
    return request.param


def test_numbafuse_runs_the_sleeping_blocks():
    from numba.cuda.simulator import kernel
    assert kernel.BlockManager.run is compat._run_block
    assert compat.speed_up_simulator(kernel)          # idempotent


@cuda.jit
def _tree_sums(x, out):
    s = cuda.shared.array(THREADS, float64)
    t = cuda.threadIdx.x
    s[t] = x[cuda.blockIdx.x * THREADS + t]
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:                          # a barrier in a loop, a branch between them
        if t < step:
            s[t] += s[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[cuda.blockIdx.x] = s[0]


@cuda.jit
def _early_exit(out, live):
    s = cuda.shared.array(THREADS, int32)
    t = cuda.threadIdx.x
    s[t] = t
    if t >= live:
        return                               # leaves before the barrier the others reach
    cuda.syncthreads()
    out[cuda.blockIdx.x, t] = s[(t + 1) % live] + cuda.syncthreads_count(t % 2 == 0)


@cuda.jit
def _out_of_bounds(x):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    x[t * 2] = 1.0                           # past the end for the upper half of the block


@cuda.jit
def _divergent_barrier(x):
    t = cuda.threadIdx.x
    if t < 4:
        cuda.syncthreads()                   # half the block waits here ...
    else:
        cuda.syncthreads()                   # ... and half here: a hang or UB on a GPU
    x[t] = t


def test_barriers_in_loops_and_branches(scheduler):
    x = np.arange(3 * THREADS, dtype=np.float64) ** 1.5
    out = np.zeros(3)
    _tree_sums[3, THREADS](x, out)
    np.testing.assert_allclose(out, x.reshape(3, THREADS).sum(axis=1))


# threads that leave early never reach the barrier: the simulator releases the others (as
# numba-cuda does), and uniform_barriers reports it (undefined on a GPU), hence the marks
@pytest.mark.parametrize("live", [pytest.param(1, marks=pytest.mark.divergent_barriers),
                                  pytest.param(3, marks=pytest.mark.divergent_barriers),
                                  THREADS])
def test_threads_that_leave_before_a_barrier(scheduler, live):
    out = np.full((2, THREADS), -1, np.int32)
    _early_exit[2, THREADS](out, live)
    t = np.arange(live)
    expected = (t + 1) % live + (live + 1) // 2        # s[t+1] + even threads among the live
    assert (out[:, :live] == expected).all() and (out[:, live:] == -1).all()


def test_a_threads_exception_is_raised_and_the_next_launch_runs(scheduler):
    x = np.zeros(THREADS)
    with pytest.raises(IndexError, match=r"tid=\["):
        _out_of_bounds[1, THREADS](x)
    out = np.zeros(1)
    _tree_sums[1, THREADS](np.ones(THREADS), out)
    assert out[0] == THREADS


@pytest.mark.divergent_barriers
def test_the_uniform_barrier_check_catches_divergent_barriers(scheduler):
    # the simulator releases the block; conftest's uniform_barriers, asked by the marker,
    # fails this test at teardown unless it found the two barrier sequences
    x = np.zeros(THREADS)
    _divergent_barrier[1, THREADS](x)
    assert (x == np.arange(THREADS)).all()


# --------------------------------------------------------------------------- barrier-free blocks

@cuda.jit
def _grid_ids(out):
    # each thread writes its own ids: a block of (4, 2) threads in a (3, 2) grid
    x, y = cuda.grid(2)
    t = cuda.threadIdx.x + cuda.blockDim.x * cuda.threadIdx.y
    out[x, y, 0] = t
    out[x, y, 1] = cuda.blockIdx.x + 10 * cuda.blockIdx.y
    out[x, y, 2] = cuda.laneid


@cuda.jit
def _past_the_end(x):
    x[cuda.threadIdx.x * 2] = 1.0          # no barrier: past the end for the upper half


@cuda.jit(device=True)
def _block_sum_device(s, t):
    cuda.syncthreads()                      # a device function's barrier
    return s[0] + t


@cuda.jit
def _barrier_in_a_device_function(out):
    s = cuda.shared.array(1, float64)
    out[cuda.threadIdx.x] = _block_sum_device(s, cuda.threadIdx.x)


def _make_closure_kernel():
    helper = _block_sum_device

    @cuda.jit
    def kernel(out):
        out[cuda.threadIdx.x] = helper(out, 0)
    return kernel


def test_barrier_free_kernels_run_their_threads_in_order_on_the_launching_thread():
    """A kernel that reaches no barrier runs each block's threads one after another on the
    launching thread (compat._run_sequentially), each with its own ids; kernels that reach
    one, in their own code, a device function, a module's function or a closure, keep a
    thread each."""
    assert compat._sequential(_grid_ids.py_func)
    assert compat._sequential(_past_the_end.py_func)
    for kernel in (_tree_sums, _early_exit, _out_of_bounds, _divergent_barrier,
                   _barrier_in_a_device_function, _make_closure_kernel()):
        assert not compat._sequential(kernel.py_func), kernel
    from numbafuse.kernels.batchnorm import cuda as bn_cuda   # through a module attribute
    from numbafuse.kernels.elementwise import cuda as ew_cuda
    assert not compat._sequential(bn_cuda._apply.py_func)     # _apply_walk's shared array
    assert compat._sequential(ew_cuda._fill.py_func)
    import threading
    started = threading.active_count()
    out = np.full((12, 4, 3), -1, np.int64)
    _grid_ids[(3, 2), (4, 2)](out)
    assert threading.active_count() == started                # no thread was started
    assert not hasattr(threading.current_thread(), "threadIdx")   # and the ids are gone
    x, y = np.meshgrid(np.arange(12), np.arange(4), indexing="ij")
    assert (out[..., 0] == x % 4 + 4 * (y % 2)).all()
    assert (out[..., 1] == x // 4 + 10 * (y // 2)).all()
    assert (out[..., 2] == out[..., 0] % 32).all()


def test_a_barrier_free_threads_exception_names_the_thread():
    x = np.zeros(THREADS)
    with pytest.raises(IndexError, match=r"tid=\[4, 0, 0\] ctaid=\[0, 0, 0\]"):
        _past_the_end[2, THREADS](x)
    assert not hasattr(__import__("threading").current_thread(), "threadIdx")
    out = np.zeros(1)
    _tree_sums[1, THREADS](np.ones(THREADS), out)
    assert out[0] == THREADS


@pytest.mark.parametrize("lookup", ["locked", "unlocked"])
def test_a_blocks_threads_share_one_shared_array_however_they_interleave(lookup, monkeypatch):
    """numba-cuda's simulator made a block's shared array by a look-up and then a store with no
    lock between them: a thread switch there gave threads arrays of their own (a CI flake of
    tests/cuda/test_graph_cuda.py's fit test). Forced here: every look-up waits at a barrier
    of the block's threads, so every thread looks up before any stores (under the lock only
    one thread can look up at a time: the first wait times out, the barrier breaks, and the
    look-ups go on one by one). numbafuse's lock (compat.lock_shared_arrays) keeps one array;
    numba-cuda's own method, put back, loses the other threads' values (so this test can tell
    them apart). (A 2 ms sleep instead of the barrier let a block whose threads started late
    share the first thread's array: the unlocked case passed once in CI's oldest leg.)"""
    import threading

    from numba.cuda.simulator import kernelapi
    assert kernelapi.FakeCUDAShared.array is compat._shared_array
    assert compat.lock_shared_arrays(kernelapi)           # idempotent
    if lookup == "unlocked":
        monkeypatch.setattr(kernelapi.FakeCUDAShared, "array",
                            kernelapi.FakeCUDAShared._unlocked_array)

    everyone = threading.Barrier(THREADS)

    class SlowLookups(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            try:                              # the block's other threads look up meanwhile
                everyone.wait(timeout=0.5)
            except threading.BrokenBarrierError:
                pass
            return found

    made = kernelapi.FakeCUDAShared.__init__

    def init(self, dynshared_size):
        made(self, dynshared_size)
        self._allocations = SlowLookups()

    monkeypatch.setattr(kernelapi.FakeCUDAShared, "__init__", init)
    x = np.arange(2 * THREADS, dtype=np.float64)
    out = np.zeros(2)
    _tree_sums[2, THREADS](x, out)
    want = x.reshape(2, THREADS).sum(axis=1)
    if lookup == "locked":
        np.testing.assert_array_equal(out, want)
    else:
        assert not np.array_equal(out, want)
