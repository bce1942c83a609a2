"""The measured table of CPU conv algorithms (``kernels/conv/cpu_table.py``): the plans follow
it under the default rules only, for its own geometries, passes and dtypes; recording,
tuning (the margin), saving and loading, the environment variable; the ops' results with a
table are the reference's."""
import json

import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.kernels.conv import cpu_plan, cpu_plan_table, cpu_table


@pytest.fixture(autouse=True)
def no_table():
    """Every test starts and ends without a table (and a table made by the env var, unread)."""
    cpu_table.use(None)
    yield
    cpu_table.use(None)


def _geometry(layout="NCHW", C=32, K=32, N=2):
    shape = (N, C, 8, 8) if layout == "NCHW" else (N, 8, 8, C)
    return nf.validate.conv_geometry("test", shape, (K, C, 3, 3), 1, 1, 1, layout)


def _other(geom, pass_):
    """An algorithm that runs ``pass_`` of ``geom`` and that the rules do not pick."""
    ruled = cpu_plan.algorithm(geom, pass_)
    return next(a for a in ("winograd", "im2col", "phase", "tapwise")
                if a != ruled and cpu_plan.supports(a, geom, pass_, np.float32))


def _table(entries):
    return {"version": cpu_table.VERSION,
            "entries": {k: {"algorithm": a} for k, a in entries.items()}}


def test_plans_follow_the_table_under_the_default_rules_only():
    g = _geometry()
    ruled = {p: cpu_plan.algorithm(g, p) for p in cpu_plan.PASSES}
    measured = _other(g, "forward")
    assert cpu_plan.algorithm(g) == ruled["forward"]          # a plan made before the table
    cpu_table.use(_table({
        cpu_table.key(g, "forward", np.float32): measured,
        cpu_table.key(g, "dx", np.float32): "implicit",       # cannot run a dX: not followed
    }))
    assert cpu_plan.algorithm(g) == measured
    assert cpu_plan.algorithm(g, "dx") == ruled["dx"]
    assert cpu_plan.algorithm(g, "dw") == ruled["dw"]         # no entry
    # another layout, dtype or batch of the same sizes is another entry
    assert cpu_plan.algorithm(_geometry("NHWC"), "forward") == \
        cpu_plan.algorithm(_geometry("NHWC"), "forward", np.float32)
    with cpu_plan.using(chunk_bytes=cpu_plan.RULES.chunk_bytes + 64):
        assert cpu_plan.algorithm(g) == ruled["forward"]      # changed rules: no table
    assert cpu_plan.algorithm(g, "forward", np.float64) == \
        cpu_plan.plan(g, "forward", np.float64, rules=cpu_plan.RULES._replace()).algorithm
    assert cpu_plan.algorithm(_geometry(N=3)) == cpu_plan.algorithm(_geometry(N=3))
    cpu_table.use(None)
    assert cpu_plan.algorithm(g) == ruled["forward"]


def test_a_tables_blocks_of_channels_are_followed_where_the_algorithm_takes_them():
    """An entry's k_blocks makes the plan's (im2col's whole-batch blocks, slab as that mode
    has it; tapwise's), unless the algorithm cannot take that many; an entry without them
    keeps the rules' blocks; the ops' results with such a table are the reference's."""
    g = _geometry()                 # 128 pixels, 32 channels: the rules' im2col in chunks
    k = {p: cpu_table.key(g, p, np.float32) for p in cpu_plan.PASSES}
    ruled = cpu_plan.plan(g, "forward", np.float32, cpu_plan.RULES, "im2col")
    assert (ruled.k_blocks, ruled.slab) == (1, False)
    other = 2                       # the whole batch in 2 blocks (over NCHW slabs)
    assert other in cpu_plan.k_block_choices("im2col", g, "forward", np.float32)
    table = {"version": cpu_table.VERSION, "entries": {
        k["forward"]: {"algorithm": "im2col", "k_blocks": other},
        k["dx"]: {"algorithm": "tapwise", "k_blocks": 64},         # more blocks than 16s
        k["dw"]: {"algorithm": "im2col"}}}
    cpu_table.use(table)
    made = cpu_plan.plan(g, "forward", np.float32)
    assert made == cpu_plan.plan(g, "forward", np.float32, cpu_plan.RULES, "im2col", other)
    assert (made.algorithm, made.k_blocks, made.slab) == ("im2col", other, True)
    assert cpu_plan.plan(g, "dx", np.float32) == \
        cpu_plan._planned(g, "dx", np.float32, cpu_plan.RULES,
                          cpu_plan.choose(g, "dx", np.float32, cpu_plan.RULES))
    assert cpu_plan.plan(g, "dw", np.float32) == \
        cpu_plan.plan(g, "dw", np.float32, cpu_plan.RULES, "im2col")
    with pytest.raises(ValueError, match="takes k_blocks in"):
        cpu_plan.plan(g, "forward", np.float32, cpu_plan.RULES, "winograd", 2)
    rng = np.random.default_rng(6)
    x = rng.standard_normal(g.x_shape).astype(np.float32)
    w = (rng.standard_normal((32, 32, 3, 3)) / 300).astype(np.float32)
    y = nf.conv_bias_relu(x, w, padding=1)
    want = ref.conv_bias_relu(x.astype(np.float64), w.astype(np.float64), None, padding=1)
    np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-4)


