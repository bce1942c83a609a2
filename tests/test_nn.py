"""numbafuse.nn layers and numbafuse.optim.SGD.

Layer shapes, PyTorch-style init statistics, parameter/buffer registration, train/eval
switching (running statistics move only in training), fused layers equal their unfused
twins (same seed -> same weights), the folded eval path of ConvBatchNormReLU equals the
unfused eval chain, and SGD against a hand computation (momentum, weight decay).
"""
import math

import numpy as np
import pytest

import numbafuse as nf
from numbafuse import nn, optim

TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-12)}
INIT_SAMPLES = (64, 64, 3, 3)   # a conv big enough for init statistics: 36864 weights


def _x(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# --------------------------------------------------------------------------- init

def test_kaiming_uniform_matches_pytorch_default():
    nn.init.seed(0)
    K, C, R, S = INIT_SAMPLES
    conv = nn.Conv2d(C, K, R)
    bound = 1.0 / math.sqrt(C * R * S)          # kaiming_uniform(a=sqrt(5)) == 1/sqrt(fan_in)
    w = conv.weight.numpy()
    assert w.shape == (K, C, R, S) and w.dtype == np.float32
    assert np.abs(w).max() <= bound
    # U(-b, b): mean 0, variance b^2 / 3
    assert abs(w.mean()) < 0.02 * bound
    assert w.var() == pytest.approx(bound ** 2 / 3, rel=0.03)
    b = conv.bias.numpy()
    assert b.shape == (K,) and np.abs(b).max() <= bound


def test_batchnorm_init_and_buffers():
    bn = nn.BatchNorm2d(3)
    np.testing.assert_array_equal(bn.weight.numpy(), np.ones(3))
    np.testing.assert_array_equal(bn.bias.numpy(), np.zeros(3))
    np.testing.assert_array_equal(bn.running_mean, np.zeros(3))
    np.testing.assert_array_equal(bn.running_var, np.ones(3))
    assert bn.num_batches_tracked.shape == () and bn.num_batches_tracked.dtype == np.int64
    assert [n for n, _ in bn.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in bn.named_buffers()] == ["running_mean", "running_var",
                                                  "num_batches_tracked"]


def test_seed_reproducible_and_rng_argument():
    nn.init.seed(7)
    a = nn.Linear(5, 3).weight.numpy()
    nn.init.seed(7)
    b = nn.Linear(5, 3).weight.numpy()
    np.testing.assert_array_equal(a, b)
    c = nn.Linear(5, 3, rng=np.random.default_rng(7)).weight.numpy()
    np.testing.assert_array_equal(a, c)


# --------------------------------------------------------------------------- Module mechanics

def test_registration_parameters_and_modes():
    m = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten())
    names = [n for n, _ in m.named_parameters()]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert all(p.requires_grad for p in m.parameters())
    assert len(m) == 4 and isinstance(m[1], nn.BatchNorm2d)
    assert m.training and all(c.training for c in m)
    m.eval()
    assert not m.training and not any(c.training for c in m)
    m.train()
    assert all(c.training for c in m)
    assert "Conv2d" in repr(m)


def test_state_dict_round_trip():
    nn.init.seed(1)
    a = nn.ConvBatchNormReLU(2, 3, 3)
    nn.init.seed(2)
    b = nn.ConvBatchNormReLU(2, 3, 3)
    b.bn.running_mean[:] = 5.0
    b.bn.num_batches_tracked[...] = 7
    a.load_state_dict(b.state_dict())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.numpy(), pb.numpy())
    np.testing.assert_array_equal(a.bn.running_mean, 5.0)
    assert a.bn.num_batches_tracked == 7 and a.bn.num_batches_tracked.dtype == np.int64
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and va.dtype == vb.dtype
        np.testing.assert_array_equal(va, vb)
    with pytest.raises(KeyError):
        a.load_state_dict({"weight": b.weight.numpy()})


