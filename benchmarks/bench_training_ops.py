"""Each fused op vs its unfused chain at the digits ResNet's training shape, on the tape.

    python benchmarks/bench_training_ops.py [--rounds 200] [--markdown FILE]

Shape: batch 32, 8x8 images, 24 channels, 3x3 convs with padding 1, NHWC, float32 (the
defaults of ``python -m numbafuse.train``). Each case is forward + backward through the tape
with fresh leaf Tensors; cases run round-robin in one process; median and best of the rounds.
This is where the training step's time goes (see docs/training.md).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _report
import _report  # noqa: E402

import numbafuse as nf  # noqa: E402
from numbafuse import Tensor  # noqa: E402

LAYOUT = "NHWC"
SHAPE = (32, 8, 8, 24)   # N, H, W, C


def cases():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    z = rng.standard_normal(SHAPE).astype(np.float32)
    C = SHAPE[-1]
    w = (rng.standard_normal((C, C, 3, 3)) * 0.1).astype(np.float32)
    b = np.zeros(C, np.float32)
    gamma, beta = np.ones(C, np.float32), np.zeros(C, np.float32)
    conv = dict(padding=1, layout=LAYOUT)

    def leaf(a):
        return Tensor(a, requires_grad=True)

    return {
        "conv2d alone": lambda: nf.conv2d(leaf(x), leaf(w), **conv),
        "conv_bias_relu": lambda: nf.conv_bias_relu(leaf(x), leaf(w), leaf(b), **conv),
        "conv2d, bias_add, relu": lambda: nf.relu(nf.bias_add(
            nf.conv2d(leaf(x), leaf(w), **conv), leaf(b), layout=LAYOUT)),
        "conv_batchnorm_relu (recompute)": lambda: nf.conv_batchnorm_relu(
            leaf(x), leaf(w), leaf(gamma), leaf(beta), **conv),
        "conv2d, batchnorm, relu": lambda: nf.relu(nf.batchnorm(
            nf.conv2d(leaf(x), leaf(w), **conv), leaf(gamma), leaf(beta), layout=LAYOUT)),
        "batchnorm_add_relu": lambda: nf.batchnorm_add_relu(
            leaf(x), leaf(z), leaf(gamma), leaf(beta), layout=LAYOUT),
        "batchnorm, add, relu": lambda: nf.relu(nf.add(
            nf.batchnorm(leaf(x), leaf(gamma), leaf(beta), layout=LAYOUT), leaf(z))),
    }


def fwd_bwd(build):
    out = build()
    out.backward(np.ones(out.shape, np.float32))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    todo = cases()
    for build in todo.values():          # compile and warm up
        fwd_bwd(build)
    times = {name: [] for name in todo}
    for _ in range(args.rounds):
        for name, build in todo.items():
            t0 = time.perf_counter()
            fwd_bwd(build)
            times[name].append(time.perf_counter() - t0)
    lines = [f"Command: `{_report.command('bench_training_ops.py')}`", "",
             f"Forward + backward on the tape, x {SHAPE} {LAYOUT} float32, 3x3 convs, padding 1; "
             f"median and best of {args.rounds} round-robin rounds.", "",
             "| case | median ms | best ms |", "|---|---:|---:|"]
    for name, ts in times.items():
        lines.append(f"| {name} | {statistics.median(ts) * 1e3:.3f} | {min(ts) * 1e3:.3f} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