def test_a_tables_other_layout_batch_and_dtype_keep_the_rules():
    g = _geometry()
    cpu_table.use(_table({cpu_table.key(g, "forward", np.float32): _other(g, "forward")}))
    for other, dtype in ((_geometry("NHWC"), np.float32), (_geometry(N=3), np.float32),
                         (g, np.float64)):
        with cpu_plan.using(chunk_bytes=cpu_plan.RULES.chunk_bytes + 64):
            ruled = cpu_plan.algorithm(other, "forward", dtype)
        assert cpu_plan.algorithm(other, "forward", dtype) == ruled


def test_the_ops_results_with_a_table_are_the_references():
    rng = np.random.default_rng(4)
    g = _geometry()
    x = rng.standard_normal(g.x_shape).astype(np.float32)
    w = (rng.standard_normal((32, 32, 3, 3)) / 96).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    dy = rng.standard_normal(g.y_shape).astype(np.float32)
    cpu_table.use(_table({cpu_table.key(g, p, np.float32): _other(g, p)
                          for p in cpu_plan.PASSES}))
    y = nf.conv_bias_relu(x, w, b, padding=1)
    dx, dw, db = nf.conv_bias_relu_backward(dy, x, w, y, padding=1)
    want = ref.conv_bias_relu(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                              padding=1)
    np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-4)
    rdx, rdw, rdb = ref.conv_bias_relu_backward(dy.astype(np.float64), x.astype(np.float64),
                                                w.astype(np.float64), b.astype(np.float64),
                                                padding=1)
    for got, expected in ((dx, rdx), (dw, rdw), (db, rdb)):
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)


def test_recording_collects_the_passes_a_call_plans():
    rng = np.random.default_rng(5)
    g = _geometry(C=16, K=24)
    x = rng.standard_normal(g.x_shape).astype(np.float32)
    w = rng.standard_normal((24, 16, 3, 3)).astype(np.float32)
    y = nf.conv_bias_relu(x, w, padding=1)              # plans made (memoised) before
    with cpu_table.recording() as asked:
        y = nf.conv_bias_relu(x, w, padding=1)
        nf.conv_bias_relu_backward(y, x, w, y, padding=1)
    assert {(p, d) for gg, p, d in asked if gg == g} == \
        {(p, np.dtype(np.float32)) for p in cpu_plan.PASSES}
    assert not cpu_plan._RECORDING


def test_choose_keeps_the_rules_pick_within_the_margin():
    assert cpu_table.choose({"a": 1.0, "b": 1.04}, "b", 0.05) == "b"
    assert cpu_table.choose({"a": 1.0, "b": 1.06}, "b", 0.05) == "a"
    assert cpu_table.choose({"a": 1.0, "b": 0.9}, "b", 0.05) == "b"
    assert cpu_table.choose({"a": 1.0, "b": 2.0}, "c", 0.05) == "a"


def test_tune_chooses_from_the_timings_its_table_records(monkeypatch):
    # two algorithms within 0.1 us round to a tie: the table must keep what a reader of its
    # rounded numbers would choose (CI once saw the fastest before rounding kept instead)
    g = _geometry(C=16, K=16)
    ruled = cpu_plan.choose(g, "forward", np.float32, cpu_plan.RULES)
    a, b = [v for v in cpu_table.variants(g, "forward", np.float32) if v != ruled][:2]

    def measure(geom, pass_, dtype, algorithms=None, repeats=5):
        ms = {a: 0.01234, b: 0.012336, ruled: 1.0}     # b fastest unrounded, a tie rounded
        return {v: ms[v] for v in (algorithms or ms)}
    monkeypatch.setattr(cpu_table, "measure", measure)
    e = cpu_table.tune({(g, "forward", np.dtype(np.float32))})["entries"][
        cpu_table.key(g, "forward", np.float32)]
    first = cpu_table.choose(e["ms"], e["rules"])
    assert set(e["again_ms"]) == {first, ruled}
    assert cpu_table.entry_variant(e) == cpu_table.choose(e["again_ms"], e["rules"])


