"""The unfused ops of ops/basic.py on the CPU: forward and backward vs numbafuse.reference,
the tape's gradients vs finite differences (float64), and bad input.

Run: python -m pytest tests/test_basic_ops.py -q -p no:cacheprovider
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.ops import basic
import numbafuse.testing.strategies as nfs

TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-12)}
GRADCHECK_EXAMPLES = 5      # gradcheck evaluates the op twice per input element: keep few


def close(actual, expected, dtype):
    assert actual.dtype == np.dtype(dtype)
    np.testing.assert_allclose(actual, expected, **TOL[dtype])


def seeded(shape, dtype, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


# --------------------------------------------------------------------------- strategies

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**32 - 1)


@st.composite
def pool_problems(draw, dtype=None, max_size=7):
    """(x, k, stride, layout); ``x`` sometimes small integers, so windows hold ties."""
    dtype = draw(nfs.dtypes()) if dtype is None else dtype
    layout = draw(nfs.layouts())
    N, C = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    H, W = draw(st.integers(1, max_size)), draw(st.integers(1, max_size))
    kh, kw = draw(st.integers(1, H)), draw(st.integers(1, W))
    k = kh if kh == kw and draw(st.booleans()) else (kh, kw)
    stride = draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))))
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    rng = np.random.default_rng(draw(seeds))
    if draw(st.booleans()):
        x = rng.integers(-2, 3, shape).astype(dtype)                 # ties
    else:
        x = rng.standard_normal(shape).astype(dtype)
    return x, k, stride, layout


@st.composite
def linear_problems(draw, dtype=None):
    dtype = draw(nfs.dtypes()) if dtype is None else dtype
    N, F_in, F_out = (draw(st.integers(1, 6)) for _ in range(3))
    seed = draw(seeds)
    x = seeded((N, F_in), dtype, seed)
    w = seeded((F_out, F_in), dtype, seed + 1, 1 / np.sqrt(F_in))
    b = seeded((F_out,), dtype, seed + 2) if draw(st.booleans()) else None
    return x, w, b


@st.composite
def xent_problems(draw, dtype=None):
    dtype = draw(nfs.dtypes()) if dtype is None else dtype
    N, L = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    seed = draw(seeds)
    scale = draw(st.sampled_from([1.0, 30.0]))                     # large logits: stability
    logits = seeded((N, L), dtype, seed, scale)
    labels = np.random.default_rng(seed).integers(0, L, N).astype(
        draw(st.sampled_from([np.int32, np.int64])))
    return logits, labels


# --------------------------------------------------------------------------- relu

@given(shapes, nfs.dtypes(), seeds)
def test_relu_matches_reference(shape, dtype, seed):
    x, gy = seeded(shape, dtype, seed), seeded(shape, dtype, seed + 1)
    t = nf.Tensor(x, requires_grad=True)
    y = nf.relu(t)
    close(y.data, ref.relu(x), dtype)
    y.backward(gy)
    close(t.grad, ref.relu_backward(gy, x), dtype)


def test_relu_saves_its_output_and_keeps_nan():
    x = nf.Tensor(np.array([-1.0, np.nan, 0.0, 2.0]), requires_grad=True)
    y = nf.relu(x)
    assert y._fn.saved.y is y.data and nf.saved_bytes(y) == y.data.nbytes
    np.testing.assert_array_equal(y.data, [0.0, np.nan, 0.0, 2.0])
    y.backward(np.ones(4))
    np.testing.assert_array_equal(x.grad, [0.0, 0.0, 0.0, 1.0])


def test_relu_of_a_non_contiguous_view():
    x = seeded((3, 4), np.float64, 0).T                            # (4, 3), F-ordered
    close(nf.relu(x), ref.relu(x), np.float64)


# --------------------------------------------------------------------------- linear

@given(linear_problems())
def test_linear_matches_reference(problem):
    x, w, b = problem
    dtype = x.dtype.type
    close(nf.linear(x, w, b), ref.linear(x, w, b), dtype)
    tx, tw = nf.Tensor(x, requires_grad=True), nf.Tensor(w, requires_grad=True)
    tb = None if b is None else nf.Tensor(b, requires_grad=True)
    y = nf.linear(tx, tw, tb)
    gy = seeded(y.shape, dtype, 7)
    y.backward(gy)
    gx, gw, gb = ref.linear_backward(gy, x, w)
    close(tx.grad, gx, dtype)
    close(tw.grad, gw, dtype)
    if b is not None:
        close(tb.grad, gb, dtype)


def test_linear_computes_only_the_gradients_asked_for():
    x, w = seeded((2, 3), np.float64, 0), nf.Tensor(seeded((4, 3), np.float64, 1),
                                                     requires_grad=True)
    y = nf.linear(x, w)
    assert y._fn.backward(np.ones((2, 4)))[0] is None


# --------------------------------------------------------------------------- pooling

@given(pool_problems())
def test_max_pool2d_matches_reference(problem):
    x, k, stride, layout = problem
    dtype = x.dtype.type
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, k, stride, layout=layout)
    close(y.data, ref.max_pool2d(x, k, stride, layout), dtype)
    gy = seeded(y.shape, dtype, 3)
    y.backward(gy)
    close(t.grad, ref.max_pool2d_backward(gy, x, k, stride, layout), dtype)
    np.testing.assert_array_equal(y._fn.saved.argmax, first_max_taps(x, k, stride, layout))


def first_max_taps(x, k, stride, layout):
    """Row-major tap r*kw + s of each window's first maximum, shaped like y (NumPy argmax)."""
    kh, kw = (k, k) if np.isscalar(k) else k
    sh, sw = (kh, kw) if stride is None else stride
    xc = x if layout == "NCHW" else x.transpose(0, 3, 1, 2)       # (N, C, H, W)
    P, Q = (xc.shape[2] - kh) // sh + 1, (xc.shape[3] - kw) // sw + 1
    taps = np.stack([xc[:, :, r:r + (P - 1) * sh + 1:sh, s:s + (Q - 1) * sw + 1:sw]
                     for r in range(kh) for s in range(kw)]).argmax(axis=0)  # (N, C, P, Q)
    return taps if layout == "NCHW" else taps.transpose(0, 2, 3, 1)


