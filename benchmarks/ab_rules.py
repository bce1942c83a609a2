"""Conv plan rules A/B inside one fused ResNet process: variants alternate in blocks.

    python benchmarks/ab_rules.py --variant 'off: pointwise_chunked_pixels=0' [--variant ...]
                                  [--model resnet18] [--batch 16] [--size 64] [--eval]
                                  [--rounds 12] [--block 4] [--drop 2] [--sites 'R=1,H=8']

One process: ``numbafuse.torch.fuse(model, recompute="auto")`` of ``bench_resnet.py``'s model,
a training step (gradients set to None, forward, cross-entropy, backward, SGD) or with
``--eval`` a forward under ``torch.no_grad()`` in eval mode. Each round runs every variant
(the defaults first, named "default") for ``--block`` steps inside ``cpu_plan.using(**its
changes)``, and keeps the last ``block - drop`` of them: the first steps after a switch run
slower (machine E, 2026-12-03: ResNet-18's steps alternating rule variants step by step
had medians of 101-102 ms, in blocks of 4 with 2 dropped 69-70; the cause
not measured: plans, output-cache blocks of other sizes and derived arrays are made anew).

Both variants run the same model on the same data in the same process, so what differs is
the plan: the way to tell a rule's effect in the network from this machine's drift, which
moves a whole process's speed by a third between runs (docs/benchmarks.md, "Machine E at
aff3d94"). ``--sites``: also the time of the fused Conv-BatchNorm calls whose geometry
matches (``ops.conv_batchnorm``'s forward / backward entry points; fields of
``validate.ConvGeometry`` as ``NAME=int``, comma-separated), summed a step.

A variant is ``NAME: field=value, field=value`` with fields of ``cpu_plan.Rules``
(ints, floats, True/False, or a quoted string), and dotted names of module attributes that
numbafuse reads at call time (``numbafuse.torch.conv_batchnorm.KEEP_H_MIN_MACS=128``: the
line of ``recompute="auto"``; ``numbafuse.kernels.cpu.blas.PACK_B=False``), set for the
variant's blocks and restored after. An attribute copied at import by ``from ... import``
elsewhere is not seen through that copy: such a variant changes nothing there. Prepared
calls are off for the whole run (``kernels/cpu/recorded.py``: a replay keeps the plans and
knobs of the calls it recorded, and runs past the sites' wrappers).
"""
import argparse
import ast
import collections
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_variant(text):
    """``NAME: a=1, b=False`` -> ("NAME", {"a": 1, "b": False}) (a ValueError on a bad one)."""
    name, _, body = text.partition(":")
    name, changes = name.strip(), {}
    if not name or not _:
        raise ValueError(f"a variant is 'NAME: field=value, ...', got {text!r}")
    for part in filter(None, (p.strip() for p in body.split(","))):
        field, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"variant {name!r}: {part!r} is not field=value")
        changes[field.strip()] = ast.literal_eval(value.strip())
    return name, changes


def split_changes(changes):
    """(the Rules fields, {(module, attribute): value}) of a variant's changes; a dotted
    name's module must be importable and have the attribute (a ValueError otherwise)."""
    import importlib
    rules, patches = {}, {}
    for key, value in changes.items():
        if "." not in key:
            rules[key] = value
            continue
        module_name, _, attr = key.rpartition(".")
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise ValueError(f"{module_name} has no attribute {attr!r}")
        patches[(module, attr)] = value
    return rules, patches


@contextlib.contextmanager
def applied(changes):
    """The variant's rules in force (``cpu_plan.using``) and its module attributes set, for
    the block; the attributes restored after."""
    from numbafuse.kernels.conv import cpu_plan
    rules, patches = split_changes(changes)
    old = {key: getattr(*key) for key in patches}
    try:
        for (module, attr), value in patches.items():
            setattr(module, attr, value)
        with cpu_plan.using(**rules):
            yield
    finally:
        for (module, attr), value in old.items():
            setattr(module, attr, value)


def parse_sites(text):
    """``R=1,H=8`` -> {"R": 1, "H": 8}: the geometries whose fused calls are timed."""
    if not text:
        return None
    out = {}
    for part in text.split(","):
        field, _, value = part.partition("=")
        out[field.strip()] = int(value)
    return out


