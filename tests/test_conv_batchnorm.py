"""Conv -> BatchNorm (-> ReLU) with recompute, and batch-norm folding (CPU).

Every check is against ``numbafuse.reference`` (the unfused NumPy/SciPy specification) or
finite differences: forward (training and inference, running statistics), the NumPy-style
backward, the tape's backward, gradcheck, the unfused chain on the tape, what is saved for
backward (only x, w, gamma, [beta], mean, invstd) and bad input (named errors, nothing written).
"""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.ops.conv_batchnorm import ConvBatchNormReLU
import numbafuse.testing.strategies as nfs

# The reference computes in float64 from the same float32 inputs. Gradients are compared with
# atol scaled by max(1, max|expected|) (_assert_grad_close). Measured worst error / that scale
# over 3000 random examples of problems(dtype=float32): y 3e-7, running stats 1e-7, folded
# w/b 2e-7, gx 2e-6, ggamma 8e-7, gw 1.2e-5. gw sets the float32 atol: with few values per
# channel (M = 2: xhat = +-1 whatever h is) gh is ~0 exactly and what is left is float32
# rounding of the cancelling terms, amplified by invstd, which the size of the result does
# not bound; 5e-5 leaves a 4x margin over the worst seen.
TOL = {np.float32: dict(rtol=1e-4, atol=5e-5), np.float64: dict(rtol=1e-9, atol=1e-10)}
GRADCHECK = dict(mode="directional", directions=2)
MOMENTUM, EPS = 0.1, 1e-5

small_conv = dict(max_batch=2, max_channels=3, max_size=6, max_kernel=3)


def _bn_params(K, dtype, seed):
    rng = np.random.default_rng(seed)
    return dict(gamma=rng.uniform(0.5, 1.5, K).astype(dtype),
                beta=rng.standard_normal(K).astype(dtype),
                running_mean=rng.standard_normal(K).astype(dtype),
                running_var=rng.uniform(0.5, 2.0, K).astype(dtype))


def _values_per_channel(p):
    y_shape = ref.conv2d(p.x, p.w, **p.kwargs).shape
    N, P, Q = (y_shape[0], y_shape[2], y_shape[3]) if p.layout == "NCHW" else y_shape[:3]
    return N * P * Q


@st.composite
def problems(draw, dtype=None, layout=None, **geometry):
    p = draw(nfs.conv_problems(dtype=dtype, layout=layout, bias=False,
                               **(geometry or small_conv)))
    assume(_values_per_channel(p) >= 2)
    bn = _bn_params(p.w.shape[0], p.x.dtype, draw(st.integers(0, 2**32 - 1)))
    return p, bn


# --------------------------------------------------------------------------- forward

@given(problems(), st.booleans(), st.booleans())
def test_forward_and_running_stats_vs_reference(problem, training, relu):
    p, bn = problem
    rm, rv = bn["running_mean"].copy(), bn["running_var"].copy()
    y = nf.conv_batchnorm_relu(p.x, p.w, bn["gamma"], bn["beta"], running_mean=rm,
                               running_var=rv, training=training, momentum=MOMENTUM, eps=EPS,
                               relu=relu, **p.kwargs)
    y_ref, rm_ref, rv_ref = ref.conv_batchnorm_relu(
        p.x, p.w, bn["gamma"], bn["beta"], bn["running_mean"], bn["running_var"], training,
        MOMENTUM, EPS, relu=relu, **p.kwargs)
    tol = TOL[p.x.dtype.type]
    assert y.dtype == p.x.dtype and y.shape == y_ref.shape
    np.testing.assert_allclose(y, y_ref, **tol)
    np.testing.assert_allclose(rm, rm_ref, **tol)
    np.testing.assert_allclose(rv, rv_ref, **tol)


