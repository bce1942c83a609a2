"""First contact: cold first calls (empty Numba cache), compile time per function, warm starts.

    python benchmarks/bench_compile.py [--cases NAME,...] [--quick] [--list]
                                       [--write | --markdown FILE[#SECTION]] [--json FILE]

Every case runs in its own processes (issue 33), each with a fresh, empty ``NUMBA_CACHE_DIR``
(a new temporary directory per case):

* **cold**: a new process, empty cache: import numbafuse, then each pass of the case once, in
  order. A pass's cold time is the time of its first call *in that process*, so a backward is
  the additional time of the first backward after the forward (what the forward compiled is
  not counted again);
* **warm**: a second new process reusing the case's cache directory: the same import and
  calls. Its column is import + the first calls up to and including the pass (a warm process
  should get there without compiling anything);
* **slowest function**: every Numba compilation in the cold process is recorded with
  ``numba.core.event`` (``numba:compile``: the dispatcher's ``py_func.__qualname__``, nested:
  a callee compiled while its caller is typed), each with wall time (``perf_counter``) and
  CPU time (``process_time``, all threads); the *self* time of a function excludes its
  callees' compilations. The slowest function is the one with the most self CPU seconds.

Cases: ``conv_bias_relu`` forward + backward (``conv_bias_relu_backward``) in both layouts,
strides 1 and 2, 1x1 and 3x3 (padding k // 2); ``conv_batchnorm_relu`` and
``batchnorm_add_relu`` forward + backward, both layouts, training mode; ``numbafuse.torch``'s
``ConvBiasReLU2d``, ``ConvBatchNormReLU2d``, ``BatchNormAddReLU2d`` and ``fuse``'s max pool
(3x3/2, padding 1) forward + backward through torch.autograd (only with torch importable;
torch's own import is timed apart and not counted); all at x
``(8, 16, 32, 32)`` float32 (NHWC: ``(8, 32, 32, 16)``), w ``(16, 16, k, k)``. ``train``: the
quick start ``python -m numbafuse.train`` with its defaults (``--no-progress`` added and a
``--report`` JSON read back for its training seconds). ``cuda``: every numba.cuda kernel a
training step of the digits ResNet launches, built to PTX for sm_90 without a GPU, cold and
from the cache; ``cuda-all``: every listed kernel (``PTX_SIGNATURES``) at float32. ``numba
floor``: no numbafuse, a one-line ``@njit(cache=True)`` function (``a.sum()``) called once:
what any Numba library pays in a new process before its own code, cold and warm (the floor
under the targets below).

The targets of issue 33 (this 2-core machine): every op's cold first call <= 3 s, no single
compiled function over 2 s, a cold ``python -m numbafuse.train`` <= 60 s wall, warm import +
first call <= 0.5 s. The table marks each; on a shared machine the CPU seconds are the robust
measure, and the marks are read from them (wall for the train target, which is stated as wall).

    python benchmarks/bench_compile.py --worker CASE      (internal: one process of a case)
"""
import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import _report   # noqa: E402
import _runner   # noqa: E402

DOCS = os.path.join(ROOT, "docs", "benchmarks.md") + "#compile"   # that section of the page
SHAPE = (8, 16, 32, 32)          # N, C, H, W (the table)
K_OUT = 16
CC = (9, 0)

# issue 33's targets, in seconds
TARGET_COLD_CALL = 3.0
TARGET_FUNCTION = 2.0
TARGET_TRAIN_WALL = 60.0
TARGET_WARM = 0.5

QUICK = ("batchnorm_add_relu NCHW", "conv_bias_relu NCHW 1x1 s1")
TRAIN_ARGS = ("--no-progress",)
IMPORTS = ("import numba", "import")     # the steps that make up "import numbafuse"


def _conv_cases():
    return {f"conv_bias_relu {layout} {k}x{k} s{s}": dict(op="conv_bias_relu", layout=layout,
                                                            k=k, stride=s)
            for layout in ("NCHW", "NHWC") for k in (3, 1) for s in (1, 2)}


def _depthwise_cases():
    # groups = C: the depthwise kernels (kernels/conv/cpu_depthwise*), w (C, 1, k, k)
    return {f"conv_bias_relu {layout} dw 3x3 s{s}": dict(op="conv_bias_relu", layout=layout,
                                                           k=3, stride=s, depthwise=True)
            for layout in ("NCHW", "NHWC") for s in (1, 2)}


CASES = {
    **_conv_cases(),
    **_depthwise_cases(),
    **{f"conv_batchnorm_relu {layout} 3x3 s1": dict(op="conv_batchnorm_relu", layout=layout,
                                                    k=3, stride=1)
       for layout in ("NCHW", "NHWC")},
    **{f"batchnorm_add_relu {layout}": dict(op="batchnorm_add_relu", layout=layout)
       for layout in ("NCHW", "NHWC")},
    "torch ConvBiasReLU2d 3x3 s1": dict(op="torch_conv", layout="NCHW", k=3, stride=1),
    "torch BatchNormAddReLU2d": dict(op="torch_bn", layout="NCHW"),
    "torch ConvBatchNormReLU2d 3x3 s1": dict(op="torch_cbr", layout="NCHW", k=3, stride=1),
    "torch MaxPool2d 3x3 s2": dict(op="torch_pool", layout="NCHW", k=3, stride=2),
    "train": dict(op="train"),
    "numba floor": dict(op="floor"),
    "cuda": dict(op="cuda", kernels="step"),
    "cuda-all": dict(op="cuda", kernels="all"),
}


