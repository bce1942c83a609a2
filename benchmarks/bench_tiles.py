"""numbafuse's own GEMM tiles (``kernels/cpu/gemm_taps.py``) against OpenBLAS, where the CPU
conv passes use them: the products alone, each ResNet conv pass, and the ResNet steps.

    python benchmarks/bench_tiles.py [--part gemm|passes|network|all] [--model resnet18]
                                     [--rounds 8] [--batch 16] [--size 64]
                                     [--compare tiles|pack]

The tiles run where ``blas.TILE_GEMM`` (float32 products of ``blas.gemm`` with no operand
transposed) says, and in that orientation where ``cpu_im2col_dw.gathers_dw`` (the NCHW
im2col dW without slab) and ``cpu_tapwise.tiles_forward`` say; "off" sets all three to
OpenBLAS and its orientations. Every comparison runs both variants in
this one process, alternating round by round (the same arrays, the same model), and keeps
the best of each; "faster in" counts the rounds the tiles won. ``gemm``: one thread, c (m, n)
= a (m, k) @ b (k, n) by ``gemm_gather`` (b's rows by address) against NumPy's OpenBLAS on
the same arrays (numbafuse's private OpenBLAS is the same library). ``passes``: each conv
pass of the model's layers (batch 16, 64x64, NCHW, the rules' plan, numbafuse's threads).
``network``: the fused model's training step and eval forward (``numbafuse.torch.fuse``,
recompute "auto"). A profile of numbafuse against itself: ``bench_resnet.py`` compares
with PyTorch.

``--compare pack``: the tiles with b's panels packed (``gemm_taps.packs_panel``) against b
read in place, by ``blas.PACK_B`` (the products of ``blas.gemm``: im2col, tapwise, pointwise,
Winograd; the implicit, grouped and stride-2 Winograd passes call the drivers themselves and
pack either way); the gemm part: ``gemm_gather`` with b in place against OpenBLAS.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

# (m, n, k) of products the conv passes make: dW^T of the ResNet stem (C*R*S, K, pixels),
# dW of deep 3x3 layers (K block, R*S*C, pixels), a Winograd GEMM, pointwise products
GEMM_SHAPES = [(147, 64, 1024), (576, 64, 1024), (1152, 128, 256), (128, 2304, 256),
               (128, 4608, 64), (128, 1024, 64), (160, 128, 128), (256, 256, 256),
               (27, 32, 1024)]


def _switch(on, saved):
    from numbafuse.kernels.conv import cpu_im2col_dw, cpu_tapwise
    from numbafuse.kernels.cpu import blas
    if saved == "pack":                   # --compare pack: b's panels packed or read in place
        blas.PACK_B = on
        return
    blas.TILE_GEMM = on

    def off(*args, **kwargs):
        return False
    cpu_im2col_dw.gathers_dw = saved[0] if on else off
    cpu_tapwise.tiles_forward = saved[1] if on else off


def _saved(compare="tiles"):
    from numbafuse.kernels.conv import cpu_im2col_dw, cpu_tapwise
    if compare == "pack":
        return "pack"
    return (cpu_im2col_dw.gathers_dw, cpu_tapwise.tiles_forward)


def _alternate(fn, rounds, repeats, saved):
    """{True: [best of a round], False: [...]} with the tiles on and off, alternating."""
    best = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            _switch(on, saved)
            fn()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best[on].append(min(times))
    _switch(True, saved)
    return best


def _names(compare):
    return ("b in place", "b packed") if compare == "pack" else ("OpenBLAS", "tiles")


def _row(best):
    on, off = min(best[True]), min(best[False])
    wins = sum(a < b for a, b in zip(best[True], best[False]))
    return off * 1e3, on * 1e3, off / on, f"{wins}/{len(best[True])}"


def gemm_part(rounds, compare="tiles"):
    from threadpoolctl import threadpool_limits

    from numbafuse.kernels.cpu import gemm_taps
    rng = np.random.default_rng(0)
    unpacked = gemm_taps.UNPACKED if compare == "pack" else 0
    print(f"| (m, n, k) | tiles{' (b read in place)' if unpacked else ''} GFLOP/s | OpenBLAS "
          "GFLOP/s | tiles / OpenBLAS |")
    print("|---|---:|---:|---:|")
    for m, n, k in GEMM_SHAPES:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        c = np.zeros((m, n), np.float32)
        rows = (b.ctypes.data + 4 * n * np.arange(k)).astype(np.int64)

        def tiles():
            gemm_taps.gemm_gather(m, n, k, a.ctypes.data, k, rows.ctypes.data, 0, c.ctypes.data,
                                  n, 0, int(gemm_taps.WIDE) | unpacked)
        tiles()
        np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-3, atol=1e-3)
        t_tiles = t_blas = 1e9
        with threadpool_limits(1):
            for _ in range(rounds * 4):
                t = time.perf_counter()
                tiles()
                t_tiles = min(t_tiles, time.perf_counter() - t)
                t = time.perf_counter()
                np.matmul(a, b, out=c)
                t_blas = min(t_blas, time.perf_counter() - t)
        flop = 2.0 * m * n * k
        print(f"| ({m}, {n}, {k}) | {flop / t_tiles / 1e9:.1f} | {flop / t_blas / 1e9:.1f} | "
              f"{t_blas / t_tiles:.2f} |")


def passes_part(model, batch, size, rounds, compare="tiles"):
    import bench_conv_plan

    import numbafuse as nf
    from numbafuse.kernels.conv import cpu as cpu_conv, cpu_plan
    saved = _saved(compare)
    rng = np.random.default_rng(0)
    off_name, on_name = _names(compare)
    print(f"| layer | pass | algorithm | {off_name} ms | {on_name} ms | speed-up | "
          f"{on_name} faster in |")
    print("|---|---|---|---:|---:|---:|---|")
    for name, C, K, k, stride, H in bench_conv_plan.layers(model, size):
        shape = (batch, C, H, H)
        geom = nf.validate.conv_geometry("bench", shape, (K, C, k, k), stride, k // 2, 1,
                                         "NCHW")
        x = rng.standard_normal(shape).astype(np.float32)
        w = (rng.standard_normal((K, C, k, k)) / (C * k)).astype(np.float32)
        gy = rng.standard_normal(geom.y_shape).astype(np.float32)
        for pass_ in cpu_plan.PASSES:
            plan = cpu_plan.plan(geom, pass_, np.float32)
            if pass_ == "forward":
                def fn(plan=plan):
                    cpu_conv.conv_forward(x, w, None, geom, False, plan=plan)
            else:
                need = (True, False, False) if pass_ == "dx" else (False, True, False)

                def fn(plan=plan, need=need):
                    cpu_conv.conv_backward(gy, x, w, geom, None, need, plans=(plan, plan))
            off, on, ratio, wins = _row(_alternate(fn, rounds, 4, saved))
            print(f"| {name} | {pass_} | {plan.algorithm} | {off:.2f} | {on:.2f} | "
                  f"{ratio:.2f}x | {wins} |", flush=True)


def network_part(model, batch, size, rounds, compare="tiles"):
    import bench_resnet_memory
    import torch

    import numbafuse.torch as nft
    from numbafuse.kernels.cpu import first_calls
    first_calls.set_wait(float("inf"))
    torch.manual_seed(0)
    net = getattr(bench_resnet_memory.resnet_module(), model)(
        num_classes=bench_resnet_memory.CLASSES)
    net = nft.fuse(net, recompute="auto")
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, bench_resnet_memory.CLASSES, (batch,))

    def step():
        net.train()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), labels).backward()
        opt.step()

    def forward():
        net.eval()
        with torch.no_grad():
            net(x)
    saved = _saved(compare)
    off_name, on_name = _names(compare)
    print(f"| case | {off_name} ms | {on_name} ms | speed-up | {on_name} faster in |")
    print("|---|---:|---:|---:|---|")
    for name, fn in ((f"{model} train step", step), (f"{model} eval forward", forward)):
        off, on, ratio, wins = _row(_alternate(fn, rounds, 3, saved))
        print(f"| {name} | {off:.1f} | {on:.1f} | {ratio:.3f}x | {wins} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="all", choices=("gemm", "passes", "network", "all"))
    p.add_argument("--model", default="resnet18", choices=("resnet18", "resnet50"))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--compare", default="tiles", choices=("tiles", "pack"),
                   help="tiles: the tiles against OpenBLAS (default); pack: the tiles with b's "
                        "panels packed against read in place (blas.PACK_B; the gemm part: "
                        "gemm_gather unpacked against OpenBLAS)")
    args = p.parse_args(argv)
    from numbafuse.kernels.cpu import launch
    print(f"Command: `python benchmarks/bench_tiles.py {' '.join(sys.argv[1:])}`; "
          f"numbafuse threads {launch.num_threads()}, {os.cpu_count()} CPUs visible")
    if args.part in ("gemm", "all"):
        gemm_part(args.rounds, args.compare)
    if args.part in ("passes", "all"):
        passes_part(args.model, args.batch, args.size, args.rounds, args.compare)
    if args.part in ("network", "all"):
        network_part(args.model, args.batch, args.size, args.rounds, args.compare)


if __name__ == "__main__":
    main()
