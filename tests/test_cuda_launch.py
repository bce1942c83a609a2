"""The prepared launch (numbafuse/kernels/cuda/launch.py) lays kernel arguments out exactly as
numba's own launch does: each packer is checked against numba's ``_Kernel._prepare_args``
itself, on device arrays that view a made-up pointer (no GPU is needed: nothing is launched
or read). On a GPU, tests/cuda/test_prepared_launch_cuda.py compares whole ops bit for bit."""
import ctypes
import os
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1",
                                reason="numba's kernel ABI: the real numba.cuda, not the "
                                       "simulator")

BASE = 1 << 32          # a made-up device address


def _device_array(shape, dtype, strides=None, offset=0):
    from numba.cuda.cudadrv import driver
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    class Context:
        device = None
    dtype = np.dtype(dtype)
    if strides is None:
        strides = tuple(int(s) for s in np.empty(shape, dtype).strides)
    memory = driver.MemoryPointer(Context(), driver.binding.CUdeviceptr(BASE + offset), 1 << 20,
                                  finalizer=lambda: None)
    return DeviceNDArray(shape, strides, dtype, gpu_data=memory)


def _numba_values(value):
    from numba.cuda.dispatcher import _Kernel
    from numba.cuda.typing.typeof import Purpose, typeof
    class Kernel:                    # what _prepare_args reads of a compiled kernel
        extensions = []
        _prepare_args = _Kernel._prepare_args
    out = []
    Kernel()._prepare_args(typeof(value, Purpose.argument), value, 0, [], out)
    return out


def _ours(value):
    from numba.cuda.typing.typeof import Purpose, typeof
    from numbafuse.kernels.cuda import launch as cuda_launch
    out = []
    cuda_launch.packer(typeof(value, Purpose.argument))(value, out)
    return out


def _comparable(values):
    return [(type(v).__name__, v.value) if isinstance(v, ctypes._SimpleCData) else
            ("int", int(v)) if isinstance(v, (int, np.integer)) and not isinstance(v, bool)
            else (type(v).__name__, v) for v in values]


def _arrays():
    return [
        _device_array((7,), np.float32),
        _device_array((3, 5), np.float64),
        _device_array((2, 3, 4, 5), np.float32),
        _device_array((6,), np.uint8),
        _device_array((4, 5), np.int32),
        _device_array((9,), np.int64),
        _device_array((2, 3), np.float32, strides=(40, 8), offset=16),   # a strided view
        _device_array((2, 2, 3), np.float64, strides=(96, 24, 16)),      # strided, 3-d
    ]


@pytest.mark.parametrize("index", range(8))
def test_arrays_are_laid_out_as_numba_does(index):
    a = _arrays()[index]
    assert _comparable(_ours(a)) == _comparable(_numba_values(a))


@pytest.mark.parametrize("value", [3, -7, 2.5, True, False, np.float32(1.5), np.int32(-4),
                                   np.float64(0.1), np.uint8(200)],
                         ids=lambda v: f"{type(v).__name__}({v})")
def test_scalars_are_laid_out_as_numba_does(value):
    assert _comparable(_ours(value)) == _comparable(_numba_values(value))


def test_tuples_are_flattened_as_numba_does():
    a, b = _device_array((3, 5), np.float64), _device_array((4,), np.float32)
    for value in [(a, 1.5, 3, True, b), (b, b, b), (a, (b, 2.0))]:
        assert _comparable(_ours(value)) == _comparable(_numba_values(value))


