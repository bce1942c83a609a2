"""Each pass of a depthwise Conv-Bias-ReLU alone (forward, dX, dW + db), numbafuse and PyTorch,
each library in its own process, alternating round by round; best of each.

    python benchmarks/depthwise_passes.py [--rounds 3] [--repeats 3] [--threads 1]
                                          [--layouts NHWC NCHW] [--shapes 'dw 3x3' ...]

bench_conv_bias_relu.py times forward and forward + backward; this splits the backward into
its two passes, which run different kernels (numbafuse: ``conv_bias_relu_backward`` with
``need``; PyTorch: ``torch.nn.grad.conv2d_input`` and ``conv2d_weight`` on the gated gradient,
channels_last tensors for NHWC), so that a change to one kernel is seen alone. The shapes are
bench_conv_bias_relu's depthwise ones. docs/conv_bias_relu.md quotes its figures.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (N, C, H, W), R, stride
SHAPES = {"dw 3x3": ((32, 64, 56, 56), 3, 1), "dw 3x3 s2": ((32, 64, 56, 56), 3, 2),
          "dw 7x7": ((32, 96, 28, 28), 7, 1), "dw 7x7 s2": ((32, 96, 28, 28), 7, 2)}
PASSES = ("fwd", "dx", "dw")


def _best(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _cases(shapes, layouts):
    import numpy as np
    rng = np.random.default_rng(0)
    for name in shapes:
        (N, C, H, W), R, stride = SHAPES[name]
        x = rng.standard_normal((N, C, H, W)).astype(np.float32)
        w = rng.standard_normal((C, 1, R, R)).astype(np.float32) * 0.2
        b = rng.standard_normal(C).astype(np.float32) * 0.1
        for layout in layouts:
            yield name, layout, x, w, b, stride, R // 2


def worker_numbafuse(args):
    import numpy as np
    sys.path.insert(0, ROOT)
    import numbafuse as nf
    from numbafuse.kernels.cpu import launch
    launch.set_num_threads(args.threads)
    out = {}
    for name, layout, x, w, b, stride, pad in _cases(args.shapes, args.layouts):
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if layout == "NHWC" else x
        kw = dict(stride=stride, padding=pad, layout=layout, groups=x.shape[-1 if layout ==
                                                                               "NHWC" else 1])
        y = nf.conv_bias_relu(x, w, b, **kw)
        gy = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
        fns = {"fwd": lambda: nf.conv_bias_relu(x, w, b, **kw),
               "dx": lambda: nf.conv_bias_relu_backward(gy, x, w, y, need=(True, False, False),
                                                        **kw),
               "dw": lambda: nf.conv_bias_relu_backward(gy, x, w, y, need=(False, True, True),
                                                        **kw)}
        for p in PASSES:
            out[f"{name}|{layout}|{p}"] = _best(fns[p], args.repeats)
    return out


def worker_torch(args):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    out = {}
    for name, layout, x, w, b, stride, pad in _cases(args.shapes, args.layouts):
        fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        xt = torch.from_numpy(x).contiguous(memory_format=fmt)
        wt = torch.from_numpy(w).contiguous(memory_format=fmt)
        bt = torch.from_numpy(b)
        C = x.shape[1]
        with torch.no_grad():
            y = F.relu(F.conv2d(xt, wt, bt, stride, pad, groups=C))
            gy = torch.randn(y.shape).contiguous(memory_format=fmt)
        g = (gy * (y > 0)).contiguous(memory_format=fmt)

        def fwd():
            with torch.no_grad():
                F.relu(F.conv2d(xt, wt, bt, stride, pad, groups=C))

        def dx():
            # the gating is part of the pass, as numbafuse's dX gates gy by y > 0
            gg = (gy * (y > 0)).contiguous(memory_format=fmt)
            torch.nn.grad.conv2d_input(xt.shape, wt, gg, stride, pad, groups=C)

        def dw():
            gg = (gy * (y > 0)).contiguous(memory_format=fmt)
            torch.nn.grad.conv2d_weight(xt, wt.shape, gg, stride, pad, groups=C)
            gg.sum((0, 2, 3))

        del g
        fns = {"fwd": fwd, "dx": dx, "dw": dw}
        for p in PASSES:
            out[f"{name}|{layout}|{p}"] = _best(fns[p], args.repeats)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layouts", nargs="+", default=["NHWC", "NCHW"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--libraries", nargs="+", default=["numbafuse", "torch"])
    p.add_argument("--worker", choices=["numbafuse", "torch"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        fn = worker_numbafuse if args.worker == "numbafuse" else worker_torch
        print(json.dumps(fn(args)))
        return
    best = {lib: {} for lib in args.libraries}
    common = ["--repeats", str(args.repeats), "--threads", str(args.threads), "--layouts",
              *args.layouts, "--shapes", *args.shapes]
    for _ in range(args.rounds):
        for lib in args.libraries:
            res = subprocess.run([sys.executable, __file__, "--worker", lib, *common],
                                 check=True, capture_output=True, text=True)
            for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items():
                best[lib][k] = min(v, best[lib].get(k, float("inf")))
    import platform
    print(f"depthwise passes, {args.threads} thread(s), best of {args.rounds} rounds x "
          f"{args.repeats}, each library in its own process; {platform.processor() or ''}")
    libs = args.libraries
    print("| shape | layout | pass | " + " | ".join(f"{lib} ms" for lib in libs)
          + (" | PyTorch / numbafuse |" if len(libs) == 2 else " |"))
    print("|---|---|---|" + "---:|" * (len(libs) + (len(libs) == 2)))
    for key in best[libs[0]]:
        name, layout, pass_ = key.split("|")
        row = [best[lib][key] for lib in libs]
        ratio = f" | {row[1] / row[0]:.2f}x" if len(libs) == 2 else ""
        print(f"| {name} | {layout} | {pass_} | " + " | ".join(f"{v:.2f}" for v in row)
              + ratio + " |")


if __name__ == "__main__":
    main()
