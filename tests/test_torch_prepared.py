"""numbafuse.torch.prepared: an inference call of batchnorm_add_relu whose signature passed
every check before skips them and runs the kernel that call ran; anything else is checked."""
import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'numbafuse[torch]'); .ci/run's "
    "torch leg has it")

import numbafuse.torch as nft  # noqa: E402
from numbafuse.torch import layers, prepared  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def fresh_signatures(monkeypatch):
    monkeypatch.setattr(prepared, "VALIDATED", {})
    monkeypatch.setattr(prepared, "CHECKED", {})


def _inputs(dtype=torch.float32, channels_last=False, seed=0, shape=(3, 5, 4, 6)):
    g = torch.Generator().manual_seed(seed)
    x, z = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(2))
    C = shape[1]
    weight = torch.nn.Parameter(torch.rand(C, generator=g, dtype=dtype) + 0.5)
    bias = torch.nn.Parameter(torch.randn(C, generator=g, dtype=dtype))
    rm = torch.randn(C, generator=g, dtype=dtype)
    rv = torch.rand(C, generator=g, dtype=dtype) + 0.5
    if channels_last:
        x, z = (t.contiguous(memory_format=torch.channels_last) for t in (x, z))
    return x, z, weight, bias, rm, rv


def _reference(x, z, weight, bias, rm, rv, eps=1e-5):
    with torch.no_grad():
        d = torch.float64
        y = torch.nn.functional.batch_norm(x.to(d), rm.to(d), rv.to(d), weight.to(d),
                                           bias.to(d), False, 0.0, eps)
        return (y + z.to(d)).relu()


