"""numbafuse.torch in half precision: float16 tensors (bfloat16 on the CPU where ``ml_dtypes``
is importable) in and out, float32 arithmetic inside, batch-norm parameters and running
statistics float32 (autocast's) or the input's dtype, as PyTorch takes them.

References: torch's own layers in float64 on the same half inputs (independent of numbafuse's
kernels); each result within the half dtype's tolerance (``tests/harness.py``'s ``TOL``). The
gradient references read the ReLU mask from numbafuse's own rounded y: a value rounded near 0
may have the other sign in float64, which is no error of the gradient.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                                            "'numbafuse[torch]'); .ci/run's torch leg has it")
F = torch.nn.functional

import numbafuse.torch as nft  # noqa: E402

from .harness import TOL  # noqa: E402

pytestmark = pytest.mark.torch

CL = torch.channels_last
HALF = [torch.float16] + ([torch.bfloat16] if torch.bfloat16 in nft.layers.HALF_DTYPES else [])


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
    tol = TOL[np.dtype(nft.layers.NUMPY_DTYPES[dtype])]
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
    (lambda: nft.conv_bias_relu(torch.zeros(2, 3, 4, 4, dtype=torch.int32),
                                torch.zeros(4, 3, 3, 3, dtype=torch.int32)),
     "x must be float32 or float64 .*got torch.int32")])
def test_mixed_dtypes_are_refused_as_pytorch_refuses_them(call, match):
    with pytest.raises(TypeError, match=match):
        call()
