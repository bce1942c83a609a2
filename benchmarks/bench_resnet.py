"""ResNet-18/50 training step and eval forward: ``numbafuse.torch.fuse(model)`` against PyTorch.

    python benchmarks/bench_resnet.py [--models resnet18,resnet50] [--batch 16] [--size 64]
                                      [--rounds 3] [--repeats 5] [--threads N] [--weight-cache]
                                      [--channels-last] [--fused-sgd] [--conv-table FILE]
                                      [--markdown FILE]

The model is torchvision's code (``numbafuse/torch/resnet.py``: the same modules, names and
forward; ``--models`` takes any of its functions, resnext50_32x4d too, and mobilenet.py's
mobilenet_v2 and mobilenet_v2_relu), float32, NCHW, 1000 classes. A training step =
gradients set to None, forward, cross-entropy, backward, SGD (lr 0.01, momentum 0.9, weight
decay 1e-4); "eval" is a forward under ``torch.no_grad`` in eval mode. The numbafuse side runs
``numbafuse.torch.fuse(model, recompute="auto")`` (every Conv-BN(-add)-ReLU chain as one
fused op, the conv outputs recomputed in backward except the deep layers') on the same
model, and its training step also with ``fuse(model)`` (``recompute=True``, the default:
every conv output recomputed) and
``fuse(model, recompute=False)`` (the conv outputs kept), and with
``--weight-cache`` both inside ``numbafuse.torch.weight_cache()`` (the cached eval on a model
of its own that is not trained: a training step gives every weight a new version); the torch
side the model as written. Each library in its own process (``_runner.py``: the torch worker
loads resnet.py from its file, without importing numbafuse), the processes alternating round
by round, best of each. Each worker also prints its first step's time to stderr (compilation
included on the numbafuse side, with whatever Numba cache the environment has).

``--conv-table FILE``: the numbafuse side plans its convs by the measured table FILE
(``numbafuse.kernels.conv.cpu_table``; docs/pytorch.md, "A measured plan"); where FILE does not
exist, the first numbafuse worker makes it first (``numbafuse.torch.tune.tune_step`` on each
model's "auto" training step, ``tune.resnet_step``; the tables merged), outside the timed
rounds.

``--channels-last``: both sides as a PyTorch user makes a model channels_last: the model
``.to(memory_format=torch.channels_last)`` (before ``fuse`` on the numbafuse side, whose
fused ops then run their NHWC kernels) and the input batch channels_last.

``--fused-sgd``: both sides' SGD is PyTorch's own ``torch.optim.SGD(..., fused=True)`` (one
pass over each parameter, its gradient and momentum buffer, where the default runs three
elementwise ops each: a PyTorch feature any model can use; the optimizer is the same on both
sides either way).
"""
import argparse
import importlib.util
import os
import sys
import time

import _report
import _runner

HERE = os.path.dirname(os.path.abspath(__file__))
RESNET = os.path.join(os.path.dirname(HERE), "numbafuse", "torch", "resnet.py")
MOBILENET = os.path.join(os.path.dirname(HERE), "numbafuse", "torch", "mobilenet.py")
LR, MOMENTUM, WEIGHT_DECAY, CLASSES = 0.01, 0.9, 1e-4, 1000
ALL = " (recompute=True)"            # the case name's suffix of fuse(model, recompute=True)
KEEP_H = " (recompute=False)"        # ... of fuse(model, recompute=False)
CACHED = " (weight_cache)"           # ... of fuse(model) run inside numbafuse.torch.weight_cache()


