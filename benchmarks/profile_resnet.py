"""Where a fused ResNet's CPU training step spends its time: numbafuse's kernel launches, each
timed by name.

    python benchmarks/profile_resnet.py [--model resnet18] [--batch 16] [--size 64]
                                        [--steps 5] [--top 25]

The model is ``numbafuse/torch/resnet.py`` (torchvision's code) converted by
``numbafuse.torch.fuse``; a step as in ``bench_resnet.py`` (gradients set to None, forward,
cross-entropy, backward, SGD with momentum and weight decay). Every ``launch`` of a compiled
task kernel is wrapped (``kernels/cpu/launch.launch`` and the names modules imported it
under) and its wall time added to the kernel's name, after three warm-up steps. A launch
made inside another's tasks (``launch.concurrently``, ``launch_all``: a pass's kernels run
side by side) is counted under both, so the column does not sum to the step; the rest of
the step (PyTorch's own ops, the autograd glue, Python) is the step's time less the
outermost launches'. One process, the library's default threads: a profile, not a
comparison (``bench_resnet.py`` compares against PyTorch).
"""
import argparse
import collections
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _name(kernel):
    fn = getattr(kernel, "py_func", kernel)
    module = getattr(fn, "__module__", "") or ""
    return f"{module.rsplit('.', 1)[-1]}.{getattr(fn, '__qualname__', repr(fn))}"


def _wrap_launches(times, counts):
    """Replace ``launch`` in every numbafuse module that holds it; returns the undo."""
    from numbafuse.kernels.cpu import launch as launch_mod
    original = launch_mod.launch
    depth = [0]

    def timed(kernel, *args, **kwargs):
        name = _name(kernel)
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return original(kernel, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            depth[0] -= 1
            times[name] += dt
            counts[name] += 1
            if depth[0] == 0:
                times["(outermost launches)"] += dt

    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("numbafuse")
               and getattr(m, "launch", None) is original]
    for m in patched:
        m.launch = timed

    def undo():
        for m in patched:
            m.launch = original
    return undo


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)

    import torch
    import numbafuse.torch as nft
    from numbafuse.torch import resnet

    torch.manual_seed(0)
    model = nft.fuse(getattr(resnet, args.model)(num_classes=1000))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.randint(0, 1000, (args.batch,))

    def step():
        for param in model.parameters():
            param.grad = None
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        opt.step()

    for _ in range(3):                   # compilation, buffers, the plans' caches
        step()
    times, counts = collections.defaultdict(float), collections.Counter()
    undo = _wrap_launches(times, counts)
    try:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        total = (time.perf_counter() - t0) / args.steps
    finally:
        undo()
    n = args.steps
    outer = times.pop("(outermost launches)", 0.0) / n
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fused, "
          f"{torch.get_num_threads()} torch threads: step {total * 1e3:.1f} ms, of which "
          f"numbafuse's outermost launches {outer * 1e3:.1f} ms ({outer / total:.0%}), "
          f"the rest {(total - outer) * 1e3:.1f} ms (mean of {n} steps)")
    print("\n| kernel | ms a step | launches a step |\n|---|---:|---:|")
    for name, t in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"| `{name}` | {t / n * 1e3:.2f} | {counts[name] / n:g} |")


if __name__ == "__main__":
    main()
