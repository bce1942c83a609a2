"""Peak memory of a ResNet training step: ``numbafuse.torch.fuse(model)`` against PyTorch.

    python benchmarks/bench_resnet_memory.py [--models resnet18,resnet50] [--batch 16]
                                             [--size 64] [--steps 3] [--markdown FILE]

A count, not a timing (the machine's load does not move it). Every case runs in a fresh
process of its own, one library each (the torch worker loads ``numbafuse/torch/resnet.py``
from its file and never imports numbafuse), the same model code, seed, batch and SGD as
``bench_resnet.py``. A worker builds the model (and fuses it, on the numbafuse side), runs two
training steps (compilation or loading from Numba's cache included; numbafuse's kernels
waited for, as the timing benchmarks do), then:

* **at rest**: the process's resident set (VmRSS) between steps: interpreter, libraries,
  compiled code, parameters, optimizer state, anything a library keeps between calls (for
  numbafuse its output cache and task scratch);
* resets the kernel's high-water mark (``/proc/self/clear_refs`` 5) and runs ``--steps``
  more steps: **step peak** is VmHWM after them, the most the process held during a step;
  **above rest** = step peak - at rest: the step's own working memory (activations kept for
  backward, gradients, scratch);
* **process peak**: ``ru_maxrss`` over the worker's whole life, its first steps (and
  numbafuse's compilation) included;
* **saved for backward**: the bytes of every tensor given to a pack hook of
  ``torch.autograd.graph.saved_tensors_hooks`` during one training forward, each storage once,
  the parameters left out (as ``fuse_saved_bytes.py`` counts them).

Linux only (``/proc``). numbafuse's side runs ``fuse(model, recompute=...)`` for each of
``--recompute``'s values (default ``auto,True,False``).
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys

import _report
import _runner
from bench_resnet import CLASSES, LR, MOMENTUM, WEIGHT_DECAY, resnet_module

MIB = 2.0 ** 20
WARM_STEPS = 2


def _status_kib(field):
    """A VmRSS/VmHWM-like field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def _reset_peak():
    """Set VmHWM to the current VmRSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def saved_bytes(model, x):
    """(all bytes, bytes that are not the model's parameters) saved for backward by one
    forward: every tensor given to a pack hook, each storage once."""
    import torch
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values()), sum(v for k, v in seen.items() if k not in params)


def worker(side, name, recompute, batch, size, steps, threads):
    import torch
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = getattr(resnet_module(), name)(num_classes=CLASSES)
    if side == "numbafuse":
        import numbafuse.torch as nft
        from numbafuse.kernels.cpu import first_calls, launch
        first_calls.set_wait(float("inf"))           # compiled kernels in every step
        if threads:
            launch.set_num_threads(threads)
        model = nft.fuse(model, recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    x = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, CLASSES, (batch,))
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        opt.step()

    for _ in range(WARM_STEPS):
        step()
    rest = _status_kib("VmRSS")
    _reset_peak()
    for _ in range(steps):
        step()
    peak = _status_kib("VmHWM")
    saved = saved_bytes(model, x)[1]
    return dict(rest=rest, peak=peak, process=resource.getrusage(resource.RUSAGE_SELF)
                .ru_maxrss * 1024, saved=saved, info=_runner._library_info(side))


def run_case(side, name, recompute, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, name, str(recompute),
           "--batch", str(args.batch), "--size", str(args.size), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _ratio(value, base):
    """value / base to two places, or "-" where base is not positive (PyTorch's step grew
    its process by nothing: a ratio would divide by zero)."""
    return f"{value / base:.2f}" if base > 0 else "-"


def _recompute(text):
    return {"True": True, "False": False}.get(text, text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,resnet50")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--recompute", default="auto,True,False",
                   help="fuse(model, recompute=...) values on the numbafuse side")
    p.add_argument("--markdown", default=None, help="write the table to this file")
    p.add_argument("--worker", nargs=3, metavar=("SIDE", "MODEL", "RECOMPUTE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        side, name, recompute = args.worker
        print(json.dumps(worker(side, name, _recompute(recompute), args.batch, args.size,
                                args.steps, args.threads)))
        return
    rows = []
    for name in args.models.split(","):
        base = run_case("torch", name, "-", args)
        rows.append((name, "PyTorch", base, base))
        for recompute in args.recompute.split(","):
            rows.append((name, f'numbafuse, recompute={recompute}',
                         run_case("numbafuse", name, recompute, args), base))
    libs = {}
    for _, _, r, _ in rows:
        libs.update(r.pop("info"))
    libs.pop("backend", None)
    lines = [f"Command: `{_report.command('bench_resnet_memory.py')}`", "",
             f"Machine: {_runner._machine()}; Python {libs['python']}; {libs['numbafuse']}; "
             f"{libs['torch']}. Each case in a fresh process of its own, one library each.",
             "", f"Batch {args.batch}, 3x{args.size}x{args.size}, float32, NCHW, SGD with "
              f"momentum; {args.steps} steps after {WARM_STEPS}. MiB; the ratios are "
              "numbafuse's over PyTorch's (below 1: less memory).", "",
              "| model | library | at rest | step peak | above rest | ratio | process peak "
              "| ratio | saved for backward | ratio |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, side, r, base in rows:
        above, above0 = r["peak"] - r["rest"], base["peak"] - base["rest"]
        lines.append(
            f"| {name} | {side} | {r['rest'] / MIB:.0f} | {r['peak'] / MIB:.0f} | "
            f"{above / MIB:.0f} | {_ratio(above, above0)} | {r['process'] / MIB:.0f} | "
            f"{r['process'] / base['process']:.2f} | {r['saved'] / MIB:.1f} | "
            f"{r['saved'] / base['saved']:.2f} |")
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
