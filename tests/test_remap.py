"""The remapper: tracing, each rewrite (values, tape gradients, running stats), each refusal
with its reason, random chains of unfused ops, NUMBAFUSE_LOG=remap, compile.

Refusals are checked on tiny stand-in Functions (named like the real ops, computing with the
reference) where the real ops would refuse the input themselves (a dtype mismatch cannot be
traced through real ops); everything that runs a remapped graph uses the real ops.
"""
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numbafuse as nf
from numbafuse import reference as ref
from numbafuse.autograd import Function, Tensor
from numbafuse.ops import arith


TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-9, atol=1e-11)}
DT = np.float64   # one dtype for the real-op tests: every dtype/layout is a new compilation
EPS = 1e-5


# --------------------------------------------------------------------------- stand-in ops

class FakeConv(Function):
    name = "conv2d"
    Params = nf.ops.conv.Conv2d.Params

    def forward(self, x, w):                 # y in x's dtype, as the real op's
        return ref.conv2d(x, w, *self.params.astuple()).astype(x.dtype)


class FakeBiasAdd(Function):
    name = "bias_add"
    Params = nf.ops.conv.BiasAdd.Params

    def forward(self, x, b):
        return ref.bias_add(x, b, self.params.layout)


class FakeReLU(Function):
    name = "relu"

    def forward(self, x):
        return ref.relu(x).astype(x.dtype)


class FakeBatchNorm(Function):
    name = "batchnorm"
    Params = nf.ops.batchnorm.BatchNorm.Params

    def forward(self, x, gamma, beta):       # y in x's dtype, as the real op's
        p = self.params
        if p.training:
            return ref.batchnorm_train(x, gamma, beta, p.eps, p.layout)[0].astype(x.dtype)
        return ref.batchnorm_infer(x, gamma, beta, p.running_mean, p.running_var, p.eps,
                                   p.layout).astype(x.dtype)


def fconv(x, w, layout="NCHW"):
    return FakeConv(stride=1, padding=1, dilation=1, layout=layout, groups=1).apply(x, w)


def fbias(x, b, layout="NCHW"):
    return FakeBiasAdd(layout=layout).apply(x, b)


def frelu(x):
    return FakeReLU().apply(x)


def fbn(x, C, training=True, layout="NCHW", dtype=np.float64, stats_dtype=None):
    """A stand-in batch norm: gamma, beta of ``dtype``, running stats of ``stats_dtype``
    (``dtype`` if None)."""
    stats_dtype = stats_dtype or dtype
    return FakeBatchNorm(running_mean=np.zeros(C, stats_dtype),
                         running_var=np.ones(C, stats_dtype), training=training,
                         momentum=0.1, eps=EPS, layout=layout,
                         comm=None).apply(x, np.ones(C, dtype), np.zeros(C, dtype))


X = np.random.default_rng(0).standard_normal((1, 2, 4, 4))
W = np.random.default_rng(1).standard_normal((3, 2, 3, 3))
B = np.random.default_rng(2).standard_normal(3)


def _remap(fn, *inputs):
    return nf.remap(nf.trace(fn, *inputs))


def _only_line(graph, start):
    lines = [line for line in graph.log if line.startswith(start)]
    assert len(lines) == 1, graph.log
    return lines[0]


# --------------------------------------------------------------------------- tracing

def test_trace_records_inputs_constants_ops_and_outputs():
    c = np.arange(3.0)

    def f(x, z):
        y = nf.add(x, c)
        return arith.mul(y, z), y

    g = nf.trace(f, np.ones(3), np.full(3, 2.0))
    assert g.ops == ["add", "mul"]
    assert [v.kind for v in g.inputs] == ["input", "input"]
    assert g.nodes[0].args["z"].kind == "const" and g.nodes[0].args["z"].obj is c
    assert g.outputs == [g.nodes[1].output, g.nodes[0].output] and not g.single_output
    out, y = g(np.zeros(3), np.ones(3))
    np.testing.assert_array_equal(out, c)
    np.testing.assert_array_equal(y, c)
    assert "%mul_1 = mul(%add_0, %in1)" in g.summary() and "ops=[add, mul]" in repr(g)


def test_constants_are_captured_by_reference():
    c = np.zeros(2)
    g = nf.trace(lambda x: nf.add(x, c), np.ones(2))
    c[:] = 5.0
    np.testing.assert_array_equal(g(np.ones(2)), [6.0, 6.0])


