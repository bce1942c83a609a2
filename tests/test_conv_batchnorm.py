"""Conv -> BatchNorm (-> ReLU) with recompute, and batch-norm folding: what the harness does
not ask of every op, on every backend (``backend`` injected: CPU, and CUDA in ``-m cuda``).

Forward (training, inference, running statistics), both backwards, gradcheck, the unfused
chain on the tape and reruns are in ``tests/test_ops.py``; bad input in
``tests/test_errors.py``. Here: what is saved for backward (only x, w, gamma, [beta], mean,
invstd), the gradients actually computed, the recompute=False policy, ``fold_batchnorm``.
"""
import numpy as np
import pytest
from hypothesis import strategies as st

import numbafuse as nf
import numbafuse.testing.strategies as nfs
from numbafuse import reference as ref
from numbafuse.ops.conv_batchnorm import ConvBatchNormReLU

from .harness import close, run_property
from .op_cases import CASES

TOL = CASES["conv_batchnorm_relu"].tol
EPS = 1e-5


def _arrays(rng, dtype=np.float32, small=False):
    x = rng.standard_normal((1, 3, 4, 4) if small else (2, 3, 5, 5)).astype(dtype)
    w = rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    return dict(x=x, w=w, gamma=np.ones(4, dtype), beta=np.zeros(4, dtype),
                running_mean=np.zeros(4, dtype), running_var=np.ones(4, dtype))


@pytest.mark.parametrize("relu", [True, False])
def test_saved_bytes_only_inputs_and_statistics(backend, rng, relu):
    N, C, H, K = (1, 2, 5, 4) if backend.small else (2, 4, 6, 8)
    x = backend.put(rng.standard_normal((N, C, H, H)).astype(np.float32))
    w = backend.put((rng.standard_normal((K, C, 3, 3)) * 0.1).astype(np.float32))
    gamma, beta = backend.put(np.ones(K, np.float32)), backend.put(np.zeros(K, np.float32))
    ts = [nf.Tensor(a, requires_grad=True) for a in (x, w, gamma, beta)]
    y = nf.conv_batchnorm_relu(*ts, padding=1, relu=relu)
    saved = y._fn.saved
    assert set(vars(saved)) == ({"x", "w", "gamma", "mean", "invstd"}
                                | ({"beta"} if relu else set()))
    assert saved.x is x and saved.w is w                   # the inputs themselves, not copies
    expected = x.nbytes + w.nbytes + gamma.nbytes + 2 * K * 8 + (beta.nbytes if relu else 0)
    assert nf.saved_bytes(y) == expected                   # + mean, invstd: float64 (K,)
    # the unfused chain keeps the conv output and the batch-norm output as well
    unfused = nf.batchnorm(nf.conv2d(ts[0], ts[1], padding=1), ts[2], ts[3])
    unfused = nf.relu(unfused) if relu else unfused
    assert nf.saved_bytes(y) < 0.7 * nf.saved_bytes(unfused)


def test_only_needed_gradients(backend, rng):
    a = {k: backend.put(v) for k, v in _arrays(rng, np.float64, backend.small).items()}
    xt = nf.Tensor(a["x"])                                 # no gradient wanted for x
    wt, gt, bt = (nf.Tensor(a[k], requires_grad=True) for k in ("w", "gamma", "beta"))
    y = nf.conv_batchnorm_relu(xt, wt, gt, bt)
    assert y._fn.needs_input_grad == (False, True, True, True)
    dx, dw, dgamma, dbeta = y._fn.backward(backend.put(np.ones(y.shape)))
    assert dx is None and all(g is not None for g in (dw, dgamma, dbeta))


