"""numbafuse's max pool for PyTorch tensors (``numbafuse.torch.pool``) and ``fuse``'s
MaxPool2d sites: values and gradients PyTorch's bit for bit (contiguous and channels_last,
float32 and float64, the output's memory format kept), what falls back to ``F.max_pool2d``,
what ``fuse`` refuses and why, and the bytes kept for backward."""
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                            "'numbafuse[torch]')")

import numbafuse.torch as nft  # noqa: E402
from numbafuse.torch import pool  # noqa: E402

pytestmark = pytest.mark.torch
F = torch.nn.functional

CASES = [((4, 64, 16, 16), 3, 2, 1), ((2, 80, 9, 7), 3, 2, 1), ((3, 17, 10, 11), 3, 1, 1),
         ((2, 5, 6, 8), (3, 2), (2, 1), (1, 1)), ((2, 8, 6, 6), 2, None, 0)]


def _pair_runs(shape, k, stride, padding, dtype, channels_last):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype)
    x[0, 0, 0, :3] = x[0, 0, 0, 0]                        # a tie
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = pool.max_pool2d(xa, k, stride, padding)
    yb = F.max_pool2d(xb, k, stride, padding)
    gy = torch.randn_like(yb)
    ya.backward(gy)
    yb.backward(gy)
    return ya, yb, xa.grad, xb.grad


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, k, stride, padding", CASES)
def test_max_pool_is_pytorchs_bit_for_bit(shape, k, stride, padding, dtype, channels_last):
    ya, yb, ga, gb = _pair_runs(shape, k, stride, padding, dtype, channels_last)
    assert ya.grad_fn is not None and "MaxPool2dFunction" in type(ya.grad_fn).__name__
    assert torch.equal(ya, yb) and torch.equal(ga, gb)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert ya.is_contiguous(memory_format=fmt)
    assert ga.is_contiguous(memory_format=fmt) or ga.is_contiguous()


def test_what_falls_back_to_pytorchs_max_pool():
    x = torch.randn(2, 3, 8, 8)
    for other, why in ((x.half(), "dtype"), (x[0], "3-d"), (x[:, :, ::2], "neither"),
                       (torch.randn(1, 1, 20, 20), "over 256 taps")):
        k = 17 if why == "over 256 taps" else 2
        assert why in pool.refusal(other, k)
        y = pool.max_pool2d(other, k)
        assert y.grad_fn is None or "MaxPool2dFunction" not in type(y.grad_fn).__name__
        assert torch.equal(y, F.max_pool2d(other, k))
    assert pool.refusal(x, 3) is None
    with torch.no_grad():                                   # a trace records PyTorch's op
        traced = torch.jit.trace(lambda t: pool.max_pool2d(t, 3, 2, 1), x)
    other = torch.randn(2, 3, 8, 8)
    assert torch.equal(traced(other), F.max_pool2d(other, 3, 2, 1))


def test_fuse_runs_max_pools_and_refuses_what_it_cannot_stand_for(caplog):
    model = torch.nn.Sequential(torch.nn.MaxPool2d(3, 2, 1), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2, ceil_mode=True),
                                torch.nn.MaxPool2d(2, dilation=2))
    fused = nft.fuse(model)
    log = "\n".join(fused.fuse_log)
    assert "Run MaxPool2d on numbafuse's max pool: 0 -> fused_0" in log
    assert "refused MaxPool2d: ceil_mode=True" in log and "refused MaxPool2d: dilation=2" in log
    x = torch.randn(2, 4, 13, 13, requires_grad=True)
    y = fused(x)
    assert torch.equal(y, model(x))
    # a module changed after fuse runs as itself (the site reads it at every call)
    fused.get_submodule("0").ceil_mode = True
    assert torch.equal(fused(x), model(x))
    assert "runs unfused: ceil_mode=True" in caplog.text


def test_backward_keeps_one_byte_an_output():
    """PyTorch keeps an int64 index an output (and the input, for the shape); numbafuse's
    max pool a one-byte window argmax."""
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = pool.max_pool2d(x, 3, 2, 1)
    assert [(t.dtype, t.shape) for t in saved] == [(torch.uint8, y.shape)]
