"""BatchNorm -> Add -> ReLU on the CPU, forward and forward + backward: numbafuse vs PyTorch.

    python benchmarks/bench_batchnorm_add_relu.py [--rounds 5] [--repeats 10]
                                                  [--shapes 32,64,32,32 ...] [--layout NHWC]
                                                  [--markdown FILE]

Training mode, float32, NCHW (``--layout NHWC``: numbafuse's NHWC arrays, PyTorch's
channels_last tensors; shapes are given as N,C,H,W either way). Each library in its own
processes (``_runner.py``), alternating, best of each:

* ``fused``       numbafuse.batchnorm_add_relu on the tape (Tensors, y.backward(gy)), the ReLU
                  state kept as y;
* ``fused mask``  the same with save="mask" (a 1-bit ReLU state);
* ``unfused``     numbafuse relu(add(batchnorm(x), z)) on the tape;
* ``PyTorch``     F.batch_norm + add + relu with autograd, gradients cleared before each call.

GB/s of ``fused`` counts the minimum bytes a call must move, each tensor once: the forward
reads x, z and writes y (3 tensors); forward + backward adds gy, x, y read and gx, gz written
(8 in all).

The memory roofline: a third process (``stream``, NumPy only) times ``c = a + b`` over arrays
of ``STREAM_BYTES`` each (past the last-level cache), one slice per usable core on Python
threads (NumPy releases the GIL), and reports GB/s counting the 3 arrays once, as STREAM's
"add" does. ``roofline ms`` = the minimum bytes above / that rate: the time of an
implementation that moves each tensor once through memory at that rate, and ``roofline
speed-up`` = PyTorch's time / roofline ms, what such an implementation would show. Only
tensors still in the last-level cache from the call before can come faster (the benchmark
repeats one call, and a tensor of the default shape is 8 MiB).
"""
import argparse
import sys
import threading

import numpy as np

import _report
import _runner

SHAPES = ["32,64,32,32"]                 # (N, C, H, W); add 64,256,56,56 for a large one
DTYPE = np.float32
FWD_TENSORS, FWD_BWD_TENSORS = 3, 8
STREAM_BYTES = 64 << 20                  # bytes per array of the bandwidth probe (3 arrays)


def problem(shape, layout="NCHW"):
    """The arrays of one call; x, z, gy in ``layout`` (NHWC: NCHW's values transposed)."""
    rng = np.random.default_rng(0)
    N, C, H, W = shape
    out = dict(x=rng.standard_normal(shape).astype(DTYPE),
               z=rng.standard_normal(shape).astype(DTYPE),
               gy=rng.standard_normal(shape).astype(DTYPE))
    if layout == "NHWC":
        out = {k: np.ascontiguousarray(v.transpose(0, 2, 3, 1)) for k, v in out.items()}
    return dict(out, gamma=rng.uniform(0.5, 1.5, C).astype(DTYPE),
                beta=rng.standard_normal(C).astype(DTYPE))


def _numbafuse_cases(name, shape, layout):
    import numbafuse as nf
    p = problem(shape, layout)
    C = shape[1]
    rm, rv = np.zeros(C, DTYPE), np.ones(C, DTYPE)

    def leaves():
        return [nf.Tensor(p[k], requires_grad=True) for k in ("x", "z", "gamma", "beta")]

    def fused(save):
        def fwd():
            with nf.no_grad():
                nf.batchnorm_add_relu(*leaves(), running_mean=rm, running_var=rv, layout=layout)

        def both():
            y = nf.batchnorm_add_relu(*leaves(), running_mean=rm, running_var=rv, save=save,
                                      layout=layout)
            y.backward(p["gy"])
        return fwd, both

    def unfused():
        x, z, gamma, beta = leaves()
        y = nf.relu(nf.add(nf.batchnorm(x, gamma, beta, running_mean=rm, running_var=rv,
                                        layout=layout), z))
        y.backward(p["gy"])

    fwd, both = fused("output")
    return {f"{name} fwd": fwd, f"{name} fwd+bwd": both,
            f"{name} fwd+bwd mask": fused("mask")[1], f"{name} fwd+bwd unfused": unfused}


