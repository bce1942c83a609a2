"""Benchmark BatchNorm -> Add -> ReLU on the CPU: fused vs unfused vs NumPy vs PyTorch eager.

    python benchmarks/bench_batchnorm_add_relu.py [--quick] [--repeat R] [--markdown FILE]

Everything runs in ONE process, round-robin: each round calls every implementation once
(forward, then forward+backward) and the two copies, in a fresh random order each round,
and the table keeps the best time of each over the rounds, so a burst of load from another
process hits all of them alike (the machine is shared: compare columns of one run, not runs).
For each shape (float32, NCHW):

* ``fused``          numbafuse.batchnorm_add_relu on the tape (Tensors, y.backward(gy)),
                     save="output" (the backward reads y for the ReLU gate);
* ``fused mask``     the same with save="mask" (1-bit ReLU state);
* ``fused no-cache`` save="output" with the CPU output cache off
                     (``kernels.cpu.batchnorm.output_cache.max_bytes = 0``): every y, gx, gz
                     is a fresh array whose pages the OS faults in and zeroes;
* ``fused no-tape``  the NumPy-style API on arrays: batchnorm_add_relu, then
                     batchnorm_add_relu_backward(..., y=y) (which recomputes the statistics);
* ``unfused``        numbafuse relu(add(batchnorm(x), z)) on the tape;
* ``numpy``          numbafuse.reference (plain NumPy, float64 inside);
* ``torch``          PyTorch CPU eager F.batch_norm + add + relu with autograd (if importable).

Bandwidth of ``fused`` = the *minimum* bytes each call must move, every tensor counted once per
call: forward reads x, z and writes y (3 tensors); the backward reads gy, x, y and writes gx, gz
(5 tensors), so forward+backward counts 8. That over the time, next to the bandwidth of a NumPy
copy of an array of the same size (read + write, 2 tensors) measured in the same rounds: NumPy's
``copyto`` (one thread) and a Numba ``prange`` copy on all Numba threads (the fair ceiling for the
fused kernels, which use all threads).
"""
import argparse
import os
import platform
import sys
import time

import numpy as np
from numba import njit, prange

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numbafuse as nf                                      # noqa: E402
from numbafuse import reference as ref                      # noqa: E402
from numbafuse.kernels.batchnorm import cpu as cpu_bn       # noqa: E402

SHAPES = [(32, 64, 32, 32), (64, 256, 56, 56)]   # (N, C, H, W)
DTYPE = np.float32
REPEAT, QUICK_REPEAT = 15, 3
SHUFFLE_SEED = 0         # the order of the implementations in each round is a permutation
SLOW_REPEAT = 2          # rounds that include the (float64, ~seconds) NumPy reference
LARGE_ELEMENTS = 1 << 24  # above this, the NumPy reference runs only SLOW_REPEAT rounds
FWD_TENSORS = 3          # x, z read; y written
BWD_TENSORS = 5          # gy, x, y read; gx, gz written
COPY_TENSORS = 2         # read + write
GB = 1e9
MS = 1e3
IMPLS = ("fused", "fused_mask", "fused_nocache", "fused_notape", "unfused", "numpy", "torch")
HEADS = {"fused": "fused", "fused_mask": "fused mask", "fused_nocache": "fused no-cache",
         "fused_notape": "fused no-tape", "unfused": "unfused", "numpy": "numpy",
         "torch": "torch"}


