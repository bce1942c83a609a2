"""Prepared calls (``numbafuse/kernels/cpu/recorded.py``): a host function's launches recorded
per signature and replayed. Each host function below is a small driver of the kinds the conv
and batch-norm drivers are: allocations, launches of task kernels, compiled steps and NumPy
copies between them, views of inputs and allocations. A replay must give the bits the
function gives; whatever a replay cannot carry must keep the signature on the layered path,
with its reason."""
import threading

import numpy as np
import pytest
from numba import njit

from numbafuse.kernels.conv import weights
from numbafuse.kernels.cpu import programs, recorded
from numbafuse.kernels.cpu.buffers import output_cache
from numbafuse.kernels.cpu.launch import launch, launch_all, concurrently, num_threads


@njit(nogil=True, cache=True)
def _scale_rows(t0, t1, x, s, out):
    for r in range(t0, t1):
        for j in range(x.shape[1]):
            out[r, j] = x[r, j] * s[j]


@njit(cache=True)
def _sums(out, total):
    for j in range(out.shape[1]):
        acc = 0.0
        for r in range(out.shape[0]):
            acc += out[r, j]
        total[j] += acc


def driver(x, s, running):
    """``x * s`` by rows (a cached output and a scratch copy of s), column sums added to
    ``running`` in place, the sums' first half scaled again through a view."""
    s2 = np.empty(s.shape[0], x.dtype)
    recorded.copy(s2, s)
    out = output_cache.empty(x.shape, x.dtype)
    launch(_scale_rows, x.shape[0], x, s2, out, work=x.size)
    total = np.zeros(x.shape[1])
    recorded.step(_sums, out, total)
    half = np.empty((1, x.shape[1] // 2))
    launch_all([(_scale_rows, 1, (total[None, :x.shape[1] // 2], s[: x.shape[1] // 2], half))])
    recorded.step(_sums, out[1:], running)
    return {"y": out.reshape(-1), "parts": (total, half[0])}, x.shape[0]


def call(fn, *args):
    return recorded.call(fn, args, num_threads())


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(recorded, "ENABLED", True)
    recorded.clear()
    yield
    recorded.clear()


def _data(seed, rows=37, cols=10):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, cols)), rng.standard_normal(cols)


def _expect(x, s, running):
    r = running.copy()
    out, n = driver(x, s, r)
    return out, n, r


@pytest.mark.parametrize("rows", [1, 5, 37, 300])
def test_a_prepared_call_gives_the_layered_bits(rows):
    running = np.zeros(10)
    for i in range(8):
        x, s = _data(i, rows)
        want, n, running_want = _expect(x, s, running)
        got, m = call(driver, x, s, running)
        assert m == n and np.array_equal(got["y"], want["y"])
        assert all(np.array_equal(a, b) for a, b in zip(got["parts"], want["parts"]))
        assert np.array_equal(running, running_want)
    stats = recorded.stats()
    assert stats["prepared"] == 1 and stats["replays"] == 5 and not stats["refused"]


def test_a_replay_makes_fresh_arrays_and_views_of_this_calls_inputs():
    running = np.zeros(10)
    outs = []
    for i in range(6):
        x, s = _data(i)
        outs.append((call(driver, x, s, running)[0], x, s))
    (y4, x4, s4), (y5, x5, s5) = outs[4], outs[5]
    assert not np.shares_memory(y4["y"], y5["y"])
    assert np.array_equal(y4["y"].reshape(x4.shape), x4 * s4)
    assert np.array_equal(y5["y"].reshape(x5.shape), x5 * s5)


def _numpy_between(x, s, running):
    out, n = driver(x, s, running)
    out["parts"][0][0] += 1.0                 # NumPy work the recording does not see
    return out, n


def _closure(x, s, running):
    def kernel(t0, t1):
        pass
    launch(kernel, 2)
    return driver(x, s, running)


def _from_data(x, s, running):
    out = np.empty(x.shape)
    launch(_scale_rows, x.shape[0] - (x[0, 0] > 0), x, s, out)   # a task count from a value
    return out


def _numpy_copy(x, s, running):
    return x.copy() * 2.0, driver(x, s, running)[1]


@pytest.mark.parametrize("fn, reason", [
    (_numpy_between, "the replay's results differ"),
    (_closure, "two recordings differ"),
    (_numpy_copy, "two recordings differ"),
])
def test_what_a_replay_cannot_carry_stays_layered(fn, reason):
    running = np.zeros(10)
    for i in range(6):
        x, s = _data(i)
        r = running.copy()
        want = fn(x, s, r)
        got = call(fn, x, s, running)
        assert np.array_equal(running, r)
        assert np.array_equal(got[0]["y"] if isinstance(got[0], dict) else got[0],
                              want[0]["y"] if isinstance(want[0], dict) else want[0])
    stats = recorded.stats()
    assert stats["prepared"] == 0 and stats["replays"] == 0 and len(stats["refused"]) == 1
    assert next(iter(stats["refused"])).startswith(reason), stats["refused"]
    assert recorded.refusals()[-1][0] == fn.__name__


def test_a_value_from_the_data_stays_layered():
    x0, s = _data(0)
    for i in range(6):
        x = x0.copy()
        x[0, 0] = 1.0 if i % 2 else -1.0               # a task count that alternates
        assert np.array_equal(call(_from_data, x, s, None)[:36], (x * s)[:36])
    assert "two recordings differ" in next(iter(recorded.stats()["refused"]))


def test_inputs_that_share_memory_stay_layered():
    x, s = _data(0)
    for i in range(4):
        x = x + 1.0
        call(driver, x, x[0], np.zeros(10))           # s a view of x
    assert list(recorded.stats()["refused"]) == ["inputs that share memory"]


def _pure(x, s):
    return driver(x, s, np.zeros(10))


def test_the_same_data_again_is_not_a_second_recording():
    x, s = _data(0)
    for i in range(recorded.SAME_DATA_LIMIT + 2):      # seen, then recorded on one data
        call(_pure, x, s)
    stats = recorded.stats()
    assert stats["prepared"] == 0
    assert list(stats["refused"]) == [f"the same data in {recorded.SAME_DATA_LIMIT} recordings"]


def test_the_check_catches_a_wrong_slot(monkeypatch):
    # planted: every view's offset one element off, as a slot bug would make it
    make = programs.Slot.__init__

    def off_by_one(self, index, whole, offset=0, view=None, source=None):
        room = view is not None and offset + view.nbytes + view.itemsize <= source.nbytes
        make(self, index, whole, offset + (view.itemsize if room else 0), view, source)
    monkeypatch.setattr(programs.Slot, "__init__", off_by_one)
    running = np.zeros(10)
    for i in range(5):
        call(driver, *_data(i), running)
    assert recorded.stats()["prepared"] == 0
    assert "the replay's results differ" in next(iter(recorded.stats()["refused"]))


def test_the_weight_cache_keeps_a_call_layered():
    w = np.ones((3, 3))

    class Owner:
        _version = 0
    owner = Owner()

    def derives(x, s, running):
        weights.derived(w, "kind", lambda: w.T.copy())
        return driver(x, s, running)
    with weights.enabled(), weights.vouch(w, owner):
        for i in range(4):
            call(derives, *_data(i), np.zeros(10))
    assert list(recorded.stats()["refused"]) == ["the weight cache"]


def test_a_transient_taint_records_a_later_call():
    state = {"compiling": 2}

    def sometimes(x, s, running):
        if state["compiling"]:
            state["compiling"] -= 1
            recorded.taint("a kernel still compiling", transient=True)
        return driver(x, s, running)
    for i in range(6):
        call(sometimes, *_data(i), np.zeros(10))
    assert recorded.stats()["prepared"] == 1 and not recorded.stats()["refused"]


def test_concurrently_is_recorded_call_by_call():
    def two(x, s, r1, r2):
        a, b = concurrently(lambda: driver(x, s, r1)[0], lambda: driver(x[1:], s, r2)[0])
        return a["y"], b["y"]
    r1, r2 = np.zeros(10), np.zeros(10)
    for i in range(6):
        x, s = _data(i, 300)
        w1, w2 = r1.copy(), r2.copy()
        want = two(x, s, w1, w2)
        got = call(two, x, s, r1, r2)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        assert np.array_equal(r1, w1) and np.array_equal(r2, w2)
    assert recorded.stats()["prepared"] == 1, recorded.refusals()


def test_other_threads_allocate_as_ever_while_one_records():
    started, done = threading.Event(), threading.Event()
    seen = []

    def other():
        started.wait(5)
        seen.append(np.empty(3))
        done.set()

    def slow(x, s, running):
        if recorded.here() is not None:
            started.set()
            done.wait(5)
        return driver(x, s, running)
    call(slow, *_data(0), np.zeros(10))            # seen once: not recorded
    t = threading.Thread(target=other)
    t.start()
    call(slow, *_data(1), np.zeros(10))            # recorded, while other() allocates
    t.join()
    assert [a.shape for a in seen] == [(3,)] and np.empty is recorded._np_empty
    program = next(p for p in recorded._programs.values() if isinstance(p, programs.Program))
    assert len(program.allocs) == 4 and recorded.stats()["recordings"] == 1


def test_off_within_the_block_and_on_after():
    with recorded.off():
        for i in range(5):
            call(driver, *_data(i), np.zeros(10))
    assert recorded.stats()["recordings"] == 0 and recorded.stats()["signatures"] == 0
    assert recorded.ENABLED


def _kept_program():
    return next(p for p in recorded._programs.values()
                if isinstance(p, programs.Program) and p.ready)


def test_small_scratch_is_kept_and_what_the_output_holds_is_not():
    running = np.zeros(10)
    ys = []
    for i in range(6):
        x, s = _data(i)
        want, _, running_want = _expect(x, s, running)
        got, _ = call(driver, x, s, running)
        assert np.array_equal(got["y"], want["y"]) and np.array_equal(running, running_want)
        ys.append(got)
    kept = _kept_program().kept
    # s2 (10 floats, np.empty) only: out, total and half are held by the output, total is
    # np.zeros' (filled)
    assert kept is not None and kept.nbytes == 80
    assert sum(type(a) is np.ndarray for a in kept.allocs) == 1
    assert not any(np.shares_memory(a, b) for a, b in
                   zip(programs.leaves(ys[4], []), programs.leaves(ys[5], [])))
    assert recorded.stats()["scratch bytes"] == 80


def test_no_scratch_is_kept_at_zero_bytes(monkeypatch):
    monkeypatch.setattr(recorded, "SCRATCH_BYTES", 0)
    for i in range(5):
        call(driver, *_data(i), np.zeros(10))
    assert _kept_program().kept is None and recorded.stats()["replays"] == 2


_gate = {"wait": None}


def _gated(x):
    """Copies x's first row into a scratch array, calls ``_gate["wait"]`` once (a step),
    then copies the scratch to the output: a replay running meanwhile must not share the
    scratch."""
    scratch = np.empty(x.shape[1])
    recorded.copy(scratch, x[0])
    recorded.step(_wait)
    out = np.empty((2, x.shape[1]))
    recorded.copy(out, scratch)
    return out


def _wait():
    hook, _gate["wait"] = _gate["wait"], None
    if hook is not None:
        hook()


@pytest.mark.parametrize("planted", [False, True])
def test_a_replay_while_another_uses_the_kept_scratch_makes_its_own(monkeypatch, planted):
    for i in range(5):
        call(_gated, _data(i)[0])
    assert _kept_program().kept is not None
    if planted:                  # the lock that keeps a second run off the kept arrays: none
        class Free:
            def acquire(self, blocking=True):
                return True

            def release(self):
                pass
        monkeypatch.setattr(_kept_program().kept, "free", Free())
    xa, xb = _data(10)[0], _data(11)[0]
    got = {}

    def second():                # another thread's replay, while the first waits at _wait
        t = threading.Thread(target=lambda: got.setdefault("b", call(_gated, xb)))
        t.start()
        t.join(10)
    _gate["wait"] = second
    got["a"] = call(_gated, xa)
    assert _gate["wait"] is None and recorded.stats()["replays"] == 4
    assert np.array_equal(got["b"], np.tile(xb[0], (2, 1)))
    assert np.array_equal(got["a"], np.tile(xa[0], (2, 1))) != planted


def test_the_kept_scratch_is_checked_too(monkeypatch):
    # planted: each step's view of a kept array a copy of it, so that what one step writes
    # the next does not read
    folded = programs._folded

    def copied(t, kept, top=False):
        v = folded(t, kept, top)
        return v.copy() if type(t) is programs.Slot and isinstance(v, np.ndarray) else v
    monkeypatch.setattr(programs, "_folded", copied)
    for i in range(5):
        x = _data(i)[0]
        assert np.array_equal(call(_gated, x), np.tile(x[0], (2, 1)))
    assert _kept_program().kept is None
    assert recorded.stats()["scratch refused"] == 1 and recorded.stats()["replays"] == 2


def _fortran_scratch(x):
    scratch = np.empty((2, x.shape[1]), order="F")          # (not C-contiguous: not kept)
    recorded.copy(scratch, x[:2])
    out = np.empty((2, x.shape[1]))
    recorded.copy(out, scratch)
    return out


def test_a_scratch_not_c_contiguous_is_made_at_each_call():
    for i in range(5):
        x = _data(i)[0]
        assert np.array_equal(call(_fortran_scratch, x), x[:2])
    assert recorded.stats()["prepared"] == 1 and recorded.stats()["replays"] == 2
    assert _kept_program().kept is None


def test_a_scratch_that_cannot_be_kept_leaves_the_call_prepared(monkeypatch):
    def fails(self, limit):
        raise ValueError("planted")
    monkeypatch.setattr(programs.Program, "keep_scratch", fails)
    running = np.zeros(10)
    for i in range(5):
        x, s = _data(i)
        want, _, running_want = _expect(x, s, running)
        got, _ = call(driver, x, s, running)
        assert np.array_equal(got["y"], want["y"]) and np.array_equal(running, running_want)
    stats = recorded.stats()
    assert stats["replays"] == 2 and stats["scratch refused"] == 1
    assert _kept_program().kept is None
