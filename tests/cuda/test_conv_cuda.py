"""Conv2D -> BiasAdd -> ReLU and the unfused conv2d, bias_add on the device.

Run under the simulator: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda/test_conv_cuda.py``.
Shapes are tiny (the simulator runs every thread in Python); conftest shrinks launch sizes so
they still span several blocks and several reduction splits.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from numba import cuda

import numbafuse as nf
import numbafuse.testing.strategies as nfs
from numbafuse import backend
from numbafuse import reference as ref

TOL = {np.float32: dict(rtol=1e-4, atol=1e-4), np.float64: dict(rtol=1e-10, atol=1e-12)}
EXAMPLES = 5
TINY = dict(max_batch=2, max_channels=3, max_size=5, max_kernel=3)


def close(actual, expected, dtype):
    assert backend.is_device_array(actual), "the result left the device"
    np.testing.assert_allclose(actual.copy_to_host(), expected, **TOL[np.dtype(dtype).type])


def dev(*arrays):
    return [None if a is None else cuda.to_device(a) for a in arrays]


def gy_like(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def reference_grads(gy, p):
    b = p.b if p.b is not None else np.zeros(p.w.shape[0], p.x.dtype)
    return ref.conv_bias_relu_backward(gy, p.x, p.w, b, **p.kwargs)


@settings(max_examples=EXAMPLES)
@given(nfs.conv_problems(**TINY))
def test_forward_matches_reference(p):
    y = nf.conv_bias_relu(*dev(p.x, p.w, p.b), **p.kwargs)
    close(y, ref.conv_bias_relu(p.x, p.w, p.b, **p.kwargs), p.x.dtype)


@settings(max_examples=EXAMPLES)
@given(nfs.conv_problems(**TINY))
def test_backward_matches_reference(p):
    x, w, b = dev(p.x, p.w, p.b)
    y = nf.conv_bias_relu(x, w, b, **p.kwargs)
    gy = gy_like(y.shape, p.x.dtype)
    got = nf.conv_bias_relu_backward(cuda.to_device(gy), x, w, y, **p.kwargs)
    for g, r in zip(got, reference_grads(gy, p)):
        close(g, r, p.x.dtype)


@settings(max_examples=EXAMPLES)
@given(nfs.conv_problems(bias=True, **TINY))
def test_tape_matches_reference(p):
    ts = [nf.Tensor(a, requires_grad=True) for a in dev(p.x, p.w, p.b)]
    y = nf.conv_bias_relu(*ts, **p.kwargs)
    assert y.device == "cuda"
    gy = gy_like(y.shape, p.x.dtype)
    y.backward(cuda.to_device(gy))
    for t, r in zip(ts, reference_grads(gy, p)):
        close(t.grad, r, p.x.dtype)


@pytest.mark.parametrize("layout", nfs.LAYOUTS)
def test_unfused_ops_match_reference(layout):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 2, 4, 3) if layout == "NCHW" else (2, 4, 3, 2))
    w, b = rng.standard_normal((3, 2, 2, 2)), rng.standard_normal(3)
    kw = dict(stride=1, padding=(1, 0), dilation=1, layout=layout)
    tx, tw, tb = (nf.Tensor(a, requires_grad=True) for a in dev(x, w, b))
    h = nf.conv2d(tx, tw, **kw)
    y = nf.bias_add(h, tb, layout=layout)
    close(h.data, ref.conv2d(x, w, **kw), np.float64)
    close(y.data, ref.bias_add(ref.conv2d(x, w, **kw), b, layout=layout), np.float64)
    gy = gy_like(y.shape, np.float64)
    y.backward(cuda.to_device(gy))
    gx, gw = ref.conv2d_backward(gy, x, w, **kw)
    close(tx.grad, gx, np.float64)
    close(tw.grad, gw, np.float64)
    close(tb.grad, ref.bias_add_backward(gy, layout=layout)[1], np.float64)


def test_gradcheck_on_device():
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((2, 2, 2, 2)), \
        rng.standard_normal(2)
    ts = [nf.Tensor(a, requires_grad=True) for a in dev(x, w, b)]
    fn = lambda x, w, b: nf.conv_bias_relu(x, w, b, padding="same")  # noqa: E731
    assert nf.gradcheck(fn, ts, mode="directional", directions=1)


@pytest.mark.parametrize("dtype", nfs.DTYPES)
def test_deterministic(dtype):
    """Two runs give bit-identical results (fixed-order reductions, no atomics)."""
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(dtype) for s in ((2, 5, 5, 3), (3, 3, 3, 3), (3,)))
    kw = dict(stride=1, padding=1, layout="NHWC")
    runs = []
    for _ in range(2):
        xd, wd, bd = dev(x, w, b)
        y = nf.conv_bias_relu(xd, wd, bd, **kw)
        grads = nf.conv_bias_relu_backward(cuda.to_device(np.ones(y.shape, dtype)), xd, wd, y,
                                           **kw)
        runs.append([a.copy_to_host() for a in (y,) + tuple(grads)])
    for a, b_ in zip(*runs):
        assert np.array_equal(a, b_)


def test_saved_bytes_on_device():
    ts = [nf.Tensor(a, requires_grad=True) for a in dev(np.ones((1, 2, 3, 3)),
                                                       np.ones((2, 2, 1, 1)), np.ones(2))]
    y = nf.conv_bias_relu(*ts)
    assert nf.saved_bytes(y) == (ts[0].data.nbytes + ts[1].data.nbytes + y.data.nbytes)


def test_mixed_host_and_device_is_refused():
    x, w = np.ones((1, 2, 3, 3)), np.ones((2, 2, 1, 1))
    with pytest.raises(TypeError, match="conv_bias_relu: cannot mix host and device"):
        nf.conv_bias_relu(cuda.to_device(x), w)
    with pytest.raises(TypeError, match="bias_add: cannot mix host and device"):
        nf.bias_add(cuda.to_device(x), np.ones(2))


@pytest.mark.parametrize("threads, layout, dtype", [(32, "NCHW", np.float64),
                                                    (64, "NHWC", np.float32)])
def test_warp_sized_blocks_over_many_tiles(threads, layout, dtype, monkeypatch):
    # A GPU's block sizes (32/64 threads own several tile elements each) with more output tiles
    # than blocks (grid-stride over tiles), K over two tiles, uneven dw/db splits of M = 2*3*4
    from numbafuse.kernels import cuda_config as config
    monkeypatch.setattr(config, "threads", threads)
    rng = np.random.default_rng(21)
    shape = (2, 3, 6, 7) if layout == "NCHW" else (2, 6, 7, 3)
    x, w, b = (rng.standard_normal(s).astype(dtype) for s in (shape, (17, 3, 3, 3), (17,)))
    kw = dict(stride=2, padding=1, layout=layout)
    xd, wd, bd = dev(x, w, b)
    y = nf.conv_bias_relu(xd, wd, bd, **kw)
    close(y, ref.conv_bias_relu(x, w, b, **kw), dtype)
    gy = gy_like(y.shape, dtype)
    got = nf.conv_bias_relu_backward(cuda.to_device(gy), xd, wd, y, **kw)
    for g, r in zip(got, ref.conv_bias_relu_backward(gy, x, w, b, **kw)):
        close(g, r, dtype)


def test_bias_add_of_an_empty_batch():
    # channel_sum over zero rows divided by zero on the device; the host gives zeros
    x = nf.Tensor(cuda.to_device(np.zeros((0, 2, 3, 3))), requires_grad=True)
    b = nf.Tensor(cuda.to_device(np.ones(2)), requires_grad=True)
    y = nf.bias_add(x, b)
    assert y.shape == (0, 2, 3, 3)
    y.backward(cuda.to_device(np.zeros((0, 2, 3, 3))))
    np.testing.assert_array_equal(b.grad.copy_to_host(), np.zeros(2))
