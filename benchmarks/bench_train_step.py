"""ms per training step of the digits ResNet: numbafuse fused / unfused / remapped vs PyTorch.

    python benchmarks/bench_train_step.py [--rounds 5] [--repeats 40] [--layout NHWC]
                                          [--threads N] [--markdown FILE]

The network of ``numbafuse.models.build_model`` (stem Conv2dBiasReLU 1->24 3x3 pad 1, two
residual blocks [ConvBatchNormReLU, Conv2d no bias, BatchNormAddReLU with the block input],
global average pool, Linear 24->10), batch 32 of 8x8 images, SGD lr 0.05, momentum 0.9, weight
decay 5e-4, float32, and the same network written in PyTorch (``torch.nn``, channels_last for
NHWC), with torch.optim.SGD of the same settings. A step = zero the gradients (set to None on
both sides), forward, cross-entropy, backward, SGD update. Batches are seeded random images
and labels of the digits shapes (a step's time does not depend on the pixel values), the same
on both sides. Each library runs in its own processes (``_runner.py``), alternating, and the
table keeps the best step of each model.

numbafuse models: fused (ConvBatchNormReLU recomputing its conv in backward), fused keeping
the conv output (no recompute), unfused, and the unfused model remapped by numbafuse.compile.
"""
import argparse
import sys

import numpy as np

import _report
import _runner

BATCH, SIZE, CLASSES, WIDTH, BLOCKS = 32, 8, 10, 24, 2
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4
N_BATCHES = 16


def batches(layout):
    rng = np.random.default_rng(0)
    shape = (BATCH, 1, SIZE, SIZE) if layout == "NCHW" else (BATCH, SIZE, SIZE, 1)
    return [(rng.uniform(0, 1, shape).astype(np.float32),
             rng.integers(0, CLASSES, BATCH).astype(np.int64)) for _ in range(N_BATCHES)]


def _cycle(data):
    state = {"i": 0}

    def next_batch():
        state["i"] = (state["i"] + 1) % len(data)
        return data[state["i"]]
    return next_batch


def _numbafuse_cases(layout):
    from numbafuse import models, optim, train
    models = {
        "numbafuse fused (recompute)": models.make_model("fused", layout=layout, recompute=True),
        "numbafuse fused (keep conv output)": models.make_model("fused", layout=layout,
                                                               recompute=False),
        "numbafuse unfused": models.make_model("unfused", layout=layout),
        "numbafuse remapped unfused": models.make_model("remap", layout=layout),
    }
    out = {}
    for name, model in models.items():
        opt = optim.SGD(list(model.parameters()), lr=LR, momentum=MOMENTUM,
                        weight_decay=WEIGHT_DECAY)
        nxt = _cycle(batches(layout))

        def step(model=model, opt=opt, nxt=nxt):
            xb, yb = nxt()
            train.train_step(model, opt, xb, yb)
        out[name] = step
    return out


def _torch_cases(layout):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, C):
            super().__init__()
            self.conv1 = nn.Conv2d(C, C, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(C)
            self.conv2 = nn.Conv2d(C, C, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(C)

        def forward(self, x):
            h = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(h)) + x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, WIDTH, 3, padding=1), nn.ReLU(),
                          *[Block(WIDTH) for _ in range(BLOCKS)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTH, CLASSES))
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    model = model.to(memory_format=fmt).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    data = []
    for xb, yb in batches("NCHW"):            # torch's logical shape is NCHW always
        data.append((torch.from_numpy(xb).contiguous(memory_format=fmt), torch.from_numpy(yb)))
    nxt = _cycle(data)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        xb, yb = nxt()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xb), yb).backward()
        opt.step()
    return {f"PyTorch {layout}": step}


def cases(side, options):
    layout = options["layout"]
    return _torch_cases(layout) if side == "torch" else _numbafuse_cases(layout)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=40, help="timed steps per model and process")
    p.add_argument("--layout", default="NHWC", choices=("NCHW", "NHWC"))
    p.add_argument("--threads", type=int, help="threads of both libraries (default: theirs)")
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    best, info = _runner.compare("bench_train_step", ["numbafuse", "torch"], args.rounds,
                                 args.repeats, dict(layout=args.layout, threads=args.threads),
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
    times = {**best["numbafuse"], **best["torch"]}
    cpu = {**info["cpu"]["numbafuse"], **info["cpu"]["torch"]}
    base = times["numbafuse unfused"]
    lines = _runner.header(info, _report.command("bench_train_step.py"))
    lines += [f"Digits ResNet (width {WIDTH}, {BLOCKS} blocks), batch {BATCH} of {SIZE}x{SIZE}, "
              f"{args.layout}, float32; best step of {args.rounds} processes x {args.repeats} "
              "steps per model after 2 warm-up steps.", "",
              "| model | best ms/step | / numbafuse unfused | best CPU ms/step |",
              "|---|---:|---:|---:|"]
    for name, t in times.items():
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / base:.2f} | {cpu[name] * 1e3:.2f} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
