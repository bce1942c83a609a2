"""What a prepared call per signature could take off a fused call's host path: the call timed
against a replay of the launches and compiled steps it made.

    python benchmarks/replay_floor.py [--op cbr|cbar] [--channels 64] [--size 16] [--batch 16]
                                      [--stride 1] [--recompute auto] [--calls 100] [--rounds 3]

One process, numbafuse.torch's Conv-BN-ReLU (``cbr``) or Conv-BN-Add-ReLU (``cbar``) in
training, 3x3, padding 1, float32, NCHW, on random tensors. One forward and one backward are
*recorded*: every outermost ``launch`` (kernel, task count, arguments), every call of the
compiled steps the drivers make between launches from Python (``STEPS``: statistics merges,
running-statistics updates, per-channel values, the backward's coefficients, and every
``recorded.step``, the NumPy copies between launches among them), and every
array the call allocates (the output cache's, ``np.empty``'s, ``np.zeros``'s; float ones
filled with NaN as they are made). Then, in alternating rounds, the fused call is timed
against its *replay*: the same output-cache requests made again, each ``np.zeros`` array
zeroed again, the recorded calls made again in order, on the recorded arrays. The replay
runs every kernel and each launch's own Python (threads, the native entry), and none of the
layers between them: the torch layer's checks, views and records, the ops layer, the
drivers' plans and views. That is what a prepared call (docs/architecture.md, "Next: a
prepared call") would still do, less the views of a new call's tensors it would have to
make. A floor, not a result: the replay computes on the
recorded arrays, and the fused backward's time includes autograd's engine (the leaves'
gradients are set to None before each, as in a training step).

Before timing, each replay is checked: every float array the call allocated is filled with
NaN again, the replay run once, and each must come back bit for bit as the call left it; the
table counts those that do not ("not rewritten"): written by something the recording does
not see (NumPy work between launches, such as the batch norm's shift copied into its
spread rows, or a compiled step not in ``STEPS``), which the replay leaves out. (An array
made in Python by other means is not seen at all: the replay reuses it as it was.)
"""
import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

from profile_resnet import replace_in_numbafuse

# compiled steps the drivers call from Python between launches (module attribute names;
# "step": kernels/cpu/recorded.step, through which the drivers call them and their copies)
STEPS = ("step", "merge_stats", "_update_running", "channel_values", "spread_in_place",
         "finalize_stats", "finalize_backward", "channel_totals")