@given(problems(dtype=np.float64))
def test_training_without_running_stats(problem):
    p, bn = problem
    y = nf.conv_batchnorm_relu(p.x, p.w, bn["gamma"], bn["beta"], **p.kwargs)
    y_ref, _, _ = ref.conv_batchnorm_relu(p.x, p.w, bn["gamma"], bn["beta"], **p.kwargs)
    np.testing.assert_allclose(y, y_ref, **TOL[np.float64])


# --------------------------------------------------------------------------- backward

@given(problems(), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_backward_vs_reference(problem, training, relu, seed):
    p, bn = problem
    args = dict(running_mean=bn["running_mean"], running_var=bn["running_var"],
                training=training, eps=EPS, relu=relu, **p.kwargs)
    y = ref.conv_batchnorm_relu(p.x, p.w, bn["gamma"], bn["beta"], **args)[0]
    gy = np.random.default_rng(seed).standard_normal(y.shape).astype(p.x.dtype)
    rm, rv = bn["running_mean"].copy(), bn["running_var"].copy()
    grads = nf.conv_batchnorm_relu_backward(gy, p.x, p.w, bn["gamma"], bn["beta"], **args)
    expected = ref.conv_batchnorm_relu_backward(gy, p.x, p.w, bn["gamma"], bn["beta"], **args)
    for name, g, e in zip(("gx", "gw", "ggamma", "gbeta"), grads, expected):
        assert g.dtype == p.x.dtype and g.shape == e.shape, name
        _assert_grad_close(g, e, p.x.dtype.type, name)
    np.testing.assert_array_equal(bn["running_mean"], rm)   # backward writes nothing
    np.testing.assert_array_equal(bn["running_var"], rv)


def _assert_grad_close(g, e, dtype, name):
    # gradients through a batch norm scale with gamma*invstd: compare relative to their size
    scale = max(1.0, float(np.abs(e).max()))
    tol = TOL[dtype]
    np.testing.assert_allclose(g, e, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=name)


@given(problems(), st.booleans(), st.integers(0, 2**32 - 1))
def test_tape_backward_vs_reference(problem, relu, seed):
    p, bn = problem
    tensors = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, bn["gamma"], bn["beta"])]
    y = nf.conv_batchnorm_relu(*tensors, relu=relu, **p.kwargs)
    gy = np.random.default_rng(seed).standard_normal(y.shape).astype(p.x.dtype)
    y.backward(gy)
    expected = ref.conv_batchnorm_relu_backward(gy, p.x, p.w, bn["gamma"], bn["beta"],
                                                relu=relu, **p.kwargs)
    for name, t, e in zip(("gx", "gw", "ggamma", "gbeta"), tensors, expected):
        _assert_grad_close(t.grad, e, p.x.dtype.type, name)


@settings(max_examples=5)
@given(problems(dtype=np.float64), st.booleans(), st.booleans())
def test_gradcheck(problem, training, relu):
    p, bn = problem
    rm, rv = bn["running_mean"], bn["running_var"]

    def fn(x, w, gamma, beta):
        # fresh copies: finite differences must not see running stats drift between calls
        return nf.conv_batchnorm_relu(x, w, gamma, beta, running_mean=rm.copy(),
                                      running_var=rv.copy(), training=training, relu=relu,
                                      **p.kwargs)

    inputs = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, bn["gamma"], bn["beta"])]
    assert nf.gradcheck(fn, inputs, **GRADCHECK)


@given(problems(dtype=np.float64), st.booleans())
def test_equals_unfused_chain_on_the_tape(problem, relu):
    """conv2d -> batchnorm [-> relu] on the tape: same values, gradients and running stats."""
    p, bn = problem

    def run(fused):
        rm, rv = bn["running_mean"].copy(), bn["running_var"].copy()
        ts = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, bn["gamma"], bn["beta"])]
        kw = dict(running_mean=rm, running_var=rv)
        if fused:
            y = nf.conv_batchnorm_relu(*ts, relu=relu, **kw, **p.kwargs)
        else:
            h = nf.conv2d(ts[0], ts[1], **p.kwargs)
            y = nf.batchnorm(h, ts[2], ts[3], layout=p.layout, **kw)
            y = nf.relu(y) if relu else y
        y.backward(np.random.default_rng(0).standard_normal(y.shape))   # the same gy twice
        return [y.numpy(), rm, rv] + [t.grad for t in ts]

    for a, b in zip(run(True), run(False)):
        np.testing.assert_allclose(a, b, **TOL[np.float64])


