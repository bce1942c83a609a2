"""Benchmark Conv2D -> BiasAdd -> ReLU, forward + backward, float32 on the CPU.

Compares, in one process and on the same arrays:

    fused        numbafuse.conv_bias_relu + conv_bias_relu_backward (NCHW, and NHWC)
    unfused      numbafuse conv2d -> bias_add -> relu on the tape (forward, then .backward)
    reference    numbafuse.reference (plain NumPy, float64 inside)
    torch        PyTorch CPU conv2d + bias + relu with autograd (if importable)

Every implementation is warmed up (Numba compiles) before timing; the best of several runs is
kept. GFLOP/s counts the forward conv's 2*N*K*P*Q*C*R*S flops times 3 (forward, dx, dw).

    python benchmarks/bench_conv_bias_relu.py [--quick] [--markdown FILE]
"""
import argparse
import sys
import time

import numpy as np

import numbafuse as nf
from numbafuse import _arrays
from numbafuse import reference as ref

SHAPES = [  # name, x shape (NCHW), w shape, conv kwargs
    ("resnet 3x3", (32, 64, 32, 32), (64, 64, 3, 3), dict(stride=1, padding=1)),
    ("small", (8, 16, 16, 16), (32, 16, 3, 3), dict(stride=1, padding=1)),
    ("stride 2", (32, 64, 32, 32), (128, 64, 3, 3), dict(stride=2, padding=1)),
]
REPEATS = {"full": 5, "quick": 2}
DTYPE = np.float32
FWD_BWD_PASSES = 3        # forward, dx and dw each cost one conv's flops


def best_time(fn, repeats):
    fn()  # warm-up: compilation, allocator, BLAS threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def to_nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))      # (N, C, H, W) -> (N, H, W, C)


def implementations(x, w, b, gy, kw):
    """name -> (forward only, forward + backward) callables."""
    impls = {}

    def fused_fwd(layout="NCHW", xx=x):
        return nf.conv_bias_relu(xx, w, b, layout=layout, **kw)

    def fused_both(layout="NCHW", xx=x, g=gy):
        y = fused_fwd(layout, xx)
        return nf.conv_bias_relu_backward(g, xx, w, y, layout=layout, **kw)

    impls["numbafuse fused"] = (fused_fwd, fused_both)
    x_nhwc, gy_nhwc = to_nhwc(x), to_nhwc(gy)
    impls["numbafuse fused NHWC"] = (lambda: fused_fwd("NHWC", x_nhwc),
                                     lambda: fused_both("NHWC", x_nhwc, gy_nhwc))

    def unfused(backward):
        tx, tw, tb = (nf.Tensor(a, requires_grad=True) for a in (x, w, b))
        y = nf.relu(nf.bias_add(nf.conv2d(tx, tw, **kw), tb))
        if backward:
            y.backward(gy)

    impls["numbafuse unfused"] = (lambda: unfused(False), lambda: unfused(True))

    def reference(backward):
        ref.conv_bias_relu(x, w, b, **kw)
        if backward:
            ref.conv_bias_relu_backward(gy, x, w, b, **kw)

    impls["NumPy reference"] = (lambda: reference(False), lambda: reference(True))
    try:
        import torch
    except ImportError:
        return impls
    tx0, tw0, tb0, tgy = (torch.from_numpy(a) for a in (x, w, b, gy))

    def torch_run(backward):
        tx, tw, tb = (t.clone().requires_grad_(backward) for t in (tx0, tw0, tb0))
        y = torch.relu(torch.nn.functional.conv2d(tx, tw, tb, stride=kw["stride"],
                                                  padding=kw["padding"]))
        if backward:
            y.backward(tgy)

    impls[f"PyTorch {torch.__version__} CPU"] = (lambda: torch_run(False),
                                                 lambda: torch_run(True))
    return impls


def run(quick):
    repeats = REPEATS["quick" if quick else "full"]
    rng = np.random.default_rng(0)
    rows = []
    for name, x_shape, w_shape, kw in SHAPES:
        x = rng.standard_normal(x_shape).astype(DTYPE)
        w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(DTYPE)
        b = rng.standard_normal(w_shape[0]).astype(DTYPE)
        geom = _arrays.conv_geometry("bench", x_shape, w_shape, **kw)
        gy = rng.standard_normal(geom.y_shape).astype(DTYPE)
        fused_both = None
        for impl, (fwd, both) in implementations(x, w, b, gy, kw).items():
            t_fwd, t_both = best_time(fwd, repeats), best_time(both, repeats)
            fused_both = t_both if fused_both is None else fused_both
            rows.append((name, impl, t_fwd * 1e3, t_both * 1e3,
                         FWD_BWD_PASSES * geom.flops / t_both / 1e9, t_both / fused_both))
            print(f"{name:12s} {impl:28s} fwd {t_fwd * 1e3:9.1f} ms   fwd+bwd "
                  f"{t_both * 1e3:9.1f} ms", flush=True)
    return rows


def markdown(rows, command):
    lines = [f"Command: `{command}`", "",
             "float32, NCHW unless marked; best of several runs after a warm-up. "
             "GFLOP/s = 3 x forward conv flops / (fwd+bwd time). "
             "Ratio = fwd+bwd time / fused fwd+bwd time (lower is faster).", "",
             "| shape | implementation | fwd ms | fwd+bwd ms | GFLOP/s | ratio vs fused |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, impl, fwd, both, gflops, ratio in rows:
        lines.append(f"| {name} | {impl} | {fwd:.1f} | {both:.1f} | {gflops:.1f} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed repeats")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    table = markdown(rows, "python " + " ".join(sys.argv))
    print()
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# Conv2D -> BiasAdd -> ReLU benchmark\n\n" + table)


if __name__ == "__main__":
    main()