def test_a_wrong_layout_would_be_caught():
    """The comparison can fail: strides given in elements instead of bytes differ."""
    from numba.cuda.typing.typeof import Purpose, typeof
    from numbafuse.kernels.cuda import launch as cuda_launch
    a = _device_array((3, 5), np.float64)
    real = cuda_launch.packer(typeof(a, Purpose.argument))

    def elements(value, out):
        real(value, out)
        out[-2:] = [s // value.dtype.itemsize for s in value.strides]
    got = []
    elements(a, got)
    assert _comparable(got) != _comparable(_numba_values(a))


def test_equal_type_keys_are_equal_numba_types():
    """The cheap key stands in for numba's type: equal keys, equal types, and the reverse."""
    from numba.cuda.typing.typeof import Purpose, typeof
    from numbafuse.kernels.cuda.launch import _type_key
    arrays = _arrays() + [_device_array((4, 3), np.float32, strides=(4, 16)),     # F order
                          _device_array((3, 4), np.float32, strides=(0, 4)),      # broadcast
                          _device_array((1, 5), np.float32)]
    for a in arrays:
        for b in arrays:
            same_key = _type_key(a) == _type_key(b)
            assert same_key == (typeof(a, Purpose.argument) == typeof(b, Purpose.argument)), \
                (a.shape, a.strides, b.shape, b.strides)


def test_the_type_key_follows_numba_types():
    from numbafuse.kernels.cuda.launch import _type_key
    c1, c2 = _device_array((3, 5), np.float32), _device_array((8, 2), np.float32)
    view = _device_array((2, 3), np.float32, strides=(40, 8))
    assert _type_key(c1) == _type_key(c2)                  # same dtype, ndim and layout
    assert _type_key(c1) != _type_key(view)                # layout A, another compilation
    assert _type_key(c1) != _type_key(_device_array((3, 5), np.float64))
    assert _type_key((c1, 2.0)) == _type_key((c2, 3.0)) != _type_key((c2, 3))


def test_a_host_array_is_refused_not_keyed_by_its_class():
    """A NumPy array's class says nothing of its dtype or rank: two of them would share one
    compiled kernel, so the key refuses them (numbafuse moves arrays to the device first)."""
    from numbafuse.kernels.cuda.launch import _type_key
    with pytest.raises(TypeError, match="host array"):
        _type_key(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="host array"):
        _type_key((1.0, np.zeros((2, 2))))
    assert _type_key(np.float32(1.5)) is np.float32       # a NumPy scalar's class is its type


def test_unsupported_argument_types_are_refused():
    from numba import types
    from numbafuse.kernels.cuda import launch as cuda_launch
    with pytest.raises(TypeError, match="no prepared launch"):
        cuda_launch.packer(types.complex128)


def _parameter_bytes(values, sizes):
    """The bytes cuda.core's launch hands the driver for ``values`` (its ParamHolder, the
    very object ``cuda.core.launch`` builds), the first ``sizes[i]`` of each parameter."""
    from cuda.core import _kernel_arg_handler
    holder = _kernel_arg_handler.ParamHolder(values)
    addresses = (ctypes.c_void_p * len(values)).from_address(holder.ptr)
    return [bytes((ctypes.c_ubyte * n).from_address(a)) for a, n in zip(addresses, sizes)]


def _sizes(values):
    return [ctypes.sizeof(v) if isinstance(v, ctypes._SimpleCData) else
            1 if isinstance(v, bool) else 8 for v in values]


@pytest.mark.parametrize("case", range(6))
def test_the_fast_path_hands_the_driver_the_packers_bytes(case):
    """launch's fast path (``_flatten``) passes Python scalars as they are and a pool array's
    parameters as kept on it: the driver must get the very bytes the packers' ctypes give,
    and the key must be ``_type_key``'s (one compiled kernel per signature either way)."""
    from numbafuse import cuda as nfcuda
    from numbafuse.cuda.arrays import c_array, memory
    from numbafuse.kernels.cuda import launch as cuda_launch

    class Context:
        device = None
    from numba.cuda.cudadrv import driver
    ours = c_array((4, 6), np.dtype(np.float32),
                   memory(Context(), driver.binding.CUdeviceptr(BASE + 64), 96), BASE + 64)
    a, b = _device_array((3, 5), np.float64), _device_array((2, 3), np.float32, (40, 8), 16)
    args = [(ours, 3, 2.5, True), (a, -7, (b, False, 1 << 40)), (ours, ours, 0.1),
            (a, (1, 2), (True, False, True)), (b,), (ours, -1.0e300, 2 ** 63 - 1)][case]
    keys, fast = [], []
    assert cuda_launch._flatten(args, keys, fast)
    assert tuple(keys) == tuple(map(cuda_launch._type_key, args))
    packed = []
    for value in args:
        cuda_launch.packer(nfcuda.argument_type(value))(value, packed)
    assert len(fast) == len(packed)
    sizes = _sizes(packed)
    assert _parameter_bytes(fast, sizes) == _parameter_bytes(packed, sizes)


def test_the_fast_path_leaves_other_arguments_to_the_packers():
    from numbafuse.kernels.cuda import launch as cuda_launch
    a = _device_array((3, 5), np.float64)
    for args in [(a, np.float32(1.5)), (a, (2, np.int32(3))), (np.zeros(3),), (a, 1 + 2j)]:
        assert not cuda_launch._flatten(args, [], [])


def test_a_wrong_fast_path_would_be_caught():
    """The byte comparison can fail: a float32 parameter passed as a Python float (a double)."""
    sizes = _sizes([ctypes.c_float(1.5)])
    assert _parameter_bytes([1.5], sizes) != _parameter_bytes([ctypes.c_float(1.5)], sizes)


def test_numbafuses_arrays_carry_numbas_parameters():
    """A pool array, its flat view and its rows carry their kernel parameters from the
    start (``cuda.arrays.c_array``'s ``address``): they must be what numba lays out."""
    from numba.cuda.cudadrv import driver
    from numbafuse.cuda.arrays import c_array, flat, memory, rows

    class Context:
        device = None
    arrays = []
    for k, (shape, dtype) in enumerate([((4, 6), np.float32), ((7,), np.float64),
                                        ((2, 3, 4, 5), np.float32), ((3, 5), np.uint8)]):
        address = BASE + 4096 * k
        a = c_array(shape, np.dtype(dtype),
                    memory(Context(), driver.binding.CUdeviceptr(address), 1024), address)
        arrays += [a, flat(a)] + (list(rows(a)) if len(shape) == 2 else [])
    for a in arrays:
        assert "_nf_values" in a.__dict__
        assert _comparable(a.__dict__["_nf_values"]) == _comparable(_numba_values(a))
