"""Conv2D -> BiasAdd -> ReLU (fused) and the unfused conv2d, bias_add on the CPU.

Every check compares against ``numbafuse.reference`` (plain NumPy, float64) or against finite
differences: forward, NumPy-style backward, the tape, the unfused chain, residual bytes, the
gradients actually computed, and every bad input refused before anything runs.
"""
import numpy as np
import pytest
from hypothesis import given, settings

import numbafuse as nf
from numbafuse import validate
from numbafuse import reference as ref
from numbafuse.kernels.conv import cpu as cpu_conv
from numbafuse.ops import conv as conv_ops
import numbafuse.testing.strategies as nfs

TOL = {np.float32: dict(rtol=1e-4, atol=1e-4), np.float64: dict(rtol=1e-10, atol=1e-12)}
GRADCHECK_EXAMPLES = 4      # gradcheck runs the op many times: fewer examples


def tol(dtype):
    return TOL[np.dtype(dtype).type]


def close(actual, expected, dtype):
    np.testing.assert_allclose(actual, expected, **tol(dtype))


def gy_like(y, seed=0):
    return np.random.default_rng(seed).standard_normal(y.shape).astype(y.dtype)


def reference_grads(gy, p):
    """(gx, gw, gb) of the reference chain; gb is the would-be bias gradient even without b."""
    b = p.b if p.b is not None else np.zeros(p.w.shape[0], p.x.dtype)
    return ref.conv_bias_relu_backward(gy, p.x, p.w, b, **p.kwargs)


# --------------------------------------------------------------------------- fused op

@given(nfs.conv_problems())
def test_forward_matches_reference(p):
    y = nf.conv_bias_relu(p.x, p.w, p.b, **p.kwargs)
    assert y.dtype == p.x.dtype
    close(y, ref.conv_bias_relu(p.x, p.w, p.b, **p.kwargs), p.x.dtype)


@given(nfs.conv_problems())
def test_backward_matches_reference(p):
    y = nf.conv_bias_relu(p.x, p.w, p.b, **p.kwargs)
    gy = gy_like(y)
    got = nf.conv_bias_relu_backward(gy, p.x, p.w, y, **p.kwargs)
    for g, r in zip(got, reference_grads(gy, p)):
        assert g.dtype == p.x.dtype and g.shape == r.shape
        close(g, r, p.x.dtype)


@given(nfs.conv_problems(bias=True))
def test_tape_matches_reference(p):
    x, w, b = (nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, p.b))
    y = nf.conv_bias_relu(x, w, b, **p.kwargs)
    gy = gy_like(y)
    y.backward(gy)
    for t, r in zip((x, w, b), reference_grads(gy, p)):
        close(t.grad, r, p.x.dtype)


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(nfs.conv_problems(dtype=np.float64, bias=True))
def test_gradcheck(p):
    fn = lambda x, w, b: nf.conv_bias_relu(x, w, b, **p.kwargs)  # noqa: E731
    inputs = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, p.b)]
    assert nf.gradcheck(fn, inputs, mode="directional")


@pytest.mark.parametrize("layout", nfs.LAYOUTS)
@pytest.mark.parametrize("geometry", [
    dict(R=1, S=1, stride=1, padding=0, dilation=1),           # pointwise: no im2col
    dict(R=3, S=2, stride=(2, 1), padding="same", dilation=(1, 2)),  # asymmetric "same"
    dict(R=2, S=3, stride=2, padding="valid", dilation=1),     # rectangular, strided
    dict(R=3, S=3, stride=1, padding=(2, 1), dilation=2),      # dilated, padded
], ids=["1x1", "same", "valid-rect", "dilated"])
@pytest.mark.parametrize("images_per_chunk", [1, 2])
def test_batch_chunks(layout, geometry, images_per_chunk, monkeypatch):
    """Several im2col chunks (the last one partial) give the same result as one."""
    rng = np.random.default_rng(7)
    N, C, H, W, K = 3, 3, 7, 6, 4
    x = rng.standard_normal((N, C, H, W) if layout == "NCHW" else (N, H, W, C))
    w = rng.standard_normal((K, C, geometry["R"], geometry["S"]))
    b = rng.standard_normal(K)
    kw = dict(stride=geometry["stride"], padding=geometry["padding"],
              dilation=geometry["dilation"], layout=layout)
    geom = validate.conv_geometry("test", x.shape, w.shape, kw["stride"], kw["padding"],
                                 kw["dilation"], layout)
    per_image = C * geom.R * geom.S * geom.P * geom.Q * x.itemsize   # one image's cols bytes
    monkeypatch.setattr(cpu_conv, "CHUNK_BYTES", images_per_chunk * per_image)
    y = nf.conv_bias_relu(x, w, b, **kw)
    close(y, ref.conv_bias_relu(x, w, b, **kw), np.float64)
    gy = gy_like(y)
    got = nf.conv_bias_relu_backward(gy, x, w, y, **kw)
    for g, r in zip(got, ref.conv_bias_relu_backward(gy, x, w, b, **kw)):
        close(g, r, np.float64)


