"""Data-parallel scaling on MPI: a digits training step at 1 and 2 processes (weak scaling: a
fixed batch per rank) and the all-reduce of a gradient buffer against its size.

    python benchmarks/bench_distributed.py [--ranks 1 2] [--steps 30] [--markdown FILE[#SECTION]]

It launches itself under ``mpiexec -n P`` for each P (``--worker`` is the per-rank part) and
writes rank 0's timings. On one machine the ranks share its cores: this measures the cost of
synchronizing (sync batch norm, gradient averaging) on top of the compute, not cluster speed.
"""
import argparse
import json
import os
import platform
import shutil
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _report
import _report  # noqa: E402

MIB = 2.0 ** 20
SIZES = [2 ** k for k in range(8, 25, 2)]            # float32 elements: 1 KiB .. 64 MiB


def worker(args):
    from numbafuse import distributed, models, optim, train
    from numbafuse.data import load_digits
    comm = distributed.init()
    out = {"ranks": comm.size}
    # -- a training step, per-rank batch fixed
    data = load_digits(layout=models.DEFAULTS["layout"])
    model = models.make_model("fused", comm=comm if comm.size > 1 else None)
    distributed.broadcast_parameters(model, comm)
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    B = args.batch_per_rank
    n_global = B * comm.size
    times = []
    for step in range(args.warmup + args.steps):
        lo = (step * n_global) % (len(data.x_train) - n_global)
        xb = np.ascontiguousarray(data.x_train[lo + comm.rank * B:lo + (comm.rank + 1) * B])
        yb = np.ascontiguousarray(data.y_train[lo + comm.rank * B:lo + (comm.rank + 1) * B])
        if comm.mpi_comm is not None:
            comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        train.train_step(model, opt, xb, yb, comm if comm.size > 1 else None, n_global)
        if step >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    out["step_ms"] = statistics.median(times)
    out["grad_bytes"] = int(sum(p.data.nbytes for p in model.parameters()))
    # -- all-reduce of a buffer
    allreduce = {}
    for n in SIZES:
        a = np.ones(n, np.float32)
        samples = []
        for _ in range(args.repeats):
            if comm.mpi_comm is not None:
                comm.mpi_comm.Barrier()
            t0 = time.perf_counter()
            comm.allreduce_sum(a)
            samples.append((time.perf_counter() - t0) * 1e6)
        allreduce[n * 4] = statistics.median(samples)
    out["allreduce_us"] = allreduce
    if comm.rank == 0:
        print("RESULT " + json.dumps(out))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--batch-per-rank", type=int, default=32)
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    results = []
    for ranks in args.ranks:
        cmd = [mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker",
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats",
               str(args.repeats), "--batch-per-rank", str(args.batch_per_rank)]
        run = subprocess.run(cmd, capture_output=True, text=True, check=True)
        line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    lines = _table(args, results)
    print("\n".join(lines))
    if args.markdown:
        _report.write(args.markdown, "\n".join(lines) + "\n")


def _table(args, results):
    import mpi4py
    from mpi4py import MPI
    import numba
    load = os.getloadavg()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = [f"Command: `python benchmarks/bench_distributed.py {shlex.join(sys.argv[1:])}`",
             "", f"Machine: {cpu}, {os.cpu_count()} cores, one machine; Python "
             f"{platform.python_version()}, numba "
             f"{numba.__version__}, mpi4py {mpi4py.__version__}, "
             f"{MPI.Get_library_version().splitlines()[0].strip()}; load average {load:.1f}. "
             f"Medians; the ranks share the machine's cores.", "",
             f"### Training step, digits ResNet (fused, NHWC), {args.batch_per_rank} images per "
             f"rank (weak scaling)", "",
             "| ranks | global batch | ms / step | images / s | gradient buffer |",
             "|---:|---:|---:|---:|---:|"]
    for r in results:
        n = r["ranks"] * args.batch_per_rank
        lines.append(f"| {r['ranks']} | {n} | {r['step_ms']:.2f} | "
                     f"{n / r['step_ms'] * 1e3:.0f} | {r['grad_bytes'] / 1024:.1f} KiB |")
    lines += ["", "### allreduce_sum (reduce to rank 0 + broadcast), float32", "",
              "| bytes | " + " | ".join(f"{r['ranks']} ranks (us)" for r in results) +
              " | GB/s at the most ranks |", "|---:|" + "---:|" * (len(results) + 1)]
    for nbytes in results[0]["allreduce_us"]:
        times = [r["allreduce_us"][nbytes] for r in results]
        rate = int(nbytes) / (times[-1] * 1e-6) / 1e9
        lines.append(f"| {int(nbytes):,} | " + " | ".join(f"{t:.1f}" for t in times) +
                     f" | {rate:.2f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