# --------------------------------------------------------------------------- memory

@pytest.mark.parametrize("relu", [True, False])
def test_saved_bytes_only_inputs_and_statistics(rng, relu):
    x = rng.standard_normal((4, 8, 10, 10)).astype(np.float32)
    w = (rng.standard_normal((16, 8, 3, 3)) * 0.1).astype(np.float32)
    gamma, beta = np.ones(16, np.float32), np.zeros(16, np.float32)
    ts = [nf.Tensor(a, requires_grad=True) for a in (x, w, gamma, beta)]
    y = nf.conv_batchnorm_relu(*ts, padding=1, relu=relu)
    saved = y._fn.saved
    assert set(vars(saved)) == ({"x", "w", "gamma", "mean", "invstd"} | ({"beta"} if relu
                                                                        else set()))
    assert saved.x is x and saved.w is w                   # the inputs themselves, not copies
    stats_bytes = saved.mean.nbytes + saved.invstd.nbytes  # float64 (K,) each
    expected = x.nbytes + w.nbytes + gamma.nbytes + stats_bytes + (beta.nbytes if relu else 0)
    assert nf.saved_bytes(y) == expected
    # the unfused chain keeps the conv output and the batch-norm output as well
    h = nf.conv2d(ts[0], ts[1], padding=1)
    unfused = nf.batchnorm(h, ts[2], ts[3])
    unfused = nf.relu(unfused) if relu else unfused
    assert nf.saved_bytes(y) < 0.7 * nf.saved_bytes(unfused)


def test_only_needed_gradients(rng):
    x = rng.standard_normal((2, 3, 5, 5))
    w = rng.standard_normal((4, 3, 3, 3))
    xt = nf.Tensor(x)                                      # no gradient wanted for x
    wt, gt, bt = (nf.Tensor(a, requires_grad=True) for a in (w, np.ones(4), np.zeros(4)))
    y = nf.conv_batchnorm_relu(xt, wt, gt, bt)
    assert y._fn.needs_input_grad == (False, True, True, True)
    gx, gw, gg, gb = y._fn.backward(np.ones(y.shape))
    assert gx is None and gw is not None and gg is not None and gb is not None
    grads = nf.conv_batchnorm_relu_backward(np.ones(y.shape), x, w, np.ones(4), np.zeros(4),
                                            need=(True, False, False, True))
    assert grads[0] is not None and grads[1] is None and grads[2] is None
    assert grads[3] is not None


# --------------------------------------------------------------------------- folding

@given(problems(), st.booleans())
def test_fold_batchnorm_vs_reference(problem, with_bias):
    p, bn = problem
    K = p.w.shape[0]
    b = np.random.default_rng(K).standard_normal(K).astype(p.x.dtype) if with_bias else None
    args = (bn["gamma"], bn["beta"], bn["running_mean"], bn["running_var"])
    wf, bf = nf.fold_batchnorm(p.w, b, *args, eps=EPS)
    wf_ref, bf_ref = ref.fold_batchnorm(p.w, b, *args, eps=EPS)
    np.testing.assert_allclose(wf, wf_ref, **TOL[p.x.dtype.type])
    np.testing.assert_allclose(bf, bf_ref, **TOL[p.x.dtype.type])
    assert wf.dtype == p.w.dtype and bf.dtype == p.w.dtype
    # the folded conv equals inference batch norm of the conv
    h = ref.conv2d(p.x, p.w, **p.kwargs)
    h = h if b is None else ref.bias_add(h, b, p.layout)
    expected = ref.batchnorm_infer(h, *args, eps=EPS, layout=p.layout)
    folded = ref.bias_add(ref.conv2d(p.x, wf, **p.kwargs), bf, p.layout)
    np.testing.assert_allclose(folded, expected, **TOL[p.x.dtype.type])


