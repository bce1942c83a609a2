"""Numba's on-disk cache, made to notice a changed helper in another file.

Numba keys a cached function (``@njit(cache=True)``, ``cuda.jit(cache=True)``) on its own
source file only: the content hash of that file (numba) or its mtime and size (numba-cuda). A
kernel that inlines or calls a helper from another module keeps the helper's old machine code
after that module changes, and gives the old results, until its own file changes too. A wheel
upgrade rewrites every file, so it is safe; an editable install after ``git pull``, a local
edit, or a checkout of another commit is not.

:func:`install` puts a cache locator in front of numba's (both the CPU and the CUDA target's)
that, for a function defined under one of the given roots, keeps numba's cache directory and
stamp and adds the content hash of every module the function's file imports from the same
roots, transitively (``from .x import y``, ``from . import x``, ``import pkg.x``, inside
functions too). A changed helper then changes the stamp of every file that reaches it, and
numba recompiles those functions instead of loading them. The imports are read with a regular
expression, not executed; a module imported some other way (``importlib``) is not followed.

It also makes numba's cache safe for processes that compile at once (:func:`locked_saves`).
Numba saves a new entry by reading the cache's index, taking the first data file number the
index does not name, writing the index, then the data file, with no lock: two processes
compiling two signatures of one function at the same time (MPI ranks, a job's workers,
``first_calls``' compiling process beside the user's) both take number 1, and the index
that one of them writes can name the data file the other wrote last. Every later process
then loads that function's machine code for the wrong argument types: ``TypeError: can't
unbox array from PyObject into native value`` (seen here in ``tests/test_mpi.py``, and in
1 of 12 runs of four processes compiling one function on a cold cache), or a crash. Each
save now holds an exclusive ``flock`` on one file of its cache directory (:data:`LOCK_NAME`)
while it reads the index, writes the data file, then the index, so an index never names a
data file another save is writing or has taken (waiting at most :data:`LOCK_WAIT` seconds
for it, then not saving). A cache a racing save broke before stays
broken: delete the cache directory (``NUMBA_CACHE_DIR``, or the package's ``__pycache__``).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
import sys
import time

try:
    import fcntl
except ImportError:          # (not POSIX: numba's saves stay as they are)
    fcntl = None

_ROOTS: list = []          # (package directory, package name), e.g. (".../numbafuse", "numbafuse")

_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(?P<base>\.*[\w.]*)[ \t]+import[ \t]+(?P<names>\([^)]*\)|[^\n#]*)"
    r"|import[ \t]+(?P<plain>[\w.]+(?:[ \t]*,[ \t]*[\w.]+)*))", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def _file_hash(path: str, mtime_ns: int, size: int) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def file_hash(path: str) -> bytes:
    """sha256 of the file's bytes (re-read when its mtime or size changes)."""
    st = os.stat(path)
    return _file_hash(path, st.st_mtime_ns, st.st_size)


def _root_of(path: str):
    for directory, name in _ROOTS:
        if path.startswith(directory + os.sep):
            return directory, name
    return None


def _module_file(directory: str, name: str, module: str):
    """The file of dotted ``module`` if it lies under the root ``directory`` (named ``name``)."""
    parts = module.split(".")
    if parts[0] != name:
        return None
    base = os.path.join(directory, *parts[1:])
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _module_of(directory: str, name: str, path: str) -> str:
    rel = os.path.relpath(path, directory)[:-3].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join([name, *rel])


def _names(text: str) -> list:
    return [n.split(" as ")[0].strip() for n in text.strip("() \t\n").replace("\n", " ").split(",")
            if n.strip() and n.strip() != "*"]


def imports(path: str) -> frozenset:
    """The files under ``path``'s root that ``path`` imports (one level)."""
    if _root_of(path) is None:
        return frozenset()
    st = os.stat(path)
    return _imports(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=None)
def _imports(path: str, mtime_ns: int, size: int) -> frozenset:
    directory, name = _root_of(path)
    current = _module_of(directory, name, path)
    package = current if path.endswith("__init__.py") else current.rpartition(".")[0]
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    found = set()
    for m in _IMPORT.finditer(source):
        if m.group("plain"):
            for module in _names(m.group("plain")):
                found.add(_module_file(directory, name, module))
            continue
        base = m.group("base")
        level = len(base) - len(base.lstrip("."))
        module = base.lstrip(".")
        if level:
            anchor = package.split(".")
            anchor = anchor[:len(anchor) - (level - 1)]
            module = ".".join(anchor + ([module] if module else []))
        names = _names(m.group("names"))
        submodules = [_module_file(directory, name, f"{module}.{n}") for n in names]
        found.update(submodules)                  # ``from pkg import submodule``: not pkg
        if not names or None in submodules:       # a name defined in the module itself
            found.add(_module_file(directory, name, module))
    found.discard(None)
    found.discard(path)
    return frozenset(found)


