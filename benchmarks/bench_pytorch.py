"""A residual block in PyTorch with and without numbafuse's layers (numbafuse.torch), CPU.

    python benchmarks/bench_pytorch.py [--quick] [--rounds R] [--steps S] [--markdown FILE]
                                       [--shape N,C,H,W] [--numbafuse-env NAME=VALUE ...]
                                       [--memory]

The block (float32, NCHW, C channels, 3x3 convs, padding 1)::

    torch      y = relu(bn2(conv2(relu(conv1(x) + b1))) + x)      torch.nn Conv2d, BatchNorm2d
    numbafuse  y = bn2(conv2(conv1(x)), x)     conv1 = numbafuse.torch.ConvBiasReLU2d,
                                               bn2 = numbafuse.torch.BatchNormAddReLU2d,
                                               conv2 the same torch.nn.Conv2d

Each side runs in **its own process with its own defaults** (DESIGN.md, "How speed is
measured"): the torch process never imports numbafuse; the numbafuse process imports torch,
then numbafuse.torch, as a user would. The driver (this script without ``--worker``) imports
neither; it alternates the two processes for ``--rounds`` rounds and keeps each side's best.
In a process: build the block (seeded), warm up (Numba compiles), then time ``--steps``
training steps, each from cleared gradients (``zero_grad(set_to_none=True)``, forward,
``(y * t).sum()``, backward, SGD step), and as many inference calls (``eval()``,
``torch.no_grad()``); a process reports the median
of its steps. ``--memory`` prints instead the bytes autograd saves for backward (every tensor
passed to a pack hook of ``torch.autograd.graph.saved_tensors_hooks``, each storage once) for
the unfused torch ops and the numbafuse Functions, and for the two blocks.
``--numbafuse-env NAME=VALUE`` sets an environment variable in the numbafuse process only (a
diagnostic run, e.g. ``OPENBLAS_NUM_THREADS=1``; the table says so).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _report import command, emit  # noqa: E402  (imports neither torch nor numbafuse)

SHAPES = [(32, 64, 32, 32), (32, 24, 8, 8)]     # (N, C, H, W): a ResNet stage; the digits block
QUICK_SHAPES = [(8, 16, 16, 16)]
ROUNDS, QUICK_ROUNDS = 5, 2
STEPS, QUICK_STEPS = 10, 3
WARMUP = 3
SEED = 0
MS = 1e3
MIB = 2.0 ** 20
SIDES = ("torch", "numbafuse")


# --------------------------------------------------------------------------- the blocks

def blocks():
    """(TorchBlock, FusedBlock): the two blocks as classes of ``C``; numbafuse.torch is imported
    only when FusedBlock is built. tests/test_torch.py trains both and checks they agree, so
    the benchmark compares the same network."""
    import torch

    class TorchBlock(torch.nn.Module):
        """relu(bn2(conv2(relu(conv1(x) + b))) + x) in torch.nn layers."""

        def __init__(self, C):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(C, C, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(C, C, 3, padding=1, bias=False)
            self.bn2 = torch.nn.BatchNorm2d(C)

        def forward(self, x):
            return torch.relu(self.bn2(self.conv2(torch.relu(self.conv1(x)))) + x)

    class FusedBlock(torch.nn.Module):
        """The same block with numbafuse's layers swapped in (same attribute names)."""

        def __init__(self, C):
            super().__init__()
            import numbafuse.torch as nft
            self.conv1 = nft.ConvBiasReLU2d(C, C, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(C, C, 3, padding=1, bias=False)
            self.bn2 = nft.BatchNormAddReLU2d(C)

        def forward(self, x):
            return self.bn2(self.conv2(self.conv1(x)), x)

    return TorchBlock, FusedBlock


def build(side, C):
    """The block of ``side`` ("torch" or "numbafuse"); same seed, same initial weights."""
    import torch
    torch_block, fused_block = blocks()
    torch.manual_seed(SEED)
    return torch_block(C) if side == "torch" else fused_block(C)


def worker(side, shape, steps):
    """Time one side in this process; print one JSON line."""
    import torch
    if side == "numbafuse":
        import numbafuse.torch  # noqa: F401  (after torch, as a user would)
    N, C, H, W = shape
    block = build(side, C)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N, C, H, W, generator=g)
    target = torch.randn(N, C, H, W, generator=g)
    opt = torch.optim.SGD(block.parameters(), lr=1e-3, momentum=0.9)

    def train_step():
        opt.zero_grad(set_to_none=True)
        (block(x) * target).sum().backward()
        opt.step()

    def infer():
        with torch.no_grad():
            block(x)

    times = {}
    for name, fn, mode in (("train", train_step, True), ("infer", infer, False)):
        block.train(mode)
        for _ in range(WARMUP):
            fn()
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples) * MS
    print(json.dumps(dict(side=side, threads=torch.get_num_threads(), **times)))


# --------------------------------------------------------------------------- saved bytes

