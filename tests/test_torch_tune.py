"""``python -m numbafuse.torch.tune``: a small ResNet's step tuned end to end; the table it
saves loads and covers the step's conv passes, and a model planned by it computes what one
planned by the rules does (to float32 rounding)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                                            "'numbafuse[torch]'); .ci/run's torch leg has it")

import numbafuse.torch as nft  # noqa: E402
from numbafuse.kernels.conv import cpu_table  # noqa: E402
from numbafuse.torch import resnet, tune  # noqa: E402

pytestmark = pytest.mark.torch


def test_tune_saves_a_table_of_the_steps_passes(tmp_path, capsys):
    out = tmp_path / "conv_table.json"
    try:
        assert tune.main(["--model", "resnet18", "--batch", "2", "--size", "32",
                          "--repeats", "1", "--out", str(out)]) == 0
        table = cpu_table.load(out)
        step = tune.resnet_step("resnet18", 2, 32, "auto", False)
        step()
        with cpu_table.recording() as asked:
            step()
        assert {cpu_table.key(*a) for a in asked} == set(table["entries"])
        losses = []
        for used in (None, table):
            cpu_table.use(used)
            torch.manual_seed(1)
            model = nft.fuse(resnet.resnet18(num_classes=10), recompute="auto")
            x = torch.randn(2, 3, 32, 32)
            with torch.no_grad():
                losses.append(float(model(x).square().mean()))
        # other algorithms' float32 rounding, through 20 convs each normalised by the
        # statistics of 2 images: the same to 3e-4 here
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-2)
    finally:
        cpu_table.use(None)
    assert "conv passes timed" in capsys.readouterr().out


def test_tune_refuses_bad_sizes():
    with pytest.raises(SystemExit):
        tune.main(["--size", "8"])


def test_tune_lists_a_pass_kept_by_the_rules_algorithm_in_other_blocks(tmp_path, capsys,
                                                                        monkeypatch):
    """A pass whose entry keeps the rules' algorithm in other blocks of channels is a change
    the summary lists, with the time of the variant kept (not of the rules' blocks)."""
    k1, k2 = "NCHW float32 forward one", "NCHW float32 dx two"
    table = {"version": cpu_table.VERSION, "machine": {}, "entries": {
        k1: {"algorithm": "im2col", "k_blocks": 4, "rules": "im2col",
             "ms": {"im2col": 1.9, "im2col k_blocks=4": 0.96}},
        k2: {"algorithm": "tapwise", "rules": "tapwise", "ms": {"tapwise": 1.0}}}}
    monkeypatch.setattr(tune, "tune_step", lambda step, repeats, progress: table)
    assert tune.main(["--batch", "2", "--size", "32", "--out", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "1 take another algorithm or other blocks" in out
    assert f"{k1}: im2col 1.900 ms -> im2col k_blocks=4 0.960 ms" in out and k2 not in out
