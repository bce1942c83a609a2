"""First calls while Numba compiles (``kernels/cpu/first_calls.py``): the NumPy conv passes
(``kernels/conv/cpu_numpy.py``) against the float64 reference, and the hand-off: who waits,
for how long, which result comes back, errors, contexts, a cold process end to end.

The rest of the suite runs with ``NUMBAFUSE_FIRST_CALL_WAIT=inf`` (conftest.py): every first
call waits for the compiled kernels, so those tests test the kernels. Here the module's state
is set per test and restored."""
import contextvars
import itertools
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from numbafuse import reference, validate
from numbafuse.kernels.conv import cpu_numpy
from numbafuse.kernels.cpu import first_calls

from .harness import close


@pytest.fixture
def fc(monkeypatch):
    """first_calls with a fresh state and ``WAIT_S`` = 5 s; the old state restored after."""
    first_calls.join(30)
    monkeypatch.setattr(first_calls, "_states", {})
    monkeypatch.setattr(first_calls, "_others_ended", -math.inf)   # no compilation just before
    monkeypatch.setattr(first_calls, "_stats", {"compiled": 0, "fallback": 0, "background": 0,
                                                 "child errors": 0})
    old = first_calls.set_wait(5)
    yield first_calls
    assert first_calls.join(300), "a background call did not finish"
    first_calls.set_wait(old)


# --------------------------------------------------------------------------- the NumPy passes

