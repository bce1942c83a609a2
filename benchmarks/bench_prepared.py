"""Prepared calls on and off in a fused ResNet's training step, paired in one process.

    python benchmarks/bench_prepared.py [--models resnet18,resnet50] [--batch 16] [--size 64]
                                        [--steps 20] [--scratch] [--eval]

One process a model: ``numbafuse.torch.fuse(model, recompute="auto")`` of
``numbafuse/torch/resnet.py``'s model (1000 classes), float32, NCHW, SGD (lr 0.01, momentum
0.9, weight decay 1e-4), two random batches taken in turn. After six warm-up steps (every
signature recorded and prepared: ``kernels/cpu/recorded.py``), ``--steps`` pairs of steps
alternate between prepared calls on and off (``recorded.ENABLED``; off: the layered path),
so that the machine's drift falls on both alike. Printed, per mode, the medians of: the step;
the fused Functions' cores (``recorded.call``: the ops layer, the drivers, their launches);
the outermost launches inside the cores (each launch's own Python and its kernels); and the
cores' host path (cores less those launches: what a prepared call replaces, plus what it
still makes: allocations, views, the compiled steps between launches). Then the median of
the paired differences of the step. The wrappers that time the cores and the launches are
installed before the model's first call, so the recorded programs call them too.

``--eval``: the eval forward (``model.eval()``, ``torch.no_grad()``: the fused ops' inference
calls, the batch norm in the conv's epilogue or folded) instead of the training step.
``--scratch``: prepared calls on throughout, the pairs alternate between the programs' small
scratch kept from one replay to the next and made at each replay (``programs.Kept``, each
prepared program's ``kept`` set aside: the replay before it).
One library on both sides of one process: this measures what prepared calls change, not a
comparison with PyTorch (``bench_resnet.py``: each library in its own process).
"""
import argparse
import platform
import statistics
import sys
import time


def _instrument(acc):
    """Wrap ``launch._launch`` and ``recorded.call`` to add into ``acc`` the time of the
    cores and of the outermost launches inside them; returns the undo (which also forgets
    the signatures recorded through the wrappers)."""
    from numbafuse.kernels.cpu import launch, recorded
    run_launch, run_call = launch._launch, recorded.call

    def timed_launch(*args, **kwargs):
        acc["launch_depth"] += 1
        t0 = time.perf_counter()
        try:
            return run_launch(*args, **kwargs)
        finally:
            acc["launch_depth"] -= 1
            if acc["core_depth"] and not acc["launch_depth"]:
                acc["launches"] += time.perf_counter() - t0

    def timed_call(fn, args, context):
        acc["core_depth"] += 1
        t0 = time.perf_counter()
        try:
            return run_call(fn, args, context)
        finally:
            acc["core_depth"] -= 1
            acc["cores"] += time.perf_counter() - t0

    launch._launch, recorded.call = timed_launch, timed_call

    def undo():
        launch._launch, recorded.call = run_launch, run_call
        recorded.clear()
    return undo


def run(model_name, batch, size, steps, scratch=False, evaluate=False):
    import torch

    import numbafuse.torch as nft
    from numbafuse.kernels.cpu import first_calls, recorded
    from numbafuse.torch import resnet
    first_calls.set_wait(float("inf"))
    acc = dict(cores=0.0, launches=0.0, core_depth=0, launch_depth=0)
    recorded.clear()                      # (programs recorded through the wrappers only)
    undo = _instrument(acc)
    torch.manual_seed(0)
    model = nft.fuse(getattr(resnet, model_name)(num_classes=1000), recompute="auto").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, 3, size, size, generator=g) for _ in range(2)]
    ys = [torch.randint(0, 1000, (batch,), generator=g) for _ in range(2)]

    if evaluate:
        model.eval()

    def step(i):
        acc["cores"] = acc["launches"] = 0.0
        t0 = time.perf_counter()
        if evaluate:
            with torch.no_grad():
                model(xs[i % 2])
            return time.perf_counter() - t0, acc["cores"], acc["launches"]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(xs[i % 2]), ys[i % 2]).backward()
        opt.step()
        return time.perf_counter() - t0, acc["cores"], acc["launches"]

    enabled = recorded.ENABLED
    try:
        for i in range(6):
            step(i)
        kept = {p: p.kept for p in recorded._programs.values() if getattr(p, "ready", False)}
        rows = {True: [], False: []}
        for i in range(2 * steps):
            on = (i // 2) % 2 == 0
            if scratch:
                for p, k in kept.items():
                    p.kept = k if on else None
            else:
                recorded.ENABLED = on
            rows[on].append(step(i))
        stats = recorded.stats()
    finally:
        recorded.ENABLED = enabled
        undo()
    return rows, stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,resnet50")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval", action="store_true",
                   help="the eval forward instead of the training step")
    p.add_argument("--scratch", action="store_true",
                   help="pair the kept scratch on and off instead of prepared calls")
    args = p.parse_args(argv)
    import numba
    import numpy as np
    import torch

    from numbafuse.kernels.cpu import launch
    print(f"Command: python benchmarks/bench_prepared.py --models {args.models} --batch "
          f"{args.batch} --size {args.size} --steps {args.steps}"
          f"{' --scratch' if args.scratch else ''}{' --eval' if args.eval else ''}\n")
    print(f"Machine: {platform.processor() or platform.machine()}, Python "
          f"{platform.python_version()}, numba {numba.__version__}, numpy {np.__version__}, "
          f"torch {torch.__version__}; {launch.num_threads()} numbafuse threads, "
          f"{torch.get_num_threads()} torch threads\n")
    what = "kept scratch" if args.scratch else "prepared calls"
    print(f"| model | {what} | step ms | cores ms | their launches ms | cores' host "
          "path ms | signatures prepared, refused |\n|---|---|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        rows, stats = run(name, args.batch, args.size, args.steps, args.scratch, args.eval)
        for on in (True, False):
            r = rows[on]

            def median(k):
                return statistics.median(v[k] for v in r) * 1e3
            host = statistics.median(v[1] - v[2] for v in r) * 1e3
            print(f"| {name} | {'on' if on else 'off'} | {median(0):.1f} | {median(1):.1f} "
                  f"| {median(2):.1f} | {host:.2f} | {stats['prepared']}, "
                  f"{sum(stats['refused'].values())} |")
        paired = statistics.median(b[0] - a[0] for a, b in zip(rows[True], rows[False]))
        print(f"| {name} | off less on, paired | {paired * 1e3:.2f} | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
