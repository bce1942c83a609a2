"""Every numba.cuda kernel launch of numbafuse goes through :func:`launch`.

numba's own launch, ``kernel[grid, block](*args)``, re-types every argument, turns each
array into a cuda.core ``StridedMemoryView`` through its ``__cuda_array_interface__``
dictionary, builds ctypes values and a ``LaunchConfig``, and warns about small grids, at
every call: on an H100, 19 us for one argument and 61-92 us for thirteen, for a few
microseconds of driver work. A *prepared launch* does that work once per (kernel, argument
types): it compiles (or loads from the disk cache) numba's kernel for those types, keeps its
cuda.core ``Kernel`` and one *packer* per argument type, and at each call only lays the
argument values out in numba's kernel ABI and calls ``cuda.core.launch``.

numba's kernel ABI, as its ``_Kernel._prepare_args`` lays it out (and as
``tests/test_cuda_launch.py`` checks against that very function):

    array (ndim d)   meminfo 0, parent 0, nitems, itemsize, data pointer, shape[d], strides[d]
                     (every value an intptr; strides in bytes)
    integer          a ctypes integer of its width
    float32/64       ctypes.c_float / ctypes.c_double
    boolean          the Python bool
    tuple            its members, flattened in order

The kinds of launch (``cuda.config.launch``):

- ``"prepared"`` (default on a GPU): the above;
- ``"numba"``: numba's own ``kernel[grid, block](*args)``, for comparison (``NUMBAFUSE_CUDA_
  LAUNCH=numba`` in the environment). Under the CUDA simulator every launch takes this path
  (the simulator runs kernels as Python; there is no ABI to prepare).

During a CUDA graph capture (``numbafuse.cuda.graph``) a launch goes into the graph being
built (cuda.core's ``launch`` takes the GraphBuilder as its stream) and the pool blocks among
its arguments are held by the graph; under the simulator it is recorded for the replay.

Observers (``observe``) see every launch, whichever the path: the tests count launches and
their argument values with them.
"""
from __future__ import annotations

import ctypes

import numpy as np
from numba import types

from ...cuda import SIMULATOR, argument_type, capture_in_progress, default_stream
from . import config

_PREPARED = {}          # (kernel, argument type key) -> _Prepared
_CONFIGS = {}           # (grid, block) -> cuda.core LaunchConfig
_OBSERVERS = []         # callables (kernel, args), see observe()
_CORE = []              # [(cuda.core's launch, numba's default stream)], made on first use


def observe(callback):
    """Call ``callback(kernel, args)`` before every launch; returns a function that stops it."""
    _OBSERVERS.append(callback)
    return lambda: _OBSERVERS.remove(callback)


def launch(kernel, grid, block, *args):
    """Launch the numba.cuda ``kernel`` over ``grid`` blocks of ``block`` threads (ints or
    tuples) on numba's default stream."""
    for callback in _OBSERVERS:
        callback(kernel, args)
    capture = capture_in_progress()
    if SIMULATOR or config.launch == "numba":
        if capture is None:
            kernel[grid, block](*args)
        elif SIMULATOR:                  # the simulator's graph: the launch, recorded
            capture.launches.append(lambda: kernel[grid, block](*args))
        else:
            raise RuntimeError("numbafuse.cuda.graph: capturing needs numbafuse's prepared "
                               "launches (NUMBAFUSE_CUDA_LAUNCH=numba launches on numba's "
                               "default stream, outside the graph)")
        return
    keys, values = [], []
    fast = _flatten(args, keys, values)      # the common arguments: no packer needed
    key = (kernel, tuple(keys) if fast else tuple(map(_type_key, args)))
    prepared = _PREPARED.get(key)
    if prepared is None:
        prepared = _PREPARED[key] = _Prepared(kernel, args)
    if not fast:
        values = []
        for pack, value in zip(prepared.packers, args):
            pack(value, values)
    conf = _CONFIGS.get((grid, block))
    if conf is None:
        conf = _CONFIGS[(grid, block)] = _launch_config(grid, block)
    core_launch, stream = _CORE[0] if _CORE else _core()
    if capture is not None:              # into the graph, which holds the memory it uses
        capture.use(args)
        stream = capture.builder
    core_launch(stream, conf, prepared.kernel, *values)


