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

from .harness import BACKENDS, close


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
    from numbafuse.kernels.cuda import config
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


# =========================================================================== padding, empty batch
# Reference: x zero-padded by np.pad, then the reference's unpadded conv; dx is the padded
# input's gradient cropped back. Neither the kernels nor the reference's padding rules.

def _padded_reference(x, w, b, dy, quad, layout, **kw):
    """(y, dx, dw, db) of relu(conv(pad(x), w) + b) by the reference on the np.pad'ed x,
    with ``quad`` = (left, right, top, bottom)."""
    left, right, top, bottom = quad
    pads = ((0, 0), (0, 0), (top, bottom), (left, right))
    if layout == "NHWC":
        pads = ((0, 0), (top, bottom), (left, right), (0, 0))
    xp = np.pad(x.astype(np.float64), pads)
    w64, b64 = w.astype(np.float64), b.astype(np.float64)
    y = ref.conv_bias_relu(xp, w64, b64, padding=0, layout=layout, **kw)
    dxp, dw, db = ref.conv_bias_relu_backward(dy.astype(np.float64), xp, w64, b64, padding=0,
                                              layout=layout, **kw)
    H, W = (x.shape[2], x.shape[3]) if layout == "NCHW" else (x.shape[1], x.shape[2])
    rows, cols = slice(top, top + H), slice(left, left + W)
    dx = dxp[:, :, rows, cols] if layout == "NCHW" else dxp[:, rows, cols, :]
    return y, dx, dw, db


def _check_padded(backend, x, w, b, padding, quad, dtype, **kw):
    y = nf.conv_bias_relu(*map(backend.put, (x, w, b)), padding=padding, **kw)
    dy = _seeded(backend.get(y).shape, 7, dtype)
    expected = _padded_reference(x, w, b, dy, quad, **kw)
    got = (y,) + nf.conv_bias_relu_backward(backend.put(dy), backend.put(x), backend.put(w), y,
                                            padding=padding, **kw)
    for g, e in zip(got, expected):
        close(backend.get(g), e, dtype)


# (left, right, top, bottom), stride, dilation, kernel, layout: more padding on either side
# of each axis, with strides and dilations whose windows end inside the bottom/right padding
# or not (both layouts of every CPU algorithm: the next test)
ASYMMETRIC = [((0, 2, 1, 0), 1, 1, (3, 3), "NCHW"), ((2, 0, 0, 1), 2, 1, (3, 2), "NHWC"),
              ((1, 0, 2, 1), (2, 1), (1, 2), (2, 3), "NHWC")]


@pytest.mark.parametrize("quad, stride, dilation, kernel, layout", ASYMMETRIC)
def test_asymmetric_padding_is_np_pad_then_an_unpadded_conv(backend, quad, stride, dilation,
                                                            kernel, layout):
    """A 4-tuple padding is (left, right, top, bottom), torch.nn.functional.pad's order."""
    H, W = 5, 6
    x = _seeded((2, 3, H, W) if layout == "NCHW" else (2, H, W, 3), 1)
    w, b = _seeded((4, 3) + kernel, 2), _seeded(4, 3)
    _check_padded(backend, x, w, b, quad, quad, np.float64, stride=stride, dilation=dilation,
                  layout=layout)


@pytest.mark.parametrize("quad, stride, kind", [((0, 1, 2, 0), 1, "winograd"),
                                                ((1, 2, 0, 1), 2, "winograd_s2"),
                                                ((2, 0, 1, 2), 2, "implicit")])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_asymmetric_padding_on_every_cpu_algorithm(quad, stride, kind, layout, conv_rules):
    """The CPU's GEMM paths (16 channels and more), float32: each reads only the top/left
    padding and P, Q; the bottom/right padding is what lies past the input's edge."""
    from numbafuse.kernels.conv import cpu as cpu_conv
    # Winograd's forward at 90 tiles (not the implicit GEMM's, as 16 channels would take);
    # the implicit GEMM's strided forward at 16 channels (taps: also with 8-float tiles, where
    # the plan leaves it to im2col)
    conv_rules(winograd_min_tiles=0, implicit_max_channels=16, implicit_s1_max_channels=0,
               taps=True, winograd_s2_min_pixels=0)
    H, W, R = 9, 18, 3 if kind != "implicit" else 1
    x = _seeded((2, 16, H, W) if layout == "NCHW" else (2, H, W, 16), 1, np.float32)
    w, b = _seeded((16, 16, R, R), 2, np.float32) / 12, _seeded(16, 3, np.float32)
    geometry = validate.conv_geometry("t", x.shape, w.shape, stride, quad, 1, layout)
    assert (geometry.ph, geometry.ph_end, geometry.pw, geometry.pw_end) == (
        quad[2], quad[3], quad[0], quad[1])
    if kind != "implicit" or layout == "NHWC":
        assert cpu_conv.algorithm(geometry, "forward", np.float32) == kind
    _check_padded(BACKENDS["cpu"], x, w, b, quad, quad, np.float32, stride=stride,
                  layout=layout)


