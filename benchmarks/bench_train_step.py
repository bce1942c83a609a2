"""ms per training step of the digits ResNet: fused vs unfused vs remapped, interleaved.

    python benchmarks/bench_train_step.py [--steps 40] [--rounds 7] [--layout NHWC]
                                          [--markdown FILE]

``python -m numbafuse.train --compare`` trains one model after the other, so a change in the
machine's load between the two runs lands on one side only. Here every model takes one step
in turn, on the same batches, round after round, in one process; the table reports the
median and the best step time of each. Models: fused (ConvBatchNormReLU recomputing its conv
in backward), fused without recompute (it keeps the conv output and a 1-bit mask), unfused,
and the unfused model remapped by numbafuse.compile.
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

from numbafuse import data, models, optim, train  # noqa: E402

WARMUP_STEPS = 5


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layout", default=models.DEFAULTS["layout"])
    p.add_argument("--batch-size", type=int, default=train.DEFAULTS["batch_size"])
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)

    digits = data.load_digits(layout=args.layout)
    batches = [(np.ascontiguousarray(xb), yb) for xb, yb in
               data.batches(digits.x_train, digits.y_train, args.batch_size, seed=0,
                            drop_last=True)]
    nets = {
        "fused (recompute)": models.make_model("fused", layout=args.layout, recompute=True),
        "fused (keep conv output)": models.make_model("fused", layout=args.layout,
                                                     recompute=False),
        "unfused": models.make_model("unfused", layout=args.layout),
        "remapped unfused": models.make_model("remap", layout=args.layout),
    }
    opts = {k: optim.SGD(list(m.parameters()), lr=0.01, momentum=0.9)
            for k, m in nets.items()}
    times = {k: [] for k in nets}
    held = {}
    for name, model in nets.items():               # compile and warm up, untimed
        for xb, yb in batches[:WARMUP_STEPS]:
            _, _, held[name] = train.train_step(model, opts[name], xb, yb)
    for r in range(args.rounds):
        for i in range(args.steps):
            xb, yb = batches[(r * args.steps + i) % len(batches)]
            for name, model in nets.items():
                t0 = time.perf_counter()
                train.train_step(model, opts[name], xb, yb)
                times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["unfused"])
    lines = [f"Command: `{_report.command('bench_train_step.py')}`",
             "",
             f"Digits ResNet (models.DEFAULTS: width {models.DEFAULTS['width']}, "
             f"{models.DEFAULTS['blocks']} blocks), batch {args.batch_size}, {args.layout}, "
             f"float32; {args.rounds} rounds x {args.steps} interleaved steps per model "
             f"after {WARMUP_STEPS} warm-up steps; a step = forward, saved_bytes, backward, "
             f"SGD update.",
             "",
             "| model | median ms/step | best ms/step | median / unfused | "
             "saved for backward (KiB) |",
             "|---|---:|---:|---:|---:|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med * 1e3:.2f} | {min(ts) * 1e3:.2f} | {med / base:.2f} | "
                     f"{held[name] / 1024:.1f} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
