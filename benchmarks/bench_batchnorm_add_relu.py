"""Benchmark BatchNorm -> Add -> ReLU on the CPU: fused vs unfused vs NumPy vs PyTorch eager.

    python benchmarks/bench_batchnorm_add_relu.py [--quick] [--markdown FILE]

For each shape (float32, NCHW) it times the forward and the forward+backward of

* ``fused``     numbafuse.batchnorm_add_relu on the tape (Tensors, y.backward(gy)), save="output";
* ``fused mask`` the same with save="mask" (1-bit ReLU state);
* ``fused no-tape`` the NumPy-style API: batchnorm_add_relu on arrays, then
                batchnorm_add_relu_backward(..., y=y) (the kernels without the tape's
                bookkeeping; the backward recomputes the batch statistics);
* ``unfused``   numbafuse relu(add(batchnorm(x), z)) on the tape;
* ``numpy``     numbafuse.reference (plain NumPy, float64 inside);
* ``torch``     PyTorch CPU eager F.batch_norm + add + relu with autograd (if importable);

and reports the best time of ``repeat`` runs (after a warm-up that also compiles), the speed-up
of ``fused`` over each, and the achieved bandwidth of ``fused``: the *minimum* bytes any
implementation must move (forward: read x, z, write y; backward: read gy, x and the ReLU state
y, write gx, gz) divided by its time, next to the bandwidth of a NumPy copy measured in the
same run (read + write of an array of the same size).
"""
import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numbafuse as nf                         # noqa: E402
from numbafuse import reference as ref         # noqa: E402

SHAPES = [(32, 64, 32, 32), (64, 256, 56, 56)]   # (N, C, H, W)
DTYPE = np.float32
REPEAT, QUICK_REPEAT = 5, 2
FWD_TENSORS = 3          # x, z read; y written
BWD_TENSORS = 5          # gy, x, y read; gx, gz written
COPY_TENSORS = 2         # read + write
GB = 1e9
MS = 1e3
REFERENCE_MAX_ELEMENTS = 1 << 22   # --quick skips the (slow, float64) reference above this