def test_max_pool2d_gradient_goes_to_the_first_maximum():
    x = np.array([[[[1.0, 3.0], [3.0, 3.0]]]])
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, 2)
    np.testing.assert_array_equal(y._fn.saved.argmax, [[[[1]]]])     # tap (0, 1) of 2x2
    y.backward(np.ones((1, 1, 1, 1)))
    np.testing.assert_array_equal(t.grad[0, 0], [[0.0, 1.0], [0.0, 0.0]])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pool2d_overlapping_windows_accumulate(dtype, layout):
    # 3x3 plane, 2x2 windows, stride 1: the centre is the max of all four windows
    plane = np.array([[0.0, 1.0, 0.0], [2.0, 9.0, 3.0], [0.0, 4.0, 0.0]])
    x = np.stack([plane, -plane])[None].astype(dtype)               # (1, 2, 3, 3)
    x = x if layout == "NCHW" else x.transpose(0, 2, 3, 1).copy()
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, 2, 1, layout=layout)
    gy = seeded(y.shape, dtype, 0)
    y.backward(gy)
    close(t.grad, ref.max_pool2d_backward(gy, x, 2, 1, layout), dtype)
    gx_c = t.grad if layout == "NCHW" else t.grad.transpose(0, 3, 1, 2)
    gy_c = gy if layout == "NCHW" else gy.transpose(0, 3, 1, 2)
    np.testing.assert_allclose(gx_c[0, 0, 1, 1], gy_c[0, 0].sum(), **TOL[dtype])


