"""The CUDA backend module (numbafuse/cuda/__init__.py): the one import of numba.cuda, and the clear
error for a NumPy that numba-cuda cannot work with."""
import ast
import pathlib
import sys

import numpy as np
import pytest

import numbafuse as nf

PACKAGE = pathlib.Path(nf.__file__).parent


def _imports_numba_cuda(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("numba.cuda")
                                                for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("numba.cuda"):
                return True
            if node.module == "numba" and any(a.name == "cuda" for a in node.names):
                return True
    return False


def test_numba_cuda_is_imported_in_one_module_only():
    importers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                       if _imports_numba_cuda(ast.parse(p.read_text())))
    # the CUDA backend package: its __init__ (numba_cuda for everyone) and arrays.py (numba's
    # DeviceNDArray, subclassed)
    assert importers == ["cuda/__init__.py", "cuda/arrays.py"]


@pytest.mark.parametrize("numpy_version", ["2.5.0", "2.5.5", "3.0.0rc1"])
def test_numpy_25_with_numba_cuda_030_is_refused_with_the_fix(numpy_version):
    from numbafuse import cuda
    message = cuda.compatibility_error(numpy_version, "0.30.4")
    assert f"NumPy {numpy_version}" in message and "numba-cuda 0.30.4" in message
    assert "pip install 'numpy<2.5'" in message
    with pytest.raises(RuntimeError, match="np.row_stack"):
        cuda.require_compatible(numpy_version, "0.30.4")


@pytest.mark.parametrize("numpy_version", ["1.26.4", "2.2.6", "2.4.6"])
def test_numpy_before_25_is_fine(numpy_version):
    from numbafuse import cuda
    assert cuda.compatibility_error(numpy_version, "0.30.4") is None
    cuda.require_compatible(numpy_version, "0.30.4")


def test_a_numba_cuda_release_that_guards_row_stack_lifts_the_refusal(monkeypatch):
    from numbafuse import cuda
    monkeypatch.setattr(cuda.compat, "FIRST_NUMBA_CUDA_WITH_NUMPY_25", "0.31.0")
    assert cuda.compatibility_error("2.5.0", "0.31.0") is None
    assert cuda.compatibility_error("2.5.0", "0.30.4") is not None


class _FakeDeviceArray:
    """Looks like a CUDA array to the dispatch (``__cuda_array_interface__``)."""

    def __init__(self, shape):
        self.shape, self.dtype = shape, np.dtype(np.float32)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "data": (0, False),
                                         "version": 3, "strides": None}


def test_first_cuda_call_with_an_incompatible_numpy_raises_runtime_error(monkeypatch):
    # What a user with NumPy 2.5 sees at the first CUDA call: the RuntimeError naming the
    # versions and the fix, not an AttributeError from inside numba-cuda.
    import numbafuse
    monkeypatch.setattr(np, "__version__", "2.5.1")
    monkeypatch.delitem(sys.modules, "numbafuse.cuda", raising=False)
    monkeypatch.delattr(numbafuse, "cuda", raising=False)
    with pytest.raises(RuntimeError, match=r"NumPy 2\.5\.1 .*pip install 'numpy<2\.5'"):
        nf.conv2d(_FakeDeviceArray((1, 1, 3, 3)), _FakeDeviceArray((1, 1, 2, 2)))
