"""GPU benchmark: numbafuse's CUDA path against PyTorch CUDA, each library in its own process.

    PYTHONPATH=. python benchmarks/bench_gpu.py [--rounds 3] [--dtypes float32,float16]
        [--markdown FILE]
    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=. python benchmarks/bench_gpu.py --smoke   # simulator

The driver imports neither library: it runs ``bench_gpu.py --worker numbafuse`` and
``--worker torch`` as separate processes, alternating for ``--rounds`` rounds, keeps the best
(smallest) time of each measurement, and prints the tables (DESIGN.md, "How speed is
measured"). The torch worker gets an environment without numbafuse's and numba's settings
(``NUMBA_*``, ``OMP_WAIT_POLICY``); numbafuse never sees torch.

Tables:

1. **Per call, host overhead** (issue 17): wall time per call at the digits shape x (32, 24,
   8, 8) float32, w (24, 24, 3, 3), synchronized once per ``CALLS`` (200) calls, best of the
   repeats: conv_bias_relu forward, batchnorm_add_relu forward (training, running
   statistics), an empty kernel launch (numba.cuda: one array argument), against PyTorch's
   conv2d + bias + relu, batch_norm + add + relu and a one-element op.
2. **Training step** of the digits ResNet (width 24, 2 blocks, batch 32, SGD with momentum and
   weight decay, gradients cleared at each step): numbafuse fused and unfused (NHWC, the
   model's default) and PyTorch eager (Conv2d, BatchNorm2d, SGD; its default NCHW), ms per
   step over ``STEPS`` steps with one synchronization at the end.
3. **Kernels at the shapes of issue 16**: conv_bias_relu and batchnorm_add_relu forward and
   forward+backward timed with CUDA events (median of repeats), numbafuse against cuDNN (TF32
   off and PyTorch's default) and PyTorch eager, with the copy and matmul ceilings each
   process measures for itself. Each dtype of ``--dtypes`` (default float32,float16) has its
   tables; the float16 rows (marked "fp16") take x, w, b (conv) and x, z (batch norm), their
   outputs and gradients in float16, gamma and beta in float32 (numbafuse's half-precision
   rules, as PyTorch autocast and cuDNN: docs/ops.md, "Half precision"; like the float32 rows
   they pass no running statistics), against cuDNN FP16 and PyTorch eager on float16 tensors.
   Their batch-norm bandwidth counts 2 bytes an element; they run after every float32 row, each
   a measurement of its own, so a half-precision failure is reported and loses nothing else.

``--smoke`` shrinks everything so the script runs under the CUDA simulator (the torch worker
is skipped there: PyTorch has no CUDA device); its times mean nothing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# TREE=/another/checkout: that tree's numbafuse under this script's measurements (a pair of
# commits measured alike on one machine, as in benchmarks/gpu_check.sh's pair section)
ROOT = os.environ.get("TREE", os.path.dirname(HERE))
sys.path.insert(0, HERE)  # for _report
import _report  # noqa: E402

DIGITS = dict(x=(32, 24, 8, 8), w=(24, 24, 3, 3), batch=32)
# the kernel tables' dtypes (--dtypes) and the bytes of an element of each
DTYPES = ("float32", "float16")
ITEMSIZE = dict(float32=4, float16=2)
FULL = dict(conv=[((32, 64, 56, 56), (64, 64, 3, 3), dict(padding=1)),
                  ((32, 64, 32, 32), (64, 64, 3, 3), dict(padding=1)),
                  ((32, 256, 56, 56), (64, 256, 1, 1), dict()),
                  ((32, 128, 56, 56), (128, 128, 3, 3), dict(stride=2, padding=1))],
            bn=[((64, 256, 56, 56), "NCHW"), ((64, 56, 56, 256), "NHWC"),
                ((256, 2048, 7, 7), "NCHW"), ((32, 64, 32, 32), "NCHW")],
            copy_mib=512, matmul=8192, repeats=50, calls=200, call_repeats=10,
            steps=50, digits=DIGITS, model=dict(width=24, blocks=2), dtypes=DTYPES)
SMOKE = dict(conv=[((1, 2, 4, 4), (2, 2, 3, 3), dict(padding=1))],
             bn=[((1, 2, 3, 3), "NCHW"), ((1, 3, 3, 2), "NHWC")], copy_mib=0.01, matmul=0,
             repeats=1, calls=2, call_repeats=1, steps=1,
             digits=dict(x=(2, 3, 4, 4), w=(3, 3, 3, 3), batch=2), model=dict(width=2, blocks=1),
             launch=dict(threads=8, max_blocks=3, reduce_blocks=3, dw_target_blocks=1),
             dtypes=DTYPES)
# --quick: the figures of one short GPU call (benchmarks/gpu_check.sh): fewer repeats and steps
QUICK = dict(FULL, repeats=15, call_repeats=3, steps=20, calls=100)
# --calls: the per-call and training-step figures alone, prepared launches only (a process
# pair in a few seconds, for alternating two trees: gpu_check.sh's pair section)
CALLS = dict(QUICK, conv=[], bn=[], copy_mib=0, matmul=0, numba_launch=False)
WARMUP = 3          # calls before timing (1 with --smoke)


def best_per_call(fn, calls, repeats, synchronize):
    """Best wall seconds per call of ``fn`` over ``repeats`` runs of ``calls`` calls, each run
    synchronized once at its end (after ``WARMUP`` calls)."""
    for _ in range(WARMUP):
        fn()
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def median_events(fn, repeats, new_event, synchronize):
    """Median milliseconds of ``fn()`` between two device events, after a warm-up."""
    for _ in range(WARMUP):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start, stop = new_event(), new_event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


# --------------------------------------------------------------------------- numbafuse worker

class Results(dict):
    """A worker's results, written to ``path`` (JSON) after each measurement, so that a
    failure (or a crash that kills the process) loses only the measurement it happened in.
    ``measure(section, key, fn)`` stores ``fn()`` or the error it raised under ``errors``."""

    def __init__(self, path, **fields):
        super().__init__(calls={}, steps={}, kernels={}, errors={}, **fields)
        self.path = path
        self.save()

    def save(self):
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self, f)
            os.replace(self.path + ".tmp", self.path)

    def measure(self, section, key, fn):
        t0 = time.perf_counter()
        print(f"bench_gpu: {key} ...", file=sys.stderr, flush=True)   # where a hang is
        try:
            value = fn()
            if section is None:
                self[key] = value
            else:
                self[section][key] = value
        except Exception as exc:   # kept in the report, never hidden
            self["errors"][f"{section or ''} {key}".strip()] = f"{type(exc).__name__}: {exc}"[:600]
        print(f"bench_gpu: {key} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
        self.save()


def numbafuse_worker(cfg, path=None):
    sys.path.insert(0, ROOT)
    import numpy as np
    import numbafuse as nf
    from numbafuse import cuda as nfcuda, models, optim
    from numbafuse.train import train_step
    from numbafuse.kernels.cuda import config as cuda_config
    for name, value in cfg.get("launch", {}).items():     # --smoke: simulator-sized launches
        setattr(cuda_config, name, value)
    if "launch" in cfg:
        cuda_config.tile_override = cuda_config.Tile(64, 8, 8, 8, 8, 4)
        if nfcuda.SIMULATOR:     # the linear layer's 16 x 16 thread blocks (as tests/conftest.py)
            from numbafuse.kernels.basic import cuda as basic_cuda
            basic_cuda.TILE = 4
    cuda = nfcuda.numba_cuda
    out = Results(path, device=_numba_device_name(cuda))
    sync = cuda.synchronize
    rng = np.random.default_rng(0)
    dev = nfcuda.to_device

    # per call, at the digits shape
    d = cfg["digits"]
    C = d["x"][1]
    x = dev(rng.standard_normal(d["x"]).astype(np.float32))
    z = dev(rng.standard_normal(d["x"]).astype(np.float32))
    w = dev((rng.standard_normal(d["w"]) / np.sqrt(np.prod(d["w"][1:]))).astype(np.float32))
    b, gamma, beta = (dev(v.astype(np.float32)) for v in (rng.standard_normal(C),
                                                           np.ones(C), np.zeros(C)))
    rm, rv = dev(np.zeros(C, np.float32)), dev(np.ones(C, np.float32))
    one = dev(np.zeros(1, np.float32))

    @cuda.jit
    def empty_kernel(a):
        pass

    from numbafuse.kernels.cuda.launch import launch
    n, reps = cfg["calls"], cfg["call_repeats"]
    xb = dev(rng.standard_normal((d["batch"], 8, 8, 1)).astype(np.float32))
    # labels: on the host for the eager steps, as numbafuse.train.fit passes them
    # (cross_entropy checks them there and uploads them without a wait); on the device for
    # the graphs (a capture cannot copy from the host)
    yb_host = rng.integers(0, 10, d["batch"])
    yb = dev(yb_host)
    # every per-call and training-step figure with numbafuse's prepared launches, and with
    # numba's own launch for comparison (the simulator has numba's alone)
    modes = ("prepared", "numba") if cfg.get("numba_launch", True) else ("prepared",)
    for mode in (modes if not nfcuda.SIMULATOR else ("numba",)):
        cuda_config.launch = mode
        tag = NUMBA_LAUNCH if mode == "numba" and not nfcuda.SIMULATOR else ""
        out.measure("calls", "conv_bias_relu forward" + tag, lambda: best_per_call(
            lambda: nf.conv_bias_relu(x, w, b, padding=1), n, reps, sync))
        out.measure("calls", "batchnorm_add_relu forward (training)" + tag,
                    lambda: best_per_call(lambda: nf.batchnorm_add_relu(
                        x, z, gamma, beta, running_mean=rm, running_var=rv), n, reps, sync))
        out.measure("calls", "an empty kernel launch" + tag, lambda: best_per_call(
            lambda: launch(empty_kernel, 1, 1, one), n, reps, sync))
        if mode == "prepared" or nfcuda.SIMULATOR:     # the same calls replayed from graphs
            for key, fn in (("conv_bias_relu forward", lambda: nf.conv_bias_relu(
                    x, w, b, padding=1)), ("batchnorm_add_relu forward (training)",
                    lambda: nf.batchnorm_add_relu(x, z, gamma, beta, running_mean=rm,
                                                  running_var=rv))):
                def replayed(fn=fn):
                    with nfcuda.graph(fn, warmup=1) as g:
                        return best_per_call(g.replay, n, reps, sync)
                out.measure("calls", key + GRAPH, replayed)
        for kind in ("fused", "unfused"):
            def step_time(kind=kind):
                model = models.make_model(kind, **cfg["model"]).to("cuda")
                opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
                return best_per_call(lambda: train_step(model, opt, xb, yb_host), cfg["steps"],
                                     1, sync)
            out.measure("steps", f"numbafuse {kind}" + tag, step_time)

            def graph_time(kind=kind):      # the same step captured once, replayed
                model = models.make_model(kind, **cfg["model"]).to("cuda")
                opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
                with nfcuda.graph(train_step, model, opt, xb, yb) as step:
                    return best_per_call(step.replay, cfg["steps"], 1, sync)
            if mode == "prepared" or nfcuda.SIMULATOR:
                out.measure("steps", f"numbafuse {kind}, CUDA graph", graph_time)
    cuda_config.launch = "prepared"
    out.measure(None, "memory", nfcuda.memory_stats)

    # kernels at the shapes of issue 16
    def events(fn):
        return median_events(fn, cfg["repeats"], cuda.event, sync)

    def _replays(*fns):
        """Median ms of each function's CUDA-graph replay: its device time without the
        host's (each call's Python runs once, at the capture)."""
        times = ()
        for fn in fns:
            with nfcuda.graph(fn, warmup=1) as g:
                times += (events(g.replay),)
        return times

    def copy_rate():
        n_copy = max(1, int(cfg["copy_mib"] * 2**20 // 4))
        src, dst = dev(np.ones(n_copy, np.float32)), nfcuda.empty(n_copy, np.float32)
        return 2 * src.nbytes / (events(lambda: dst.copy_to_device(src)) * 1e-3) / 1e9
    if cfg["copy_mib"]:
        out.measure(None, "copy_gbs", copy_rate)
    # float16 after every float32 row: each (shape, dtype) a measurement of its own
    for dtype in cfg["dtypes"]:
        for x_shape, w_shape, kw in cfg["conv"]:
            def conv_times(x_shape=x_shape, w_shape=w_shape, kw=kw, dtype=dtype):
                xs = dev(rng.standard_normal(x_shape).astype(dtype))
                ws = dev((rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:])))
                         .astype(dtype))
                bs = dev(rng.standard_normal(w_shape[0]).astype(dtype))
                y = nf.conv_bias_relu(xs, ws, bs, **kw)
                gy = dev(rng.standard_normal(y.shape).astype(dtype))

                def fwd():
                    return nf.conv_bias_relu(xs, ws, bs, **kw)

                def fwd_bwd():
                    return nf.conv_bias_relu_backward(gy, xs, ws, fwd(), **kw)
                return (events(fwd), events(fwd_bwd)) + _replays(fwd, fwd_bwd)
            out.measure("kernels", _conv_key(x_shape, w_shape, kw, dtype), conv_times)
        for shape, layout in cfg["bn"]:
            def bn_times(shape=shape, layout=layout, dtype=dtype):
                Cb = shape[1] if layout == "NCHW" else shape[3]
                xs, zs, gy = (dev(rng.standard_normal(shape).astype(dtype)) for _ in range(3))
                # gamma, beta float32 for a half x too (PyTorch's BatchNorm2d under autocast)
                g1 = dev(rng.uniform(0.5, 1.5, Cb).astype(np.float32))
                b0 = dev(rng.standard_normal(Cb).astype(np.float32))

                def fwd():
                    return nf.batchnorm_add_relu(xs, zs, g1, b0, layout=layout)
                def fwd_bwd():
                    return nf.batchnorm_add_relu_backward(gy, xs, zs, g1, b0, y=fwd(),
                                                          layout=layout)
                return (events(fwd), events(fwd_bwd)) + _replays(fwd, fwd_bwd)
            out.measure("kernels", _bn_key(shape, layout, dtype), bn_times)
    return out


def _numba_device_name(cuda):
    name = getattr(cuda.get_current_device(), "name", b"simulator")
    return name.decode() if isinstance(name, bytes) else str(name)


def _tag(dtype):
    """A result key's and a table row's mark of its dtype: none for float32 (the keys and
    rows as before there were half rows), ", fp16" for float16."""
    return "" if dtype == "float32" else ", fp16"


def _conv_key(x_shape, w_shape, kw, dtype="float32"):
    return (f"conv_bias_relu | x {x_shape}, w {w_shape}" + (f", {kw}" if kw else "")
            + _tag(dtype))


def _bn_key(shape, layout, dtype="float32"):
    return f"batchnorm_add_relu | {shape} {layout}" + _tag(dtype)


# --------------------------------------------------------------------------- torch worker

def torch_worker(cfg, path=None):
    try:
        import torch
    except ImportError:
        return dict(skipped="PyTorch is not installed")
    if not torch.cuda.is_available():
        return dict(skipped="PyTorch has no CUDA device")
    F = torch.nn.functional
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = dict(device="cuda")
    out = Results(path, device=torch.cuda.get_device_name(),
                  versions=f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    sync = torch.cuda.synchronize
    torch.manual_seed(0)

    d = cfg["digits"]
    C = d["x"][1]
    x, z = torch.randn(d["x"], **dev), torch.randn(d["x"], **dev)
    w = torch.randn(d["w"], **dev) / float(torch.tensor(d["w"][1:]).prod()) ** 0.5
    b, gamma, beta = torch.randn(C, **dev), torch.ones(C, **dev), torch.zeros(C, **dev)
    rm, rv = torch.zeros(C, **dev), torch.ones(C, **dev)
    one = torch.zeros(1, **dev)
    n, reps = cfg["calls"], cfg["call_repeats"]
    out.measure("calls", "conv_bias_relu forward", lambda: best_per_call(
        lambda: F.relu(F.conv2d(x, w, b, padding=1)), n, reps, sync))
    out.measure("calls", "batchnorm_add_relu forward (training)", lambda: best_per_call(
        lambda: F.relu(F.batch_norm(x, rm, rv, gamma, beta, training=True) + z), n, reps,
        sync))
    out.measure("calls", "an empty kernel launch", lambda: best_per_call(
        lambda: one.add_(1), n, reps, sync))

    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, h):
            return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h))))) + h)

    width = cfg["model"]["width"]
    model = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
                          *[Block(width) for _ in range(cfg["model"]["blocks"])],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(width, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    xb = torch.randn(d["batch"], 1, 8, 8, **dev)
    yb = torch.randint(0, 10, (d["batch"],), **dev)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    out.measure("steps", "PyTorch eager", lambda: best_per_call(step, cfg["steps"], 1, sync))

    def events(fn):
        return median_events(fn, cfg["repeats"], lambda: torch.cuda.Event(enable_timing=True),
                             sync)
    def copy_rate():
        n_copy = max(1, int(cfg["copy_mib"] * 2**20 // 4))
        src, dst = torch.ones(n_copy, **dev), torch.empty(n_copy, **dev)
        return 2 * src.nbytes / (events(lambda: dst.copy_(src)) * 1e-3) / 1e9
    if cfg["copy_mib"]:
        out.measure(None, "copy_gbs", copy_rate)
    if cfg["matmul"]:
        def matmul_rate():
            a = torch.randn(cfg["matmul"], cfg["matmul"], **dev)
            return 2 * cfg["matmul"] ** 3 / (events(lambda: a @ a) * 1e-3) / 1e9
        out.measure(None, "matmul_gflops", matmul_rate)
    # float16 after every float32 row; the inputs made inside each measurement (a failure
    # there is reported and loses nothing else)
    for dtype in cfg["dtypes"]:
        dt = dict(dev, dtype=getattr(torch, dtype))
        for x_shape, w_shape, kw in cfg["conv"]:
            # float32: cuDNN with TF32 off, then on (PyTorch's default); float16: cuDNN FP16
            for mode in ((FP32, TF32) if dtype == "float32" else (FP16,)):
                def conv_times(mode=mode, kw=kw, x_shape=x_shape, w_shape=w_shape, dt=dt):
                    tx = torch.randn(x_shape, **dt, requires_grad=True)
                    tw = (torch.randn(w_shape, **dt) / float(torch.tensor(w_shape[1:]).prod())
                          ** 0.5).requires_grad_(True)
                    tb = torch.randn(w_shape[0], **dt, requires_grad=True)
                    tgy = torch.randn_like(F.conv2d(tx, tw, tb, **kw))
                    torch.backends.cudnn.allow_tf32 = mode == TF32
                    try:
                        def fwd():
                            return F.relu(F.conv2d(tx, tw, tb, **kw))
                        return events(fwd), events(lambda: fwd().backward(tgy))
                    finally:
                        torch.backends.cudnn.allow_tf32 = False
                out.measure("kernels", _conv_key(x_shape, w_shape, kw, dtype) + mode,
                            conv_times)
        for shape, layout in cfg["bn"]:
            def bn_times(shape=shape, layout=layout, dt=dt):
                fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
                nchw = shape if layout == "NCHW" else (shape[0], shape[3], shape[1], shape[2])
                tx, tz, tgy = (torch.randn(nchw, **dt).contiguous(memory_format=fmt)
                               for _ in range(3))
                tx.requires_grad_(True)
                tz.requires_grad_(True)
                # weight and bias float32 for a half x too (BatchNorm2d's under autocast)
                tg = (torch.rand(nchw[1], **dev) + 0.5).requires_grad_(True)
                tbe = torch.randn(nchw[1], **dev, requires_grad=True)

                def bn_fwd():
                    return F.relu(F.batch_norm(tx, None, None, tg, tbe, training=True) + tz)
                return events(bn_fwd), events(lambda: bn_fwd().backward(tgy))
            out.measure("kernels", _bn_key(shape, layout, dtype) + EAGER, bn_times)
    return out


GRAPH = ", CUDA graph replay"
NUMBA_LAUNCH = " [numba launch]"
FP32 = " | cuDNN FP32 (TF32 off)"
TF32 = " | cuDNN TF32 (PyTorch default)"
FP16 = " | cuDNN FP16"
EAGER = " | PyTorch eager"


# --------------------------------------------------------------------------- the driver

WORKERS = dict(numbafuse=numbafuse_worker, torch=torch_worker)


def _torch_env():
    """The environment without numba's and numbafuse's settings."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("NUMBA_") and k != "OMP_WAIT_POLICY"}