def test_reassigned_buffer_stays_a_buffer(rng):
    bn = nn.BatchNorm2d(2, dtype=np.float64)
    new_mean = np.full(2, 3.0)
    bn.running_mean = new_mean                          # like PyTorch: still a buffer
    assert [n for n, _ in bn.named_buffers()] == ["running_mean", "running_var",
                                                  "num_batches_tracked"]
    assert bn.running_mean is new_mean and "running_mean" not in vars(bn)
    np.testing.assert_array_equal(bn.state_dict()["running_mean"], 3.0)
    bn(_x(rng, (2, 2, 3, 3), np.float64))               # the op updates the new array
    assert not np.array_equal(new_mean, 3.0)
    bn.load_state_dict({**bn.state_dict(), "running_mean": np.zeros(2)})
    np.testing.assert_array_equal(bn.running_mean, 0.0)
    bn.running_mean = nf.Tensor(np.ones(2), requires_grad=True)   # a parameter replaces it
    assert [n for n, _ in bn.named_buffers()] == ["running_var", "num_batches_tracked"]
    assert "running_mean" in dict(bn.named_parameters())


class _TorchLike:
    """Stands for a torch tensor in a state dict: read through .detach().cpu().numpy()."""

    def __init__(self, array):
        self.array, self.calls = array, []

    def detach(self):
        self.calls.append("detach")
        return self

    def cpu(self):
        self.calls.append("cpu")
        return self

    def numpy(self):
        self.calls.append("numpy")
        return self.array


def test_num_batches_tracked_counts_training_batches_only(rng):
    x = _x(rng, (4, 3, 5, 5), np.float64)
    for m, call in ((nn.BatchNorm2d(3, dtype=np.float64), lambda m: m(x)),
                    (nn.BatchNormAddReLU(3, dtype=np.float64), lambda m: m(x, x)),
                    (nn.ConvBatchNormReLU(3, 3, 3, padding=1, dtype=np.float64),
                     lambda m: m(x))):
        bn = m.bn if isinstance(m, nn.ConvBatchNormReLU) else m
        counter = bn.num_batches_tracked
        call(m)
        call(m)
        m.eval()
        call(m)
        assert bn.num_batches_tracked == 2 and bn.num_batches_tracked is counter   # in place


def test_momentum_none_is_the_cumulative_average(rng):
    bn = nn.BatchNorm2d(2, momentum=None, dtype=np.float64)
    batches = [_x(rng, (3, 2, 4, 4), np.float64) + i for i in range(4)]
    for xb in batches:
        bn(xb)
    means = [xb.mean(axis=(0, 2, 3)) for xb in batches]
    variances = [xb.var(axis=(0, 2, 3), ddof=1) for xb in batches]
    # PyTorch's rule: factor 1/n at the n-th batch, so the n-th update starts from the average
    # of the first n-1 batches (and from the initial 0 / 1, weighted 0, at n = 1)
    np.testing.assert_allclose(bn.running_mean, np.mean(means, axis=0), rtol=1e-12)
    np.testing.assert_allclose(bn.running_var, np.mean(variances, axis=0), rtol=1e-12)


@pytest.mark.parametrize("layer", ["BatchNorm2d", "BatchNormAddReLU", "ConvBatchNormReLU"])
def test_momentum_is_checked_where_it_is_used(rng, layer):
    """A momentum outside [0, 1] is taken at construction and in eval (never read there, as
    PyTorch's layers take it), and refused at a training call before anything is written
    (running statistics, num_batches_tracked), the error naming the layer called."""
    m = {"BatchNorm2d": lambda: nn.BatchNorm2d(2, momentum=5, dtype=np.float64),
         "BatchNormAddReLU": lambda: nn.BatchNormAddReLU(2, momentum=5, dtype=np.float64),
         "ConvBatchNormReLU": lambda: nn.ConvBatchNormReLU(2, 2, 1, momentum=5,
                                                           dtype=np.float64)}[layer]()
    bn = m.bn if layer == "ConvBatchNormReLU" else m
    bn.running_mean[...], bn.running_var[...] = [0.5, -0.5], [2.0, 3.0]
    state = {k: np.array(v, copy=True) for k, v in bn.state_dict().items()}
    xb = _x(rng, (2, 2, 4, 4), np.float64)

    def call():
        return m(xb, np.zeros_like(xb)) if layer == "BatchNormAddReLU" else m(xb)

    m.eval()
    call()
    m.train()
    with pytest.raises(ValueError, match=rf"^{layer}: momentum must lie in \[0.0, 1.0\], got 5$"):
        call()
    for k, v in bn.state_dict().items():
        np.testing.assert_array_equal(v, state[k], err_msg=k)
    bn.momentum = 0.5                                  # a valid one: the call runs
    call()
    assert int(bn.num_batches_tracked) == 1


