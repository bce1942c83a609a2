"""Where the digits training step's device time goes, kernel by kernel, on a GPU.

    TREE=<checkout> python benchmarks/gpu_step_kernels.py [--steps 20] [--rounds 3]
                                                       [--affine-gate on|off]

The fused digits step (bench_gpu.py's model, batch and optimizer) run eagerly ``--steps``
times under PyTorch's profiler (CUPTI sees numba's kernels too): each kernel's launches per
step and device time per step, the heaviest first; then the same step captured in a CUDA
graph and replayed (device time alone, best of ``--rounds``). ``TREE`` picks the checkout
whose numbafuse is imported (default: this one), so that two trees can be compared on one
machine in one call, as ``gpu_pair.py`` compares their per-call rows. ``--affine-gate``
sets the CUDA batch norm's ``AFFINE_GATE`` for the run (Conv-BN-ReLU's recompute: the ReLU
gate re-derived from h by the batch-norm backward, or the mask rebuilt by the apply kernel;
trees since 08b6328 only).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.abspath(os.environ.get("TREE") or os.path.dirname(HERE))
sys.path.insert(0, TREE)
sys.path.insert(1, HERE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--affine-gate", choices=("on", "off"), default=None)
    args = parser.parse_args(argv)
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile
    import numbafuse
    from numbafuse import cuda as nfcuda, models, optim
    from numbafuse.train import train_step
    from bench_gpu import DIGITS, FULL, median_events
    assert os.path.dirname(os.path.dirname(os.path.abspath(numbafuse.__file__))) == TREE
    from numbafuse.kernels.batchnorm import cuda as bn_cuda
    if args.affine_gate is not None:
        bn_cuda.AFFINE_GATE = args.affine_gate == "on"
    gate = getattr(bn_cuda, "AFFINE_GATE", None)
    cuda = nfcuda.numba_cuda
    torch.cuda.init()
    rng = np.random.default_rng(0)
    xb = nfcuda.to_device(rng.standard_normal((DIGITS["batch"], 8, 8, 1)).astype(np.float32))
    yb = nfcuda.to_device(rng.integers(0, 10, DIGITS["batch"]))   # device labels: both trees

    def model_and_optimizer():          # bench_gpu's model and SGD
        model = models.make_model("fused", **FULL["model"]).to("cuda")
        return model, optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    model, opt = model_and_optimizer()
    for _ in range(3):
        train_step(model, opt, xb, yb)
    cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            train_step(model, opt, xb, yb)
        cuda.synchronize()
    rows = [(e.device_time_total / args.steps, e.count / args.steps, e.key)
            for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(reverse=True)
    print(f"tree {TREE} (AFFINE_GATE {gate}): the fused digits step's kernels (eager, "
          f"{args.steps} steps), device us a step, launches a step:")
    for us, n, name in rows:
        print(f"  {us:8.1f} us  {n:4.1f}x  {name[:70]}")
    total, launches = sum(r[0] for r in rows), sum(r[1] for r in rows)
    print(f"  {total:8.1f} us  {launches:4.1f}x  in all")
    times = []
    for _ in range(args.rounds):
        with nfcuda.graph(train_step, *model_and_optimizer(), xb, yb) as step:
            times.append(median_events(step.replay, 20, cuda.event, cuda.synchronize) * 1e3)
    print(f"tree {TREE} (AFFINE_GATE {gate}): every kernel {total:.1f} us a step eagerly "
          f"({launches:.0f} launches); replayed from a CUDA graph best {min(times):.1f} us of "
          + ", ".join(f"{t:.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