# --------------------------------------------------------------------------- in a worker

class CompileLog:
    """Every ``numba:compile`` event, nested, with wall and CPU seconds (inclusive and self).

    ``step`` is the name of the pass running when a compilation starts."""

    def __init__(self):
        from numba.core import event

        log = self

        class Listener(event.Listener):
            def on_start(self, ev):
                log._start(ev)

            def on_end(self, ev):
                log._end(ev)

        self.records, self.step = [], None
        self._threads = threading.local()     # a stack per thread: the pool's helper threads
        #                                       compile too (numbafuse's _park, lazily)
        self.loads = dict(hits=0, misses=0, wall=0.0, cpu=0.0)   # disk-cache lookups
        self._event = event
        self._listener = Listener()
        event.register("numba:compile", self._listener)
        from numba.core import caching
        self._cache_class, self._load = caching.Cache, caching.Cache.load_overload

        def load_overload(cache, sig, target_context):     # timed: what a warm start costs
            c0, t0 = time.process_time(), time.perf_counter()
            out = log._load(cache, sig, target_context)
            self.loads["wall"] += time.perf_counter() - t0
            self.loads["cpu"] += time.process_time() - c0
            self.loads["hits" if out is not None else "misses"] += 1
            return out
        caching.Cache.load_overload = load_overload

    def close(self):
        self._event.unregister("numba:compile", self._listener)
        self._cache_class.load_overload = self._load

    def _stack(self):
        stack = getattr(self._threads, "stack", None)
        if stack is None:
            stack = self._threads.stack = []
        return stack

    def _start(self, ev):
        fn = ev.data["dispatcher"].py_func
        stack = self._stack()
        stack.append(dict(fn=fn.__qualname__, module=fn.__module__, step=self.step,
                          depth=len(stack), wall=time.perf_counter(),
                          cpu=time.process_time(), child_wall=0.0, child_cpu=0.0))

    def _end(self, ev):
        stack = self._stack()
        if not stack:          # a compilation this thread started before the log existed
            return
        r = stack.pop()
        r["wall"] = time.perf_counter() - r["wall"]
        r["cpu"] = time.process_time() - r["cpu"]
        r["self_wall"] = r["wall"] - r.pop("child_wall")
        r["self_cpu"] = r["cpu"] - r.pop("child_cpu")
        if stack:
            stack[-1]["child_wall"] += r["wall"]
            stack[-1]["child_cpu"] += r["cpu"]
        self.records.append(r)


def _timed(steps, log, name, fn):
    """Run ``fn()`` as the pass ``name``; append its wall and CPU seconds to ``steps``."""
    if log is not None:
        log.step = name
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    steps.append(dict(name=name, wall=time.perf_counter() - t0, cpu=time.process_time() - c0,
                      start=t0))
    return out


def _arrays(spec):
    import numpy as np
    rng = np.random.default_rng(0)
    N, C, H, W = SHAPE
    shape = (N, C, H, W) if spec["layout"] == "NCHW" else (N, H, W, C)
    x = rng.standard_normal(shape).astype(np.float32)
    k = spec.get("k", 1)
    if spec.get("depthwise"):
        return rng, x, (rng.standard_normal((C, 1, k, k)) / k).astype(np.float32)
    w = (rng.standard_normal((K_OUT, C, k, k)) / (C * k * k) ** 0.5).astype(np.float32)
    return rng, x, w