def test_max_pool2d_saves_a_one_byte_argmax_not_x():
    x = nf.Tensor(seeded((2, 3, 6, 6), np.float32, 0), requires_grad=True)
    y = nf.max_pool2d(x, 2)
    assert set(vars(y._fn.saved)) == {"argmax"}
    assert y._fn.saved.argmax.dtype == np.uint8 and y._fn.saved.argmax.shape == y.shape
    assert nf.saved_bytes(y) == y.data.size                          # 1 byte per output


def test_max_pool2d_windows_over_256_taps_use_uint16():
    x = seeded((1, 2, 17, 18), np.float64, 1)
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, (17, 16), (1, 2))                           # 272 taps, 2 windows
    assert y._fn.saved.argmax.dtype == np.uint16
    np.testing.assert_array_equal(y._fn.saved.argmax, first_max_taps(x, (17, 16), (1, 2),
                                                                     "NCHW"))
    gy = seeded(y.shape, np.float64, 2)
    y.backward(gy)
    close(t.grad, ref.max_pool2d_backward(gy, x, (17, 16), (1, 2), "NCHW"), np.float64)


def test_max_pool2d_propagates_nan_and_routes_its_gradient_to_the_first_nan():
    x = np.array([[[[1.0, np.nan], [5.0, np.nan]]]])
    t = nf.Tensor(x, requires_grad=True)
    y = nf.max_pool2d(t, 2)
    assert np.isnan(y.data).all()
    y.backward(np.ones((1, 1, 1, 1)))
    np.testing.assert_array_equal(t.grad[0, 0], [[0.0, 1.0], [0.0, 0.0]])


@given(nfs.dtypes(), nfs.layouts(), st.tuples(*[st.integers(1, 4)] * 4), seeds)
def test_global_avg_pool2d_matches_reference(dtype, layout, shape, seed):
    x = seeded(shape, dtype, seed)
    t = nf.Tensor(x, requires_grad=True)
    y = nf.global_avg_pool2d(t, layout=layout)
    close(y.data, ref.global_avg_pool2d(x, layout), dtype)
    gy = seeded(y.shape, dtype, seed + 1)
    y.backward(gy)
    close(t.grad, ref.global_avg_pool2d_backward(gy, x.shape, layout), dtype)


# --------------------------------------------------------------------------- shape ops

@given(shapes, seeds)
def test_flatten_and_squeeze(shape, seed):
    x = seeded(shape + (1,), np.float64, seed)
    t = nf.Tensor(x, requires_grad=True)
    y = nf.flatten(nf.squeeze(t, -1))
    assert y.shape == (shape[0], int(np.prod(shape[1:], dtype=np.int64)))
    np.testing.assert_array_equal(y.data, x.reshape(y.shape))
    gy = seeded(y.shape, np.float64, seed + 1)
    y.backward(gy)
    np.testing.assert_array_equal(t.grad, gy.reshape(x.shape))


# --------------------------------------------------------------------------- cross_entropy

@given(xent_problems())
def test_cross_entropy_matches_reference(problem):
    logits, labels = problem
    dtype = logits.dtype.type
    t = nf.Tensor(logits, requires_grad=True)
    y = nf.cross_entropy(t, labels)
    assert y.shape == () and np.isfinite(y.data)
    close(y.data, ref.cross_entropy(logits, labels), dtype)
    y.backward(np.asarray(0.5, dtype))
    close(t.grad, ref.cross_entropy_backward(0.5, logits, labels), dtype)


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1000.0, 0.0], [-1000.0, 1000.0]])
    np.testing.assert_allclose(nf.cross_entropy(logits, np.array([0, 1])), 0.0, atol=1e-12)


# --------------------------------------------------------------------------- gradcheck (tape)

