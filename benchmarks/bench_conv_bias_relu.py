"""Benchmark Conv2D -> BiasAdd -> ReLU, forward and forward + backward, float32 on the CPU.

Compares, in ONE process, on the same arrays, at three shapes (ResNet 3x3, small, stride 2):

    numbafuse fused        conv_bias_relu + conv_bias_relu_backward (NCHW, and NHWC)
    numbafuse unfused      conv2d -> bias_add -> relu on the tape (forward, then .backward)
    NumPy reference        numbafuse.reference (plain NumPy/SciPy, float64 inside)
    PyTorch CPU            torch conv2d + bias + relu with autograd (if torch is importable)

Every implementation is warmed up first (Numba compiles, allocators and thread pools start).
The timed runs go round-robin over the implementations (so a burst of load from elsewhere
hits all of them alike) and the best run of each is kept. GFLOP/s counts the forward conv's
2*N*K*P*Q*C*R*S flops times 3 (forward, dx, dw) over the fwd+bwd time.

    python benchmarks/bench_conv_bias_relu.py [--quick] [--markdown FILE]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # repo root

import numbafuse as nf  # noqa: E402
from numbafuse import validate  # noqa: E402
from numbafuse import reference as ref  # noqa: E402

SHAPES = [  # name, x shape (NCHW), w shape, conv kwargs
    ("resnet 3x3", (32, 64, 32, 32), (64, 64, 3, 3), dict(stride=1, padding=1)),
    ("small", (8, 16, 16, 16), (32, 16, 3, 3), dict(stride=1, padding=1)),
    ("stride 2", (32, 64, 32, 32), (128, 64, 3, 3), dict(stride=2, padding=1)),
]
REPEATS = {"full": 7, "quick": 2}
SLOW_REPEATS = 2          # the NumPy reference takes seconds: fewer timed runs
DTYPE = np.float32
FWD_BWD_PASSES = 3        # forward, dx and dw each cost one conv's flops
FUSED = "numbafuse fused"


def to_nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))      # (N, C, H, W) -> (N, H, W, C)


def implementations(x, w, b, gy, kw):
    """name -> (forward only, forward + backward) callables; the fused NCHW one first."""
    impls = {}

    def fused_fwd(layout="NCHW", xx=x):
        return nf.conv_bias_relu(xx, w, b, layout=layout, **kw)

    def fused_both(layout="NCHW", xx=x, g=gy):
        y = fused_fwd(layout, xx)
        return nf.conv_bias_relu_backward(g, xx, w, y, layout=layout, **kw)

    impls[FUSED] = (fused_fwd, fused_both)
    x_nhwc, gy_nhwc = to_nhwc(x), to_nhwc(gy)
    impls["numbafuse fused NHWC"] = (lambda: fused_fwd("NHWC", x_nhwc),
                                     lambda: fused_both("NHWC", x_nhwc, gy_nhwc))

    def unfused(backward):
        tx, tw, tb = (nf.Tensor(a, requires_grad=backward) for a in (x, w, b))
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
    tgy = torch.from_numpy(gy)

    def torch_run(backward):
        # from_numpy shares memory (no copy); fresh leaves so grads do not accumulate
        tx, tw, tb = (torch.from_numpy(a).requires_grad_(backward) for a in (x, w, b))
        with torch.set_grad_enabled(backward):
            y = torch.relu(torch.nn.functional.conv2d(tx, tw, tb, stride=kw["stride"],
                                                      padding=kw["padding"]))
        if backward:
            y.backward(tgy)

    impls[f"PyTorch {torch.__version__} CPU ({torch.get_num_threads()} threads)"] = (
        lambda: torch_run(False), lambda: torch_run(True))
    return impls


def time_round_robin(fns, repeats):
    """Best wall time of each callable in ``fns`` (name -> (fn, repeats)), runs interleaved."""
    for fn, _ in fns.values():
        fn()                                                   # warm-up
    best = {name: float("inf") for name in fns}
    for i in range(max(r for _, r in fns.values())):
        for name, (fn, reps) in fns.items():
            if i < reps:
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def run(quick):
    repeats = REPEATS["quick" if quick else "full"]
    rng = np.random.default_rng(0)
    rows = []
    for name, x_shape, w_shape, kw in SHAPES:
        x = rng.standard_normal(x_shape).astype(DTYPE)
        w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(DTYPE)
        b = rng.standard_normal(w_shape[0]).astype(DTYPE)
        geom = validate.conv_geometry("bench", x_shape, w_shape, **kw)
        gy = rng.standard_normal(geom.y_shape).astype(DTYPE)
        impls = implementations(x, w, b, gy, kw)
        fns = {}
        for impl, (fwd, both) in impls.items():
            reps = min(repeats, SLOW_REPEATS) if impl == "NumPy reference" else repeats
            fns[(impl, "fwd")] = (fwd, reps)
            fns[(impl, "both")] = (both, reps)
        best = time_round_robin(fns, repeats)
        fused_both = best[(FUSED, "both")]
        for impl in impls:
            t_fwd, t_both = best[(impl, "fwd")], best[(impl, "both")]
            rows.append((name, impl, t_fwd * 1e3, t_both * 1e3,
                         FWD_BWD_PASSES * geom.flops / t_both / 1e9, t_both / fused_both))
            print(f"{name:12s} {impl:36s} fwd {t_fwd * 1e3:9.1f} ms   fwd+bwd "
                  f"{t_both * 1e3:9.1f} ms", flush=True)
    return rows


def shape_line(name, x_shape, w_shape, kw):
    return f"- {name}: x {x_shape}, w {w_shape}, {kw}"


def nf_threads():
    import numba
    return numba.get_num_threads()


def markdown(rows, command):
    threads = (f"Numba threads {nf_threads()}, OMP_WAIT_POLICY="
               f"{os.environ.get('OMP_WAIT_POLICY', '')}, {os.cpu_count()} CPUs visible")
    lines = [f"Command: `{command}`", "",
             f"float32, NCHW unless marked; {threads}. Best of several interleaved runs after "
             "a warm-up. GFLOP/s = 3 x forward conv flops / (fwd+bwd time). "
             "Ratio = fwd+bwd time / fused NCHW fwd+bwd time (lower is faster).", "",
             *[shape_line(*s) for s in SHAPES], "",
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
