"""``python -m numbafuse.precompile``: what it compiles and how it refuses (the compilation
itself needs a GPU: benchmarks/gpu_check.sh runs it there, 96 kernels in 33 s on an H100)."""
import os

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1",
                                reason="the real numba.cuda")


def test_it_lists_every_kernel_of_every_module_once_per_dtype():
    from numbafuse import precompile
    from numbafuse.kernels import cuda_sass
    cases = precompile._cases(("float32", "float64"))
    assert [(n, str(s)) for n, _, s, _ in cases] == \
        [(n, str(s)) for n, _, s, _ in cuda_sass.cases()]
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
