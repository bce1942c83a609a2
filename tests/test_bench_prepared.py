"""benchmarks/bench_prepared.py: prepared calls on and off in a fused ResNet's step, paired in
one process; a small run prints both modes, every signature prepared, and leaves nothing
wrapped."""
import os
import re
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'numbafuse[torch]'); "
                    ".ci/run's torch leg has it")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import bench_prepared  # noqa: E402
from numbafuse.kernels.cpu import launch, recorded  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("flags", [[], ["--scratch"], ["--eval"]])
def test_a_small_run_times_both_modes_and_undoes_its_wrappers(capsys, flags):
    run_launch, run_call = launch._launch, recorded.call
    assert bench_prepared.main(["--models", "resnet18", "--batch", "2", "--size", "32",
                                "--steps", "2"] + flags) == 0
    out = capsys.readouterr().out
    assert ("| kept scratch |" in out) == ("--scratch" in flags)
    rows = re.findall(r"^\| resnet18 \| (on|off) \| (\S+) \| (\S+) \| (\S+) \| (\S+) "
                      r"\| (\d+), (\d+) \|$", out, re.MULTILINE)
    assert [r[0] for r in rows] == ["on", "off"]
    for _, step, cores, launches, host, prepared, refused in rows:
        assert 0 < float(launches) < float(cores) < float(step)
        assert int(prepared) >= (12 if "--eval" in flags else 20) and refused == "0"
    assert "| resnet18 | off less on, paired |" in out
    assert launch._launch is run_launch and recorded.call is run_call and recorded.ENABLED
