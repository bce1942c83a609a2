"""Cheap device arrays: numba's DeviceNDArray, made without its constructor.

numba-cuda's DeviceNDArray is made by a constructor that checks its arguments and builds a
"dummy" host array description (Extent objects, flags) up front; its reshape and __getitem__
go through that description and ask the driver for the current context. On an H100 host that
was most of a call's host time: 12 arrays, 9 reshapes and 3 row views in one batch-norm
forward (docs/benchmarks.md#gpu; ``benchmarks/host_path.py`` measures it without a GPU). The
arrays numbafuse makes for itself (pool requests, flat views, rows) are therefore built
directly: a subclass of DeviceNDArray (everything numba and users do with a device array works
on it) whose attributes are set without the checks (the shapes are numbafuse's own,
C-contiguous) and whose description is made only when something asks for it. The launch
(``kernels/cuda/launch.py``) keeps each array's kernel arguments on the array.

Not under the CUDA simulator (its arrays are the simulator's own): there ``flat`` and ``rows``
take numba's reshape and indexing.
"""
from __future__ import annotations

import sys

_ARRAY_CLASS = []          # [PoolArray, numba's DeviceNDArray], made on first use (not
                           # simulated)
_MEMORY_CLASS = []         # [the MemoryPointer subclass], likewise


def array_class():
    """numbafuse's subclass of numba's DeviceNDArray (made on first use)."""
    if not _ARRAY_CLASS:
        from numba.cuda.cudadrv import dummyarray
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

        class PoolArray(DeviceNDArray):
            """A numba device array made by numbafuse (pool memory or a view of it); its
            host description (``_dummy``: flags, reshape, indexing) is built on first use.
            Those :func:`c_array` made are C-contiguous (``_nf_c``); numba's own methods
            (slicing, reshape) make PoolArrays through DeviceNDArray's constructor, which
            may be strided views."""

            def is_c_contiguous(self):
                return "_nf_c" in self.__dict__ or self._dummy.is_c_contig

            def __getattr__(self, name):
                if name != "_dummy":
                    raise AttributeError(name)
                dummy = self._dummy = dummyarray.Array.from_desc(
                    0, self.shape, self.strides, self.dtype.itemsize)
                return dummy

        _ARRAY_CLASS[:] = [PoolArray, DeviceNDArray]
    return _ARRAY_CLASS[0]


def memory_class():
    """numbafuse's subclass of numba's MemoryPointer (made on first use)."""
    if not _MEMORY_CLASS:
        from numba.cuda.cudadrv.driver import MemoryPointer

        class PoolMemory(MemoryPointer):
            """Device memory numba's arrays view: a pool block (``release`` called once, when
            the last reference goes, by ``__del__`` rather than numba's weakref finalizer)
            or a view of another PoolMemory (``owner``, kept alive by the reference)."""

            def __del__(self):
                release = self.__dict__.pop("_release", None)
                if release is not None and not sys.is_finalizing():   # (at exit the pool's
                    release()                   # module globals are gone; so is the context)

            def free(self):                     # numba's forced free
                release = self.__dict__.pop("_release", None)
                if release is None:
                    raise RuntimeError("Freeing dead memory")
                release()

        _MEMORY_CLASS.append(PoolMemory)
    return _MEMORY_CLASS[0]


def memory(context, pointer, nbytes, release=None, owner=None):
    """A numba MemoryPointer of ``nbytes`` at ``pointer`` (a cuda.bindings CUdeviceptr),
    without MemoryPointer's constructor: ``release()`` is called once when it dies (a pool
    block's), or it views ``owner``'s memory and keeps it alive."""
    cls = _MEMORY_CLASS[0] if _MEMORY_CLASS else memory_class()
    m = cls.__new__(cls)
    if release is not None:
        m.__dict__ = dict(context=context, device_pointer=pointer, size=nbytes,
                          _cuda_memsize_=nbytes, is_managed=True, refct=1, handle=pointer,
                          _owner=owner, _release=release)
    else:
        m.__dict__ = dict(context=context, device_pointer=pointer, size=nbytes,
                          _cuda_memsize_=nbytes, is_managed=False, refct=1, handle=pointer,
                          _owner=owner)
    return m


_LAYOUTS = {}           # (shape, dtype) -> (the attributes of a C-contiguous array of them,
                        #   its kernel parameters before and after the pointer)


def c_array(shape, dtype, memory, address=None):
    """A C-contiguous device array of ``shape`` (a tuple of ints) and ``dtype`` (a NumPy
    dtype) over ``memory`` (a numba MemoryPointer), without DeviceNDArray's constructor.
    ``address``: the memory's device address as an int, where the caller knows it: the array
    then carries its kernel parameters (``kernels/cuda/launch.py``) from the start."""
    layout = _LAYOUTS.get((shape, dtype))
    if layout is None:
        itemsize = dtype.itemsize
        size = 1
        for n in shape:
            size *= n
        strides = c_strides(shape, itemsize)
        layout = _LAYOUTS[(shape, dtype)] = (dict(
            ndim=len(shape), shape=shape, strides=strides, dtype=dtype,
            size=size, alloc_size=size * itemsize, stream=0,
            _nf_type_key=(dtype, len(shape), "C"), _nf_c=True),
            (0, 0, size, itemsize), (*shape, *strides))
    cls = _ARRAY_CLASS[0] if _ARRAY_CLASS else array_class()
    a = cls.__new__(cls)
    attributes, head, tail = layout
    attributes = attributes.copy()
    attributes["gpu_data"] = memory
    if address is not None:
        attributes["_nf_values"] = (*head, address, *tail)
    a.__dict__ = attributes
    return a


def _ours(a):
    """Whether ``a`` is a non-empty array :func:`c_array` made (C-contiguous)."""
    return a.size > 0 and "_nf_c" in getattr(a, "__dict__", ())


def flat(a):
    """``a`` (C-contiguous) as a 1-d device array viewing the same memory, kept on ``a``
    (a layer's weights are flattened at every call). numba's own C-contiguous arrays (a
    reshape, a slice: the optimizer's parameter views) get one the same way."""
    if len(a.shape) == 1:
        return a
    cache = getattr(a, "__dict__", None)
    if cache is not None and a.size and _ARRAY_CLASS:
        view = cache.get("_nf_flat")
        if view is not None:
            return view
        if "_nf_c" in cache or (isinstance(a, _ARRAY_CLASS[1]) and a.is_c_contiguous()):
            values = cache.get("_nf_values")
            view = cache["_nf_flat"] = c_array((a.size,), a.dtype, a.gpu_data,
                                               None if values is None else values[4])
            return view
    return a.reshape(a.size)


def rows(a):
    """The rows of a 2-d C-contiguous device array ``a``, as a tuple of 1-d views."""
    if not _ours(a):
        return tuple(a[i] for i in range(a.shape[0]))
    from numba.cuda.cudadrv.driver import binding
    base = a.gpu_data
    start, width = int(base.device_pointer), a.shape[1]
    step = width * a.dtype.itemsize
    return tuple(c_array((width,), a.dtype, memory(
        base.context, binding.CUdeviceptr(start + i * step), step, owner=base.owner),
        start + i * step) for i in range(a.shape[0]))


def c_strides(shape, itemsize):
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))
