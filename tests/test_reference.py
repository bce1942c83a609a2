"""The reference checked against independent oracles.

The reference (numbafuse/reference.py) is the specification every kernel is tested against, so
it is tested here only against things that do not share its code: SciPy's ``correlate``, naive
per-pixel loops, ``np.var(ddof=1)``, ``scipy.special.log_softmax``, hand-worked examples, and
central finite differences in float64 for every backward.

Gradient checks compare one scalar two ways (as HIPS autograd does): for a random output
cotangent u and input direction v, <u, J v> by finite differences along v, against
sum_i <backward(u)_i, v_i>. Inputs are drawn away from kinks (ReLU at 0, max-pool ties).
"""
import numpy as np
import pytest
import scipy.signal
import scipy.special
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from numbafuse import reference as ref

STEP = 1e-6          # central-difference step, float64
GRAD_RTOL = 1e-5     # |fd - analytic| <= GRAD_RTOL * (1 + sum_i |<g_i, v_i>| terms)
KINK_MARGIN = 1e-3   # pre-activations closer than this to 0 are rejected (STEP*|Jv| << this)
LAYOUTS = ("NCHW", "NHWC")

seeds = st.integers(0, 2**32 - 1)
layouts = st.sampled_from(LAYOUTS)


# --------------------------------------------------------------------------- oracles

def to_nhwc(a):
    return a.transpose(0, 2, 3, 1)       # (N, C, H, W) -> (N, H, W, C)


def to_nchw(a):
    return a.transpose(0, 3, 1, 2)       # (N, H, W, C) -> (N, C, H, W)


def as_pair(v):
    return (v, v) if isinstance(v, (int, str)) else tuple(v)


def tf_same_padding(size, k, stride, dilation):
    """TensorFlow's "same" padding in the form of its own source (conv_ops / nn_ops docs)."""
    extent = dilation * (k - 1) + 1
    if size % stride == 0:
        total = max(extent - stride, 0)
    else:
        total = max(extent - size % stride, 0)
    return total // 2, total - total // 2


def oracle_padding(size, k, stride, dilation, padding):
    if padding == "valid":
        return 0, 0
    if padding == "same":
        return tf_same_padding(size, k, stride, dilation)
    return padding, padding


def conv2d_oracle(x, w, stride=1, padding=0, dilation=1):
    """NCHW cross-correlation by scipy.signal.correlate: dilate w with zeros, correlate each
    (n, k) pair over channels in "valid" mode on the padded input, keep every stride-th output."""
    (sh, sw), (dh, dw), (ph, pw) = as_pair(stride), as_pair(dilation), as_pair(padding)
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    pads = (oracle_padding(H, R, sh, dh, ph), oracle_padding(W, S, sw, dw, pw))
    x_pad = np.pad(x, ((0, 0), (0, 0)) + pads)
    w_dil = np.zeros((K, C, dh * (R - 1) + 1, dw * (S - 1) + 1))
    w_dil[:, :, ::dh, ::dw] = w
    y = np.array([[sum(scipy.signal.correlate(x_pad[n, c], w_dil[k, c], mode="valid",
                                              method="direct") for c in range(C))
                   for k in range(K)] for n in range(N)])
    return y[:, :, ::sh, ::sw]


def max_pool_oracle(x, k, stride):
    """NCHW max pooling and its backward by per-window loops; first maximum (row-major) wins."""
    N, C, H, W = x.shape
    P, Q = (H - k) // stride + 1, (W - k) // stride + 1
    y, gx_of = np.zeros((N, C, P, Q)), {}
    for n, c, p, q in np.ndindex(N, C, P, Q):
        window = x[n, c, p * stride:p * stride + k, q * stride:q * stride + k]
        y[n, c, p, q] = window.max()
        i, j = divmod(int(np.argmax(window)), k)      # first maximum in row-major order
        gx_of[n, c, p, q] = (n, c, p * stride + i, q * stride + j)
    return y, gx_of


