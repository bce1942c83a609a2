"""numbafuse.torch with grouped/depthwise convs, channels_last tensors, and the Conv-BatchNorm
modules with ``dtype=``/``device=``.

References: torch's own layers in float64 (``F.conv2d``, ``F.batch_norm``, ``nn.Conv2d`` +
``nn.BatchNorm2d``), which are independent of numbafuse's kernels: values, the gradients of
every input, the running statistics (1e-10). channels_last: the output and dx keep the memory
format, and numbafuse's kernels read the input's own memory (no copy). Skipped where torch is
not installed.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                                            "'numbafuse[torch]'); .ci/run's torch leg has it")
nn, F = torch.nn, torch.nn.functional

from numbafuse import kernels  # noqa: E402
import numbafuse.ops.conv as ops_conv  # noqa: E402
import numbafuse.torch as nft  # noqa: E402

pytestmark = pytest.mark.torch

F64 = dict(rtol=1e-10, atol=1e-10)
CL = torch.channels_last
FORMATS = [torch.contiguous_format, CL]
# (C, K, groups, stride, padding): grouped, depthwise, depthwise x2 multiplier, stride 2
GEOMETRIES = [(4, 6, 2, 1, 1), (4, 4, 4, 2, 1), (3, 6, 3, 1, (1, 0))]


def _t(*shape, fmt=torch.contiguous_format, seed=0, grad=True, lo=None):
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(*shape, dtype=torch.float64, generator=g) + lo if lo is not None
         else torch.randn(*shape, dtype=torch.float64, generator=g))
    if len(shape) == 4:
        t = t.contiguous(memory_format=fmt)
    return t.requires_grad_(grad)


def _grads(y, inputs, seed=9):
    dy = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(y, inputs, dy)


def _check_format(t, fmt):
    assert t.is_contiguous(memory_format=fmt), (fmt, t.stride())


def _assert_all_close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("fmt", FORMATS, ids=["nchw", "channels_last"])
@pytest.mark.parametrize("C, K, groups, stride, padding", GEOMETRIES)
def test_conv_bias_relu_groups_and_formats(fmt, C, K, groups, stride, padding):
    x, w, b = _t(2, C, 7, 6, fmt=fmt), _t(K, C // groups, 3, 3, seed=1), _t(K, seed=2)
    y = nft.conv_bias_relu(x, w, b, stride, padding, 1, groups)
    want = F.conv2d(x, w, b, stride, padding, 1, groups).relu()
    torch.testing.assert_close(y, want, **F64)
    _check_format(y, fmt)
    got, ref = _grads(y, (x, w, b)), _grads(want, (x, w, b))
    _assert_all_close(got, ref)
    _check_format(got[0], fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=["nchw", "channels_last"])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_add_relu_formats(fmt, training):
    x, z = _t(2, 3, 5, 4, fmt=fmt), _t(2, 3, 5, 4, fmt=fmt, seed=1)
    weight, bias = _t(3, seed=2, lo=0.5), _t(3, seed=3)
    stats = [_t(3, seed=4, grad=False), _t(3, seed=5, grad=False, lo=0.5)]
    ref_stats = [s.clone() for s in stats]
    y = nft.batchnorm_add_relu(x, z, weight, bias, *stats, training, 0.1, 1e-5)
    want = (F.batch_norm(x, *ref_stats, weight, bias, training, 0.1, 1e-5) + z).relu()
    torch.testing.assert_close(y, want, **F64)
    _assert_all_close(stats, ref_stats)
    _check_format(y, fmt)
    got, ref = _grads(y, (x, z, weight, bias)), _grads(want, (x, z, weight, bias))
    _assert_all_close(got, ref)
    _check_format(got[0], fmt)
    _check_format(got[1], fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=["nchw", "channels_last"])
@pytest.mark.parametrize("C, K, groups, stride, padding", GEOMETRIES)
@pytest.mark.parametrize("kind", ["relu", "bn", "add_relu"])
def test_conv_batchnorm_groups_and_formats(fmt, C, K, groups, stride, padding, kind):
    """Training (running statistics updated) and inference (folded), values and gradients."""
    x, w = _t(2, C, 7, 6, fmt=fmt), _t(K, C // groups, 3, 3, seed=1)
    weight, bias = _t(K, seed=2, lo=0.5), _t(K, seed=3)
    for training in (True, False):
        stats = [_t(K, seed=4, grad=False), _t(K, seed=5, grad=False, lo=0.5)]
        ref_stats = [s.clone() for s in stats]
        conv = dict(stride=stride, padding=padding, dilation=1, groups=groups)
        want = F.batch_norm(F.conv2d(x, w, None, **conv), *ref_stats, weight, bias, training,
                            0.1, 1e-5)
        inputs = [x, w, weight, bias]
        if kind == "add_relu":
            z = _t(*want.shape, fmt=fmt, seed=6)
            inputs.insert(2, z)
            y = nft.conv_batchnorm_add_relu(x, w, z, weight, bias, *stats, training, 0.1, 1e-5,
                                            **conv)
            want = (want + z).relu()
        else:
            y = nft.conv_batchnorm_relu(x, w, weight, bias, *stats, training, 0.1, 1e-5,
                                        relu=kind == "relu", **conv)
            want = want.relu() if kind == "relu" else want
        torch.testing.assert_close(y, want, **F64)
        _assert_all_close(stats, ref_stats)
        _check_format(y, fmt)
        got, ref = _grads(y, inputs), _grads(want, inputs)
        _assert_all_close(got, ref)
        _check_format(got[0], fmt)


def test_channels_last_is_read_and_returned_without_a_copy(monkeypatch):
    """The arrays numbafuse's kernels get are NHWC views of the tensors' own memory, and the
    tensors returned are views of the kernels' outputs (data pointers equal)."""
    seen = {}
    bn_kernels = kernels.batchnorm_kernels("cpu")
    conv_forward, bn_apply = ops_conv.conv_forward, bn_kernels.apply

    def spy_conv(x, w, b, geometry, relu):
        y = conv_forward(x, w, b, geometry, relu)
        seen["conv"] = (x.ctypes.data, geometry.layout, y.ctypes.data)
        return y

    def spy_apply(h, mean, invstd, gamma, beta, z, relu, layout, want_mask):
        out = bn_apply(h, mean, invstd, gamma, beta, z, relu, layout, want_mask)
        seen["apply"] = (h.ctypes.data, layout, out[0].ctypes.data)
        return out

    monkeypatch.setattr(ops_conv, "conv_forward", spy_conv)
    monkeypatch.setattr(bn_kernels, "apply", spy_apply)
    x = _t(2, 4, 6, 6, fmt=CL)
    w, b = _t(4, 1, 3, 3, seed=1), _t(4, seed=2)
    y = nft.conv_bias_relu(x, w, b, 1, 1, 1, 4)
    assert seen["conv"] == (x.data_ptr(), "NHWC", y.data_ptr())
    y2 = nft.batchnorm_add_relu(y, y.detach(), _t(4, seed=3), _t(4, seed=4))
    assert seen["apply"] == (y.data_ptr(), "NHWC", y2.data_ptr())
    seen.clear()
    nft.conv_bias_relu(x.contiguous(), w, b, 1, 1, 1, 4)
    assert seen["conv"][1] == "NCHW"


