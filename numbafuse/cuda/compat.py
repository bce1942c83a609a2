"""Which NumPy and numba-cuda pairs the CUDA backend can run with (see ``numbafuse.cuda``'s
docstring, "NumPy 2.5"): checked before ``numba.cuda`` is imported."""
from __future__ import annotations

from importlib import metadata

import numpy as np

SUPPORTED_NUMBA_CUDA = ">=0.20, tested 0.30.4"
NUMPY_WITHOUT_ROW_STACK = (2, 5)
# No numba-cuda release works with NumPy >= 2.5 yet; the first that does goes here.
FIRST_NUMBA_CUDA_WITH_NUMPY_25 = None


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def compatibility_error(numpy_version: str, numba_cuda_version: str | None) -> str | None:
    """Why this NumPy / numba-cuda pair cannot compile CUDA kernels, or None if it can."""
    if _version_tuple(numpy_version)[:2] < NUMPY_WITHOUT_ROW_STACK:
        return None
    if numba_cuda_version is not None and FIRST_NUMBA_CUDA_WITH_NUMPY_25 is not None and \
            _version_tuple(numba_cuda_version) >= _version_tuple(FIRST_NUMBA_CUDA_WITH_NUMPY_25):
        return None
    return (f"numbafuse: the CUDA backend cannot run with NumPy {numpy_version} and numba-cuda "
            f"{numba_cuda_version or '(version unknown)'}: NumPy 2.5 removed np.row_stack, "
            f"which numba-cuda 0.30 (in maintenance mode) still registers, so every kernel "
            f"compilation fails. Install NumPy < 2.5 in this environment: "
            f"pip install 'numpy<2.5' (or reinstall with pip install 'numbafuse[cuda]', "
            f"which pins it). The CPU path is unaffected.")


def _numba_cuda_version() -> str | None:
    try:
        return metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return None


def require_compatible(numpy_version: str | None = None,
                       numba_cuda_version: str | None = None) -> None:
    """Raise ``RuntimeError`` when the installed NumPy and numba-cuda cannot work together."""
    message = compatibility_error(numpy_version or np.__version__,
                                  numba_cuda_version or _numba_cuda_version())
    if message:
        raise RuntimeError(message)