def check_vjp(forward, backward, inputs, rng):
    """<u, J v> by central differences against sum_i <backward(u, *inputs)_i, v_i>.

    ``forward(*inputs)`` returns an array; ``backward(u, *inputs)`` returns one gradient per
    input, None for an input that is not differentiated.
    """
    y = forward(*inputs)
    u = rng.standard_normal(np.shape(y))
    grads = backward(u, *inputs)
    assert len(grads) == len(inputs)
    vs = [None if g is None else rng.standard_normal(np.shape(a))
          for a, g in zip(inputs, grads)]
    for a, g in zip(inputs, grads):
        assert g is None or np.shape(g) == np.shape(a)

    def along(t):
        moved = [a if v is None else a + t * v for a, v in zip(inputs, vs)]
        return np.sum(u * forward(*moved))

    fd = (along(STEP) - along(-STEP)) / (2 * STEP)
    terms = [np.sum(g * v) for g, v in zip(grads, vs) if g is not None]
    analytic = sum(terms)
    scale = 1.0 + sum(np.sum(np.abs(g * v)) for g, v in zip(grads, vs) if g is not None)
    assert abs(fd - analytic) <= GRAD_RTOL * scale, (fd, analytic, terms)


def numeric_gradient(f, x):
    """Gradient of the scalar f at x, element by element, by central differences."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = STEP
        g[i] = (f(x + e) - f(x - e)) / (2 * STEP)
    return g


# --------------------------------------------------------------------------- strategies

@st.composite
def conv_problems(draw, paddings=None):
    """(x NCHW, w, kwargs) of a tiny convolution whose output is at least 1x1."""
    rng = np.random.default_rng(draw(seeds))
    N, C, K = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    R, S = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    H, W = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    ints = st.integers(1, 2)
    stride = draw(st.one_of(ints, st.tuples(ints, ints)))
    dilation = draw(st.one_of(ints, st.tuples(ints, ints)))
    pads = st.integers(0, 2)
    padding = draw(paddings if paddings is not None else st.one_of(
        pads, st.tuples(pads, pads), st.sampled_from(["valid", "same"])))
    (sh, sw), (dh, dw), (ph, pw) = as_pair(stride), as_pair(dilation), as_pair(padding)
    for size, k, s, d, p in ((H, R, sh, dh, ph), (W, S, sw, dw, pw)):
        begin, end = oracle_padding(size, k, s, d, p)
        assume(size + begin + end - d * (k - 1) >= 1)
    x = rng.standard_normal((N, C, H, W))
    w = rng.standard_normal((K, C, R, S))
    return x, w, dict(stride=stride, padding=padding, dilation=dilation)


def relayout(a, layout):
    """An NCHW array in ``layout``."""
    return to_nhwc(a) if layout == "NHWC" else a


def unlayout(a, layout):
    """An array in ``layout`` back to NCHW."""
    return to_nchw(a) if layout == "NHWC" else a


# --------------------------------------------------------------------------- padding, conv2d

@settings(deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_same_padding_is_tensorflows(size, k, stride, dilation):
    begin, end = ref.resolve_padding(size, k, stride, dilation, "same")
    assert (begin, end) == tf_same_padding(size, k, stride, dilation)
    assert ref.conv_output_size(size, k, stride, "same", dilation) == -(-size // stride)


def test_padding_hand_cases():
    assert ref.resolve_padding(6, 2, 1, 1, "same") == (0, 1)     # odd total: extra at the end
    assert ref.resolve_padding(6, 3, 2, 1, "same") == (0, 1)
    assert ref.resolve_padding(7, 3, 2, 1, "same") == (1, 1)
    assert ref.resolve_padding(6, 3, 1, 2, "same") == (2, 2)     # dilated extent 5
    assert ref.resolve_padding(5, 1, 2, 1, "same") == (0, 0)
    assert ref.resolve_padding(5, 3, 1, 1, "valid") == (0, 0)
    assert ref.resolve_padding(5, 3, 1, 1, 2) == (2, 2)
    assert ref.conv_output_size(7, 3, stride=2, padding=1, dilation=1) == 4
    for bad in ("full", -1):
        with pytest.raises(ValueError):
            ref.resolve_padding(5, 3, 1, 1, bad)


@settings(deadline=None)
@given(conv_problems(), layouts)
def test_conv2d_matches_scipy_correlate(problem, layout):
    x, w, kw = problem
    y = ref.conv2d(relayout(x, layout), w, layout=layout, **kw)
    np.testing.assert_allclose(unlayout(y, layout), conv2d_oracle(x, w, **kw),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("H, W, k, stride", [(6, 6, 2, 1), (6, 5, 2, 2), (6, 7, 3, 2)])
def test_conv2d_asymmetric_same_padding(H, W, k, stride):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 2, H, W)), rng.standard_normal((3, 2, k, k))
    y = ref.conv2d(x, w, stride=stride, padding="same")
    assert y.shape[2:] == (-(-H // stride), -(-W // stride))
    # the same thing with the padding written out by hand: begin = total // 2, rest at the end
    pads = [tf_same_padding(size, k, stride, 1) for size in (H, W)]
    x_pad = np.pad(x, ((0, 0), (0, 0), pads[0], pads[1]))
    np.testing.assert_allclose(y, conv2d_oracle(x_pad, w, stride=stride), rtol=1e-12,
                               atol=1e-12)


def test_conv2d_hand_worked_example():
    x = np.arange(9.0).reshape(1, 1, 3, 3)
    y = ref.conv2d(x, np.ones((1, 1, 2, 2)))
    np.testing.assert_array_equal(y[0, 0], [[8, 12], [20, 24]])
    w = np.arange(4.0).reshape(1, 1, 2, 2)
    gx, gw = ref.conv2d_backward(np.ones((1, 1, 2, 2)), x, w)
    np.testing.assert_array_equal(gx[0, 0], [[0, 1, 1], [2, 6, 4], [2, 5, 3]])
    np.testing.assert_array_equal(gw[0, 0], [[8, 12], [20, 24]])   # x correlated with gy = 1


def test_conv2d_full_gradient():
    """Every element of gx and gw by finite differences, on one awkward geometry."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 2, 6, 5)), rng.standard_normal((3, 2, 2, 3))
    kw = dict(stride=(2, 1), padding="same", dilation=(1, 2))
    u = rng.standard_normal(ref.conv2d(x, w, **kw).shape)
    gx, gw = ref.conv2d_backward(u, x, w, **kw)
    np.testing.assert_allclose(gx, numeric_gradient(lambda x_: np.sum(u * ref.conv2d(x_, w, **kw)),
                                                    x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gw, numeric_gradient(lambda w_: np.sum(u * ref.conv2d(x, w_, **kw)),
                                                    w), rtol=1e-6, atol=1e-8)


@settings(deadline=None)
@given(conv_problems(), layouts, seeds)
def test_conv2d_backward(problem, layout, seed):
    x, w, kw = problem
    check_vjp(lambda x_, w_: ref.conv2d(x_, w_, layout=layout, **kw),
              lambda gy, x_, w_: ref.conv2d_backward(gy, x_, w_, layout=layout, **kw),
              [relayout(x, layout), w], np.random.default_rng(seed))


def test_conv2d_errors():
    x, w = np.zeros((1, 3, 4, 4)), np.zeros((2, 3, 3, 3))
    with pytest.raises(ValueError, match="input channels"):
        ref.conv2d(x, np.zeros((2, 2, 3, 3)))
    with pytest.raises(ValueError, match="output size"):
        ref.conv2d(x, np.zeros((2, 3, 5, 5)))
    with pytest.raises(ValueError, match="layout"):
        ref.conv2d(x, w, layout="CHWN")
    with pytest.raises(ValueError, match="stride"):
        ref.conv2d(x, w, stride=0)


# --------------------------------------------------------------------------- elementwise

@st.composite
def activations(draw, away_from_zero=False):
    """An NCHW float64 array, optionally with every value at least KINK_MARGIN*100 from 0."""
    rng = np.random.default_rng(draw(seeds))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5)),
             draw(st.integers(1, 5)))
    x = rng.standard_normal(shape)
    if away_from_zero:
        x = np.where(x >= 0, x + 0.1, x - 0.1)
    return x


