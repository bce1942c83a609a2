"""The CPU conv plan on real layer shapes: every algorithm that can run each pass of each
ResNet conv, the one ``kernels/conv/cpu_plan.plan`` picks, and PyTorch's time for the pass.

    python benchmarks/bench_conv_plan.py [--model resnet18|resnet50] [--batch 16] [--size 64]
                                         [--layout NCHW] [--rounds 2] [--repeats 3]
                                         [--threads N] [--markdown FILE]
                                         [--only NAME ...]

Layers: the distinct conv shapes of torchvision's ResNet-18 (or -50) on a batch of
``size``x``size`` RGB images (the stem 7x7/2, each stage's 3x3 convs, its stride-2 3x3 and
1x1 downsample; ResNet-50 adds the bottlenecks' 1x1s), float32, bias-free, no ReLU (in a
ResNet a BatchNorm follows each conv). Passes: forward; dX alone; dW alone
(``conv_backward(need=...)``), each algorithm forced through ``plan(..., algorithm=)``.
PyTorch: ``F.conv2d`` and ``torch.nn.grad.conv2d_input`` / ``conv2d_weight`` (aten's
convolution_backward with one output) in its own process, the processes alternating (_runner).

The table gives, per layer and pass, each algorithm's time, the planned one (``*``), the
fastest, how much slower the plan is than the fastest (1.00: the plan picked it), and
PyTorch's time over the plan's (> 1: numbafuse faster).
"""
import argparse
import sys

import _report
import _runner

# cpu_plan.ALGORITHMS, written out (the PyTorch processes do not import numbafuse; the
# numbafuse ones check that the two agree)
ALGORITHMS = ("pointwise", "im2col", "implicit", "winograd", "winograd_s2", "phase", "tapwise")
PASSES = ("forward", "dx", "dw")


def layers(model, size, only=None):
    """[(name, C, K, kernel, stride, H)]: the distinct conv shapes, H the input's size;
    ``only``: those whose name contains one of these strings."""
    out = _layers(model, size)
    return [layer for layer in out if not only or any(s in layer[0] for s in only)]


def _layers(model, size):
    out = [("stem 7x7/2", 3, 64, 7, 2, size)]
    h = (size + 1) // 2 // 2                     # after the stem and the max pool
    widths = (64, 128, 256, 512)
    if model == "resnet18":
        c = 64
        for i, k in enumerate(widths):
            if i:
                out += [(f"l{i + 1} 3x3/2 {c}->{k}", c, k, 3, 2, h),
                        (f"l{i + 1} 1x1/2 {c}->{k}", c, k, 1, 2, h)]
                h = (h + 1) // 2
            out.append((f"l{i + 1} 3x3 {k}", k, k, 3, 1, h))
            c = k
        return out
    c = 64
    for i, k in enumerate(widths):                      # bottleneck: 1x1 k, 3x3 k, 1x1 4k
        stride = 1 if i == 0 else 2
        out += [(f"l{i + 1} 1x1 {c}->{k}", c, k, 1, 1, h),
                (f"l{i + 1} 3x3{'/2' if stride == 2 else ''} {k}", k, k, 3, stride, h),
                (f"l{i + 1} 1x1/{stride} {c}->{4 * k} (downsample)", c, 4 * k, 1, stride, h)]
        h = (h + stride - 1) // stride
        out += [(f"l{i + 1} 1x1 {k}->{4 * k}", k, 4 * k, 1, 1, h),
                (f"l{i + 1} 1x1 {4 * k}->{k}", 4 * k, k, 1, 1, h)]
        if i:
            out.append((f"l{i + 1} 3x3 {k}", k, k, 3, 1, h))
        c = 4 * k
    return out


def _pass(cpu_conv, x, w, gy, geom, pass_, plan):
    """A call of ``pass_`` of the conv ``geom`` as ``plan`` says (dX and dW alone)."""
    if pass_ == "forward":
        return lambda: cpu_conv.conv_forward(x, w, None, geom, False, plan=plan)
    need = (True, False, False) if pass_ == "dx" else (False, True, False)
    return lambda: cpu_conv.conv_backward(gy, x, w, geom, None, need, plans=(plan, plan))


