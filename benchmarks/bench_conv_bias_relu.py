"""Conv2D -> BiasAdd -> ReLU on the CPU, forward and forward + backward: numbafuse vs PyTorch.

    python benchmarks/bench_conv_bias_relu.py [--rounds 5] [--repeats 5] [--quick]
                                              [--mode separate|import-order|neighbours]
                                              [--threads N] [--markdown FILE]

float32, at the shapes of ``SHAPES``, in both layouts (PyTorch's NHWC is a channels_last
tensor). Every mode runs through ``_runner.py`` (each side in its own processes, alternating,
best of each):

* ``separate`` (default): numbafuse fused, numbafuse unfused (conv2d -> bias_add -> relu on
  the tape) and PyTorch eager (conv2d + bias + relu with autograd), each library alone;
* ``import-order``: numbafuse alone vs numbafuse in a process where torch was imported and
  ran a conv first (the ratio should be ~1);
* ``neighbours``: numbafuse and PyTorch alone vs the two interleaved call by call in one process.

``--threads N`` sets both libraries to N threads (each through its own API); without it each
runs with its defaults. Forward + backward starts from cleared gradients on both sides (fresh
leaves each call). The CPU ms columns are the best process CPU time of a call (all threads).
GFLOP/s counts the forward conv's 2*N*K*P*Q*C*R*S flops, times 3 for forward + backward.
"""
import argparse
import sys

import numpy as np

import _report
import _runner

SHAPES = {  # name: (x shape NCHW, w shape, stride, padding[, groups])
    "resnet 3x3": ((32, 64, 32, 32), (64, 64, 3, 3), 1, 1),
    "stride 2": ((32, 64, 32, 32), (128, 64, 3, 3), 2, 1),
    "1x1": ((32, 64, 32, 32), (128, 64, 1, 1), 1, 0),
    "small": ((8, 16, 16, 16), (32, 16, 3, 3), 1, 1),
    # depthwise (groups = C): MobileNet's 3x3 and ConvNeXt's 7x7, stride 1 and 2
    "dw 3x3": ((32, 64, 56, 56), (64, 1, 3, 3), 1, 1, 64),
    "dw 3x3 s2": ((32, 64, 56, 56), (64, 1, 3, 3), 2, 1, 64),
    "dw 7x7": ((32, 96, 28, 28), (96, 1, 7, 7), 1, 3, 96),
    "dw 7x7 s2": ((32, 96, 28, 28), (96, 1, 7, 7), 2, 3, 96),
    # EfficientNet-B0's 5x5 depthwise layers: 240 channels at 28x28, 144 at 56x56 stride 2
    "dw 5x5": ((32, 240, 28, 28), (240, 1, 5, 5), 1, 2, 240),
    "dw 5x5 s2": ((16, 144, 56, 56), (144, 1, 5, 5), 2, 2, 144),
    # grouped (ResNeXt-50 32x4d's 3x3s at a 224x224 input): 32 groups of 4, 8 (stride 2), 16
    "g32 3x3": ((32, 128, 56, 56), (128, 4, 3, 3), 1, 1, 32),
    "g32 3x3 s2": ((32, 256, 56, 56), (256, 8, 3, 3), 2, 1, 32),
    "g32 3x3 deep": ((32, 512, 14, 14), (512, 16, 3, 3), 1, 1, 32),
}
LAYOUTS = ("NCHW", "NHWC")
DTYPE = np.float32
FWD_BWD_PASSES = 3        # forward, dx and dw each cost one conv's flops


def problem(name):
    """x, w, b, gy (NCHW) of a shape, the same arrays in every process (seeded)."""
    x_shape, w_shape, stride, pad = SHAPES[name][:4]
    groups = SHAPES[name][4] if len(SHAPES[name]) > 4 else 1
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(DTYPE)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(DTYPE)
    b = rng.standard_normal(w_shape[0]).astype(DTYPE)
    N, _, H, W = x_shape
    K, _, R, S = w_shape
    P, Q = (H + 2 * pad - R) // stride + 1, (W + 2 * pad - S) // stride + 1
    gy = rng.standard_normal((N, K, P, Q)).astype(DTYPE)
    flops = 2 * N * K * P * Q * w_shape[1] * R * S
    return x, w, b, gy, dict(stride=stride, padding=pad, groups=groups), flops


def nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))     # (N, C, H, W) -> (N, H, W, C)


def aligned(a, align=64):
    """A copy of ``a`` starting on an ``align``-byte boundary (a cache line), as PyTorch's
    allocator and numbafuse's output buffers place arrays; NumPy's large arrays start 16
    bytes into a page."""
    buf = np.empty(a.nbytes + align, np.uint8)
    start = -buf.ctypes.data % align
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _numbafuse_cases(name, layout, unfused, align=False):
    import numbafuse as nf
    x, w, b, gy, kw, _ = problem(name)
    if layout == "NHWC":
        x, gy = nhwc(x), nhwc(gy)
    if align:
        x, w, b, gy = (aligned(a) for a in (x, w, b, gy))
    kw = dict(kw, layout=layout)

    def fwd():
        return nf.conv_bias_relu(x, w, b, **kw)

    def both():
        nf.conv_bias_relu_backward(gy, x, w, fwd(), **kw)

    cases = {f"{name} {layout} fwd": fwd, f"{name} {layout} fwd+bwd": both}
    if unfused:
        def chain(backward):
            tx, tw, tb = (nf.Tensor(a, requires_grad=backward) for a in (x, w, b))
            y = nf.relu(nf.bias_add(nf.conv2d(tx, tw, **kw), tb, layout=layout))
            if backward:
                y.backward(gy)
        cases[f"{name} {layout} unfused fwd+bwd"] = lambda: chain(True)
    return cases