def resnet_module(path=RESNET):
    """numbafuse/torch/resnet.py (or ``path``: mobilenet.py) loaded from its file (torch only,
    no numbafuse import)."""
    spec = importlib.util.spec_from_file_location(
        "_bench_" + os.path.basename(path)[:-3] + "_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_function(name):
    """The function making model ``name``: resnet.py's, or mobilenet.py's for mobilenet_*."""
    return getattr(resnet_module(MOBILENET if name.startswith("mobilenet") else RESNET), name)


def _cache(side, cached):
    """numbafuse.torch.weight_cache() for a cached case, else nothing."""
    import contextlib
    if not cached:
        return contextlib.nullcontext()
    import numbafuse.torch as nft
    return nft.weight_cache()


def _use_conv_table(path, models, batch, size):
    """Plan numbafuse's convs by the table at ``path``, made first if it does not exist."""
    from numbafuse.kernels.conv import cpu_table
    from numbafuse.torch import tune
    if not os.path.exists(path):
        table = None
        for name in models:
            made = tune.tune_step(tune.resnet_step(name, batch, size))
            if table is None:
                table = made
            else:
                table["entries"].update(made["entries"])
        cpu_table.save(table, path)
        print(f"# numbafuse: conv table {path} made ({len(table['entries'])} passes)",
              file=sys.stderr, flush=True)
    cpu_table.use(path)


def cases(side, options):
    import torch
    torch.manual_seed(0)
    batch, size = int(options["batch"]), int(options["size"])
    x = torch.randn(batch, 3, size, size)
    memory = torch.channels_last if options.get("channels_last") else torch.contiguous_format
    x = x.contiguous(memory_format=memory)
    labels = torch.randint(0, CLASSES, (batch,))
    if side == "numbafuse" and options.get("conv_table"):
        rng = torch.get_rng_state()        # (a table made here draws: the models stay as without)
        _use_conv_table(options["conv_table"], options["models"].split(","), batch, size)
        torch.set_rng_state(rng)
    out = {}
    variants = [("", "auto")] + ([(ALL, True), (KEEP_H, False)] if side == "numbafuse"
                                 else []) + (
        [(CACHED, "auto")] if side == "numbafuse" and options.get("weight_cache") else [])
    for name, (suffix, recompute) in ((n, v) for n in options["models"].split(",")
                                       for v in variants):
        model = model_function(name)(num_classes=CLASSES).to(memory_format=memory)
        if side == "numbafuse":
            import numbafuse.torch as nft
            model = nft.fuse(model, recompute=recompute)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                              weight_decay=WEIGHT_DECAY,
                              **({"fused": True} if options.get("fused_sgd") else {}))

        def step(model=model, opt=opt, cached=suffix == CACHED):
            model.train()
            with _cache(side, cached):
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x), labels)
                loss.backward()
                opt.step()

        # the cached eval runs a model of its own that no training step changes (serving):
        # after a step every weight has a new version and nothing cached is valid
        served = nft.fuse(model_function(name)(num_classes=CLASSES).to(
            memory_format=memory)) if suffix == CACHED else model

        def forward(model=served, cached=suffix == CACHED):
            model.eval()
            with torch.no_grad(), _cache(side, cached):
                model(x)

        t0 = time.perf_counter()
        step()
        first = time.perf_counter() - t0
        print(f"# {side} {name}{suffix}: first step {first:.2f} s", file=sys.stderr,
              flush=True)
        out[f"{name} train step{suffix}"] = step
        if suffix not in (ALL, KEEP_H):  # (inference folds the batch norm: no h either way)
            out[f"{name} eval forward{suffix}"] = forward
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,resnet50")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--markdown", default=None, help="write the table to this file")
    p.add_argument("--weight-cache", action="store_true",
                   help="also time fuse(model) inside numbafuse.torch.weight_cache()")
    p.add_argument("--channels-last", action="store_true",
                   help="both sides' model and input in torch.channels_last")
    p.add_argument("--fused-sgd", action="store_true",
                   help="both sides' SGD as torch.optim.SGD(..., fused=True)")
    p.add_argument("--conv-table", default=None,
                   help="plan numbafuse's convs by this measured table (made first if missing)")
    args = p.parse_args(argv)
    options = dict(models=args.models, batch=args.batch, size=args.size)
    if args.conv_table:
        options["conv_table"] = os.path.abspath(args.conv_table)
    if args.weight_cache:
        options["weight_cache"] = 1
    if args.threads:
        options["threads"] = args.threads
    if args.channels_last:
        options["channels_last"] = 1
    if args.fused_sgd:
        options["fused_sgd"] = 1
    best, info = _runner.compare("bench_resnet", ["numbafuse", "torch"], args.rounds,
                                 args.repeats, options, log=lambda s: print(s, file=sys.stderr))
    names = list(best["torch"])
    lines = _runner.header(info, _report.command("bench_resnet.py"))
    lines += [f"Batch {args.batch}, 3x{args.size}x{args.size}, float32, "
              f"{'channels_last (NHWC)' if args.channels_last else 'NCHW'}. numbafuse: "
              f"`fuse(model, recompute=\"auto\")` (backward keeps each conv's input, and "
              f"the deep layers' conv outputs) and, for the training step, "
              f"`fuse(model)` (`recompute=True`, the default: every conv output recomputed) and "
              f"`fuse(model, recompute=False)` (keeps the conv outputs too, as PyTorch does; "
              f"no conv forward in backward)."
              + (f" Conv plans: the measured table `{args.conv_table}` (`--conv-table`)."
                 if args.conv_table else "")
              + (" Both sides' SGD `fused=True` (`--fused-sgd`)." if args.fused_sgd else ""),
              "",
              "| case | numbafuse (fused) ms | PyTorch ms | speed vs PyTorch | "
              "recompute=True ms | its speed vs PyTorch | "
              "recompute=False ms | its speed vs PyTorch"
              + (" | weight_cache ms | its speed vs PyTorch |" if args.weight_cache else " |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|"
              + ("---:|---:|" if args.weight_cache else "")]
    suffixes = (ALL, KEEP_H) + ((CACHED,) if args.weight_cache else ())
    for n in names:
        a, b = best["numbafuse"][n], best["torch"][n]
        extra = ""
        for suffix in suffixes:
            v = best["numbafuse"].get(n + suffix)
            extra += f" | {v * 1e3:.1f} | {b / v:.2f}x" if v else " | - | -"
        lines.append(f"| {n} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x{extra} |")
    spread = [(n, _runner.round_ratios(info, n)) for n in names]
    if args.rounds > 1 and all(r is not None for _, r in spread):
        lines += ["", "Round by round (each round's PyTorch over the same round's numbafuse, "
                  "`recompute=\"auto\"`): " + "; ".join(
                      f"{n} {lo:.2f}-{hi:.2f}x" for n, (lo, hi) in spread) + "."]
    _report.emit(lines, args.markdown)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