def test_nan_propagates():
    x = np.ones((1, 1, 2, 2))
    x[0, 0, 0, 0] = np.nan
    y = nf.conv_bias_relu(x, np.ones((1, 1, 1, 1)), np.array([-5.0]))
    assert np.isnan(y[0, 0, 0, 0]) and y[0, 0, 1, 1] == 0.0


# --------------------------------------------------------------------------- unfused ops

@given(nfs.conv_problems(bias=False))
def test_conv2d_matches_reference(p):
    x, w = nf.Tensor(p.x, requires_grad=True), nf.Tensor(p.w, requires_grad=True)
    y = nf.conv2d(x, w, **p.kwargs)
    close(y.data, ref.conv2d(p.x, p.w, **p.kwargs), p.x.dtype)
    gy = gy_like(y)
    y.backward(gy)
    gx, gw = ref.conv2d_backward(gy, p.x, p.w, **p.kwargs)
    close(x.grad, gx, p.x.dtype)
    close(w.grad, gw, p.x.dtype)


@given(nfs.conv_problems(bias=True))
def test_bias_add_matches_reference(p):
    layout = p.layout
    C = p.x.shape[validate.channel_axis(layout)]
    x = nf.Tensor(p.x, requires_grad=True)
    b = nf.Tensor(np.linspace(-1, 1, C).astype(p.x.dtype), requires_grad=True)
    y = nf.bias_add(x, b, layout=layout)
    close(y.data, ref.bias_add(p.x, b.data, layout=layout), p.x.dtype)
    gy = gy_like(y)
    y.backward(gy)
    gx, gb = ref.bias_add_backward(gy, layout=layout)
    close(x.grad, gx, p.x.dtype)
    close(b.grad, gb, p.x.dtype)


@given(nfs.conv_problems(bias=True))
def test_unfused_chain_equals_fused(p):
    ts = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, p.b)]
    fused = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, p.b)]
    y_chain = nf.relu(nf.bias_add(nf.conv2d(ts[0], ts[1], **p.kwargs), ts[2], layout=p.layout))
    y_fused = nf.conv_bias_relu(*fused, **p.kwargs)
    close(y_fused.data, y_chain.data, p.x.dtype)
    gy = gy_like(y_fused)
    y_chain.backward(gy)
    y_fused.backward(gy)
    for a, b in zip(fused, ts):
        close(a.grad, b.grad, p.x.dtype)


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(nfs.conv_problems(dtype=np.float64, bias=True))
def test_gradcheck_unfused(p):
    fn = lambda x, w, b: nf.bias_add(nf.conv2d(x, w, **p.kwargs), b,  # noqa: E731
                                     layout=p.layout)
    inputs = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, p.b)]
    assert nf.gradcheck(fn, inputs, mode="directional")


# --------------------------------------------------------------------------- residuals, needs

def test_saved_bytes_are_x_w_y():
    rng = np.random.default_rng(0)
    x = nf.Tensor(rng.standard_normal((2, 3, 6, 5)).astype(np.float32), requires_grad=True)
    w = nf.Tensor(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), requires_grad=True)
    b = nf.Tensor(rng.standard_normal(4).astype(np.float32), requires_grad=True)
    y = nf.conv_bias_relu(x, w, b, padding=1)
    assert nf.saved_bytes(y) == x.data.nbytes + w.data.nbytes + y.data.nbytes
    fn = y._fn
    assert set(vars(fn.saved)) == {"x", "w", "y"} and fn.saved.y is y.data