@settings(deadline=None)
@given(activations(), layouts, seeds)
def test_bias_add(x, layout, seed):
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(x.shape[1])
    y = unlayout(ref.bias_add(relayout(x, layout), b, layout=layout), layout)
    for c in range(x.shape[1]):
        np.testing.assert_array_equal(y[:, c], x[:, c] + b[c])
    check_vjp(lambda x_, b_: ref.bias_add(x_, b_, layout=layout),
              lambda gy, x_, b_: ref.bias_add_backward(gy, layout=layout),
              [relayout(x, layout), b], rng)


@settings(deadline=None)
@given(activations(away_from_zero=True), seeds)
def test_relu(x, seed):
    np.testing.assert_array_equal(ref.relu(x), np.where(x > 0, x, 0.0))
    check_vjp(ref.relu, lambda gy, x_: (ref.relu_backward(gy, x_),), [x],
              np.random.default_rng(seed))


def test_relu_gradient_is_zero_at_zero():
    x = np.array([-1.0, 0.0, 2.0])
    np.testing.assert_array_equal(ref.relu_backward(np.ones(3), x), [0.0, 0.0, 1.0])


@settings(deadline=None)
@given(activations(), seeds)
def test_add(x, seed):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(x.shape)
    np.testing.assert_array_equal(ref.add(x, z), x + z)
    check_vjp(ref.add, lambda gy, x_, z_: ref.add_backward(gy), [x, z], rng)


