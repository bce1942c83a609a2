"""benchmarks/bench_gpu.py runs end to end (tiny shapes; under the simulator its times mean
nothing, but the script a GPU session will run is kept working). Its measurements run in
worker processes, one per library (the torch worker reports itself skipped here)."""
import importlib.util
import os

HERE = os.path.dirname(__file__)


def test_bench_gpu_smoke(capsys):
    path = os.path.join(HERE, "..", "..", "benchmarks", "bench_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--smoke"])
    out = capsys.readouterr().out
    assert "| conv_bias_relu |" in out and "| batchnorm_add_relu |" in out
    for row in ("conv_bias_relu forward", "batchnorm_add_relu forward (training)",
                "an empty kernel launch", "numbafuse fused", "numbafuse unfused"):
        assert f"| {row} |" in out, row
