"""GPU benchmark: the fused CUDA kernels vs PyTorch CUDA (TF32 off) and the measured ceilings.

    PYTHONPATH=. python benchmarks/bench_gpu.py [--markdown FILE]      # on a machine with a GPU
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/bench_gpu.py --smoke       # tiny shapes, simulator

For a session that is lent a GPU (none was while this was written: its figures are still to be
taken). It measures, in one process:

- the two ceilings: device-to-device copy bandwidth (bytes read + written / time) and, when
  PyTorch CUDA is there, an FP32 matrix product's rate with TF32 off;
- Conv-Bias-ReLU at the four shapes of issue 16 (NCHW, float32): numbafuse's fused forward
  and forward+backward (GFLOP/s, fraction of the matmul ceiling) and cuDNN's through
  PyTorch, with TF32 off (``allow_tf32 = False``: the same FP32 arithmetic) and with
  PyTorch's default (TF32 on for cuDNN convolutions);
- BatchNorm-Add-ReLU at the four shapes of issue 16 (three NCHW, one NHWC): fused forward and
  forward+backward, achieved bandwidth (minimum bytes moved / time) against the copy ceiling,
  and PyTorch CUDA eager (F.batch_norm + add + relu, autograd; NHWC as channels_last).

GPU figures for the kernels of issue 16 are pending: no GPU was lent to the session that
wrote them (their static sm_90 analysis is docs/bench_gpu_static.md).

Device work is timed with CUDA events around many repeats after a warm-up (median of the
repeats). ``--smoke`` shrinks every shape so the script itself can be checked under the
simulator; its times mean nothing.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _report
import _report  # noqa: E402
from numba import cuda  # noqa: E402

import numbafuse as nf  # noqa: E402

FULL = dict(conv=[((32, 64, 56, 56), (64, 64, 3, 3), dict(padding=1)),
                  ((32, 64, 32, 32), (64, 64, 3, 3), dict(padding=1)),
                  ((32, 256, 56, 56), (64, 256, 1, 1), dict()),
                  ((32, 128, 56, 56), (128, 128, 3, 3), dict(stride=2, padding=1))],
            bn=[((64, 256, 56, 56), "NCHW"), ((64, 56, 56, 256), "NHWC"),
                ((256, 2048, 7, 7), "NCHW"), ((32, 64, 32, 32), "NCHW")],
            copy_mib=512, matmul=8192, repeats=50)
SMOKE = dict(conv=[((1, 2, 4, 4), (2, 2, 3, 3), dict(padding=1)),
                   ((1, 2, 5, 5), (3, 2, 3, 3), dict(stride=2, padding=1))],
             bn=[((1, 2, 3, 3), "NCHW"), ((1, 3, 3, 2), "NHWC")], copy_mib=0.01, matmul=0,
             repeats=1)
WARMUP = 3


def _time_events(fn, repeats, new_event, synchronize):
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


def time_device(fn, repeats):
    """numbafuse's work, timed with numba.cuda events."""
    return _time_events(fn, repeats, cuda.event, cuda.synchronize)


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def time_torch(torch, fn, repeats):
    """PyTorch's work, timed with its own events (on its current stream)."""
    return _time_events(fn, repeats, lambda: torch.cuda.Event(enable_timing=True),
                        torch.cuda.synchronize)


