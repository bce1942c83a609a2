"""Where an input array starts, and what it costs a CPU conv: the same x 64-byte aligned and
16 bytes off (where NumPy puts a large array), timed alternately in one process.

    python benchmarks/alignment_probe.py [--rounds 7] [--threads 1]

NumPy's large arrays start 16 bytes into a page, so a 64-byte vector load of each row crosses
two cache lines; PyTorch's allocator and numbafuse's CPU output buffers (``OutputCache.ALIGN``)
start arrays on 64-byte boundaries. Each case: best of ``--rounds`` rounds of 3 calls, the two
placements alternating round by round (numbafuse only: this compares placements, not
libraries). docs/conv_bias_relu.md quotes its figures.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

CASES = [("depthwise 7x7 NHWC", (32, 28, 28, 96), (96, 1, 7, 7),
          dict(padding=3, layout="NHWC", groups=96)),
         ("depthwise 3x3 NHWC", (32, 56, 56, 64), (64, 1, 3, 3),
          dict(padding=1, layout="NHWC", groups=64)),
         ("depthwise 7x7 NCHW", (32, 96, 28, 28), (96, 1, 7, 7),
          dict(padding=3, layout="NCHW", groups=96)),
         ("3x3 conv NHWC", (32, 32, 32, 64), (64, 64, 3, 3), dict(padding=1, layout="NHWC"))]


def placed(a, offset, align=64):
    """A copy of ``a`` starting ``offset`` bytes past an ``align``-byte boundary."""
    buf = np.empty(a.nbytes + 2 * align, np.uint8)
    start = -buf.ctypes.data % align + offset
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import numbafuse as nf
    from numbafuse.kernels.cpu import launch
    launch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"numbafuse conv_bias_relu forward, {args.threads} thread(s), best of {args.rounds} "
          f"alternating rounds of 3 calls")
    for name, x_shape, w_shape, kw in CASES:
        x = rng.standard_normal(x_shape).astype(np.float32)
        w = rng.standard_normal(w_shape).astype(np.float32)
        b = rng.standard_normal(w_shape[0]).astype(np.float32)
        inputs = {"64-byte aligned": placed(x, 0), "16 bytes off": placed(x, 16)}
        best = dict.fromkeys(inputs, float("inf"))
        for _ in range(args.rounds):
            for label, xx in inputs.items():
                nf.conv_bias_relu(xx, w, b, **kw)
                t0 = time.perf_counter()
                for _ in range(3):
                    nf.conv_bias_relu(xx, w, b, **kw)
                best[label] = min(best[label], (time.perf_counter() - t0) / 3 * 1e3)
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in best.items()), flush=True)


if __name__ == "__main__":
    main()