def _torch_cases(name, layout):
    import torch
    x, w, b, gy, kw, _ = problem(name)
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    tx = torch.from_numpy(x).contiguous(memory_format=fmt)
    tgy = torch.from_numpy(gy).contiguous(memory_format=fmt)
    tw = torch.from_numpy(w).contiguous(memory_format=fmt)
    tb = torch.from_numpy(b)
    leaves = [t.clone().requires_grad_(True) for t in (tx, tw, tb)]

    def fwd():
        with torch.no_grad():
            return torch.relu(torch.nn.functional.conv2d(tx, tw, tb, **kw))

    def both():
        for leaf in leaves:
            leaf.grad = None                       # cleared gradients, as a training step
        y = torch.relu(torch.nn.functional.conv2d(*leaves, **kw))
        y.backward(tgy)

    return {f"{name} {layout} fwd": fwd, f"{name} {layout} fwd+bwd": both}


def cases(side, options):
    out = {}
    for name in options["shapes"]:
        for layout in options["layouts"]:
            if side == "torch":
                out.update(_torch_cases(name, layout))
            else:
                out.update(_numbafuse_cases(name, layout, options.get("unfused", False),
                                            options.get("aligned", False)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case and process")
    p.add_argument("--quick", action="store_true", help="2 rounds of 2, ResNet shape only")
    p.add_argument("--mode", default="separate", choices=("separate", "import-order",
                                                          "neighbours"))
    p.add_argument("--shapes", nargs="*", default=list(SHAPES))
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    p.add_argument("--threads", type=int, help="threads of both libraries (default: theirs)")
    p.add_argument("--aligned", action="store_true",
                   help="numbafuse's input arrays on 64-byte boundaries (as its own outputs "
                        "and PyTorch's tensors are), not where NumPy puts them")
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats, args.shapes = 2, 2, ["resnet 3x3"]
    opts = dict(shapes=args.shapes, layouts=args.layouts, unfused=args.mode == "separate",
                threads=args.threads, aligned=args.aligned)
    sides = {"separate": ["numbafuse", "torch"],
             "import-order": ["numbafuse", "numbafuse-after-torch"],
             "neighbours": ["numbafuse", "torch", "neighbours"]}[args.mode]
    best, info = _runner.compare("bench_conv_bias_relu", sides, args.rounds, args.repeats, opts,
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
    lines = _runner.header(info, _report.command("bench_conv_bias_relu.py"))
    lines += [f"- {n}: x {SHAPES[n][0]} (NCHW shape), w {SHAPES[n][1]}, stride {SHAPES[n][2]}, "
              f"padding {SHAPES[n][3]}" + (f", groups {SHAPES[n][4]}" if len(SHAPES[n]) > 4
                                           else "") for n in args.shapes]
    lines += ["- numbafuse's inputs: " + ("copied onto 64-byte boundaries (--aligned)"
                                          if args.aligned else "NumPy's arrays as allocated")
              + "; PyTorch's: tensors from them (NCHW: the same memory; channels_last and "
                "the backward's leaves: copies, on 64-byte boundaries)", ""]
    if args.mode == "separate":
        cpu = info["cpu"]
        lines += ["| shape | layout | pass | numbafuse ms | PyTorch ms | numbafuse speed-up | "
                  "numbafuse GFLOP/s | numbafuse CPU ms | PyTorch CPU ms | numbafuse unfused ms |",
                  "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name in args.shapes:
            flops = problem(name)[-1]
            for layout in args.layouts:
                for ps, mult in (("fwd", 1), ("fwd+bwd", FWD_BWD_PASSES)):
                    key = f"{name} {layout} {ps}"
                    a, t = best["numbafuse"][key], best["torch"][key]
                    unf = best["numbafuse"].get(f"{name} {layout} unfused {ps}")
                    lines.append(f"| {name} | {layout} | {ps} | {a * 1e3:.2f} | {t * 1e3:.2f} | "
                                 f"{t / a:.2f}x | {mult * flops / a / 1e9:.0f} | "
                                 f"{cpu['numbafuse'][key] * 1e3:.2f} | {cpu['torch'][key] * 1e3:.2f} | "
                                 + (f"{unf * 1e3:.2f} |" if unf else "- |"))
    else:
        other = "numbafuse-after-torch" if args.mode == "import-order" else "neighbours"
        lines += ["| case | alone ms | " + ("after torch ms" if args.mode == "import-order"
                                           else "interleaved in one process ms")
                  + " | alone / there |", "|---|---:|---:|---:|"]
        for side in (["numbafuse"] if args.mode == "import-order" else ["numbafuse", "torch"]):
            for key, a in best[side].items():
                there = best[other][key if args.mode == "import-order" else f"{side}:{key}"]
                lines.append(f"| {side} {key} | {a * 1e3:.2f} | {there * 1e3:.2f} | "
                             f"{a / there:.2f} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
