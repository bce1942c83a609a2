"""benchmarks/memory_bandwidth.py: one row a thread count, each kernel's GB/s a positive
number; bad arguments refused by argparse."""
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import _runner  # noqa: E402
import memory_bandwidth  # noqa: E402


def test_a_row_per_thread_count(capsys):
    memory_bandwidth.main(["--mib", "1", "--rounds", "1"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, _runner.usable_cores() + 1))
    assert all(float(v) > 0 for r in rows for v in r[1:])
    assert "| threads | copy | add | sum |" in out


@pytest.mark.parametrize("argv", [["--mib", "0"], ["--rounds", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        memory_bandwidth.main(argv)
    assert "must be at least 1" in capsys.readouterr().err