# --------------------------------------------------------------------------- batch norm

@st.composite
def batchnorm_problems(draw):
    """(x NCHW, gamma, beta, running_mean, running_var) with >= 2 values per channel and no
    channel nearly constant (invstd stays moderate, so finite differences stay accurate)."""
    x = draw(activations())
    N, C, H, W = x.shape
    assume(N * H * W >= 2)
    assume(x.var(axis=(0, 2, 3)).min() > 1e-2)
    rng = np.random.default_rng(draw(seeds))
    gamma, beta = rng.standard_normal(C), rng.standard_normal(C)
    running_mean, running_var = rng.standard_normal(C), rng.uniform(0.5, 2.0, C)
    return x, gamma, beta, running_mean, running_var


def batchnorm_oracle(x, gamma, beta, eps):
    """Training batch norm channel by channel, from np.mean and np.std."""
    y = np.empty_like(x)
    for c in range(x.shape[1]):
        xc = x[:, c]
        y[:, c] = gamma[c] * (xc - np.mean(xc)) / np.sqrt(np.std(xc) ** 2 + eps) + beta[c]
    return y


@settings(deadline=None)
@given(batchnorm_problems(), layouts, seeds)
def test_batchnorm_train(problem, layout, seed):
    x, gamma, beta, _, _ = problem
    eps = 1e-3
    y, mean, var = ref.batchnorm_train(relayout(x, layout), gamma, beta, eps=eps, layout=layout)
    np.testing.assert_allclose(unlayout(y, layout), batchnorm_oracle(x, gamma, beta, eps),
                               rtol=1e-10, atol=1e-12)
    for c in range(x.shape[1]):
        np.testing.assert_allclose([mean[c], var[c]], [np.mean(x[:, c]), np.var(x[:, c])],
                                   rtol=1e-12, atol=1e-14)
    check_vjp(lambda *a: ref.batchnorm_train(*a, eps=eps, layout=layout)[0],
              lambda gy, x_, g_, b_: ref.batchnorm_backward(gy, x_, g_, eps=eps, layout=layout),
              [relayout(x, layout), gamma, beta], np.random.default_rng(seed))


@settings(deadline=None)
@given(batchnorm_problems(), layouts, seeds)
def test_batchnorm_infer(problem, layout, seed):
    x, gamma, beta, rm, rv = problem
    eps = 1e-3
    y = ref.batchnorm_infer(relayout(x, layout), gamma, beta, rm, rv, eps=eps, layout=layout)
    for c in range(x.shape[1]):
        expected = gamma[c] * (x[:, c] - rm[c]) / np.sqrt(rv[c] + eps) + beta[c]
        np.testing.assert_allclose(unlayout(y, layout)[:, c], expected, rtol=1e-12, atol=1e-12)
    check_vjp(lambda x_, g_, b_: ref.batchnorm_infer(x_, g_, b_, rm, rv, eps=eps, layout=layout),
              lambda gy, x_, g_, b_: ref.batchnorm_infer_backward(
                  gy, x_, g_, rv, eps=eps, layout=layout, running_mean=rm),
              [relayout(x, layout), gamma, beta], np.random.default_rng(seed))


def test_batchnorm_infer_backward_needs_running_mean():
    x = np.ones((2, 1, 2, 2))
    with pytest.raises(ValueError, match="running_mean"):
        ref.batchnorm_infer_backward(x, x, np.ones(1), np.ones(1))