def _checks_refused(monkeypatch):
    """Make the checked path fail loudly: a call that reaches it raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("the checked path ran")
    monkeypatch.setattr(layers, "check_tensors", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_checked_inference_call_runs_again_without_its_checks(monkeypatch, dtype,
                                                                channels_last):
    args = _inputs(dtype, channels_last)
    with torch.no_grad():
        first = nft.batchnorm_add_relu(*args, training=False)
        assert len(prepared.VALIDATED) == 1
        _checks_refused(monkeypatch)
        again = nft.batchnorm_add_relu(*args, training=False)
    assert torch.equal(again, first)                       # the same kernel: the same bits
    assert again.is_contiguous(memory_format=torch.channels_last) == channels_last
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(again.double().numpy(), _reference(*args).numpy(), rtol=tol,
                               atol=tol)
    # not under no_grad, no input requiring grad but the Parameters: recorded, so checked
    x, z, weight, bias, rm, rv = args
    weight.requires_grad_(False), bias.requires_grad_(False)
    assert prepared.signature(False, x, z, weight, bias, rm, rv, 1e-5) not in prepared.VALIDATED


def test_prepared_calls_read_every_value_anew():
    """Writes no version counter sees (``.data``) reach the next call: nothing derived from
    the values is kept."""
    x, z, weight, bias, rm, rv = _inputs()
    with torch.no_grad():
        nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=False)
        for t in (x, z, weight, bias, rm, rv):
            version = t._version
            t.data.mul_(1.5).add_(0.25)
            assert t._version == version
        y = nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=False)
    assert len(prepared.VALIDATED) == 1
    np.testing.assert_allclose(y.double().numpy(), _reference(x, z, weight, bias, rm, rv)
                               .numpy(), rtol=1e-5, atol=1e-5)


def test_what_is_never_prepared_or_differs_is_checked(monkeypatch):
    x, z, weight, bias, rm, rv = _inputs()
    with torch.no_grad():
        nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=True)       # training
        assert not prepared.VALIDATED
        nft.batchnorm_add_relu(x.half(), z.half(), weight, bias, rm, rv, training=False)
        assert not prepared.VALIDATED                                            # half
        nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=False)
        assert len(prepared.VALIDATED) == 1
        # the same tensors otherwise: each a signature of its own, checked and refused
        strided = torch.randn(3, 5, 4, 12)[..., ::2]
        with pytest.raises(ValueError, match="x is not contiguous"):
            nft.batchnorm_add_relu(strided, z, weight, bias, rm, rv, training=False)
        with pytest.raises(ValueError, match="eps"):
            nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=False, eps=-1.0)
        with pytest.raises(TypeError, match="training"):
            nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=0)
        with pytest.raises(ValueError, match="shape"):
            nft.batchnorm_add_relu(x, z[:, :, :2].contiguous(), weight, bias, rm, rv,
                                   training=False)
        with pytest.raises(TypeError, match="float64"):
            nft.batchnorm_add_relu(x, z, weight, bias, rm.double(), rv, training=False)
        with pytest.raises(ValueError, match="requires grad"):
            nft.batchnorm_add_relu(x, z, weight, bias, rm.clone().requires_grad_(), rv,
                                   training=False)
    assert len(prepared.VALIDATED) == 1
    # recorded by autograd (grad enabled, Parameters requiring grad): the Function, checked
    y = nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=False)
    assert y.grad_fn is not None
    y.sum().backward()
    assert weight.grad is not None and len(prepared.VALIDATED) == 1


def test_the_signatures_kept_are_capped(monkeypatch):
    monkeypatch.setattr(prepared, "MAX_SIGNATURES", 2)
    with torch.no_grad():
        for n in (1, 2, 3):
            nft.batchnorm_add_relu(*_inputs(shape=(n, 5, 4, 6)), training=False)
    assert len(prepared.VALIDATED) == 2


def test_a_fused_model_in_eval_takes_the_prepared_calls(monkeypatch):
    """The BatchNormAddReLU2d module (and so fuse()'s block tails) in eval: one checked call,
    then prepared ones, the same outputs."""
    torch.manual_seed(0)
    m = nft.BatchNormAddReLU2d(5)
    with torch.no_grad():
        m.running_mean.normal_(), m.running_var.uniform_(0.5, 1.5)
    m.eval()
    x, z = torch.randn(3, 5, 4, 6), torch.randn(3, 5, 4, 6)
    with torch.no_grad():
        first = m(x, z)
        _checks_refused(monkeypatch)
        assert torch.equal(m(x, z), first)


def _train_calls(x, z, weight, bias, rm, rv, momentum=0.1):
    """A training call of batchnorm_add_relu recorded by autograd, and its backward."""
    x, z = x.clone().requires_grad_(), z.clone().requires_grad_()
    y = nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=True, momentum=momentum)
    (y * torch.linspace(-1, 2, y.numel(), dtype=y.dtype).view(y.shape)).sum().backward()
    grads = [t.grad.clone() for t in (x, z, weight, bias)]
    weight.grad = bias.grad = None
    return [y.detach(), rm.clone(), rv.clone()] + grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_training_batch_norm_checked_before_skips_its_checks(monkeypatch, dtype,
                                                               channels_last):
    """Training calls (recorded, and not: no_grad) whose signature passed the checks reuse
    what the checks gave: the same outputs, running statistics and gradients as checked."""
    first = _train_calls(*_inputs(dtype, channels_last))
    with torch.no_grad():
        first.append(nft.batchnorm_add_relu(*_inputs(dtype, channels_last)))
    assert len(prepared.CHECKED) == 2 and not prepared.VALIDATED
    _checks_refused(monkeypatch)
    again = _train_calls(*_inputs(dtype, channels_last))
    with torch.no_grad():
        again.append(nft.batchnorm_add_relu(*_inputs(dtype, channels_last)))
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert again[0].is_contiguous(memory_format=torch.channels_last) == channels_last


def test_momentum_is_checked_at_every_call_and_no_part_of_the_signature():
    x, z, weight, bias, rm, rv = _inputs()
    for momentum in (0.1, 0.5, 1.0 / 3):
        nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, momentum=momentum)
    assert len(prepared.CHECKED) == 1
    kept = rm.clone(), rv.clone()
    for bad, error in ((2.0, ValueError), (None, TypeError), (float("nan"), ValueError)):
        with pytest.raises(error, match="momentum"):
            nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, momentum=bad)
    assert torch.equal(rm, kept[0]) and torch.equal(rv, kept[1])     # nothing written
    with torch.no_grad():                       # inference: momentum unused, any value passes
        nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=False, momentum=2.0)
    # a module with the cumulative average (1/n each step): one signature, the statistics
    m = nft.BatchNormAddReLU2d(5, momentum=None)
    ref = torch.nn.BatchNorm2d(5, momentum=None)
    for _ in range(4):
        x, z = torch.randn(3, 5, 4, 6), torch.randn(3, 5, 4, 6)
        m(x, z), ref(x)
    assert len(prepared.CHECKED) == 2
    torch.testing.assert_close(m.running_mean, ref.running_mean)
    torch.testing.assert_close(m.running_var, ref.running_var)


# --------------------------------------------------------------------------- Conv-BatchNorm


@pytest.fixture
def fresh_checks(monkeypatch):
    monkeypatch.setattr(prepared, "CHECKED", {})


def _conv_inputs(channels_last=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 7, 6, generator=g, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 4, 4, 3, generator=g, dtype=torch.float64)
    weight = torch.nn.Parameter(torch.rand(4, generator=g, dtype=torch.float64) + 0.5)
    bias = torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    if channels_last:
        x, z = (t.contiguous(memory_format=torch.channels_last) for t in (x, z))
    return x, w, z, weight, bias, rm, rv


def _conv_calls(x, w, z, weight, bias, rm, rv, training):
    """Both Conv-BatchNorm functions (stride 2, padding 1), forward and backward."""
    kw = dict(stride=2, padding=1, training=training)
    y1 = nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, **kw)
    y2 = nft.conv_batchnorm_add_relu(x, w, z, weight, bias, rm, rv, **kw)
    (y1.sum() + y2.sum()).backward()
    grads = [t.grad.clone() for t in (w, weight, bias)]
    for t in (w, weight, bias):
        t.grad = None
    return [y1.detach(), y2.detach(), rm.clone(), rv.clone()] + grads


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_batchnorm_calls_checked_before_reuse_what_their_checks_returned(
        monkeypatch, fresh_checks, channels_last):
    from numbafuse.torch import conv_batchnorm
    for training in (True, False):
        args = _conv_inputs(channels_last)
        first = _conv_calls(*args, training)            # checked: two signatures kept
        assert len(prepared.CHECKED) == (2 if training else 4)
        args = _conv_inputs(channels_last)
        with monkeypatch.context() as m:
            m.setattr(conv_batchnorm, "check_tensors", lambda *a, **k: pytest.fail("checked"))
            again = _conv_calls(*args, training)
        for a, b in zip(first, again):
            assert torch.equal(a, b)                    # the same values, statistics, grads


def test_conv_batchnorm_calls_that_differ_are_checked(fresh_checks):
    x, w, z, weight, bias, rm, rv = _conv_inputs()
    nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, stride=2, padding=1)
    assert len(prepared.CHECKED) == 1
    kept = rm.clone()
    with pytest.raises(ValueError, match="momentum"):
        nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, stride=2, padding=1, momentum=2.0)
    assert torch.equal(rm, kept)
    nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, stride=2, padding=1, momentum=0.3)
    with pytest.raises(ValueError, match="eps"):
        nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, stride=2, padding=1, eps=-1.0)
    with pytest.raises(ValueError, match="x is not contiguous"):
        nft.conv_batchnorm_relu(torch.randn(2, 3, 7, 12, dtype=torch.float64)[..., ::2], w,
                                weight, bias, rm, rv, stride=2, padding=1)
    with pytest.raises(ValueError, match="requires grad"):
        nft.conv_batchnorm_relu(x, w, weight, bias, rm.clone().requires_grad_(), rv,
                                stride=2, padding=1)
    with pytest.raises(ValueError, match="z has shape"):
        nft.conv_batchnorm_add_relu(x, w, z, weight, bias, rm, rv, stride=1, padding=1)
    assert len(prepared.CHECKED) == 1
    # a list argument is not hashable: checked every time, and it runs
    y = nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, stride=[2, 2], padding=1)
    assert y.shape == (2, 4, 4, 3) and len(prepared.CHECKED) == 1


def _cbr_calls(x, w, b):
    """conv_bias_relu forward without grad and forward + backward (stride 2, padding 1)."""
    y0 = nft.conv_bias_relu(x.detach(), w.detach(), b.detach(), 2, 1)
    xg = x.detach().requires_grad_()
    y = nft.conv_bias_relu(xg, w, b, 2, 1)
    y.sum().backward()
    grads = [t.grad.clone() for t in (xg, w, b)]
    for t in (w, b):
        t.grad = None
    return [y0, y.detach()] + grads


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_bias_relu_calls_checked_before_reuse_what_their_checks_returned(
        monkeypatch, fresh_checks, channels_last):
    x, w, *_ = _conv_inputs(channels_last)
    b = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    first = _cbr_calls(x, w, b)                         # checked: two signatures kept
    assert len(prepared.CHECKED) == 2
    with monkeypatch.context() as m:
        m.setattr(layers, "check_tensors", lambda *a, **k: pytest.fail("checked"))
        m.setattr(layers.validate, "conv_geometry", lambda *a, **k: pytest.fail("checked"))
        again = _cbr_calls(x, w, b)
    for a, c in zip(first, again):
        assert torch.equal(a, c)
    ref = torch.nn.functional.conv2d(x, w.detach(), b.detach(), 2, 1).relu()
    torch.testing.assert_close(again[0], ref, rtol=1e-12, atol=1e-12)


def test_conv_bias_relu_calls_that_differ_are_checked(fresh_checks):
    x, w, *_ = _conv_inputs()
    b = torch.randn(4, dtype=torch.float64)
    nft.conv_bias_relu(x, w.detach(), b, 2, 1)
    assert len(prepared.CHECKED) == 1
    with pytest.raises(ValueError, match="b"):
        nft.conv_bias_relu(x, w.detach(), torch.randn(5, dtype=torch.float64), 2, 1)
    with pytest.raises(ValueError, match="x is not contiguous"):
        nft.conv_bias_relu(torch.randn(2, 3, 7, 12, dtype=torch.float64)[..., ::2], w.detach(),
                           b, 2, 1)
    with pytest.raises(ValueError, match="padding='same'"):
        nft.conv_bias_relu(x, w.detach(), b, 2, "same")
    with pytest.raises(TypeError, match="dtype|float"):
        nft.conv_bias_relu(x, w.detach().float(), b, 2, 1)
    assert len(prepared.CHECKED) == 1
    # a list argument is not hashable: checked every time, and it runs
    y = nft.conv_bias_relu(x, w.detach(), b, [2, 2], 1)
    assert y.shape == (2, 4, 4, 3) and len(prepared.CHECKED) == 1


def _eval_calls(x, w, z, weight, bias, rm, rv, relu, stride):
    kw = dict(stride=stride, padding=1, training=False, eps=1e-3)
    return (nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, relu=relu, **kw),
            nft.conv_batchnorm_add_relu(x, w, z, weight, bias, rm, rv, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("relu", [True, False])
def test_unrecorded_eval_conv_batchnorm_calls_compute_what_the_functions_do(
        dtype, channels_last, relu):
    """Eval calls autograd does not record run the ops layer's inference straight
    (``conv_batchnorm.inference``): the same bits as the Functions (a recorded call), the
    float64 reference's values, with and without the weight cache."""
    from numbafuse.torch import conv_batchnorm
    x, w, z, weight, bias, rm, rv = (t.detach().to(dtype) for t in _conv_inputs(channels_last))
    with torch.no_grad():
        rm.normal_(), rv.uniform_(0.5, 1.5)
    for stride in (2, 1):
        if stride == 1:                                    # z of the stride-1 conv's shape
            z = torch.randn(2, 4, 7, 6, dtype=dtype).contiguous(
                memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        with torch.no_grad():
            lean = _eval_calls(x, w, z, weight, bias, rm, rv, relu, stride)
            with nft.weight_cache():
                cached = [_eval_calls(x, w, z, weight, bias, rm, rv, relu, stride)
                          for _ in range(2)]
        recorded = _eval_calls(x, w.clone().requires_grad_(), z, weight, bias, rm, rv, relu,
                               stride)
        assert all(t.grad_fn is not None for t in recorded)         # the Functions ran
        assert all(t.grad_fn is None for t in lean)
        for a, b, c, d in zip(lean, recorded, *cached):
            assert torch.equal(a, b.detach()) and torch.equal(a, c) and torch.equal(a, d)
            assert a.is_contiguous(memory_format=torch.channels_last) == channels_last
        F = torch.nn.functional
        d = torch.float64
        h = F.batch_norm(F.conv2d(x.to(d), w.to(d), None, stride, 1), rm.to(d), rv.to(d),
                         weight.to(d), bias.to(d), False, 0.1, 1e-3)
        zz = z.to(d)
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        torch.testing.assert_close(lean[0].to(d), h.relu() if relu else h, rtol=tol, atol=tol)
        torch.testing.assert_close(lean[1].to(d), (h + zz).relu(), rtol=tol, atol=tol)
    assert conv_batchnorm.unrecorded_inference(x.device, False, (x, w)) == (not x.requires_grad)


@pytest.mark.parametrize("channels_last", [False, True])
def test_eval_conv_batchnorm_add_relu_runs_in_one_pass(monkeypatch, channels_last):
    """In eval, Conv-BN-Add-ReLU's batch norm and z go into the conv's epilogue
    (``cpu.forward_scaled``'s z) where its plan has one: the unrecorded call and the Function
    the same bits, y and the gradients (the ReLU mask packed from that y) those of the
    two-pass path (conv, then the batch norm's apply with z) to float64 rounding."""
    from numbafuse.kernels.conv import cpu as cpu_conv
    from numbafuse.ops import conv_batchnorm as ops_cbn
    real, residual = cpu_conv.forward_scaled, []

    def counted(x, w, values, geom, relu, z=None):
        residual.append(z is not None)
        return real(x, w, values, geom, relu, z)
    monkeypatch.setattr(cpu_conv, "forward_scaled", counted)
    x, w, _, weight, bias, rm, rv = _conv_inputs(channels_last)
    with torch.no_grad():
        rm.normal_(), rv.uniform_(0.5, 1.5)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    z = torch.randn(2, 4, 7, 6, dtype=torch.float64).contiguous(memory_format=fmt)
    gy = torch.randn(2, 4, 7, 6, dtype=torch.float64)

    def call():
        xg, zg = x.clone().requires_grad_(), z.clone().requires_grad_()
        y = nft.conv_batchnorm_add_relu(xg, w, zg, weight, bias, rm, rv, stride=1, padding=1,
                                        training=False, eps=1e-3)
        y.backward(gy)
        grads = [t.grad.clone() for t in (xg, zg, w, weight, bias)]
        for t in (w, weight, bias):
            t.grad = None
        return y.detach(), grads
    with torch.no_grad():
        lean = nft.conv_batchnorm_add_relu(x, w, z, weight, bias, rm, rv, stride=1, padding=1,
                                           training=False, eps=1e-3)
    y, grads = call()
    assert any(residual)                                        # the one pass ran
    assert torch.equal(lean, y)
    assert 0 < int((y > 0).sum()) < y.numel()                  # the gate matters
    monkeypatch.setattr(ops_cbn, "_inference_add", lambda *a: None)
    y2, grads2 = call()                                         # conv, then apply with z
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_eval_calls_recorded_or_in_half_run_the_functions(monkeypatch):
    from numbafuse.torch import conv_batchnorm
    monkeypatch.setattr(conv_batchnorm, "inference",
                        lambda *a, **k: pytest.fail("the inference path ran"))
    x, w, z, weight, bias, rm, rv = _conv_inputs()
    y = nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, training=False, padding=1)
    assert y.grad_fn is not None                        # w requires grad: recorded
    with torch.no_grad():                               # half: the Function's conversions
        nft.conv_batchnorm_relu(x.half(), w.half(), weight.float(), bias.float(), rm.float(),
                                rv.float(), training=False, padding=1)
        nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, training=True, padding=1)


