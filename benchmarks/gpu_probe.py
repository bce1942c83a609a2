"""Questions for a lent GPU that the other scripts do not ask; each part isolated, printed.

    python benchmarks/gpu_probe.py [bn] [knobs] [graph] [tiles] [tiles_nhwc] [labels] [groups]

``bn``: where batch norm's forward time goes, per kernel: device time by CUDA events of the
statistics kernel alone, the apply alone and the whole op, and the host time of a call
(calls issued back to back, one synchronization at the end), at the digits shape and at
(32, 64, 32, 32); then per-kernel durations from PyTorch's profiler (CUPTI sees every kernel
of the process, numba's too).

``knobs``: batch norm's kernels at the benchmark's large shapes, per kernel (CUPTI durations
through PyTorch's profiler, the mean of 10 calls), under launch-time settings of
``kernels/cuda/config.py`` side by side: ``reduce_target_blocks`` (the channel reductions'
blocks in all) and ``max_blocks`` (the elementwise passes' grid).

``tiles``: the conv GEMMs' tilings side by side at the benchmark's four conv shapes (NCHW,
float32; ``tiles_nhwc``: the same in NHWC against cuDNN on channels_last tensors): each pass
(forward, dx, dw) alone, its device time from a CUDA-graph replay (median
of CUDA events) under each tiling of ``TILE_VARIANTS``, beside cuDNN's FP32 time for the same
pass (torch.nn.functional.conv2d and torch.nn.grad, TF32 off). The variants compile first, in
parallel processes, into Numba's disk cache.

``labels``: the eager digits training step with the cross-entropy label check (a flag kernel
and a 4-byte read back, which waits for the forward) and without it, alternating.

``groups``: depthwise and grouped Conv-Bias-ReLU (the CPU conv benchmark's ``dw`` and ``g32``
shapes, float32, both layouts) against cuDNN: each result against torch float64 on the GPU
(relative error of y, dx, dw, db), then the forward and forward + backward as median CUDA
events of eager calls (numbafuse's host path included) and of a CUDA-graph replay, beside
PyTorch's eager conv2d + bias + relu and its autograd backward (cuDNN FP32, TF32 off); for
a grouped conv (1 < groups < C) also the path not chosen (the direct stencil or the GEMMs per
group, ``config.direct_group_channels[_nhwc]``) from a graph. ``groups:g32``: only the shapes
whose names hold ``g32``.

``graph``: what CUDA graph capture through cuda.core allows with numbafuse's launches and
pool: a prepared launch captured into a GraphBuilder and replayed; which calls a capture in
``global`` mode refuses (a pool allocation on the legacy stream, numba's to_device); the
replay time of a graph of 60 small launches against launching them one by one.
"""
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_gpu import median_events  # noqa: E402  (the benchmark's event timing)


def _events(cuda, fn, repeats=30):
    """Median ms of ``fn()`` between two device events (bench_gpu's, after its warm-up)."""
    return median_events(fn, repeats, cuda.event, cuda.synchronize)


def _host(cuda, fn, calls=200):
    for _ in range(3):
        fn()
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def bn():
    import numpy as np
    import numbafuse as nf
    from numbafuse import cuda as nfcuda, kernels
    cuda = nfcuda.numba_cuda
    bnk = kernels.batchnorm_kernels("cuda")
    rng = np.random.default_rng(0)
    for shape in ((32, 24, 8, 8), (32, 64, 32, 32), (64, 256, 56, 56)):
        C = shape[1]
        x, z = (nfcuda.to_device(rng.standard_normal(shape).astype(np.float32))
                for _ in range(2))
        g = nfcuda.to_device(rng.uniform(0.5, 1.5, C).astype(np.float32))
        b = nfcuda.to_device(rng.standard_normal(C).astype(np.float32))
        rm = nfcuda.to_device(np.zeros(C, np.float32))
        rv = nfcuda.to_device(np.ones(C, np.float32))
        mean, var, invstd = bnk.stats_update(x, "NCHW", 1e-5, rm, rv, 0.1)
        cases = {
            "stats_update": lambda: bnk.stats_update(x, "NCHW", 1e-5, rm, rv, 0.1),
            "stats (no running)": lambda: bnk.stats(x, "NCHW", 1e-5),
            "apply": lambda: bnk.apply(x, mean, invstd, g, b, z, True, "NCHW", True),
            "op forward": lambda: nf.batchnorm_add_relu(x, z, g, b, running_mean=rm,
                                                        running_var=rv),
        }
        for name, fn in cases.items():
            try:
                ms = _events(cuda, fn)
                issue, total = _host(cuda, fn)
                print(f"bn {shape} {name:20s} events {ms * 1e3:8.1f} us | host issue "
                      f"{issue:7.1f} us/call, with the device {total:7.1f} us/call", flush=True)
            except Exception:
                traceback.print_exc()
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.init()
        shape = (32, 64, 32, 32)
        x, z = (nfcuda.to_device(rng.standard_normal(shape).astype(np.float32))
                for _ in range(2))
        g = nfcuda.to_device(np.ones(64, np.float32))
        b = nfcuda.to_device(np.zeros(64, np.float32))
        for _ in range(3):
            nf.batchnorm_add_relu(x, z, g, b)
        cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                nf.batchnorm_add_relu(x, z, g, b)
            cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                        max_name_column_width=60), flush=True)
    except Exception:
        traceback.print_exc()