def test_graph_runs_tensors_on_the_tape():
    c = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    g = nf.trace(lambda x: arith.mul(x, c).sum(), np.ones(2))     # traced with arrays
    x = Tensor(np.array([3.0, 4.0]), requires_grad=True)
    g(x).backward()
    np.testing.assert_array_equal(x.grad, [1.0, 2.0])
    np.testing.assert_array_equal(c.grad, [3.0, 4.0])


def test_graph_refuses_unlike_inputs():
    g = nf.trace(lambda x: nf.add(x, x), np.ones(2))
    with pytest.raises(ValueError, match="input 0"):
        g(np.ones(2, np.float32))
    with pytest.raises(TypeError, match="takes 1 inputs"):
        g(np.ones(2), np.ones(2))


def test_trace_refuses_bad_functions_and_inputs():
    with pytest.raises(ValueError, match="trace: fn returned None"):
        nf.trace(lambda x: None, np.ones(2))
    x = np.ones(2)
    with pytest.raises(ValueError, match="trace: example inputs 0 and 1 are the same object"):
        nf.trace(nf.add, x, x)
    g = nf.trace(lambda x, k: arith.mul(x, k), np.ones(2), 3.0)     # plain values: baked in
    np.testing.assert_array_equal(g(np.ones(2), 3.0), [3.0, 3.0])
    with pytest.raises(ValueError, match="input 1 was traced as 3.0, got 4.0"):
        g(np.ones(2), 4.0)


def test_nested_ops_are_not_recorded():
    class Outer(Function):
        name = "outer"

        def forward(self, x):
            return nf.add(x, x)                     # an op inside an op: part of it

    g = nf.trace(lambda x: Outer().apply(x), np.ones(2))
    assert g.ops == ["outer"]


def test_remap_leaves_the_input_graph_untouched():
    g = nf.trace(lambda x: frelu(fbias(fconv(x, W), B)), X)
    before = (list(g.nodes), [n.name for n in g.nodes])
    r = nf.remap(g)
    assert r.ops == ["conv_bias_relu"] and g.ops == ["conv2d", "bias_add", "relu"]
    assert (g.nodes, [n.name for n in g.nodes]) == before and g.log == []
    assert r.log == ["Fuse Conv2D with BiasAdd and Relu: conv2d_0, bias_add_1, relu_2 -> "
                     "conv_bias_relu_0"]


# --------------------------------------------------------------------------- refusals

def test_refused_two_consumers():
    def f(x):
        h = fbias(fconv(x, W), B)
        return nf.add(frelu(h), h)

    g = _remap(f, X)
    assert "refused conv2d->bias_add->relu: bias_add output has 2 consumers" in g.log[0]
    # the bias still fuses into the conv, without the ReLU
    assert g.log[1] == "Fuse Conv2D with BiasAdd: conv2d_0, bias_add_1 -> conv_bias_0"
    assert g.ops == ["conv_bias", "relu", "add"]


def test_refused_intermediate_is_graph_output():
    g = _remap(lambda x: (frelu(fbias(fconv(x, W), B)), fconv(x, W)), X)   # fine: separate
    assert g.ops == ["conv_bias_relu", "conv2d"]

    def f(x):
        h = fconv(x, W)
        return frelu(fbias(h, B)), h

    g = _remap(f, X)
    _only_line(g, "refused conv2d->bias_add->relu: conv2d output is a graph output")
    assert "conv_bias_relu" not in g.ops


def test_refused_dtype_mismatch():
    g = _remap(lambda x: frelu(fbias(fconv(x, W.astype(np.float32)), B)),
               X.astype(np.float32))
    _only_line(g, "refused conv2d->bias_add->relu: dtype mismatch: conv2d output float32, "
                  "b float64, relu output float64")