@pytest.mark.parametrize("kernel, size", [(1, 5), (3, 1)])
def test_unrecorded_eval_calls_fold_anew_when_the_batch_norm_changes(kernel, size):
    """A 1x1 conv's eval folds the batch norm into w (the pointwise plan has no epilogue
    scale), and so does a 3x3 on 1x1 maps (run as its center tap's 1x1: cpu_first._crop);
    under the weight cache, the folded (cropped) w is kept while w and the batch norm's
    tensors keep their versions, and an in-place change of any of them folds again."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, size, size, generator=g)
    w = torch.randn(4, 6, kernel, kernel, generator=g)
    weight, bias = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g)
    rm, rv = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    with torch.no_grad(), nft.weight_cache():
        for t in (None, weight, bias, rm, rv, w):
            if t is not None:
                t.mul_(1.5)                                 # in place: a new version
            y = nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, training=False,
                                        padding=kernel // 2)
            F = torch.nn.functional
            ref = F.batch_norm(F.conv2d(x, w, padding=kernel // 2), rm, rv, weight, bias,
                               False).relu()
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_the_cpu_batch_norm_function_runs_what_the_ops_forward_runs(dtype, channels_last,
                                                                   training):
    """BatchNormAddReLUFunction on CPU float32/float64 tensors calls the kernels straight
    (``ops.batchnorm.cpu_forward``): the same y, mask, mean, invstd and running statistics,
    bit for bit, as ``ops.batchnorm.forward`` (the generic path, its params and checks) on the
    same arrays."""
    from numbafuse import ops
    from numbafuse.torch import bridge
    x, z, weight, bias, rm, rv = _inputs(dtype, channels_last)
    layout = bridge.layout_of(x)
    rm2, rv2 = rm.clone(), rv.clone()
    xg = x.clone().requires_grad_()
    y = nft.batchnorm_add_relu(xg, z, weight, bias, rm, rv, training=training, momentum=0.3,
                               eps=1e-3)
    saved = y.grad_fn.saved_tensors                       # x, weight, mean, invstd, mask
    p = ops.batchnorm.BatchNormParams(running_mean=rm2.numpy(), running_var=rv2.numpy(),
                                      training=training, momentum=0.3, eps=1e-3, layout=layout,
                                      comm=None)
    out = ops.batchnorm.forward("t", bridge.as_array(x, layout), bridge.as_array(z, layout),
                                weight.detach().numpy(), bias.detach().numpy(), p, relu=True,
                                with_mask=True, save="mask")
    assert np.array_equal(bridge.as_array(y, layout), out.y)
    for t, a in zip(saved[2:], (out.mean, out.invstd, out.mask)):
        assert np.array_equal(t.numpy(), a)
    assert torch.equal(rm, rm2) and torch.equal(rv, rv2)
    assert training == (not torch.equal(rm, _inputs(dtype)[4]))   # updated in training only
