"""Conv2D -> BiasAdd -> ReLU and the unfused conv2d, bias_add: what the harness does not ask of
every op, on every backend (``backend`` is injected: CPU, and CUDA in the ``-m cuda`` process).

Forward, backward, gradcheck, the NumPy-style backward, the unfused chain and reruns are in
``tests/test_ops.py``; chunk and tile boundaries in ``tests/test_boundaries.py``; bad input in
``tests/test_errors.py``. Here: NaN, residual bytes, the gradients actually computed, the
array-level helpers other families build on, Tensors in the NumPy-style backward, an empty
batch, and GPU-like block sizes.
"""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import kernels, validate
from numbafuse import reference as ref
from numbafuse.ops import conv as conv_ops

from .harness import close


def _seeded(shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_nan_propagates(backend):
    x = np.ones((1, 1, 2, 2))
    x[0, 0, 0, 0] = np.nan
    y = backend.get(nf.conv_bias_relu(*map(backend.put, (x, np.ones((1, 1, 1, 1)),
                                                          np.array([-5.0])))))
    assert np.isnan(y[0, 0, 0, 0]) and y[0, 0, 1, 1] == 0.0


@pytest.mark.parametrize("relu", [True, False])
def test_saved_bytes_are_x_w_and_y_only_with_relu(backend, relu):
    x, w, b = (nf.Tensor(backend.put(_seeded(s, i, np.float32)), requires_grad=True)
               for i, s in enumerate([(2, 3, 6, 5), (4, 3, 3, 3), (4,)]))
    fn = nf.conv_bias_relu if relu else conv_ops.conv_bias
    y = fn(x, w, b, padding=1)
    expected = x.data.nbytes + w.data.nbytes + (y.data.nbytes if relu else 0)
    assert nf.saved_bytes(y) == expected
    assert set(vars(y._fn.saved)) == {"x", "w", "y"}
    assert (y._fn.saved.y is y.data) if relu else y._fn.saved.y is None


@pytest.mark.parametrize("grads", [(False, True, True), (True, False, False),
                                   (False, False, True), (True, True, False)])
def test_only_needed_gradients_are_computed(backend, grads):
    arrays = (_seeded((2, 3, 5, 5), 1), _seeded((2, 3, 3, 3), 2), _seeded(2, 3))
    module = kernels.module("conv", backend.name)
    calls, real = [], module.conv_backward

    def spy(dy, x, w, geometry, y, need):
        calls.append(need)
        return real(dy, x, w, geometry, y, need)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "conv_backward", spy)
        ts = [nf.Tensor(backend.put(a), requires_grad=r) for a, r in zip(arrays, grads)]
        y = nf.conv_bias_relu(*ts, padding=1)
        dy = _seeded(y.shape, 4)
        y.backward(backend.put(dy))
    assert calls == [grads]
    expected = ref.conv_bias_relu_backward(dy, *arrays, padding=1)
    for t, r, e in zip(ts, grads, expected):
        if r:
            close(backend.get(t.grad), e, np.float64)
        else:
            assert t.grad is None


def test_helpers_for_other_families(backend):
    """conv_forward / conv_backward: the array-level API Conv-BatchNorm builds on."""
    x, w = _seeded((2, 5, 5, 3), 2), _seeded((4, 3, 3, 3), 3)
    geometry = validate.conv_geometry("t", x.shape, w.shape, 1, "same", 1, "NHWC")
    h = conv_ops.conv_forward(backend.put(x), backend.put(w), None, geometry, False)
    close(backend.get(h), ref.conv2d(x, w, padding="same", layout="NHWC"), np.float64)
    dy = _seeded(h.shape, 4)
    dx, dw, db = conv_ops.conv_backward(backend.put(dy), backend.put(x), backend.put(w),
                                        geometry, None, (True, True, True))
    rdx, rdw = ref.conv2d_backward(dy, x, w, padding="same", layout="NHWC")
    close(backend.get(dx), rdx, np.float64)
    close(backend.get(dw), rdw, np.float64)
    close(backend.get(db), dy.sum(axis=(0, 1, 2)), np.float64)


def test_numpy_style_backward_takes_tensors(backend):
    x, w = backend.put(_seeded((1, 2, 4, 4))), backend.put(_seeded((3, 2, 3, 3), 1))
    y = nf.conv_bias_relu(x, w)
    dy = backend.put(_seeded(y.shape, 2))
    T = nf.Tensor
    for g, e in zip(nf.conv_bias_relu_backward(T(dy), T(x), T(w), T(y)),
                    nf.conv_bias_relu_backward(dy, x, w, y)):
        np.testing.assert_array_equal(backend.get(g), backend.get(e))


def test_bias_add_of_an_empty_batch(backend):
    # channel_sum over zero rows: zeros (the device once divided by zero here)
    x = nf.Tensor(backend.put(np.zeros((0, 2, 3, 3))), requires_grad=True)
    b = nf.Tensor(backend.put(np.ones(2)), requires_grad=True)
    y = nf.bias_add(x, b)
    assert y.shape == (0, 2, 3, 3)
    y.backward(backend.put(np.zeros((0, 2, 3, 3))))
    np.testing.assert_array_equal(backend.get(b.grad), np.zeros(2))


@pytest.mark.cuda
@pytest.mark.parametrize("threads, layout, dtype", [(32, "NCHW", np.float64),
                                                    (64, "NHWC", np.float32)])
def test_warp_sized_blocks_over_many_tiles(threads, layout, dtype, monkeypatch):
    # A GPU's block sizes (32/64 threads own several tile elements each) with more output tiles
    # than blocks (grid-stride over tiles), K over two tiles, uneven dw/db splits of M = 2*3*4
    from numbafuse.kernels import cuda_config as config
    from .harness import BACKENDS
    cuda = BACKENDS["cuda"]
    monkeypatch.setattr(config, "threads", threads)
    shape = (2, 3, 6, 7) if layout == "NCHW" else (2, 6, 7, 3)
    x, w, b = (_seeded(s, i, dtype) for i, s in enumerate((shape, (17, 3, 3, 3), (17,))))
    kw = dict(stride=2, padding=1, layout=layout)
    y = nf.conv_bias_relu(*map(cuda.put, (x, w, b)), **kw)
    close(cuda.get(y), ref.conv_bias_relu(x, w, b, **kw), dtype)
    dy = _seeded(y.shape, 5, dtype)
    got = nf.conv_bias_relu_backward(cuda.put(dy), cuda.put(x), cuda.put(w), y, **kw)
    for g, r in zip(got, ref.conv_bias_relu_backward(dy, x, w, b, **kw)):
        close(cuda.get(g), r, dtype)
