"""Static check of every numba.cuda kernel as sm_90 machine code (no GPU needed).

Each kernel listed in a ``numbafuse/kernels/cuda`` module's ``PTX_SIGNATURES`` is compiled
by numba to PTX, assembled by ``ptxas -arch=sm_90 -O3`` and disassembled by ``cuobjdump``
(``numbafuse/testing/cuda_sass.py``). Checks:

- every kernel: no register spills, no stack frame, no local-memory traffic (a
  ``cuda.local.array`` that did not become registers), but for a spill measured faster and
  kept (``SPILLS_MEASURED``: no more than its bytes);
- every non-GEMM kernel (batch norm, reductions, elementwise, ...): no 64-bit integer
  division call inside a loop (Python-semantics ``//``/``%`` on int64 is a subroutine);
- every GEMM kernel (``GEMM_KERNELS``): its multiply-add loop (the loop with the most
  FFMA/DFMA) is at least ``MIN_FMA_SHARE`` FMA, does at least ``MIN_FMA_PER_LDS`` FMA per
  shared-memory load (register blocking), and divides nothing;
- every GEMM kernel: at most ``MAX_GEMM_REGISTERS`` registers a thread, so that two blocks
  of its 256 threads fit an SM's 64K registers (one block per SM left each SM one K-step's
  barrier away from idle);
- every GEMM whose operand is gated by the ReLU (dx's and dw's ``g = gy * (y > 0)``): no
  float compare before the first FMA of that loop (the gate is applied when the tile is
  stored to shared memory, so the loads of y and gy are in flight together during the FMAs;
  a gate tested at the load makes each load of gy wait for its y).

Skipped, saying why, when NVIDIA's tool wheels are absent (``pip install -e '.[test]'``
installs them). The table of these numbers: ``python benchmarks/gpu_static.py``.
"""
import os

import pytest

pytestmark = [pytest.mark.ptx, pytest.mark.usefixtures("compiled_in_workers"),
              pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1",
    reason="compiling for sm_90 needs the real numba.cuda, not the simulator"), pytest.mark.skipif(
    os.environ.get("NUMBAFUSE_TEST_SM90", "1") == "0",
    reason="NUMBAFUSE_TEST_SM90=0: CI compiles for sm_90 in its newest-Python leg only")]

MIN_FMA_SHARE = 0.30
MIN_FMA_PER_LDS = 2.0
GEMM_THREADS = 256                                   # every tiling of config.CONV_TILES
MAX_GEMM_REGISTERS = 65536 // (2 * GEMM_THREADS)     # two blocks per SM: 128


def _sass():
    from numbafuse.testing import cuda_sass as sass
    missing = sass.missing_tools()
    if missing:
        pytest.skip(f"NVIDIA tools {missing} not installed (pip install nvidia-cuda-nvcc "
                    f"nvidia-cuda-cuobjdump, or the 'sass' extra)")
    return sass


def _cases():
    if (os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
            or os.environ.get("NUMBAFUSE_TEST_SM90", "1") == "0"):
        return []       # no kernel module imported to collect tests that skip
    from numbafuse.kernels import catalog
    return [pytest.param(k, s, g, _gated(n), SPILLS_MEASURED.get(n, 0), id=n)
            for n, k, s, g in catalog.cases()]


def _gated(name):
    # the conv GEMMs whose loaders gate an operand by y > 0 (kernels/conv/cuda.py)
    return "gemm_dx_" in name or "gemm_dw_" in name


_REPORTS = {}


def _report(kernel, signature):
    key = (id(kernel), str(signature))
    if key not in _REPORTS:
        sass = _sass()
        _REPORTS[key] = sass.analyse(kernel, signature, getattr(kernel, "__name__", "?"))
    return _REPORTS[key]


# Spills measured and kept, by kernel (bytes of spill stores, loads and stack each): dw in NHWC
# at 128 x 64 x 16 capped to two blocks per SM spills 12 bytes and beat the unspilled
# 128 x 64 x 8 by 8-15% at every benchmark shape (run 12, config.CONV_TILES_NHWC's comment)
SPILLS_MEASURED = {"conv.gemm_dw_nhwc_32[f32]": 16}


def check(report, is_gemm, gated=False, spill_allowed=0):
    """The list of problems of one kernel's report (empty: it passes)."""
    problems = []
    if spill_allowed:
        if max(report.spill_stores, report.spill_loads, report.stack) > spill_allowed:
            problems.append(f"spills {report.spill_stores}+{report.spill_loads} B, stack "
                            f"{report.stack} B: more than the {spill_allowed} B measured")
    elif report.spills or report.stack or report.local_memory_ops:
        problems.append(f"spills {report.spill_stores}+{report.spill_loads} B, stack "
                        f"{report.stack} B, {report.local_memory_ops} LDL/STL")
    if is_gemm:
        if report.registers > MAX_GEMM_REGISTERS:
            problems.append(f"{report.registers} registers a thread: fewer than two blocks "
                            f"of {GEMM_THREADS} threads per SM")
        loop = report.hot_loop()
        if loop is None:
            problems.append("no multiply-add loop found")
        else:
            if loop.fma_share < MIN_FMA_SHARE:
                problems.append(f"multiply-add loop is {loop.fma_share:.0%} FMA "
                                f"({loop.fma} of {len(loop.insns)})")
            if loop.fma_per_lds < MIN_FMA_PER_LDS:
                problems.append(f"{loop.fma_per_lds:.1f} FMA per shared load")
            if report.divisions_in(loop):
                problems.append("the multiply-add loop divides")
            if gated:
                first = next(i for i, insn in enumerate(loop.insns)
                             if insn.base in ("FFMA", "DFMA"))
                early = [i for i in loop.insns[:first] if i.base in ("FSETP", "DSETP")]
                if early:
                    problems.append(f"{len(early)} float compares before the loop's first "
                                    f"FMA (a ReLU gate tested at the load)")
    else:
        calls = report.integer_division_calls_in_loops()
        if calls:
            problems.append(f"{len(calls)} 64-bit integer division calls inside loops "
                            f"(at {', '.join(hex(c.addr) for c in calls[:4])})")
    return problems