def test_running_stats_update_by_hand():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 4, 5))
    rm, rv = rng.standard_normal(2), rng.uniform(0.5, 2, 2)
    rm0, rv0 = rm.copy(), rv.copy()
    m = 0.3
    _, mean, var = ref.batchnorm_train(x, np.ones(2), np.zeros(2))
    new_mean, new_var = ref.update_running_stats(rm, rv, mean, var, count=3 * 4 * 5, momentum=m)
    for c in range(2):
        xc = x[:, c].ravel()
        assert np.isclose(new_mean[c], (1 - m) * rm0[c] + m * xc.mean(), rtol=1e-12)
        assert np.isclose(new_var[c], (1 - m) * rv0[c] + m * np.var(xc, ddof=1), rtol=1e-12)
    np.testing.assert_array_equal(rm, rm0)          # pure: the old stats are untouched
    np.testing.assert_array_equal(rv, rv0)
    # the composites update the same way, and return new arrays
    z = np.zeros_like(x)
    _, got_mean, got_var = ref.batchnorm_add_relu(x, z, np.ones(2), np.zeros(2), rm, rv,
                                                  momentum=m)
    np.testing.assert_allclose(got_mean, new_mean, rtol=1e-12)
    np.testing.assert_allclose(got_var, new_var, rtol=1e-12)
    np.testing.assert_array_equal(rm, rm0)
    np.testing.assert_array_equal(rv, rv0)
    with pytest.raises(ValueError):
        ref.update_running_stats(rm, rv, mean, var, count=1, momentum=m)


def test_fold_batchnorm_equals_conv_then_inference_batchnorm():
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3)), \
        rng.standard_normal(4)
    gamma, beta, rm = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(4)
    rv = rng.uniform(0.5, 2.0, 4)
    kw = dict(stride=2, padding="same", dilation=1)
    w_f, b_f = ref.fold_batchnorm(w, b, gamma, beta, rm, rv, eps=1e-3)
    folded = ref.bias_add(ref.conv2d(x, w_f, **kw), b_f)
    unfolded = ref.batchnorm_infer(ref.bias_add(ref.conv2d(x, w, **kw), b), gamma, beta, rm, rv,
                                   eps=1e-3)
    np.testing.assert_allclose(folded, unfolded, rtol=1e-10, atol=1e-12)
    w_f, b_f = ref.fold_batchnorm(w, None, gamma, beta, rm, rv, eps=1e-3)     # no conv bias
    np.testing.assert_allclose(ref.bias_add(ref.conv2d(x, w_f, **kw), b_f),
                               ref.batchnorm_infer(ref.conv2d(x, w, **kw), gamma, beta, rm, rv,
                                                   eps=1e-3), rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- linear, pooling, loss

@settings(deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), seeds)
def test_linear(N, n_in, n_out, seed):
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((N, n_in)), rng.standard_normal((n_out, n_in)), \
        rng.standard_normal(n_out)
    expected = np.array([[sum(x[n, i] * w[o, i] for i in range(n_in)) + b[o]
                          for o in range(n_out)] for n in range(N)])
    np.testing.assert_allclose(ref.linear(x, w, b), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.linear(x, w), expected - b, rtol=1e-12, atol=1e-12)
    check_vjp(ref.linear, lambda gy, x_, w_, b_: ref.linear_backward(gy, x_, w_), [x, w, b], rng)


@st.composite
def pool_problems(draw):
    """(x NCHW with distinct values 0.1 apart, k, stride or None)."""
    rng = np.random.default_rng(draw(seeds))
    k = draw(st.integers(1, 3))
    stride = draw(st.one_of(st.none(), st.integers(1, 3)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(k, 7)),
             draw(st.integers(k, 7)))
    x = 0.1 * rng.permutation(np.prod(shape)).reshape(shape) - 1.0
    return x, k, stride


@settings(deadline=None)
@given(pool_problems(), layouts, seeds)
def test_max_pool2d(problem, layout, seed):
    x, k, stride = problem
    rng = np.random.default_rng(seed)
    y_oracle, _ = max_pool_oracle(x, k, k if stride is None else stride)
    y = ref.max_pool2d(relayout(x, layout), k, stride, layout=layout)
    np.testing.assert_array_equal(unlayout(y, layout), y_oracle)
    check_vjp(lambda x_: ref.max_pool2d(x_, k, stride, layout=layout),
              lambda gy, x_: (ref.max_pool2d_backward(gy, x_, k, stride, layout=layout),),
              [relayout(x, layout)], rng)