# --------------------------------------------------------------------------- bad input

def _good(rng, dtype=np.float32):
    x = rng.standard_normal((2, 3, 5, 5)).astype(dtype)
    w = rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    return dict(x=x, w=w, gamma=np.ones(4, dtype), beta=np.zeros(4, dtype),
                running_mean=np.zeros(4, dtype), running_var=np.ones(4, dtype))


BAD = [
    (dict(w=np.ones((4, 5, 3, 3), np.float32)), ValueError, "w has 5 input channels, x has 3"),
    (dict(x=np.ones((2, 3, 5), np.float32)), ValueError, "x must have 4 dimensions"),
    (dict(gamma=np.ones(3, np.float32)), ValueError, "gamma must have shape"),
    (dict(beta=np.ones(5, np.float32)), ValueError, "beta must have shape"),
    (dict(running_mean=np.ones(3, np.float32)), ValueError, "running_mean must have shape"),
    (dict(running_var=None), ValueError, "only running_mean was given"),
    (dict(gamma=np.ones(4, np.float64)), TypeError, "gamma is float64"),
    (dict(x=np.ones((2, 3, 5, 5), np.int32)), TypeError, "x must be float32 or float64"),
    (dict(kw=dict(layout="NWHC")), ValueError, "layout"),
    (dict(kw=dict(stride=0)), ValueError, "stride"),
    (dict(kw=dict(padding="full")), ValueError, "padding"),
    (dict(kw=dict(momentum=1.5)), ValueError, "momentum"),
    (dict(kw=dict(eps=-1.0)), ValueError, "eps"),
    (dict(x=np.ones((1, 3, 3, 3), np.float32)), ValueError, "more than one value per channel"),
    (dict(kw=dict(training=False), running_mean=None, running_var=None), ValueError,
     "inference"),
    (dict(kw=dict(training="no")), TypeError, "training must be True or False"),
    (dict(kw=dict(training=0)), TypeError, "training must be True or False"),
]


@pytest.mark.parametrize("change,error,match", BAD)
def test_bad_input_is_named_and_writes_nothing(rng, change, error, match):
    args = _good(rng)
    change = dict(change)                       # the parameter dict is shared: copy it
    kw = change.pop("kw", {})
    args.update(change)
    rm, rv = args.pop("running_mean"), args.pop("running_var")
    before = [None if a is None else a.copy() for a in (rm, rv)]
    with pytest.raises(error, match="conv_batchnorm_relu: .*" + match):
        nf.conv_batchnorm_relu(args["x"], args["w"], args["gamma"], args["beta"],
                               running_mean=rm, running_var=rv, **kw)
    for a, b in zip((rm, rv), before):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_fold_batchnorm_bad_input(rng):
    a = _good(rng)
    with pytest.raises(ValueError, match="fold_batchnorm: b must have shape"):
        nf.fold_batchnorm(a["w"], np.ones(3, np.float32), a["gamma"], a["beta"],
                          a["running_mean"], a["running_var"])
    with pytest.raises(TypeError, match="fold_batchnorm: .*float64"):
        nf.fold_batchnorm(a["w"], None, a["gamma"].astype(np.float64), a["beta"],
                          a["running_mean"], a["running_var"])


