"""Where the host time of a CUDA call goes: cProfile over many calls, the top functions by
their own time. Run on a GPU (benchmarks/gpu_check.sh runs it):

    python benchmarks/gpu_profile.py [--calls 200] [--top 18]

At the digits shape (bench_gpu.DIGITS: x (32, 24, 8, 8) float32), the per-call table's ops
and one training step of the digits ResNet, each with the launches of ``cuda.config.launch``
(prepared unless NUMBAFUSE_CUDA_LAUNCH=numba).
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import host_path  # noqa: E402  (the calls: the per-call table's shapes, a step)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumtime)")
    args = p.parse_args()
    from numbafuse import cuda as nfcuda
    from numbafuse.kernels.cuda import config as cuda_config
    cases = {name: call for name, (_, call) in host_path.cases().items()}
    sync = nfcuda.numba_cuda.synchronize
    print(f"launches: {cuda_config.launch}")
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        sync()
        n = args.calls if "step" not in name else max(1, args.calls // 10)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        per_call = (time.perf_counter() - t0) / n
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        sync()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(args.sort).print_stats(args.top)
        body = text.getvalue().split("ncalls", 1)[-1]
        print(f"\n#### {name}: {per_call * 1e6:.1f} us per call unprofiled; top by {args.sort} "
              f"over {n} calls:\n   ncalls{body.rstrip()}")


if __name__ == "__main__":
    main()
