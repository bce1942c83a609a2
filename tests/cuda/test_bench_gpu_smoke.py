"""benchmarks/bench_gpu.py runs end to end (tiny shapes; under the simulator its times mean
nothing, but the script a GPU session will run is kept working). Its measurements run in
worker processes, one per library (the torch worker reports itself skipped here)."""
import importlib.util
import os

import pytest

HERE = os.path.dirname(__file__)
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@pytest.mark.skipif(not SIMULATOR, reason="on a GPU the benchmark itself runs "
                    "(benchmarks/gpu_check.sh); its smoke shapes and tiny tiles would only "
                    "compile kernels no one uses")
def test_bench_gpu_smoke(capsys):
    path = os.path.join(HERE, "..", "..", "benchmarks", "bench_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke"])
    out = capsys.readouterr().out
    assert "| x (1, 2, 4, 4), w (2, 2, 3, 3)" in out
    assert "| (1, 2, 3, 3) | NCHW |" in out and "| (1, 3, 3, 2) | NHWC |" in out
    assert "Failed measurements" not in out, out
    for row in ("conv_bias_relu forward", "batchnorm_add_relu forward (training)",
                "an empty kernel launch", "numbafuse fused", "numbafuse unfused"):
        assert f"| {row} |" in out, row


def test_a_failed_measurement_is_reported_and_the_rest_kept(tmp_path):
    """One measurement raising does not lose the others; the error lands in the report."""
    path = os.path.join(HERE, "..", "..", "benchmarks", "bench_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.Results(str(tmp_path / "r.json"), device="test")
    results.measure("calls", "good", lambda: 1.5e-5)
    results.measure("calls", "bad", lambda: 1 / 0)
    import json
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["calls"] == {"good": 1.5e-5}
    assert "ZeroDivisionError" in saved["errors"]["calls bad"]
    lines = bench.tables(saved, {"skipped": "none"}, "cmd", bench.SMOKE)
    assert any("calls bad" in line and "ZeroDivisionError" in line for line in lines)
