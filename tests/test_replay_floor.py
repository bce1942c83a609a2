"""benchmarks/replay_floor.py: a fused call's launches and compiled steps recorded and
replayed; the replay's check catches a compiled step the recording leaves out."""
import pathlib
import re
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'numbafuse[torch]'); "
                    ".ci/run's torch leg has it")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import replay_floor  # noqa: E402

pytestmark = pytest.mark.torch
SMALL = ["--batch", "2", "--size", "8", "--channels", "16", "--calls", "2", "--rounds", "1"]


@pytest.mark.parametrize("op", ["cbr", "cbar"])
def test_both_directions_are_recorded_checked_and_timed(op, capsys):
    assert replay_floor.main(SMALL + ["--op", op]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[0] for r in rows] == ["forward", "backward"]
    for _, launches, steps, arrays, checked, missed, fused, replay in rows:
        assert int(launches) >= 2 and int(steps) >= 1 and 0 < int(checked) <= int(arrays)
        assert missed == "0"                # (at this shape nothing escapes the recording)
        assert float(fused) > 0 and float(replay) > 0


def _rows(out):
    return re.findall(r"^\| (forward|backward) \| (\d+), (\d+), (\d+) \((\d+), (\d+)\) "
                      r"\| (\S+) / \S+ \| (\S+) / \S+ \|", out, re.MULTILINE)


def test_a_step_left_out_of_the_recording_is_counted(monkeypatch, capsys):
    monkeypatch.setattr(replay_floor, "STEPS", tuple(s for s in replay_floor.STEPS
                                                     if s not in ("channel_values", "step")))
    assert replay_floor.main(SMALL) == 0
    out = capsys.readouterr().out
    missed = {r[0]: int(r[5]) for r in _rows(out)}
    assert missed["forward"] >= 1 and "Not rewritten:" in out