def _cumulative_batches(rng):
    """Training batches (None: an eval call between them), one of them empty."""
    return [_x(rng, (3, 2, 4, 4), np.float64) * 2 + 1, _x(rng, (2, 2, 4, 4), np.float64) - 3,
            np.zeros((0, 2, 4, 4)), None, _x(rng, (4, 2, 4, 4), np.float64) * 0.5]


@pytest.mark.parametrize("layer", ["BatchNorm2d", "BatchNormAddReLU", "ConvBatchNormReLU"])
def test_momentum_none_follows_pytorchs_rule_with_an_empty_batch(rng, layer):
    """Plain NumPy, PyTorch's rule: each training batch counts (num_batches_tracked += 1,
    an empty one too), then r += (batch statistic - r) / num_batches_tracked, where the batch
    has values (an empty batch updates nothing); eval changes nothing."""
    m = {"BatchNorm2d": lambda: nn.BatchNorm2d(2, momentum=None, dtype=np.float64),
         "BatchNormAddReLU": lambda: nn.BatchNormAddReLU(2, momentum=None, dtype=np.float64),
         "ConvBatchNormReLU": lambda: nn.ConvBatchNormReLU(2, 2, 1, momentum=None,
                                                           dtype=np.float64)}[layer]()
    bn = m.bn if layer == "ConvBatchNormReLU" else m
    if layer == "ConvBatchNormReLU":
        m.weight.data[...] = np.eye(2).reshape(2, 2, 1, 1)       # h = x
    r_mean, r_var, count = np.zeros(2), np.ones(2), 0
    for xb in _cumulative_batches(rng):
        m.train(xb is not None)
        xb = _x(rng, (2, 2, 4, 4), np.float64) if xb is None else xb
        m(xb, np.zeros_like(xb)) if layer == "BatchNormAddReLU" else m(xb)
        if m.training:
            count += 1
            if xb.size:
                r_mean = r_mean + (xb.mean(axis=(0, 2, 3)) - r_mean) / count
                r_var = r_var + (xb.var(axis=(0, 2, 3), ddof=1) - r_var) / count
        assert int(bn.num_batches_tracked) == count
        np.testing.assert_allclose(bn.running_mean, r_mean, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(bn.running_var, r_var, rtol=1e-12, atol=1e-15)


@pytest.mark.torch
def test_momentum_none_matches_torch_batchnorm2d(rng):
    torch = pytest.importorskip("torch")
    ours = nn.BatchNorm2d(2, momentum=None, dtype=np.float64)
    theirs = torch.nn.BatchNorm2d(2, momentum=None, dtype=torch.float64)
    for xb in _cumulative_batches(rng):
        for m in (ours, theirs):
            m.train(xb is not None)
        xb = _x(rng, (2, 2, 4, 4), np.float64) if xb is None else xb
        y = nf.Tensor(ours(xb)).numpy()
        with torch.no_grad():
            np.testing.assert_allclose(y, theirs(torch.from_numpy(xb)).numpy(), **TOL[np.float64])
        assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked)
        np.testing.assert_allclose(ours.running_mean, theirs.running_mean.numpy(), rtol=1e-12)
        np.testing.assert_allclose(ours.running_var, theirs.running_var.numpy(), rtol=1e-12)


@pytest.mark.parametrize("layer", ["BatchNorm2d", "ConvBatchNormReLU"])
def test_a_refused_batch_is_not_counted(rng, layer):
    """One value per channel in training is refused before anything is written: the running
    statistics and num_batches_tracked stay (PyTorch counts the batch before refusing it)."""
    m = nn.BatchNorm2d(2, dtype=np.float64) if layer == "BatchNorm2d" else \
        nn.ConvBatchNormReLU(2, 2, 1, dtype=np.float64)
    bn = m.bn if layer == "ConvBatchNormReLU" else m
    m(_x(rng, (2, 2, 3, 3), np.float64))
    state = [np.array(bn.running_mean), np.array(bn.running_var), int(bn.num_batches_tracked)]
    with pytest.raises(ValueError, match="more than one value per channel"):
        m(_x(rng, (1, 2, 1, 1), np.float64))
    np.testing.assert_array_equal(bn.running_mean, state[0])
    np.testing.assert_array_equal(bn.running_var, state[1])
    assert int(bn.num_batches_tracked) == state[2]


