"""BatchNorm -> Add -> ReLU (fused) and batchnorm (unfused) on the CPU, against the reference.

Three checks per op: forward vs ``numbafuse.reference``, backward vs the reference, and the
tape's gradient vs finite differences (float64); over Hypothesis-drawn shapes, both layouts,
both dtypes, both modes (training/inference) and both save policies. Then the numerics edge
cases (channel means of 1e4 in float32, a constant channel, NaN) and bad input (a named error
and the running statistics untouched).

Run: python -m pytest tests/test_batchnorm.py -q -p no:cacheprovider
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numbafuse as nf
from numbafuse import validate
import numbafuse.testing.strategies as nfs
from numbafuse import reference as ref
from numbafuse.ops import batchnorm as bn

TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-12)}
LARGE_MEAN = 1e4          # channel means of this size, unit variance (float32 accuracy test)
LARGE_MEAN_RTOL = 1e-4    # relative error allowed there, against a float64 reference


def _tol(dtype):
    return TOL[np.dtype(dtype).type]


def _assert_all_close(got, expected, dtype):
    for g, e in zip(got, expected):
        assert g.dtype == np.dtype(dtype)
        np.testing.assert_allclose(g, e, **_tol(dtype))


def _stats(p):
    return dict(running_mean=p.running_mean.copy(), running_var=p.running_var.copy())


# --------------------------------------------------------------------------- fused forward

@given(nfs.batchnorm_problems(), st.booleans(), st.sampled_from(validate.SAVE_POLICIES))
def test_forward_and_running_stats_match_reference(p, training, save):
    stats = _stats(p)
    y_ref, rm_ref, rv_ref = ref.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta,
                                                   p.running_mean, p.running_var,
                                                   training=training, layout=p.layout)
    y = nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, training=training, layout=p.layout,
                              save=save, **stats)
    _assert_all_close([y, stats["running_mean"], stats["running_var"]], [y_ref, rm_ref, rv_ref],
                      p.x.dtype)


@given(nfs.batchnorm_problems(), st.floats(0.0, 1.0))
def test_momentum_rule(p, momentum):
    stats = _stats(p)
    _, rm_ref, rv_ref = ref.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, p.running_mean,
                                               p.running_var, momentum=momentum,
                                               layout=p.layout)
    nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, momentum=momentum, layout=p.layout,
                          **stats)
    _assert_all_close([stats["running_mean"], stats["running_var"]], [rm_ref, rv_ref],
                      p.x.dtype)


# --------------------------------------------------------------------------- fused backward

@given(nfs.batchnorm_problems(), st.booleans(), st.sampled_from(["y", "mask", "recompute"]))
def test_backward_function_matches_reference(p, training, state):
    gy = np.random.default_rng(0).standard_normal(p.x.shape).astype(p.x.dtype)
    stats = _stats(p)
    expected = ref.batchnorm_add_relu_backward(gy, p.x, p.z, p.gamma, p.beta, p.running_mean,
                                               p.running_var, training=training,
                                               layout=p.layout)
    kw = {}
    if state != "recompute":
        mean, invstd = (bn.bn_stats(p.x, layout=p.layout)[::2] if training else
                        bn.bn_inference_stats(p.running_mean, p.running_var))
        y, mask = bn.bn_apply(p.x, mean, invstd, p.gamma, p.beta, z=p.z, layout=p.layout,
                              with_mask=True)
        kw = dict(y=y) if state == "y" else dict(mask=mask)
    got = nf.batchnorm_add_relu_backward(gy, p.x, p.z, p.gamma, p.beta, stats["running_mean"],
                                         stats["running_var"], training, layout=p.layout, **kw)
    _assert_all_close(got, expected, p.x.dtype)
    np.testing.assert_array_equal(stats["running_mean"], p.running_mean)  # never updated


@given(nfs.batchnorm_problems(), st.booleans(), st.sampled_from(validate.SAVE_POLICIES))
def test_tape_backward_matches_reference(p, training, save):
    gy = np.random.default_rng(1).standard_normal(p.x.shape).astype(p.x.dtype)
    expected = ref.batchnorm_add_relu_backward(gy, p.x, p.z, p.gamma, p.beta, p.running_mean,
                                               p.running_var, training=training,
                                               layout=p.layout)
    leaves = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.z, p.gamma, p.beta)]
    y = nf.batchnorm_add_relu(*leaves, training=training, layout=p.layout, save=save,
                              **_stats(p))
    y.backward(gy)
    x, z, gamma, beta = leaves
    _assert_all_close([x.grad, z.grad, gamma.grad, beta.grad], expected, p.x.dtype)


def test_only_needed_gradients_are_computed():
    p = _fixed_problem()
    x, gamma = nf.Tensor(p.x, requires_grad=True), nf.Tensor(p.gamma, requires_grad=True)
    y = nf.batchnorm_add_relu(x, p.z, gamma, p.beta)   # z, beta plain arrays: no gradient
    fn = y._fn
    y.backward(np.ones(p.x.shape))
    assert fn.needs_input_grad == (True, False, True, False)
    gx, gz, ggamma, gbeta = fn.backward(np.ones(p.x.shape))
    assert gz is None and gbeta is None and gx is not None and ggamma is not None


@settings(max_examples=4)
@given(nfs.batchnorm_problems(dtype=np.float64, max_channels=3, max_size=3),
       st.booleans(), st.sampled_from(validate.SAVE_POLICIES))
def test_gradcheck_fused(p, training, save):
    leaves = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.z, p.gamma, p.beta)]
    assert nf.gradcheck(
        lambda x, z, g, b: nf.batchnorm_add_relu(x, z, g, b, training=training,
                                                 layout=p.layout, save=save,
                                                 running_mean=p.running_mean.copy(),
                                                 running_var=p.running_var.copy()),
        leaves)


# --------------------------------------------------------------------------- unfused batchnorm

@given(nfs.batchnorm_problems(), st.booleans())
def test_unfused_batchnorm_matches_reference(p, training):
    gy = np.random.default_rng(2).standard_normal(p.x.shape).astype(p.x.dtype)
    if training:
        y_ref = ref.batchnorm_train(p.x, p.gamma, p.beta, layout=p.layout)[0]
        g_ref = ref.batchnorm_backward(gy, p.x, p.gamma, layout=p.layout)
    else:
        y_ref = ref.batchnorm_infer(p.x, p.gamma, p.beta, p.running_mean, p.running_var,
                                    layout=p.layout)
        g_ref = ref.batchnorm_infer_backward(gy, p.x, p.gamma, p.running_var, layout=p.layout,
                                             running_mean=p.running_mean)
    leaves = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.gamma, p.beta)]
    y = nf.batchnorm(*leaves, training=training, layout=p.layout, **_stats(p))
    assert y._fn.name == "batchnorm"
    y.backward(gy)
    _assert_all_close([y.data] + [t.grad for t in leaves], [y_ref, *g_ref], p.x.dtype)


@settings(max_examples=3)
@given(nfs.batchnorm_problems(dtype=np.float64, max_channels=3, max_size=3), st.booleans())
def test_gradcheck_unfused(p, training):
    leaves = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.gamma, p.beta)]
    assert nf.gradcheck(lambda x, g, b: nf.batchnorm(
        x, g, b, training=training, layout=p.layout, running_mean=p.running_mean.copy(),
        running_var=p.running_var.copy()), leaves)


@settings(max_examples=5)
@given(nfs.batchnorm_problems(dtype=np.float64), st.booleans())
def test_fused_equals_unfused_chain(p, training):
    gy = np.random.default_rng(3).standard_normal(p.x.shape)
    results = []
    for chain in ("fused", "unfused"):
        stats = _stats(p)
        leaves = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.z, p.gamma, p.beta)]
        x, z, gamma, beta = leaves
        if chain == "fused":
            y = nf.batchnorm_add_relu(x, z, gamma, beta, training=training, layout=p.layout,
                                      **stats)
        else:
            y = nf.relu(nf.add(nf.batchnorm(x, gamma, beta, training=training,
                                            layout=p.layout, **stats), z))
        y.backward(gy)
        results.append([y.data, stats["running_mean"], stats["running_var"]]
                       + [t.grad for t in leaves])
    _assert_all_close(results[0], results[1], np.float64)


# --------------------------------------------------------------------------- saved memory

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_policy_saves_y_minus_mask_bytes(dtype):
    shape = (2, 3, 5, 7)                                       # 210 elements: 27 mask bytes
    rng = np.random.default_rng(4)
    x, z = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    gamma, beta = np.ones(3, dtype), np.zeros(3, dtype)
    held = {}
    for save in validate.SAVE_POLICIES:
        y = nf.batchnorm_add_relu(nf.Tensor(x, requires_grad=True), z, gamma, beta, save=save)
        held[save] = nf.saved_bytes(y)
    size = int(np.prod(shape))
    y_bytes, mask_bytes = size * np.dtype(dtype).itemsize, bn.mask_nbytes(size)
    assert mask_bytes == -(-size // 8)
    assert held["output"] - held["mask"] == y_bytes - mask_bytes
    # x, mean and invstd (float64, C each), gamma, and the ReLU state
    assert held["mask"] == size * np.dtype(dtype).itemsize + 2 * 3 * 8 \
        + 3 * np.dtype(dtype).itemsize + mask_bytes


# --------------------------------------------------------------------------- numerics

@settings(max_examples=5)
@given(nfs.batchnorm_problems(dtype=np.float32, mean_scale=LARGE_MEAN), st.booleans())
def test_float32_large_channel_means(p, training):
    """float32 with |mean| ~ 1e4, unit variance: relative error <= 1e-4 vs float64."""
    f64 = [a.astype(np.float64) for a in (p.x, p.z, p.gamma, p.beta)]
    # running stats near the batch's (large) means, as float32 values
    rm32 = ref.batchnorm_train(f64[0], f64[2], f64[3], layout=p.layout)[1].astype(np.float32)
    rm, rv = rm32.astype(np.float64), p.running_var.astype(np.float64)
    y_ref = ref.batchnorm_add_relu(*f64, rm, rv, training=training, layout=p.layout)[0]
    y = nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, running_mean=rm.astype(np.float32),
                              running_var=rv.astype(np.float32), training=training,
                              layout=p.layout)
    scale = np.abs(y_ref).max()
    assert np.abs(y - y_ref).max() <= LARGE_MEAN_RTOL * scale
    gy = np.random.default_rng(5).standard_normal(p.x.shape)
    g_ref = ref.batchnorm_add_relu_backward(gy, *f64, rm, rv, training=training,
                                            layout=p.layout)
    got = nf.batchnorm_add_relu_backward(gy.astype(np.float32), p.x, p.z, p.gamma, p.beta,
                                         rm.astype(np.float32), rv.astype(np.float32),
                                         training, layout=p.layout)
    for g, e in zip(got, g_ref):
        assert np.abs(g - e).max() <= LARGE_MEAN_RTOL * max(np.abs(e).max(), 1.0)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_constant_channel_is_finite(layout):
    p = _fixed_problem(layout)
    x = p.x.copy()
    if layout == "NCHW":
        x[:, 1] = 3.0
    else:
        x[..., 1] = 3.0
    leaves = [nf.Tensor(a, requires_grad=True) for a in (x, p.z, p.gamma, p.beta)]
    y = nf.batchnorm_add_relu(*leaves, layout=layout)
    y.backward(np.ones(x.shape))
    assert np.isfinite(y.data).all()
    assert all(np.isfinite(t.grad).all() for t in leaves)
    y_ref = ref.batchnorm_add_relu(x, p.z, p.gamma, p.beta, layout=layout)[0]
    np.testing.assert_allclose(y.data, y_ref, **TOL[np.float64])


def test_nan_in_x_propagates_through_the_relu():
    p = _fixed_problem()
    x = p.x.copy()
    x[0, 0, 0, 0] = np.nan
    y = nf.batchnorm_add_relu(x, p.z, p.gamma, p.beta)
    assert np.isnan(y[:, 0]).all()               # channel 0's statistics are NaN
    assert np.isfinite(y[:, 1:]).all()


@pytest.mark.parametrize("layout,shape", [("NCHW", (2, 3, 4, 4)), ("NCHW", (3, 2, 3, 5)),
                                          ("NHWC", (2, 3, 3, 8)), ("NHWC", (2, 3, 5, 3))])
def test_mask_and_output_states_give_the_same_gradients(layout, shape):
    """Rows on and off mask-byte boundaries (HW or C a multiple of 8, or not)."""
    p = _fixed_problem(layout, shape=shape)
    gy = np.random.default_rng(8).standard_normal(shape)
    grads = {}
    for save in validate.SAVE_POLICIES:
        leaves = [nf.Tensor(a, requires_grad=True) for a in (p.x, p.z, p.gamma, p.beta)]
        nf.batchnorm_add_relu(*leaves, layout=layout, save=save).backward(gy)
        grads[save] = [t.grad for t in leaves]
    for a, b in zip(grads["output"], grads["mask"]):
        np.testing.assert_array_equal(a, b)
    y, mask = bn.bn_apply(p.x, *bn.bn_stats(p.x, layout=layout)[::2], p.gamma, p.beta, z=p.z,
                          layout=layout, with_mask=True)
    np.testing.assert_array_equal(mask, np.packbits(y.reshape(-1) > 0, bitorder="little"))


def test_result_does_not_depend_on_thread_count():
    import numba
    p = _fixed_problem("NHWC", shape=(4, 16, 16, 8))
    gy = np.random.default_rng(6).standard_normal(p.x.shape)
    runs = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        runs.append([nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, layout="NHWC"),
                     *nf.batchnorm_add_relu_backward(gy, p.x, p.z, p.gamma, p.beta,
                                                     layout="NHWC")])
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- bad input

def _fixed_problem(layout="NCHW", shape=(2, 3, 4, 5), dtype=np.float64):
    rng = np.random.default_rng(7)
    C = shape[1] if layout == "NCHW" else shape[3]
    return nfs.BatchNormProblem(
        x=rng.standard_normal(shape).astype(dtype), z=rng.standard_normal(shape).astype(dtype),
        gamma=rng.uniform(0.5, 1.5, C).astype(dtype), beta=rng.standard_normal(C).astype(dtype),
        running_mean=rng.standard_normal(C).astype(dtype),
        running_var=rng.uniform(0.5, 2.0, C).astype(dtype), layout=layout)


def _bad_calls(p):
    """(exception, message pattern, kwargs overriding a good call) for each kind of bad input."""
    C = p.gamma.shape[0]
    return [
        (ValueError, "z has shape", dict(z=p.z[:, :, :-1])),
        (ValueError, r"gamma must have shape \(3,\)", dict(gamma=np.ones(C + 1))),
        (ValueError, r"beta must have shape \(3,\)", dict(beta=np.ones(C - 1))),
        (ValueError, r"running_mean must have shape \(3,\)", dict(running_mean=np.zeros(4))),
        (ValueError, r"running_var must have shape \(3,\)", dict(running_var=np.ones(2))),
        (TypeError, "x must be float32 or float64", dict(x=p.x.astype(np.int32))),
        (TypeError, "z is float32 but x is float64", dict(z=p.z.astype(np.float32))),
        (ValueError, "eps must lie in", dict(eps=-1e-5)),
        (ValueError, "momentum must lie in", dict(momentum=1.5)),
        (ValueError, "momentum must lie in", dict(momentum=-0.1)),
        (ValueError, "layout must be", dict(layout="NCWH")),
        (ValueError, "save must be 'output' or 'mask'", dict(save="bits")),
        (ValueError, "only running_mean was given", dict(running_var=None)),
        (ValueError, "x must have 4 dimensions", dict(x=p.x[0], z=p.z[0])),
        (ValueError, "more than one value per channel", dict(x=p.x[:1, :, :1, :1],
                                                             z=p.z[:1, :, :1, :1])),
        (TypeError, "cannot mix host and device|must be a NumPy array", dict(gamma=[1.0] * C)),
        (TypeError, "running_mean is float32 but x is float64",
         dict(running_mean=p.running_mean.astype(np.float32))),
        (TypeError, "training must be True or False", dict(training="yes")),
    ]


N_BAD_CASES = 18


@pytest.mark.parametrize("case", range(N_BAD_CASES))
def test_bad_input_is_named_and_running_stats_untouched(case):
    p = _fixed_problem()
    exc, pattern, override = _bad_calls(p)[case]
    kw = dict(x=p.x, z=p.z, gamma=p.gamma, beta=p.beta, **_stats(p))
    rm, rv = kw["running_mean"], kw["running_var"]
    kw.update(override)
    with pytest.raises(exc, match="batchnorm_add_relu: .*(" + pattern + ")"):
        nf.batchnorm_add_relu(kw.pop("x"), kw.pop("z"), kw.pop("gamma"), kw.pop("beta"), **kw)
    np.testing.assert_array_equal(rm, p.running_mean)
    np.testing.assert_array_equal(rv, p.running_var)


def test_every_bad_case_is_run():
    assert len(_bad_calls(_fixed_problem())) == N_BAD_CASES


def test_inference_needs_running_stats():
    p = _fixed_problem()
    with pytest.raises(ValueError, match="batchnorm_add_relu: inference"):
        nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, training=False)
    with pytest.raises(ValueError, match="batchnorm: inference"):
        nf.batchnorm(p.x, p.gamma, p.beta, training=False)


def test_unfused_batchnorm_bad_input_leaves_running_stats():
    p = _fixed_problem()
    stats = _stats(p)
    with pytest.raises(ValueError, match="batchnorm: gamma must have shape"):
        nf.batchnorm(p.x, np.ones(5), p.beta, **stats)
    np.testing.assert_array_equal(stats["running_mean"], p.running_mean)


def test_one_value_per_channel_is_fine_in_inference():
    p = _fixed_problem(shape=(1, 3, 1, 1))
    y = nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, training=False, **_stats(p))
    y_ref = ref.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, p.running_mean, p.running_var,
                                   training=False)[0]
    np.testing.assert_allclose(y, y_ref, **TOL[np.float64])


def test_tensor_arguments_are_accepted_everywhere():
    """Tensors where arrays go (NumPy-style backward, running statistics): their data is used."""
    p = _fixed_problem()
    T = nf.Tensor
    gy = np.random.default_rng(1).standard_normal(p.x.shape)
    for training in (True, False):
        expected = nf.batchnorm_add_relu_backward(gy, p.x, p.z, p.gamma, p.beta, p.running_mean,
                                                  p.running_var, training)
        got = nf.batchnorm_add_relu_backward(T(gy), T(p.x), T(p.z), T(p.gamma), T(p.beta),
                                             T(p.running_mean), T(p.running_var), training)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)
    y = nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta)
    got = nf.batchnorm_add_relu_backward(T(gy), T(p.x), None, T(p.gamma), None, y=T(y))
    expected = nf.batchnorm_add_relu_backward(gy, p.x, None, p.gamma, None, y=y)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    rm, rv = T(p.running_mean.copy()), T(p.running_var.copy())
    nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, running_mean=rm, running_var=rv)
    nf.batchnorm(p.x, p.gamma, p.beta, running_mean=rm, running_var=rv)
    assert not np.array_equal(rm.data, p.running_mean)        # updated in place, through .data