@pytest.mark.parametrize("k, stride", [(2, None), (2, 1), (3, 2)])
def test_max_pool2d_ties_go_to_first_maximum(k, stride):
    rng = np.random.default_rng(4)
    x = rng.integers(0, 3, size=(2, 2, 6, 7)).astype(np.float64)     # many ties
    s = k if stride is None else stride
    y_oracle, source = max_pool_oracle(x, k, s)
    gy = rng.standard_normal(y_oracle.shape)
    expected = np.zeros_like(x)
    for out, src in source.items():
        expected[src] += gy[out]
    np.testing.assert_array_equal(ref.max_pool2d(x, k, stride), y_oracle)
    np.testing.assert_allclose(ref.max_pool2d_backward(gy, x, k, stride), expected,
                               rtol=1e-12, atol=1e-12)
    # all-equal window: the top-left element takes everything
    gx = ref.max_pool2d_backward(np.ones((1, 1, 1, 1)), np.zeros((1, 1, 2, 2)), 2)
    np.testing.assert_array_equal(gx[0, 0], [[1, 0], [0, 0]])


@settings(deadline=None)
@given(activations(), layouts, seeds)
def test_global_avg_pool2d(x, layout, seed):
    N, C, H, W = x.shape
    expected = np.array([[x[n, c].sum() / (H * W) for c in range(C)] for n in range(N)])
    xl = relayout(x, layout)
    np.testing.assert_allclose(ref.global_avg_pool2d(xl, layout=layout), expected, rtol=1e-12,
                               atol=1e-14)
    check_vjp(lambda x_: ref.global_avg_pool2d(x_, layout=layout),
              lambda gy, x_: (ref.global_avg_pool2d_backward(gy, x_.shape, layout=layout),),
              [xl], np.random.default_rng(seed))


@settings(deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), seeds)
def test_cross_entropy(N, classes, seed):
    rng = np.random.default_rng(seed)
    logits, labels = rng.standard_normal((N, classes)), rng.integers(0, classes, N)
    expected = -np.mean(scipy.special.log_softmax(logits, axis=1)[np.arange(N), labels])
    loss = ref.cross_entropy(logits, labels)
    assert loss.shape == ()
    assert np.isclose(loss, expected, rtol=1e-12, atol=1e-14)
    check_vjp(lambda l_: ref.cross_entropy(l_, labels),
              lambda gy, l_: (ref.cross_entropy_backward(gy, l_, labels),),
              [logits], rng)


def test_cross_entropy_is_stable():
    logits = np.array([[1000.0, 0.0], [0.0, -1000.0]])
    loss = ref.cross_entropy(logits, np.array([1, 0]))
    assert np.isclose(loss, 500.0)
    g = ref.cross_entropy_backward(1.0, logits, np.array([1, 0]))
    np.testing.assert_allclose(g, [[0.5, -0.5], [0.0, 0.0]], atol=1e-12)


# --------------------------------------------------------------------------- composites

@settings(deadline=None)
@given(conv_problems(), layouts, st.booleans(), seeds)
def test_conv_bias_relu(problem, layout, with_bias, seed):
    x, w, kw = problem
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(w.shape[0]) if with_bias else None
    pre = conv2d_oracle(x, w, **kw) + (0 if b is None else b.reshape(1, -1, 1, 1))
    assume(np.abs(pre).min() > KINK_MARGIN)
    xl = relayout(x, layout)
    y = ref.conv_bias_relu(xl, w, b, layout=layout, **kw)
    np.testing.assert_allclose(unlayout(y, layout), np.maximum(pre, 0), rtol=1e-12, atol=1e-12)
    if b is None:
        gx, gw, gb = ref.conv_bias_relu_backward(np.ones_like(y), xl, w, None, layout=layout,
                                                 **kw)
        assert gb is None
        check_vjp(lambda x_, w_: ref.conv_bias_relu(x_, w_, None, layout=layout, **kw),
                  lambda gy, x_, w_: ref.conv_bias_relu_backward(
                      gy, x_, w_, None, layout=layout, **kw)[:2],
                  [xl, w], rng)
    else:
        check_vjp(lambda x_, w_, b_: ref.conv_bias_relu(x_, w_, b_, layout=layout, **kw),
                  lambda gy, x_, w_, b_: ref.conv_bias_relu_backward(
                      gy, x_, w_, b_, layout=layout, **kw),
                  [xl, w, b], rng)