def make_problem(shape, seed=0):
    rng = np.random.default_rng(seed)
    C = shape[1]
    return dict(x=rng.standard_normal(shape, dtype=DTYPE),
                z=rng.standard_normal(shape, dtype=DTYPE),
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


def without_cache(runners):
    """The same runners with the CPU output cache off (fresh outputs each call)."""
    def wrap(fn):
        def run():
            saved, cpu_bn.output_cache.max_bytes = cpu_bn.output_cache.max_bytes, 0
            try:
                fn()
            finally:
                cpu_bn.output_cache.max_bytes = saved
        return run
    return tuple(wrap(f) for f in runners)


def notape_runners(p):
    """The fused kernels through the NumPy-style API: no tape, no gradient bookkeeping."""
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
    leaves = {k: torch.from_numpy(p[k]).requires_grad_(True)
              for k in ("x", "z", "gamma", "beta")}

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


@njit(parallel=True, cache=True)
def parallel_copy(dst, src):
    """dst[:] = src on all Numba threads (a copy at the bandwidth the fused kernels can use)."""
    for i in prange(src.shape[0]):
        dst[i] = src[i]


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_shape(shape, repeat, quick, notes):
    """{impl: [best fwd s, best fwd+bwd s]} and the copy bandwidth (GB/s) of one shape."""
    p = make_problem(shape)
    size = int(np.prod(shape))
    impls = {"fused": numbafuse_runners(p, "fused"),
             "fused_mask": numbafuse_runners(p, "fused", save="mask"),
             "fused_nocache": without_cache(numbafuse_runners(p, "fused")),
             "fused_notape": notape_runners(p),
             "unfused": numbafuse_runners(p, "unfused")}
    slow = {}
    if quick and size > LARGE_ELEMENTS:
        notes.append(f"{shape}: NumPy reference skipped (--quick)")
    elif size > LARGE_ELEMENTS:
        slow["numpy"] = numpy_runners(p)
        notes.append(f"{shape}: NumPy reference: best of {min(SLOW_REPEAT, repeat)} rounds")
    else:
        impls["numpy"] = numpy_runners(p)
    torch_impl = torch_runners(p)
    if torch_impl is None:
        notes.append("PyTorch not importable: torch column empty")
    else:
        impls["torch"] = torch_impl
    src = np.ones(size, DTYPE)
    dst = np.empty_like(src)
    every = {**impls, **slow}
    for f, fb in every.values():       # warm-up: compiles, and fills the output cache
        f()
        fb()
    parallel_copy(dst, src)
    best = {name: [np.inf, np.inf] for name in every}
    best_copy = best_pcopy = np.inf
    order = ["copy", "pcopy", *every]
    shuffler = np.random.default_rng(SHUFFLE_SEED)
    for r in range(repeat):
        # a fresh order each round: whoever runs right after a copy finds its inputs evicted
        # from the cache (at the small shape the tensors otherwise stay in L3), so no column
        # may always be the one that pays (a fixed or rotated order measured fused's forward
        # 1.5x slower than the identical save="mask" one)
        for name in shuffler.permutation(order):
            if name == "copy":
                best_copy = min(best_copy, timed(lambda: np.copyto(dst, src)))
            elif name == "pcopy":
                best_pcopy = min(best_pcopy, timed(lambda: parallel_copy(dst, src)))
            elif name not in slow or r < SLOW_REPEAT:
                f, fb = every[name]
                best[name][0] = min(best[name][0], timed(f))
                best[name][1] = min(best[name][1], timed(fb))
    copy_gbs = COPY_TENSORS * src.nbytes / best_copy / GB
    pcopy_gbs = COPY_TENSORS * src.nbytes / best_pcopy / GB
    return best, copy_gbs, pcopy_gbs


def run(repeat, quick):
    rows, notes = [], []
    for shape in SHAPES:
        best, copy_gbs, pcopy_gbs = run_shape(shape, repeat, quick, notes)
        nbytes = int(np.prod(shape)) * np.dtype(DTYPE).itemsize
        for i, (pass_name, tensors) in enumerate((("fwd", FWD_TENSORS),
                                                  ("fwd+bwd", FWD_TENSORS + BWD_TENSORS))):
            times = {name: t[i] for name, t in best.items()}
            rows.append(dict(shape=shape, pass_=pass_name, times=times, copy_gbs=copy_gbs,
                             pcopy_gbs=pcopy_gbs, min_bytes=tensors * nbytes))
    return rows, notes


EXPLANATION = (
    "All columns come from one process, round-robin (each round runs every implementation "
    "once, in a fresh random order), best time per column. `torch / fused` is PyTorch's time "
    "over fused's (tape, save=\"output\"): higher is better for fused. Bandwidth counts each "
    "tensor once per call: forward x, z, y (3 tensors); forward+backward adds gy, x, y, gx, gz "
    "(8 in all). Copy: a copy of one tensor (read + write) in the same rounds, by NumPy's "
    "copyto (one thread) and by a Numba prange loop (all threads, like the fused kernels); at "
    "the small shape source and destination (16 MB) fit in the 32 MB L3 of the machine "
    "measured, so its copy figures may be cache, not DRAM, bandwidth. `no-cache`: the output "
    "cache off, so every output is fresh memory (page faults).")


def _fmt_ms(t):
    return "-" if t is None else f"{t * MS:.2f}"


def time_table(rows):
    head = ("| shape | pass | " + " | ".join(f"{HEADS[i]} ms" for i in IMPLS)
            + " | torch / fused | unfused / fused |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["times"]
        f = t["fused"]
        ratio = {k: ("-" if k not in t else f"{t[k] / f:.2f}x") for k in ("torch", "unfused")}
        lines.append(f"| {r['shape']} | {r['pass_']} | "
                     + " | ".join(_fmt_ms(t.get(i)) for i in IMPLS)
                     + f" | {ratio['torch']} | {ratio['unfused']} |")
    return "\n".join(lines)


def bandwidth_table(rows):
    head = ("| shape | pass | min MB moved | copy GB/s | prange copy GB/s | fused GB/s "
            "| fused / copy | fused / prange copy | no-cache GB/s | no-cache / copy "
            "| no-tape GB/s | no-tape / copy |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        gbs = {impl: r["min_bytes"] / r["times"][impl] / GB
               for impl in ("fused", "fused_nocache", "fused_notape")}
        lines.append(
            f"| {r['shape']} | {r['pass_']} | {r['min_bytes'] / 1e6:.0f} | {r['copy_gbs']:.1f} | "
            f"{r['pcopy_gbs']:.1f} | {gbs['fused']:.1f} | {gbs['fused'] / r['copy_gbs']:.2f} | "
            f"{gbs['fused'] / r['pcopy_gbs']:.2f} | {gbs['fused_nocache']:.1f} | "
            f"{gbs['fused_nocache'] / r['copy_gbs']:.2f} | {gbs['fused_notape']:.1f} | "
            f"{gbs['fused_notape'] / r['copy_gbs']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REPEAT} rounds, no NumPy reference at the large shape")
    parser.add_argument("--repeat", type=int, help="rounds (default %d)" % REPEAT)
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown")
    args = parser.parse_args(argv)
    import numba
    repeat = args.repeat or (QUICK_REPEAT if args.quick else REPEAT)
    rows, notes = run(repeat, args.quick)
    try:
        import torch
        torch_info = f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    except ImportError:
        torch_info = "no torch"
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
               f"numba {numba.__version__} with {numba.get_num_threads()} threads "
               f"({numba.threading_layer()}), {torch_info}, numpy {np.__version__}, float32 "
               f"NCHW, best of {repeat} round-robin rounds")
    text = ("Times (ms):\n\n" + time_table(rows) + "\n\nBandwidth of the fused op (minimum "
            "bytes moved / time):\n\n" + bandwidth_table(rows))
    print(machine)
    print(text)
    for n in notes:
        print("note:", n)
    if args.markdown:
        command = ("python benchmarks/bench_batchnorm_add_relu.py"
                   + (" --quick" if args.quick else "")
                   + (f" --repeat {args.repeat}" if args.repeat else "")
                   + f" --markdown {args.markdown}")
        with open(args.markdown, "w") as fh:
            fh.write(f"Command: `{command}`\n\n# BatchNorm -> Add -> ReLU benchmark (CPU)\n\n")
            fh.write(f"Machine: {machine}\n\n")
            fh.write(EXPLANATION + "\n\n")
            fh.write(text + "\n")
            for n in notes:
                fh.write(f"\n- {n}")
            fh.write("\n")


if __name__ == "__main__":
    main()