def _torch_cases(name, shape, layout):
    import torch
    import torch.nn.functional as F
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    p = {k: torch.from_numpy(v) for k, v in problem(shape).items()}
    p.update({k: p[k].contiguous(memory_format=fmt) for k in ("x", "z", "gy")})
    C = shape[1]
    rm, rv = torch.zeros(C), torch.ones(C)
    leaves = [p[k].clone().requires_grad_(True) for k in ("x", "z", "gamma", "beta")]

    def fwd():
        with torch.no_grad():
            F.relu(F.batch_norm(p["x"], rm, rv, p["gamma"], p["beta"], training=True) + p["z"])

    def both():
        for leaf in leaves:
            leaf.grad = None
        x, z, gamma, beta = leaves
        F.relu(F.batch_norm(x, rm, rv, gamma, beta, training=True) + z).backward(p["gy"])

    return {f"{name} fwd": fwd, f"{name} fwd+bwd": both}


def _stream_cases():
    """{"stream add": fn}: c = a + b on every usable core, 3 x STREAM_BYTES moved."""
    n = STREAM_BYTES // 4
    a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    edges = np.linspace(0, n, _runner.usable_cores() + 1).astype(int)

    def add(lo, hi):
        np.add(a[lo:hi], b[lo:hi], out=c[lo:hi])

    def run():
        threads = [threading.Thread(target=add, args=(lo, hi))
                   for lo, hi in zip(edges[:-1], edges[1:])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {"stream add": run}


def stream_gbs(seconds):
    """GB/s of the probe: 3 arrays of STREAM_BYTES in ``seconds``."""
    return 3 * STREAM_BYTES / seconds / 1e9


def cases(side, options):
    if side == "stream":
        return _stream_cases()
    out = {}
    for s in options["shapes"]:
        shape = tuple(int(v) for v in s.split(","))
        out.update((_torch_cases if side == "torch" else _numbafuse_cases)(s, shape,
                                                                           options["layout"]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--shapes", nargs="*", default=SHAPES)
    p.add_argument("--layout", default="NCHW", choices=("NCHW", "NHWC"))
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    best, info = _runner.compare("bench_batchnorm_add_relu", ["numbafuse", "torch", "stream"],
                                 args.rounds, args.repeats,
                                 dict(shapes=args.shapes, layout=args.layout),
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
    bw = stream_gbs(best["stream"]["stream add"])
    lines = _runner.header(info, _report.command("bench_batchnorm_add_relu.py"))
    lines += [f"Training mode, float32, {args.layout}. GB/s: minimum bytes moved (forward 3 "
              "tensors, forward + backward 8) over the fused time. Roofline: those bytes at the "
              f"machine's measured memory bandwidth, {bw:.1f} GB/s (NumPy c = a + b on every "
              f"core over {STREAM_BYTES >> 20} MiB arrays, its own process, best of the "
              "rounds); roofline speed-up: PyTorch's time over the roofline, what an "
              "implementation moving each tensor once through memory would show (only what "
              "stays in the last-level cache between calls comes faster).", "",
              "| shape (N,C,H,W) | pass | numbafuse fused ms | PyTorch ms | speed-up | fused GB/s "
              "| roofline ms | roofline speed-up | fused, mask state ms | unfused ms |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    nf, th = best["numbafuse"], best["torch"]
    for s in args.shapes:
        nbytes = np.prod([int(v) for v in s.split(",")]) * np.dtype(DTYPE).itemsize
        for ps, tensors in (("fwd", FWD_TENSORS), ("fwd+bwd", FWD_BWD_TENSORS)):
            a, t = nf[f"{s} {ps}"], th[f"{s} {ps}"]
            extra = (f"{nf[f'{s} fwd+bwd mask'] * 1e3:.2f} | {nf[f'{s} fwd+bwd unfused'] * 1e3:.2f}"
                     if ps == "fwd+bwd" else "- | -")
            roof = tensors * nbytes / (bw * 1e9)
            lines.append(f"| ({s}) | {ps} | {a * 1e3:.2f} | {t * 1e3:.2f} | {t / a:.2f}x | "
                         f"{tensors * nbytes / a / 1e9:.1f} | {roof * 1e3:.2f} | "
                         f"{t / roof:.2f}x | {extra} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
