"""Per-call cost of numbafuse.torch's fused functions at a tiny shape, against PyTorch's ops.

    python benchmarks/bench_torch_call.py [--rounds 2] [--calls 500] [--shape 2,8,4,4] [--cold]

At a shape this small the kernels do almost nothing, so the time is the call's own cost:
checks, tensor views, records, kernel dispatch. Each library runs in its own process (a
fresh interpreter per round, alternating), one thread each (``torch.set_num_threads(1)``,
``NUMBAFUSE_NUM_THREADS=1``); the table keeps the best of 7 x ``--calls`` calls per round,
best over rounds. Forwards, training and eval batch norm, and Conv-BN-ReLU's forward and
forward + backward in training (numbafuse: ``conv_batchnorm_relu``, recompute; PyTorch:
conv2d, batch_norm, relu; the backward from ``y.sum()``, x, w and the batch-norm parameters
requiring grad; two inputs taken in turn, as a training loop gives new data), and
Conv-BN-ReLU's forward in eval (numbafuse: the batch norm folded or, at the im2col plans,
applied in the conv's epilogue; PyTorch: conv2d, batch_norm, relu; two inputs in turn too:
a prepared call is recorded on two calls' different data, and one input again and again
leaves it layered, ``recorded.SAME_DATA_LIMIT``); the running statistics
are updated in both libraries' training calls. The numbafuse side also runs with prepared
calls off (``NUMBAFUSE_PREPARED=0``: the layered path, ``kernels/cpu/recorded.py``), in a
process of its own too.

``--cold``: each call timed alone after a 64 MiB buffer is written (the sweep not timed), the
median of ``--calls`` calls per round, best over rounds: the call as it runs inside a
network, where the layers before it have pushed its code, Python objects and arrays out of
the caches (machine A: a Conv-BN-ReLU forward + backward's ~0.4-0.5 ms warm doubles).
"""
import argparse
import json
import os
import subprocess
import sys
import time

CASES = ("conv + bias + ReLU forward", "BN + add + ReLU forward, training",
         "BN + add + ReLU forward, eval", "conv + BN + ReLU forward, training",
         "conv + BN + ReLU forward + backward, training", "conv + BN + ReLU forward, eval")


def _timed_cold(f, calls):
    """Median us of ``calls`` calls of ``f``, each after a 64 MiB buffer is written (not
    timed): the caches hold none of the call's code, objects or arrays, as in a network,
    where each fused op runs after the other layers' kernels have gone through the caches."""
    import numpy as np
    sweep = np.ones(16 << 20, np.float32)
    times = []
    for _ in range(calls):
        sweep += 1.0
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e6


def worker(side, shape, calls, cold=False):
    import torch
    torch.set_num_threads(1)
    F = torch.nn.functional
    N, C, H, W = shape
    x, z = torch.randn(N, C, H, W), torch.randn(N, C, H, W)
    w, b = torch.randn(C, C, 3, 3), torch.randn(C)
    g, be, rm, rv = torch.ones(C), torch.zeros(C), torch.zeros(C), torch.ones(C)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    xgs = [xg, torch.randn(N, C, H, W, requires_grad=True)]
    gg, beg = g.clone().requires_grad_(), be.clone().requires_grad_()
    if side == "numbafuse":
        import numbafuse.torch as nft

        def cbr(x=x, w=w, g=g, be=be):
            return nft.conv_batchnorm_relu(x, w, g, be, rm, rv, padding=1)
        fns = (lambda: nft.conv_bias_relu(x, w, b, 1, 1),
               lambda: nft.batchnorm_add_relu(x, z, g, be, rm, rv),
               lambda: nft.batchnorm_add_relu(x, z, g, be, rm, rv, training=False))
    else:
        def cbr(x=x, w=w, g=g, be=be):
            return F.batch_norm(F.conv2d(x, w, None, 1, 1), rm, rv, g, be, True).relu()
        fns = (lambda: F.conv2d(x, w, b, 1, 1).relu(),
               lambda: (F.batch_norm(x, rm, rv, g, be, True) + z).relu(),
               lambda: (F.batch_norm(x, rm, rv, g, be, False) + z).relu())
    turn = [0]
    xs = [x, xgs[1].detach()]
    if side == "numbafuse":
        def cbr_eval():
            turn[0] ^= 1
            return nft.conv_batchnorm_relu(xs[turn[0]], w, g, be, rm, rv, training=False,
                                           padding=1)
    else:
        def cbr_eval():
            turn[0] ^= 1
            return F.batch_norm(F.conv2d(xs[turn[0]], w, None, 1, 1), rm, rv, g, be,
                                False).relu()

    def cbr_backward():
        turn[0] ^= 1
        cbr(xgs[turn[0]], wg, gg, beg).sum().backward()
    fns += (cbr, cbr_backward, cbr_eval)
    out = {}
    for name, f in zip(CASES, fns):
        for _ in range(200):
            f()
        if cold:
            out[name] = _timed_cold(f, calls)
            continue
        best = float("inf")
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(calls):
                f()
            best = min(best, (time.perf_counter() - t) / calls)
        out[name] = best * 1e6
    print(json.dumps(out))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--shape", default="2,8,4,4")
    p.add_argument("--cold", action="store_true",
                   help="each call after a 64 MiB sweep of the caches; the median call")
    p.add_argument("--worker", choices=("numbafuse", "layered", "torch"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    if args.worker:
        return worker("torch" if args.worker == "torch" else "numbafuse", shape, args.calls,
                      args.cold)
    best = {side: {} for side in ("numbafuse", "layered", "torch")}
    for _ in range(args.rounds):
        for side in best:
            env = dict(os.environ, NUMBAFUSE_NUM_THREADS="1",
                       NUMBAFUSE_PREPARED="0" if side == "layered" else "1")
            out = subprocess.run([sys.executable, __file__, "--worker", side, "--shape",
                                  args.shape, "--calls", str(args.calls)]
                                 + (["--cold"] if args.cold else []), env=env,
                                 capture_output=True, text=True, check=True).stdout
            for name, us in json.loads(out.strip().splitlines()[-1]).items():
                best[side][name] = min(best[side].get(name, us), us)
    print(f"Command: python benchmarks/bench_torch_call.py --rounds {args.rounds} --calls "
          f"{args.calls} --shape {args.shape}{' --cold' if args.cold else ''}\n")
    print(f"| call at {shape} | numbafuse.torch us | prepared calls off us | PyTorch us |\n"
          "|---|---:|---:|---:|")
    for name in CASES:
        print(f"| {name} | {best['numbafuse'][name]:.1f} | {best['layered'][name]:.1f} "
              f"| {best['torch'][name]:.1f} |")


if __name__ == "__main__":
    main()
