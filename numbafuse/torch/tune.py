"""``python -m numbafuse.torch.tune``: measure on this machine which algorithm runs each conv
pass of a fused ResNet's training step fastest, and save the table that the CPU conv plans
then follow (``kernels/conv/cpu_table.py``; docs/pytorch.md, "A measured plan")::

    python -m numbafuse.torch.tune --model resnet18 --batch 16 --size 64 --out conv_table.json
    NUMBAFUSE_CONV_TABLE=conv_table.json python train.py

One training step of ``fuse(resnet(...))`` (SGD, random data) records the passes its plans
are asked for; each is timed by every algorithm that can run it, on random inputs of its
shape, with this process's threads. A table is for the shapes it was made at: other batch
sizes or image sizes plan by the rules. :func:`tune_step` does the same for any step function.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..kernels.conv import cpu_table


def tune_step(step, repeats=5, progress=None):
    """The table of the conv passes that ``step()`` (called twice: once to warm up, once
    recorded) plans on the CPU (``cpu_table.tune``)."""
    step()
    with cpu_table.recording() as asked:
        step()
    return cpu_table.tune(asked, repeats=repeats, progress=progress)


def resnet_step(model_name, batch, size, recompute="auto", channels_last=False):
    """One training step (SGD, random data) of ``fuse(resnet.<model_name>())``, a callable."""
    import torch

    from . import fuse, resnet
    torch.manual_seed(0)
    model = fuse(getattr(resnet, model_name)(num_classes=1000), recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(batch, 3, size, size)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,))

    def step():
        for p in model.parameters():
            p.grad = None
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        opt.step()
    return step


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m numbafuse.torch.tune",
        description="Time every algorithm of each CPU conv pass of a fused ResNet's training "
                    "step on this machine and save the table of the fastest, which the conv "
                    "plans then follow (NUMBAFUSE_CONV_TABLE=FILE; docs/pytorch.md, 'A "
                    "measured plan').")
    p.add_argument("--model", default="resnet18", choices=("resnet18", "resnet50"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--recompute", default="auto", choices=("auto", "True", "False"))
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each algorithm")
    p.add_argument("--out", default="conv_table.json")
    args = p.parse_args(argv)
    if args.batch < 1 or args.size < 32 or args.repeats < 1:
        p.error("--batch and --repeats must be >= 1 and --size >= 32")
    load = cpu_table._load_average()
    if load is not None and load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load} on {os.cpu_count()} CPUs: timings taken beside "
              f"other work are noisy (a pass moves off the rules only when timed faster "
              f"twice, but a quiet machine gives the better table)", file=sys.stderr)
    recompute = {"True": True, "False": False}.get(args.recompute, args.recompute)
    step = resnet_step(args.model, args.batch, args.size, recompute, args.channels_last)

    def progress(i, n, key):
        print(f"\r[{i + 1}/{n}] {key[:90]:90s}", end="", file=sys.stderr, flush=True)
    table = tune_step(step, args.repeats, progress)
    print(file=sys.stderr)
    cpu_table.save(table, args.out)
    entries = table["entries"]
    changed = {k: e for k, e in entries.items() if cpu_table.entry_variant(e) != e["rules"]}
    print(f"{len(entries)} conv passes timed; {len(changed)} take another algorithm or other "
          f"blocks of channels than the rules' (more than {cpu_table.MARGIN:.0%} faster here):")
    for k, e in sorted(changed.items()):
        kept = cpu_table.entry_variant(e)
        print(f"  {k}: {e['rules']} {e['ms'][e['rules']]:.3f} ms -> {kept} "
              f"{e['ms'][kept]:.3f} ms")
    print(f"saved {args.out}; use it with {cpu_table.ENV}={args.out} (or "
          f"numbafuse.kernels.conv.cpu_table.use({args.out!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