def knobs():
    import numpy as np
    import numbafuse as nf
    from numbafuse import cuda as nfcuda
    from numbafuse.kernels.cuda import config
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.init()
    cuda = nfcuda.numba_cuda
    rng = np.random.default_rng(0)
    settings = [dict(reduce_target_blocks=10**9, max_blocks=1024),     # before
                dict(reduce_target_blocks=1024, max_blocks=1024),
                dict(reduce_target_blocks=2048, max_blocks=1024),
                dict(reduce_target_blocks=1024, max_blocks=4096)]
    for shape, layout in (((64, 256, 56, 56), "NCHW"), ((64, 56, 56, 256), "NHWC"),
                          ((256, 2048, 7, 7), "NCHW"), ((32, 64, 32, 32), "NCHW")):
        C = shape[1] if layout == "NCHW" else shape[3]
        x, z, gy = (nfcuda.to_device(rng.standard_normal(shape).astype(np.float32))
                    for _ in range(3))
        g = nfcuda.to_device(rng.uniform(0.5, 1.5, C).astype(np.float32))
        b = nfcuda.to_device(rng.standard_normal(C).astype(np.float32))

        def fwd_bwd():
            y = nf.batchnorm_add_relu(x, z, g, b, layout=layout)
            return nf.batchnorm_add_relu_backward(gy, x, z, g, b, y=y, layout=layout)
        for setting in settings:
            for name, value in setting.items():
                setattr(config, name, value)
            try:
                for _ in range(2):
                    fwd_bwd()
                cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        fwd_bwd()
                    cuda.synchronize()
                times = {}
                for e in prof.key_averages():
                    if e.device_time_total > 0:
                        key = e.key.split("(")[0].split("::")[-1].split("[")[0][:34]
                        times[key] = e.device_time_total / max(e.count, 1)
                print(f"knobs {shape} {layout} {setting}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in sorted(times.items())) +
                    f" | sum {sum(times.values()):.1f} us", flush=True)
            except Exception:
                traceback.print_exc()
    config.reduce_target_blocks, config.max_blocks = 1024, 1024


