"""benchmarks/bench_compile.py cannot rot silently: its compile log on this numba, its worker
processes, and its report on a made-up result (no cold compile of a kernel here: a few
seconds in all; the benchmark itself takes minutes)."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_compile as bc  # noqa: E402


def test_compile_log_records_nested_compilations():
    from numba import njit

    @njit
    def inner(a):
        return a + 1

    @njit
    def outer(a):
        return inner(a) * 2

    log = bc.CompileLog()
    try:
        log.step = "forward"
        assert outer(1) == 4
    finally:
        log.close()
    by_fn = {r["fn"].rsplit(".", 1)[-1]: r for r in log.records}
    assert by_fn["outer"]["depth"] == 0 and by_fn["inner"]["depth"] == 1
    assert all(r["step"] == "forward" for r in log.records)
    for r in log.records:
        assert 0 <= r["self_cpu"] <= r["cpu"] + 1e-9 and r["self_wall"] <= r["wall"] + 1e-9
    o = by_fn["outer"]
    assert o["wall"] >= by_fn["inner"]["wall"] + o["self_wall"] - 1e-6


def test_compile_log_keeps_a_stack_per_thread():
    # numbafuse's pool threads compile too (lazily); a compilation that started before the
    # log existed ends without a start: ignored, not an IndexError in that thread
    import threading
    from numba import njit

    @njit
    def in_thread(a):
        return a - 1

    @njit
    def in_main(a):
        return a + 1

    log = bc.CompileLog()
    try:
        log._end(None)                              # an end whose start the log never saw
        started = threading.Event()

        def other():
            log._start(type("E", (), {"data": {"dispatcher": in_thread}})())
            started.set()
        t = threading.Thread(target=other)
        t.start()
        started.wait()
        t.join()
        assert in_main(1) == 2                      # main's stack: its own, depth 0
    finally:
        log.close()
    by_fn = {r["fn"].rsplit(".", 1)[-1]: r for r in log.records}
    assert by_fn["in_main"]["depth"] == 0


def test_worker_processes_cold_and_warm():
    res = bc.measure("import", dict(op="import"), log=lambda s: None)
    for side in ("cold", "warm"):
        names = [s["name"] for s in res[side]["steps"]]
        assert names == ["import numba", "import"]
        assert res[side]["compiles"] == []
    assert res["cold_wall"] > 0 and res["warm_cpu"] > 0
    assert "| import |" in "\n".join(bc.process_rows({"import": res}))


def test_numba_floor_case_compiles_cold_and_loads_warm():
    # the floor under issue 33's targets: a one-line cached function, compiled in the cold
    # process and loaded (nothing compiled) in the warm one; its report line names both
    res = bc.measure("numba floor", bc.CASES["numba floor"], log=lambda s: None)
    for side in ("cold", "warm"):
        assert [s["name"] for s in res[side]["steps"]] == ["import numba", "first call"]
    assert [r["fn"].rsplit(".", 1)[-1] for r in res["cold"]["compiles"]
            if r["depth"] == 0] == ["_floor_sum"]
    assert res["warm"]["compiles"] == [] and res["warm"]["loads"]["hits"] == 1
    text = "\n".join(bc.report({"numba floor": res}, {}, "c", "m", (1.0, 1.0)))
    assert "**Numba's floor**" in text and "Warm import + first call: **" in text
    assert "Whole processes" not in text                 # not a numbafuse case's row


def _op_result(fwd_cpu, bwd_cpu, slow_cpu, warm_cpu):
    def steps(f, b, imp):
        return [dict(name="import numba", wall=imp, cpu=imp), dict(name="import", wall=imp,
                                                                   cpu=imp),
                dict(name="forward", wall=2 * f, cpu=f), dict(name="backward", wall=2 * b, cpu=b)]

    rec = dict(fn="_tasks", module="numbafuse.kernels.conv.cpu", step="forward", depth=0,
               wall=slow_cpu, cpu=slow_cpu, self_wall=slow_cpu, self_cpu=slow_cpu)
    return dict(spec=dict(op="conv_bias_relu"), cold_wall=20.0, cold_cpu=15.0, warm_wall=1.0,
                warm_cpu=0.8,
                cold=dict(steps=steps(fwd_cpu, bwd_cpu, 0.2), compiles=[rec], extra={}),
                warm=dict(steps=steps(warm_cpu, 0.01, 0.1), compiles=[], extra={}))


def test_report_marks_the_targets():
    results = {"conv fast": _op_result(1.0, 0.5, 0.4, 0.1),
               "conv slow": _op_result(5.0, 0.5, 2.5, 0.6)}
    results["train"] = dict(
        spec=dict(op="train"), cold_wall=70.0, cold_cpu=65.0, warm_wall=20.0, warm_cpu=19.0,
        cold=dict(steps=[dict(name="import", wall=0.3, cpu=0.3),
                         dict(name="python -m numbafuse.train", wall=69.0, cpu=64.0)],
                  compiles=[dict(_op_result(0, 0, 3.0, 0)["cold"]["compiles"][0])],
                  extra=dict(train_seconds=50.0, ms_per_step=5.0, steps=540,
                             test_accuracy=0.98)),
        warm=dict(steps=[], compiles=[], extra=dict(train_seconds=5.0)))
    kernel = dict(name="cuda.gemm_fwd_nhwc_32n[f32]", wall=9.0, cpu=8.0, cache_hit=False)
    cached = dict(kernel, wall=0.7, cpu=0.6, cache_hit=True)
    results["cuda"] = dict(spec=dict(op="cuda", kernels="step"), cold_wall=12.0,
                           cold_cpu=11.0, warm_wall=2.0, warm_cpu=1.9,
                           cold=dict(steps=[], compiles=[], extra=dict(kernels=[kernel])),
                           warm=dict(steps=[], compiles=[], extra=dict(kernels=[cached])))
    lines = bc.report(results, {"torch BatchNormAddReLU2d": "torch is not importable"},
                      "python benchmarks/bench_compile.py", "a CPU, 2 cores", (1.0, 2.0))
    text = "\n".join(lines)
    rows = [ln for ln in lines if ln.startswith("| conv") and "ward |" in ln]
    assert len(rows) == 4
    fast_fwd, _, slow_fwd, _ = rows
    assert fast_fwd.endswith("| yes | yes | yes |")
    # 5 s cold, a 2.5 s function, 0.8 s warm
    assert slow_fwd.endswith("| **no** | **no** | **no** |")
    tables = [ln for ln in lines if ln.startswith("|")]
    for table_line in tables:                                 # every row as wide as its head
        head = next(h for h in reversed(tables[:tables.index(table_line) + 1])
                    if h.startswith(("| case", "| kernel")))
        assert table_line.count("|") == head.count("|"), table_line
    assert "**70.0 s wall**" in text and "**no**" in text.split("Cold `python -m")[1]
    assert "gemm_fwd_nhwc_32n" in text and "1 of 1 loaded from it" in text
    assert "Skipped: torch BatchNormAddReLU2d: torch is not importable." in text
    assert "cold first call <= 3 s in 3 of 4 passes (the longest: conv slow forward" in text
    assert ("no function over 2 s in 3 of 4; warm import + first calls <= 0.5 s in 2 of 4 "
            "(by wall seconds: 2 of 4)") in text
    assert "self CPU (the most in any case): `kernels.conv.cpu._tasks` 3.0 s." in text


def test_case_selection():
    assert bc.select(None, quick=True) == list(bc.QUICK)
    assert bc.select("conv_bias_relu NHWC 3x3", False) == [
        "conv_bias_relu NHWC 3x3 s1", "conv_bias_relu NHWC 3x3 s2"]
    assert bc.select("train,batchnorm_add_relu NCHW", False) == [
        "batchnorm_add_relu NCHW", "train"]
    with pytest.raises(SystemExit):
        bc.select("no such case", False)