def saved_bytes(fn):
    """Bytes of the tensors autograd saves while ``fn()`` runs, each storage once."""
    import torch
    seen = {}

    def pack(t):
        seen.setdefault((t.untyped_storage().data_ptr(), t.dtype, t.numel()), t.nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def memory_rows(shape):
    import torch
    import numbafuse.torch as nft
    F = torch.nn.functional
    N, C, H, W = shape
    g = torch.Generator().manual_seed(SEED)
    leaf = lambda *s: torch.randn(*s, generator=g).requires_grad_()   # noqa: E731
    x, z, w, b = leaf(N, C, H, W), leaf(N, C, H, W), leaf(C, C, 3, 3), leaf(C)
    gamma, beta = leaf(C), leaf(C)
    act = x.nbytes
    rows = [
        ("conv -> bias -> relu", saved_bytes(lambda: F.conv2d(x, w, b, padding=1).relu()),
         saved_bytes(lambda: nft.conv_bias_relu(x, w, b, padding=1))),
        ("batchnorm -> add -> relu",
         saved_bytes(lambda: (F.batch_norm(x, None, None, gamma, beta, True) + z).relu()),
         saved_bytes(lambda: nft.batchnorm_add_relu(x, z, gamma, beta))),
    ]
    blocks = {side: build(side, C) for side in SIDES}
    rows.append(("the block", saved_bytes(lambda: blocks["torch"](x)),
                 saved_bytes(lambda: blocks["numbafuse"](x))))
    return act, rows


# --------------------------------------------------------------------------- the driver

def machine():
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return model, os.cpu_count()


def versions():
    code = ("import platform, torch, numba, numpy; print(platform.python_version(), "
            "torch.__version__, numba.__version__, numpy.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    return dict(zip(("python", "torch", "numba", "numpy"), out))


def run_worker(side, shape, steps, extra_env=()):
    args = [sys.executable, os.path.abspath(__file__), "--worker", side, "--shape",
            ",".join(map(str, shape)), "--steps", str(steps)]
    env = dict(os.environ, **dict(e.split("=", 1) for e in extra_env))
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small shape, few rounds")
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--memory", action="store_true", help="print the saved-bytes table")
    p.add_argument("--numbafuse-env", nargs="*", default=[], metavar="NAME=VALUE",
                   help="environment of the numbafuse process only (diagnostics)")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--shape", metavar="N,C,H,W", help="this block shape only")
    args = p.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shape and not args.worker:
        shapes = [tuple(int(v) for v in args.shape.split(","))]
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    if args.worker:
        return worker(args.worker, tuple(int(v) for v in args.shape.split(",")), steps)
    model, cores = machine()
    v = versions()
    lines = [f"`{command('bench_pytorch.py')}`", "",
             f"{model}, {cores} cores; Python {v['python']}, torch {v['torch']} (CPU), "
             f"numba {v['numba']}, numpy {v['numpy']}; load before: "
             f"{os.getloadavg()[0]:.2f} (1-min average)", ""]
    if args.memory:
        lines += ["| what (float32, NCHW) | bytes of x | torch saves (bytes) | "
                  "numbafuse saves (bytes) | numbafuse / torch |", "|---|---:|---:|---:|---:|"]
        for shape in shapes:
            act, rows = memory_rows(shape)
            for name, theirs, ours in rows:
                lines.append(f"| {name}, x {shape} | {act:,} | {theirs:,} "
                             f"({theirs / MIB:.2f} MiB) | {ours:,} ({ours / MIB:.2f} MiB) | "
                             f"{ours / theirs:.2f} |")
        return emit(lines, args.markdown)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    lines += [f"{rounds} rounds alternating the two processes, {steps} timed calls each after "
              f"{WARMUP} warm-up calls; each cell: the best over rounds of a process's median.",
              *([f"numbafuse process only: {' '.join(args.numbafuse_env)}"]
                if args.numbafuse_env else []),
              "", "| block (N, C, H, W) | torch train step | numbafuse train step | ratio | "
                  "torch inference | numbafuse inference | ratio |",
              "|---|---|---|---|---|---|---|"]
    for shape in shapes:
        best = {side: {} for side in SIDES}
        for r in range(rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                result = run_worker(side, shape, steps,
                                    args.numbafuse_env if side == "numbafuse" else ())
                for k in ("train", "infer"):
                    best[side][k] = min(best[side].get(k, float("inf")), result[k])
        t, n = best["torch"], best["numbafuse"]
        lines.append(f"| {shape} | {t['train']:.2f} ms | {n['train']:.2f} ms | "
                     f"{n['train'] / t['train']:.2f} | {t['infer']:.2f} ms | "
                     f"{n['infer']:.2f} ms | {n['infer'] / t['infer']:.2f} |")
    lines += ["", f"load after: {os.getloadavg()[0]:.2f} (1-min average); ratio = numbafuse / "
                  f"torch (below 1: numbafuse faster)"]
    emit(lines, args.markdown)


if __name__ == "__main__":
    main()