@pytest.mark.parametrize("training", [True, False])
def test_refused_batchnorm_parameter_dtypes_as_the_fused_op_refuses_them(training):
    """The batch-norm parameters and running statistics go through conv_batchnorm_relu's own
    dtype check (validate.check_param_dtypes): float64 ones after a float32 conv, or float32
    parameters with float16 running statistics after a float16 conv, are refused with its
    message; float32 ones after a float16 conv (autocast's mix) fuse."""
    x32, w32 = X.astype(np.float32), W.astype(np.float32)
    g = _remap(lambda x: frelu(fbn(fconv(x, w32), 3, training=training)), x32)
    _only_line(g, "refused conv2d->batchnorm->relu: conv_batchnorm_relu: gamma is float64 but "
                  "x is float32; batch-norm parameters and running statistics must be float32 "
                  "for a float32 x")
    assert g.ops == ["conv2d", "batchnorm", "relu"]
    x16, w16 = X.astype(np.float16), W.astype(np.float16)
    g = _remap(lambda x: frelu(fbn(fconv(x, w16), 3, training=training, dtype=np.float32,
                                   stats_dtype=np.float16)), x16)
    _only_line(g, "refused conv2d->batchnorm->relu: conv_batchnorm_relu: running_mean is "
                  "float16 but gamma is float32; batch-norm parameters and running "
                  "statistics must share one dtype")
    g = _remap(lambda x: frelu(fbn(fconv(x, w16), 3, training=training, dtype=np.float32)),
               x16)
    assert g.ops == ["conv_batchnorm_relu"], g.log
    # inference: not folded (fold_batchnorm takes float32 or float64 only), recomputed
    assert training or "not folded: fold_batchnorm: w must be float32 or float64, got " \
                       "float16" in g.log[0]


def test_refused_layout_mismatch():
    b4 = np.zeros(4)   # bias_add NHWC reads the last axis (Q = 4) as channels
    g = _remap(lambda x: frelu(fbias(fconv(x, W), b4, layout="NHWC")), X)
    _only_line(g, "refused conv2d->bias_add->relu: layout mismatch: conv2d NCHW, "
                  "bias_add NHWC")


def test_refused_bias_length():
    g = _remap(lambda x: frelu(fbias(fconv(x, W[:, :, :1, :1].copy()), np.zeros(1))), X)
    _only_line(g, "refused conv2d->bias_add->relu: b has shape (1,), conv2d has 3 output "
                  "channels")


def test_refused_batchnorm_mode_for_fold_and_recompute():
    # training batch norm after a bias: neither folding (needs inference) nor recompute
    # (conv_batchnorm_relu has no bias, and the bias moves the running mean) is exact
    g = _remap(lambda x: frelu(fbn(fbias(fconv(x, W), B), 3, training=True)), X)
    line = _only_line(g, "refused conv2d->bias_add->batchnorm->relu: batchnorm is in training")
    assert "folding needs training=False" in line and "no bias" in line
    assert g.ops == ["conv_bias", "batchnorm", "relu"]    # the bias still fuses into the conv


def test_refused_fold_of_differentiated_weights_falls_back_to_recompute():
    w = Tensor(W, requires_grad=True)
    g = _remap(lambda x: frelu(fbn(fconv(x, w), 3, training=False)), X)
    line = _only_line(g, "Fuse Conv2D with FusedBatchNorm and Relu (inference, not folded: w "
                         "requires a gradient")
    assert line.endswith("-> conv_batchnorm_relu_0") and g.ops == ["conv_batchnorm_relu"]
    with nf.no_grad():    # traced without the tape: folded
        g = _remap(lambda x: frelu(fbn(fconv(x, w), 3, training=False)), X)
    assert g.ops == ["conv_bias_relu"] and len(g.folds) == 1
    with pytest.raises(ValueError, match="w now require gradients"):
        g(Tensor(X))


def test_refused_add_that_broadcasts():
    z = np.ones((1, 1, 4, 4))
    g = _remap(lambda x: frelu(nf.add(fbn(x, 2), z)), X)
    _only_line(g, "refused batchnorm->add->relu: z has shape (1, 1, 4, 4), batchnorm output "
                  "(1, 2, 4, 4) (add would broadcast)")


def test_log_env_prints_lines(monkeypatch, capsys, caplog):
    monkeypatch.setenv("NUMBAFUSE_LOG", "remap")
    with caplog.at_level(logging.INFO, logger="numbafuse.fusion"):
        g = _remap(lambda x: frelu(fbias(fconv(x, W), B)), X)
    err = capsys.readouterr().err
    assert "numbafuse.remap: Fuse Conv2D with BiasAdd and Relu" in err
    assert g.log[0] in caplog.text
    monkeypatch.delenv("NUMBAFUSE_LOG")
    _remap(lambda x: frelu(fbias(fconv(x, W), B)), X)
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- real ops

def _np(a):
    return a.numpy() if isinstance(a, Tensor) else a


def _tensors(arrays):
    return [Tensor(a.copy(), requires_grad=True) for a in arrays]