def run_worker(name, mode, timeout=None, dtypes=DTYPES):
    """One worker process's results. A worker that fails or crashes still gives what it
    measured before (its results file), with the failure under ``errors``."""
    import tempfile
    fd, path = tempfile.mkstemp(suffix=f".{name}.json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--results", path]
    cmd += ([f"--{mode}"] if mode != "full" else []) + ["--dtypes", ",".join(dtypes)]
    env = dict(os.environ) if name == "numbafuse" else _torch_env()
    with tempfile.TemporaryFile("w+") as err:
        try:
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                  env=env, check=False, timeout=timeout)
            failure = None if done.returncode == 0 else f"the {name} worker exited " \
                                                        f"{done.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"the {name} worker ran past {timeout} s"
        if failure:
            err.seek(0)
            lines = [ln for ln in err.read().splitlines() if "Warning" not in ln
                     and "warn(" not in ln]
            failure += ": " + "\n".join(lines[-12:])
    try:
        with open(path) as f:
            text = f.read()
        out = json.loads(text) if text.strip() else {}
    finally:
        os.unlink(path)
    if failure:
        out.setdefault("errors", {})["worker"] = failure
        print(f"bench_gpu: {failure}", file=sys.stderr)
    return out


def _best(acc, new):
    """Keep the smallest of each time (tuples elementwise), the largest of each rate."""
    for key, value in new.items():
        if key not in acc or key in ("memory", "errors"):
            acc[key] = value if key != "errors" else {**acc.get(key, {}), **value}
        elif isinstance(value, dict):
            _best(acc[key], value)
        elif isinstance(value, list):
            acc[key] = [min(a, b) for a, b in zip(acc[key], value)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            acc[key] = max(acc[key], value) if key.endswith(("_gbs", "_gflops")) else \
                min(acc[key], value)
    return acc


def conv_flops(x_shape, w_shape, kw):
    """Multiply-adds x 2 of one forward (NCHW x, (K, C, R, S) w): 2 N K P Q C R S."""
    N, C, H, W = x_shape
    K, _, R, S = w_shape
    st, pad = kw.get("stride", 1), kw.get("padding", 0)
    P, Q = (H + 2 * pad - R) // st + 1, (W + 2 * pad - S) // st + 1
    return 2.0 * N * K * P * Q * C * R * S


def _ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"


def tables(nf, pt, command, cfg):
    us = 1e6
    lines = [f"Command: `{command}`", "",
             f"numbafuse device: {nf.get('device', '?')}; PyTorch: " +
             (pt.get("skipped") or f"{pt.get('device', '?')} ({pt.get('versions', '?')})")
             + ".", "",
             f"Per call (wall time, synchronized once per {cfg['calls']} calls, best of "
             f"{cfg['call_repeats']} repeats), at x {cfg['digits']['x']} float32, w "
             f"{cfg['digits']['w']}:", "",
             "| call | numbafuse us | PyTorch us | numbafuse / PyTorch |", "|---|---:|---:|---:|"]
    for key, t in nf.get("calls", {}).items():
        p = pt.get("calls", {}).get(key.replace(NUMBA_LAUNCH, "").replace(GRAPH, ""))
        lines.append(f"| {key} | {t * us:.1f} | " + (f"{p * us:.1f} | {t / p:.2f}x |"
                                                     if p else "n/a | |"))
    eager = pt.get("steps", {}).get("PyTorch eager")
    lines += ["", f"Training step of the digits ResNet ({cfg['model']}, batch "
              f"{cfg['digits']['batch']}, SGD momentum 0.9, weight decay 5e-4), ms per step "
              f"over {cfg['steps']} steps:", "",
              "| implementation | ms/step | / PyTorch eager |", "|---|---:|---:|"]
    for key, t in list(nf.get("steps", {}).items()) + list(pt.get("steps", {}).items()):
        lines.append(f"| {key} | {t * 1e3:.3f} | {_ratio(t, eager)} |")
    copy = nf.get("copy_gbs") or pt.get("copy_gbs")
    lines += ["", f"numbafuse's pool after the run: {nf.get('memory')}", ""]
    if cfg["conv"] or cfg["bn"]:
        lines += _kernel_tables(nf, pt, cfg, copy)
    errors = {**{f"numbafuse: {k}": v for k, v in nf.get("errors", {}).items()},
              **{f"PyTorch: {k}": v for k, v in pt.get("errors", {}).items()}}
    if errors:
        lines += ["", "Failed measurements:", ""] + [f"- {k}: `{v}`" for k, v in errors.items()]
    return lines


def _kernel_tables(nf, pt, cfg, copy):
    lines = ["Copy ceiling (bytes read + written): "
             + ", ".join(f"{who} process {r['copy_gbs']:.0f} GB/s"
                         for who, r in (("numbafuse", nf), ("PyTorch", pt)) if "copy_gbs" in r)
             + (f"; FP32 matmul (TF32 off) {pt['matmul_gflops'] / 1e3:.1f} TFLOP/s"
                if "matmul_gflops" in pt else "") + "."]
    kern, pk = nf.get("kernels", {}), pt.get("kernels", {})
    for dtype in cfg["dtypes"]:
        lines += _conv_tables(kern, pk, cfg["conv"], dtype)
    for dtype in cfg["dtypes"]:
        lines += _bn_table(kern, pk, cfg["bn"], dtype, copy)
    return lines


def _conv_tables(kern, pk, convs, dtype):
    """Conv-Bias-ReLU's two tables (eager, replayed from graphs) at one dtype: numbafuse
    against cuDNN FP32 and TF32 for float32, cuDNN FP16 for float16."""
    half = dtype == "float16"
    ref, name = (FP16, "FP16") if half else (FP32, "FP32")
    what = ("float16 NCHW (CUDA events, median; x, w, b, y and the gradients float16, which "
            "numbafuse converts to float32 at the op boundary and back: docs/ops.md, \"Half "
            "precision\")" if half else "float32 NCHW (CUDA events, median)")
    lines = ["", f"Conv-Bias-ReLU, {what}: time and TFLOP/s "
             "(fwd: 2NKPQCRS; fwd+bwd: 3x that), and cuDNN's time over numbafuse's "
             "(above 1: numbafuse faster):", "",
             "| shape | numbafuse fwd ms | fwd+bwd ms | TFLOP/s fwd / fwd+bwd | "
             f"cuDNN {name} fwd / fwd+bwd ms | vs {name} fwd / fwd+bwd |"
             + ("" if half else " cuDNN TF32 fwd+bwd ms | vs TF32 fwd+bwd |"),
             "|---|---:|---:|---:|---:|---:|" + ("" if half else "---:|---:|")]
    rows = []
    for x_shape, w_shape, kw in convs:
        key = _conv_key(x_shape, w_shape, kw, dtype)
        label = f"x {x_shape}, w {w_shape}{', ' + str(kw) if kw else ''}{_tag(dtype)}"
        rows.append((label, kern.get(key), pk.get(key + ref), pk.get(key + TF32),
                     conv_flops(x_shape, w_shape, kw)))
    for label, f, c, t32, fl in rows:
        cell = (f"{f[0]:.3f} | {f[1]:.3f} | {fl / f[0] / 1e9:.1f} / {3 * fl / f[1] / 1e9:.1f}"
                if f else "failed | | ")
        lines.append(f"| {label} | {cell} | "
                     + (f"{c[0]:.3f} / {c[1]:.3f} | {_ratio(c[0], f and f[0])} / "
                        f"{_ratio(c[1], f and f[1])}" if c else "n/a | ")
                     + (" |" if half else f" | {t32[1]:.3f} | {_ratio(t32[1], f and f[1])} |"
                        if t32 else " | n/a | |"))
    lines += ["", "The same, each call captured in a CUDA graph and replayed (CUDA events, "
              "median): numbafuse's device time without its host time; PyTorch eager as "
              "above:", "", "| shape | numbafuse fwd / fwd+bwd ms (graph) | TFLOP/s fwd+bwd | "
              f"vs cuDNN {name} fwd / fwd+bwd |" + ("" if half else " vs TF32 fwd+bwd |"),
              "|---|---:|---:|---:|" + ("" if half else "---:|")]
    for label, f, c, t32, fl in rows:
        g = f[2:4] if f and len(f) >= 4 else None
        lines.append(f"| {label} | "
                     + (f"{g[0]:.3f} / {g[1]:.3f} | {3 * fl / g[1] / 1e9:.1f} | "
                        if g else "n/a | | ")
                     + (f"{_ratio(c[0], g and g[0])} / {_ratio(c[1], g and g[1])} |"
                        if c else "n/a |")
                     + ("" if half else f" {_ratio(t32[1], g and g[1])} |" if t32
                        else " n/a |"))
    return lines


def _bn_table(kern, pk, bns, dtype, copy):
    """BatchNorm-Add-ReLU's table at one dtype: its bandwidth counts ``dtype``'s bytes."""
    half = dtype == "float16"
    what = "float16 (x, z, y and the gradients; gamma, beta float32)" if half else "float32"
    lines = ["", f"BatchNorm-Add-ReLU, {what}, training (CUDA events, median); bandwidth "
             "counts the fewest bytes (fwd reads x, z and writes y: 3 elements; fwd+bwd adds "
             "reading dy, x, y and writing dx, dz: 8 elements in all"
             + (", 2 bytes each; gamma, beta, C values, left out" if half else "")
             + "), as a share of the copy ceiling:", "",
             "| shape | layout | numbafuse fwd / fwd+bwd ms | PyTorch eager fwd / fwd+bwd ms "
             "| PyTorch / numbafuse fwd / fwd+bwd | numbafuse % of copy fwd / fwd+bwd |",
             "|---|---|---:|---:|---:|---:|"]
    for shape, layout in bns:
        key = _bn_key(shape, layout, dtype)
        f, p = kern.get(key), pk.get(key + EAGER)
        size = ITEMSIZE[dtype]          # bytes of one element of x
        for n in shape:
            size *= n
        share = ""
        if f and copy:
            share = (f"{100 * 3 * size / (f[0] * 1e-3) / 1e9 / copy:.0f}% / "
                     f"{100 * 8 * size / (f[1] * 1e-3) / 1e9 / copy:.0f}%")
        lines.append(f"| {shape} | {layout}{_tag(dtype)} | "
                     + (f"{f[0]:.3f} / {f[1]:.3f}" if f else "failed") + " | "
                     + (f"{p[0]:.3f} / {p[1]:.3f}" if p else "n/a") + " | "
                     + (f"{_ratio(p[0], f[0])} / {_ratio(p[1], f[1])}" if f and p else "")
                     + f" | {share} |")
        if f and len(f) >= 4:           # the same replayed from CUDA graphs: device time
            share = (f"{100 * 3 * size / (f[2] * 1e-3) / 1e9 / copy:.0f}% / "
                     f"{100 * 8 * size / (f[3] * 1e-3) / 1e9 / copy:.0f}%" if copy else "")
            lines.append(f"| {shape} | {layout}{_tag(dtype)}, CUDA graph | "
                         f"{f[2]:.3f} / {f[3]:.3f} | "
                         + (f"{p[0]:.3f} / {p[1]:.3f}" if p else "n/a") + " | "
                         + (f"{_ratio(p[0], f[2])} / {_ratio(p[1], f[3])}" if p else "")
                         + f" | {share} |")
    return lines


def _dtypes(text):
    """``--dtypes``: a comma-separated subset of :data:`DTYPES`, kept in DTYPES' order (float32
    measured first, so a half-precision crash cannot take its rows)."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    if not names or not names <= set(DTYPES):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(DTYPES)}")
    return tuple(d for d in DTYPES if d in names)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes (simulator check)")
    mode.add_argument("--quick", action="store_true", help="fewer repeats (one short GPU call)")
    mode.add_argument("--calls", action="store_true",
                      help="the per-call and training-step figures alone (--quick's repeats)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; "
                   "2 with --quick, 1 with --smoke)")
    p.add_argument("--dtypes", type=_dtypes, default=DTYPES, metavar="D[,D]",
                   help="the kernel tables' dtypes, float32 and/or float16 (default both; "
                   "--calls has no kernel tables)")
    p.add_argument("--worker-timeout", type=float, default=None, metavar="S",
                   help="give up on a worker process after S seconds (its results so far kept)")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--json", metavar="FILE", help="write the raw best-of results here")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = ("smoke" if args.smoke else "quick" if args.quick else "calls" if args.calls
            else "full")
    cfg = dict(dict(smoke=SMOKE, quick=QUICK, calls=CALLS, full=FULL)[mode],
               dtypes=args.dtypes)
    if args.worker:
        global WARMUP
        WARMUP = 1 if args.smoke else WARMUP
        out = WORKERS[args.worker](cfg, args.results)
        if args.results and not isinstance(out, Results):   # skipped: say why
            with open(args.results, "w") as f:
                json.dump(out, f)
        return
    nf, pt = {}, {}
    rounds = args.rounds or dict(smoke=1, quick=2, calls=2, full=3)[mode]
    for _ in range(rounds):
        _best(nf, run_worker("numbafuse", mode, args.worker_timeout, args.dtypes))
        if not pt.get("skipped"):
            _best(pt, run_worker("torch", mode, args.worker_timeout, args.dtypes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(numbafuse=nf, torch=pt), f, indent=1)
    _report.emit(tables(nf, pt, _report.command("bench_gpu.py"), cfg), args.markdown)


if __name__ == "__main__":
    main()
