"""benchmarks/profile_resnet.py --host: the fused Functions' time split into their launches
and the rest (the host path), on a small ResNet-18 step: every Function and direction that
the fused model calls has a row, and each row's parts add up."""
import pathlib
import re
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'numbafuse[torch]'); "
                    ".ci/run's torch leg has it")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_resnet  # noqa: E402


def test_host_rows_split_each_function_into_launches_and_the_rest(capsys):
    profile_resnet.main(["--host", "--batch", "2", "--size", "32", "--steps", "1",
                         "--recompute", "auto"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (Conv-BN(?:-Add)?-ReLU (?:forward|backward)) \| (\S+) \| (\S+) "
                      r"\| (\S+) \| (\S+) \| (\S+) \|$", out, re.MULTILINE)
    # ResNet-18: 9 Conv-BN-ReLU (the stem, each block's first conv) and 3 Conv-BN (the
    # downsample branches: the same Function, no ReLU), 8 Conv-BN-Add-ReLU block tails
    assert {r[0]: float(r[1]) for r in rows} == {
        "Conv-BN-Add-ReLU backward": 8, "Conv-BN-Add-ReLU forward": 8,
        "Conv-BN-ReLU backward": 12, "Conv-BN-ReLU forward": 12}
    for name, calls, total, launches, rest, per_call in rows:
        total, launches, rest = float(total), float(launches), float(rest)
        assert 0 < launches < total, name
        assert abs(total - launches - rest) <= 0.02, name
        assert abs(rest / float(calls) * 1e3 - float(per_call)) <= 1, name
    assert "The fused Functions' host path:" in out
