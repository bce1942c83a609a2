"""Host time of the CUDA backend's calls, measured without a GPU: the device is stubbed out.

    python benchmarks/host_path.py [--calls 300] [--rounds 5] [--profile CASE] [--sort cumtime]
    TREE=/path/to/other/checkout python benchmarks/host_path.py      (a before/after pair)

On an H100 the per-call and eager training-step tables of ``bench_gpu.py`` are host-bound:
the kernels of a digits training step take 0.9 ms replayed from a CUDA graph, the step 8-9 ms
eagerly (docs/benchmarks.md#gpu). That host time is Python: numbafuse's checks and dispatch,
numba's device arrays, the pool, the prepared launches. This script runs exactly that code on
any machine, with the device replaced by stubs: numbafuse's real pool (``_CudaPool``) over a
made-up memory resource, numba's real device arrays over made-up addresses, the prepared
launch's real argument packing with cuda.core's launch call replaced by a counter, copies to
and from the device doing nothing (reads return zeros). What it leaves out: the driver calls
(a launch ~5-8 us, a pool allocation, numba's context queries) and the device's own time. So
its figures are a floor of the eager host time, and they move the way the real ones do when
numbafuse's Python changes: use it to measure a change before a GPU run, not instead of one.

Cases: the per-call table's ops at its shape (bench_gpu.DIGITS) and one training step of the
digits ResNet (fused), each with its launches, pool requests and driver allocations (new
memory: a request the pool's cache could not serve) per call, after 3 warm-up calls.
``tests/test_cuda_host_path.py`` runs it to pin those counts.
"""
import argparse
import contextlib
import cProfile
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.environ.get("TREE", os.path.dirname(HERE))
sys.path.insert(0, TREE)

BASE = 0x7F0000000000
LAUNCHES = [0]


class _Context:
    device = None


class _Buffer:
    def __init__(self, address):
        self.handle = address

    def close(self, stream):
        pass


class _Resource:
    """A memory resource handing out made-up addresses (1 MiB apart), counting them."""
    def __init__(self):
        self.next = BASE
        self.allocations = 0
        self.attributes = _Attributes()

    def allocate(self, nbytes, stream=None):
        self.allocations += 1
        self.next += max(1 << 20, nbytes)
        return _Buffer(self.next)


class _Attributes:
    reserved_mem_current = 1 << 30


def stub_device():
    """Replace the device under numbafuse's CUDA path (see the module docstring)."""
    import numpy as np
    from numba.cuda.cudadrv import devices
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numbafuse import cuda as nfcuda
    from numbafuse.kernels.cuda import launch

    devices._runtime.ensure_context = contextlib.nullcontext
    nfcuda._pool = nfcuda._CudaPool.over(_Resource(), _Context())

    class Prepared:            # the argument packers, without compiling the kernel
        __slots__ = ("kernel", "packers", "argtypes")

        def __init__(self, dispatcher, args):
            self.argtypes = tuple(map(nfcuda.argument_type, args))
            self.kernel = dispatcher
            self.packers = [launch.packer(t) for t in self.argtypes]

    def core_launch(stream, conf, kernel, *values):
        LAUNCHES[0] += 1

    launch._Prepared = Prepared
    launch._CORE[:] = [(core_launch, None)]
    launch._launch_config = lambda grid, block: (grid, block)
    DeviceNDArray.copy_to_device = lambda self, a, stream=0: None
    nfcuda._NUMBA_STREAM = [None]       # numba's default stream (copies do nothing here)
    DeviceNDArray.copy_to_host = (lambda self, ary=None, stream=0:
                                  np.zeros(self.shape, self.dtype) if ary is None else ary)


def cases():
    """{name: (weight, call)}: the calls timed here and profiled by gpu_profile.py (a step
    weighs 15 calls: it is timed ``--calls / 15`` times)."""
    import numpy as np
    import numbafuse as nf
    from numbafuse import cuda as nfcuda, models, optim
    from numbafuse.train import train_step
    from bench_gpu import DIGITS
    rng = np.random.default_rng(0)
    dev = nfcuda.to_device
    C, batch = DIGITS["x"][1], DIGITS["batch"]
    x, z = (dev(rng.standard_normal(DIGITS["x"]).astype(np.float32)) for _ in range(2))
    w = dev((rng.standard_normal(DIGITS["w"]) / np.sqrt(np.prod(DIGITS["w"][1:])))
            .astype(np.float32))
    b, gam, bet = (dev(rng.standard_normal(C).astype(np.float32)) for _ in range(3))
    rm, rv = dev(np.zeros(C, np.float32)), dev(np.ones(C, np.float32))
    model = models.make_model("fused").to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    xb = dev(rng.standard_normal((batch, 8, 8, 1)).astype(np.float32))
    yb = rng.integers(0, 10, batch)        # host labels, as numbafuse.train.fit passes them
    return {
        "conv_bias_relu forward": (1, lambda: nf.conv_bias_relu(x, w, b, padding=1)),
        "batchnorm_add_relu forward (training)": (1, lambda: nf.batchnorm_add_relu(
            x, z, gam, bet, running_mean=rm, running_var=rv)),
        "digits training step (fused)": (15, lambda: train_step(model, opt, xb, yb)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="calls per round (a step: 1/15)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", help="cProfile this case (a prefix of its name)")
    p.add_argument("--sort", default="tottime")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", metavar="FILE", help="write the table's figures here")
    args = p.parse_args()
    sys.path.insert(0, HERE)
    stub_device()
    from numbafuse import cuda as nfcuda
    print(f"tree: {TREE}; device stubbed (no driver calls, no device time)")
    resource = nfcuda._pool.resource
    print("| call | host us (best of rounds) | launches | pool requests | new memory |")
    print("|---|---:|---:|---:|---:|")
    results = {}
    for name, (weight, fn) in cases().items():
        n = max(1, args.calls // weight)
        for _ in range(3):
            fn()
        best = float("inf")
        for _ in range(args.rounds):
            launches, requests = LAUNCHES[0], nfcuda.memory_stats()["requests"]
            allocations = resource.allocations
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n)
        row = dict(us=best * 1e6, launches=(LAUNCHES[0] - launches) / n,
                   requests=(nfcuda.memory_stats()["requests"] - requests) / n,
                   allocations=(resource.allocations - allocations) / n)
        results[name] = row
        print(f"| {name} | {row['us']:.1f} | {row['launches']:.0f} | {row['requests']:.0f} | "
              f"{row['allocations']:.0f} |")
        if args.profile and name.startswith(args.profile):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(n):
                fn()
            profile.disable()
            pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