def test_load_state_dict_takes_torch_like_tensors_and_pytorch_keys():
    bn = nn.BatchNormAddReLU(3)
    state = {"weight": _TorchLike(np.full(3, 2.0)), "bias": _TorchLike(np.full(3, -1.0)),
             "running_mean": np.full(3, 0.5), "running_var": np.full(3, 4.0),
             "num_batches_tracked": _TorchLike(np.array(12))}
    bn.load_state_dict(state)
    assert state["weight"].calls == ["detach", "cpu", "numpy"]
    assert bn.weight.dtype == np.float32 and bn.weight.numpy().tolist() == [2.0] * 3
    assert bn.num_batches_tracked == 12 and bn.num_batches_tracked.dtype == np.int64
    del state["num_batches_tracked"]                   # PyTorch accepts its absence
    bn.load_state_dict(state)
    assert bn.num_batches_tracked == 12


def test_load_state_dict_refuses_bad_keys_and_shapes_before_writing():
    bn = nn.BatchNorm2d(3)
    good = bn.state_dict()
    with pytest.raises(KeyError, match=r"missing \['running_var'\], unexpected \['gamma'\]"):
        bn.load_state_dict({**{k: v for k, v in good.items() if k != "running_var"},
                            "gamma": np.ones(3)})
    bad = {**good, "weight": np.full(3, 9.0), "running_mean": np.zeros(4)}
    with pytest.raises(ValueError, match=r"running_mean has shape \(4,\), expected \(3,\)"):
        bn.load_state_dict(bad)
    np.testing.assert_array_equal(bn.weight.numpy(), 1.0)     # nothing was written


def test_zero_grad():
    lin = nn.Linear(3, 2)
    x = nf.Tensor(np.ones((4, 3), np.float32))
    lin(x).sum().backward()
    assert lin.weight.grad is not None
    lin.zero_grad()
    assert all(p.grad is None for p in lin.parameters())


# --------------------------------------------------------------------------- layer shapes

@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_layer_shapes(rng, layout):
    nn.init.seed(0)
    shape = (2, 3, 8, 8) if layout == "NCHW" else (2, 8, 8, 3)
    x = nf.Tensor(_x(rng, shape))
    y = nn.Conv2d(3, 4, 3, stride=2, padding=1, layout=layout)(x)
    assert y.shape == ((2, 4, 4, 4) if layout == "NCHW" else (2, 4, 4, 4))
    y = nn.Conv2dBiasReLU(3, 5, 3, padding="same", layout=layout)(x)
    assert y.shape == ((2, 5, 8, 8) if layout == "NCHW" else (2, 8, 8, 5))
    y = nn.ConvBatchNormReLU(3, 5, (3, 1), padding=(1, 0), layout=layout)(x)
    assert y.shape == ((2, 5, 8, 8) if layout == "NCHW" else (2, 8, 8, 5))
    assert nn.MaxPool2d(2, layout=layout)(x).shape == (
        (2, 3, 4, 4) if layout == "NCHW" else (2, 4, 4, 3))
    assert nn.GlobalAvgPool2d(layout)(x).shape == (2, 3)
    assert nn.Flatten()(x).shape == (2, 3 * 8 * 8)
    assert nn.Linear(3, 7)(nn.GlobalAvgPool2d(layout)(x)).shape == (2, 7)
    assert nn.BatchNormAddReLU(3, layout=layout)(x, x).shape == shape


# --------------------------------------------------------------------------- train / eval

def test_running_stats_move_only_in_training(rng):
    bn = nn.BatchNorm2d(3)
    x = _x(rng, (4, 3, 5, 5)) + 2.0
    bn.eval()
    bn(x)
    np.testing.assert_array_equal(bn.running_mean, 0.0)
    bn.train()
    bn(x)
    assert np.all(bn.running_mean > 0.1)


