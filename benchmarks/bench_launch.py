"""The cost of one CPU launch: compiled (``kernels/cpu/native.py``) against the Python job.

    python benchmarks/bench_launch.py [--torch] [--tasks 8] [--size 2000] [--calls 400]
                                      [--rounds 3]

One process, numbafuse on 2 threads (torch too with ``--torch``: the launches run on its
OpenMP team, else on numbafuse's own pool): a task kernel of ``--tasks`` tasks, each a dot
product of ``--size`` float32 values, launched in ranges of half the tasks, with
``launch.NATIVE`` on and off in turn; the median of ``--calls`` launches, warm (one after
another) and cold (a 64 MiB array written before each launch: the launch's code and objects
out of the caches, as between a step's large kernels). The kernel alone on one thread is
printed beside them (``direct``).
"""
import argparse
import statistics
import time

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", action="store_true", help="on PyTorch's OpenMP team")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--size", type=int, default=2000)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.torch:
        import torch
        torch.set_num_threads(2)
    from numba import njit

    from numbafuse.kernels.cpu import launch

    @njit(nogil=True, cache=True)
    def kernel(t0, t1, x, y, a, b, c):
        for t in range(t0, t1):
            s = 0.0
            for i in range(x.shape[1]):
                s += x[t, i] * a
            y[t, 0] = s + b + c[0]

    launch.set_num_threads(2)
    x = np.ones((args.tasks, args.size), np.float32)
    y = np.zeros((args.tasks, 4), np.float32)
    operands = (x, y, np.float32(2), np.float32(1), np.ones(3, np.float32))
    grain = max(1, args.tasks // 2)
    for native in (True, False):                # compiled, and the entry readied
        launch.NATIVE = native
        for _ in range(3):
            launch.launch(kernel, args.tasks, *operands, grain=grain)
    sweep = np.zeros(8 << 20)

    def timed(native, cold, calls):
        launch.NATIVE = bool(native)
        times = []
        for _ in range(calls):
            if cold:
                sweep[:] += 1
            t = time.perf_counter()
            if native is None:
                kernel(0, args.tasks, *operands)
            else:
                launch.launch(kernel, args.tasks, *operands, grain=grain)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    print(f"{launch.backend()}: {args.tasks} tasks of {args.size} values, ranges of {grain}; "
          "median us a launch")
    for r in range(args.rounds):
        row = []
        for cold in (False, True):
            calls = args.calls if not cold else max(1, args.calls // 4)
            row.append(f"{'cold' if cold else 'warm'}: compiled {timed(True, cold, calls):.1f}"
                       f" python {timed(False, cold, calls):.1f}"
                       f" direct {timed(None, cold, calls):.1f}")
        print(f"round {r + 1}: " + "; ".join(row))


if __name__ == "__main__":
    main()
