"""A fused ResNet's first training steps with an empty Numba cache (issue 33, in a network).

    python benchmarks/bench_first_steps.py [--model resnet18] [--batch 4] [--size 64]
                                           [--steps 12] [--wait 5|inf] [--runs 1]

Each run is a new process with a new, empty ``NUMBA_CACHE_DIR``: torch and numbafuse imported,
``numbafuse.torch.fuse(resnet(num_classes=10))``, SGD (lr 0.01, momentum 0.9), random data
(seed 0), then steps timed one by one (from cleared gradients) until ``--steps`` have run or,
after the fourth, no background compilation is pending (``kernels/cpu/first_calls.py``); then
``first_calls.join()`` and one more step. Printed per run: the import time, each step's
seconds, when every background compilation was done (from the first step's start), the step
after that, and the losses. ``--wait inf`` compiles on the calling thread (no first calls:
``NUMBAFUSE_FIRST_CALL_WAIT=inf``), what a first step cost before them.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import numbafuse.torch as nft
from numbafuse.torch import resnet
from numbafuse.kernels.cpu import first_calls
t1 = time.perf_counter()
model_name, batch, size, most = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = nft.fuse(getattr(resnet, model_name)(num_classes=10))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(batch, 3, size, size)
labels = torch.randint(0, 10, (batch,))

def step():
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), labels)
    loss.backward()
    opt.step()
    return loss.item()

times, losses = [], []
t2 = time.perf_counter()
for i in range(most):
    s = time.perf_counter()
    losses.append(step())
    times.append(time.perf_counter() - s)
    if i >= 3 and not first_calls.pending():
        break
first_calls.join()
t3 = time.perf_counter()
s = time.perf_counter()
step()
after = time.perf_counter() - s
print(json.dumps(dict(imports=t1 - t0, steps=times, losses=losses, compiled_after=t3 - t2,
                      step_after=after, stats=first_calls.stats())))
"""


def run_once(args):
    with tempfile.TemporaryDirectory(prefix="bench_first_steps-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, NUMBAFUSE_FIRST_CALL_WAIT=args.wait,
                   PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get(
                       "PYTHONPATH", "").split(os.pathsep) if p]))
        out = subprocess.run([sys.executable, "-c", _CHILD, args.model, str(args.batch),
                              str(args.size), str(args.steps)], env=env, capture_output=True,
                             text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench_first_steps: the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--wait", default="5", help="NUMBAFUSE_FIRST_CALL_WAIT (inf: no first calls)")
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args(argv)
    print(f"{args.model}, batch {args.batch}, 3x{args.size}x{args.size}, empty cache, "
          f"NUMBAFUSE_FIRST_CALL_WAIT={args.wait}")
    for _ in range(args.runs):
        r = run_once(args)
        print(f"imports {r['imports']:.1f} s; steps (s): "
              + " ".join(f"{t:.2f}" for t in r["steps"])
              + f"; all compiled {r['compiled_after']:.1f} s after the first step began; "
              f"a step then {r['step_after']:.3f} s; losses "
              + " ".join(f"{v:.3f}" for v in r["losses"]) + f"; {r['stats']}")


if __name__ == "__main__":
    main()