def test_fused_layers_equal_unfused_twins(rng):
    """Same seed -> same weights; outputs and gradients agree in train and eval mode."""
    x = _x(rng, (3, 2, 6, 6), np.float64)
    z = _x(rng, (3, 4, 6, 6), np.float64)
    kw = dict(padding=1, dtype=np.float64)
    nn.init.seed(3)
    fused = nn.ConvBatchNormReLU(2, 4, 3, **kw)
    nn.init.seed(3)
    conv, bn = nn.Conv2d(2, 4, 3, bias=False, **kw), nn.BatchNorm2d(4, dtype=np.float64)
    for mode in ("train", "eval", "train"):
        getattr(fused, mode)()
        getattr(bn, mode)()
        xf, xu = nf.Tensor(x, requires_grad=True), nf.Tensor(x, requires_grad=True)
        yf, yu = fused(xf), nf.relu(bn(conv(xu)))
        np.testing.assert_allclose(yf.numpy(), yu.numpy(), **TOL[np.float64])
        (yf * z).sum().backward()
        (yu * z).sum().backward()
        np.testing.assert_allclose(xf.grad, xu.grad, **TOL[np.float64])
        np.testing.assert_allclose(fused.weight.grad, conv.weight.grad, **TOL[np.float64])
        np.testing.assert_allclose(fused.bn.weight.grad, bn.weight.grad, **TOL[np.float64])
        np.testing.assert_allclose(fused.bn.bias.grad, bn.bias.grad, **TOL[np.float64])
        for p in (fused.weight, fused.bn.weight, fused.bn.bias, conv.weight, bn.weight,
                  bn.bias):
            p.grad = None
        np.testing.assert_allclose(fused.bn.running_mean, bn.running_mean, **TOL[np.float64])
        np.testing.assert_allclose(fused.bn.running_var, bn.running_var, **TOL[np.float64])
        assert fused.bn.num_batches_tracked == bn.num_batches_tracked


def test_folded_eval_equals_unfused_eval(rng):
    nn.init.seed(4)
    fused = nn.ConvBatchNormReLU(3, 4, 3, padding=1, relu=False)
    fused.bn.running_mean[:] = rng.standard_normal(4)
    fused.bn.running_var[:] = rng.uniform(0.5, 2.0, 4)
    fused.bn.weight.data[:] = rng.uniform(0.5, 1.5, 4)
    fused.bn.bias.data[:] = rng.standard_normal(4)
    fused.eval()
    x = _x(rng, (2, 3, 7, 7))
    y = fused(x).numpy()
    h = nf.conv2d(x, fused.weight.data, padding=1)
    expected = nf.batchnorm(h, fused.bn.weight.data, fused.bn.bias.data,
                            running_mean=fused.bn.running_mean,
                            running_var=fused.bn.running_var, training=False)
    np.testing.assert_allclose(y, expected, **TOL[np.float32])


def test_batchnorm_add_relu_module_equals_chain(rng):
    x, z = _x(rng, (2, 3, 4, 4), np.float64), _x(rng, (2, 3, 4, 4), np.float64)
    fused, bn = nn.BatchNormAddReLU(3, dtype=np.float64), nn.BatchNorm2d(3, dtype=np.float64)
    np.testing.assert_allclose(fused(x, z).numpy(), nf.relu(nf.add(bn(x), z)).numpy(),
                               **TOL[np.float64])
    np.testing.assert_allclose(fused.running_var, bn.running_var, **TOL[np.float64])


# --------------------------------------------------------------------------- SGD

def _sgd_by_hand(p0, grads, lr, momentum, wd):
    p, buf = p0.astype(np.float64).copy(), None
    for g in grads:
        g = g + wd * p
        buf = g.copy() if buf is None else momentum * buf + g
        p = p - lr * (buf if momentum else g)
    return p


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.0, 0.1), (0.9, 0.01),
                                         (1.0, 0.0), (1.5, 0.01)])   # any m >= 0, as PyTorch