@contextlib.contextmanager
def recording(steps):
    """Within the block, ``steps`` (a list) collects the outermost launches and the calls of
    ``STEPS`` made from Python, in order, as ``(function, args, kwargs)``, and each array
    allocated outside launches as ``("alloc", array, zeroed, from_cache)``."""
    from numba.core.dispatcher import Dispatcher

    from numbafuse.kernels.cpu import buffers
    from numbafuse.kernels.cpu import launch as launch_mod
    depth = [0]

    def wrap(fn):
        def recorded(*args, **kwargs):
            if depth[0] == 0:
                steps.append((fn, args, kwargs))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return recorded

    from numbafuse.kernels.cpu import recorded
    launch, step = launch_mod.launch, recorded.step
    undo_calls = replace_in_numbafuse(
        lambda name, value: value is launch
        or (name in STEPS and (isinstance(value, Dispatcher) or value is step)), wrap)
    undo = []

    def allocator(make, zeroed, from_cache):
        def alloc(*args, **kwargs):
            depth[0] += 1                 # (the cache's own np.empty is not the call's)
            try:
                out = make(*args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                if not zeroed and out.dtype.kind == "f":
                    out.fill(np.nan)      # (what the call leaves unwritten stays NaN)
                steps.append(("alloc", out, zeroed, from_cache))
            return out
        return alloc

    cache_empty = buffers.OutputCache.empty
    cached = allocator(cache_empty, False, True)
    buffers.OutputCache.empty = lambda self, shape, dtype: cached(self, shape, dtype)
    undo.append((buffers.OutputCache, "empty", cache_empty))
    for name, zeroed in (("empty", False), ("zeros", True)):
        undo.append((np, name, getattr(np, name)))
        setattr(np, name, allocator(getattr(np, name), zeroed, False))
    try:
        yield
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
        undo_calls()


def replayer(steps):
    """A function that replays ``steps`` (module docstring)."""
    from numbafuse.kernels.cpu.buffers import output_cache
    requests = [(s[1].shape, s[1].dtype) for s in steps if s[0] == "alloc" and s[3]]
    zeroed = [s[1] for s in steps if s[0] == "alloc" and s[2]]
    calls = [s for s in steps if s[0] != "alloc"]

    def replay():
        held = [output_cache.empty(shape, dtype) for shape, dtype in requests]
        for a in zeroed:
            a[...] = 0
        for fn, args, kwargs in calls:
            fn(*args, **kwargs)
        return held
    return replay


def check(steps, replay):
    """(arrays checked, arrays not rewritten): each float array the recorded call allocated,
    NaN-filled, run through one replay and compared bit for bit with what the call left in it
    (module docstring)."""
    arrays = [s[1] for s in steps if s[0] == "alloc" and not s[2]
              and s[1].dtype.kind == "f" and s[1].size]
    kept = [a.copy() for a in arrays]
    for a in arrays:
        a[...] = np.nan
    replay()
    missed = [a for a, k in zip(arrays, kept) if not np.array_equal(a, k, equal_nan=True)]
    for a, k in zip(arrays, kept):
        a[...] = k
    return len(arrays), len(missed)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("cbr", "cbar"), default="cbr")
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--recompute", default="auto", choices=("auto", "True", "False"))
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    import numbafuse.torch as nft
    from numbafuse.kernels.cpu import first_calls
    first_calls.set_wait(float("inf"))               # compiled kernels in every call
    recompute = {"True": True, "False": False}.get(args.recompute, args.recompute)
    torch.manual_seed(0)
    C, N, S, st = args.channels, args.batch, args.size, args.stride
    x = torch.randn(N, C, S, S, requires_grad=True)
    w = (torch.randn(C, C, 3, 3) / (3 * C ** 0.5)).requires_grad_()
    gamma = (1 + 0.1 * torch.randn(C)).requires_grad_()
    beta = (0.1 * torch.randn(C)).requires_grad_()
    rm, rv = torch.zeros(C), torch.ones(C)
    P = (S - 1) // st + 1
    z = torch.randn(N, C, P, P, requires_grad=True)
    leaves = (x, w, gamma, beta, z)

    def call():
        if args.op == "cbr":
            return nft.conv_batchnorm_relu(x, w, gamma, beta, rm, rv, stride=st, padding=1,
                                           recompute=recompute)
        return nft.conv_batchnorm_add_relu(x, w, z, gamma, beta, rm, rv, stride=st,
                                           padding=1, recompute=recompute)

    dy = torch.randn(N, C, P, P)
    for _ in range(10):
        call().backward(dy)
    forward, backward = [], []
    with recording(forward):
        y = call()
    with recording(backward):
        y.backward(dy)
    replays = {"forward": replayer(forward), "backward": replayer(backward)}
    checked = {d: check(s, replays[d]) for d, s in (("forward", forward),
                                                     ("backward", backward))}

    def fused(direction):
        t = 0.0
        for _ in range(args.calls):
            if direction == "forward":
                t0 = time.perf_counter()
                call()
                t += time.perf_counter() - t0
            else:
                out = call()
                for leaf in leaves:
                    leaf.grad = None
                t0 = time.perf_counter()
                out.backward(dy)
                t += time.perf_counter() - t0
        return t / args.calls

    def replayed(direction):
        replay = replays[direction]
        t0 = time.perf_counter()
        for _ in range(args.calls):
            replay()
        return (time.perf_counter() - t0) / args.calls

    times = {(d, k): [] for d in ("forward", "backward") for k in ("fused", "replay")}
    for _ in range(args.rounds):
        for d in ("forward", "backward"):
            times[d, "fused"].append(fused(d))
            times[d, "replay"].append(replayed(d))
    print(f"Command: python benchmarks/replay_floor.py --op {args.op} --channels {C} --size "
          f"{S} --batch {N} --stride {st} --recompute {args.recompute} --calls {args.calls} "
          f"--rounds {args.rounds}\n")
    print(f"{'Conv-BN-ReLU' if args.op == 'cbr' else 'Conv-BN-Add-ReLU'}, 3x3/{st} {C} -> {C} "
          f"at {S}x{S}, batch {N}, recompute={args.recompute}, {torch.get_num_threads()} "
          f"torch threads; us a call, best / median of {args.rounds} rounds of {args.calls}\n")
    print("| direction | recorded: launches, steps, arrays (checked, not rewritten) | fused "
          "| replay | fused less replay |\n|---|---|---:|---:|---:|")
    for d, steps in (("forward", forward), ("backward", backward)):
        launches = sum(1 for s in steps if s[0] != "alloc" and s[0].__name__ == "launch")
        calls = sum(1 for s in steps if s[0] != "alloc") - launches
        arrays = sum(1 for s in steps if s[0] == "alloc")
        f, r = times[d, "fused"], times[d, "replay"]
        print(f"| {d} | {launches}, {calls}, {arrays} ({checked[d][0]}, {checked[d][1]}) "
              f"| {min(f) * 1e6:.1f} / {statistics.median(f) * 1e6:.1f} "
              f"| {min(r) * 1e6:.1f} / {statistics.median(r) * 1e6:.1f} "
              f"| {(min(f) - min(r)) * 1e6:.1f} |")
    if any(missed for _, missed in checked.values()):
        print("\nNot rewritten: arrays the call wrote with something the recording does not "
              "see (NumPy work between launches, a compiled step not in STEPS); the replay "
              "leaves that work out, so it reads low by its time.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