def best_time(fn, repeat):
    """Best wall time of ``repeat`` calls after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make_problem(shape, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[1]
    return dict(x=rng.standard_normal(shape, dtype=DTYPE), z=rng.standard_normal(shape, dtype=DTYPE),
                gamma=rng.uniform(0.5, 1.5, C).astype(DTYPE),
                beta=rng.standard_normal(C, dtype=DTYPE),
                gy=rng.standard_normal(shape, dtype=DTYPE))


def numbafuse_runners(p, chain, save="output"):
    """Tape runners: chain "fused" (save policy ``save``) or "unfused"."""
    rm, rv = np.zeros(p["x"].shape[1], DTYPE), np.ones(p["x"].shape[1], DTYPE)

    def forward_op(x, z, gamma, beta):
        if chain == "fused":
            return nf.batchnorm_add_relu(x, z, gamma, beta, running_mean=rm, running_var=rv,
                                         save=save)
        return nf.relu(nf.add(nf.batchnorm(x, gamma, beta, running_mean=rm, running_var=rv),
                              z))

    def fwd():
        with nf.no_grad():
            forward_op(*(nf.Tensor(p[k]) for k in ("x", "z", "gamma", "beta")))

    def fwd_bwd():
        leaves = [nf.Tensor(p[k], requires_grad=True) for k in ("x", "z", "gamma", "beta")]
        forward_op(*leaves).backward(p["gy"])

    return fwd, fwd_bwd


def notape_runners(p):
    """The fused kernels through the NumPy-style API: no tape, no gradient copies."""
    rm, rv = np.zeros(p["x"].shape[1], DTYPE), np.ones(p["x"].shape[1], DTYPE)
    args = (p["x"], p["z"], p["gamma"], p["beta"])

    def fwd():
        return nf.batchnorm_add_relu(*args, running_mean=rm, running_var=rv)

    def fwd_bwd():
        y = fwd()
        nf.batchnorm_add_relu_backward(p["gy"], *args, y=y)

    return fwd, fwd_bwd


def numpy_runners(p):
    args = (p["x"], p["z"], p["gamma"], p["beta"])

    def fwd():
        ref.batchnorm_add_relu(*args)

    def fwd_bwd():
        ref.batchnorm_add_relu(*args)
        ref.batchnorm_add_relu_backward(p["gy"], *args)

    return fwd, fwd_bwd


def torch_runners(p):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    t = {k: torch.from_numpy(v) for k, v in p.items()}
    rm, rv = torch.zeros(p["x"].shape[1]), torch.ones(p["x"].shape[1])
    leaves = {k: torch.from_numpy(p[k]).requires_grad_(True) for k in ("x", "z", "gamma", "beta")}

    def fwd():
        with torch.no_grad():
            F.relu(F.batch_norm(t["x"], rm, rv, t["gamma"], t["beta"], training=True) + t["z"])

    def fwd_bwd():
        for leaf in leaves.values():
            leaf.grad = None          # so autograd hands its gradient buffers over, uncopied
        y = F.relu(F.batch_norm(leaves["x"], rm, rv, leaves["gamma"], leaves["beta"],
                                training=True) + leaves["z"])
        y.backward(t["gy"])

    return fwd, fwd_bwd


def copy_bandwidth(n_elements, repeat):
    src = np.ones(n_elements, DTYPE)
    dst = np.empty_like(src)
    seconds = best_time(lambda: np.copyto(dst, src), repeat)
    return COPY_TENSORS * src.nbytes / seconds / GB


def run(quick):
    repeat = QUICK_REPEAT if quick else REPEAT
    rows, notes = [], []
    for shape in SHAPES:
        p = make_problem(shape)
        size = int(np.prod(shape))
        nbytes = size * np.dtype(DTYPE).itemsize
        copy_gbs = copy_bandwidth(size, repeat)
        impls = {"fused": numbafuse_runners(p, "fused"),
                 "fused_mask": numbafuse_runners(p, "fused", save="mask"),
                 "fused_notape": notape_runners(p),
                 "unfused": numbafuse_runners(p, "unfused")}
        if quick and size > REFERENCE_MAX_ELEMENTS:
            notes.append(f"{shape}: NumPy reference skipped (--quick)")
        else:
            impls["numpy"] = numpy_runners(p)
        torch_impl = torch_runners(p)
        if torch_impl is None:
            notes.append("PyTorch not importable: torch column empty")
        else:
            impls["torch"] = torch_impl
        times = {name: (best_time(f, repeat), best_time(fb, repeat))
                 for name, (f, fb) in impls.items()}
        for i, (pass_name, tensors) in enumerate((("fwd", FWD_TENSORS),
                                                  ("fwd+bwd", FWD_TENSORS + BWD_TENSORS))):
            fused = times["fused"][i]
            row = dict(shape=shape, pass_=pass_name,
                       **{name: t[i] for name, t in times.items()},
                       gbs=tensors * nbytes / fused / GB,
                       gbs_notape=tensors * nbytes / times["fused_notape"][i] / GB,
                       copy_gbs=copy_gbs)
            rows.append(row)
        del p
    return rows, sorted(set(notes))


def _fmt_ms(t):
    return "-" if t is None else f"{t * MS:.2f}"


def _fmt_x(base, t):
    return "-" if t is None else f"{t / base:.2f}x"


def table(rows):
    head = ("| shape | pass | fused ms | fused mask ms | fused no-tape ms | unfused ms | numpy ms "
            "| torch ms | vs unfused | vs numpy | vs torch | fused GB/s | no-tape GB/s "
            "| copy GB/s | fused/copy | no-tape/copy |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        f = r["fused"]
        lines.append(
            f"| {r['shape']} | {r['pass_']} | {_fmt_ms(f)} | {_fmt_ms(r['fused_mask'])} | "
            f"{_fmt_ms(r['fused_notape'])} | {_fmt_ms(r.get('unfused'))} | "
            f"{_fmt_ms(r.get('numpy'))} | {_fmt_ms(r.get('torch'))} | "
            f"{_fmt_x(f, r.get('unfused'))} | {_fmt_x(f, r.get('numpy'))} | "
            f"{_fmt_x(f, r.get('torch'))} | {r['gbs']:.1f} | {r['gbs_notape']:.1f} | "
            f"{r['copy_gbs']:.1f} | {r['gbs'] / r['copy_gbs']:.2f} | "
            f"{r['gbs_notape'] / r['copy_gbs']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, skip slow refs")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    args = parser.parse_args(argv)
    import numba
    rows, notes = run(args.quick)
    text = table(rows)
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"numba {numba.__version__} with {numba.get_num_threads()} threads, "
               f"numpy {np.__version__}, float32 NCHW, best of "
               f"{QUICK_REPEAT if args.quick else REPEAT}")
    print(machine)
    print(text)
    for n in notes:
        print("note:", n)
    if args.markdown:
        command = "python benchmarks/bench_batchnorm_add_relu.py" + (
            " --quick" if args.quick else "") + f" --markdown {args.markdown}"
        with open(args.markdown, "w") as fh:
            fh.write("# BatchNorm -> Add -> ReLU benchmark (CPU)\n\n")
            fh.write(f"Command: `{command}`\n\nMachine: {machine}\n\n")
            fh.write("Times are the best of the repeats, in milliseconds; `vs X` is X's time "
                     "over fused's (tape, save=\"output\"; higher is better for fused). "
                     "Bandwidth: minimum bytes moved (forward: x, z, y; backward: gy, x, y, "
                     "gx, gz) over the fused time (tape, and no-tape), against a NumPy copy "
                     "(read + write) in the same run.\n\n")
            fh.write(text + "\n")
            for n in notes:
                fh.write(f"\n- {n}")
            fh.write("\n")


if __name__ == "__main__":
    main()