def test_sgd_matches_hand_computation(rng, momentum, wd):
    p0 = rng.standard_normal(5)
    grads = [rng.standard_normal(5) for _ in range(3)]
    p = nf.Tensor(p0.copy(), requires_grad=True)
    opt = optim.SGD([p], lr=0.1, momentum=momentum, weight_decay=wd)
    for g in grads:
        opt.zero_grad()
        assert p.grad is None
        p.grad = g.copy()
        opt.step()
    np.testing.assert_allclose(p.data, _sgd_by_hand(p0, grads, 0.1, momentum, wd),
                               rtol=1e-12, atol=1e-14)


def test_sgd_momentum_buffer_is_not_the_gradient():
    p = nf.Tensor(np.ones(3), requires_grad=True)
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = np.full(3, 2.0)
    opt.step()
    assert opt.momentum_buffers[0] is not p.grad
    p.grad[:] = 100.0                                  # e.g. accumulated into in place
    np.testing.assert_array_equal(opt.momentum_buffers[0], 2.0)


def test_sgd_updates_in_place_and_skips_missing_grads():
    p = nf.Tensor(np.ones(3, np.float32), requires_grad=True)
    q = nf.Tensor(np.ones(3, np.float32), requires_grad=True)
    data = p.data
    opt = optim.SGD([p, q], lr=0.5)
    (p * p).sum().backward()
    opt.step()
    assert p.data is data and p.data.dtype == np.float32
    np.testing.assert_allclose(p.data, 0.0)
    np.testing.assert_array_equal(q.data, 1.0)


def _numpy_steps(p0, grads, lr, momentum, wd):
    """The NumPy step the compiled host step replaces (optim.SGD._step_host_numpy), written
    out: g + wd*p; b = g, then b*m + g; p - lr*b, every operation in p's dtype."""
    dt = p0.dtype.type
    p, b = p0.copy(), None
    for g in grads:
        if wd:
            g = g + dt(wd) * p
        if momentum:
            if b is None:
                b = np.array(g)
            else:
                b *= dt(momentum)
                b += g
            g = b
        p -= dt(lr) * g
    return p


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.0, 5e-4), (0.9, 5e-4)])
def test_sgd_host_step_is_the_numpy_step_bit_for_bit(rng, dtype, momentum, wd):
    shape = (24, 24, 3, 3)
    p0 = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(4)]
    p = nf.Tensor(p0.copy(), requires_grad=True)
    data = p.data
    opt = optim.SGD([p], lr=0.05, momentum=momentum, weight_decay=wd)
    for g in grads:
        p.grad = g.copy()
        opt.step()
        np.testing.assert_array_equal(p.grad, g)                  # the gradient is untouched
    assert p.data is data and p.data.dtype == dtype
    np.testing.assert_array_equal(p.data, _numpy_steps(p0, grads, 0.05, momentum, wd))
    if momentum:
        assert opt.momentum_buffers[0].dtype == dtype


@pytest.mark.parametrize("layout", ["strided param", "strided grad", "float64 grad"])
def test_sgd_host_step_takes_any_array_layout(rng, layout):
    base = rng.standard_normal((6, 8)).astype(np.float32)
    g0 = [rng.standard_normal((6, 4)).astype(np.float32) for _ in range(3)]
    p0 = np.ascontiguousarray(base[:, ::2])
    p = nf.Tensor(base[:, ::2] if layout == "strided param" else p0.copy(), requires_grad=True)
    data = p.data
    opt = optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    for g in g0:
        p.grad = (np.asfortranarray(g) if layout == "strided grad" else
                  g.astype(np.float64) if layout == "float64 grad" else g)
        opt.step()
    assert p.data is data                                          # still in place
    want = _numpy_steps(p0, [np.asarray(g, np.float32) for g in g0], 0.1, 0.9, 0.01)
    np.testing.assert_allclose(p.data, want, rtol=1e-6, atol=1e-6)
    if layout == "strided param":
        np.testing.assert_array_equal(base[:, ::2], p.data)       # the caller's view moved


@pytest.mark.parametrize("kwargs,match", [(dict(lr=0.0), "lr"), (dict(lr=0.1, momentum=-1),
                                                                  "momentum"),
                                          (dict(lr=0.1, weight_decay=-1), "weight_decay")])