def test_tools_and_kernels_are_there():
    _sass()
    from numbafuse.kernels import catalog
    from numbafuse.kernels.cuda import config
    tiles = [t for d in (config.CONV_TILES, config.CONV_TILES_NHWC) for t in d.values()]
    tiles += [t for tiers in config.CONV_TILE_TIERS.values() for _, t in tiers]
    assert {t.threads for t in tiles} == {GEMM_THREADS}  # the register budget's premise
    cases = catalog.cases()
    assert sum(1 for c in cases if c[3]) >= 12          # 3 passes x 2 layouts x 2 dtypes
    assert len(cases) >= 40


@pytest.mark.parametrize("kernel,signature,is_gemm,gated,spill_allowed", _cases())
def test_kernel_machine_code(kernel, signature, is_gemm, gated, spill_allowed):
    problems = check(_report(kernel, signature), is_gemm, gated, spill_allowed)
    assert not problems, "; ".join(problems)


def test_the_check_fails_on_planted_regressions():
    """A division in a K-loop-like loop, a spill, an int64 division in an elementwise loop,
    a ReLU gate tested before a load and a GEMM past the register budget are each caught
    (the check can fail)."""
    sass = _sass()
    import numba
    from numbafuse.cuda import numba_cuda as cuda

    @cuda.jit
    def spills(a, n):
        # a local array indexed by a runtime value stays in local memory
        buf = cuda.local.array(512, numba.float32)
        for i in range(512):
            buf[i] = a[i]
        a[0] = buf[n % 512]

    @cuda.jit
    def divides(a, n):
        # an elementwise loop with a Python-semantics int64 division per element
        for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
            a[i] = a[i // n]

    @cuda.jit
    def slow_gemm(a, b, c, n):
        # a multiply-add loop with an int64 division and a shared load per FMA
        sh = cuda.shared.array(256, numba.float32)
        sh[cuda.threadIdx.x] = a[cuda.threadIdx.x]
        cuda.syncthreads()  # sh is loaded
        acc = numba.float32(0.0)
        for k in range(n):
            acc += sh[k % 256] * b[k // n]
        c[cuda.threadIdx.x] = acc

    f = numba.float32[::1]
    r = sass.analyse(spills, (f, numba.int64), "spills")
    assert any("spills" in p for p in check(r, False))
    assert any("spills" in p for p in check(r, False, spill_allowed=1))   # past its bytes
    r = sass.analyse(divides, (f, numba.int64), "divides")
    assert any("division" in p for p in check(r, False))
    r = sass.analyse(slow_gemm, (f, f, f, numba.int64), "slow_gemm")
    problems = " ".join(check(r, True))
    assert "FMA" in problems and "divides" in problems

    @cuda.jit
    def gate_at_load(g, y, b, c, n):
        # the old dx loader's pattern: g is loaded only where its y is open, then used
        acc = numba.float32(0.0)
        for k in range(n):
            v = numba.float32(0.0)
            if y[k] > 0:
                v = g[k]
            acc += v * b[k]
        c[0] = acc

    r = sass.analyse(gate_at_load, (f, f, f, f, numba.int64), "gate_at_load")
    assert any("float compares" in p for p in check(r, True, gated=True))
    r.registers = MAX_GEMM_REGISTERS + 1                 # as a GEMM past the budget reads
    assert any("fewer than two blocks" in p for p in check(r, True))


def test_min_blocks_caps_the_registers_of_a_tiling():
    """``Tile.min_blocks`` reaches ptxas as ``.minnctapersm`` and caps the registers at
    65536 / (threads * min_blocks) (a ``-maxrregcount`` cap is ignored next to the
    ``.maxntid`` every GEMM has, which is why the tiling has no such field): the 64 x 64
    forward, 48 registers alone, fits 32 at 8 blocks of 256 threads per SM."""
    sass = _sass()
    import numba
    from numbafuse.kernels.conv import cuda as conv_cuda
    from numbafuse.kernels.cuda.config import Tile
    f = numba.float32[::1]
    signature = (f,) * 5 + (numba.int32[:, ::1], numba.int32[:, ::1])
    tile = Tile(64, 64, 8, 4, 4, 4, min_blocks=8)
    r = sass.analyse(conv_cuda.gemm_kernel("fwd", "NCHW", tile), signature, "capped")
    assert r.registers <= 65536 // (tile.threads * 8), r.registers