@settings(deadline=None)
@given(batchnorm_problems(), layouts, st.booleans(), seeds)
def test_batchnorm_add_relu(problem, layout, training, seed):
    x, gamma, beta, rm, rv = problem
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(x.shape)
    eps = 1e-3
    if training:
        bn = batchnorm_oracle(x, gamma, beta, eps)
    else:
        bn = (gamma.reshape(1, -1, 1, 1) * (x - rm.reshape(1, -1, 1, 1))
              / np.sqrt(rv.reshape(1, -1, 1, 1) + eps) + beta.reshape(1, -1, 1, 1))
    assume(np.abs(bn + z).min() > KINK_MARGIN)
    xl, zl = relayout(x, layout), relayout(z, layout)
    stats = dict(running_mean=rm, running_var=rv, training=training, eps=eps, layout=layout)
    y, new_rm, new_rv = ref.batchnorm_add_relu(xl, zl, gamma, beta, **stats)
    np.testing.assert_allclose(unlayout(y, layout), np.maximum(bn + z, 0), rtol=1e-10,
                               atol=1e-12)
    if not training:
        np.testing.assert_array_equal(new_rm, rm)
        np.testing.assert_array_equal(new_rv, rv)
        assert new_rm is not rm and new_rv is not rv

    def backward(gy, x_, z_, g_, b_):
        return ref.batchnorm_add_relu_backward(gy, x_, z_, g_, b_, **stats)

    check_vjp(lambda *a: ref.batchnorm_add_relu(*a, **stats)[0], backward,
              [xl, zl, gamma, beta], rng)


@settings(deadline=None)
@given(conv_problems(), layouts, st.booleans(), st.booleans(), seeds)
def test_conv_batchnorm_relu(problem, layout, training, relu, seed):
    x, w, kw = problem
    rng = np.random.default_rng(seed)
    K = w.shape[0]
    gamma, beta = rng.standard_normal(K), rng.standard_normal(K)
    rm, rv = rng.standard_normal(K), rng.uniform(0.5, 2.0, K)
    eps = 1e-3
    h = conv2d_oracle(x, w, **kw)
    if training:
        N, _, P, Q = h.shape
        assume(N * P * Q >= 2 and h.var(axis=(0, 2, 3)).min() > 1e-2)
        bn = batchnorm_oracle(h, gamma, beta, eps)
    else:
        bn = ref.batchnorm_infer(h, gamma, beta, rm, rv, eps=eps)
    if relu:
        assume(np.abs(bn).min() > KINK_MARGIN)
    xl = relayout(x, layout)
    opts = dict(running_mean=rm, running_var=rv, training=training, eps=eps, relu=relu,
                layout=layout, **kw)
    y, _, _ = ref.conv_batchnorm_relu(xl, w, gamma, beta, **opts)
    np.testing.assert_allclose(unlayout(y, layout), np.maximum(bn, 0) if relu else bn,
                               rtol=1e-9, atol=1e-11)
    check_vjp(lambda *a: ref.conv_batchnorm_relu(*a, **opts)[0],
              lambda gy, *a: ref.conv_batchnorm_relu_backward(gy, *a, **opts),
              [xl, w, gamma, beta], rng)


def test_composites_are_pure_and_keep_float32():
    rng = np.random.default_rng(5)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    x, z, w, b = f32(2, 3, 5, 5), f32(2, 3, 5, 5), f32(3, 3, 3, 3), f32(3)
    gamma, beta, rm = f32(3), f32(3), f32(3)
    rv = np.abs(f32(3)) + 0.5
    inputs = [x, z, w, b, gamma, beta, rm, rv]
    before = [a.copy() for a in inputs]
    outs = [ref.conv_bias_relu(x, w, b, padding=1),
            *ref.conv_bias_relu_backward(f32(2, 3, 5, 5), x, w, b, padding=1),
            *ref.batchnorm_add_relu(x, z, gamma, beta, rm, rv),
            *ref.batchnorm_add_relu_backward(f32(2, 3, 5, 5), x, z, gamma, beta, rm, rv),
            *ref.conv_batchnorm_relu(x, w, gamma, beta, rm, rv, padding="same"),
            *ref.conv_batchnorm_relu_backward(f32(2, 3, 5, 5), x, w, gamma, beta, rm, rv,
                                              padding="same"),
            *ref.fold_batchnorm(w, b, gamma, beta, rm, rv)]
    for a, a0 in zip(inputs, before):
        np.testing.assert_array_equal(a, a0)
    assert all(o.dtype == np.float32 for o in outs)
    y, new_rm, new_rv = ref.batchnorm_add_relu(x, z, gamma, beta)
    assert new_rm is None and new_rv is None