def test_sgd_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=f"SGD: {match}"):
        optim.SGD([nf.Tensor(np.ones(1), requires_grad=True)], **kwargs)
    with pytest.raises(TypeError, match="SGD: params"):
        optim.SGD([np.ones(1)], lr=0.1)


@pytest.mark.torch
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("groups, C, K", [(2, 4, 6), (4, 4, 8)])    # grouped; depthwise x2
def test_grouped_layers_match_torch(rng, layout, groups, C, K):
    """nn.Conv2d / Conv2dBiasReLU / ConvBatchNormReLU with ``groups``: torch's weight shape
    (K, C/groups, R, S), torch checkpoints load as they are, and outputs, gradients and
    running statistics equal torch's float64 layers over train, train, eval."""
    torch = pytest.importorskip("torch")
    tnn = torch.nn
    kw = dict(stride=2, padding=1, dtype=np.float64, groups=groups)
    conv_t = tnn.Conv2d(C, K, 3, 2, 1, groups=groups, dtype=torch.float64)
    free_t = tnn.Conv2d(C, K, 3, 2, 1, groups=groups, bias=False, dtype=torch.float64)
    bn_t = tnn.BatchNorm2d(K, dtype=torch.float64)
    with torch.no_grad():
        bn_t.weight.uniform_(0.5, 1.5)
        bn_t.bias.uniform_(-0.5, 0.5)
    plain, fused = nn.Conv2d(C, K, 3, layout=layout, **kw), nn.Conv2dBiasReLU(C, K, 3,
                                                                            layout=layout, **kw)
    cbr = nn.ConvBatchNormReLU(C, K, 3, layout=layout, **kw)
    assert plain.weight.data.shape == (K, C // groups, 3, 3)
    plain.load_state_dict(conv_t.state_dict())
    fused.load_state_dict(conv_t.state_dict())
    cbr.load_state_dict({"weight": free_t.weight,
                         **{"bn." + k: v for k, v in bn_t.state_dict().items()}})
    to_layout = (lambda a: a) if layout == "NCHW" else (lambda a: a.transpose(0, 2, 3, 1))
    x = rng.standard_normal((2, C, 7, 6))
    for training in (True, True, False):
        cbr.train(training)
        bn_t.train(training)
        xt = torch.from_numpy(x).requires_grad_(True)
        cases = [(plain, conv_t(xt), conv_t.weight), (fused, conv_t(xt).relu(), conv_t.weight),
                 (cbr, bn_t(free_t(xt)).relu(), free_t.weight)]
        for layer, want, w_t in cases:
            xn = nf.Tensor(np.ascontiguousarray(to_layout(x)), requires_grad=True)
            y = layer(xn)
            np.testing.assert_allclose(y.numpy(), to_layout(want.detach().numpy()),
                                       **TOL[np.float64])
            dy = rng.standard_normal(want.shape)
            y.backward(np.ascontiguousarray(to_layout(dy)))
            dx_t, dw_t = torch.autograd.grad(want, (xt, w_t), torch.from_numpy(dy))
            np.testing.assert_allclose(xn.grad, to_layout(dx_t.numpy()), **TOL[np.float64])
            np.testing.assert_allclose(layer.weight.grad, dw_t.numpy(), **TOL[np.float64])
            layer.weight.grad = None
        np.testing.assert_allclose(cbr.bn.running_mean, bn_t.running_mean.numpy(),
                                   **TOL[np.float64])
        np.testing.assert_allclose(cbr.bn.running_var, bn_t.running_var.numpy(),
                                   **TOL[np.float64])


def test_grouped_layer_errors_name_the_layer():
    with pytest.raises(ValueError, match="Conv2d: groups=3 must divide in_channels=4"):
        nn.Conv2d(4, 6, 3, groups=3)
    with pytest.raises(ValueError, match="ConvBatchNormReLU: groups must be >= 1"):
        nn.ConvBatchNormReLU(4, 4, 3, groups=0)
    with pytest.raises(TypeError, match="Conv2dBiasReLU: groups must be an int"):
        nn.Conv2dBiasReLU(4, 4, 3, groups=2.0)
