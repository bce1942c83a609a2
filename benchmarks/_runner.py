"""Each library in its own process: the shared runner of every benchmark against PyTorch.

A benchmark module (``benchmarks/bench_*.py``) defines ``cases(side, options) -> {name: fn}``
for each side it measures and imports numbafuse or torch only inside it, so this parent process
imports neither and passes no setting of one to the other. :func:`compare` starts one worker
process per side and round, alternating the order of the sides from round to round; a worker
imports its library with the environment the parent was started with (nothing added), builds
its cases, warms each up (compiles, starts thread pools), times ``repeats`` round-robin runs
of every case and prints the best time of each as JSON. A case shorter than
``MIN_TIMED_SECONDS`` is timed over several calls in a row (up to ``MAX_CALLS``, the mean
per call), except in the neighbour mode, whose point is the interleaving. The table keeps the
best of each case over the rounds. numbafuse's warm-up calls wait for its compiled kernels
(``first_calls.set_wait(inf)``): no timed call meets a NumPy first call or a compilation.

``options["threads"]`` (the benchmarks' ``--threads N``), when given, sets each library's thread
count through its own API in its worker (``numbafuse.kernels.cpu.launch.set_num_threads``,
``torch.set_num_threads``): with 1 thread each, the comparison is of single-core speed, which a
loaded shared machine disturbs far less than a 2-thread race (PyTorch's OpenMP threads spin and
wait for each other; a descheduled one stalls the call). Workers report the best wall time and
the best CPU time (``time.process_time``, all threads of the process) of each case.

Sides:

* ``numbafuse``, ``torch``: one library per process (the honest comparison);
* ``numbafuse-after-torch``: torch imported first and one torch conv forward + backward run
  before numbafuse is imported (its OpenMP pool started) - the *import order* mode;
* ``neighbours``: both libraries in one process, their cases interleaved call by call (a
  PyTorch model with numbafuse layers) - the *same-process neighbour* mode; the names come
  back prefixed ``numbafuse:`` and ``torch:``;
* any other name: a probe the benchmark module defines (e.g. ``stream``, the memory-bandwidth
  probe of bench_batchnorm_add_relu.py), run in its own process like the libraries.

    python benchmarks/_runner.py --worker MODULE SIDE REPEATS OPTIONS_JSON   (internal)
"""
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP_CALLS = 2
MIN_TIMED_SECONDS = 0.005     # cases shorter than this are timed over several calls in a row
MAX_CALLS = 50


def usable_cores():
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # not on Linux
        return os.cpu_count() or 1


def _machine():
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {usable_cores()} cores usable ({os.cpu_count()} visible)"


def _library_info(side):
    info = {"python": platform.python_version()}
    if side not in ("numbafuse", "torch", "numbafuse-after-torch", "neighbours"):
        return info                              # a probe of the benchmark's own (NumPy only)
    if side != "numbafuse":
        import torch
        info.update(torch=f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if side != "torch":                          # (after torch: the backend depends on it)
        import numba
        import numpy
        from numbafuse.kernels.cpu import blas as _blas, launch as _launch
        from numbafuse.kernels.cpu import gemm_taps as _taps
        info.update(numbafuse=f"numba {numba.__version__}, numpy {numpy.__version__}, "
                    f"{_launch.num_threads()} threads, private BLAS {_blas.PRIVATE} "
                    f"({getattr(_blas, 'CORENAME', None)} kernels), "
                    f"{'16' if _taps.WIDE else '8'}-float tiles "
                    f"({'AVX-512' if _taps.WIDE else 'no AVX-512'})",
                    backend=_launch.backend())
    return info


def _torch_first():
    import torch
    x = torch.randn(8, 16, 16, 16, requires_grad=True)
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
    torch.nn.functional.conv2d(x, w, padding=1).relu().sum().backward()


def _set_threads(side, n):
    if side != "torch":
        from numbafuse.kernels.cpu import launch as cpu_launch
        cpu_launch.set_num_threads(n)
    if side not in ("numbafuse",):
        import torch
        torch.set_num_threads(n)


def worker(module, side, repeats, options):
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))
    mod = __import__(module)
    if side != "torch":     # warm-up calls wait for the compiled kernels (no NumPy first calls)
        from numbafuse.kernels.cpu import first_calls
        first_calls.set_wait(float("inf"))
    if options.get("threads"):
        _set_threads(side, int(options["threads"]))
    if side == "numbafuse-after-torch":
        _torch_first()
        todo = mod.cases("numbafuse", options)
    elif side == "neighbours":
        nf, th = mod.cases("numbafuse", options), mod.cases("torch", options)
        todo = {}
        for (a, fa), (b, fb) in zip(nf.items(), th.items()):   # interleaved, call by call
            todo["numbafuse:" + a], todo["torch:" + b] = fa, fb
    else:
        todo = mod.cases(side, options)
    calls = {}
    for name, fn in todo.items():
        for _ in range(WARMUP_CALLS):
            fn()
        t0 = time.perf_counter()
        fn()
        # a case shorter than MIN_TIMED_SECONDS is timed over several calls in a row (as
        # timeit does): one call of a sub-millisecond op right after a large one measures
        # the caches and the sleeping helper threads the large one left, not the op
        once = max(time.perf_counter() - t0, 1e-9)
        calls[name] = 1 if side == "neighbours" else max(1, min(MAX_CALLS,
                                                               int(MIN_TIMED_SECONDS / once)))
    best = {name: float("inf") for name in todo}
    best_cpu = dict(best)
    for _ in range(repeats):
        for name, fn in todo.items():
            k = calls[name]
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(k):
                fn()
            t1, c1 = time.perf_counter(), time.process_time()
            best[name] = min(best[name], (t1 - t0) / k)
            best_cpu[name] = min(best_cpu[name], (c1 - c0) / k)
    print(json.dumps({"best": best, "best_cpu": best_cpu, "info": _library_info(side)}))


