"""The CUDA backend: the one module of numbafuse that imports ``numba.cuda``.

Every CUDA kernel module takes ``cuda`` from here (``from numbafuse.cuda import numba_cuda as
cuda``), so moving to another compiler is a change to this file alone. The CPU path never
imports it: it is imported when the first device array reaches an op (or a CUDA kernel module
is imported, as the PTX tests do).

Supported compiler
------------------
numba-cuda ``SUPPORTED_NUMBA_CUDA`` (tested: 0.30.4, with numba 0.68, on an H100 and under
the CUDA simulator). numba-cuda is in maintenance mode since June 2026 (security and critical
fixes only, through CUDA 13; NVIDIA/numba-cuda#902). Its successor, numba-cuda-mlir, has no
CUDA simulator and needs a CUDA driver even to emit PTX, so it cannot be tested on machines
without a GPU; numbafuse stays on numba-cuda until that changes.

NumPy 2.5
---------
NumPy 2.5 removed ``np.row_stack``; numba-cuda 0.30 still registers an overload for it, so
every kernel compilation fails inside numba-cuda with ``AttributeError: module 'numpy' has
no attribute 'row_stack'``. The ``cuda`` and ``test`` extras therefore install ``numpy<2.5``,
and importing this module with an incompatible pair raises a ``RuntimeError`` that names the
versions and the fix (:func:`compatibility_error`), instead of that ``AttributeError`` from
deep inside the compiler. The bound can be lifted once a numba-cuda release guards the
overload (numba itself does since 0.67): raise ``FIRST_NUMBA_CUDA_WITH_NUMPY_25`` then.
"""
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


require_compatible()

from numba import config as numba_config  # noqa: E402

try:
    from numba import cuda as numba_cuda  # noqa: E402  (the one import of numba.cuda)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("numbafuse: CUDA arrays need numba-cuda: pip install 'numbafuse[cuda]'"
                      ) from exc

SIMULATOR = bool(numba_config.ENABLE_CUDASIM)   # NUMBA_ENABLE_CUDASIM=1: the CUDA simulator


def is_available() -> bool:
    """True when a CUDA device (or the simulator) can run kernels."""
    return bool(numba_cuda.is_available())


def current_device_id() -> int:
    """The id of numba's current CUDA device: where numbafuse's kernels run."""
    return int(numba_cuda.get_current_device().id)


def as_device_array(a):
    """A numba device array viewing ``a`` (zero-copy for ``__cuda_array_interface__`` objects)."""
    if getattr(a, "__cuda_ndarray__", False):
        return a
    return numba_cuda.as_cuda_array(a)


def device_array(shape, dtype):
    """An uninitialised device array."""
    return numba_cuda.device_array(shape, dtype)


def to_device(a: np.ndarray):
    """A device copy of the C-contiguous host array ``a``."""
    return numba_cuda.to_device(a)


def to_host(a) -> np.ndarray:
    return as_device_array(a).copy_to_host()
