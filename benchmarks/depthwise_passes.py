"""Each pass of numbafuse's depthwise Conv-Bias-ReLU alone (forward, dX, dW + db), in a new
process per round; best of each.

    python benchmarks/depthwise_passes.py [--rounds 3] [--repeats 3] [--threads 1]
                                          [--layouts NHWC NCHW] [--shapes 'dw 3x3' ...]

bench_conv_bias_relu.py times forward and forward + backward against PyTorch; this splits the
backward into its two passes (``conv_bias_relu_backward`` with ``need``), which run different
kernels, so that a change to one kernel is seen alone: run it in two trees, alternating, to
pair a change with its base. The shapes are bench_conv_bias_relu's depthwise ones.
docs/conv_bias_relu.md quotes its figures. (PyTorch's passes are not timed here: oneDNN's
channels_last depthwise forward measured 9 or 33 ms from one call to the next in one process
on machine A, as its 25 MB outputs were or were not page-faulted afresh; bench_conv_bias_relu
times it over many calls.)
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


WARMUP_CALLS = 3     # oneDNN's first two calls of a depthwise conv take 3-4x a later one


def _best(fn, repeats):
    for _ in range(WARMUP_CALLS):
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layouts", nargs="+", default=["NHWC", "NCHW"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker_numbafuse(args)))
        return
    best = {}
    common = ["--repeats", str(args.repeats), "--threads", str(args.threads), "--layouts",
              *args.layouts, "--shapes", *args.shapes]
    for _ in range(args.rounds):
        res = subprocess.run([sys.executable, __file__, "--worker", *common], check=True,
                             capture_output=True, text=True)
        for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items():
            best[k] = min(v, best.get(k, float("inf")))
    print(f"numbafuse depthwise passes, {args.threads} thread(s), best of {args.rounds} "
          f"processes x {args.repeats} calls (after {WARMUP_CALLS})")
    print("| shape | layout | pass | ms |")
    print("|---|---|---|---:|")
    for key, ms in best.items():
        name, layout, pass_ = key.split("|")
        print(f"| {name} | {layout} | {pass_} | {ms:.2f} |")


if __name__ == "__main__":
    main()