def _grads_match(fn, graph, inputs, params, dtype=DT, stats=()):
    """Same outputs, gradients (inputs and captured params) and running stats, unfused vs graph.

    ``params`` are the Tensors fn captures; ``stats`` the running-stat arrays it updates.
    """
    saved = [s.copy() for s in stats]
    results = []
    for run in (fn, graph):
        for s, s0 in zip(stats, saved):
            s[...] = s0
        for p in params:
            p.zero_grad()
        xs = _tensors(inputs)
        y = run(*xs)
        gy = np.random.default_rng(7).standard_normal(y.shape).astype(dtype)
        y.backward(gy)
        results.append([y.numpy()] + [t.grad for t in xs] + [p.grad for p in params]
                       + [s.copy() for s in stats])
    for a, b in zip(*results):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b, a, **TOL[dtype])


def _conv_params(rng, C, K, k=3, bias=True):
    w = Tensor(rng.standard_normal((K, C, k, k)) / np.sqrt(C * k * k), requires_grad=True)
    b = Tensor(rng.standard_normal(K), requires_grad=True) if bias else None
    return w, b


def _bn_params(rng, C):
    gamma = Tensor(rng.uniform(0.5, 1.5, C), requires_grad=True)
    beta = Tensor(rng.standard_normal(C), requires_grad=True)
    return gamma, beta, rng.standard_normal(C), rng.uniform(0.5, 2.0, C)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv_bias_relu_fires(layout):
    rng = np.random.default_rng(3)
    w, b = _conv_params(rng, 2, 3)
    x = rng.standard_normal((2, 2, 5, 4) if layout == "NCHW" else (2, 5, 4, 2))
    kw = dict(stride=(1, 2), padding="same", dilation=1, layout=layout)

    def f(x):
        return nf.relu(nf.bias_add(nf.conv2d(x, w, **kw), b, layout=layout))

    g = _remap(f, x)
    assert g.ops == ["conv_bias_relu"]
    _only_line(g, "Fuse Conv2D with BiasAdd and Relu: conv2d_0, bias_add_1, relu_2")
    np.testing.assert_allclose(_np(g(x)), _np(f(x)), **TOL[DT])
    _grads_match(f, g, [x], [w, b])


def test_conv_relu_fires():
    rng = np.random.default_rng(4)
    w, _ = _conv_params(rng, 2, 3, bias=False)
    x = rng.standard_normal((1, 2, 4, 4))

    def f(x):
        return nf.relu(nf.conv2d(x, w, padding=1))

    g = _remap(f, x)
    assert g.ops == ["conv_bias_relu"]
    _grads_match(f, g, [x], [w])


@pytest.mark.parametrize("order", ["bn_first", "z_first"])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_add_relu_fires(order, training):
    rng = np.random.default_rng(5)
    gamma, beta, r_mean, r_var = _bn_params(rng, 3)
    x, z = rng.standard_normal((2, 3, 3, 3)), rng.standard_normal((2, 3, 3, 3))

    def f(x, z):
        h = nf.batchnorm(x, gamma, beta, running_mean=r_mean, running_var=r_var,
                         training=training, momentum=0.2, eps=EPS)
        return nf.relu(nf.add(h, z) if order == "bn_first" else nf.add(z, h))

    g = _remap(f, x, z)
    assert g.ops == ["batchnorm_add_relu"]
    _only_line(g, "Fuse FusedBatchNorm with Add and Relu: batchnorm_0, add_1, relu_2")
    _grads_match(f, g, [x, z], [gamma, beta], stats=[r_mean, r_var])


@pytest.mark.parametrize("relu", [True, False])
def test_conv_batchnorm_training_fires(relu):
    rng = np.random.default_rng(6)
    w, _ = _conv_params(rng, 2, 3, bias=False)
    gamma, beta, r_mean, r_var = _bn_params(rng, 3)
    x = rng.standard_normal((2, 2, 4, 4))

    def f(x):
        h = nf.batchnorm(nf.conv2d(x, w, padding=1), gamma, beta, running_mean=r_mean,
                         running_var=r_var, eps=EPS)
        return nf.relu(h) if relu else h

    g = _remap(f, x)
    assert g.ops == ["conv_batchnorm_relu"] and g.nodes[0].params["relu"] is relu
    _only_line(g, "Fuse Conv2D with FusedBatchNorm" + (" and Relu" if relu else "") + ":")
    _grads_match(f, g, [x], [w, gamma, beta], stats=[r_mean, r_var])