@pytest.mark.parametrize("kernel, dilation", [(2, 1), ((4, 2), 1)])
def test_same_padding_of_even_kernels_puts_the_extra_at_the_end(backend, kernel, dilation):
    """padding="same" at stride 1: total = dilation*(k-1), begin = total//2, the rest at the
    bottom/right (PyTorch's rule), forward and backward."""
    R, S = (kernel, kernel) if np.ndim(kernel) == 0 else kernel
    th, tw = dilation * (R - 1), dilation * (S - 1)
    quad = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    x, w, b = _seeded((2, 3, 5, 6), 1), _seeded((4, 3, R, S), 2), _seeded(4, 3)
    _check_padded(backend, x, w, b, "same", quad, np.float64, dilation=dilation,
                  layout="NCHW")


def test_reference_reads_a_4_tuple_in_f_pad_order():
    x, w = _seeded((1, 2, 4, 5), 1), _seeded((3, 2, 2, 2), 2)
    padded = np.pad(x, ((0, 0), (0, 0), (3, 0), (1, 2)))          # top 3, left 1, right 2
    np.testing.assert_array_equal(ref.conv2d(x, w, padding=(1, 2, 3, 0)),
                                  ref.conv2d(padded, w, padding=0))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_an_empty_batch_gives_empty_outputs_and_zero_gradients(backend, layout):
    """N = 0, as PyTorch: y empty, dx empty, dw and db zero (sums over no pixels), on the tape
    and NumPy style, for the fused op and conv2d."""
    x = np.zeros((0, 3, 5, 5) if layout == "NCHW" else (0, 5, 5, 3))
    w, b = _seeded((4, 3, 3, 3), 1), _seeded(4, 2)
    kw = dict(stride=2, padding=1, layout=layout)
    y_shape = (0, 4, 3, 3) if layout == "NCHW" else (0, 3, 3, 4)
    xt, wt, bt = (nf.Tensor(backend.put(a), requires_grad=True) for a in (x, w, b))
    for y in (nf.conv_bias_relu(xt, wt, bt, **kw), nf.conv2d(xt, wt, **kw)):
        assert y.shape == y_shape
        y.backward(backend.put(np.zeros(y_shape)))
    assert backend.get(xt.grad).shape == x.shape
    np.testing.assert_array_equal(backend.get(wt.grad), np.zeros(w.shape))
    np.testing.assert_array_equal(backend.get(bt.grad), np.zeros(4))
    y = nf.conv_bias_relu(*map(backend.put, (x, w, b)), **kw)
    dx, dw, db = nf.conv_bias_relu_backward(backend.put(np.zeros(y_shape)), backend.put(x),
                                            backend.put(w), y, **kw)
    assert backend.get(y).shape == y_shape and backend.get(dx).shape == x.shape
    np.testing.assert_array_equal(backend.get(dw), np.zeros(w.shape))
    np.testing.assert_array_equal(backend.get(db), np.zeros(4))


# (N, C, K, H, kernel, stride, padding, dilation, groups): one tap alone reaches the input
ONE_TAP = [(3, 16, 24, 1, 3, 1, 1, 1, 1), (2, 8, 8, 1, 5, 2, 2, 1, 8),
           (2, 12, 16, 2, 3, 1, 2, 2, 1), (4, 16, 32, 1, 3, 2, (1, 1, 1, 1), 1, 1)]


