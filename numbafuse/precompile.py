"""Compile numbafuse's kernels ahead of time into Numba's on-disk cache.

    python -m numbafuse.precompile --cuda [-j JOBS] [--dtypes float32,float64]

Every numba.cuda kernel of the package is listed once, with its signature per dtype, in its
module's ``PTX_SIGNATURES``; this compiles each (kernel, dtype) for the current GPU with
``cache=True`` semantics, one kernel per task, ``JOBS`` processes at a time, so that later
processes (the tests, a training run, each MPI rank) load the machine code from
``NUMBA_CACHE_DIR`` (or the ``__pycache__`` beside the sources) instead of compiling it.
Numba writes each cache entry to a temporary file and renames it into place, so processes
that compile at once never read half an entry.

Needs a GPU (the code is bound to the current device). The signatures are those the PTX
tests compile (``tests/test_ptx.py``); one that differed from a launch's would compile code no
launch asks for, and that launch would compile again (``benchmarks/gpu_check.sh`` times a
second process to show whether it does).
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import multiprocessing
import os
import sys
import time


def _cases(dtypes):
    from .kernels import cuda_sass
    return cuda_sass.cases(dtypes)


def _compile_one(index: int, dtypes: tuple) -> tuple:
    """Compile case ``index`` of ``_cases(dtypes)``; (name, seconds, error or None)."""
    name = "?"
    try:
        name, kernel, signature, _ = _cases(dtypes)[index]
        t0 = time.perf_counter()
        kernel.compile(signature)
        return name, time.perf_counter() - t0, None
    except Exception as exc:   # reported, never hidden: the caller prints and counts it
        return name, 0.0, f"{type(exc).__name__}: {exc}"


def precompile_cuda(jobs: int, dtypes=("float32", "float64"), out=sys.stdout) -> int:
    """Compile every listed CUDA kernel for the current GPU; returns the number of failures."""
    from . import cuda as nfcuda
    if nfcuda.SIMULATOR:
        raise SystemExit("numbafuse.precompile: nothing to compile under the CUDA simulator")
    if not nfcuda.is_available():
        raise SystemExit("numbafuse.precompile --cuda: no CUDA device")
    n = len(_cases(dtypes))
    t0 = time.perf_counter()
    failures = 0
    ctx = multiprocessing.get_context("spawn")     # a fresh CUDA context per worker
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        done = [pool.submit(_compile_one, i, tuple(dtypes)) for i in range(n)]
        for fut in futures.as_completed(done):
            name, seconds, error = fut.result()
            failures += error is not None
            print(f"  {name:58s} {'FAILED ' + error if error else f'{seconds:6.1f} s'}",
                  file=out, flush=True)
    print(f"numbafuse.precompile: {n} kernels, {failures} failed, "
          f"{time.perf_counter() - t0:.1f} s wall with {jobs} processes", file=out)
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m numbafuse.precompile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", action="store_true", help="compile the CUDA kernels (needs a GPU)")
    p.add_argument("-j", "--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--dtypes", default="float32,float64")
    args = p.parse_args(argv)
    if not args.cuda:
        p.error("say what to compile: --cuda")
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    return 1 if precompile_cuda(args.jobs, dtypes) else 0


if __name__ == "__main__":
    sys.exit(main())