def _numbafuse_cases(options):
    import numpy as np

    import numbafuse as nf
    from numbafuse.kernels.conv import cpu as cpu_conv, cpu_plan
    if tuple(cpu_plan.ALGORITHMS) != ALGORITHMS:
        raise SystemExit(f"bench_conv_plan.ALGORITHMS {ALGORITHMS} is not the plan's "
                         f"{tuple(cpu_plan.ALGORITHMS)}")
    out = {}
    rng = np.random.default_rng(0)
    B, layout = int(options["batch"]), options["layout"]
    for name, C, K, k, stride, H in layers(options["model"], int(options["size"]),
                                           options.get("only")):
        shape = (B, C, H, H) if layout == "NCHW" else (B, H, H, C)
        x = rng.standard_normal(shape).astype(np.float32)
        w = (rng.standard_normal((K, C, k, k)) / (C * k)).astype(np.float32)
        geom = nf.validate.conv_geometry("bench", shape, w.shape, stride, k // 2, 1, layout)
        gy = rng.standard_normal(geom.y_shape).astype(np.float32)
        for pass_ in PASSES:
            planned = cpu_plan.plan(geom, pass_, np.float32).algorithm
            for alg in ALGORITHMS:
                if not cpu_plan.supports(alg, geom, pass_, np.float32):
                    continue
                plan = cpu_plan.plan(geom, pass_, np.float32, algorithm=alg)
                mark = "*" if alg == planned else ""
                out[f"{name}|{pass_}|{alg}{mark}"] = _pass(cpu_conv, x, w, gy, geom, pass_,
                                                           plan)
    return out


def _torch_cases(options):
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    out = {}
    B = int(options["batch"])
    memory = (torch.channels_last if options["layout"] == "NHWC" else torch.contiguous_format)
    for name, C, K, k, stride, H in layers(options["model"], int(options["size"]),
                                           options.get("only")):
        x = torch.randn(B, C, H, H).contiguous(memory_format=memory)
        w = (torch.randn(K, C, k, k) / (C * k)).contiguous(memory_format=memory)
        y = F.conv2d(x, w, None, stride, k // 2)
        gy = torch.randn_like(y)
        out[f"{name}|forward|torch"] = (lambda x=x, w=w, s=stride, p=k // 2:   # no grad: x, w
                                        F.conv2d(x, w, None, s, p))          # need none
        out[f"{name}|dx|torch"] = (lambda x=x, w=w, gy=gy, s=stride, p=k // 2:
                                   torch.nn.grad.conv2d_input(x.shape, w, gy, s, p))
        out[f"{name}|dw|torch"] = (lambda x=x, w=w, gy=gy, s=stride, p=k // 2:
                                   torch.nn.grad.conv2d_weight(x, w.shape, gy, s, p))
    return out


def cases(side, options):
    return _numbafuse_cases(options) if side == "numbafuse" else _torch_cases(options)


def table(best, options):
    """Markdown rows: layer, pass, each algorithm's ms, plan, fastest, plan/fastest, PyTorch."""
    rows = ["| layer | pass | " + " | ".join(ALGORITHMS) + " | plan | fastest | plan / "
            "fastest | PyTorch ms | PyTorch / plan |",
            "|---|---|" + "---:|" * len(ALGORITHMS) + "---|---|---:|---:|---:|"]
    worst, losses = 1.0, []
    for name, *_ in layers(options["model"], int(options["size"]), options.get("only")):
        for pass_ in PASSES:
            times, planned = {}, None
            for key, t in best["numbafuse"].items():
                layer, p, alg = key.split("|")
                if layer == name and p == pass_:
                    planned = alg.rstrip("*") if alg.endswith("*") else planned
                    times[alg.rstrip("*")] = t
            fastest = min(times, key=times.get)
            ratio = times[planned] / times[fastest]
            worst = max(worst, ratio)
            if ratio > 1.1:
                losses.append(f"{name} {pass_}")
            torch_t = best["torch"][f"{name}|{pass_}|torch"]
            cells = [f"{times[a] * 1e3:.2f}" if a in times else "-" for a in ALGORITHMS]
            rows.append(f"| {name} | {pass_} | " + " | ".join(cells) + f" | {planned} | "
                        f"{fastest} | {ratio:.2f} | {torch_t * 1e3:.2f} | "
                        f"{torch_t / times[planned]:.2f}x |")
    note = ("The plan is within 10% of the fastest algorithm in every row" if not losses else
            f"The plan is more than 10% slower than the fastest algorithm in: "
            f"{', '.join(losses)} (worst {worst:.2f}x)")
    return rows, note + "."


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", choices=("resnet18", "resnet50"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--layout", default="NCHW", choices=("NCHW", "NHWC"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--markdown", default=None, help="write the table to this file")
    p.add_argument("--only", nargs="+", default=None,
                   help="only the layers whose name contains one of these (e.g. 'l3 1x1')")
    args = p.parse_args(argv)
    options = dict(model=args.model, batch=args.batch, size=args.size, layout=args.layout)
    if args.only:
        options["only"] = args.only
    if args.threads:
        options["threads"] = args.threads
    best, info = _runner.compare("bench_conv_plan", ["numbafuse", "torch"], args.rounds,
                                 args.repeats, options, log=lambda s: print(s, file=sys.stderr))
    lines = _runner.header(info, _report.command("bench_conv_plan.py"))
    rows, note = table(best, options)
    lines += [f"{args.model} conv layers, batch {args.batch}, 3x{args.size}x{args.size} input, "
              f"{args.layout}, float32; ms per pass (best of {args.rounds} rounds x "
              f"{args.repeats}); `-`: the algorithm cannot run the pass. {note}", "", *rows]
    _report.emit(lines, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
