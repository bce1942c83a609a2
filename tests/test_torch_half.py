"""numbafuse.torch in half precision: float16 tensors (bfloat16 on the CPU, with or without
``ml_dtypes``: numbafuse/torch/bfloat16.py) in and out, float32 arithmetic inside, batch-norm
parameters and running statistics float32 (autocast's) or the input's dtype, as PyTorch takes
them.

References: torch's own layers in float64 on the same half inputs (independent of numbafuse's
kernels); each result within the half dtype's tolerance (``tests/harness.py``'s ``TOL``). The
gradient references read the ReLU mask from numbafuse's own rounded y: a value rounded near 0
may have the other sign in float64, which is no error of the gradient.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                                            "'numbafuse[torch]'); .ci/run's torch leg has it")
F = torch.nn.functional

import numbafuse.torch as nft  # noqa: E402

from .harness import BF16_TOL, TOL  # noqa: E402

pytestmark = pytest.mark.torch

CL = torch.channels_last
HALF = [torch.float16, torch.bfloat16]     # bfloat16 with or without ml_dtypes (CPU)


def _t(*shape, dtype=torch.float16, seed=0, scale=1.0, lo=None, fmt=torch.contiguous_format):
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(*shape, dtype=torch.float64, generator=g) + lo if lo is not None
         else torch.randn(*shape, dtype=torch.float64, generator=g) * scale)
    t = t.to(dtype)
    return (t.contiguous(memory_format=fmt) if t.dim() == 4 else t).requires_grad_()


def _f64(t):
    return t.detach().double().requires_grad_()


def _close(got, want, dtype, what):
    assert got.dtype == dtype, f"{what} is {got.dtype}, expected {dtype}"
    tol = TOL[np.dtype(nft.bridge.NUMPY_DTYPES[dtype])] if dtype in nft.bridge.NUMPY_DTYPES \
        else BF16_TOL                                          # bfloat16 without ml_dtypes
    torch.testing.assert_close(got.double(), want.detach().double(), **tol, msg=what)


def _dy(y, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(y.shape, dtype=torch.float64, generator=g).to(y.dtype)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, CL], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_conv_bias_relu_half(dtype, fmt):
    x, w, b = _t(2, 3, 7, 6, dtype=dtype, fmt=fmt), _t(4, 3, 3, 3, dtype=dtype, seed=1,
                                                          scale=0.3), _t(4, dtype=dtype, seed=2)
    y = nft.conv_bias_relu(x, w, b, 1, 1)
    assert y.is_contiguous(memory_format=fmt)
    x64, w64, b64 = _f64(x), _f64(w), _f64(b)
    pre = F.conv2d(x64, w64, b64, 1, 1)
    _close(y, pre.relu(), dtype, "y")
    dy = _dy(y)
    want = torch.autograd.grad(pre, (x64, w64, b64), dy.double() * (y.detach() > 0))
    got = torch.autograd.grad(y, (x, w, b), dy)
    for g, e, name in zip(got, want, ("dx", "dw", "db")):
        _close(g, e, dtype, name)


@pytest.mark.parametrize("params", ["float32", "same"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_batchnorm_add_relu_half(dtype, params):
    pdtype = torch.float32 if params == "float32" else dtype
    x, z = _t(3, 4, 5, 6, dtype=dtype), _t(3, 4, 5, 6, dtype=dtype, seed=1)
    weight, bias = _t(4, dtype=pdtype, seed=2, lo=0.5), _t(4, dtype=pdtype, seed=3)
    rm, rv = torch.zeros(4, dtype=pdtype), torch.ones(4, dtype=pdtype)
    y = nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, momentum=0.25)
    rm64, rv64 = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    x64, z64, w64, b64 = _f64(x), _f64(z), _f64(weight), _f64(bias)
    pre = F.batch_norm(x64, rm64, rv64, w64, b64, True, 0.25) + z64
    _close(y, pre.relu(), dtype, "y")
    _close(rm, rm64, pdtype, "running_mean")
    _close(rv, rv64, pdtype, "running_var")
    dy = _dy(y)
    want = torch.autograd.grad(pre, (x64, z64, w64, b64), dy.double() * (y.detach() > 0))
    got = torch.autograd.grad(y, (x, z, weight, bias), dy)
    for g, e, t, name in zip(got, want, (x, z, weight, bias), ("dx", "dz", "dweight", "dbias")):
        _close(g, e, t.dtype, name)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_conv_batchnorm_relu_half(dtype):
    """Float32 parameters and running statistics, as under autocast; recomputed in backward."""
    x, w = _t(2, 3, 6, 6, dtype=dtype), _t(5, 3, 3, 3, dtype=dtype, seed=1, scale=0.3)
    weight, bias = _t(5, dtype=torch.float32, seed=2, lo=0.5), _t(5, dtype=torch.float32,
                                                                  seed=3)
    rm, rv = torch.zeros(5), torch.ones(5)
    y = nft.conv_batchnorm_relu(x, w, weight, bias, rm, rv, padding=1)
    rm64, rv64 = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    x64, w64, g64, b64 = _f64(x), _f64(w), _f64(weight), _f64(bias)
    pre = F.batch_norm(F.conv2d(x64, w64, None, 1, 1), rm64, rv64, g64, b64, True)
    _close(y, pre.relu(), dtype, "y")
    _close(rm, rm64, torch.float32, "running_mean")
    dy = _dy(y)
    want = torch.autograd.grad(pre, (x64, w64, g64, b64), dy.double() * (y.detach() > 0))
    got = torch.autograd.grad(y, (x, w, weight, bias), dy)
    for g, e, t, name in zip(got, want, (x, w, weight, bias), ("dx", "dw", "dweight", "dbias")):
        _close(g, e, t.dtype, name)


def test_modules_run_in_half():
    """``module.half()`` (parameters and buffers float16) runs; outputs and grads float16."""
    for m, args in ((nft.ConvBiasReLU2d(3, 4, 3, padding=1), (_t(2, 3, 5, 5),)),
                    (nft.ConvBatchNormReLU2d(3, 4, 3, padding=1), (_t(2, 3, 5, 5, fmt=CL),)),
                    (nft.BatchNormAddReLU2d(3), (_t(2, 3, 4, 4), _t(2, 3, 4, 4, seed=1)))):
        m = m.half()
        y = m(*args)
        assert y.dtype == torch.float16
        y.float().sum().backward()
        assert all(p.grad.dtype == torch.float16 for p in m.parameters())
        assert all(b.dtype in (torch.float16, torch.int64) for b in m.buffers())
    m = nft.ConvBiasReLU2d(3, 4, 3, dtype=torch.float16)
    assert m.weight.dtype == torch.float16


@pytest.mark.parametrize("call, match", [
    (lambda: nft.conv_bias_relu(torch.randn(2, 3, 4, 4).half(), torch.randn(4, 3, 3, 3)),
     "w is torch.float32 but x is torch.float16"),
    (lambda: nft.batchnorm_add_relu(torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4),
                                    torch.ones(3).half(), torch.zeros(3)),
     "weight is torch.float16 but x is torch.float32"),
    (lambda: nft.batchnorm_add_relu(torch.randn(2, 3, 4, 4).half(),
                                    torch.randn(2, 3, 4, 4).half(), torch.ones(3).half(),
                                    torch.zeros(3)),
     "bias is torch.float32 but weight is torch.float16; batch-norm parameters"),
    (lambda: nft.batchnorm_add_relu(torch.randn(2, 3, 4, 4).half(),
                                    torch.randn(2, 3, 4, 4).half(), torch.ones(3).double(),
                                    torch.zeros(3).double()),
     r"weight is torch.float64 but x is torch.float16; .* \(or, for the batch-norm "),
    (lambda: nft.conv_bias_relu(torch.randn(2, 3, 4, 4).bfloat16(), torch.randn(4, 3, 3, 3)),
     "w is torch.float32 but x is torch.bfloat16"),
    (lambda: nft.conv_batchnorm_relu(torch.randn(2, 3, 4, 4).bfloat16(),
                                     torch.randn(4, 3, 3, 3).bfloat16(), torch.ones(4),
                                     torch.zeros(4).bfloat16()),
     "bias is torch.bfloat16 but weight is torch.float32; batch-norm parameters"),
    (lambda: nft.conv_bias_relu(torch.zeros(2, 3, 4, 4, dtype=torch.int32),
                                torch.zeros(4, 3, 3, 3, dtype=torch.int32)),
     "x must be float32 or float64 .*got torch.int32")])
def test_mixed_dtypes_are_refused_as_pytorch_refuses_them(call, match):
    with pytest.raises(TypeError, match=match):
        call()


@pytest.fixture(params=["as installed", "without ml_dtypes"])
def bf16_path(request, monkeypatch):
    """bfloat16 as this install runs it, and as it runs without ml_dtypes (NumPy without a
    bfloat16 dtype: torch's float32 copies, numbafuse/torch/bfloat16.py): the same where
    ml_dtypes is not installed, as in CI."""
    if request.param == "without ml_dtypes":
        monkeypatch.setattr(nft.bfloat16, "NUMPY_BF16", None)
    return request.param


def _rounded_once(call, tensors):
    """(y, grads) of ``call`` on float32 copies of the bfloat16 ``tensors`` (float32 ones
    as they are), each rounded to bfloat16 once: what a bfloat16 call must give."""
    wide = [t.detach().float().requires_grad_() if t.dtype == torch.bfloat16 else
            t.detach().clone().requires_grad_() for t in tensors]
    y = call(*wide)
    grads = torch.autograd.grad(y, wide, _dy(y).bfloat16().float())
    return y.detach().bfloat16(), [g.to(t.dtype) for g, t in zip(grads, tensors)]


def test_bfloat16_conv_bias_relu(bf16_path):
    """The issue's call (depthwise, no bias): y, dx, dw in bfloat16, bit for bit numbafuse's
    float32 results rounded once, and within bfloat16's TOL of torch's float64 conv."""
    x, w = _t(2, 4, 6, 6, dtype=torch.bfloat16), _t(4, 1, 3, 3, dtype=torch.bfloat16, seed=1)
    y = nft.conv_bias_relu(x, w, None, 1, 1, 1, 4)
    assert y.dtype == torch.bfloat16
    dx, dw = torch.autograd.grad(y, (x, w), _dy(y))
    want_y, want_grads = _rounded_once(lambda a, b: nft.conv_bias_relu(a, b, None, 1, 1, 1, 4),
                                       (x, w))
    for got, want, name in zip((y, dx, dw), [want_y] + want_grads, ("y", "dx", "dw")):
        assert got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    _close(y, F.conv2d(_f64(x), _f64(w), None, 1, 1, 1, 4).relu(), torch.bfloat16, "y")


@pytest.mark.parametrize("training", [True, False])
def test_bfloat16_modules_and_running_statistics(bf16_path, training):
    """Modules in bfloat16 (``.bfloat16()``: parameters and buffers): y and the gradients
    bfloat16 and rounded once from float32; running statistics updated in training as the
    float32 update rounded once, untouched in eval; float32 parameters and statistics
    (autocast's mix) updated in float32."""
    for module, args in ((nft.ConvBatchNormReLU2d(3, 4, 3, padding=1), (_t(2, 3, 5, 5),)),
                         (nft.ConvBatchNormAddReLU2d(3, 4, 3, padding=1),
                          (_t(2, 3, 5, 5, fmt=CL), _t(2, 4, 5, 5, seed=1, fmt=CL))),
                         (nft.BatchNormAddReLU2d(3), (_t(2, 3, 4, 4), _t(2, 3, 4, 4, seed=1)))):
        with torch.no_grad():                     # statistics that an update visibly moves
            for name, b in module.named_buffers():
                if name.endswith("running_mean"):
                    b.uniform_(-1, 1)
        narrow = module.train(training).bfloat16()
        wide = copy.deepcopy(narrow).float()      # the same values, in float32
        args = [a.detach().bfloat16().requires_grad_() for a in args]
        before = {n: b.clone() for n, b in narrow.named_buffers()}
        y = narrow(*args)
        want_y, want_grads = _rounded_once(wide, args)
        what = type(module).__name__
        assert y.dtype == torch.bfloat16, what
        torch.testing.assert_close(y, want_y, rtol=0, atol=0, msg=what)
        grads = torch.autograd.grad(y, args, _dy(y))
        for g, e in zip(grads, want_grads):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=f"{what} grad")
        for (name, b), (_, b32) in zip(narrow.named_buffers(), wide.named_buffers()):
            if name.endswith(("running_mean", "running_var")):
                want = b32.bfloat16() if training else before[name]
                torch.testing.assert_close(b, want, rtol=0, atol=0, msg=f"{what} {name}")
        autocast = copy.deepcopy(narrow)          # float32 batch norm, bfloat16 conv
        for name, m in autocast.named_modules():
            if "bn" in name.split(".")[-1:] or isinstance(m, nft.BatchNormAddReLU2d):
                m.float()
        y = autocast(*args)
        assert y.dtype == torch.bfloat16 and all(
            b.dtype in (torch.float32, torch.int64) for n, b in autocast.named_buffers()
            if "running" in n or "num_batches" in n), what
