"""What slows a library's conv when another runs between its calls: a controlled experiment.

    python benchmarks/neighbour_experiment.py [--rounds 2] [--calls 12] [--markdown FILE]

The victim (PyTorch conv fwd+bwd at the ResNet layer x (32,64,32,32), w (64,64,3,3), NCHW, on
1 thread and on its default 2) is timed alone and with one call of a neighbour between its
calls: numbafuse imported with its pool started but idle, numbafuse's fwd+bwd on 2 threads and
on 1 (no helper threads), and a pure-NumPy neighbour (allocate and fill four x-sized arrays).
numbafuse as the victim is timed alone and beside PyTorch. Every (victim, neighbour) pair runs
in its own process, the pairs alternate, rounds repeat; each row reports the best wall ms, the
best process CPU ms (all threads) and the median minor page faults per victim call.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_NEIGHBOURS = ("alone", "numbafuse idle", "numbafuse 2 threads", "numbafuse 1 thread",
                    "numpy fill")


def _torch_case():
    import bench_conv_bias_relu as B
    return B._torch_cases("resnet 3x3", "NCHW")["resnet 3x3 NCHW fwd+bwd"]


def _numbafuse_case(threads=None):
    import bench_conv_bias_relu as B
    if threads:
        from numbafuse.kernels.cpu import launch as cpu_launch
        cpu_launch.set_num_threads(threads)
    return B._numbafuse_cases("resnet 3x3", "NCHW", False)["resnet 3x3 NCHW fwd+bwd"]


def worker(victim, neighbour, torch_threads, calls):
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    if victim == "torch":
        import torch
        if torch_threads:
            torch.set_num_threads(torch_threads)
        fn = _torch_case()
    else:
        fn = _numbafuse_case()
    other = None
    if neighbour == "numbafuse idle":
        _numbafuse_case()()                          # compiled, pool started, then never run
    elif neighbour == "numbafuse 2 threads":
        other = _numbafuse_case(2)
    elif neighbour == "numbafuse 1 thread":
        other = _numbafuse_case(1)
    elif neighbour == "torch":
        other = _torch_case()
    elif neighbour == "numpy fill":
        def other():
            keep = []
            for _ in range(4):
                a = np.empty((32, 64, 32, 32), np.float32)
                a.fill(1.0)
                keep.append(a)
    for _ in range(3):
        fn()
        if other:
            other()
    wall, cpu, faults = [], [], []
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        if other:
            other()
    print(json.dumps(dict(wall=min(wall), cpu=min(cpu), faults=sorted(faults)[len(faults) // 2],
                          load=os.getloadavg()[0])))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    pairs = [("torch", n, t) for t in (1, 0) for n in TORCH_NEIGHBOURS]
    pairs += [("numbafuse", "alone", 0), ("numbafuse", "torch", 0)]
    res = {pair: [] for pair in pairs}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for pair in (pairs if r % 2 == 0 else pairs[::-1]):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                  pair[0], pair[1], str(pair[2]), str(args.calls)],
                                 capture_output=True, text=True, check=True)
            res[pair].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(pair, res[pair][-1], file=sys.stderr, flush=True)
    loads.append(os.getloadavg()[0])
    sys.path.insert(0, HERE)
    import _report
    import _runner
    lines = [f"Command: `{_report.command('neighbour_experiment.py')}`", "",
             f"Machine: {_runner._machine()}; load average {loads[0]:.2f} at the start, "
             f"{loads[1]:.2f} at the end. One process per (victim, neighbour) pair, pairs "
             f"alternating, {args.rounds} rounds (values per round, separated by /).", "",
             "| victim | threads | between its calls | best ms | best CPU ms | page faults per call |",
             "|---|---|---|---|---|---|"]
    for (victim, neighbour, threads), rows in res.items():
        fmt = lambda key, scale: " / ".join(f"{d[key] * scale:.1f}" for d in rows)  # noqa: E731
        lines.append(f"| {victim} | {threads or 'default'} | {neighbour} | {fmt('wall', 1e3)} | "
                     f"{fmt('cpu', 1e3)} | {' / '.join(str(d['faults']) for d in rows)} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