def test_tune_times_every_algorithm_and_its_table_round_trips(tmp_path, monkeypatch):
    g = _geometry(C=16, K=16)
    asked = {(g, p, np.dtype(np.float32)) for p in cpu_plan.PASSES}
    table = cpu_table.tune(asked, repeats=1)
    assert set(table["entries"]) == {cpu_table.key(g, p, np.float32) for p in cpu_plan.PASSES}
    for p in cpu_plan.PASSES:
        e = table["entries"][cpu_table.key(g, p, np.float32)]
        algorithms = {a for a in cpu_plan.ALGORITHMS if cpu_plan.supports(a, g, p, np.float32)}
        assert {cpu_table.parse(v)[0] for v in e["ms"]} == algorithms <= set(e["ms"])
        for a in algorithms:                    # every count of blocks, the rules' by name
            ruled = cpu_plan.plan(g, p, np.float32, cpu_plan.RULES, a).k_blocks
            blocks = {cpu_table.parse(v)[1] or ruled for v in e["ms"] if v.startswith(a)}
            assert blocks == (set(cpu_plan.k_block_choices(a, g, p, np.float32)) or {1})
        assert e["rules"] == cpu_plan.choose(g, p, np.float32, cpu_plan.RULES)
        first = cpu_table.choose(e["ms"], e["rules"])
        if first == e["rules"]:
            assert e["algorithm"] == first and "again_ms" not in e and "k_blocks" not in e
        else:                                   # confirmed by a second timing, or not taken
            assert set(e["again_ms"]) == {first, e["rules"]}
            kept = cpu_table.choose(e["again_ms"], e["rules"])
            assert (e["algorithm"], e.get("k_blocks")) == cpu_table.parse(kept)
    assert set(table["machine"]) >= {"processor", "threads", "repeats", "load_average"}
    path = tmp_path / "table.json"
    cpu_table.save(table, path)
    assert cpu_table.load(path) == json.loads(json.dumps(table))
    # a table with another algorithm for the forward, read from the environment by the
    # first plan of a process (here: as if none had been made)
    other = _other(g, "forward")
    table["entries"][cpu_table.key(g, "forward", np.float32)]["algorithm"] = other
    cpu_table.save(table, path)
    monkeypatch.setenv(cpu_table.ENV, str(path))
    monkeypatch.setattr(cpu_plan_table, "_TABLE_READ", [False])
    cpu_plan._PLANS.clear()
    assert cpu_plan.algorithm(g) == other != \
        cpu_plan.choose(g, "forward", np.float32, cpu_plan.RULES)


def test_a_save_that_fails_leaves_the_old_table(tmp_path):
    # written beside the path and renamed over it: a reader meanwhile, or a write that fails
    # half way (here a value JSON cannot write, after the entries before it), sees the old
    path = tmp_path / "table.json"
    old = {"version": 1, "entries": {}}
    cpu_table.save(old, path)
    with pytest.raises(TypeError):
        cpu_table.save({"version": 1, "entries": {"k": {"algorithm": object()}}}, path)
    assert cpu_table.load(path) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


@pytest.mark.parametrize("text, match", [
    ("{", "not JSON"),
    ('{"version": 99, "entries": {}}', "not a version-1"),
    ('{"version": 1}', "no entries"),
    ('{"version": 1, "entries": {"k": {"algorithm": "fft"}}}', "entry 'k' has algorithm 'fft'"),
    ('{"version": 1, "entries": {"k": {"algorithm": "im2col", "k_blocks": 0}}}',
     "entry 'k' has k_blocks 0"),
    ('{"version": 1, "entries": {"k": {"algorithm": "tapwise", "k_blocks": 2.0}}}',
     "entry 'k' has k_blocks 2.0"),
    ('{"version": 1, "entries": {"k": {"algorithm": "winograd", "k_blocks": 2}}}',
     "entry 'k' has k_blocks 2 \\(a positive int, for im2col or tapwise only\\)"),
])
def test_load_refuses_what_is_not_a_table(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"conv table {path}: {match}"):
        cpu_table.load(path)


def test_a_table_named_in_the_environment_that_is_missing_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "missing.json"
    monkeypatch.setenv(cpu_table.ENV, str(path))
    monkeypatch.setattr(cpu_plan_table, "_TABLE_READ", [False])
    cpu_plan._PLANS.clear()
    with pytest.raises(ValueError, match=f"conv table {path}: cannot be read"):
        cpu_plan.algorithm(_geometry())
    with cpu_plan.using(chunk_bytes=cpu_plan.RULES.chunk_bytes + 64):
        cpu_plan.algorithm(_geometry())         # other rules: no table asked for


@pytest.mark.parametrize("again, kept", [("slower", "rules"), ("faster", "other")])
def test_a_pass_that_moves_off_the_rules_is_timed_again(monkeypatch, again, kept):
    """A first timing that puts another algorithm ahead is checked by a second of the two
    alone: a pass slowed once (another process) does not move the plan."""
    g = _geometry()
    ruled = cpu_plan.choose(g, "forward", np.float32, cpu_plan.RULES)
    other = _other(g, "forward")
    calls = []

    def measure(geom, pass_, dtype, algorithms=None, repeats=5, rng=None):
        calls.append(algorithms)
        if algorithms is None:                                    # the first timing
            return {ruled: 2.0, other: 1.0}
        return {ruled: 1.0, other: 1.0 if again == "slower" else 0.5}
    monkeypatch.setattr(cpu_table, "measure", measure)
    table = cpu_table.tune({(g, "forward", np.dtype(np.float32))})
    entry = table["entries"][cpu_table.key(g, "forward", np.float32)]
    assert calls == [None, (ruled, other)]
    assert entry["algorithm"] == {"rules": ruled, "other": other}[kept]