def test_no_recompute_policy_same_gradients_and_keeps_h_and_mask(backend):
    """recompute=False (speed over memory) keeps h and a 1-bit mask; same values/gradients
    (on the CPU the same bits: the recompute's affine gate decides as the forward did)."""
    def body(draw):
        p = draw(nfs.conv_batchnorm_problems())
        relu = draw(st.booleans())
        dy = None
        out = {}
        for recompute in (True, False):
            ts = [nf.Tensor(backend.put(a), requires_grad=True)
                  for a in (p.x, p.w, p.gamma, p.beta)]
            fn = ConvBatchNormReLU(running_mean=None, running_var=None, training=True,
                                   momentum=0.1, eps=EPS, relu=relu, recompute=recompute,
                                   comm=None, **p.kwargs)
            y = fn.apply(*ts)
            dy = np.random.default_rng(0).standard_normal(y.shape).astype(p.x.dtype) \
                if dy is None else dy
            y.backward(backend.put(dy))
            out[recompute] = (backend.get(y.data), [backend.get(t.grad) for t in ts], fn)
        np.testing.assert_array_equal(out[True][0], out[False][0])
        for a, b in zip(out[True][1], out[False][1]):
            if backend.name == "cpu":   # both gate by the forward's decision: same bits
                np.testing.assert_array_equal(a, b)
            else:
                close(a, b, p.x.dtype, TOL)
        saved = out[False][2].saved
        assert saved.h.shape == out[False][0].shape
        if relu:
            assert saved.relu_state.dtype == np.uint8
            assert saved.relu_state.size == -(-saved.h.size // 8)   # 1 bit per element
        else:
            assert saved.relu_state is None

    run_property(f"no-recompute:{backend.name}", 2 * backend.cost, body)


def test_fold_batchnorm_vs_reference(backend):
    def body(draw):
        p = draw(nfs.conv_batchnorm_problems())
        K = p.w.shape[0]
        b = np.random.default_rng(K).standard_normal(K).astype(p.x.dtype) \
            if draw(st.booleans()) else None
        args = (p.gamma, p.beta, p.running_mean, p.running_var)
        wf, bf = nf.fold_batchnorm(*map(backend.put, (p.w, b) + args), eps=EPS)
        wf, bf = backend.get(wf), backend.get(bf)
        wf_ref, bf_ref = ref.fold_batchnorm(p.w, b, *args, eps=EPS)
        close(wf, wf_ref, p.x.dtype, TOL)
        close(bf, bf_ref, p.x.dtype, TOL)
        assert wf.dtype == p.w.dtype and bf.dtype == p.w.dtype
        # the folded conv equals inference batch norm of the conv
        h = ref.conv2d(p.x, p.w, **p.kwargs)
        h = h if b is None else ref.bias_add(h, b, p.layout)
        expected = ref.batchnorm_infer(h, *args, eps=EPS, layout=p.layout)
        folded = ref.bias_add(ref.conv2d(p.x, wf, **p.kwargs), bf, p.layout)
        close(folded, expected, p.x.dtype, TOL)

    run_property(f"fold:{backend.name}", backend.cost, body)


def test_fold_batchnorm_bad_input(backend, rng):
    a = {k: backend.put(v) for k, v in _arrays(rng).items()}
    stats = (a["gamma"], a["beta"], a["running_mean"], a["running_var"])
    with pytest.raises(ValueError, match="fold_batchnorm: b must have shape"):
        nf.fold_batchnorm(a["w"], backend.put(np.ones(3, np.float32)), *stats)
    with pytest.raises(TypeError, match="fold_batchnorm: .*float64"):
        nf.fold_batchnorm(a["w"], None, backend.put(np.ones(4)), *stats[1:])
    with pytest.raises(TypeError, match="fold_batchnorm: running_var must be an array, got None"):
        nf.fold_batchnorm(a["w"], None, *stats[:3], None)


def test_tensor_arguments_are_accepted_everywhere(backend, rng):
    """Tensors where arrays go (running statistics, NumPy-style backward, folding)."""
    host = _arrays(rng, np.float64, backend.small)
    a = {k: backend.put(v) for k, v in host.items()}
    T = nf.Tensor
    args = [a[k] for k in ("x", "w", "gamma", "beta")]
    rm, rv = T(backend.put(host["running_mean"])), T(backend.put(host["running_var"]))
    rm_ref, rv_ref = backend.put(host["running_mean"]), backend.put(host["running_var"])
    y = nf.conv_batchnorm_relu(*args, running_mean=rm, running_var=rv)
    y_ref = nf.conv_batchnorm_relu(*args, running_mean=rm_ref, running_var=rv_ref)
    np.testing.assert_array_equal(backend.get(y), backend.get(y_ref))
    np.testing.assert_array_equal(backend.get(rm.data), backend.get(rm_ref))  # via .data
    np.testing.assert_array_equal(backend.get(rv.data), backend.get(rv_ref))
    stats = dict(running_mean=a["running_mean"], running_var=a["running_var"])
    dy = backend.put(np.random.default_rng(0).standard_normal(y.shape))
    for training in (True, False):
        expected = nf.conv_batchnorm_relu_backward(dy, *args, training=training, **stats)
        got = nf.conv_batchnorm_relu_backward(T(dy), *map(T, args), training=training,
                                              **{k: T(v) for k, v in stats.items()})
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(backend.get(g), backend.get(e))
    fold = (a["w"], backend.put(np.ones(4)), a["gamma"], a["beta"], a["running_mean"],
            a["running_var"])
    for g, e in zip(nf.fold_batchnorm(*map(T, fold)), nf.fold_batchnorm(*fold)):
        np.testing.assert_array_equal(backend.get(g), backend.get(e))


@pytest.mark.parametrize("training", [True, False])
def test_an_empty_batch_gives_empty_outputs_and_updates_nothing(backend, training):
    """N = 0, as PyTorch's conv2d -> batch_norm: y and dx empty, dw, dgamma, dbeta zero, the
    running statistics left as they are; on the tape and NumPy style."""
    rng = np.random.default_rng(0)
    x, w = np.zeros((0, 3, 5, 5)), rng.standard_normal((4, 3, 3, 3))
    gamma, beta = rng.uniform(0.5, 1.5, 4), rng.standard_normal(4)
    rm, rv = rng.standard_normal(4), rng.uniform(0.5, 2.0, 4)
    stats = dict(running_mean=backend.put(rm), running_var=backend.put(rv))
    kw = dict(training=training, padding=1, **stats)
    ts = [nf.Tensor(backend.put(a), requires_grad=True) for a in (x, w, gamma, beta)]
    y = nf.conv_batchnorm_relu(*ts, **kw)
    assert backend.get(y.data).shape == (0, 4, 5, 5)
    y.backward(backend.put(np.zeros((0, 4, 5, 5))))
    grads = [t.grad for t in ts]
    grads_np = nf.conv_batchnorm_relu_backward(backend.put(np.zeros((0, 4, 5, 5))),
                                               *map(backend.put, (x, w, gamma, beta)), **kw)
    for dx, dw, dgamma, dbeta in (grads, grads_np):
        assert backend.get(dx).shape == x.shape
        np.testing.assert_array_equal(backend.get(dw), np.zeros(w.shape))
        np.testing.assert_array_equal(backend.get(dgamma), np.zeros(4))
        np.testing.assert_array_equal(backend.get(dbeta), np.zeros(4))
    np.testing.assert_array_equal(backend.get(stats["running_mean"]), rm)
    np.testing.assert_array_equal(backend.get(stats["running_var"]), rv)


def _ungrouped(w, groups):
    """w (K, C/groups, R, S) as the block-diagonal (K, C, R, S) of the same ungrouped conv:
    the grouped reference is the reference's ungrouped conv with these weights."""
    K, Cg = w.shape[:2]
    full, k = np.zeros((K, Cg * groups) + w.shape[2:]), K // groups
    for g in range(groups):
        full[g * k:(g + 1) * k, g * Cg:(g + 1) * Cg] = w[g * k:(g + 1) * k]
    return full


def _grouped(dw_full, groups):
    """The (K, C/groups, R, S) blocks of an ungrouped conv's dw (the grouped conv's dw)."""
    K, C = dw_full.shape[:2]
    k, Cg = K // groups, C // groups
    return np.concatenate([dw_full[g * k:(g + 1) * k, g * Cg:(g + 1) * Cg]
                           for g in range(groups)])


def _grouped_reference(x, w, gamma, beta, running_mean=None, running_var=None, *, groups=1,
                       **kw):
    """(y, running_mean, running_var) of the float64 reference, through block-diagonal w."""
    return ref.conv_batchnorm_relu(x, _ungrouped(w, groups), gamma, beta, running_mean,
                                   running_var, **kw)


def _grouped_reference_backward(dy, x, w, gamma, beta, running_mean=None, running_var=None, *,
                                groups=1, **kw):
    kw.pop("momentum", None)
    dx, dw, dgamma, dbeta = ref.conv_batchnorm_relu_backward(
        dy, x, _ungrouped(w, groups), gamma, beta, running_mean, running_var, **kw)
    return dx, _grouped(np.asarray(dw, np.float64), groups), dgamma, dbeta


def test_grouped_conv_batchnorm_relu_vs_reference(backend):
    """groups (grouped and depthwise convs; drawn by ``conv_batchnorm_problems(groups=True)``):
    y and the running statistics in training and inference, and the tape's four gradients
    (the conv recomputed in backward), against the float64 reference."""
    def body(draw):
        p = draw(nfs.conv_batchnorm_problems(groups=True, max_channels=4))
        relu, training = draw(st.booleans()), draw(st.booleans())
        kw = dict(p.kwargs, relu=relu, eps=EPS)
        rm, rv = p.running_mean.copy(), p.running_var.copy()
        ts = [nf.Tensor(backend.put(a), requires_grad=True) for a in (p.x, p.w, p.gamma, p.beta)]
        rm_d, rv_d = backend.put(rm), backend.put(rv)
        y = nf.conv_batchnorm_relu(*ts, running_mean=rm_d, running_var=rv_d,
                                   training=training, momentum=0.1, **kw)
        y_ref, rm_ref, rv_ref = _grouped_reference(
            p.x, p.w, p.gamma, p.beta, p.running_mean, p.running_var, training=training,
            momentum=0.1, **kw)
        close(backend.get(y.data), y_ref, p.x.dtype, TOL, what="y")
        close(backend.get(rm_d), rm_ref, p.x.dtype, TOL, what="running_mean")
        close(backend.get(rv_d), rv_ref, p.x.dtype, TOL, what="running_var")
        dy = np.random.default_rng(7).standard_normal(y.shape).astype(p.x.dtype)
        y.backward(backend.put(dy))
        want = _grouped_reference_backward(dy, p.x, p.w, p.gamma, p.beta, p.running_mean,
                                           p.running_var, training=training, **kw)
        for t, g, what in zip(ts, want, ("dx", "dw", "dgamma", "dbeta")):
            close(backend.get(t.grad), g, p.x.dtype, TOL, what=what)

    run_property(f"groups:{backend.name}", backend.cost, body)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_depthwise_conv_batchnorm_relu_backward_numpy_style(layout):
    """The NumPy-style backward with groups (a depthwise 3x3, stride 2) equals the reference;
    it is also what the tape computes."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 4, 7, 6) if layout == "NCHW" else (2, 7, 6, 4))
    w, gamma, beta = rng.standard_normal((4, 1, 3, 3)), rng.uniform(0.5, 1.5, 4), \
        rng.standard_normal(4)
    kw = dict(stride=2, padding=1, groups=4, layout=layout, eps=EPS)
    y = nf.conv_batchnorm_relu(x, w, gamma, beta, **kw)
    close(y, _grouped_reference(x, w, gamma, beta, **kw)[0], np.float64, TOL)
    dy = rng.standard_normal(y.shape)
    got = nf.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)
    for g, want in zip(got, _grouped_reference_backward(dy, x, w, gamma, beta, **kw)):
        close(g, want, np.float64, TOL)
    ts = [nf.Tensor(a, requires_grad=True) for a in (x, w, gamma, beta)]
    nf.conv_batchnorm_relu(*ts, **kw).backward(dy)
    for t, g in zip(ts, got):
        close(t.grad, g, np.float64, TOL)