def test_tensor_arguments_are_accepted_everywhere(rng):
    """Tensors where arrays go (running statistics, NumPy-style backward, folding)."""
    a = _good(rng, np.float64)
    T = nf.Tensor
    args = [a[k] for k in ("x", "w", "gamma", "beta")]
    rm, rv = T(a["running_mean"].copy()), T(a["running_var"].copy())
    y = nf.conv_batchnorm_relu(*args, running_mean=rm, running_var=rv)
    rm_ref, rv_ref = a["running_mean"].copy(), a["running_var"].copy()
    np.testing.assert_array_equal(y, nf.conv_batchnorm_relu(*args, running_mean=rm_ref,
                                                            running_var=rv_ref))
    np.testing.assert_array_equal(rm.data, rm_ref)             # updated in place, via .data
    np.testing.assert_array_equal(rv.data, rv_ref)
    stats = dict(running_mean=a["running_mean"], running_var=a["running_var"])
    gy = np.random.default_rng(0).standard_normal(y.shape)
    for training in (True, False):
        expected = nf.conv_batchnorm_relu_backward(gy, *args, training=training, **stats)
        got = nf.conv_batchnorm_relu_backward(
            T(gy), *map(T, args), training=training,
            **{k: T(v) for k, v in stats.items()})
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)
    fold = (a["w"], np.ones(4), a["gamma"], a["beta"], a["running_mean"], a["running_var"])
    for g, e in zip(nf.fold_batchnorm(*map(T, fold)), nf.fold_batchnorm(*fold)):
        np.testing.assert_array_equal(g, e)


def test_backward_refuses_a_non_boolean_training(rng):
    a = _good(rng)
    gy = np.ones((2, 4, 3, 3), np.float32)
    with pytest.raises(TypeError, match="conv_batchnorm_relu_backward: training must be True"):
        nf.conv_batchnorm_relu_backward(gy, a["x"], a["w"], a["gamma"], a["beta"],
                                        running_mean=a["running_mean"],
                                        running_var=a["running_var"], training="no")


@pytest.mark.parametrize("need", [(True,), (True, True, True), (True,) * 5, "all"])
def test_backward_refuses_a_bad_need(rng, need):
    a = _good(rng)
    with pytest.raises(ValueError, match="conv_batchnorm_relu_backward: need must be four"):
        nf.conv_batchnorm_relu_backward(np.ones((2, 4, 3, 3), np.float32), a["x"], a["w"],
                                        a["gamma"], a["beta"], need=need)


def test_backward_bad_gy(rng):
    a = _good(rng)
    with pytest.raises(ValueError, match="conv_batchnorm_relu_backward: dy has shape"):
        nf.conv_batchnorm_relu_backward(np.ones((2, 4, 5, 5), np.float32), a["x"], a["w"],
                                        a["gamma"], a["beta"])


@given(problems(), st.booleans(), st.integers(0, 2**32 - 1))
def test_no_recompute_policy_same_gradients_and_keeps_h_and_mask(problem, relu, seed):
    """recompute=False (speed over memory) keeps h and a 1-bit mask; same values/gradients."""
    p, bn = problem
    out = {}
    for recompute in (True, False):
        ts = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.w, bn["gamma"], bn["beta"])]
        fn = ConvBatchNormReLU(running_mean=None, running_var=None, training=True,
                               momentum=0.1, eps=1e-5, relu=relu, recompute=recompute, comm=None,
                               **p.kwargs)
        y = fn.apply(*ts)
        y.backward(np.random.default_rng(seed).standard_normal(y.shape).astype(p.x.dtype))
        out[recompute] = (y, [t.grad for t in ts], fn)
    np.testing.assert_array_equal(out[True][0].numpy(), out[False][0].numpy())
    for a, b in zip(out[True][1], out[False][1]):
        _assert_grad_close(a, b, p.x.dtype.type, "grad")
    saved = out[False][2].saved
    assert saved.h.shape == out[False][0].shape
    if relu:
        assert saved.relu_state.dtype == np.uint8
        assert saved.relu_state.size == -(-saved.h.size // 8)      # 1 bit per element
    else:
        assert saved.relu_state is None


def test_relu_flag_must_be_a_bool():
    x = np.ones((1, 1, 3, 3))
    w = np.ones((1, 1, 1, 1))
    with pytest.raises(TypeError, match="conv_batchnorm_relu: relu must be True or False"):
        nf.conv_batchnorm_relu(x, w, np.ones(1), np.zeros(1), relu="no")
