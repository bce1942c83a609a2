"""The max pool on the CPU, forward and forward + backward: ``numbafuse.torch.pool.max_pool2d``
(what ``numbafuse.torch.fuse`` runs for ``nn.MaxPool2d``) vs PyTorch's ``F.max_pool2d``.

    python benchmarks/bench_pool.py [--rounds 3] [--repeats 5] [--shapes ...] [--layouts ...]
                                    [--threads N] [--markdown FILE]

float32 torch tensors, ResNet's stem pool (3x3, stride 2, padding 1) at a 64x64 and a 224x224
input's stem output, contiguous (NCHW) and channels_last. Through ``_runner.py``: each library
in its own processes (the PyTorch side never imports numbafuse), alternating, best of each.
Forward + backward starts from a fresh leaf each call (cleared gradients) and back-propagates a
fixed gradient.
"""
import argparse
import sys

import _report
import _runner

SHAPES = {  # name: x shape (NCHW)
    "stem 64": (16, 64, 32, 32),
    "stem 224": (16, 64, 112, 112),
}
LAYOUTS = ("NCHW", "NHWC")
KERNEL, STRIDE, PADDING = 3, 2, 1


def cases(side, options):
    import torch
    import torch.nn.functional as F
    if side == "torch":
        pool = F.max_pool2d
    else:
        from numbafuse.torch.pool import max_pool2d as pool
    out = {}
    for name in options["shapes"]:
        for layout in options["layouts"]:
            fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(SHAPES[name], generator=gen).contiguous(memory_format=fmt)
            gy = torch.randn(pool(x, KERNEL, STRIDE, PADDING).shape,
                             generator=gen).contiguous(memory_format=fmt)

            def fwd(x=x):
                with torch.no_grad():
                    return pool(x, KERNEL, STRIDE, PADDING)

            def both(x=x, gy=gy):
                leaf = x.detach().requires_grad_(True)
                pool(leaf, KERNEL, STRIDE, PADDING).backward(gy)

            out[f"{name} {layout} fwd"], out[f"{name} {layout} fwd+bwd"] = fwd, both
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case and process")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    p.add_argument("--threads", type=int, help="threads of both libraries (default: theirs)")
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    opts = dict(shapes=args.shapes, layouts=args.layouts, threads=args.threads)
    best, info = _runner.compare("bench_pool", ["numbafuse", "torch"], args.rounds,
                                 args.repeats, opts,
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
    lines = _runner.header(info, _report.command("bench_pool.py"))
    lines += [f"- {n}: x {SHAPES[n]} (NCHW shape), {KERNEL}x{KERNEL} windows, stride {STRIDE}, "
              f"padding {PADDING}" for n in args.shapes]
    lines += ["", "| shape | layout | pass | numbafuse ms | PyTorch ms | numbafuse speed-up | "
              "numbafuse CPU ms | PyTorch CPU ms |", "|---|---|---|---:|---:|---:|---:|---:|"]
    cpu = info["cpu"]
    for name in args.shapes:
        for layout in args.layouts:
            for ps in ("fwd", "fwd+bwd"):
                key = f"{name} {layout} {ps}"
                a, t = best["numbafuse"][key], best["torch"][key]
                lines.append(f"| {name} | {layout} | {ps} | {a * 1e3:.2f} | {t * 1e3:.2f} | "
                             f"{t / a:.2f}x | {cpu['numbafuse'][key] * 1e3:.2f} | "
                             f"{cpu['torch'][key] * 1e3:.2f} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