def graph():
    import numpy as np
    from numbafuse import cuda as nfcuda
    from numbafuse.kernels.cuda import launch as cuda_launch
    from numbafuse.kernels.cuda.launch import launch
    cuda = nfcuda.numba_cuda
    import cuda.core as cc

    @cuda.jit
    def add_one(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1.0

    a = nfcuda.empty(1024, np.float32)
    a.copy_to_device(np.zeros(1024, np.float32))
    launch(add_one, 4, 256, a)                      # prepared, compiled
    cuda.synchronize()
    prepared = next(p for (k, _), p in cuda_launch._PREPARED.items() if k is add_one)
    dev = cc.Device(cuda.get_current_device().id)
    dev.set_current()
    conf = cc.LaunchConfig(grid=4, block=256)

    def values(arr):
        out = []
        for pack, v in zip(prepared.packers, (arr,)):
            pack(v, out)
        return out

    for mode in ("global", "relaxed"):
        try:
            gb = dev.create_graph_builder()
            print(f"graph[{mode}]: builder stream {gb.stream}", flush=True)
            gb.begin_building(mode)
            for _ in range(3):
                cc.launch(gb, conf, prepared.kernel, *values(a))
            gb.end_building()
            g = gb.complete()
            legacy = cc.LEGACY_DEFAULT_STREAM
            g.launch(legacy)
            g.launch(legacy)
            cuda.synchronize()
            print(f"graph[{mode}]: after 1 + 2 x 3 launches a[0] = {a.copy_to_host()[0]} "
                  f"(expect 7 + 6 x first mode)", flush=True)
        except Exception:
            traceback.print_exc()
    pool = nfcuda._the_pool()
    probes = {
        "pool allocate on the legacy stream": lambda gb: pool.resource.allocate(
            4096, stream=pool.stream),
        "pool allocate on the builder": lambda gb: pool.resource.allocate(4096, stream=gb),
        "numba to_device": lambda gb: nfcuda.to_device(np.zeros(16, np.float32)),
        "numba copy_to_host": lambda gb: a.copy_to_host(),
        "numba device_array": lambda gb: cuda.device_array(16, np.float32),
        "prepared launch on legacy": lambda gb: launch(add_one, 4, 256, a),
    }
    for mode in ("global", "relaxed"):
        for name, probe in probes.items():
            gb = dev.create_graph_builder()
            gb.begin_building(mode)
            try:
                probe(gb)
                result = "allowed"
            except Exception as exc:
                result = f"refused: {type(exc).__name__}: {str(exc)[:160]}"
            try:
                gb.end_building()
                gb.complete()
                ended = "capture completed"
            except Exception as exc:
                ended = f"capture failed: {type(exc).__name__}: {str(exc)[:160]}"
            print(f"graph[{mode}] {name}: {result}; {ended}", flush=True)
            try:
                cuda.synchronize()
            except Exception as exc:
                print(f"   synchronize after it: {exc}", flush=True)
    try:   # 60 small launches: one by one against one graph replay
        n = 60
        t0 = time.perf_counter()
        for _ in range(20):
            for _ in range(n):
                launch(add_one, 4, 256, a)
        cuda.synchronize()
        eager = (time.perf_counter() - t0) / 20 * 1e6
        gb = dev.create_graph_builder()
        gb.begin_building("global")
        for _ in range(n):
            cc.launch(gb, conf, prepared.kernel, *values(a))
        gb.end_building()
        g = gb.complete()
        g.upload(cc.LEGACY_DEFAULT_STREAM)
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            g.launch(cc.LEGACY_DEFAULT_STREAM)
        cuda.synchronize()
        replay = (time.perf_counter() - t0) / 20 * 1e6
        print(f"graph: {n} launches one by one {eager:.1f} us, one replay {replay:.1f} us",
              flush=True)
    except Exception:
        traceback.print_exc()


def _tile_variants():
    from numbafuse.kernels.cuda.config import Tile
    wide, narrow = Tile(128, 128, 8, 8, 8, 4), Tile(128, 64, 8, 8, 4, 4)
    small = Tile(64, 64, 8, 4, 4, 4)
    deep, deep_narrow = Tile(128, 128, 16, 8, 8, 4), Tile(128, 64, 16, 8, 4, 4)
    both = [wide, narrow, small, deep, deep_narrow]
    # dw 128x64x16 at two blocks per SM: 128 registers and a 12-byte spill in NHWC, where it
    # needs 167 alone (production keeps no spill: tests/test_sass.py)
    capped = Tile(128, 64, 16, 8, 4, 4, min_blocks=2)
    return {"fwd": both, "dx": both, "dw": [narrow, wide, small, deep_narrow, capped]}


def _compile_tile(kind, tile, layout):
    from numba.core import types
    from numbafuse.kernels.conv import cuda as conv_cuda
    f = types.float32
    t0 = time.perf_counter()
    conv_cuda.gemm_kernel(kind, layout, tile).compile(
        (f[::1],) * 5 + (types.int32[:, ::1], types.int32[:, ::1]))
    return time.perf_counter() - t0


def label(tile):
    return f"{tile.BM}x{tile.BN}x{tile.BK}" + (f"/b{tile.min_blocks}" if tile.min_blocks
                                                else "")


def tiles(layout="NCHW"):
    import concurrent.futures as futures
    import multiprocessing
    import numpy as np
    import torch
    import torch.nn.functional as F
    from numbafuse import cuda as nfcuda, validate
    from numbafuse.kernels.conv import cuda as conv_cuda
    from numbafuse.kernels.cuda import config
    sys.path.insert(0, HERE)
    from bench_gpu import QUICK
    variants = _tile_variants()
    jobs = [(k, t) for k, ts in variants.items() for t in ts]
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=min(len(jobs), 14), mp_context=ctx) as pool:
        done = {pool.submit(_compile_tile, k, t, layout): (k, t) for k, t in jobs}
        for fut in futures.as_completed(done):
            try:
                fut.result()
            except Exception as exc:
                print(f"tiles: {done[fut]} did not compile: {exc}", flush=True)
    print(f"tiles: {len(jobs)} kernels compiled in {time.perf_counter() - t0:.1f} s",
          flush=True)
    cuda = nfcuda.numba_cuda
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(0)
    for x_shape, w_shape, kw in QUICK["conv"]:
        nhwc = layout == "NHWC"
        shape = (x_shape[0], x_shape[2], x_shape[3], x_shape[1]) if nhwc else x_shape
        geom = validate.conv_geometry("probe", shape, w_shape, kw.get("stride", 1),
                                      kw.get("padding", 0), layout=layout)
        xh = rng.standard_normal(x_shape).astype(np.float32)          # NCHW
        wh = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
        bh = rng.standard_normal(w_shape[0]).astype(np.float32)
        y_nchw = (geom.N, geom.K, geom.P, geom.Q)
        gyh = rng.standard_normal(y_nchw).astype(np.float32)

        def ours(a):          # numbafuse's array: NHWC in that layout
            return np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if nhwc else a
        x, w, b, gy = (nfcuda.to_device(a) for a in (ours(xh), wh, bh, ours(gyh)))
        y = conv_cuda.conv_forward(x, w, b, geom, True)
        passes = {"fwd": lambda: conv_cuda.conv_forward(x, w, b, geom, True),
                  "dx": lambda: conv_cuda.conv_backward(gy, x, w, geom, y, (1, 0, 0)),
                  "dw": lambda: conv_cuda.conv_backward(gy, x, w, geom, y, (0, 1, 0))}
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        tx, tw, tgy = (torch.from_numpy(a).cuda().contiguous(memory_format=fmt)
                       for a in (xh, wh, gyh))
        st, pd = kw.get("stride", 1), kw.get("padding", 0)
        ref = {"fwd": lambda: F.conv2d(tx, tw, stride=st, padding=pd),
               "dx": lambda: torch.nn.grad.conv2d_input(tx.shape, tw, tgy, stride=st,
                                                        padding=pd),
               "dw": lambda: torch.nn.grad.conv2d_weight(tx, tw.shape, tgy, stride=st,
                                                         padding=pd)}
        flops = 2.0 * np.prod(geom.y_shape) * np.prod(w_shape[1:])
        for kind, fn in passes.items():
            try:
                for _ in range(3):
                    ref[kind]()
                torch.cuda.synchronize()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                times = []
                for _ in range(20):
                    ev[0].record()
                    ref[kind]()
                    ev[1].record()
                    torch.cuda.synchronize()
                    times.append(ev[0].elapsed_time(ev[1]))
                cudnn = sorted(times)[len(times) // 2]
                row = []
                for tile in variants[kind]:
                    config.tile_override = tile
                    try:
                        with nfcuda.graph(fn, warmup=1) as g:
                            ms = _events(cuda, g.replay, 20)
                        row.append(f"{label(tile)} {ms * 1e3:7.1f} us ({cudnn / ms:4.2f}x)")
                    except Exception as exc:
                        row.append(f"{label(tile)} failed: {exc}")
                    finally:
                        config.tile_override = None
                cols = {"fwd": geom.K, "dx": geom.C, "dw": None}[kind]
                chosen = config.conv_tile(kind, np.float32, cols, layout)
                print(f"tiles {layout} {x_shape} {w_shape} {kw} {kind}: cuDNN FP32 "
                      f"{cudnn * 1e3:.1f} us ({flops / cudnn / 1e9:.1f} TFLOP/s) | "
                      + " | ".join(row) + f" | production: {label(chosen)}", flush=True)
            except Exception:
                traceback.print_exc()


def labels(rounds=5, steps=20):
    """What the cross-entropy label check costs an eager training step: the digits step
    (fused, bench_gpu's model and batch) timed as bench_gpu times it (20 steps, one
    synchronization at the end), alternating, best of ``rounds``, with the labels

    - on the device: a flag kernel and a 4-byte read (a wait for the forward's kernels);
    - on the host (as ``numbafuse.train.fit`` passes them): checked there, uploaded without
      a wait (what bench_gpu's eager steps now time);
    - on the device with ``count_bad_labels`` replaced by ``0`` (no check at all)."""
    import numpy as np
    from numbafuse import cuda as nfcuda, models, optim
    from numbafuse.kernels.basic import cuda as basic_cuda
    from numbafuse.train import train_step
    from bench_gpu import DIGITS
    cuda = nfcuda.numba_cuda
    rng = np.random.default_rng(0)
    model = models.make_model("fused").to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    xb = nfcuda.to_device(rng.standard_normal((DIGITS["batch"], 8, 8, 1)).astype(np.float32))
    yb_host = rng.integers(0, 10, DIGITS["batch"])
    yb = nfcuda.to_device(yb_host)
    real = basic_cuda.count_bad_labels
    variants = (("device labels, checked", real, yb), ("host labels", real, yb_host),
                ("device labels, no check", lambda labels, L: 0, yb))
    best = {name: [] for name, _, _ in variants}
    try:
        for _ in range(rounds):
            for name, check, y in variants:
                basic_cuda.count_bad_labels = check
                best[name].append(_host(cuda, lambda: train_step(model, opt, xb, y),
                                        steps)[1])
    finally:
        basic_cuda.count_bad_labels = real
    for name, times in best.items():
        print(f"labels: digits step (fused) {name}: best {min(times):.1f} us of "
              f"{', '.join(f'{t:.0f}' for t in times)}", flush=True)


def _names(word):
    """``gpu_probe.py groups:g32``: the conv benchmark's shapes whose names hold ``word``."""
    from bench_conv_bias_relu import SHAPES
    return [n for n in SHAPES if word in n]


def groups(names=None, repeats=20):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import numbafuse as nf
    from numbafuse import cuda as nfcuda
    from bench_conv_bias_relu import SHAPES
    cuda = nfcuda.numba_cuda
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng(0)
    names = names or [n for n in SHAPES if len(SHAPES[n]) > 4]
    for name in names:
        x_shape, w_shape, stride, pad, groups = SHAPES[name]
        xh = rng.standard_normal(x_shape)
        wh = rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))
        bh = rng.standard_normal(w_shape[0]) * 0.1
        # float64 oracle on the GPU (cuDNN float64 or torch's own kernels)
        tx, tw, tb = (torch.tensor(a, device="cuda", requires_grad=True) for a in (xh, wh, bh))
        ty = F.relu(F.conv2d(tx, tw, tb, stride=stride, padding=pad, groups=groups))
        gyh = rng.standard_normal(tuple(ty.shape))
        ty.backward(torch.tensor(gyh, device="cuda"))
        oracle = [t.detach().cpu().numpy() for t in (ty, tx.grad, tw.grad, tb.grad)]
        flops = 2.0 * np.prod(ty.shape) * np.prod(w_shape[1:])
        bytes_fwd = 4.0 * (np.prod(x_shape) + np.prod(ty.shape))
        for layout in ("NCHW", "NHWC"):
            try:
                nhwc = layout == "NHWC"
                to = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) if nhwc \
                    else (lambda a: a)
                back = (lambda a: a.transpose(0, 3, 1, 2)) if nhwc else (lambda a: a)
                f32 = lambda a: nfcuda.to_device(np.ascontiguousarray(a, np.float32))  # noqa
                x, w, b, gy = f32(to(xh)), f32(wh), f32(bh), f32(to(gyh))
                kw = dict(stride=stride, padding=pad, groups=groups, layout=layout)
                y = nf.conv_bias_relu(x, w, b, **kw)
                g = nf.conv_bias_relu_backward(gy, x, w, y, **kw)
                got = [back(y.copy_to_host()), back(g[0].copy_to_host()),
                       g[1].copy_to_host(), g[2].copy_to_host()]
                errs = [float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))
                        for a, e in zip(got, oracle)]

                def fwd():
                    return nf.conv_bias_relu(x, w, b, **kw)

                def fwd_bwd():
                    yy = nf.conv_bias_relu(x, w, b, **kw)
                    return nf.conv_bias_relu_backward(gy, x, w, yy, **kw)
                eager = [_events(cuda, f, repeats) for f in (fwd, fwd_bwd)]
                replay = []
                for f in (fwd, fwd_bwd):
                    with nfcuda.graph(f, warmup=1) as gr:
                        replay.append(_events(cuda, gr.replay, repeats))
                other = ""
                if 1 < groups < x_shape[1]:      # the path not chosen, beside the production
                    # choice (config.direct_group_channels[_nhwc]): the GEMMs per group where
                    # the direct stencil runs, the direct stencil where the GEMMs run
                    from numbafuse.kernels.cuda import config
                    from numbafuse.kernels.conv import cuda_grouped
                    direct = cuda_grouped._direct(nf.validate.conv_geometry(
                        "gpu_probe", x.shape, w.shape, stride, pad, 1, layout, groups))
                    keep = config.direct_group_channels, config.direct_group_channels_nhwc
                    config.direct_group_channels = config.direct_group_channels_nhwc = \
                        0 if direct else 1 << 30
                    try:
                        ms = []
                        for f in (fwd, fwd_bwd):
                            with nfcuda.graph(f, warmup=1) as gr:
                                ms.append(_events(cuda, gr.replay, repeats))
                        other = (f" ({'direct' if not direct else 'GEMMs per group'} instead: "
                                 f"graph fwd {ms[0]:.3f}, fwd+bwd {ms[1]:.3f})")
                    finally:
                        config.direct_group_channels, config.direct_group_channels_nhwc = keep
                fmt = torch.channels_last if nhwc else torch.contiguous_format
                px, pw, pb, pgy = (torch.tensor(a, device="cuda", dtype=torch.float32)
                                   .contiguous(memory_format=fmt) if a.ndim == 4 else
                                   torch.tensor(a, device="cuda", dtype=torch.float32)
                                   for a in (xh, wh, bh, gyh))
                for t in (px, pw, pb):
                    t.requires_grad_(True)

                def tfwd():
                    with torch.no_grad():
                        return F.relu(F.conv2d(px, pw, pb, stride=stride, padding=pad,
                                               groups=groups))

                def tfwd_bwd():
                    yy = F.relu(F.conv2d(px, pw, pb, stride=stride, padding=pad,
                                         groups=groups))
                    return torch.autograd.grad(yy, (px, pw, pb), pgy)
                tev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
                theirs = [median_events(f, repeats, tev, torch.cuda.synchronize)
                          for f in (tfwd, tfwd_bwd)]
                print(f"groups {name} {layout} x{x_shape} w{w_shape} s{stride} g{groups}: "
                      f"rel err y dx dw db {' '.join(f'{e:.1e}' for e in errs)} | fwd ms: "
                      f"ours {eager[0]:.3f} (graph {replay[0]:.3f}, "
                      f"{bytes_fwd / replay[0] / 1e6:.0f} GB/s, "
                      f"{flops / replay[0] / 1e9:.2f} TFLOP/s){other} cuDNN {theirs[0]:.3f} "
                      f"-> {theirs[0] / replay[0]:.2f}x | fwd+bwd ms: ours {eager[1]:.3f} "
                      f"(graph {replay[1]:.3f}) cuDNN {theirs[1]:.3f} -> "
                      f"{theirs[1] / replay[1]:.2f}x (eager {theirs[1] / eager[1]:.2f}x)",
                      flush=True)
            except Exception:
                print(f"groups {name} {layout}: failed", flush=True)
                traceback.print_exc()


if __name__ == "__main__":
    parts = sys.argv[1:] or ["bn", "knobs", "graph"]
    for part in parts:
        print(f"#### {part}", flush=True)
        try:
            {"bn": bn, "knobs": knobs, "graph": graph, "tiles": tiles, "labels": labels,
             "tiles_nhwc": lambda: tiles("NHWC"), "groups": groups}[part.split(":")[0]](
                *([_names(part.split(":")[1])] if ":" in part else []))
        except Exception:
            traceback.print_exc()