def _numpy_op(spec, steps, log):
    """The passes of a NumPy-style op case: forward, then backward."""
    import numpy as np
    nf = _timed(steps, log, "import", lambda: __import__("numbafuse"))
    rng, x, w = _arrays(spec)
    layout, op = spec["layout"], spec["op"]
    C = SHAPE[1]
    if op == "conv_bias_relu":
        b = rng.standard_normal(w.shape[0]).astype(np.float32)
        geo = dict(stride=spec["stride"], padding=spec["k"] // 2, layout=layout)
        if spec.get("depthwise"):
            geo["groups"] = C
        y = _timed(steps, log, "forward", lambda: nf.conv_bias_relu(x, w, b, **geo))
        dy = rng.standard_normal(y.shape).astype(np.float32)
        _timed(steps, log, "backward", lambda: nf.conv_bias_relu_backward(dy, x, w, y, **geo))
    elif op == "conv_batchnorm_relu":
        g, be = np.ones(K_OUT, np.float32), np.zeros(K_OUT, np.float32)
        rm, rv = np.zeros(K_OUT, np.float32), np.ones(K_OUT, np.float32)
        geo = dict(stride=spec["stride"], padding=spec["k"] // 2, layout=layout)
        y = _timed(steps, log, "forward", lambda: nf.conv_batchnorm_relu(
            x, w, g, be, running_mean=rm, running_var=rv, **geo))
        dy = rng.standard_normal(y.shape).astype(np.float32)
        _timed(steps, log, "backward", lambda: nf.conv_batchnorm_relu_backward(
            dy, x, w, g, be, **geo))
    elif op == "batchnorm_add_relu":
        z = rng.standard_normal(x.shape).astype(np.float32)
        g, be = np.ones(C, np.float32), np.zeros(C, np.float32)
        rm, rv = np.zeros(C, np.float32), np.ones(C, np.float32)
        y = _timed(steps, log, "forward", lambda: nf.batchnorm_add_relu(
            x, z, g, be, running_mean=rm, running_var=rv, layout=layout))
        dy = rng.standard_normal(y.shape).astype(np.float32)
        _timed(steps, log, "backward", lambda: nf.batchnorm_add_relu_backward(
            dy, x, z, g, be, layout=layout, y=y))
    else:
        raise ValueError(op)


def _import_only(spec, steps, log):
    """``import numbafuse`` alone (the tests' case: nothing is compiled)."""
    _timed(steps, log, "import", lambda: __import__("numbafuse"))


def _floor_sum(a):
    return a.sum()


def _floor(spec, steps, log):
    """Numba alone: import numpy and numba (the worker's first step), then the first call of a
    one-line cached function: compiled (cold) or loaded from the cache (warm), either way after
    Numba loads its typing and lowering registries, once per process."""
    import numpy as np
    from numba import njit
    fn = njit(cache=True)(_floor_sum)
    a = np.ones(3)
    _timed(steps, log, "first call", lambda: fn(a))


def _torch_op(spec, steps, log):
    """numbafuse.torch's modules: torch imported first (its time apart), then forward and
    backward through torch.autograd."""
    torch = _timed(steps, log, "import torch (not counted)", lambda: __import__("torch"))
    nft = _timed(steps, log, "import", lambda: __import__("numbafuse.torch").torch)
    torch.manual_seed(0)
    N, C, H, W = SHAPE
    x = torch.randn(N, C, H, W, requires_grad=True)
    if spec["op"] in ("torch_conv", "torch_cbr"):
        module = nft.ConvBiasReLU2d if spec["op"] == "torch_conv" else nft.ConvBatchNormReLU2d
        m = module(C, K_OUT, spec["k"], stride=spec["stride"], padding=spec["k"] // 2)
        y = _timed(steps, log, "forward", lambda: m(x))
    elif spec["op"] == "torch_pool":           # fuse()'s max pool (the ResNet stem's)
        m = nft.fuse(torch.nn.Sequential(torch.nn.MaxPool2d(spec["k"], spec["stride"],
                                                            spec["k"] // 2)))
        y = _timed(steps, log, "forward", lambda: m(x))
    else:
        m = nft.BatchNormAddReLU2d(C)
        z = torch.randn(N, C, H, W, requires_grad=True)
        y = _timed(steps, log, "forward", lambda: m(x, z))
    dy = torch.randn(y.shape)
    _timed(steps, log, "backward", lambda: y.backward(dy))


def _train(spec, steps, log):
    """The quick start, in this process: ``numbafuse.cli.main`` with its defaults."""
    fd, report = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        cli = _timed(steps, log, "import", lambda: __import__("numbafuse.cli").cli)
        rc = _timed(steps, log, "python -m numbafuse.train",
                    lambda: cli.main([*TRAIN_ARGS, "--report", report]))
        if rc:
            raise SystemExit(f"numbafuse.train exited with {rc}")
        with open(report) as f:
            r = json.load(f)
    finally:
        os.remove(report)
    return {k: r.get(k) for k in ("train_seconds", "ms_per_step", "steps", "test_accuracy")}


# CUDA: PTX for sm_90 without a GPU. numba-cuda asks the driver for the device twice while it
# builds a kernel: its compute capability (which PTX to make) and, for the disk cache's index
# key, (CUDA runtime version, compute capability). A stand-in device answers both here, so the
# cache entries written are those a cc 9.0 GPU's process would write and read (PTX for
# sm_90a, as numba makes for a real H100; no cubin: linking needs the driver).

def _offline_device():
    import types
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv import devices
    dev = types.SimpleNamespace(compute_capability=CC)
    devices.get_context = lambda devnum=None: types.SimpleNamespace(device=dev)
    dispatcher.get_current_device = lambda: dev


def _kernel_key(py_func):
    """A kernel's name that the simulator's process and a compiling one agree on."""
    return f"{py_func.__module__}.{py_func.__qualname__}"


def _step_kernel_names():
    """``module.qualname`` of every kernel one training step of the digits ResNet launches (batch
    2, the default model, float32), found by running the step under the CUDA simulator and
    observing its launches (``cuda.launch.observe``). Run in its own process (the simulator is
    chosen when numba is imported)."""
    import numpy as np
    from numbafuse import backend, models, optim, train
    from numbafuse.kernels.cuda import launch as cuda_launch
    seen = set()

    def record(kernel, args):
        seen.add(_kernel_key(getattr(kernel, "fn", None) or kernel.py_func))
    stop = cuda_launch.observe(record)
    model = models.make_model("fused")
    model.to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(0)
    shape = (2, 8, 8, 1) if models.DEFAULTS["layout"] == "NHWC" else (2, 1, 8, 8)
    xb = rng.uniform(0, 1, shape).astype(np.float32)
    yb = rng.integers(0, 10, 2).astype(np.int64)
    train.train_step(model, opt, backend.to_device(xb), backend.to_device(yb))
    stop()
    return sorted(seen)


def _cuda(spec, steps, log):
    """Build each kernel of the set to sm_90 PTX, loading it from the disk cache when there."""
    from numba.core import sigutils
    catalog = _timed(steps, log, "import", lambda: _import_catalog())
    wanted = spec.get("names")
    owner = {id(k): m.__name__.removeprefix("numbafuse.kernels.")
             for m in catalog.kernel_modules() for k, _ in m.PTX_SIGNATURES}
    cases, seen = [], set()
    for name, kernel, signature, gemm in catalog.cases(("float32",)):
        if wanted is None or _kernel_key(kernel.py_func) in wanted:
            name = f"{owner[id(kernel)]}.{name.split('.', 1)[1]}"
            while name in seen:                   # a kernel listed with two signatures
                name += "'"
            seen.add(name)
            cases.append((name, kernel, signature, gemm))
    _offline_device()
    from numba.cuda import dispatcher
    kernels = []

    def build_all():
        for name, kernel, signature, _ in cases:
            c0, t0 = time.process_time(), time.perf_counter()
            built = kernel._cache.load_overload(signature, kernel.targetctx)
            hit = built is not None
            if built is None:
                argtypes, _ = sigutils.normalize_signature(signature)
                built = dispatcher._Kernel(kernel.py_func, argtypes, **kernel.targetoptions)
                kernel._cache.save_overload(signature, built)
            ptx = built._codelibrary.get_asm_str(cc=(*CC, "a"))
            if ".target sm_90" not in ptx:
                raise RuntimeError(f"{name}: no sm_90 PTX")
            kernels.append(dict(name=name, cache_hit=hit, wall=time.perf_counter() - t0,
                                cpu=time.process_time() - c0))
    _timed(steps, log, f"build {len(cases)} kernels", build_all)
    return dict(kernels=kernels, missing=sorted(set(wanted or ()) - {
        _kernel_key(c[1].py_func) for c in cases}))


def _import_catalog():
    from numbafuse.kernels import catalog
    return catalog


def worker(case, spec):
    """One process of a case: prints {steps, compiles, extra} as JSON on its last line."""
    if spec["op"] == "cuda-names":
        print(json.dumps(dict(names=_step_kernel_names())))
        return
    steps, log = [], None
    if spec["op"] != "cuda":
        log = _timed(steps, None, "import numba", CompileLog)
    run = {"train": _train, "cuda": _cuda, "torch_conv": _torch_op, "torch_bn": _torch_op,
           "torch_cbr": _torch_op, "torch_pool": _torch_op,
           "import": _import_only, "floor": _floor}.get(spec["op"], _numpy_op)
    extra = run(spec, steps, log)
    if spec.get("first_calls"):     # every background compilation done: how long after the
        from numbafuse.kernels.cpu import first_calls       # first pass (the train: import)
        first_calls.join()
        t0 = next((s["start"] for s in steps if s["name"] == "forward"),
                  next(s["start"] for s in steps if s["name"] == "import"))
        extra = dict(extra or {}, compiled_after=time.perf_counter() - t0,
                     first_calls=first_calls.stats())
    records = log.records if log else []
    loads = log.loads if log else {}
    print(json.dumps(dict(case=case, steps=steps, compiles=records, loads=loads,
                          extra=extra or {})))


# --------------------------------------------------------------------------- in the parent

def _run_process(case, spec, cache_dir, env_extra=None, timeout=1800):
    """Run one worker process; (its JSON result, wall seconds, CPU seconds of the process)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.update(env_extra or {})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", case,
                          json.dumps(spec)], capture_output=True, text=True, env=env,
                         timeout=timeout, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if out.returncode != 0:
        raise RuntimeError(f"{case} worker failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), wall, cpu


def skip_reason(spec):
    """Why a case cannot run here (None: it can)."""
    import importlib.util
    if spec["op"].startswith("torch") and importlib.util.find_spec("torch") is None:
        return "torch is not importable"
    if spec["op"] == "cuda":
        if importlib.util.find_spec("numba_cuda") is None:
            return "numba-cuda is not installed"
        sys.path.insert(0, ROOT)
        from numbafuse.testing import cuda_sass   # (imports no kernel module)
        # NVVM (libnvvm) comes with the nvidia-cuda-nvcc wheel; ptxas with it too
        if cuda_sass.tool("ptxas") is None:
            return "NVIDIA's nvidia-cuda-nvcc wheel (NVVM) is not installed"
    return None


def measure(case, spec, log=print):
    """{cold, warm, cold_wall, cold_cpu, warm_wall, warm_cpu} of one case, each in a new
    process, with a cache directory of its own (removed afterwards)."""
    cache = tempfile.mkdtemp(prefix="bench_compile-")
    try:
        if spec["op"] == "cuda" and spec["kernels"] == "step" and "names" not in spec:
            t0 = time.perf_counter()
            names, _, _ = _run_process(case, dict(op="cuda-names"), cache,
                                       dict(NUMBA_ENABLE_CUDASIM="1"))
            spec = dict(spec, names=names["names"])
            log(f"{case}: {len(spec['names'])} kernels launched by a training step under the "
                f"simulator ({time.perf_counter() - t0:.0f} s)")
            shutil.rmtree(cache)
            os.mkdir(cache)
        wait = {"NUMBAFUSE_FIRST_CALL_WAIT": "inf"}       # compiled on the calling thread
        cold, cold_wall, cold_cpu = _run_process(case, spec, cache, wait)
        log(f"{case}: cold process {cold_wall:.1f} s wall, {cold_cpu:.1f} s CPU")
        warm, warm_wall, warm_cpu = _run_process(case, spec, cache, wait)
        log(f"{case}: warm process {warm_wall:.1f} s wall, {warm_cpu:.1f} s CPU")
        first = None
        if spec["op"] not in ("cuda", "floor", "import"):       # the default: first calls
            shutil.rmtree(cache)
            os.mkdir(cache)
            first, first_wall, first_cpu = _run_process(
                case, dict(spec, first_calls=True), cache,
                {"NUMBAFUSE_FIRST_CALL_WAIT": os.environ.get("NUMBAFUSE_FIRST_CALL_WAIT", "5")})
            first.update(wall=first_wall, cpu=first_cpu)
            log(f"{case}: cold process, first calls: {first_wall:.1f} s wall, all compiled "
                f"{first['extra']['compiled_after']:.1f} s after the first pass began")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return dict(spec=spec, cold=cold, warm=warm, cold_wall=cold_wall, cold_cpu=cold_cpu,
                warm_wall=warm_wall, warm_cpu=warm_cpu, first=first)


def _slowest(records, step=None):
    rs = [r for r in records if step is None or r["step"] == step]
    return max(rs, key=lambda r: r["self_cpu"]) if rs else None


def _ok(value, target):
    return "yes" if value <= target else "**no**"


def _fn(r):
    return (f"`{r['module'].removeprefix('numbafuse.')}.{r['fn']}` {r['self_cpu']:.2f} "
            f"({r['cpu']:.2f} incl.)") if r else "-"


def op_rows(results):
    """The table of the op cases: one row per pass."""
    head = ["case", "pass", "cold first call: CPU s", "wall s", "functions compiled",
            "slowest function: self CPU s (incl.)", "warm import + calls: CPU s", "wall s",
            "cold <= 3 s", "function <= 2 s", "warm <= 0.5 s"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---|---:|---:|---|---|---|"]
    for case, res in results.items():
        cold = {s["name"]: s for s in res["cold"]["steps"]}
        if "forward" not in cold:
            continue
        warm_steps = res["warm"]["steps"]
        for name in ("forward", "backward"):
            c = cold[name]
            recs = [r for r in res["cold"]["compiles"] if r["step"] == name]
            slow = _slowest(recs)
            upto = []
            for s in warm_steps:                  # warm: import + calls up to this pass
                if s["name"] in IMPORTS or s["name"] in ("forward", "backward"):
                    upto.append(s)
                if s["name"] == name:
                    break
            w_cpu, w_wall = sum(s["cpu"] for s in upto), sum(s["wall"] for s in upto)
            lines.append(
                f"| {case} | {name} | {c['cpu']:.2f} | {c['wall']:.2f} | {len(recs)} | "
                f"{_fn(slow)} | {w_cpu:.2f} | {w_wall:.2f} | {_ok(c['cpu'], TARGET_COLD_CALL)}"
                f" | {_ok(slow['self_cpu'] if slow else 0.0, TARGET_FUNCTION)} | "
                f"{_ok(w_cpu, TARGET_WARM)} |")
    return lines


def first_call_rows(results):
    """The table of the same passes as users get them (first calls on, the default): each
    pass's cold first call, and when every background compilation was done."""
    head = ["case", "pass", "cold first call: wall s", "CPU s (this process)",
            "keys handed over / calls by NumPy", "all compiled after: wall s", "cold <= 3 s"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---|---:|---|"]
    for case, res in results.items():
        first = res.get("first")
        if not first or not any(s["name"] == "forward" for s in first["steps"]):
            continue
        st = first["extra"]["first_calls"]
        for s in first["steps"]:
            if s["name"] in ("forward", "backward"):
                after = (f"{first['extra']['compiled_after']:.1f}" if st["background"]
                         else "- (none)")
                lines.append(
                    f"| {case} | {s['name']} | {s['wall']:.2f} | {s['cpu']:.2f} | "
                    f"{st['background']} / {st['fallback']} | {after} | "
                    f"{_ok(s['wall'], TARGET_COLD_CALL)} |")
    return lines


def target_summary(results):
    """How many passes meet each target, and every function over the 2 s target (its most
    self CPU seconds in any case)."""
    passes = [(c, s) for c, res in results.items() for s in res["cold"]["steps"]
              if s["name"] in ("forward", "backward")]
    if not passes:
        return []
    rows = op_rows(results)[2:]
    n = len(rows)
    met = [sum(r.split(" | ")[i].strip(" |") == "yes" for r in rows) for i in (-3, -2, -1)]
    # the warm column's wall seconds (the CPU seconds also count other threads' time: the
    # BLAS pools' start at import, the pool's helpers parking after a launch)
    warm_wall = sum(float(r.split(" | ")[7]) <= TARGET_WARM for r in rows)
    worst = max(passes, key=lambda p: p[1]["cpu"])
    over = {}
    for res in results.values():
        for r in res["cold"]["compiles"]:
            key = f"{r['module'].removeprefix('numbafuse.')}.{r['fn']}"
            over[key] = max(over.get(key, 0.0), r["self_cpu"])
    over = sorted(((k, v) for k, v in over.items() if v > TARGET_FUNCTION), key=lambda kv: -kv[1])
    return [f"Targets met (CPU seconds): cold first call <= {TARGET_COLD_CALL:g} s in {met[0]} of "
            f"{n} passes (the longest: {worst[0]} {worst[1]['name']}, {worst[1]['cpu']:.1f} s); "
            f"no function over {TARGET_FUNCTION:g} s in {met[1]} of {n}; warm import + first "
            f"calls <= {TARGET_WARM:g} s in {met[2]} of {n} (by wall seconds: {warm_wall} of "
            f"{n}). Functions over "
            f"{TARGET_FUNCTION:g} s of self CPU (the most in any case): "
            + (", ".join(f"`{k}` {v:.1f} s" for k, v in over) or "none") + ".", ""]


def _loads(run):
    ld = run.get("loads") or {}
    if not ld:
        return "-"
    return f"{ld['hits']} functions in {ld['cpu']:.2f} s CPU ({ld['wall']:.2f} s wall)"


def process_rows(results):
    """Per case: the whole cold and warm processes (interpreter start included), the import,
    and what the warm process still compiled (a function without ``cache=True``)."""
    head = ["case", "cold process: CPU s", "wall s", "import numbafuse (cold): CPU s",
            "compiled (cold): functions", "CPU s (self, sum)", "warm process: CPU s",
            "wall s", "import numbafuse (warm): CPU s", "loaded from the cache (warm)",
            "compiled in the warm process"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * 8 + "---|---|"]
    for case, res in results.items():
        if res["spec"]["op"] in ("cuda", "floor"):
            continue
        cold_imp = sum(s["cpu"] for s in res["cold"]["steps"] if s["name"] in IMPORTS)
        warm_imp = sum(s["cpu"] for s in res["warm"]["steps"] if s["name"] in IMPORTS)
        recs, wrecs = res["cold"]["compiles"], res["warm"]["compiles"]
        again = ", ".join(f"`{r['fn']}` ({r['step']}, {r['cpu']:.2f} s)"
                          for r in wrecs if r["depth"] == 0) or "none"
        lines.append(
            f"| {case} | {res['cold_cpu']:.1f} | {res['cold_wall']:.1f} | {cold_imp:.2f}"
            f" | {len(recs)} | {sum(r['self_cpu'] for r in recs):.1f} | {res['warm_cpu']:.1f}"
            f" | {res['warm_wall']:.1f} | {warm_imp:.2f} | {_loads(res['warm'])} | "
            f"{len(wrecs)}: {again} |")
    return lines


def train_lines(res):
    cold, warm = res["cold"], res["warm"]
    recs = cold["compiles"]
    step = next(s for s in cold["steps"] if s["name"] == "python -m numbafuse.train")
    ex = cold["extra"]
    steady = ex["ms_per_step"] * ex["steps"] / 1e3
    slow = _slowest(recs)
    return [
        f"Cold `python -m numbafuse.train {' '.join(TRAIN_ARGS)}` (the quick start's defaults; "
        "empty cache; run as `numbafuse.cli.main([...])` in the worker process, which is what "
        f"the command runs): **{res['cold_wall']:.1f} s wall**, {res['cold_cpu']:.1f} s CPU for "
        f"the whole process (target <= {TARGET_TRAIN_WALL:.0f} s wall: "
        f"{_ok(res['cold_wall'], TARGET_TRAIN_WALL)}); of it the command itself "
        f"{step['wall']:.1f} s wall / {step['cpu']:.1f} s CPU, and Numba compiled "
        f"{len(recs)} functions in {sum(r['self_cpu'] for r in recs):.1f} s CPU "
        f"({sum(r['wall'] for r in recs if r['depth'] == 0):.1f} s wall); its training loop "
        f"reported {ex['train_seconds']:.1f} s ({ex['steps']} steps, median "
        f"{ex['ms_per_step']:.2f} ms/step: ~{steady:.1f} s of steady-state steps; the rest of "
        f"the loop's time is the first steps' compilation), test accuracy "
        f"{ex['test_accuracy']:.4f}. Slowest function: {_fn(slow)}.",
        "",
        f"The same command warm (second process, same cache): {res['warm_wall']:.1f} s wall, "
        f"{res['warm_cpu']:.1f} s CPU, training loop {warm['extra']['train_seconds']:.1f} s, "
        f"{len(warm['compiles'])} functions compiled.", ""] + _train_first_lines(res)


def _train_first_lines(res):
    """The quick start as users get it (first calls on), cold."""
    first = res.get("first")
    if not first:
        return []
    step = next(s for s in first["steps"] if s["name"] == "python -m numbafuse.train")
    imp = sum(s["wall"] for s in first["steps"] if s["name"] in IMPORTS)
    ex = first["extra"]
    return [
        f"The same command cold as users get it (first calls on, the default; a new empty "
        f"cache): **{imp + step['wall']:.1f} s wall** from the start of the import to the "
        f"command's end ({step['cpu']:.1f} s CPU of this process for the command; the "
        f"compiling process's not counted), its training loop {ex['train_seconds']:.1f} s "
        f"(median {ex['ms_per_step']:.2f} ms/step: the first steps' convs by NumPy), test "
        f"accuracy {ex['test_accuracy']:.4f}; every background compilation done "
        f"{ex['compiled_after']:.1f} s after the import began (the command ends without "
        f"waiting for it).", ""]


def floor_lines(res):
    """The Numba floor: what a new process pays before any numbafuse code runs."""
    def step(run, name):
        return next(s for s in run["steps"] if s["name"] == name)
    cold, warm = res["cold"], res["warm"]
    ci, cc = step(cold, "import numba"), step(cold, "first call")
    wi, wc = step(warm, "import numba"), step(warm, "first call")
    return [
        f"**Numba's floor** (`numba floor`: no numbafuse; a one-line `@njit(cache=True)` "
        f"function, `a.sum()`, called once in a new process): importing NumPy and Numba "
        f"{ci['cpu']:.2f} s CPU cold, {wi['cpu']:.2f} warm; the first call {cc['cpu']:.2f} s "
        f"cold (compiled: Numba loads its typing and lowering registries first, once a process) "
        f"and **{wc['cpu']:.2f} s warm** (loaded from the cache, after the same registries). "
        f"Warm import + first call: **{wi['cpu'] + wc['cpu']:.2f} s CPU** "
        f"({wi['wall'] + wc['wall']:.2f} s wall) for any Numba code on this machine, against "
        f"the {TARGET_WARM:g} s target (met: {_ok(wi['cpu'] + wc['cpu'], TARGET_WARM)}); the "
        f"first pass of a cold process spends about {cc['cpu']:.2f} s of its "
        f"{TARGET_COLD_CALL:g} s there before it compiles a function of its own.", ""]


def cuda_lines(results):
    lines = []
    for case, res in results.items():
        spec = res["spec"]
        if spec["op"] != "cuda":
            continue
        cold, warm = res["cold"]["extra"], res["warm"]["extra"]
        kc, kw = cold["kernels"], warm["kernels"]
        what = (f"the {len(kc)} kernel signatures a training step launches (default digits "
                "ResNet, NHWC, float32; the kernels found by running one step at batch 2 under "
                "the CUDA simulator and observing its launches)" if spec["kernels"] == "step"
                else f"all {len(kc)} listed kernel signatures at float32 (`PTX_SIGNATURES`)")
        hits = sum(k["cache_hit"] for k in kw)
        slow = max(kc, key=lambda k: k["cpu"])
        lines += [
            f"**CUDA, {case}**: {what}, each built to PTX for sm_90 with no GPU: cold (empty "
            f"cache) **{sum(k['cpu'] for k in kc):.1f} s CPU** ({sum(k['wall'] for k in kc):.1f}"
            f" s wall; whole process {res['cold_wall']:.1f} s wall); from the cache "
            f"{sum(k['cpu'] for k in kw):.1f} s CPU ({sum(k['wall'] for k in kw):.1f} s wall; "
            f"whole process {res['warm_wall']:.1f} s wall), {hits} of {len(kw)} loaded from it. "
            f"Slowest: `{slow['name']}` {slow['cpu']:.1f} s CPU cold."
            + (f" Launched but not listed in PTX_SIGNATURES: {cold['missing']}."
               if cold.get("missing") else "")
            + (" Compiled again in the second process (not served by the cache): "
               + ", ".join(f"`{k['name']}` {k['cpu']:.1f} s" for k in kw if not k["cache_hit"])
               + "." if hits < len(kw) else ""), ""]
        if spec["kernels"] == "step":
            lines += ["| kernel | cold: CPU s | wall s | cached: CPU s | from the cache |",
                      "|---|---:|---:|---:|---|"]
            for a, b in zip(kc, kw):
                lines.append(f"| `{a['name']}` | {a['cpu']:.2f} | {a['wall']:.2f} | "
                             f"{b['cpu']:.2f} | {'yes' if b['cache_hit'] else '**no**'} |")
            lines.append("")
    return lines


def versions():
    """Python, numba, numpy (and numba-cuda, torch when installed) versions."""
    from importlib import metadata
    out = [f"Python {platform.python_version()}"]
    for pkg in ("numba", "numpy", "numba-cuda", "torch"):
        try:
            out.append(f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def source_state():
    """The commit of the working tree, the last commit of the conv kernels, and the package's
    uncommitted changes (the tree is what the processes import)."""
    def git(*a):
        out = subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, check=False)
        return out.stdout.rstrip() if out.returncode == 0 else "?"
    dirty = [ln for ln in git("status", "--porcelain", "--", "numbafuse").splitlines()
             if len(ln) > 3]
    return (f"numbafuse at {git('log', '-1', '--format=%h')} (numbafuse/kernels/conv last "
            f"changed in {git('log', '-1', '--format=%h', '--', 'numbafuse/kernels/conv')})"
            + (f", with uncommitted changes in {', '.join(ln[3:] for ln in dirty)}"
               if dirty else ""))


def report(results, skipped, command, machine, load, note=""):
    """The Markdown report of measured ``results`` ({case: measure()}) and ``skipped``
    ({case: reason})."""
    lines = [f"Command: `{command}`", "",
             f"Machine: {machine}; {versions()}; load average {load[0]:.2f} at the start, "
             f"{load[1]:.2f} at the end.{note}", "",
             f"Each case in new processes, each case with its own empty `NUMBA_CACHE_DIR`; "
             f"x {SHAPE} float32 (NCHW; NHWC the same values transposed), w ({K_OUT}, "
             f"{SHAPE[1]}, k, k), padding k // 2. *Cold first call*: that pass's first call in a"
             " new process with an empty cache; the backward is the additional time after the "
             "forward in the same process. *Warm*: a second new process on the same cache: "
             "import numbafuse + the first calls up to and including that pass. CPU seconds "
             "(`time.process_time`, all threads) are the robust column on a shared machine: the "
             "target marks read them. *Slowest function*: the most self CPU seconds of one "
             "`numba:compile` event (its callees' compilations excluded; incl.: included).", ""]
    ops = op_rows(results)
    if len(ops) > 2:
        lines += ["Compiled on the calling thread (`NUMBAFUSE_FIRST_CALL_WAIT=inf`: what each "
                  "pass compiles, as before first calls):", ""]
        lines += target_summary(results) + ops + [""]
    firsts = first_call_rows(results)
    if len(firsts) > 2:
        rows = firsts[2:]
        met = sum(r.rstrip(" |").endswith("yes") for r in rows)
        lines += ["As users get them (the default: a pass's first call served by NumPy while a "
                  "second process compiles its kernels, `kernels/cpu/first_calls.py`), a third "
                  "new process per case with an empty cache: the cold first call's wall seconds "
                  "and this process's CPU seconds (the compiling process's not counted: it runs "
                  "beside); *keys handed over*: the case's conv calls whose compiled run went to "
                  "the background thread (their first calls), *calls by NumPy*: those it served "
                  "meanwhile; *all compiled after*: from the first pass's start to "
                  "the end of the last background compilation (`first_calls.join()`). Cold "
                  f"first call <= {TARGET_COLD_CALL:g} s (wall) in {met} of {len(rows)} "
                  "passes.", ""] + firsts + [""]
    if results and any(r["spec"]["op"] not in ("cuda", "floor") for r in results.values()):
        lines += ["Whole processes (interpreter start included; the torch cases' processes "
                  "include torch's import):", ""] + process_rows(results) + [""]
    if "train" in results:
        lines += train_lines(results["train"])
    if "numba floor" in results:
        lines += floor_lines(results["numba floor"])
    lines += cuda_lines(results)
    for case, reason in skipped.items():
        lines.append(f"Skipped: {case}: {reason}.")
    if skipped:
        lines.append("")
    return lines


def select(cases_arg, quick):
    """The case names to run, in CASES order."""
    if quick:
        return list(QUICK)
    if not cases_arg:
        return list(CASES)
    names = []
    for part in cases_arg.split(","):
        part = part.strip()
        hits = [c for c in CASES if c == part] or [c for c in CASES if c.startswith(part)]
        if not hits:
            raise SystemExit(f"bench_compile: no case {part!r}; --list shows them")
        names += [h for h in hits if h not in names]
    return [c for c in CASES if c in names]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", help="comma-separated case names or prefixes "
                   "(e.g. 'conv_bias_relu NCHW,train'); default: all")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--write", action="store_true", help=f"write the table to "
                   f"{os.path.relpath(DOCS, ROOT)}")
    p.add_argument("--note", default="", help="a sentence added after the machine line")
    p.add_argument("--json", metavar="FILE", help="also write the raw results there")
    p.add_argument("--from-json", metavar="FILE", help="no measuring: the report of the raw "
                   "results a --json run wrote (its command, machine and load)")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return
    if args.from_json:
        with open(args.from_json) as f:
            raw = json.load(f)
        lines = report(raw["results"], raw["skipped"], raw["command"], raw["machine"],
                       raw["load"], raw["note"])
        _report.emit(lines, DOCS if args.write else args.markdown)
        return
    results, skipped = {}, {}
    load = [os.getloadavg()[0]]
    state = source_state()
    for case in select(args.cases, args.quick):
        spec = CASES[case]
        reason = skip_reason(spec)
        if reason:
            skipped[case] = reason
            print(f"{case}: skipped ({reason})", file=sys.stderr, flush=True)
            continue
        results[case] = measure(case, spec,
                                log=lambda s: print(s, file=sys.stderr, flush=True))
    load.append(os.getloadavg()[0])
    if source_state() != state:
        state = f"{state} at the start; {source_state()} at the end"
    note = f" Source: {state}." + (f" {args.note}" if args.note else "")
    command, machine = _report.command("bench_compile.py"), _runner._machine()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(results=results, skipped=skipped, command=command, machine=machine,
                           load=load, note=note), f)
    lines = report(results, skipped, command, machine, load, note)
    _report.emit(lines, DOCS if args.write else args.markdown)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.path.insert(0, ROOT)
        worker(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