# --------------------------------------------------------------------------- layouts

def _layout_cases():
    """Op name -> fn(layout) giving its outputs with every activation back in NCHW."""
    rng = np.random.default_rng(6)
    x, z = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 5))
    w = rng.standard_normal((3, 3, 3, 2))
    b, gamma, beta, rm = (rng.standard_normal(3) for _ in range(4))
    rv = rng.uniform(0.5, 2.0, 3)
    conv = dict(stride=(2, 1), padding="same", dilation=(1, 2))
    gy_conv = rng.standard_normal(ref.conv2d(x, w, **conv).shape)
    gy_pool = rng.standard_normal(ref.max_pool2d(x, 2).shape)
    gy_gap = rng.standard_normal((2, 3))

    def case(fn, weights=()):
        """``weights``: indices of outputs that are (K, C, R, S) weights, never transposed."""
        def run(layout):
            to = (lambda a: relayout(a, layout))
            outs = fn(layout, to)
            outs = outs if isinstance(outs, tuple) else (outs,)
            return [unlayout(o, layout) if o is not None and o.ndim == 4 and i not in weights
                    else o for i, o in enumerate(outs)]
        return run

    return {
        "conv2d": case(lambda L, to: ref.conv2d(to(x), w, layout=L, **conv)),
        "conv2d_backward": case(lambda L, to: ref.conv2d_backward(to(gy_conv), to(x), w,
                                                                  layout=L, **conv),
                                  weights=(1,)),
        "bias_add": case(lambda L, to: ref.bias_add(to(x), b, layout=L)),
        "bias_add_backward": case(lambda L, to: ref.bias_add_backward(to(z), layout=L)),
        "batchnorm_train": case(lambda L, to: ref.batchnorm_train(to(x), gamma, beta, layout=L)),
        "batchnorm_backward": case(lambda L, to: ref.batchnorm_backward(to(z), to(x), gamma,
                                                                        layout=L)),
        "batchnorm_infer": case(lambda L, to: ref.batchnorm_infer(to(x), gamma, beta, rm, rv,
                                                                  layout=L)),
        "batchnorm_infer_backward": case(lambda L, to: ref.batchnorm_infer_backward(
            to(z), to(x), gamma, rv, layout=L, running_mean=rm)),
        "max_pool2d": case(lambda L, to: ref.max_pool2d(to(x), 2, layout=L)),
        "max_pool2d_backward": case(lambda L, to: ref.max_pool2d_backward(to(gy_pool), to(x), 2,
                                                                          layout=L)),
        "global_avg_pool2d": case(lambda L, to: ref.global_avg_pool2d(to(x), layout=L)),
        "global_avg_pool2d_backward": case(lambda L, to: ref.global_avg_pool2d_backward(
            gy_gap, to(x).shape, layout=L)),
        "conv_bias_relu": case(lambda L, to: ref.conv_bias_relu(to(x), w, b, layout=L, **conv)),
        "conv_bias_relu_backward": case(lambda L, to: ref.conv_bias_relu_backward(
            to(gy_conv), to(x), w, b, layout=L, **conv), weights=(1,)),
        "batchnorm_add_relu": case(lambda L, to: ref.batchnorm_add_relu(
            to(x), to(z), gamma, beta, rm, rv, layout=L)),
        "batchnorm_add_relu_backward": case(lambda L, to: ref.batchnorm_add_relu_backward(
            to(z), to(x), to(z), gamma, beta, rm, rv, training=False, layout=L)),
        "conv_batchnorm_relu": case(lambda L, to: ref.conv_batchnorm_relu(
            to(x), w, gamma, beta, rm, rv, layout=L, **conv)),
        "conv_batchnorm_relu_backward": case(lambda L, to: ref.conv_batchnorm_relu_backward(
            to(gy_conv), to(x), w, gamma, beta, rm, rv, layout=L, **conv), weights=(1,)),
    }


LAYOUT_CASES = _layout_cases()


@pytest.mark.parametrize("op", sorted(LAYOUT_CASES))
def test_nhwc_is_nchw_transposed(op):
    for got, expected in zip(LAYOUT_CASES[op]("NHWC"), LAYOUT_CASES[op]("NCHW")):
        if expected is None:
            assert got is None
        else:
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