@pytest.mark.parametrize("grads", [(False, True, True), (True, False, False),
                                   (False, False, True), (True, True, False)])
def test_only_needed_gradients(grads, monkeypatch):
    rng = np.random.default_rng(1)
    arrays = (rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((2, 3, 3, 3)),
              rng.standard_normal(2))
    calls = []
    real = cpu_conv.conv_backward

    def spy(gy, x, w, geom, y, need):
        calls.append(need)
        return real(gy, x, w, geom, y, need)

    monkeypatch.setattr(cpu_conv, "conv_backward", spy)
    ts = [nf.Tensor(a, requires_grad=r) for a, r in zip(arrays, grads)]
    y = nf.conv_bias_relu(*ts, padding=1)
    y.backward(gy_like(y))
    assert calls == [grads]
    expected = ref.conv_bias_relu_backward(gy_like(y), *arrays, padding=1)
    for t, r, e in zip(ts, grads, expected):
        if r:
            close(t.grad, e, np.float64)
        else:
            assert t.grad is None


def test_backward_need_flags_return_none():
    x, w = np.ones((1, 2, 4, 4)), np.ones((3, 2, 3, 3))
    y = nf.conv_bias_relu(x, w)
    dx, dw, db = nf.conv_bias_relu_backward(np.ones_like(y), x, w, y, need=(False, True, False))
    assert dx is None and db is None and dw.shape == w.shape


def test_backward_accepts_tensors():
    x, w = np.ones((1, 2, 4, 4)), np.ones((3, 2, 3, 3))
    y = nf.conv_bias_relu(x, w)
    gy = gy_like(y)
    T = nf.Tensor
    for g, e in zip(nf.conv_bias_relu_backward(T(gy), T(x), T(w), T(y)),
                    nf.conv_bias_relu_backward(gy, x, w, y)):
        np.testing.assert_array_equal(g, e)


