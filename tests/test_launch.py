"""CPU kernels run on the calling thread alone for small inputs (kernels/cpu/launch.py).

Property tests draw small shapes, which run on the calling thread; here the same ops run with
the threshold at 0 (every kernel on the pool) and at infinity (every kernel on the calling
thread), and must agree bit for bit with each other and with the reference.
"""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference
from numbafuse.kernels.cpu import launch as _launch


def _run_all(x, w, b, z, gamma, beta, layout):
    y = nf.conv_bias_relu(x, w, b, padding=1, layout=layout)
    grads = nf.conv_bias_relu_backward(np.ones_like(y), x, w, y, padding=1, layout=layout)
    rm, rv = np.zeros_like(gamma), np.ones_like(gamma)
    out = nf.batchnorm_add_relu(y, z, gamma, beta, running_mean=rm, running_var=rv,
                                layout=layout)
    bn_grads = nf.batchnorm_add_relu_backward(np.ones_like(out), y, z, gamma, beta,
                                              layout=layout, y=out)
    pooled = nf.max_pool2d(nf.relu(out), 2, layout=layout)
    return [y, *grads, out, rm, rv, *bn_grads, pooled]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_parallel_and_serial_builds_agree(layout, monkeypatch, rng):
    shape = (3, 4, 6, 6) if layout == "NCHW" else (3, 6, 6, 4)
    x = rng.standard_normal(shape).astype(np.float32)
    z = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, 4).astype(np.float32), np.zeros(4, np.float32)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    parallel = _run_all(x, w, b, z, gamma, beta, layout)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 2**62)
    serial = _run_all(x, w, b, z, gamma, beta, layout)
    for p, s in zip(parallel, serial):
        assert p.tobytes() == s.tobytes()
    ref = reference.conv_bias_relu(x, w, b, padding=1, layout=layout)
    np.testing.assert_allclose(parallel[0], ref, rtol=1e-4, atol=1e-5)


def test_threshold_picks_the_threads(monkeypatch):
    """Below PARALLEL_MIN_ELEMENTS a launch is one call on the calling thread."""
    import threading

    calls = []

    def kernel(t0, t1):
        calls.append((t0, t1, threading.get_ident()))

    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 10)
    _launch.launch(kernel, 8, work=9)
    assert calls == [(0, 8, threading.get_ident())]
    calls.clear()
    _launch.launch(kernel, 8, work=10)
    assert sorted(t for c in calls for t in range(c[0], c[1])) == list(range(8))
    if _launch.num_threads() > 1:
        assert len(calls) > 1                          # ranges handed out, not one call
    # a launch's own threshold (parallel_min) in place of PARALLEL_MIN_ELEMENTS
    calls.clear()
    _launch.launch(kernel, 8, work=99, parallel_min=100)
    assert calls == [(0, 8, threading.get_ident())]
    calls.clear()
    _launch.launch(kernel, 8, work=100, parallel_min=100, grain=1)
    assert sorted(t for c in calls for t in range(c[0], c[1])) == list(range(8))
    if _launch.num_threads() > 1:
        assert len(calls) > 1


