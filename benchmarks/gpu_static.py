"""Static sm_90 table of every numba.cuda kernel: registers, spills, shared memory, the loop
instruction mix of the GEMMs (FMA share, FMA per shared load). No GPU needed.

    PYTHONPATH=. python benchmarks/gpu_static.py [--markdown 'docs/benchmarks.md#gpu_static']

Needs NVIDIA's tool wheels (``pip install -e '.[sass]'``: ptxas, cuobjdump). The same numbers
are checked by tests/test_sass.py; this script only tabulates them.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _report

import _report  # noqa: E402

from numbafuse.kernels import catalog  # noqa: E402
from numbafuse.testing import cuda_sass as sass  # noqa: E402


def _mix(loop, top=6):
    counts = sorted(loop.mix().items(), key=lambda kv: -kv[1])[:top]
    return " ".join(f"{op} {n}" for op, n in counts)


def rows(filter_=None):
    out = []
    for name, kernel, sig, is_gemm in catalog.cases():
        if filter_ and filter_ not in name:
            continue
        r = sass.analyse(kernel, sig, name)
        loop = r.hot_loop() if is_gemm else None
        int_div = len(r.integer_division_calls_in_loops())
        row = [name, "GEMM" if is_gemm else "", str(r.registers),
               f"{r.spill_stores}/{r.spill_loads}", str(r.stack), str(r.local_memory_ops),
               str(r.smem), str(int_div)]
        if loop is not None:
            row += [str(len(loop.insns)), str(loop.fma), f"{loop.fma_share:.0%}",
                    str(loop.shared_loads), f"{loop.fma_per_lds:.1f}", _mix(loop)]
        else:
            row += [""] * 6
        out.append(row)
        print(" | ".join(row[:8] + row[8:13]), file=sys.stderr, flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--only", help="kernels whose name contains this")
    args = p.parse_args(argv)
    missing = sass.missing_tools()
    if missing:
        sys.exit(f"gpu_static: NVIDIA tools {missing} not installed: "
                 f"pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump")
    table = rows(args.only)
    head = ["kernel [dtype]", "kind", "regs", "spill st/ld B", "stack B", "LDL/STL",
            "smem B", "int64 div calls in loops", "K-loop insns", "FMA", "FMA share",
            "LDS", "FMA/LDS", "K-loop mix (top 6)"]
    lines = [f"Command: `{_report.command('gpu_static.py')}`", "",
             f"Versions: {sass.versions()}. Target sm_90 (`ptxas -arch=sm_90 -O3 -v`, "
             f"`cuobjdump -sass`); no GPU involved: these are static counts, not timings.", "",
             "The K-loop is the loop with the most FFMA/DFMA (a backward branch and its "
             "target); LDS counts shared-load instructions (LDS.128 is one). Checked by "
             "tests/test_sass.py: no spill, stack or LDL/STL anywhere but where a spill was "
             "measured faster and kept (its SPILLS_MEASURED: the NHWC dW GEMM's 12 bytes at "
             "128 x 64 x 16); no int64 division call "
             "in a loop outside the GEMMs; GEMM K-loops >= 30% FMA and >= 2 FMA per LDS; GEMMs "
             "at <= 128 registers (two 256-thread blocks per SM); in dx's and dw's K-loops "
             "no float compare before the first FMA (the ReLU gate at the shared store).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in table]
    _report.emit(lines, args.markdown)


if __name__ == "__main__":
    main()
