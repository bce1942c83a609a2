"""benchmarks/bench_gpu.py runs end to end (tiny shapes; under the simulator its times mean
nothing, but the script a GPU session will run is kept working). Its measurements run in
worker processes, one per library (the torch worker reports itself skipped here)."""
import importlib.util
import os

import pytest

HERE = os.path.dirname(__file__)
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def _load():
    path = os.path.join(HERE, "..", "..", "benchmarks", "bench_gpu.py")
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.skipif(not SIMULATOR, reason="on a GPU the benchmark itself runs "
                    "(benchmarks/gpu_check.sh); its smoke shapes and tiny tiles would only "
                    "compile kernels no one uses")
def test_bench_gpu_smoke(capsys):
    bench = _load()
    bench.main(["--smoke"])         # float32 and float16 kernel rows (the default --dtypes)
    out = capsys.readouterr().out
    assert "Failed measurements" not in out, out
    for row in ("conv_bias_relu forward", "batchnorm_add_relu forward (training)",
                "an empty kernel launch", "numbafuse fused", "numbafuse unfused"):
        assert f"| {row} |" in out, row
    # each kernel row measured (eager and replayed), float32 as before and marked fp16
    conv = "| x (1, 2, 4, 4), w (2, 2, 3, 3), {'padding': 1}"
    bn = ["| (1, 2, 3, 3) | NCHW", "| (1, 3, 3, 2) | NHWC"]
    lines = out.splitlines()
    for tag in ("", ", fp16"):
        cells = [line[len(conv + tag + " | "):] for line in lines
                 if line.startswith(conv + tag + " | ")]     # eager table, graph table
        assert len(cells) == 2 and not any(c.startswith(("failed", "n/a")) for c in cells), \
            (tag, cells)
        for b in bn:
            assert sum(line.startswith(b + tag + suffix + " | ") and "failed" not in line
                       for line in lines for suffix in ("", ", CUDA graph")) == 2, (tag, b)
    assert "Conv-Bias-ReLU, float16 NCHW" in out and "BatchNorm-Add-ReLU, float16" in out


def test_a_failed_measurement_is_reported_and_the_rest_kept(tmp_path):
    """One measurement raising does not lose the others; the error lands in the report."""
    bench = _load()
    results = bench.Results(str(tmp_path / "r.json"), device="test")
    results.measure("calls", "good", lambda: 1.5e-5)
    results.measure("calls", "bad", lambda: 1 / 0)
    import json
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["calls"] == {"good": 1.5e-5}
    assert "ZeroDivisionError" in saved["errors"]["calls bad"]
    lines = bench.tables(saved, {"skipped": "none"}, "cmd", bench.SMOKE)
    assert any("calls bad" in line and "ZeroDivisionError" in line for line in lines)


def test_a_failed_half_measurement_keeps_the_float32_rows():
    """--dtypes: float32 keys and rows as before the half rows; a float16 row that failed
    reads "failed", its error is reported, and the float32 rows keep their figures."""
    import argparse
    bench = _load()
    assert bench._dtypes("float16, float32") == ("float32", "float16")   # float32 first
    assert bench._dtypes("float32") == ("float32",)
    with pytest.raises(argparse.ArgumentTypeError):
        bench._dtypes("float64")
    (x, w, kw), = bench.SMOKE["conv"]
    assert bench._conv_key(x, w, kw, "float32") == \
        "conv_bias_relu | x (1, 2, 4, 4), w (2, 2, 3, 3), {'padding': 1}"
    assert bench._bn_key((1, 2, 3, 3), "NCHW", "float32") == \
        "batchnorm_add_relu | (1, 2, 3, 3) NCHW"
    kernels = {bench._conv_key(x, w, kw, "float32"): [1.0, 2.0, 0.5, 1.5]}
    kernels.update({bench._bn_key(s, lay, "float32"): [1.0, 2.0] for s, lay in bench.SMOKE["bn"]})
    kernels[bench._bn_key((1, 2, 3, 3), "NCHW", "float16")] = [1.0, 2.0]
    nf = dict(kernels=kernels, copy_gbs=1e-9,
              errors={"kernels " + bench._conv_key(x, w, kw, "float16"): "CudaAPIError: 700"})
    lines = bench.tables(nf, {"skipped": "none"}, "cmd", bench.SMOKE)
    row = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line for line in lines
           if line.startswith("| ")}
    assert row["| x (1, 2, 4, 4), w (2, 2, 3, 3), {'padding': 1} | 1.000"]
    assert "| x (1, 2, 4, 4), w (2, 2, 3, 3), {'padding': 1}, fp16 | failed" in row
    # the bandwidth share counts 4 bytes an element for float32, 2 for float16
    n = 1 * 2 * 3 * 3
    f32, f16 = row["| (1, 2, 3, 3) | NCHW"], row["| (1, 2, 3, 3) | NCHW, fp16"]
    assert f32.endswith(f"| {100 * 12 * n / 1e-3 / 1e9 / 1e-9:.0f}% / "
                        f"{100 * 32 * n / 2e-3 / 1e9 / 1e-9:.0f}% |"), f32
    assert f16.endswith(f"| {100 * 6 * n / 1e-3 / 1e9 / 1e-9:.0f}% / "
                        f"{100 * 16 * n / 2e-3 / 1e9 / 1e-9:.0f}% |"), f16
    assert row["| (1, 3, 3, 2) | NHWC, fp16"].startswith("| (1, 3, 3, 2) | NHWC, fp16 | failed")
    assert any("fp16" in line and "CudaAPIError" in line for line in lines)
