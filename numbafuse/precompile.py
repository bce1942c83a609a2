"""Compile numbafuse's kernels ahead of time into Numba's on-disk cache.

    python -m numbafuse.precompile --cpu [-j JOBS] [--dtypes float32,float64]
    python -m numbafuse.precompile --cuda [-j JOBS] [--dtypes float32,float64]

``--cpu``: every CPU path a layer of a common network takes (:data:`CPU_CASES`: each conv
algorithm's forward and backward in both layouts -- 3x3 stride 1 by Winograd and, at small
maps, im2col; the deep layers' k-blocked GEMMs and tapwise forward; 3x3 stride 2; 1x1; the
few-channel stem; Conv-BatchNorm-ReLU; BatchNorm-Add-ReLU; the max pool; depthwise 3x3 and
7x7)
is called once at a small shape per dtype, one case per task, ``JOBS`` processes at a time, so
that the first call of a later process (a training run, each MPI rank, the tests) loads the
compiled code instead of compiling it (seconds per path on one core). A serial pass then runs
every case once more in one process: Numba saves a function's cache index by reading, updating
and rewriting it, so two processes adding different signatures of one shared step at once can
lose one of them, and this pass compiles what was lost.

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
    from .kernels import catalog
    return catalog.cases(dtypes)


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


# (name, op, shape (N, C, H, W) of x, kernel size, stride, K): each conv case runs
# conv_bias_relu's forward and backward; "bn" cases batchnorm_add_relu's; "cbr" cases
# conv_batchnorm_relu's (training, recompute). The shapes pick the algorithm that layers of
# that kind take (kernels/conv/cpu.algorithm): channels >= 32 and multiples of 8, 128 tiles.
CPU_CASES = [
    # 3x3 stride 1: Winograd above 64 channels, the implicit GEMM's forward at 64 and fewer
    # (kernels/conv/cpu_plan.Rules.implicit_s1_max_channels; Winograd's dX and dW)
    ("conv 3x3 s1 (Winograd)", "conv", (8, 72, 8, 8), 3, 1, 72),
    ("conv 3x3 s1 few channels (implicit forward)", "conv", (8, 32, 8, 8), 3, 1, 32),
    ("conv 3x3 s1 small map (im2col forward)", "conv", (2, 32, 4, 4), 3, 1, 32),
    # deep layers (more output channels than pixels: ResNet's 256 and 512 at 2x2 to 8x8): the
    # whole batch's GEMMs in blocks of channels (cols built once, each block's weights
    # reordered by its task); at 2x2 and 4x4 the forward and dX by tap (cpu_tapwise: no products
    # with the padding)
    # (16 output pixels: a dX of fewer runs the blocked im2col, the next case's kernels)
    ("conv 3x3 deep small map (tapwise forward, dX)", "conv", (4, 256, 2, 2), 3, 1, 256),
    ("conv 3x3 deep (k-blocked GEMMs)", "conv", (2, 256, 8, 8), 3, 1, 256),
    # (1024 output pixels: the stride-2 Winograd's forward and dW take no fewer,
    # cpu_plan.Rules.winograd_s2_min_pixels)
    ("conv 3x3 s2", "conv", (16, 32, 16, 16), 3, 2, 32),
    # a 3x3 on 1x1 maps: its center tap's 1x1 (kernels/conv/cpu_first._crop: the tap's copy
    # and dW's spread, the pointwise GEMMs)
    ("conv 3x3 on 1x1 maps (one tap)", "conv", (2, 32, 1, 1), 3, 1, 32),
    ("conv 1x1 s1", "conv", (4, 32, 16, 16), 1, 1, 32),
    # (a small map's dW: the implicit GEMM's, cpu_plan.Rules.pointwise_dw_implicit_pixels)
    ("conv 1x1 s1 small map (implicit dW)", "conv", (4, 32, 8, 8), 1, 1, 32),
    ("conv 1x1 s2", "conv", (4, 32, 8, 8), 1, 2, 64),
    ("conv 3x3 stem (few channels)", "conv", (4, 3, 16, 16), 3, 1, 32),
    ("conv 7x7 s2 stem (implicit forward)", "conv", (2, 3, 16, 16), 7, 2, 64),
    ("conv-batchnorm-relu 3x3", "cbr", (8, 72, 8, 8), 3, 1, 72),
    ("conv-batchnorm-relu 3x3 few channels", "cbr", (8, 32, 8, 8), 3, 1, 32),
    ("batchnorm-add-relu", "bn", (8, 32, 8, 8), 0, 0, 0),
    # the max pool (a fused ResNet's stem pool runs it: numbafuse.torch.pool), 3x3/2 padding 1
    ("max pool 3x3 s2", "pool", (2, 16, 9, 9), 3, 2, 0),
    # depthwise (groups = C, MobileNet / ConvNeXt): the register tiles at 3x3 strides 1 and 2,
    # the sliding tiles at 7x7 (NHWC) and the 7x7 plane tiles (NCHW)
    ("depthwise 3x3 s1", "dw", (4, 32, 8, 8), 3, 1, 32),
    ("depthwise 3x3 s2", "dw", (4, 32, 16, 16), 3, 2, 32),
    ("depthwise 7x7 s1", "dw", (2, 32, 20, 20), 7, 1, 32),
    # grouped (ResNeXt's 3x3s: 8 groups of 4 channels here, merged in pairs; float32 runs
    # cpu_grouped_taps' implicit GEMMs, float64 the ungrouped kernels per group)
    ("grouped 3x3 s1 (8 groups)", "grp", (4, 32, 8, 8), 3, 1, 32),
]


GROUPS = 8                        # the "grp" cases' groups


def cpu_cases(dtypes=("float32", "float64")):
    """Every (name, op, shape, kernel, stride, K, dtype) that ``--cpu`` runs (both layouts
    each: most CPU kernels take the layout as an argument, so one process compiles both)."""
    return [(f"{name} {dtype}", op, shape, kernel, stride, K, dtype)
            for dtype in dtypes for name, op, shape, kernel, stride, K in CPU_CASES]


def run_cpu_case(case, layouts=("NCHW", "NHWC")) -> None:
    """Call the case's op forward and backward once per layout (what compiles its kernels)."""
    import numpy as np

    from .kernels.cpu import first_calls, launch
    first_calls.set_wait(float("inf"))      # compile here, not in the background
    launch.NATIVE_WARM = True               # and the compiled launches' entries (cpu.native)

    from .ops.basic import max_pool2d
    from .ops.batchnorm import batchnorm_add_relu, batchnorm_add_relu_backward
    from .ops.conv import conv_bias_relu, conv_bias_relu_backward
    from .ops.conv_batchnorm import conv_batchnorm_relu, conv_batchnorm_relu_backward
    _, op, (N, C, H, W), kernel, stride, K, dtype = case
    rng = np.random.default_rng(0)
    for layout in layouts:
        shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
        x = rng.standard_normal(shape).astype(dtype)
        if op == "pool":
            from .autograd import Tensor
            t = Tensor(x, requires_grad=True)
            y = max_pool2d(t, kernel, stride, padding=kernel // 2, layout=layout)
            y.backward(np.ones(y.shape, dtype))
            continue
        if op == "bn":
            g, b = np.ones(C, dtype), np.zeros(C, dtype)
            y = batchnorm_add_relu(x, x, g, b, layout=layout)
            batchnorm_add_relu_backward(y, x, x, g, b, layout=layout)
            continue
        groups = C if op == "dw" else GROUPS if op == "grp" else 1
        w = (rng.standard_normal((K, C // groups, kernel, kernel)) / (C * kernel)).astype(dtype)
        kw = dict(stride=stride, padding=kernel // 2, layout=layout, groups=groups)
        if op == "cbr":                  # (with running statistics: their update too)
            g, b = np.ones(K, dtype), np.zeros(K, dtype)
            y = conv_batchnorm_relu(x, w, g, b, running_mean=np.zeros(K, dtype),
                                    running_var=np.ones(K, dtype), **kw)
            conv_batchnorm_relu_backward(y, x, w, g, b, **kw)
            continue
        b = np.zeros(K, dtype)
        y = conv_bias_relu(x, w, b, **kw)
        conv_bias_relu_backward(y, x, w, y, **kw)


def _run_cpu_one(index: int, dtypes: tuple) -> tuple:
    """Run CPU case ``index``; (name, seconds, error or None)."""
    case = cpu_cases(dtypes)[index]
    try:
        t0 = time.perf_counter()
        run_cpu_case(case)
        return case[0], time.perf_counter() - t0, None
    except Exception as exc:   # reported, never hidden: the caller prints and counts it
        return case[0], 0.0, f"{type(exc).__name__}: {exc}"


def _in_processes(task, n, dtypes, jobs, ctx, out) -> int:
    """``task(i, dtypes)`` for i < n in ``jobs`` processes of ``ctx``, each result (name,
    seconds, error or None) printed as it comes; returns the number of failures."""
    failures = 0
    with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        done = [pool.submit(task, i, tuple(dtypes)) for i in range(n)]
        for fut in futures.as_completed(done):
            name, seconds, error = fut.result()
            failures += error is not None
            print(f"  {name:58s} {'FAILED ' + error if error else f'{seconds:6.1f} s'}",
                  file=out, flush=True)
    return failures


def precompile_cpu(jobs: int, dtypes=("float32", "float64"), out=sys.stdout) -> int:
    """Compile the CPU paths of :data:`CPU_CASES` into the cache; returns the failures."""
    n = len(cpu_cases(dtypes))
    t0 = time.perf_counter()
    # spawn: no fork of a process whose thread pools (numbafuse's, OpenBLAS's) are running
    ctx = multiprocessing.get_context("spawn")
    failures = _in_processes(_run_cpu_one, n, dtypes, jobs, ctx, out)
    t1 = time.perf_counter()
    with futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        serial = pool.submit(_run_cpu_serial, tuple(dtypes)).result()
    failures += serial[1]
    print(f"numbafuse.precompile --cpu: {n} cases, {failures} failed, {t1 - t0:.1f} s wall "
          f"with {jobs} processes, then {time.perf_counter() - t1:.1f} s in one process "
          f"(loading, and compiling what the parallel round lost)", file=out)
    return failures


def _run_cpu_serial(dtypes: tuple) -> tuple:
    """Every case once more in this one process: (seconds, failures)."""
    t0, failures = time.perf_counter(), 0
    for i in range(len(cpu_cases(dtypes))):
        failures += _run_cpu_one(i, dtypes)[2] is not None
    return time.perf_counter() - t0, failures


def precompile_cuda(jobs: int, dtypes=("float32", "float64"), out=sys.stdout) -> int:
    """Compile every listed CUDA kernel for the current GPU; returns the number of failures."""
    from . import cuda as nfcuda
    if nfcuda.SIMULATOR:
        raise SystemExit("numbafuse.precompile: nothing to compile under the CUDA simulator")
    if not nfcuda.is_available():
        raise SystemExit("numbafuse.precompile --cuda: no CUDA device")
    n = len(_cases(dtypes))
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")     # a fresh CUDA context per worker
    failures = _in_processes(_compile_one, n, dtypes, jobs, ctx, out)
    print(f"numbafuse.precompile: {n} kernels, {failures} failed, "
          f"{time.perf_counter() - t0:.1f} s wall with {jobs} processes", file=out)
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m numbafuse.precompile",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="compile the CPU kernels' common paths")
    p.add_argument("--cuda", action="store_true", help="compile the CUDA kernels (needs a GPU)")
    p.add_argument("-j", "--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--dtypes", default="float32,float64")
    args = p.parse_args(argv)
    if not (args.cpu or args.cuda):
        p.error("say what to compile: --cpu, --cuda or both")
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    failures = precompile_cpu(args.jobs, dtypes) if args.cpu else 0
    if args.cuda:
        failures += precompile_cuda(args.jobs, dtypes)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