def test_concurrently_runs_each_call_whole_on_one_thread(monkeypatch):
    """cpu.launch.concurrently: the calls' results in order, every launch inside a call on
    that call's thread (the helpers are taken), both calls at once when there are helpers, and
    a call's error raised on the caller."""
    import threading

    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    threads = _launch.num_threads()
    _launch.set_num_threads(2)
    barrier = threading.Barrier(2, timeout=10)   # both calls must run at the same time

    def call(tag):
        def run():
            me = threading.get_ident()
            barrier.wait()
            seen = []
            _launch.launch(lambda t0, t1: seen.append((t0, t1, threading.get_ident())), 6,
                           work=10**9)
            assert {t for _, _, t in seen} == {me}          # inline, on this thread
            assert sorted(t for t0, t1, _ in seen for t in range(t0, t1)) == list(range(6))
            return tag, me
        return run

    def fails():
        raise KeyError("from a concurrent call")

    try:
        (a, ta), (b, tb) = _launch.concurrently(call("a"), call("b"), work=10**9)
        assert (a, b) == ("a", "b") and ta != tb
        with pytest.raises(KeyError, match="from a concurrent call"):
            _launch.concurrently(lambda: None, fails, work=10**9)
    finally:
        _launch.set_num_threads(threads)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_launch_all_runs_every_task_of_every_launch_once(monkeypatch, threads):
    """cpu.launch.launch_all: each launch's tasks [0, n) run exactly once, with that launch's
    arguments and its own task numbers (empty launches skipped); on one thread each launch is
    one whole call; the first error is raised on the caller."""
    import threading

    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    saved = _launch.num_threads()
    _launch.set_num_threads(threads)
    seen, lock = [], threading.Lock()

    def kernel(t0, t1, tag, scale):
        with lock:
            seen.append((tag, t0, t1, scale))

    sizes = {"a": 3, "b": 0, "c": 5, "d": 1}
    try:
        _launch.launch_all([(kernel, n, (tag, 10 * n)) for tag, n in sizes.items()],
                           work=10**9)
        for tag, n in sizes.items():
            calls = [c for c in seen if c[0] == tag]
            assert sorted(t for _, t0, t1, _ in calls for t in range(t0, t1)) == list(range(n))
            assert all(c[3] == 10 * n for c in calls)
            if threads == 1 and n:
                assert [c[1:3] for c in calls] == [(0, n)]     # each launch whole
        if threads > 1:
            assert len(seen) == sum(sizes.values())          # ranges of one task

        def fails(t0, t1):
            raise KeyError("from a shared job")
        with pytest.raises(KeyError, match="from a shared job"):
            _launch.launch_all([(kernel, 2, ("e", 0)), (fails, 2, ())], work=10**9)
    finally:
        _launch.set_num_threads(saved)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("winograd", [False, True])