def dependencies(path: str) -> list:
    """Every file under ``path``'s root that ``path`` reaches by imports, sorted, itself
    excluded."""
    seen, todo = set(), [os.path.abspath(path)]
    while todo:
        for dep in imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    seen.discard(os.path.abspath(path))
    return sorted(seen)


@functools.lru_cache(maxsize=None)
def stamp(path: str) -> str:
    """The hash of the contents of every file ``path`` reaches by imports (not ``path``'s own,
    which numba stamps itself); once per file and process (the functions of one module are
    decorated together, and a file edited while a process runs costs at most a recompile in
    the next one)."""
    h = hashlib.sha256()
    root = _root_of(os.path.abspath(path))
    for dep in dependencies(path):
        h.update(os.path.relpath(dep, root[0]).encode())
        h.update(file_hash(dep))
    return h.hexdigest()


class _Stamped:
    """Numba's own locator for a function, with the imported files' hash added to its stamp."""

    def __init__(self, base, py_file):
        self._base = base
        self._py_file = py_file

    def get_source_stamp(self):
        return (self._base.get_source_stamp(), stamp(self._py_file))

    def __getattr__(self, name):
        return getattr(self._base, name)


def _locator_for(cache_impl):
    others = list(cache_impl._locator_classes)

    class ImportsLocator:
        """Stamps functions under the installed roots by their file and its imports."""

        @classmethod
        def from_function(cls, py_func, py_file):
            path = os.path.abspath(py_file)
            if _root_of(path) is None:
                return None
            for other in others:
                base = other.from_function(py_func, py_file)
                if base is not None:
                    return _Stamped(base, path)
            return None

    return ImportsLocator


def _patch(cache_impl) -> None:
    if not any(getattr(c, "__name__", "") == "ImportsLocator"
               for c in cache_impl._locator_classes):
        cache_impl._locator_classes = [_locator_for(cache_impl), *cache_impl._locator_classes]


LOCK_NAME = "numbafuse-saves.lock"      # in each cache directory: held while a save runs
# seconds a save waits for the lock (a save holds it for milliseconds); then the function is
# not saved (compiled in this process all the same): a stopped process holding the lock
# (a debugger, SIGSTOP) costs the others their cache entries, not a hang
LOCK_WAIT = 30.0


def _locked(save):
    """Numba's ``IndexDataCacheFile.save``, under an exclusive lock of the cache directory,
    the data file written before the index names it (the module docstring)."""
    def locked_save(self, key, data):
        try:
            fd = os.open(os.path.join(self._cache_path, LOCK_NAME), os.O_RDWR | os.O_CREAT,
                         0o666)
        except OSError:                    # (a directory we cannot write: numba's own way)
            return save(self, key, data)
        try:
            deadline = time.monotonic() + LOCK_WAIT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:    # (another save: milliseconds)
                    if time.monotonic() > deadline:
                        return             # (its holder stopped: not cached, not hung)
                    time.sleep(0.002)
                except OSError:            # (a file system without flock: numba's own way)
                    return save(self, key, data)
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:
                taken = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1))
                            if n not in taken)
                self._save_data(name, data)
                overloads[key] = name
                self._save_index(overloads)
            else:
                self._save_data(name, data)
        finally:
            os.close(fd)                   # (releases the lock)
    locked_save.unlocked = save
    return locked_save


def locked_saves(caching) -> bool:
    """Make the saves of ``caching`` (``numba.core.caching`` or numba-cuda's module of the
    same name) lock their cache directory (the module docstring). Every numba cache in the
    process saves so from then on, numbafuse's or not (the same files, in a safe order).
    False where it cannot (not POSIX; a numba whose cache file lacks the methods used)."""
    cls = getattr(caching, "IndexDataCacheFile", None)
    needed = ("save", "_load_index", "_save_index", "_save_data", "_data_name")
    if fcntl is None or cls is None or not all(hasattr(cls, n) for n in needed):
        return False
    if not hasattr(cls.save, "unlocked"):
        cls.save = _locked(cls.save)
    return True


def install(package_dir: str, name: str) -> None:
    """Stamp the cached functions under ``package_dir`` (the package ``name``) by their imports
    too, and lock the caches' saves (:func:`locked_saves`); numba's CPU cache now,
    numba-cuda's where ``numba.cuda`` is imported (call again after importing it). Functions
    decorated before this call keep numba's stamp."""
    entry = (os.path.abspath(package_dir), name)
    if entry not in _ROOTS:
        _ROOTS.append(entry)
    from numba.core import caching
    _patch(caching.CacheImpl)
    locked_saves(caching)
    cuda_caching = sys.modules.get("numba.cuda.core.caching")
    if cuda_caching is not None and hasattr(cuda_caching, "CacheImpl"):
        _patch(cuda_caching.CacheImpl)
        locked_saves(cuda_caching)


def install_numbafuse() -> None:
    """:func:`install` for numbafuse's own package."""
    install(os.path.dirname(os.path.abspath(__file__)), __name__.partition(".")[0])
