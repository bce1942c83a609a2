"""numbafuse.jit_cache: a cached kernel recompiles when a helper it imports from another file
changes (numba alone keys the cache on the kernel's own file and loads the stale code)."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import numbafuse
from numbafuse import jit_cache

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = pathlib.Path(numbafuse.__file__).resolve().parent

DRIVER = textwrap.dedent("""
    import sys
    from numbafuse import jit_cache
    if sys.argv[2] == "stamped":
        jit_cache.install(sys.argv[1], "stalepkg")
    from stalepkg import user
    print(user.f(), len(user.f.stats.cache_hits))
""")


def _package(tmp_path, value):
    pkg = tmp_path / "stalepkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text(textwrap.dedent(f"""
        from numba import njit

        @njit
        def g():
            return {value}
    """))
    (pkg / "user.py").write_text(textwrap.dedent("""
        from numba import njit
        from .helper import g

        @njit(cache=True)
        def f():
            return g() + 100
    """))
    return pkg


def _run(tmp_path, pkg, mode, cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    out = subprocess.run([sys.executable, "-c", DRIVER, str(pkg), mode], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    value, hits = out.stdout.split()
    return int(value), int(hits)


def test_changed_helper_recompiles_a_cached_caller(tmp_path):
    pkg = _package(tmp_path, 1)
    stamped, plain = tmp_path / "cache_stamped", tmp_path / "cache_plain"
    assert _run(tmp_path, pkg, "stamped", stamped) == (101, 0)
    assert _run(tmp_path, pkg, "plain", plain) == (101, 0)
    assert _run(tmp_path, pkg, "stamped", stamped) == (101, 1)   # unchanged: from the cache
    _package(tmp_path, 2)                                         # the helper's file changes
    assert _run(tmp_path, pkg, "stamped", stamped) == (102, 0)   # recompiled
    assert _run(tmp_path, pkg, "stamped", stamped) == (102, 1)   # and cached again
    # numba alone loads the stale caller; if this ever gives 102, numba tracks imports itself
    assert _run(tmp_path, pkg, "plain", plain) == (101, 1)


def test_dependencies_follow_imports_within_the_package():
    deps = {os.path.relpath(p, PACKAGE)
            for p in jit_cache.dependencies(str(PACKAGE / "kernels/conv/cpu_depthwise.py"))}
    # from .cpu_depthwise_tiles import ... ; transitively cpu.gemm_taps through it
    assert "kernels/conv/cpu_depthwise_tiles.py" in deps
    assert "kernels/cpu/gemm_taps.py" in deps
    # ``from .. import x`` names a submodule: the package's __init__ (which imports every
    # op) is not a dependency, so editing an op does not invalidate every kernel
    assert "__init__.py" not in deps
    assert "ops/conv.py" not in deps


def test_numbafuse_kernels_are_stamped_by_their_imports():
    from numba.core import caching
    from numbafuse.kernels.conv import cpu_depthwise
    assert caching.CacheImpl._locator_classes[0].__name__ == "ImportsLocator"
    locator = cpu_depthwise._forward_nhwc._cache._impl.locator
    own, imported = locator.get_source_stamp()
    assert imported == jit_cache.stamp(cpu_depthwise.__file__)


def test_numbafuse_cuda_kernels_are_stamped_by_their_imports():
    # numba-cuda has a cache of its own (stamped by mtime and size); a process without the
    # simulator, as a real device would run (no GPU is needed to decorate)
    code = textwrap.dedent("""
        import sys
        import numbafuse.cuda
        from numbafuse import jit_cache
        from numbafuse.kernels.batchnorm import cuda as kernels
        caching = sys.modules["numba.cuda.core.caching"]
        assert caching.CacheImpl._locator_classes[0].__name__ == "ImportsLocator"
        cached = [k for k in vars(kernels).values()
                  if type(getattr(k, "_cache", None)).__name__ == "CUDACache"]
        assert cached, "no cached CUDA kernel found"
        for k in cached:
            own, imported = k._cache._impl.locator.get_source_stamp()
            assert imported == jit_cache.stamp(kernels.__file__)
        print(len(cached))
    """)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    if "need numba-cuda" in out.stderr or "No module named 'numba.cuda'" in out.stderr:
        pytest.skip("numba-cuda is not installed")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 1
