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