def test_conv_backward_concurrent_shared_and_in_turn_agree(layout, winograd, monkeypatch, rng,
                                                            conv_rules):
    """dX and dW one pass a thread (the conv rules' concurrent_max_elements, im2col here),
    their tasks in one shared job (shared_backward, the Winograd passes: min_gemm_channels
    1), or one after the other, each split over the pool: bit for bit the same gradients, on
    1 and 3 threads, and the reference's."""
    from numbafuse.kernels.conv import cpu as conv_cpu, cpu_plan

    shape = (5, 4, 7, 9) if layout == "NCHW" else (5, 7, 9, 4)
    x = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((3, 4, 3, 3)) * 0.3).astype(np.float32)
    y = nf.conv_bias_relu(x, w, None, padding=1, layout=layout)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    conv_rules(winograd_tiles=3, winograd_min_tiles=0, dw_groups=3)   # chunks, uneven
    if winograd:
        conv_rules(min_gemm_channels=1, nchw_im2col_channels=1)
    geom = nf.validate.conv_geometry("t", x.shape, w.shape, 1, 1, 1, layout)
    assert (conv_cpu.algorithm(geom, "dx") == "winograd") == winograd
    threads = _launch.num_threads()
    out = {}
    try:
        for n in (1, 3):
            _launch.set_num_threads(n)
            for mode, limit, shared in (("turn", 0, True), ("concurrently", 2**62, False),
                                        ("shared", 2**62, True)):
                with cpu_plan.using(concurrent_max_elements=limit, shared_max_elements=limit,
                                    shared_backward=shared):
                    out[n, mode] = nf.conv_bias_relu_backward(gy, x, w, y, padding=1,
                                                              layout=layout)
    finally:
        _launch.set_num_threads(threads)
    for key in out:
        for a, b in zip(out[1, "turn"], out[key]):
            assert a.tobytes() == b.tobytes(), key
    want = reference.conv_bias_relu_backward(gy, x, w, np.zeros(3, np.float32), padding=1,
                                             layout=layout)
    for got, ref_ in zip(out[3, "shared"], want):
        np.testing.assert_allclose(got, ref_, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- parking

needs_clock = pytest.mark.skipif(not _launch._CLOCK, reason="parking needs clock_gettime")


@needs_clock
def test_park_sees_another_threads_store_and_times_out():
    """_park: returns True once another thread publishes a new generation (its load is not
    hoisted out of the loop), after writing its slot; False after ``ns`` without one.
    _await_parked: True once every slot reached the generation, False on its timeout."""
    import threading
    import time

    slot = _launch._SLOT
    flag = np.zeros(2 * slot, np.int64)
    flag[slot] = -1
    publisher = threading.Timer(0.02, _launch._publish, (flag, 5))
    publisher.start()
    t = time.perf_counter()
    assert _launch._park(flag, 0, slot, _launch._CLOCK, 10**10, 0)          # up to 10 s
    assert time.perf_counter() - t < 5 and flag[0] == 5 and flag[slot] == 0
    publisher.join()
    t = time.perf_counter()
    assert not _launch._park(flag, 5, slot, _launch._CLOCK, 20_000_000, 0)  # 20 ms
    assert time.perf_counter() - t >= 0.02 and flag[slot] == 5
    slots = np.array([slot], np.int64)
    assert _launch._await_parked(flag, slots, 5, _launch._CLOCK, 10**10)
    t = time.perf_counter()
    assert not _launch._await_parked(flag, slots, 6, _launch._CLOCK, 20_000_000)
    assert time.perf_counter() - t >= 0.02


@pytest.mark.parametrize("spin_ns", [0, 1_000, 200_000])
def test_a_call_returns_after_its_helpers_whatever_the_parking(spin_ns, monkeypatch):
    """A launch returns only once the helper's range is done, also when the helper takes
    longer than the caller watches for it (then the caller sleeps on the job's condition), and
    consecutive calls find the helper, parked or asleep."""
    import threading
    import time

    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(_launch, "SPIN_NS", spin_ns)
    threads = _launch.num_threads()
    _launch.set_num_threads(2)
    try:
        for call in range(3):
            barrier = threading.Barrier(2, timeout=10)   # both ranges run at once
            done = []
            caller = threading.get_ident()

            def kernel(t0, t1):
                barrier.wait()
                if threading.get_ident() != caller:      # the helper's range: slow
                    time.sleep(0.05)
                done.append(t0)

            _launch.launch(kernel, 2, grain=1)
            assert sorted(done) == [0, 1], (call, done)
    finally:
        _launch.set_num_threads(threads)


def test_set_num_threads_ends_parked_helpers():
    """A pool replaced by set_num_threads ends its helper threads (parked or asleep)."""
    threads = _launch.num_threads()
    _launch.set_num_threads(3)
    try:
        _launch.launch(lambda t0, t1: None, 6, grain=1)
        old = _launch._get_pool().threads
        _launch.set_num_threads(2)
        for t in old:
            t.join(timeout=10)
            assert not t.is_alive()
    finally:
        _launch.set_num_threads(threads)


def test_no_parking_with_more_threads_than_cpus(monkeypatch):
    """Oversubscribed, a parked thread would take another pool thread's CPU: none parks."""
    monkeypatch.setattr(_launch, "SPIN_NS", 200_000)
    monkeypatch.setattr(_launch, "_CLOCK", 1)
    monkeypatch.setattr(_launch, "_num_threads", 3)
    monkeypatch.setattr(_launch, "_CPUS", 3)
    assert _launch._spinning()
    monkeypatch.setattr(_launch, "_CPUS", 2)
    assert not _launch._spinning()
    monkeypatch.setattr(_launch, "_CPUS", 3)
    monkeypatch.setattr(_launch, "SPIN_NS", 0)
    assert not _launch._spinning()