def compare(module, sides, rounds, repeats, options=None, log=print):
    """{side: {case: best seconds}}, info: each side in its own processes, alternating.
    ``info["cpu"]``: {side: {case: best CPU seconds}}; ``info["rounds"]``: {side: [{case:
    best seconds} of each round]} (:func:`round_ratios`)."""
    options = options or {}
    best = {side: {} for side in sides}
    cpu = {side: {} for side in sides}
    info = {"machine": _machine(), "load": [os.getloadavg()[0]],
            "rounds": {side: [] for side in sides}}
    for r in range(rounds):
        order = sides if r % 2 == 0 else list(reversed(sides))
        for side in order:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--worker", module, side,
                 str(repeats), json.dumps(options)],
                capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"{module} {side} worker failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            info["rounds"][side].append(dict(res["best"]))
            for name, t in res["best"].items():
                best[side][name] = min(best[side].get(name, float("inf")), t)
            for name, t in res["best_cpu"].items():
                cpu[side][name] = min(cpu[side].get(name, float("inf")), t)
            libraries = dict(res["info"])
            if "backend" in libraries:              # where this side's numbafuse calls ran
                info.setdefault("backends", {})[side] = libraries.pop("backend")
            info.setdefault("libraries", {}).update(libraries)
            log(f"round {r + 1}/{rounds} {side}: " + ", ".join(
                f"{k} {v * 1e3:.2f} ms" for k, v in res["best"].items()))
    info["load"].append(os.getloadavg()[0])
    info["cpu"] = cpu
    return best, info


def round_ratios(info, case, side="numbafuse", base="torch"):
    """(lowest, highest) of ``base``'s time over ``side``'s for ``case``, each round's against
    the same round's (:func:`compare`'s ``info["rounds"]``), or None where a round lacks it:
    how far a best-of-each ratio moves with the machine."""
    pairs = list(zip(info["rounds"][side], info["rounds"][base]))
    if not pairs or any(case not in a or case not in b for a, b in pairs):
        return None
    ratios = [b[case] / a[case] for a, b in pairs]
    return min(ratios), max(ratios)


def header(info, command):
    """The lines naming the command, machine, versions and load of a table."""
    libs = info.get("libraries", {})
    return [f"Command: `{command}`", "",
            f"Machine: {info['machine']}; Python {libs.get('python', '?')}; "
            + "; ".join(libs[k] for k in ("numbafuse", "torch") if k in libs)
            + "".join(f"; numbafuse's threads in the {side} processes: {backend}"
                      for side, backend in info.get("backends", {}).items())
            + f"; load average {info['load'][0]:.2f} at the start, {info['load'][1]:.2f} at "
            "the end. Each library in its own process with its own defaults, the processes "
            "alternating round by round; best of each.", ""]


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        sys.exit(__doc__)
