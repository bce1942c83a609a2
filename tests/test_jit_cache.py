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


def _racing_saves(tmp_path, caching):
    """Two saves of one function's cache, of two keys, in the order that breaks numba's
    unlocked save: the second runs while the first has read the index (the first waits
    there until the second has written the index, or 0.3 s), and writes its data file once
    the first save has ended. What each key then loads."""
    import threading
    first, second = (caching.IndexDataCacheFile(str(tmp_path), "racer", "stamp")
                     for _ in range(2))
    read, indexed, done = threading.Event(), threading.Event(), threading.Event()
    load, save_index, save_data = first._load_index, second._save_index, second._save_data

    def paused_load():
        overloads = load()
        read.set()
        indexed.wait(0.3)             # (the second save's index, unless it waits its turn)
        return overloads

    def second_index(overloads):
        save_index(overloads)
        indexed.set()

    def late_data(name, data):
        done.wait(5)
        save_data(name, data)
    first._load_index = paused_load
    second._save_index, second._save_data = second_index, late_data

    def second_save():
        read.wait(5)
        second.save(("f", "float32"), b"float32 code")
    t = threading.Thread(target=second_save)
    t.start()
    first.save(("f", "float64"), b"float64 code")
    done.set()
    t.join(10)
    reader = caching.IndexDataCacheFile(str(tmp_path), "racer", "stamp")
    return reader.load(("f", "float64")), reader.load(("f", "float32"))


@pytest.mark.skipif(jit_cache.fcntl is None, reason="no flock: numba's saves stay unlocked")
@pytest.mark.parametrize("planted", [False, True])
def test_saves_of_two_processes_at_once_keep_each_key_its_own_code(tmp_path, monkeypatch,
                                                                   planted):
    # the race numba's unlocked save has (jit_cache's module docstring), made certain: two
    # saves (two threads with a file of their own each, as two processes have) of one
    # function's cache; planted: numba's own save, which gives the float64 key the float32
    # key's code (the TypeError of tests/test_mpi.py) and loses the float32 key
    from numba.core import caching
    save = caching.IndexDataCacheFile.save
    assert hasattr(save, "unlocked"), "numbafuse's import locks numba's saves"
    if planted:
        monkeypatch.setattr(caching.IndexDataCacheFile, "save", save.unlocked)
    got = _racing_saves(tmp_path, caching)
    assert (got == (b"float64 code", b"float32 code")) != planted, got
    assert (tmp_path / jit_cache.LOCK_NAME).exists() != planted


def test_locked_saves_are_installed_once_and_on_numba_cudas_cache_too():
    from numba.core import caching
    assert jit_cache.locked_saves(caching) == (jit_cache.fcntl is not None)
    if jit_cache.fcntl is not None:
        assert not hasattr(caching.IndexDataCacheFile.save.unlocked, "unlocked")
    cuda_caching = sys.modules.get("numba.cuda.core.caching")
    if cuda_caching is not None and jit_cache.fcntl is not None:
        assert hasattr(cuda_caching.IndexDataCacheFile.save, "unlocked")


@pytest.mark.skipif(jit_cache.fcntl is None, reason="no flock: numba's saves stay unlocked")
def test_a_cache_directory_without_locks_saves_as_numba_does(tmp_path, monkeypatch):
    # a file system whose flock fails (some network file systems): numba's own save, not an
    # error in the compilation that saves
    from numba.core import caching

    def no_lock(fd, op):
        raise OSError(37, "No locks available")
    monkeypatch.setattr(jit_cache.fcntl, "flock", no_lock)
    cache = caching.IndexDataCacheFile(str(tmp_path), "nolock", "stamp")
    cache.save(("f", "float64"), b"code")
    assert cache.load(("f", "float64")) == b"code"


@pytest.mark.skipif(jit_cache.fcntl is None, reason="no flock: numba's saves stay unlocked")
def test_a_save_whose_lock_is_held_too_long_gives_up_instead_of_hanging(tmp_path, monkeypatch):
    # the lock held by a process that stopped (a debugger, SIGSTOP): the save does not wait
    # for ever; the function is not cached (compiled all the same in a real process)
    import threading
    from numba.core import caching
    monkeypatch.setattr(jit_cache, "LOCK_WAIT", 0.2)
    holder = os.open(tmp_path / jit_cache.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    jit_cache.fcntl.flock(holder, jit_cache.fcntl.LOCK_EX)
    cache = caching.IndexDataCacheFile(str(tmp_path), "held", "stamp")
    t = threading.Thread(target=cache.save, args=(("f", "float64"), b"code"))
    try:
        t.start()
        t.join(3)
        assert not t.is_alive(), "the save waits for a lock nobody releases"
    finally:
        os.close(holder)
        t.join(5)
    assert cache.load(("f", "float64")) is None
