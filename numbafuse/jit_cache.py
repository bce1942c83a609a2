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
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys

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


def install(package_dir: str, name: str) -> None:
    """Stamp the cached functions under ``package_dir`` (the package ``name``) by their imports
    too; numba's CPU cache now, numba-cuda's where ``numba.cuda`` is imported (call again after
    importing it). Functions decorated before this call keep numba's stamp."""
    entry = (os.path.abspath(package_dir), name)
    if entry not in _ROOTS:
        _ROOTS.append(entry)
    from numba.core import caching
    _patch(caching.CacheImpl)
    cuda_caching = sys.modules.get("numba.cuda.core.caching")
    if cuda_caching is not None and hasattr(cuda_caching, "CacheImpl"):
        _patch(cuda_caching.CacheImpl)


def install_numbafuse() -> None:
    """:func:`install` for numbafuse's own package."""
    install(os.path.dirname(os.path.abspath(__file__)), __name__.partition(".")[0])