def _flatten(args, keys, values):
    """The fast path of :func:`launch`: append each argument's :func:`_type_key` to ``keys``
    and its kernel parameters to ``values``, as its packer would lay them out, for the
    arguments numbafuse passes (numba device arrays, Python ints, floats and bools, tuples of
    them). Python scalars go as they are: cuda.core's launch passes an int as a 64-bit
    integer, a float as a double and a bool as one byte, which is numba's ABI for the int64,
    float64 and boolean that numba types them as (``tests/test_cuda_launch.py`` compares the
    bytes with the packers'). (An int past 2**63 - 1, which numba would type uint64, is
    refused by cuda.core with an OverflowError; numbafuse passes none.) False, with ``keys``
    and ``values`` partly filled, where an argument needs its packer (a NumPy scalar, a
    foreign CUDA array, a host array)."""
    for value in args:
        cls = value.__class__
        if cls is int or cls is float or cls is bool:
            keys.append(cls)
            values.append(value)
        elif cls is tuple:
            members = []
            if not _flatten(value, members, values):
                return False
            keys.append(tuple(members))
        else:
            cache = getattr(value, "__dict__", None)
            if cache is None or not getattr(value, "__cuda_ndarray__", False):
                return False
            key = cache.get("_nf_type_key")
            if key is None:
                key = _type_key(value)
            packed = cache.get("_nf_values")
            if packed is None:
                packed = cache["_nf_values"] = _array_values(value)
            keys.append(key)
            values += packed
    return True


def _array_values(a):
    """A numba device array's kernel parameters (its pointer, shape and strides never
    change, so they are kept on it)."""
    return (0, 0, a.size, a.dtype.itemsize, a.device_ctypes_pointer.value or 0,
            *a.shape, *a.strides)


def _type_key(value):
    """What decides the kernel's compiled signature, cheaply: a device array's (dtype, ndim,
    layout), which is all its numba type holds (numba-cuda's ``DeviceNDArray._numba_type_``,
    whose making cost ~40 us per array on an H100 host, profiled), a tuple's members' keys,
    else the value's class. A numba device array keeps its key (its shape, strides and dtype
    never change)."""
    cls = value.__class__
    if cls is int or cls is float or cls is bool:       # the common scalars first
        return cls
    if cls is tuple:
        return tuple(map(_type_key, value))
    if getattr(value, "__cuda_ndarray__", False):
        cache = value.__dict__
        key = cache.get("_nf_type_key")
        if key is None:
            key = cache["_nf_type_key"] = (value.dtype, len(value.shape),
                                           _layout(value, value.flags))
        return key
    if cls is np.ndarray:       # its class would not say its dtype or rank: no key fits it
        raise TypeError("kernels.cuda.launch: a host array reached a kernel launch; "
                        "numbafuse moves every array to the device before launching")
    return cls


def _layout(a, flags):
    """numba-cuda's layout of a device array: "C" or "F" when contiguous that way and not
    broadcast (a zero stride), else "A" (as ``DeviceNDArray._numba_type_`` decides)."""
    broadcast = 0 in a.strides and a.size != 0
    if flags["C_CONTIGUOUS"] and not broadcast:
        return "C"
    if flags["F_CONTIGUOUS"] and not broadcast:
        return "F"
    return "A"


class _Prepared:
    """numba's kernel compiled for one signature: its cuda.core Kernel and argument packers."""
    __slots__ = ("kernel", "packers", "argtypes")

    def __init__(self, dispatcher, args):
        self.argtypes = tuple(map(argument_type, args))    # numba-cuda's types, as it types
        compiled = dispatcher.compile(self.argtypes)       # from numba's disk cache if there
        self.kernel = compiled._codelibrary.get_cufunc().kernel
        self.packers = [packer(t) for t in self.argtypes]


def packer(ty):
    """``pack(value, out)``: append ``value``'s kernel parameters for numba type ``ty``."""
    if isinstance(ty, types.Array):
        def pack_array(a, out):
            if not getattr(a, "__cuda_ndarray__", False):    # a foreign CUDA array
                from ...cuda import as_device_array
                a = as_device_array(a)
            cache = a.__dict__
            values = cache.get("_nf_values")
            if values is None:
                values = cache["_nf_values"] = _array_values(a)
            out += values
        return pack_array
    if isinstance(ty, types.BaseTuple):
        members = [packer(t) for t in ty]

        def pack_tuple(value, out):
            for pack, v in zip(members, value):
                pack(v, out)
        return pack_tuple
    if ty == types.boolean:
        return lambda value, out: out.append(value)
    if isinstance(ty, types.Integer):
        ctype = getattr(ctypes, f"c_{ty}")
        return lambda value, out: out.append(ctype(value))
    if ty == types.float64:
        return lambda value, out: out.append(ctypes.c_double(value))
    if ty == types.float32:
        return lambda value, out: out.append(ctypes.c_float(value))
    raise TypeError(f"kernels.cuda.launch: no prepared launch for arguments of type {ty}")


def _core():
    """(cuda.core's launch, numba's default (legacy) stream), looked up once."""
    if not _CORE:
        import cuda.core
        _CORE.append((cuda.core.launch, default_stream()))
    return _CORE[0]


def _launch_config(grid, block):
    from cuda.core import LaunchConfig
    return LaunchConfig(grid=_dims(grid), block=_dims(block))


def _dims(d):
    """Launch dimensions as Python ints (an int or a tuple of them; NumPy ints accepted)."""
    return tuple(int(n) for n in d) if isinstance(d, tuple) else int(d)
