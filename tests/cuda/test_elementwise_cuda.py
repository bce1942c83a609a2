"""The tape's device arithmetic (kernels/elementwise/cuda.py, ops/arith.py) vs NumPy."""
import numpy as np
import pytest
from numba import cuda

import numbafuse as nf
from numbafuse.kernels.elementwise import cuda as ew
from numbafuse.ops.arith import mean


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_axpby_mul_fill(dtype, rng):
    x = rng.standard_normal((3, 7)).astype(dtype)
    y = rng.standard_normal((3, 7)).astype(dtype)
    dx, dy = cuda.to_device(x), cuda.to_device(y)
    np.testing.assert_allclose(ew.axpby(2.0, dx, -1.0, dy).copy_to_host(), 2 * x - y, rtol=1e-6)
    np.testing.assert_allclose(ew.mul(dx, dy).copy_to_host(), x * y, rtol=1e-6)
    np.testing.assert_array_equal(ew.fill(cuda.device_array((5,), dtype), 3.0).copy_to_host(),
                                  np.full(5, 3.0, dtype))


def test_sum_is_deterministic_and_right(rng):
    x = rng.standard_normal(101)  # more than threads * reduce_blocks: grid-stride + partials
    d = cuda.to_device(x)
    a, b = ew.sum_all(d).copy_to_host(), ew.sum_all(d).copy_to_host()
    assert a.shape == ()
    np.testing.assert_allclose(a, x.sum(), rtol=1e-12)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("view", ["2d strided slice", "3d strided slice", "4d strided slice"])
def test_contiguous_copy_of_a_strided_view(view, rng):
    # Only views numba-cuda makes on a real device: strided slices. (.T of a device array is
    # no view there: numba-cuda copies a 2-d one into a new C-contiguous array, seen on an
    # H100, and refuses 3/4-d ones, which the simulator alone allows.)
    if view == "2d strided slice":
        x = rng.standard_normal((5, 7))
        t, expected = cuda.to_device(x)[1:, ::3], x[1:, ::3]
    elif view == "3d strided slice":
        x = rng.standard_normal((2, 7, 4))
        t, expected = cuda.to_device(x)[:, ::2, 1:], x[:, ::2, 1:]
    else:
        x = rng.standard_normal((3, 2, 5, 6))
        t, expected = cuda.to_device(x)[::2, :, 1::2, ::3], x[::2, :, 1::2, ::3]
    assert not t.is_c_contiguous()
    out = ew.contiguous_copy(t)
    assert out.is_c_contiguous()
    np.testing.assert_array_equal(out.copy_to_host(), expected)


def test_tape_arithmetic_on_device(rng):
    x = rng.standard_normal((2, 3))
    z = rng.standard_normal((2, 3))
    tx = nf.Tensor(cuda.to_device(x), requires_grad=True)
    tz = nf.Tensor(cuda.to_device(z), requires_grad=True)
    loss = ((tx * tz - tz) * 2.0 + 1.0).mean()
    assert loss.device == "cuda"
    loss.backward()
    np.testing.assert_allclose(loss.numpy(), ((x * z - z) * 2 + 1).mean(), rtol=1e-12)
    np.testing.assert_allclose(tx.grad.copy_to_host(), 2 * z / x.size, rtol=1e-12)
    np.testing.assert_allclose(tz.grad.copy_to_host(), 2 * (x - 1) / x.size, rtol=1e-12)


def test_mixing_host_and_device_is_a_type_error(rng):
    x = rng.standard_normal(3)
    with pytest.raises(TypeError, match="add: cannot mix host and device"):
        nf.add(x, cuda.to_device(x))


def test_scaling_and_sums_keep_infinities():
    # axpby(a, x, 0, x) is how the tape scales (neg, affine, mean): 0*inf must not make a NaN
    x = np.array([1.0, np.inf, 2.0, -3.0], np.float32)
    d = cuda.to_device(x)
    np.testing.assert_array_equal(ew.axpby(2.0, d, 0.0, d).copy_to_host(), 2 * x)
    assert ew.sum_all(d).copy_to_host() == np.inf
    assert mean(d).copy_to_host() == np.inf
    assert np.isnan(mean(cuda.to_device(np.array([1.0, np.nan]))).copy_to_host())


@pytest.mark.parametrize("threads", [32, 64])
def test_sum_with_warp_sized_blocks(threads, monkeypatch, rng):
    # real-GPU-like block sizes, several blocks, a grid-stride loop whose threads leave at
    # different iterations (n is not a multiple of blocks * threads)
    from numbafuse.kernels.cuda import config
    monkeypatch.setattr(config, "threads", threads)
    x = rng.standard_normal(3 * threads * 2 + 37)
    d = cuda.to_device(x)
    a, b = ew.sum_all(d).copy_to_host(), ew.sum_all(d).copy_to_host()
    np.testing.assert_allclose(a, x.sum(), rtol=1e-12)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("bad", [0, 96, 512])
def test_block_size_must_be_a_power_of_two_within_block(bad, monkeypatch):
    from numbafuse.kernels.cuda import config
    monkeypatch.setattr(config, "threads", bad)
    with pytest.raises(ValueError, match="threads must be a power of two"):
        ew.sum_all(cuda.to_device(np.ones(4)))