def test_helpers_for_other_families():
    """conv_forward / conv_backward: the array-level API Conv-BatchNorm builds on."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 5, 5, 3)), rng.standard_normal((4, 3, 3, 3))
    geom = validate.conv_geometry("t", x.shape, w.shape, 1, "same", 1, "NHWC")
    h = conv_ops.conv_forward(x, w, None, geom, False)
    close(h, ref.conv2d(x, w, padding="same", layout="NHWC"), np.float64)
    gy = gy_like(h)
    gx, gw, gb = conv_ops.conv_backward(gy, x, w, geom, None, (True, True, True))
    rgx, rgw = ref.conv2d_backward(gy, x, w, padding="same", layout="NHWC")
    close(gx, rgx, np.float64)
    close(gw, rgw, np.float64)
    close(gb, gy.sum(axis=(0, 1, 2)), np.float64)


# --------------------------------------------------------------------------- bad input

class FakeDeviceArray:
    """Looks like a CUDA array to the dispatcher (no GPU needed)."""
    __cuda_array_interface__ = {}
    shape, dtype = (4,), np.dtype(np.float64)


X = np.zeros((1, 3, 5, 5))
W = np.zeros((2, 3, 3, 3))
B = np.zeros(2)


@pytest.mark.parametrize("args,kwargs,error,words", [
    ((np.zeros((3, 5, 5)), W, B), {}, ValueError, "x must have 4 dimensions"),
    ((X, np.zeros((2, 3, 3)), B), {}, ValueError, "w must have 4 dimensions"),
    ((X, np.zeros((2, 5, 3, 3)), B), {}, ValueError, "w has 5 input channels, x has 3"),
    ((X, W, B), dict(layout="NCWH"), ValueError, "layout"),
    ((X, W, B), dict(stride=0), ValueError, "stride"),
    ((X, W, B), dict(dilation=(1, 0)), ValueError, "dilation"),
    ((X, W, B), dict(padding=-1), ValueError, "padding"),
    ((X, W, B), dict(padding="full"), ValueError, "padding"),
    ((X, W, B), dict(stride=1.5), TypeError, "stride"),
    ((X, np.zeros((2, 3, 7, 7)), B), {}, ValueError, "output size"),
    ((X, W, np.zeros(3)), {}, ValueError, "b must have shape (2,)"),
    ((X, W, np.zeros((2, 1))), {}, ValueError, "b must have shape (2,)"),
    ((X.astype(np.float32), W, B), {}, TypeError, "w is float64 but x is float32"),
    ((X.astype(np.int64), W.astype(np.int64), None), {}, TypeError, "x must be float32"),
    ((X, W, FakeDeviceArray()), {}, TypeError, "cannot mix host and device"),
    (([[1.0]], W, B), {}, TypeError, "x must be a NumPy array"),
])
def test_bad_input_is_refused(args, kwargs, error, words):
    with pytest.raises(error, match="conv_bias_relu") as info:
        nf.conv_bias_relu(*args, **kwargs)
    assert words in str(info.value)


def test_bad_input_of_unfused_ops():
    with pytest.raises(ValueError, match="conv2d: w has 5 input channels, x has 3"):
        nf.conv2d(X, np.zeros((2, 5, 3, 3)))
    with pytest.raises(ValueError, match=r"bias_add: b must have shape \(3,\)"):
        nf.bias_add(X, np.zeros(2))
    with pytest.raises(ValueError, match="bias_add: x must have 4 dimensions"):
        nf.bias_add(np.zeros((3, 5)), np.zeros(3))
    with pytest.raises(TypeError, match="bias_add: b is float32"):
        nf.bias_add(X, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="bias_add: cannot mix host and device"):
        nf.bias_add(X, FakeDeviceArray())


def test_bad_input_of_backward():
    y = nf.conv_bias_relu(X, W, B)
    op = "conv_bias_relu_backward"
    with pytest.raises(ValueError, match=f"{op}: y has shape"):
        nf.conv_bias_relu_backward(y, X, W, y[:, :, :2], padding=0)
    with pytest.raises(ValueError, match=f"{op}: dy has shape"):
        nf.conv_bias_relu_backward(y[:, :1], X, W, y)
    with pytest.raises(TypeError, match=f"{op}: y is float32"):
        nf.conv_bias_relu_backward(y, X, W, y.astype(np.float32))
    with pytest.raises(ValueError, match=f"{op}: need"):
        nf.conv_bias_relu_backward(y, X, W, y, need=(True, True))


def test_nothing_written_on_bad_input(monkeypatch):
    """A refused call runs no kernel and leaves its inputs untouched."""
    x, w = np.ones((1, 3, 5, 5)), np.ones((2, 3, 3, 3))
    before = x.copy(), w.copy()
    monkeypatch.setattr(cpu_conv, "conv_forward", None)   # any kernel call would fail loudly
    with pytest.raises(ValueError, match="conv_bias_relu: b"):
        nf.conv_bias_relu(x, w, np.ones(5))
    assert np.array_equal(x, before[0]) and np.array_equal(w, before[1])


@given(nfs.conv_problems(dtype=np.float64, bias=True))
def test_conv_bias_without_relu_matches_reference_and_keeps_no_output(problem):
    from numbafuse.ops.conv import conv_bias
    x, w, b, kw = problem.x, problem.w, problem.b, problem.kwargs
    lay = kw["layout"]
    geo = {k: kw[k] for k in ("stride", "padding", "dilation")}
    expected = ref.bias_add(ref.conv2d(x, w, layout=lay, **geo), b, layout=lay)
    close(conv_bias(x, w, b, **kw), expected, np.float64)
    tx, tw, tb = (nf.Tensor(a, requires_grad=True) for a in (x, w, b))
    y = conv_bias(tx, tw, tb, **kw)
    assert nf.saved_bytes(y) == x.nbytes + w.nbytes      # no ReLU: no mask, y is not kept
    gy = np.random.default_rng(0).standard_normal(y.shape)
    y.backward(gy)
    gx, gw = ref.conv2d_backward(gy, x, w, layout=lay, **geo)
    for got, want in ((tx.grad, gx), (tw.grad, gw), (tb.grad, ref.bias_add_backward(gy, lay)[1])):
        close(got, want, np.float64)