def _wrap_sites(match, spent):
    """Time ``ops.conv_batchnorm``'s core calls whose geometry matches; returns the undo."""
    from numbafuse.ops import conv_batchnorm as cbn

    def geometry_of(name, args, kwargs):
        if name in ("forward", "add_forward"):
            checked = kwargs.get("checked")
            return checked[1] if checked else None
        if name in ("backward", "add_backward"):
            return args[1].geometry                 # the Call
        return args[8] if len(args) > 8 else kwargs.get("geometry")    # inference

    saved = []
    for name in ("forward", "add_forward", "backward", "add_backward", "inference"):
        original = getattr(cbn, name)

        def timed(*args, _f=original, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                g = geometry_of(_name, args, kwargs)
                if g is not None and all(getattr(g, k) == v for k, v in match.items()):
                    spent["sites"] += time.perf_counter() - t0
        saved.append((name, original))
        setattr(cbn, name, timed)

    def undo():
        for name, original in saved:
            setattr(cbn, name, original)
    return undo


def main(argv=None):
    from numbafuse.kernels.cpu import recorded
    with recorded.off():                 # (module docstring: every variant's own plans)
        return _main(argv)


def _main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=[], required=True,
                   help="'NAME: field=value, ...' (cpu_plan.Rules fields, or dotted module "
                        "attributes); repeatable")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--eval", action="store_true", help="eval forwards, not training steps")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block", type=int, default=4, help="steps a variant runs in a row")
    p.add_argument("--drop", type=int, default=2, help="of each block, the first steps dropped")
    p.add_argument("--sites", default=None, help="e.g. 'R=1,H=8': those fused calls timed too")
    args = p.parse_args(argv)
    if not 0 <= args.drop < args.block:
        p.error("--drop must be >= 0 and below --block")
    variants = dict([("default", {})] + [parse_variant(v) for v in args.variant])

    import torch
    from bench_resnet import model_function
    import numbafuse.torch as nft

    for name, changes in variants.items():          # unknown fields: refused before any step
        with applied(changes):
            pass
    torch.manual_seed(0)
    model = nft.fuse(model_function(args.model)(num_classes=1000), recompute="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.randint(0, 1000, (args.batch,))
    if args.eval:
        model.eval()

    def step():
        if args.eval:
            with torch.no_grad():
                model(x)
            return
        for param in model.parameters():
            param.grad = None
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        opt.step()

    spent = collections.defaultdict(float)
    match = parse_sites(args.sites)
    undo = _wrap_sites(match, spent) if match else (lambda: None)
    steps = {name: [] for name in variants}
    sites = {name: [] for name in variants}
    try:
        for r in range(args.rounds + 1):              # round 0: compilation and warm-up
            for name, changes in variants.items():
                with applied(changes):
                    for i in range(args.block):
                        spent.clear()
                        t0 = time.perf_counter()
                        step()
                        dt = time.perf_counter() - t0
                        if r and i >= args.drop:
                            steps[name].append(dt * 1e3)
                            sites[name].append(spent["sites"] * 1e3)
    finally:
        undo()
    what = "eval forward" if args.eval else "training step"
    kept = len(steps["default"])
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, {what}, one process, "
          f"{args.rounds} rounds of blocks of {args.block} ({args.drop} dropped): {kept} steps "
          f"kept a variant, {torch.get_num_threads()} torch threads\n")
    head = "| variant | changes | best ms | median ms |"
    line = "|---|---|---:|---:|"
    if match:
        head += f" sites {args.sites}: best ms | median ms |"
        line += "---:|---:|"
    print(head + "\n" + line)
    for name, changes in variants.items():
        ts = steps[name]
        row = (f"| {name} | {changes or '(the rules in force)'} | {min(ts):.2f} | "
               f"{statistics.median(ts):.2f} |")
        if match:
            ss = sites[name]
            row += f" {min(ss):.3f} | {statistics.median(ss):.3f} |"
        print(row)


if __name__ == "__main__":
    main()