@pytest.mark.parametrize("bias,relu", [(True, True), (False, True), (True, False)])
def test_inference_batchnorm_is_folded(bias, relu):
    rng = np.random.default_rng(7)
    w, b = _conv_params(rng, 2, 3, bias=bias)
    gamma, beta, r_mean, r_var = _bn_params(rng, 3)
    x = rng.standard_normal((2, 2, 4, 4))

    def f(x):
        h = nf.conv2d(x, w, padding=1)
        h = nf.bias_add(h, b) if bias else h
        h = nf.batchnorm(h, gamma, beta, running_mean=r_mean, running_var=r_var,
                         training=False, eps=EPS)
        return nf.relu(h) if relu else h

    with nf.no_grad():
        g = _remap(f, x)
        assert g.ops == (["conv_bias_relu"] if relu else ["conv_bias"])
        _only_line(g, "Fold FusedBatchNorm into Conv2D:")
        np.testing.assert_allclose(_np(g(x)), _np(f(x)), **TOL[DT])
        r_var *= 2.0                                 # folded again at every run: never stale
        np.testing.assert_allclose(_np(g(Tensor(x))), _np(f(x)), **TOL[DT])
    # on the tape, with the weights differentiated: not folded, recomputed instead
    g = _remap(f, x)
    if bias:
        _only_line(g, "refused conv2d->bias_add->batchnorm")
    else:
        assert g.ops == ["conv_batchnorm_relu"]
        _grads_match(f, g, [x], [w, gamma, beta])


def test_running_stats_updated_in_place_like_unfused():
    rng = np.random.default_rng(8)
    w, _ = _conv_params(rng, 2, 2, bias=False)
    gamma, beta, r_mean, r_var = _bn_params(rng, 2)
    mean_id, var_id = id(r_mean), id(r_var)

    def f(x):
        return nf.relu(nf.batchnorm(nf.conv2d(x, w, padding=1), gamma, beta,
                                    running_mean=r_mean, running_var=r_var))

    x = rng.standard_normal((2, 2, 3, 3))
    g = _remap(f, x)
    before = r_mean.copy(), r_var.copy()
    f(x)
    expected = r_mean.copy(), r_var.copy()
    r_mean[...], r_var[...] = before
    g(x)
    np.testing.assert_allclose(r_mean, expected[0], **TOL[DT])
    np.testing.assert_allclose(r_var, expected[1], **TOL[DT])
    assert (id(r_mean), id(r_var)) == (mean_id, var_id)


class BiasAdd3d(Function):
    """A bias_add that also takes the 3-d output of a squeeze (the real one is 4-d only)."""
    name = "bias_add"
    Params = nf.ops.conv.BiasAdd.Params

    def forward(self, x, b):
        axis = 1 if self.params.layout == "NCHW" else x.ndim - 1
        self.axes = tuple(a for a in range(x.ndim) if a != axis)
        return x + np.expand_dims(b, self.axes)

    def backward(self, gy):
        return gy, gy.sum(axis=self.axes)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("layout,x_shape,axis", [("NHWC", (2, 1, 5, 2), 1),
                                                 ("NCHW", (2, 2, 5, 1), 3)])
def test_conv_squeeze_bias_fires(relu, layout, x_shape, axis):
    rng = np.random.default_rng(9)
    w, b = _conv_params(rng, 2, 3)
    x = rng.standard_normal(x_shape)                      # one spatial size 1

    def f(x):
        h = nf.squeeze(nf.conv2d(x, w, padding=1, layout=layout), axis)   # 3-d
        h = BiasAdd3d(layout=layout).apply(h, b)
        return nf.relu(h) if relu else h

    g = _remap(f, x)
    assert g.ops == ["conv_bias_relu" if relu else "conv_bias", "squeeze"]
    _only_line(g, "Fuse Conv2D with Squeeze")
    _grads_match(f, g, [x], [w, b])


def test_refused_squeeze_of_the_batch_axis():
    x1 = X[:1]                                            # N = 1

    def f(x):
        return frelu(BiasAdd3d(layout="NCHW").apply(nf.squeeze(fconv(x, W), 0), B))

    with pytest.raises(ValueError):
        f(x1)                                             # bias would add along P, not K
    g = _remap(lambda x: nf.squeeze(fconv(x, W[:, :, :, :1].copy()), 0), x1)
    assert g.log == []


def test_conv_bias_fires_without_relu():
    rng = np.random.default_rng(11)
    w, b = _conv_params(rng, 2, 3)
    x = rng.standard_normal((2, 2, 4, 4))

    def f(x):
        return nf.bias_add(nf.conv2d(x, w, stride=2, padding="same"), b)

    g = _remap(f, x)
    assert g.ops == ["conv_bias"]
    _only_line(g, "Fuse Conv2D with BiasAdd: conv2d_0, bias_add_1 -> conv_bias_0")
    _grads_match(f, g, [x], [w, b])


