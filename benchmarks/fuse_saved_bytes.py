"""Bytes autograd keeps for backward: torchvision's ResNets as written, and after
``numbafuse.torch.fuse``. A count, not a timing.

    python benchmarks/fuse_saved_bytes.py [--batch 16] [--size 64] [--classes 10]

Every tensor given to a pack hook of ``torch.autograd.graph.saved_tensors_hooks`` during one
training forward (float32, NCHW), each storage once; "activations" leaves out the model's
parameters, which both hold. Prints one markdown row per model.
"""
import argparse
import platform

import numba
import numpy as np
import torch

import numbafuse.torch as nft
from bench_resnet_memory import saved_bytes   # (each storage once, parameters apart)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--recompute", choices=("True", "False", "auto"), default="True",
                        help="fuse(model, recompute=...) (default True, fuse's own)")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}; Python {platform.python_version()}, "
          f"torch {torch.__version__}, numba {numba.__version__}, numpy {np.__version__}")
    print("| model | x | torch saves (bytes) | fused saves | ratio | torch's activations | "
          "fused's activations | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, make in (("resnet18", nft.resnet18), ("resnet50", nft.resnet50)):
        torch.manual_seed(0)
        model = make(num_classes=args.classes)
        fused = nft.fuse(model, recompute={"True": True, "False": False}.get(args.recompute,
                                                                            args.recompute))
        x = torch.randn(args.batch, 3, args.size, args.size)
        total, acts = saved_bytes(model, x)
        total_f, acts_f = saved_bytes(fused, x)
        print(f"| {name} | ({args.batch}, 3, {args.size}, {args.size}) | {total:,} | "
              f"{total_f:,} | {total_f / total:.2f} | {acts:,} | {acts_f:,} | "
              f"{acts_f / acts:.2f} |")


if __name__ == "__main__":
    main()