def _case(rng, layout, C, K, G, R, S, stride, padding, dilation, dtype, N=2, H=7, W=6):
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((K, C // G, R, S)).astype(dtype)
    geom = validate.conv_geometry("test", shape, w.shape, stride, padding, dilation, layout, G)
    return x, w, geom


GEOMETRIES = list(itertools.product(
    ["NCHW", "NHWC"],
    [(4, 6, 1), (6, 9, 3), (5, 5, 5), (3, 6, 3)],      # plain, grouped, depthwise, multiplier
    [(3, 3), (1, 2), (1, 1)],
    [1, 2, (2, 1)],
    [0, 1, (1, 2, 0, 1), "same"],                       # 4-tuple: left, right, top, bottom
    [1, 2]))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numpy_passes_equal_the_reference(dtype):
    rng = np.random.default_rng(7)
    checked = 0
    for layout, (C, K, G), (R, S), stride, padding, dilation in GEOMETRIES:
        if padding == "same" and stride != 1:
            continue
        x, w, geom = _case(rng, layout, C, K, G, R, S, stride, padding, dilation, dtype)
        b = rng.standard_normal(K).astype(dtype)
        for relu, bias in ((False, False), (True, True)):
            y = cpu_numpy.conv_forward(x, w, b if bias else None, geom, relu)
            expected = reference.conv2d(x, w, stride, padding, dilation, layout, G)
            if bias:
                expected = expected + (b.reshape(1, -1, 1, 1) if layout == "NCHW" else b)
            if relu:
                expected = np.maximum(expected, 0)
            assert y.dtype == dtype and y.flags.c_contiguous
            close(y, expected, dtype, what=f"forward {geom}")
        gy = rng.standard_normal(y.shape).astype(dtype)
        g = gy * (y > 0)                                              # gated by the ReLU
        dx, dw, db = cpu_numpy.conv_backward(gy, x, w, geom, y, (True, True, True))
        rdx, rdw = reference.conv2d_backward(g, x, w, stride, padding, dilation, layout, G)
        close(dx, rdx, dtype, what=f"dx {geom}")
        close(dw, rdw, dtype, what=f"dw {geom}")
        close(db, g.sum(axis=(0, 2, 3) if layout == "NCHW" else (0, 1, 2)), dtype, what="db")
        assert dx.dtype == dw.dtype == db.dtype == dtype and dx.flags.c_contiguous
        checked += 1
    assert checked > 300


def test_numpy_backward_computes_only_what_is_needed_and_ungated_without_y():
    rng = np.random.default_rng(8)
    x, w, geom = _case(rng, "NHWC", 4, 6, 2, 3, 3, 2, 1, 1, np.float64)
    gy = rng.standard_normal(geom.y_shape)
    dx, dw, db = cpu_numpy.conv_backward(gy, x, w, geom, None, (False, True, False))
    assert dx is None and db is None
    np.testing.assert_allclose(dw, reference.conv2d_backward(gy, x, w, 2, 1, 1, "NHWC", 2)[1],
                               rtol=1e-12, atol=1e-12)
    dx, dw, db = cpu_numpy.conv_backward(gy, x, w, geom, None, (True, False, True))
    assert dw is None
    np.testing.assert_allclose(dx, reference.conv2d_backward(gy, x, w, 2, 1, 1, "NHWC", 2)[0],
                               rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- the hand-off

class Slow:
    """A "compiled" call that blocks until released, recording the thread it ran on."""

    def __init__(self, result="compiled", error=None, compiles=False):
        self.release, self.started = threading.Event(), threading.Event()
        self.result, self.error, self.compiles, self.threads = result, error, compiles, []

    def __call__(self):
        self.threads.append(threading.current_thread())
        self.started.set()
        if self.compiles:            # what Numba fires when it compiles (not when it loads)
            from numba.core import event
            with event.trigger_event("numba:compile", data={}):
                pass
        self.release.wait(30)
        if self.error is not None:
            raise self.error
        return self.result


def test_a_call_that_is_done_in_time_returns_the_compiled_result(fc):
    fast = Slow()
    fast.release.set()
    assert fc.run("k", fast, lambda: "fallback") == "compiled"
    assert fast.threads[0] is not threading.current_thread()      # it ran in the background
    assert fc.run("k", fast, lambda: "fallback") == "compiled"    # ready: on this thread
    assert fast.threads[1] is threading.current_thread()
    assert fc.stats() == {"compiled": 1, "fallback": 0, "background": 1, "child errors": 0}


def test_a_compilation_ends_the_wait_and_the_fallback_serves_until_it_is_done(fc):
    slow = Slow(compiles=True)
    t0 = time.perf_counter()
    assert fc.run("k", slow, lambda: "fallback") == "fallback"
    assert time.perf_counter() - t0 < 4          # woken by the compile event, not WAIT_S (5)
    assert fc.pending() == ["k"]
    assert fc.run("k", slow, lambda: "fallback again") == "fallback again"   # no second job
    slow.release.set()
    assert fc.join(30) and fc.pending() == []
    assert fc.run("k", slow, lambda: "fallback") == "compiled"
    assert len(slow.threads) == 2 and slow.threads[1] is threading.current_thread()
    assert fc.stats() == {"compiled": 1, "fallback": 2, "background": 1, "child errors": 0}


def test_a_load_that_outlasts_the_wait_falls_back(fc):
    fc.set_wait(0.2)                     # no compile event: only WAIT_S ends the wait
    slow = Slow()
    t0 = time.perf_counter()
    assert fc.run("k", slow, lambda: "fallback") == "fallback"
    assert 0.15 < time.perf_counter() - t0 < 3
    slow.release.set()


def test_a_key_queued_behind_another_does_not_wait(fc):
    first, second = Slow(compiles=True), Slow()
    assert fc.run("a", first, lambda: "fa") == "fa"
    assert first.started.wait(10)
    t0 = time.perf_counter()
    assert fc.run("b", second, lambda: "fb") == "fb"
    assert time.perf_counter() - t0 < 1           # WAIT_S is 5: it did not wait
    first.release.set()
    second.release.set()
    assert fc.join(30) and set(fc._states) == {"a", "b"}


def test_errors_reach_the_caller_in_time_or_on_the_next_call(fc):
    quick = Slow(error=ValueError("in time"))
    quick.release.set()
    with pytest.raises(ValueError, match="in time"):
        fc.run("a", quick, lambda: "fallback")
    late = Slow(error=ValueError("late"), compiles=True)
    assert fc.run("b", late, lambda: "fallback") == "fallback"
    late.release.set()
    assert fc.join(30)
    with pytest.raises(ValueError, match="late"):              # now run on this thread
        fc.run("b", late, lambda: "fallback")
    assert late.threads[-1] is threading.current_thread()


def test_waiting_forever_runs_compiled_on_the_calling_thread(fc):
    fc.set_wait(math.inf)
    call = Slow()
    call.release.set()
    assert fc.run("k", call, lambda: "fallback") == "compiled"
    assert call.threads == [threading.current_thread()] and fc.pending() == []


def test_the_background_call_sees_the_callers_context(fc):
    var = contextvars.ContextVar("test_first_calls", default="default")
    seen = []

    def call():
        seen.append(var.get())
        return 1

    token = var.set("the caller's")
    try:
        assert fc.run("k", call, lambda: 0) == 1
    finally:
        var.reset(token)
    assert seen == ["the caller's"]


def test_a_forked_child_forgets_the_calls_in_flight(fc):
    slow = Slow(compiles=True)
    fc.run("k", slow, lambda: 0)
    states, jobs, worker = fc._states, fc._jobs, fc._worker
    try:
        fc._forget_in_child()                      # what os.register_at_fork runs in a child
        assert fc.pending() == [] and fc._worker is None and fc._jobs is not jobs
    finally:
        fc._jobs, fc._worker = jobs, worker
        states["k"] = fc._PENDING
        slow.release.set()


def test_the_wait_setting_is_checked():
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        first_calls.set_wait(-1)


# --------------------------------------------------------------------------- through the ops

def test_an_op_whose_kernels_are_pending_returns_the_numpy_result(fc, monkeypatch):
    """Keys pending (the background thread kept busy): conv_bias_relu forward and backward,
    and Conv-BN-ReLU (its fused statistics epilogue None: the op's statistics pass), all
    from NumPy, equal to the reference."""
    import numbafuse as nf
    gate = threading.Event()
    fc.run("blocker", lambda: gate.wait(30), lambda: None)     # the thread is busy from here
    try:
        rng = np.random.default_rng(3)
        x = rng.standard_normal((3, 5, 9, 7))
        w = rng.standard_normal((6, 5, 3, 3))
        b = rng.standard_normal(6)
        y = nf.conv_bias_relu(x, w, b, stride=2, padding=1)
        expected = np.maximum(reference.conv2d(x, w, 2, 1) + b.reshape(1, -1, 1, 1), 0)
        np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
        dy = rng.standard_normal(y.shape)
        dx, dw, db = nf.conv_bias_relu_backward(dy, x, w, y, stride=2, padding=1)
        rdx, rdw = reference.conv2d_backward(dy * (y > 0), x, w, 2, 1)
        np.testing.assert_allclose(dx, rdx, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dw, rdw, rtol=1e-12, atol=1e-12)
        gamma, beta = rng.standard_normal(6), rng.standard_normal(6)
        z = nf.conv_batchnorm_relu(x, w, gamma, beta, stride=2, padding=1)
        h = reference.conv2d(x, w, 2, 1)
        mean, var = h.mean(axis=(0, 2, 3)), h.var(axis=(0, 2, 3))
        zr = np.maximum((h - mean.reshape(1, -1, 1, 1)) / np.sqrt(var + 1e-5).reshape(
            1, -1, 1, 1) * gamma.reshape(1, -1, 1, 1) + beta.reshape(1, -1, 1, 1), 0)
        np.testing.assert_allclose(z, zr, rtol=1e-10, atol=1e-10)
        assert fc.stats()["fallback"] >= 3 and fc.stats()["compiled"] == 0
    finally:
        gate.set()


def test_a_cold_process_serves_first_calls_from_numpy_then_compiles(tmp_path):
    """An empty Numba cache, the default wait: the first forward and backward come from NumPy,
    equal to the reference; the compiling process compiles their kernels (this process
    compiles none of them: every compilation its worker started was refused by the probe),
    and then the same calls run the compiled kernels, equal too."""
    script = textwrap.dedent("""
        import threading
        import numpy as np
        from numba.core import event
        import numbafuse as nf
        from numbafuse import reference
        from numbafuse.kernels.cpu import first_calls
        compiled_here = []
        class Ends(event.Listener):
            def on_start(self, ev):
                pass
            def on_end(self, ev):
                if ev._exc_details[0] is None:      # a compilation that finished
                    compiled_here.append((threading.current_thread().name,
                                          ev.data["dispatcher"].py_func.__qualname__))
        event.register("numba:compile", Ends())
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2, 8, 6, 6))
        w = rng.standard_normal((8, 8, 1, 1))
        def check():
            y = nf.conv_bias_relu(x, w)
            assert np.allclose(y, np.maximum(reference.conv2d(x, w), 0), rtol=1e-12, atol=1e-12)
            dx, dw, db = nf.conv_bias_relu_backward(y, x, w, y)
            rdx, rdw = reference.conv2d_backward(y * (y > 0), x, w)
            assert np.allclose(dx, rdx, rtol=1e-12, atol=1e-12)
            assert np.allclose(dw, rdw, rtol=1e-12, atol=1e-12)
        check()
        assert first_calls.stats()["fallback"] == 2, first_calls.stats()
        assert first_calls.join(300)
        check()
        stats = first_calls.stats()
        assert stats["fallback"] == 2 and stats["child errors"] == 0, stats    # no more
        assert first_calls._child is not None and first_calls._child_failures == 0
        worker = [name for thread, name in compiled_here if thread == "numbafuse-first-calls"]
        assert not worker, worker
        print("ok")
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBAFUSE_FIRST_CALL_WAIT": "5"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


# --------------------------------------------------------------------------- the compiling process

def test_specs_run_on_zeros_in_the_compiling_process():
    from numbafuse.kernels.cpu import compile_child
    from numbafuse.kernels.conv import cpu_first, cpu_plan
    rng = np.random.default_rng(4)
    x, w, geom = _case(rng, "NCHW", 4, 6, 1, 3, 3, 1, 1, 1, np.float32)
    spec = cpu_first._spec("conv_forward", geom, (x, w, None, geom, True))
    module, function, args, rules = spec
    assert module == "numbafuse.kernels.conv.cpu" and function == "conv_forward"
    assert args[0] == compile_child.Zeros(x.shape, x.dtype.str) and args[2] is None
    assert rules == cpu_plan.current_rules()
    scaled = cpu_first._spec("forward_scaled", geom, (x, w, lambda: None, geom, True))[2]
    assert scaled[2] == compile_child.Values(geom.K, x.dtype.str)    # values() as (K,) arrays
    seen = []

    def record(*a):
        seen.append(a)
    import types
    fake = types.ModuleType("numbafuse_test_fake_kernels")
    fake.conv_forward = record
    sys.modules[fake.__name__] = fake
    try:
        compile_child.run_spec((fake.__name__, "conv_forward", args + (
            compile_child.Values(6, "<f4"),), rules._replace(k_block=7)))
    finally:
        del sys.modules[fake.__name__]
    (a,) = seen
    assert a[0].shape == x.shape and a[0].dtype == np.float32 and not a[0].any()
    scale, shift = a[-1]()
    assert scale.tolist() == [1.0] * 6 and shift.tolist() == [0.0] * 6
    assert a[3] == geom and a[4] is True


def test_messages_round_trip():
    import io
    from numbafuse.kernels.cpu import compile_child
    stream = io.BytesIO()
    compile_child.write_message(stream, (3, ("m", "f", (1, None), None)))
    compile_child.write_message(stream, (4, None))
    stream.seek(0)
    assert compile_child.read_message(stream) == (3, ("m", "f", (1, None), None))
    assert compile_child.read_message(stream) == (4, None)
    assert compile_child.read_message(stream) is None


def test_a_probe_refuses_compiling_and_hands_the_spec_to_the_process(fc, monkeypatch):
    """The worker's first run is a probe: at the first compilation (an event here) it stops,
    wakes the caller, and has the compiling process run the spec; then it runs the call
    again. A spec the process cannot run: its error is counted and the worker runs the call
    itself."""
    sent = []

    def child(spec):
        sent.append(spec)
        time.sleep(0.5)             # compiling takes a while: the caller has gone on by then
        return spec == "good"
    monkeypatch.setattr(fc, "_child_compile", child)
    for spec in ("good", "bad"):
        compiles = [True]

        def call():
            if compiles and compiles.pop():     # the first run compiles; the second loads
                from numba.core import event
                with event.trigger_event("numba:compile", data={}):
                    pass
            return "compiled"
        assert fc.run(spec, call, lambda: "fallback", spec) == "fallback"
        assert fc.join(30)
        assert fc.run(spec, call, lambda: "fallback", spec) == "compiled"
    assert sent == ["good", "bad"]


def test_the_compiling_process_reports_its_errors():
    from numbafuse.kernels.cpu import first_calls
    from numbafuse.kernels.conv import cpu_plan
    before = first_calls._stats["child errors"]
    assert not first_calls._child_compile(("numbafuse.kernels.conv.cpu", "no_such_function",
                                           (), cpu_plan.current_rules()))
    assert first_calls._stats["child errors"] == before + 1
    assert "no_such_function" in first_calls._child_errors[-1]
    assert first_calls._child_compile(("numbafuse.kernels.conv.cpu", "channel_sum", (
        __import__("numbafuse.kernels.cpu.compile_child").kernels.cpu.compile_child.Zeros(
            (1, 2, 3, 3), "<f8"), "NCHW"), cpu_plan.current_rules()))


def test_a_short_lived_process_leaves_its_compilation_in_the_cache(tmp_path):
    """A process that makes one call and ends at once does not wait for the compiling
    process, which still finishes that compilation: a later process loads it (its first
    call compiled, no NumPy)."""
    script = textwrap.dedent("""
        import numpy as np
        import numbafuse as nf
        from numbafuse.kernels.cpu import first_calls
        x = np.random.default_rng(0).standard_normal((2, 8, 6, 6))
        w = np.random.default_rng(1).standard_normal((8, 8, 1, 1))
        nf.conv_bias_relu(x, w)
        print(first_calls.stats()["fallback"])
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBAFUSE_FIRST_CALL_WAIT": "5"}

    def once():
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return int(out.stdout.split()[-1])

    assert once() == 1                         # cold: NumPy served it, and it ended
    deadline = time.monotonic() + 240
    while once() != 0:                          # until the orphaned compilation is cached
        assert time.monotonic() < deadline, "the compilation never reached the cache"
        time.sleep(1)


def test_a_compiling_process_that_hangs_is_given_up(monkeypatch):
    """No answer within CHILD_TIMEOUT_S: the process is killed and counted as a failure (the
    worker then compiles on its own thread); the next spec starts a new process."""
    from numbafuse.kernels.conv import cpu_plan
    timeout = first_calls.CHILD_TIMEOUT_S
    monkeypatch.setattr(first_calls, "_child_failures", 0)
    rules = cpu_plan.current_rules()
    # started and answering, in the usual time (a loaded machine took over 1 s to start it:
    # the 1 s below, set first, had counted that start as a failure too)
    assert first_calls._child_compile(("time", "sleep", (0,), rules))
    child = first_calls._child
    monkeypatch.setattr(first_calls, "CHILD_TIMEOUT_S", 1)
    t0 = time.perf_counter()
    assert not first_calls._child_compile(("time", "sleep", (30,), rules))
    assert time.perf_counter() - t0 < 10
    assert first_calls._child_failures == 1 and first_calls._child is None
    assert child.wait(10) is not None                                # killed
    monkeypatch.setattr(first_calls, "CHILD_TIMEOUT_S", timeout)
    assert first_calls._child_compile(("time", "sleep", (0,), rules))   # a new process
    assert first_calls._child is not child


def test_the_compiling_process_needs_a_plain_python(monkeypatch):
    """A frozen application or an embedding program (uWSGI, an editor) as sys.executable
    would start itself again with -m: no compiling process there."""
    for exe, frozen, ok in (("/usr/bin/python3.11", False, True), ("C:\\Py\\python.exe",
                                                                      False, True),
                            ("/usr/bin/uwsgi", False, False), ("/opt/app/app", True, False),
                            ("", False, False), ("/usr/bin/python3", True, False)):
        monkeypatch.setattr(sys, "executable", exe)
        if frozen:
            monkeypatch.setattr(sys, "frozen", True, raising=False)
        else:
            monkeypatch.delattr(sys, "frozen", raising=False)
        assert (first_calls._python_executable() is not None) == ok, exe