def test_a_channels_last_weight_and_a_residual_in_the_other_format():
    """``model.to(memory_format=channels_last)`` makes conv weights channels_last too; a
    residual z in the other format than x is read through a copy: same results."""
    x, w = _t(2, 4, 5, 5, fmt=CL), _t(6, 4, 3, 3, seed=1).contiguous(memory_format=CL)
    weight, bias = _t(6, seed=2, lo=0.5), _t(6, seed=3)
    z = _t(2, 6, 5, 5, seed=4)                                  # NCHW residual
    y = nft.conv_batchnorm_add_relu(x, w, z, weight, bias, padding=1)
    want = (F.batch_norm(F.conv2d(x, w, None, 1, 1), None, None, weight, bias, True) + z).relu()
    torch.testing.assert_close(y, want, **F64)
    _check_format(y, CL)
    _assert_all_close(_grads(y, (x, w, z)), _grads(want, (x, w, z)))


@pytest.mark.parametrize("op", ["conv_bias_relu", "conv_batchnorm_relu",
                                "conv_batchnorm_add_relu"])
def test_a_channels_last_weight_gets_its_gradient_channels_last(op):
    """A channels_last weight (3x3; 5 and 12 channels: 8 x 8 tiles and their rest) is read as
    NCHW by the tiled copy (``bridge._from_channels_last``: the bytes of ``w.contiguous()``)
    and its gradient comes back in its strides (``as_weight_grad``), so autograd stores it
    without a copy; the values as with a contiguous weight. A 1x1's formats are one: its
    gradient as computed."""
    from numbafuse.torch import bridge
    for C, K, k in ((5, 12, 3), (12, 5, 3), (4, 6, 1)):
        w32 = torch.randn(K, C, k, k).contiguous(memory_format=CL)
        assert np.array_equal(bridge.as_array(w32), w32.contiguous().numpy())
        dw = np.random.default_rng(0).standard_normal((K, C, k, k))
        for w_ in (w32, w32.contiguous()):
            g = bridge.as_weight_grad(dw, w_, w_.device)
            assert np.array_equal(g.numpy(), dw)
            assert g.stride() == w_.stride() or k == 1
        x = _t(2, C, 6, 5, fmt=CL)
        z = _t(2, K, 6, 5, seed=4, fmt=CL)
        grads = {}
        for fmt in FORMATS:
            w = _t(K, C, k, k, seed=1).detach().contiguous(memory_format=fmt).requires_grad_()
            weight, bias = _t(K, seed=2, lo=0.5), _t(K, seed=3)
            if op == "conv_bias_relu":
                y = nft.conv_bias_relu(x, w, bias, 1, k // 2)
            elif op == "conv_batchnorm_relu":
                y = nft.conv_batchnorm_relu(x, w, weight, bias, padding=k // 2)
            else:
                y = nft.conv_batchnorm_add_relu(x, w, z, weight, bias, padding=k // 2)
            y.backward(torch.randn(y.shape, dtype=y.dtype,
                                   generator=torch.Generator().manual_seed(7)))
            assert w.grad.is_contiguous(memory_format=fmt)
            grads[fmt] = w.grad
        torch.testing.assert_close(grads[CL], grads[torch.contiguous_format], rtol=0, atol=0)


# --------------------------------------------------------------------------- modules

MODULES = [(nft.ConvBatchNormReLU2d, True, False), (nft.ConvBatchNorm2d, False, False),
           (nft.ConvBatchNormAddReLU2d, True, True)]


def _reference(fused):
    """torch's Conv2d + BatchNorm2d with fused's state (a deep copy of its modules)."""
    import copy
    return copy.deepcopy(fused.conv), copy.deepcopy(fused.bn)


@pytest.mark.parametrize("cls, relu, add", MODULES, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("fmt", FORMATS, ids=["nchw", "channels_last"])
def test_conv_batchnorm_modules_match_torch(cls, relu, add, fmt):
    """Depthwise stride 2 (MobileNet's Conv(dw)-BN-ReLU), two training steps and eval, with
    momentum=None on one: values, gradients, parameters' grads, running statistics."""
    torch.manual_seed(0)
    m = cls(6, 6, 3, stride=2, padding=1, groups=6, momentum=None, dtype=torch.float64)
    assert list(m.state_dict()) == ["conv.weight", "bn.weight", "bn.bias", "bn.running_mean",
                                    "bn.running_var", "bn.num_batches_tracked"]
    assert isinstance(m.bn, nn.BatchNorm2d) and m.conv.weight.dtype == torch.float64
    with torch.no_grad():
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    conv, bn = _reference(m)
    x = _t(2, 6, 7, 7, fmt=fmt)
    z = _t(2, 6, 4, 4, fmt=fmt, seed=1)
    for training in (True, True, False):
        m.train(training)
        bn.train(training)
        args = (x, z) if add else (x,)
        y = m(*args)
        want = bn(conv(x))
        want = want + z if add else want
        want = want.relu() if relu else want
        torch.testing.assert_close(y, want, **F64)
        _check_format(y, fmt)
        params = [x, m.conv.weight, m.bn.weight, m.bn.bias]
        ref_params = [x, conv.weight, bn.weight, bn.bias]
        _assert_all_close(_grads(y, params), _grads(want, ref_params))
        for key, value in bn.state_dict().items():
            torch.testing.assert_close(m.bn.state_dict()[key], value, **F64, msg=key)


def test_from_modules_shares_and_checks():
    conv, bn = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(4)
    m = nft.ConvBatchNormReLU2d.from_modules(conv, bn)
    assert m.conv is conv and m.bn is bn
    m(torch.randn(2, 4, 5, 5))
    assert int(bn.num_batches_tracked) == 1
    with pytest.raises(TypeError, match="ConvBatchNormReLU2d.from_modules: conv must be"):
        nft.ConvBatchNormReLU2d.from_modules(nn.Conv2d(4, 4, 3), bn)
    with pytest.raises(TypeError, match="ConvBatchNorm2d.from_modules: bn must be"):
        nft.ConvBatchNorm2d.from_modules(conv, nn.BatchNorm2d(5))


@pytest.mark.parametrize("make", [
    lambda **kw: nft.ConvBiasReLU2d(4, 4, 3, groups=2, **kw),
    lambda **kw: nft.BatchNormAddReLU2d(4, **kw),
    lambda **kw: nft.ConvBatchNormReLU2d(4, 4, 3, groups=4, **kw),
    lambda **kw: nft.ConvBatchNorm2d(4, 8, 1, **kw),
    lambda **kw: nft.ConvBatchNormAddReLU2d(4, 4, 3, **kw)])
def test_modules_take_dtype_and_device(make):
    name = type(make()).__name__
    m = make(dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in m.parameters())
    assert all(b.dtype in (torch.float64, torch.int64) for b in m.buffers())
    with pytest.raises(TypeError, match=f"{name}: dtype must be torch.float32 or torch.float64 "
                                        r"\(or torch.float16.*\), got torch.int32"):
        make(dtype=torch.int32)
    assert all(p.dtype == torch.float16 for p in make(dtype=torch.float16).parameters())
    with pytest.raises(ValueError, match=f"{name}: device 'mps': numbafuse runs on 'cpu' and "
                                         f"'cuda'"):
        make(device="mps")
    with pytest.raises(ValueError, match=f"{name}: device 'nonsense' is not a torch device"):
        make(device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=f"{name}: device 'cuda': this torch has no CUDA"):
            make(device="cuda")


def test_conv_bias_relu2d_groups_has_torchs_weight_shape_and_init():
    torch.manual_seed(3)
    ours = nft.ConvBiasReLU2d(4, 6, 3, padding=1, groups=2)
    torch.manual_seed(3)
    theirs = nn.Conv2d(4, 6, 3, padding=1, groups=2)
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.bias, theirs.bias, rtol=0, atol=0)
    x = torch.randn(2, 4, 5, 5).contiguous(memory_format=CL)
    torch.testing.assert_close(ours(x), theirs(x).relu(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="ConvBiasReLU2d: groups=3 must divide"):
        nft.ConvBiasReLU2d(4, 6, 3, groups=3)


# --------------------------------------------------------------------------- fuse

class MobileNetBlock(nn.Module):
    """MobileNet v2's inverted residual: 1x1 expand, 3x3 depthwise, 1x1 project, + x."""

    def __init__(self, C=4, t=2):
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(C, C * t, 1, bias=False), nn.BatchNorm2d(C * t),
                                    nn.ReLU(inplace=True))
        self.dw = nn.Sequential(nn.Conv2d(C * t, C * t, 3, padding=1, groups=C * t, bias=False),
                                nn.BatchNorm2d(C * t), nn.ReLU(inplace=True))
        self.project = nn.Conv2d(C * t, C, 1, bias=False)
        self.bn = nn.BatchNorm2d(C)
        self.grouped = nn.Conv2d(C, C, 3, padding=1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(C)

    def forward(self, x):
        out = self.bn(self.project(self.dw(self.expand(x))))     # Conv-BN, no ReLU
        return torch.relu(self.bn2(self.grouped(out)) + x)       # grouped Conv-BN-Add-ReLU


@pytest.mark.parametrize("fmt", FORMATS, ids=["nchw", "channels_last"])
def test_fuse_mobilenet_block_groups_and_channels_last(fmt):
    from .test_torch_fuse import _assert_same
    torch.manual_seed(0)
    model = MobileNetBlock().double()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    model = model.to(memory_format=fmt)
    fused = nft.fuse(model)
    assert [line.split(":")[0] for line in fused.fuse_log] == [
        "Fuse Conv2d with BatchNorm2d, add and ReLU", "Fuse Conv2d with BatchNorm2d",
        "Fuse Conv2d with BatchNorm2d and ReLU", "Fuse Conv2d with BatchNorm2d and ReLU"], \
        fused.fuse_log
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64).contiguous(memory_format=fmt)
    _check_format(fused(x), fmt)
    _assert_same(model, fused, x)


def test_fuse_makes_its_convs_weights_contiguous_and_leaves_the_rest():
    """A channels_last model: fuse gives the weights of the convs it fuses torch's default
    format in place (the same Parameter objects and values; numbafuse's kernels read (K, C,
    R, S), a channels_last weight was copied at every call), and a conv it refuses (here one
    with padding_mode="reflect", which PyTorch runs) keeps channels_last."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                          nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),
                          nn.ReLU()).double().to(memory_format=CL)
    params = [p.detach().clone() for p in model.parameters()]
    fused = nft.fuse(model)
    assert any(line.startswith("refused") for line in fused.fuse_log), fused.fuse_log
    w_fused, w_refused = fused.get_submodule("0").weight, fused.get_submodule("3").weight
    assert w_fused.is_contiguous()
    assert not w_refused.is_contiguous() and w_refused.is_contiguous(memory_format=CL)
    for a, b in zip(fused.parameters(), params):
        assert torch.equal(a, b)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=CL)
    torch.testing.assert_close(fused(x), model(x), **F64)     # (model: the original, unfused)


def test_torch_compile_keeps_channels_last_and_groups():
    """aot_eager runs the custom ops' fake rules: the compiled graph's outputs have the real
    ops' shapes and memory format, and the values and gradients are the eager ones."""
    torch._dynamo.reset()
    x = _t(2, 4, 6, 6, fmt=CL)
    w, weight, bias = _t(4, 1, 3, 3, seed=1), _t(4, seed=2, lo=0.5), _t(4, seed=3)

    def fn(x, w, weight, bias):
        return nft.conv_batchnorm_relu(x, w, weight, bias, stride=2, padding=1, groups=4)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    y = compiled(x, w, weight, bias)
    want = fn(x, w, weight, bias)
    torch.testing.assert_close(y, want, **F64)
    _check_format(y, CL)
    _assert_all_close(_grads(y, (x, w, weight, bias)), _grads(want, (x, w, weight, bias)))
    assert np.isfinite(y.detach().numpy()).all()


def _op_cases():
    x = _t(2, 4, 6, 6, fmt=CL, grad=False)
    w, weight, bias = _t(4, 1, 3, 3, seed=1, grad=False), _t(4, seed=2, lo=0.5), _t(4, seed=3)
    weight, bias = weight.detach(), bias.detach()
    stats = [_t(4, seed=4, grad=False), _t(4, seed=5, grad=False, lo=0.5)]
    conv = [2, 2, 1, 1, 1, 1, 1, 1, 4]             # stride 2, padding 1, dilation 1, groups 4
    z = _t(2, 4, 3, 3, fmt=CL, seed=6, grad=False)
    ops = torch.ops.numbafuse
    return [(ops.conv_bias_relu.default, (x, w, bias, conv)),
            (ops.batchnorm_add_relu.default, (x, x.clone(), weight, bias, *stats, False, 1e-5)),
            (ops.conv_batchnorm_relu.default, (x, w, weight, bias, *stats, False, 1e-5, conv,
                                               True)),
            (ops.conv_batchnorm_add_relu.default, (x, w, z, weight, bias, *stats, False, 1e-5,
                                                   conv))]


@pytest.mark.parametrize("case", range(4))
def test_custom_ops_fake_rules_match_the_real_ops_for_channels_last(case):
    """Each op's fake rule gives the real op's shapes, dtypes and strides (channels_last
    outputs) on a channels_last depthwise stride-2 problem (``torch.library.opcheck``)."""
    op, args = _op_cases()[case]
    torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_schema"))
    real = op(*args)
    real = real if isinstance(real, tuple) else (real,)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    fake = fake if isinstance(fake, tuple) else (fake,)
    for r, f in zip(real, fake):
        assert (tuple(r.shape), r.stride(), r.dtype) == (tuple(f.shape), f.stride(), f.dtype)


def test_cuda_branch_views_channels_last_as_nhwc(monkeypatch):
    """No GPU here: a fake CUDA tensor in channels_last goes to ``backend.as_device_array`` as
    its contiguous NHWC view (the same memory), and an NHWC device array comes back through
    ``torch.as_tensor`` permuted to (N, C, H, W) channels_last."""
    from .test_torch import FakeCudaTensor
    seen = []
    monkeypatch.setattr(nft.backend, "as_device_array", lambda t: seen.append(t) or "device")
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=CL)
    fake = x.as_subclass(FakeCudaTensor)
    assert nft.as_array(fake, "NHWC") == "device"
    view = seen[0]
    assert view.shape == (2, 4, 5, 3) and view.is_contiguous()
    assert view.data_ptr() == x.data_ptr()
    nhwc = torch.randn(2, 4, 5, 3)
    monkeypatch.setattr(nft.torch, "as_tensor", lambda a, device: nhwc)
    back = nft.as_tensor(object(), torch.device("cuda", 0), "NHWC")
    assert back.shape == (2, 3, 4, 5) and back.is_contiguous(memory_format=CL)
    assert back.data_ptr() == nhwc.data_ptr()


def test_fuse_resnext_grouped_bottlenecks():
    """torchvision's ResNeXt code (numbafuse.torch.resnet, groups=4, width_per_group=16, tiny
    widths): every conv and batch norm fused, grouped 3x3 convs included; the fused model
    computes what the model computes (float64, 2 training steps and eval)."""
    from .test_torch_fuse import _assert_same
    torch.manual_seed(0)
    model = nft.ResNet(nft.Bottleneck, [1, 1], num_classes=3, groups=4, width_per_group=16,
                       width=8).double()
    assert model.layer1[0].conv2.groups == 4 and model.layer1[0].conv2.in_channels == 8
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    fused = nft.fuse(model)
    assert not any(line.startswith("refused") for line in fused.fuse_log)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert sum(line.startswith("Fuse Conv2d") for line in fused.fuse_log) == convs
    _assert_same(model, fused, torch.randn(2, 3, 16, 16, dtype=torch.float64))
    assert nft.resnext50_32x4d().layer1[0].conv2.groups == 32
