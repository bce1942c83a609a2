"""How the machine's memory bandwidth grows with threads: STREAM's "copy", "add" and a
read-only sum over arrays far past the last-level cache, on 1, 2, ... usable cores.

    python benchmarks/memory_bandwidth.py [--mib 256] [--rounds 5]

Each thread runs NumPy on its own slice (NumPy releases the GIL), so the threads are plain
Python threads and nothing of numbafuse or PyTorch is loaded. GB/s counts each array once, as
STREAM does (copy: 2 arrays, add: 3, sum: 1); best of ``--rounds``, the thread counts
alternating round by round. A pass whose time is its bytes at this rate gains from a second
thread only what this table gains: that is the ceiling of the batch-norm passes, the gathers
and the transposes in a training step (docs/benchmarks.md, "Two threads on machine A").
"""
import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _runner  # noqa: E402

KERNELS = {
    # name: (arrays counted, the slice's work)
    "copy": (2, lambda a, b, c: np.copyto(c, a)),
    "add": (3, lambda a, b, c: np.add(a, b, out=c)),
    "sum": (1, lambda a, b, c: np.add.reduce(a)),
}


def run(kernel, arrays, threads):
    """Seconds of one ``kernel`` over ``arrays`` split into ``threads`` slices."""
    n = arrays[0].size
    edges = np.linspace(0, n, threads + 1).astype(int)
    work = [threading.Thread(target=kernel, args=tuple(x[lo:hi] for x in arrays))
            for lo, hi in zip(edges[:-1], edges[1:])]
    t = time.perf_counter()
    for w in work:
        w.start()
    for w in work:
        w.join()
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB per array (default 256)")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    if a.mib < 1 or a.rounds < 1:
        p.error("--mib and --rounds must be at least 1")
    n = (a.mib << 20) // 4
    arrays = [np.ones(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)]
    counts = list(range(1, _runner.usable_cores() + 1))
    best = {(k, t): float("inf") for k in KERNELS for t in counts}
    for _ in range(a.rounds):
        for t in counts:
            for k, (_, kernel) in KERNELS.items():
                best[k, t] = min(best[k, t], run(kernel, arrays, t))
    print(f"{len(counts)} usable cores; arrays of {a.mib} MiB float32; GB/s, best of "
          f"{a.rounds} (each array counted once)\n")
    print("| threads | " + " | ".join(KERNELS) + " |")
    print("|---:|" + "---:|" * len(KERNELS))
    for t in counts:
        cells = [f"{arrays_counted * a.mib * 2**20 / best[k, t] / 1e9:.1f}"
                 for k, (arrays_counted, _) in KERNELS.items()]
        print(f"| {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