def copy_ceiling(cfg):
    n = max(1, int(cfg["copy_mib"] * 2**20 // 4))
    src = cuda.to_device(np.ones(n, np.float32))
    dst = cuda.device_array(n, np.float32)
    ms = time_device(lambda: dst.copy_to_device(src), cfg["repeats"])
    return 2 * src.nbytes / (ms * 1e-3) / 1e9          # GB/s, read + write


def matmul_ceiling(torch, cfg):
    n = cfg["matmul"]
    if torch is None or n == 0:
        return None
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    ms = time_torch(torch, lambda: a @ b, max(5, cfg["repeats"] // 5))
    return 2 * n ** 3 / (ms * 1e-3) / 1e9              # GFLOP/s


def bench_conv(torch, cfg, rows, matmul):
    for x_shape, w_shape, kw in cfg["conv"]:
        _bench_conv_one(torch, cfg, rows, matmul, x_shape, w_shape, kw)


def _bench_conv_one(torch, cfg, rows, matmul, x_shape, w_shape, kw):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    dx, dw, db = (cuda.to_device(a) for a in (x, w, b))
    y = nf.conv_bias_relu(dx, dw, db, **kw)
    gy = cuda.to_device(rng.standard_normal(y.shape).astype(np.float32))
    geom_flops = 2 * np.prod(y.shape) * np.prod(w_shape[1:])
    fwd = time_device(lambda: nf.conv_bias_relu(dx, dw, db, **kw), cfg["repeats"])
    both = time_device(lambda: nf.conv_bias_relu_backward(
        gy, dx, dw, nf.conv_bias_relu(dx, dw, db, **kw), **kw), cfg["repeats"])
    rate = 3 * geom_flops / (both * 1e-3) / 1e9
    frate = geom_flops / (fwd * 1e-3) / 1e9
    label = f"x {x_shape}, w {w_shape}" + (f", {kw}" if kw else "")
    rows.append(("conv_bias_relu", label, "numbafuse", fwd, both,
                 f"fwd {frate:.0f}, fwd+bwd {rate:.0f} GFLOP/s"
                 + (f" ({rate / matmul:.0%} of matmul)" if matmul else "")))
    if torch is not None:
        tx, tw, tb = (torch.tensor(a, device="cuda", requires_grad=True) for a in (x, w, b))
        tgy = torch.tensor(gy.copy_to_host(), device="cuda")
        F = torch.nn.functional

        def t_fwd():
            return F.relu(F.conv2d(tx, tw, tb, **kw))

        def t_both():
            t_fwd().backward(tgy)
        for tf32 in (False, True):
            torch.backends.cudnn.allow_tf32 = tf32
            tf, tb_ = time_torch(torch, t_fwd, cfg["repeats"]), time_torch(torch, t_both,
                                                                            cfg["repeats"])
            trate = 3 * geom_flops / (tb_ * 1e-3) / 1e9
            rows.append(("conv_bias_relu", label,
                         "cuDNN " + ("TF32 (PyTorch default)" if tf32 else "FP32 (TF32 off)"),
                         tf, tb_, f"fwd+bwd {trate:.0f} GFLOP/s; numbafuse / this: "
                         f"{tb_ / both:.2f}x"))
        torch.backends.cudnn.allow_tf32 = False


def bench_bn(torch, cfg, rows, copy_bw):
    rng = np.random.default_rng(1)
    for shape, layout in cfg["bn"]:
        C = shape[1] if layout == "NCHW" else shape[3]
        x, z, gy = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        gamma, beta = np.ones(C, np.float32), np.zeros(C, np.float32)
        d = {k: cuda.to_device(v) for k, v in dict(x=x, z=z, gy=gy, gamma=gamma,
                                                    beta=beta).items()}

        def fwd():
            return nf.batchnorm_add_relu(d["x"], d["z"], d["gamma"], d["beta"], layout=layout)

        def both():
            y = fwd()
            return nf.batchnorm_add_relu_backward(d["gy"], d["x"], d["z"], d["gamma"],
                                                  d["beta"], y=y, layout=layout)
        tf, tb = time_device(fwd, cfg["repeats"]), time_device(both, cfg["repeats"])
        nbytes = x.nbytes
        # minimum traffic: fwd reads x twice (stats, apply) and z, writes y; bwd reads gy, y,
        # x twice, writes gx, gz
        bw_f, bw_b = 4 * nbytes / (tf * 1e-3) / 1e9, 10 * nbytes / (tb * 1e-3) / 1e9
        label = f"{shape} {layout}"
        rows.append(("batchnorm_add_relu", label, "numbafuse", tf, tb,
                     f"{bw_f:.0f} / {bw_b:.0f} GB/s ({bw_f / copy_bw:.0%} / "
                     f"{bw_b / copy_bw:.0%} of copy)"))
        if torch is not None:
            fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format

            def nchw(a):
                t = torch.tensor(a, device="cuda")
                if layout == "NHWC":
                    t = t.permute(0, 3, 1, 2)
                return t.contiguous(memory_format=fmt).requires_grad_(True)
            tx, tz, tgy = nchw(x), nchw(z), nchw(gy).detach()
            tg, tbe = (torch.tensor(a, device="cuda", requires_grad=True) for a in (gamma, beta))
            F = torch.nn.functional

            def t_fwd():
                return F.relu(F.batch_norm(tx, None, None, tg, tbe, training=True) + tz)

            def t_both():
                t_fwd().backward(tgy)
            ttf, ttb = time_torch(torch, t_fwd, cfg["repeats"]), time_torch(torch, t_both,
                                                                             cfg["repeats"])
            rows.append(("batchnorm_add_relu", label, "PyTorch CUDA eager", ttf, ttb,
                         f"numbafuse / this, fwd+bwd: {ttb / tb:.2f}x"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (simulator check)")
    p.add_argument("--markdown", metavar="FILE")
    args = p.parse_args(argv)
    if not cuda.is_available():
        sys.exit("bench_gpu: no CUDA device (for a smoke run: NUMBA_ENABLE_CUDASIM=1 ... --smoke)")
    cfg = SMOKE if args.smoke else FULL
    torch = None if args.smoke else _torch_cuda()
    copy_bw = copy_ceiling(cfg)
    matmul = matmul_ceiling(torch, cfg)
    rows = []
    bench_conv(torch, cfg, rows, matmul)
    bench_bn(torch, cfg, rows, copy_bw)
    device = cuda.get_current_device()
    name = getattr(device, "name", b"simulator")
    name = name.decode() if isinstance(name, bytes) else str(name)
    lines = [f"Command: `{_report.command('bench_gpu.py')}`", "",
             f"Device: {name}. Ceilings measured in this run: device copy {copy_bw:.0f} GB/s"
             + (f", FP32 matmul (TF32 off) {matmul:.0f} GFLOP/s" if matmul else "") + ".", "",
             "| op | shape | implementation | fwd ms | fwd+bwd ms | achieved |",
             "|---|---|---|---:|---:|---|"]
    lines += [f"| {op} | {shape} | {impl} | {f:.3f} | {b:.3f} | {extra} |"
              for op, shape, impl, f, b, extra in rows]
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
