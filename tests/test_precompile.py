"""``python -m numbafuse.precompile``: what it compiles and how it refuses (the compilation
itself needs a GPU: benchmarks/gpu_check.sh runs it there, 96 kernels in 33 s on an H100)."""
import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1",
                                reason="the real numba.cuda")


def test_it_lists_every_kernel_of_every_module_once_per_dtype():
    from numbafuse import precompile
    from numbafuse.kernels import catalog
    cases = precompile._cases(("float32", "float64"))
    assert [(n, str(s)) for n, _, s, _ in cases] == \
        [(n, str(s)) for n, _, s, _ in catalog.cases()]
    assert len({(n, str(s)) for n, _, s, _ in cases}) == len(cases)    # each (kernel, types) once
    assert sum(1 for *_, is_gemm in cases if is_gemm) >= 16   # 12 wide + 4 narrow GEMMs


def test_every_kernel_has_its_own_cache_index():
    """One Numba cache index per qualified name: kernels sharing one would lose entries when
    processes compile them at once (seen on an H100: GEMMs compiled again in later processes)."""
    from numbafuse import precompile
    bases = {}
    for name, kernel, _, _ in precompile._cases(("float32", "float64")):
        bases.setdefault(kernel._cache._impl.filename_base, set()).add(id(kernel))
    shared = {base: len(ids) for base, ids in bases.items() if len(ids) > 1}
    assert not shared, shared


def test_it_says_what_to_compile_and_needs_a_gpu(capsys):
    from numbafuse import cuda as nfcuda, precompile
    with pytest.raises(SystemExit):
        precompile.main([])
    assert "--cuda" in capsys.readouterr().err
    if not nfcuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            precompile.main(["--cuda", "-j", "1"])


def test_the_cpu_cases_take_the_paths_layers_take():
    # each case's shape sends its passes down the algorithm that layers of its kind take, so
    # that precompiling it compiles what a network's first call needs (kernels/conv/cpu.py)
    import numpy as np

    from numbafuse import precompile, validate
    from numbafuse.kernels.conv import cpu as conv_cpu, cpu_plan
    picked = {}
    for name, op, (N, C, H, W), kernel, stride, K, dtype in precompile.cpu_cases(("float32",)):
        if op in ("bn", "dw", "pool", "grp"):
            continue
        for layout in ("NCHW", "NHWC"):
            shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
            g = validate.conv_geometry("t", shape, (K, C, kernel, kernel), stride,
                                       kernel // 2, 1, layout)
            picked[name, layout] = tuple(conv_cpu.algorithm(g, p, np.float32)
                                         for p in ("forward", "dx", "dw"))
            if name.startswith("conv 3x3 deep"):     # the k-blocked whole-batch passes
                picked[name, layout, "blocks"] = tuple(
                    cpu_plan.plan(g, p, np.float32).k_blocks for p in ("forward", "dx", "dw"))
    for layout in ("NCHW", "NHWC"):
        assert picked["conv 3x3 s1 (Winograd) float32", layout] == ("winograd",) * 3
        assert picked["conv-batchnorm-relu 3x3 float32", layout] == ("winograd",) * 3
        # (AVX-512's tiles, but not where the CPU splits a 512-bit FMA: Zen 4 keeps Winograd)
        few = ("implicit" if cpu_plan.RULES.taps and cpu_plan.RULES.implicit_s1_max_channels
               else "winograd")
        for name in ("conv 3x3 s1 few channels (implicit forward) float32",
                     "conv-batchnorm-relu 3x3 few channels float32"):
            assert picked[name, layout] == (few, "winograd", "winograd")
        assert picked["conv 3x3 s1 small map (im2col forward) float32", layout] == (
            "im2col", "winograd", "im2col")
        # (AVX-512's tiles; NHWC's narrow ones; NCHW's by output rows of 8 pixels)
        assert picked["conv 7x7 s2 stem (implicit forward) float32", layout][0] == "implicit"
        # (the dW by the implicit GEMM where the tiles run it: Rules.winograd_s2_dw)
        s2_dw = "winograd_s2" if cpu_plan.RULES.winograd_s2_dw else "implicit"
        assert picked["conv 3x3 s2 float32", layout] == ("winograd_s2", "winograd_s2", s2_dw)
        small_dw = "implicit" if cpu_plan.RULES.taps else "pointwise"     # (AVX-512's tiles)
        assert picked["conv 1x1 s1 float32", layout] == ("pointwise", "pointwise", small_dw)
        assert picked["conv 1x1 s1 small map (implicit dW) float32", layout] == (
            "pointwise", "pointwise", small_dw)
        assert picked["conv 3x3 stem (few channels) float32", layout][0] == (
            "implicit" if layout == "NCHW" and not cpu_plan.RULES.wide   # (by output rows on
            else "im2col")                                              # 8-float tiles)
        deep = "conv 3x3 deep (k-blocked GEMMs) float32"
        assert picked[deep, layout] == ("im2col",) * 3
        assert min(picked[deep, layout, "blocks"]) > 1
        small = "conv 3x3 deep small map (tapwise forward, dX) float32"
        assert picked[small, layout] == ("tapwise", "tapwise", "im2col")
        assert min(picked[small, layout, "blocks"]) > 1
    assert len(precompile.cpu_cases()) == 2 * len(precompile.CPU_CASES)
    # the depthwise cases take the depthwise kernels' tiled paths (float32, C % 8 == 0)
    from numbafuse.kernels.conv import cpu_depthwise
    dws = [c for c in precompile.cpu_cases(("float32",)) if c[1] == "dw"]
    assert {c[3] for c in dws} == {3, 7} and {c[4] for c in dws} == {1, 2}
    for name, op, (N, C, H, W), kernel, stride, K, dtype in dws:
        g = validate.conv_geometry("t", (N, H, W, C), (K, 1, kernel, kernel), stride,
                                   kernel // 2, 1, "NHWC", groups=C)
        assert cpu_depthwise.is_depthwise(g) and cpu_depthwise._tiled(g, np.float32)
    # the grouped case takes the implicit GEMMs in float32 (cpu_grouped_taps)
    from numbafuse.kernels.conv import cpu_grouped_taps
    (_, _, (N, C, H, W), kernel, stride, K, _), = [
        c for c in precompile.cpu_cases(("float32",)) if c[1] == "grp"]
    g = validate.conv_geometry("t", (N, C, H, W), (K, C // precompile.GROUPS, kernel, kernel),
                               stride, kernel // 2, 1, "NCHW", groups=precompile.GROUPS)
    assert cpu_grouped_taps.fits(g, np.float32) and cpu_grouped_taps.merged(g) == 2


def test_a_cpu_case_runs_in_process():
    # run_cpu_case is what each worker process calls: the smallest case, both layouts
    from numbafuse import precompile
    case = next(c for c in precompile.cpu_cases(("float32",)) if c[1] == "bn")
    precompile.run_cpu_case(case)
    assert precompile._run_cpu_one(precompile.cpu_cases(("float32",)).index(case),
                                   ("float32",))[2] is None
