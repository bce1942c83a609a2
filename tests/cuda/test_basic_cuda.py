"""The unfused ops of ops/basic.py on device arrays vs numbafuse.reference, tiny shapes.

Run: NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda/test_basic_cuda.py -q -p no:cacheprovider
(conftest shrinks the launch sizes so these tiny inputs span several blocks.)
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import cuda

import numbafuse as nf
from numbafuse import reference as ref
import numbafuse.testing.strategies as nfs

TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-12)}
EXAMPLES = 5                 # the simulator runs every thread in Python: few, tiny examples
seeds = st.integers(0, 2**32 - 1)


def seeded(shape, dtype, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def host_close(device_array, expected, dtype):
    assert nf.Tensor(device_array).device == "cuda"               # the result stayed on device
    actual = device_array.copy_to_host()
    assert actual.dtype == np.dtype(dtype)
    np.testing.assert_allclose(actual, expected, **TOL[dtype])


def run_on_device(fn, inputs, gy):
    """Forward and backward of ``fn`` on device Tensors: (y, [grad of each input])."""
    tensors = [nf.Tensor(dev(a), requires_grad=True) for a in inputs]
    y = fn(*tensors)
    y.backward(dev(gy))
    return y.data, [t.grad for t in tensors]


@settings(max_examples=EXAMPLES)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), nfs.dtypes(), seeds)
def test_relu(shape, dtype, seed):
    x, gy = seeded(shape, dtype, seed), seeded(shape, dtype, seed + 1)
    y, (gx,) = run_on_device(nf.relu, [x], gy)
    host_close(y, ref.relu(x), dtype)
    host_close(gx, ref.relu_backward(gy, x), dtype)


@settings(max_examples=EXAMPLES)
@given(nfs.dtypes(), st.tuples(*[st.integers(1, 4)] * 3), st.booleans(), seeds)
def test_linear(dtype, sizes, with_bias, seed):
    N, F_in, F_out = sizes
    x, w = seeded((N, F_in), dtype, seed), seeded((F_out, F_in), dtype, seed + 1)
    b = seeded((F_out,), dtype, seed + 2) if with_bias else None
    gy = seeded((N, F_out), dtype, seed + 3)
    y, grads = run_on_device(nf.linear, [x, w] + ([b] if with_bias else []), gy)
    host_close(y, ref.linear(x, w, b), dtype)
    for g, expected in zip(grads, ref.linear_backward(gy, x, w)):
        host_close(g, expected, dtype)


def test_linear_spans_several_tiles():
    # TILE is 16: 17 rows/features make a 2x2 grid of output tiles and two k-steps
    x, w, b = seeded((17, 18), np.float32, 0), seeded((17, 18), np.float32, 1), seeded(
        17, np.float32, 2)
    host_close(nf.linear(dev(x), dev(w), dev(b)), ref.linear(x, w, b), np.float32)


@settings(max_examples=EXAMPLES)
@given(nfs.dtypes(), nfs.layouts(), st.sampled_from([(2, None), ((2, 3), 1), (3, (1, 2))]),
       st.booleans(), seeds)
def test_max_pool2d(dtype, layout, window, ties, seed):
    k, stride = window
    shape = (2, 2, 4, 5) if layout == "NCHW" else (2, 4, 5, 2)
    rng = np.random.default_rng(seed)
    x = (rng.integers(-1, 2, shape) if ties else rng.standard_normal(shape)).astype(dtype)
    y_ref = ref.max_pool2d(x, k, stride, layout)
    gy = seeded(y_ref.shape, dtype, seed + 1)
    t = nf.Tensor(dev(x), requires_grad=True)
    y = nf.max_pool2d(t, k, stride, layout=layout)
    argmax = y._fn.saved.argmax                                     # the only residual
    assert set(vars(y._fn.saved)) == {"argmax"} and nf.saved_bytes(y) == y.data.size
    assert nf.Tensor(argmax).device == "cuda" and argmax.dtype == np.uint8
    y.backward(dev(gy))
    host_close(y.data, y_ref, dtype)
    host_close(t.grad, ref.max_pool2d_backward(gy, x, k, stride, layout), dtype)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_max_pool2d_nan_and_overlapping_windows(layout):
    # 2x2 windows, stride 1 over a 3x3 plane: the NaN at the centre is every window's max
    x = np.array([[[[0.0, 1.0, 0.0], [2.0, np.nan, 3.0], [0.0, np.nan, 0.0]]]])  # (1, 1, 3, 3)
    x = x if layout == "NCHW" else x.transpose(0, 2, 3, 1)
    gy = seeded((1, 1, 2, 2), np.float64, 0)                       # C == 1: same in NHWC
    gy = gy if layout == "NCHW" else gy.reshape(1, 2, 2, 1)
    y, (gx,) = run_on_device(lambda t: nf.max_pool2d(t, 2, 1, layout=layout), [x], gy)
    assert np.isnan(y.copy_to_host()).all()
    host_close(gx, ref.max_pool2d_backward(gy, x, 2, 1, layout), np.float64)
    assert gx.copy_to_host().reshape(9)[4] == pytest.approx(gy.sum())


def test_max_pool2d_windows_over_256_taps():
    x = seeded((1, 1, 17, 17), np.float32, 0)                       # 289 taps: uint16 argmax
    gy = seeded((1, 1, 1, 1), np.float32, 1)
    y, (gx,) = run_on_device(lambda t: nf.max_pool2d(t, 17), [x], gy)
    host_close(y, ref.max_pool2d(x, 17), np.float32)
    host_close(gx, ref.max_pool2d_backward(gy, x, 17), np.float32)


@settings(max_examples=EXAMPLES)
@given(nfs.dtypes(), nfs.layouts(), st.tuples(*[st.integers(1, 3)] * 4), seeds)
def test_global_avg_pool2d(dtype, layout, shape, seed):
    x = seeded(shape, dtype, seed)
    y_ref = ref.global_avg_pool2d(x, layout)
    gy = seeded(y_ref.shape, dtype, seed + 1)
    y, (gx,) = run_on_device(lambda t: nf.global_avg_pool2d(t, layout=layout), [x], gy)
    host_close(y, y_ref, dtype)
    host_close(gx, ref.global_avg_pool2d_backward(gy, x.shape, layout), dtype)


def test_flatten_and_squeeze():
    x = seeded((2, 1, 3, 2), np.float64, 0)
    gy = seeded((2, 6), np.float64, 1)
    y, (gx,) = run_on_device(lambda t: nf.flatten(nf.squeeze(t, 1)), [x], gy)
    host_close(y, x.reshape(2, 6), np.float64)
    host_close(gx, gy.reshape(x.shape), np.float64)


@settings(max_examples=EXAMPLES)
@given(nfs.dtypes(), st.sampled_from([np.int32, np.int64]), st.integers(1, 5),
       st.integers(1, 4), st.sampled_from([1.0, 30.0]), seeds)
def test_cross_entropy(dtype, label_dtype, N, L, scale, seed):
    logits = seeded((N, L), dtype, seed, scale)
    labels = np.random.default_rng(seed).integers(0, L, N).astype(label_dtype)
    t = nf.Tensor(dev(logits), requires_grad=True)
    y = nf.cross_entropy(t, dev(labels))
    assert y.shape == ()
    host_close(y.data, ref.cross_entropy(logits, labels), dtype)
    y.backward()                                                    # 0-d: defaults to 1
    host_close(t.grad, ref.cross_entropy_backward(1.0, logits, labels), dtype)


def test_gradcheck_on_the_device():
    x = seeded((1, 2, 2, 2), np.float64, 0)
    w = seeded((3, 2), np.float64, 1)
    labels = dev(np.array([1]))

    def net(x, w):
        return nf.cross_entropy(nf.linear(nf.global_avg_pool2d(nf.relu(x)), w), labels)

    tensors = [nf.Tensor(dev(a), requires_grad=True) for a in (x, w)]
    assert nf.gradcheck(net, tensors, mode="directional", directions=1)


BAD = [
    (lambda: nf.linear(dev(np.zeros((2, 3))), np.zeros((4, 3))), TypeError,
     ["linear", "host", "device"]),
    (lambda: nf.cross_entropy(dev(np.zeros((2, 3))), np.array([0, 1])), TypeError,
     ["cross_entropy", "labels"]),
    (lambda: nf.cross_entropy(dev(np.zeros((2, 3))), dev(np.array([0, 3]))), ValueError,
     ["cross_entropy", "labels", "[0, 3)"]),
    (lambda: nf.cross_entropy(dev(np.zeros((2, 3))), dev(np.array([-1, 0], np.int32))),
     ValueError, ["cross_entropy", "labels"]),
    (lambda: nf.max_pool2d(dev(np.zeros((1, 1, 2, 2))), 3), ValueError,
     ["max_pool2d", "k", "larger"]),
    (lambda: nf.relu(dev(np.zeros(3, np.int32))), TypeError, ["relu", "x"]),
]


@pytest.mark.parametrize("call,exc,words", BAD, ids=range(len(BAD)))
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("threads", [32, 64])
def test_cross_entropy_and_linear_with_warp_sized_blocks(threads, monkeypatch):
    # GPU-like block sizes: the one-block loss mean strides unevenly over N = 77 rows (its
    # shared-memory tree over 32/64 threads), linear's tiles grid-stride over 3 blocks
    from numbafuse.kernels import cuda_config as config
    monkeypatch.setattr(config, "threads", threads)
    logits = seeded((77, 3), np.float64, 3)
    labels = np.random.default_rng(3).integers(0, 3, 77)
    t = nf.Tensor(dev(logits), requires_grad=True)
    y = nf.cross_entropy(t, dev(labels))
    host_close(y.data, ref.cross_entropy(logits, labels), np.float64)
    y.backward()
    host_close(t.grad, ref.cross_entropy_backward(1.0, logits, labels), np.float64)
    x, w, b = (seeded(s, np.float64, i) for i, s in enumerate([(20, 17), (18, 17), 18]))
    gy = seeded((20, 18), np.float64, 7)
    y, grads = run_on_device(nf.linear, [x, w, b], gy)
    host_close(y, ref.linear(x, w, b), np.float64)
    for g, r in zip(grads, ref.linear_backward(gy, x, w)):
        host_close(g, r, np.float64)