def _t(a):
    return nf.Tensor(a, requires_grad=True)


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(shapes, seeds)
def test_gradcheck_relu(shape, seed):
    x = seeded(shape, np.float64, seed)
    x[np.abs(x) < 1e-3] = 0.5                                      # away from the kink
    assert nf.gradcheck(nf.relu, [_t(x)])


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(linear_problems(dtype=np.float64))
def test_gradcheck_linear(problem):
    x, w, b = problem
    assert nf.gradcheck(nf.linear, [_t(x), _t(w)] + ([] if b is None else [_t(b)]))


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(pool_problems(dtype=np.float64, max_size=5), seeds)
def test_gradcheck_max_pool2d(problem, seed):
    _, k, stride, layout = problem
    # distinct values, so finite differences never straddle a tie
    x = np.random.default_rng(seed).permutation(problem[0].size).reshape(problem[0].shape)
    assert nf.gradcheck(lambda t: nf.max_pool2d(t, k, stride, layout=layout),
                        [_t(x.astype(np.float64))])


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(nfs.layouts(), st.tuples(*[st.integers(1, 3)] * 4), seeds)
def test_gradcheck_global_avg_pool2d(layout, shape, seed):
    x = seeded(shape, np.float64, seed)
    assert nf.gradcheck(lambda t: nf.global_avg_pool2d(t, layout=layout), [_t(x)])


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(xent_problems(dtype=np.float64))
def test_gradcheck_cross_entropy(problem):
    logits, labels = problem
    assert nf.gradcheck(lambda t: nf.cross_entropy(t, labels), [_t(logits / 10)])


@settings(max_examples=GRADCHECK_EXAMPLES)
@given(seeds)
def test_gradcheck_small_network(seed):
    # conv-free head of a CNN: relu -> max_pool -> flatten -> linear -> cross_entropy
    x, w = seeded((2, 2, 4, 4), np.float64, seed), seeded((3, 8), np.float64, seed + 1)
    labels = np.array([2, 0])

    def net(x, w):
        return nf.cross_entropy(nf.linear(nf.flatten(nf.max_pool2d(nf.relu(x), 2)), w), labels)

    assert nf.gradcheck(net, [_t(x), _t(w)], mode="directional")


def test_array_in_array_out_and_tensor_in_tensor_out():
    x = seeded((1, 1, 2, 2), np.float32, 0)
    assert isinstance(nf.max_pool2d(x, 2), np.ndarray)
    y = nf.max_pool2d(nf.Tensor(x), 2)
    assert isinstance(y, nf.Tensor) and not y.requires_grad
    with nf.no_grad():
        y = nf.relu(nf.Tensor(x, requires_grad=True))
    assert not y.requires_grad and nf.saved_bytes(y) == 0


# --------------------------------------------------------------------------- bad input

F64 = np.zeros((2, 3, 4, 4))
F32 = np.zeros((2, 3, 4, 4), np.float32)
LOGITS = np.zeros((3, 4))

