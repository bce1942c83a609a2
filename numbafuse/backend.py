"""Host and device arrays: which backend a call runs on, allocation and copies.

The lowest layer above the CUDA backend module (``numbafuse/cuda/``): it knows NumPy arrays
and CUDA arrays (numba device arrays, or anything with ``__cuda_array_interface__``, e.g. CuPy
arrays and PyTorch CUDA tensors, viewed zero-copy), and nothing of Tensors, ops or kernels.
``numbafuse.cuda`` (and with it numba-cuda) is imported only when a device array is met, so
CPU users never need numba-cuda.
"""
from __future__ import annotations

import numpy as np

CPU = "cpu"
CUDA = "cuda"
BACKENDS = (CPU, CUDA)


def _cuda():
    from . import cuda  # the CUDA backend, imported lazily: the CPU path never needs numba-cuda

    return cuda


def is_device_array(a) -> bool:
    """True for numba device arrays (real or simulated) and ``__cuda_array_interface__`` objects.

    NumPy arrays and CPU torch tensors are answered first: a CPU tensor's
    ``__cuda_array_interface__`` is a property that raises, which ``hasattr`` turns into
    False at the cost of an exception (~2 us a call, twice per numbafuse.torch batch norm)."""
    if a.__class__ is np.ndarray:
        return False
    if getattr(a, "__cuda_ndarray__", False):
        return True
    if getattr(a, "is_cuda", None) is False:          # a torch tensor on the CPU
        return False
    return hasattr(a, "__cuda_array_interface__")


def as_device_array(a):
    """A numba device array viewing ``a`` (zero-copy for ``__cuda_array_interface__`` objects)."""
    if getattr(a, "__cuda_ndarray__", False):
        return a
    return _cuda().as_device_array(a)


def backend_of(op: str, **arrays) -> str:
    """``"cpu"`` or ``"cuda"`` for the arrays of one call (``None`` entries are ignored).

    Raises ``TypeError`` naming the op and the arguments when host and device arrays are
    mixed, or when an argument is not an array.
    """
    host, device = [], []
    for name, a in arrays.items():
        if a is None:
            continue
        if is_device_array(a):
            device.append(name)
        elif isinstance(a, np.ndarray):
            host.append(name)
        else:
            raise TypeError(
                f"{op}: {name} must be a NumPy array or a CUDA array, got {type(a).__name__}")
    if host and device:
        raise TypeError(
            f"{op}: cannot mix host and device arrays ({', '.join(host)} on the host, "
            f"{', '.join(device)} on the device)")
    return CUDA if device else CPU


def backend_of_array(a) -> str:
    """The backend of one array (already known to be an array)."""
    return CPU if isinstance(a, np.ndarray) else CUDA


def host_contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` if C-contiguous, else a C-contiguous copy (0-d arrays stay 0-d)."""
    return a if a.flags.c_contiguous else np.array(a, order="C")


def empty(backend: str, shape, dtype):
    """An uninitialised C-contiguous array on ``backend``."""
    if backend == CPU:
        return np.empty(shape, dtype)
    return _cuda().device_array(shape, dtype)


def to_host(a) -> np.ndarray:
    """``a`` as a host array (itself if it is one; a copy of device data)."""
    if isinstance(a, np.ndarray):
        return a
    return _cuda().to_host(a)


def to_device(a):
    """``a`` as a numba device array (itself, viewed, if it already is a CUDA array)."""
    if is_device_array(a):
        return as_device_array(a)
    return _cuda().to_device(host_contiguous(np.asarray(a)))


def upload(a: np.ndarray):
    """A device copy of host array ``a`` by an asynchronous copy, ordered before the kernels
    launched after it (``numbafuse.cuda.upload``)."""
    return _cuda().upload(a)


def to_backend(backend: str, a):
    """``a`` on ``backend`` (no copy if it is there already)."""
    return to_device(a) if backend == CUDA else to_host(a)


def copy(a):
    """A fresh C-contiguous copy of the contiguous array ``a`` on its own device."""
    if isinstance(a, np.ndarray):
        return a.copy()
    return _cuda().copy_device(as_device_array(a))


def require_eager(what: str) -> None:
    """A RuntimeError if a CUDA graph is being captured (``numbafuse.cuda.graph``): ``what``
    would run once during the capture, not at each replay."""
    import sys
    cuda = sys.modules.get(f"{__package__}.cuda")
    if cuda is not None:
        cuda.require_eager(what)


def memory_key(a):
    """What identifies the memory behind ``a`` (its owner's id, or the device pointer); None
    where that cannot be told (the simulator's device arrays)."""
    if isinstance(a, np.ndarray):
        return id(a if a.base is None else a.base)
    values = getattr(a, "__dict__", {}).get("_nf_values")
    if values is not None:           # its kernel parameters, kept on it: the pointer is [4]
        return values[4]
    interface = getattr(a, "__cuda_array_interface__", None)
    return None if interface is None else interface["data"][0]
