"""The training loop, the digits data and the numbafuse-train CLI, on small subsets.

A short run's loss decreases; the same seed gives the same loss curve; the fused, unfused and
remapped models start from identical weights and follow the same curve; --report writes the
promised JSON fields; the CLI parses and refuses bad values.
"""
import json

import numpy as np
import pytest

from numbafuse import cli, data, models, train

QUICK = dict(width=8, blocks=1)                  # a tiny model: this file must stay fast
SUBSET = dict(n_train=96, n_test=48)
FIT = dict(epochs=2, batch_size=32, progress=False, log=None)
CURVE_TOL = dict(rtol=1e-4, atol=1e-5)           # float32 fused vs unfused kernels
CLI_QUICK = ["--epochs", "1", "--width", "8", "--blocks", "1", "--train-subset", "64",
             "--test-subset", "32", "--no-progress"]


@pytest.fixture(scope="module")
def digits():
    return data.load_digits(layout="NHWC").subset(**SUBSET)


# --------------------------------------------------------------------------- data

def test_digits_split_is_stratified_standardised_and_seeded():
    d = data.load_digits()
    assert d.x_train.shape[1:] == (1, 8, 8) and d.x_train.dtype == np.float32
    assert len(d.x_train) + len(d.x_test) == 1797
    assert d.y_train.dtype == np.int64 and set(np.unique(d.y_test)) == set(range(10))
    counts = np.bincount(d.y_test, minlength=10) / np.bincount(d.y_train, minlength=10)
    assert np.allclose(counts, 0.25, atol=0.03)                 # 20/80 in every class
    assert abs(d.x_train.mean()) < 1e-5 and abs(d.x_train.std() - 1) < 1e-4
    again = data.load_digits(layout="NHWC")
    np.testing.assert_array_equal(again.x_train[..., 0], d.x_train[:, 0])
    np.testing.assert_array_equal(again.y_test, d.y_test)


def test_batches_are_seeded_and_cover_everything():
    x, y = np.arange(10.0), np.arange(10)
    a = [yb for _, yb in data.batches(x, y, 4, seed=3)]
    b = [yb for _, yb in data.batches(x, y, 4, seed=3)]
    assert [len(v) for v in a] == [4, 4, 2]
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert sorted(np.concatenate(a)) == list(range(10))
    assert [len(v) for _, v in data.batches(x, y, 4, drop_last=True)] == [4, 4]


def test_random_shift_moves_pixels_and_keeps_shapes():
    rng = np.random.default_rng(0)
    x = np.zeros((16, 1, 8, 8), np.float32)
    x[:, :, 4, 4] = 1.0
    shifted = data.random_shift(x, rng, 1)
    assert shifted.shape == x.shape and np.all(shifted.sum(axis=(1, 2, 3)) == 1.0)
    assert not np.array_equal(shifted, x)
    nhwc = data.random_shift(x.transpose(0, 2, 3, 1), np.random.default_rng(0), 1, "NHWC")
    np.testing.assert_array_equal(nhwc.transpose(0, 3, 1, 2), shifted)


# --------------------------------------------------------------------------- fit

def test_loss_decreases_and_history_fields(digits):
    h = train.fit(models.make_model("fused", "NHWC", **QUICK), digits, epochs=4, lr=0.1,
                  batch_size=32, progress=False, log=None)
    assert h["epoch_loss"][-1] < h["epoch_loss"][0]
    assert len(h["loss_curve"]) == h["steps"] == 4 * 3
    assert 0.0 <= h["test_accuracy"] <= 1.0 and h["ms_per_step"] > 0
    assert h["saved_bytes"] > 0


def test_same_seed_same_curve_and_fused_equals_unfused(digits):
    curves = {}
    for kind in ("fused", "fused", "unfused"):
        h = train.fit(models.make_model(kind, "NHWC", seed=5, **QUICK), digits, seed=5, **FIT)
        curves.setdefault(kind, []).append(np.array(h["loss_curve"]))
    np.testing.assert_array_equal(curves["fused"][0], curves["fused"][1])    # reproducible
    np.testing.assert_allclose(curves["fused"][0], curves["unfused"][0], **CURVE_TOL)


def test_identical_initial_weights():
    fused = models.make_model("fused", "NCHW", seed=3, **QUICK)
    unfused = models.make_model("unfused", "NCHW", seed=3, **QUICK)
    fp = [p.numpy() for p in fused.parameters()]
    up = [p.numpy() for p in unfused.parameters()]
    assert [a.shape for a in fp] == [a.shape for a in up]
    for a, b in zip(fp, up):
        np.testing.assert_array_equal(a, b)


def test_fused_saves_less_than_unfused(digits):
    held = {kind: train.fit(models.make_model(kind, "NHWC", **QUICK), digits, epochs=1,
                            batch_size=32, progress=False, log=None)["saved_bytes"]
            for kind in ("fused", "unfused")}
    assert held["fused"] < held["unfused"]