BAD = [
    # (call, exception, words the message must contain)
    (lambda: nf.relu([1.0, 2.0]), TypeError, ["relu", "x"]),
    (lambda: nf.relu(np.arange(3)), TypeError, ["relu", "x", "float32 or float64"]),
    (lambda: nf.linear(np.zeros((2, 3)), np.zeros((4, 5))), ValueError,
     ["linear", "w", "input features"]),
    (lambda: nf.linear(np.zeros(3), np.zeros((4, 3))), ValueError, ["linear", "x", "2 dim"]),
    (lambda: nf.linear(np.zeros((2, 3)), np.zeros((4, 3, 1))), ValueError,
     ["linear", "w", "2 dim"]),
    (lambda: nf.linear(np.zeros((2, 3)), np.zeros((4, 3)), np.zeros(5)), ValueError,
     ["linear", "b", "(4,)"]),
    (lambda: nf.linear(np.zeros((2, 3), np.float32), np.zeros((4, 3))), TypeError,
     ["linear", "w", "float32"]),
    (lambda: nf.max_pool2d(np.zeros((2, 3, 4)), 2), ValueError, ["max_pool2d", "x", "4 dim"]),
    (lambda: nf.max_pool2d(F64, 5), ValueError, ["max_pool2d", "k", "larger"]),
    (lambda: nf.max_pool2d(F64, 0), ValueError, ["max_pool2d", "k"]),
    (lambda: nf.max_pool2d(F64, 2.5), TypeError, ["max_pool2d", "k"]),
    (lambda: nf.max_pool2d(F64, 2, 0), ValueError, ["max_pool2d", "stride"]),
    (lambda: nf.max_pool2d(F64, 2, layout="NWHC"), ValueError, ["max_pool2d", "layout"]),
    (lambda: nf.max_pool2d(F32.astype(np.int32), 2), TypeError, ["max_pool2d", "x"]),
    (lambda: nf.global_avg_pool2d(np.zeros((2, 3))), ValueError,
     ["global_avg_pool2d", "x", "4 dim"]),
    (lambda: nf.global_avg_pool2d(F64, layout="CHWN"), ValueError,
     ["global_avg_pool2d", "layout"]),
    (lambda: nf.global_avg_pool2d(np.zeros((2, 3, 0, 4))), ValueError,
     ["global_avg_pool2d", "x", "empty"]),
    (lambda: nf.flatten(np.zeros(())), ValueError, ["flatten", "x"]),
    (lambda: nf.flatten(np.zeros(3, np.int64)), TypeError, ["flatten", "x"]),
    (lambda: nf.squeeze(F64, 1), ValueError, ["squeeze", "axis", "size 3"]),
    (lambda: nf.squeeze(F64, 4), ValueError, ["squeeze", "axis", "out of range"]),
    (lambda: nf.squeeze(F64, "1"), TypeError, ["squeeze", "axis"]),
    (lambda: nf.cross_entropy(LOGITS, np.array([0, 1, 4])), ValueError,
     ["cross_entropy", "labels", "[0, 4)"]),
    (lambda: nf.cross_entropy(LOGITS, np.array([0, -1, 2])), ValueError,
     ["cross_entropy", "labels"]),
    (lambda: nf.cross_entropy(LOGITS, np.array([0.0, 1.0, 2.0])), TypeError,
     ["cross_entropy", "labels", "integers"]),
    (lambda: nf.cross_entropy(LOGITS, np.array([0, 1])), ValueError,
     ["cross_entropy", "labels", "(3,)"]),
    (lambda: nf.cross_entropy(np.zeros(4), np.array([0])), ValueError,
     ["cross_entropy", "logits", "2 dim"]),
    (lambda: nf.cross_entropy(LOGITS.astype(np.int64), np.array([0, 1, 2])), TypeError,
     ["cross_entropy", "logits"]),
    (lambda: nf.cross_entropy(LOGITS, [0, 1, 2]), TypeError, ["cross_entropy", "labels"]),
]


@pytest.mark.parametrize("call,exc,words", BAD, ids=range(len(BAD)))
def test_bad_input_names_the_op_and_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_every_op_has_a_function_named_after_it():
    names = {cls.name for cls in (basic.ReLU, basic.Linear, basic.MaxPool2d,
                                  basic.GlobalAvgPool2d, basic.Flatten, basic.Squeeze,
                                  basic.CrossEntropy)}
    assert names == {"relu", "linear", "max_pool2d", "global_avg_pool2d", "flatten", "squeeze",
                     "cross_entropy"}


def test_remapper_can_rebuild_each_op_from_its_params():
    t = nf.Tensor(seeded((1, 4, 4, 2), np.float64, 0), requires_grad=True)
    y = nf.max_pool2d(t, (2, 1), (1, 2), layout="NHWC")
    fn = y._fn
    rebuilt = type(fn)(**fn.param_dict()).apply(t.data)
    np.testing.assert_array_equal(rebuilt, y.data)