@pytest.mark.parametrize("case", ONE_TAP)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_conv_that_reaches_the_input_by_one_tap_runs_as_that_taps_1x1(case, layout, dtype):
    """A conv of whose taps one alone reads inside the input from any output (a 3x3 with
    padding 1 on a 1x1 map; 2x2 dilated by 2 with padding 2) runs every CPU pass as the 1x1
    conv of that tap (kernels/conv/cpu_first._crop): the forward, dX, dW (zeros at the other
    taps), db, the training Conv-BN-ReLU with its statistics and backward, and inference's
    folded batch norm, all as the reference computes the whole kernel."""
    from numbafuse.kernels.conv import cpu_first
    N, C, K, H, R, stride, padding, dilation, groups = case
    shape = (N, C, H, H) if layout == "NCHW" else (N, H, H, C)
    x = _seeded(shape, 1, dtype)
    w, b = _seeded((K, C // groups, R, R), 2, dtype), _seeded(K, 3, dtype)
    kw = dict(stride=stride, padding=padding, dilation=dilation, layout=layout, groups=groups)
    geom = validate.conv_geometry("t", shape, w.shape, stride, padding, dilation, layout,
                                  groups)
    crop = cpu_first._crop(geom)
    assert crop is not None and crop[2].R == crop[2].S == 1
    r, s = crop[0], crop[1]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    y = nf.conv_bias_relu(x, w, b, **kw)
    np.testing.assert_allclose(y, ref.relu(ref.bias_add(ref.conv2d(x, w, **kw), b, layout)),
                               **tol)
    gy = _seeded(y.shape, 4, dtype)
    dx, dw, db = cpu_first.conv_backward(gy, x, w, geom)
    rdx, rdw = ref.conv2d_backward(gy, x, w, **kw)
    np.testing.assert_allclose(dx, rdx, **tol)
    np.testing.assert_allclose(dw, rdw, **tol)
    others = np.ones((R, R), bool)
    others[r, s] = False
    assert dw.shape == w.shape and not dw[:, :, others].any()     # exact zeros elsewhere
    np.testing.assert_allclose(db, gy.sum(axis=(0, 2, 3) if layout == "NCHW" else (0, 1, 2)),
                               **tol)
    gamma, beta = _seeded(K, 5, dtype) + 2, _seeded(K, 6, dtype)
    got = nf.conv_batchnorm_relu(x, w, gamma, beta, **kw)
    want = ref.conv_batchnorm_relu(x, w, gamma, beta, **kw)[0]
    np.testing.assert_allclose(got, want, **tol)
    dy = _seeded(got.shape, 7, dtype)
    for a, e in zip(nf.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw),
                    ref.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)):
        np.testing.assert_allclose(a, e, **tol)
    rm, rv = _seeded(K, 8, dtype), _seeded(K, 9, dtype) ** 2 + 0.5
    got = nf.conv_batchnorm_relu(x, w, gamma, beta, running_mean=rm, running_var=rv,
                                 training=False, **kw)
    want = ref.conv_batchnorm_relu(x, w, gamma, beta, running_mean=rm, running_var=rv,
                                   training=False, **kw)[0]
    np.testing.assert_allclose(got, want, **tol)


def test_only_one_tap_convs_are_cropped():
    from numbafuse.kernels.conv import cpu_first
    g = validate.conv_geometry
    assert cpu_first._crop(g("t", (2, 8, 2, 2), (8, 8, 3, 3), 1, 1, 1, "NCHW")) is None
    assert cpu_first._crop(g("t", (2, 8, 2, 2), (8, 8, 3, 3), 2, 1, 1, "NCHW")) is None  # 2x2
    assert cpu_first._crop(g("t", (2, 8, 1, 1), (8, 8, 1, 1), 1, 0, 1, "NCHW")) is None
    assert cpu_first._crop(g("t", (2, 8, 3, 3), (8, 8, 3, 3), 1, 0, 1, "NCHW")) is None
    r, s, one = cpu_first._crop(g("t", (2, 8, 1, 1), (8, 8, 3, 3), 1, 1, 1, "NCHW"))
    assert (r, s) == (1, 1)
    assert (one.R, one.S, one.ph, one.pw, one.ph_end, one.pw_end, one.P, one.Q) == (
        1, 1, 0, 0, 0, 0, 1, 1)
