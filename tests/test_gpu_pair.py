"""benchmarks/gpu_pair.py's table (the GPU runs are its real use): each row's figures per
round for both trees and the ratio of the bests, PyTorch's rows kept apart."""
import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _module():
    path = os.path.join(HERE, "..", "benchmarks", "gpu_pair.py")
    spec = importlib.util.spec_from_file_location("gpu_pair", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pair_table_gives_each_round_and_the_ratio_of_the_bests():
    mod = _module()

    def run(conv, step, torch_conv):
        return dict(numbafuse=dict(calls={"conv": conv}, steps={"step": step}),
                    torch=dict(calls={"conv": torch_conv}))
    this = [run(60e-6, 3.0e-3, 30e-6), run(50e-6, 3.2e-3, 31e-6)]
    other = [run(80e-6, 3.5e-3, 29e-6), run(70e-6, 3.1e-3, 32e-6)]
    lines = mod.table(("a", "b"), (this, other))
    text = "\n".join(lines)
    assert "| conv | 60.0, 50.0 | 80.0, 70.0 | 0.71x |" in text       # 50 / 70
    assert "| step | 3000.0, 3200.0 | 3500.0, 3100.0 | 0.97x |" in text  # 3000 / 3100
    assert "| PyTorch: conv | 30.0, 31.0 | 29.0, 32.0 | 1.03x |" in text
    # a row one tree lacks (a failed run) shows '-' and no ratio
    lines = mod.table(("a", "b"), ([run(60e-6, 3e-3, 30e-6)], [{}]))
    assert "| conv | 60.0 | - |  |" in "\n".join(lines)