def test_remapped_model_follows_the_fused_curve(digits):
    fused = train.fit(models.make_model("fused", "NHWC", **QUICK), digits, **FIT)
    remapped_model = models.make_model("remap", "NHWC", **QUICK)
    remapped = train.fit(remapped_model, digits, **FIT)
    np.testing.assert_allclose(remapped["loss_curve"], fused["loss_curve"], **CURVE_TOL)
    log = "\n".join(remapped_model.remap_log())
    assert "conv_batchnorm_relu" in log and "batchnorm_add_relu" in log
    assert "conv_bias_relu" in log


# --------------------------------------------------------------------------- CLI

def test_cli_parse_defaults_and_errors():
    args = cli.parse_args([])
    assert args.epochs == train.DEFAULTS["epochs"] and args.device == "cpu"
    assert not args.unfused and args.fuse == "modules"
    args = cli.parse_args(["--unfused", "--device", "cuda", "--layout", "NCHW", "--lr",
                             "0.2", "--fuse", "remap", "--compare"])
    assert args.unfused and args.device == "cuda" and args.lr == 0.2 and args.compare
    for bad in (["--device", "tpu"], ["--epochs", "0"], ["--fuse", "magic"],
                ["--cuda-graph"], ["--cuda-graph", "--device", "cuda"],
                ["--cuda-graph", "--device", "cuda", "--schedule", "constant",
                 "--distributed"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)
    args = cli.parse_args(["--cuda-graph", "--device", "cuda", "--schedule", "constant"])
    assert args.cuda_graph and not cli.parse_args([]).cuda_graph


def test_cli_report_unfused(tmp_path, capsys):
    report = tmp_path / "r.json"
    assert cli.main(CLI_QUICK + ["--unfused", "--report", str(report)]) == 0
    r = json.loads(report.read_text())
    for field in ("test_accuracy", "train_seconds", "ms_per_step", "saved_bytes",
                  "loss_curve", "epoch_loss", "epoch_accuracy"):
        assert field in r, field
    assert r["model"] == "unfused" and len(r["loss_curve"]) == 2
    assert "test accuracy" in capsys.readouterr().out


def test_cli_compare_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    report, plot = tmp_path / "c.json", tmp_path / "c.png"
    assert cli.main(CLI_QUICK + ["--compare", "--report", str(report), "--plot",
                                   str(plot)]) == 0
    out = capsys.readouterr().out
    assert "| ms / step (median) |" in out and "saved for backward" in out
    r = json.loads(report.read_text())
    assert set(r["compare"]) == {"fused", "unfused"}
    assert r["compare"]["fused"]["peak_bytes"] > 0
    assert plot.stat().st_size > 0


def test_cli_save_then_load_and_evaluate_gives_the_same_accuracy(tmp_path, capsys):
    checkpoint = tmp_path / "digits.npz"
    trained, loaded = tmp_path / "trained.json", tmp_path / "loaded.json"
    assert cli.main(CLI_QUICK + ["--save", str(checkpoint), "--report", str(trained)]) == 0
    with np.load(checkpoint) as saved:
        assert "1.conv_bn_relu.bn.num_batches_tracked" in saved.files
        assert int(saved["1.conv_bn_relu.bn.num_batches_tracked"]) == 2     # 64 / 32 batches
    assert cli.main(CLI_QUICK + ["--load", str(checkpoint), "--epochs", "0", "--report",
                                 str(loaded)]) == 0
    before = json.loads(trained.read_text())["test_accuracy"]
    assert json.loads(loaded.read_text())["test_accuracy"] == before
    # the same checkpoint, renamed, in the unfused and the remapped model: the same logits
    data_ = data.load_digits(layout="NHWC").subset(32, 64)
    fused = models.make_model("fused", width=8, blocks=1)
    cli.load_checkpoint(checkpoint, fused, "fused")
    for kind in ("unfused", "remap"):
        other = models.make_model(kind, width=8, blocks=1)
        cli.load_checkpoint(checkpoint, other, kind)
        assert train.evaluate(other, data_.x_test, data_.y_test) == pytest.approx(
            train.evaluate(fused, data_.x_test, data_.y_test), abs=1 / 64)
    with pytest.raises(SystemExit):
        cli.parse_args(["--epochs", "0"])                     # evaluating needs --load
    with pytest.raises(KeyError, match="missing"):
        cli.load_checkpoint(checkpoint, models.make_model("fused", width=8, blocks=2), "fused")


def test_remapped_model_counts_batches_like_the_fused_one(digits):
    counts = {}
    for kind in ("fused", "remap"):
        model = models.make_model(kind, "NHWC", **QUICK)
        train.fit(model, digits, **FIT)
        counts[kind] = [int(v) for k, v in models.state_dict_for("unfused", model.state_dict())
                        .items() if k.endswith("num_batches_tracked")]
    assert counts["fused"] == counts["remap"] == [6, 6]            # 2 epochs x 3 batches


def test_missing_scikit_learn_gives_a_one_line_hint(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "sklearn", None)          # import sklearn -> ImportError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert cli.main(CLI_QUICK) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'numbafuse[data]'" in err