# --------------------------------------------------------------------------- random chains

STEPS = ("conv", "bias", "relu", "bn_train", "bn_infer", "add_z", "add_prev")


@settings(max_examples=12)
@given(steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=6),
       seed=st.integers(0, 2**16), as_output=st.booleans(), N=st.integers(1, 2),
       squeeze_end=st.booleans())
def test_random_chains_remap_exactly(steps, seed, as_output, N, squeeze_end):
    """Random unfused chains (channels and sizes kept, so any step applies anywhere); with
    N = 1 the chain may end in a squeeze of the batch axis (the only squeeze a 4-d op chain
    can continue from is the last op's)."""
    rng = np.random.default_rng(seed)
    C, H = 2, 3
    x, z = rng.standard_normal((N, C, H, H)), rng.standard_normal((N, C, H, H))
    plan, params, stats = [], [], []
    for step in steps:
        if step == "conv":
            w, _ = _conv_params(rng, C, C, bias=False)
            plan.append((step, w))
            params.append(w)
        elif step == "bias":
            _, b = _conv_params(rng, C, C)
            plan.append((step, b))
            params.append(b)
        elif step.startswith("bn"):
            gamma, beta, r_mean, r_var = _bn_params(rng, C)
            plan.append((step, (gamma, beta, r_mean, r_var)))
            params += [gamma, beta]
            stats += [r_mean, r_var]
        else:
            plan.append((step, None))

    def f(x, z):
        h, seen = x, [x]
        for step, p in plan:
            if step == "conv":
                h = nf.conv2d(h, p, padding=1)
            elif step == "bias":
                h = nf.bias_add(h, p)
            elif step == "relu":
                h = nf.relu(h)
            elif step.startswith("bn"):
                gamma, beta, r_mean, r_var = p
                h = nf.batchnorm(h, gamma, beta, running_mean=r_mean, running_var=r_var,
                                 training=step == "bn_train", eps=EPS)
            elif step == "add_z":
                h = nf.add(h, z)
            else:                                # a second consumer of an earlier value
                h = nf.add(seen[len(seen) // 2], h)
            seen.append(h)
        if squeeze_end and N == 1:
            h = nf.squeeze(h, 0)
        return (h, seen[len(seen) // 2]) if as_output else h

    def first(x, z):
        out = f(x, z)
        return out[0] if as_output else out

    saved = [s.copy() for s in stats]
    g = _remap(f, x, z)
    assert all(line.startswith(("refused ", "Fuse ", "Fold ")) for line in g.log), g.log
    for s, s0 in zip(stats, saved):
        s[...] = s0
    g_first = nf.Graph(g.inputs, g.nodes, g.outputs[:1], folds=g.folds, recording=g.recording)
    _grads_match(first, g_first, [x, z], params, stats=stats)
    with nf.no_grad():                          # arrays: folding may fire
        for s, s0 in zip(stats, saved):
            s[...] = s0
        ga = _remap(f, x, z)
        for s, s0 in zip(stats, saved):
            s[...] = s0
        expected = f(x, z)
        for s, s0 in zip(stats, saved):
            s[...] = s0
        got = ga(x, z)
        for a, b in zip(expected if as_output else [expected], got if as_output else [got]):
            np.testing.assert_allclose(_np(b), _np(a), **TOL[DT])


# --------------------------------------------------------------------------- compile

def test_compile_a_module_caches_per_signature_and_mode():
    rng = np.random.default_rng(10)
    model = nf.nn.Sequential(nf.nn.Conv2d(2, 3, 3, padding=1, bias=False, dtype=DT),
                             nf.nn.BatchNorm2d(3, dtype=DT), nf.nn.ReLU())
    compiled = nf.compile(model)
    x = rng.standard_normal((2, 2, 4, 4))
    compiled(Tensor(x))                                  # traces (the unfused run)
    assert compiled.graph.ops == ["conv_batchnorm_relu"]
    y = compiled(Tensor(x))                              # runs the cached graph
    assert len(compiled.graphs) == 1
    loss = y.sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with nf.no_grad():
        compiled(x)
        assert compiled.graph.ops == ["conv_bias_relu"] and len(compiled.graphs) == 2
        np.testing.assert_allclose(_np(compiled(x)), _np(model(x)), **TOL[DT])
    compiled.clear()
    assert compiled.graphs == {}
