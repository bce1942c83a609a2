"""Prepared calls in numbafuse.torch (``kernels/cpu/recorded.py``, ``torch/prepared.core``): the
Conv-BN(-Add)-ReLU Functions' cores recorded per signature and replayed give the bits the
layered path gives, forward and backward, running statistics included, at every conv pass
and batch-norm row view a ResNet reaches (Winograd, implicit, im2col in blocks of output
channels, the stride-2 and 1x1 passes, the flat rows of small maps, NHWC); and a fused
ResNet trains to the same bits."""
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install 'numbafuse[torch]'); .ci/run's "
    "torch leg has it")

import numbafuse.torch as nft  # noqa: E402
from numbafuse.kernels.conv import cpu_plan  # noqa: E402
from numbafuse.kernels.cpu import recorded  # noqa: E402
from numbafuse.torch import resnet  # noqa: E402

pytestmark = pytest.mark.torch


def _train(enabled, op, C, K, S, N, stride, kernel, recompute, channels_last, dtype, steps=5,
           fresh=True):
    """Each step's y, the leaves' gradients and the running statistics, on new data every
    step and w moved by SGD (so no two calls see the same inputs)."""
    recorded.ENABLED = enabled
    if fresh:
        recorded.clear()
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(K, C, kernel, kernel, generator=g, dtype=dtype)
         / (kernel * C ** 0.5)).requires_grad_()
    gamma = (1 + 0.1 * torch.randn(K, generator=g, dtype=dtype)).requires_grad_()
    beta = (0.1 * torch.randn(K, generator=g, dtype=dtype)).requires_grad_()
    rm, rv = torch.zeros(K, dtype=dtype), torch.ones(K, dtype=dtype)
    pad = kernel // 2
    P = (S + 2 * pad - kernel) // stride + 1
    steps_out = []
    for _ in range(steps):
        x = torch.randn(N, C, S, S, generator=g, dtype=dtype)
        z = torch.randn(N, K, P, P, generator=g, dtype=dtype)
        if channels_last:
            x, z = (t.contiguous(memory_format=torch.channels_last) for t in (x, z))
        x.requires_grad_()
        z.requires_grad_()
        if op == "cbr":
            y = nft.conv_batchnorm_relu(x, w, gamma, beta, rm, rv, stride=stride, padding=pad,
                                        recompute=recompute)
            leaves = (x, w, gamma, beta)
        else:
            y = nft.conv_batchnorm_add_relu(x, w, z, gamma, beta, rm, rv, stride=stride,
                                            padding=pad, recompute=recompute)
            leaves = (x, w, gamma, beta, z)
        y.backward(torch.randn(y.shape, generator=g, dtype=dtype))
        steps_out.append([y.detach().clone(), rm.clone(), rv.clone()]
                         + [t.grad.clone() for t in leaves])
        with torch.no_grad():
            w -= 0.05 * w.grad
        for t in leaves:
            t.grad = None
    return steps_out


@pytest.fixture(autouse=True)
def _restore():
    enabled = recorded.ENABLED
    yield
    recorded.ENABLED = enabled
    recorded.clear()


# (C, K, S, N, stride, kernel): the passes and row views these reach on any machine's plan
SHAPES = [
    (8, 8, 6, 2, 1, 3),          # the smallest: one task, flat rows
    (16, 16, 16, 4, 1, 3),       # Winograd with statistics in its epilogue
    (64, 64, 8, 16, 2, 3),       # stride 2
    (64, 64, 4, 16, 1, 3),       # a small map: flat rows spread by NumPy copies, implicit dW
    (256, 256, 2, 16, 1, 3),     # 2x2: im2col in blocks of output channels, dW in w's order
    (64, 128, 16, 16, 2, 1),     # a strided 1x1 (the downsample): dX scattered with zeros
]


@pytest.mark.parametrize("op", ["cbr", "cbar"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_prepared_calls_give_the_layered_bits(op, shape, recompute, channels_last):
    args = (op, *shape, recompute, channels_last, torch.float32)
    layered = _train(False, *args)
    prepared = _train(True, *args)
    stats = recorded.stats()
    assert stats["prepared"] == 2 and stats["replays"] == 4, (stats, recorded.refusals())
    for a, b in zip(layered, prepared):
        for u, v in zip(a, b):
            assert _strides(u) == _strides(v) and torch.equal(u, v)


def _strides(t):
    """t's strides where they matter (dimensions longer than 1)."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def test_prepared_float64_calls_give_the_layered_bits():
    args = ("cbar", 8, 8, 6, 2, 1, 3, True, False, torch.float64)
    layered, prepared = _train(False, *args), _train(True, *args)
    assert recorded.stats()["prepared"] == 2
    assert all(torch.equal(u, v) for a, b in zip(layered, prepared) for u, v in zip(a, b))


def test_the_conv_rules_in_force_are_part_of_the_signature():
    args = ("cbr", 16, 16, 16, 4, 1, 3, True, False, torch.float32)
    default = _train(True, *args)
    with cpu_plan.using(winograd_min_tiles=1 << 30):          # no Winograd: other passes
        layered = _train(False, *args, fresh=False)
        prepared = _train(True, *args, fresh=False)
    assert recorded.stats()["prepared"] == 4
    assert all(torch.equal(u, v) for a, b in zip(layered, prepared) for u, v in zip(a, b))
    assert not all(torch.equal(u, v) for a, b in zip(default, prepared) for u, v in zip(a, b))


def test_the_weight_cache_keeps_the_layered_path():
    with nft.weight_cache():
        _train(True, "cbr", 8, 8, 6, 2, 1, 3, True, False, torch.float32)
    assert recorded.stats()["recordings"] == 0


def _evaluate(enabled, op, C, K, S, N, stride, kernel, channels_last, calls=6):
    """Each eval call's y (autograd not recording), the running statistics, gamma and beta
    changed between calls (their values read at every call, never kept by a replay)."""
    recorded.ENABLED = enabled
    recorded.clear()
    g = torch.Generator().manual_seed(2)
    w = torch.randn(K, C, kernel, kernel, generator=g) / (kernel * C ** 0.5)
    pad = kernel // 2
    P = (S + 2 * pad - kernel) // stride + 1
    out = []
    for _ in range(calls):
        gamma, beta = 1 + 0.1 * torch.randn(K, generator=g), 0.1 * torch.randn(K, generator=g)
        rm, rv = 0.1 * torch.randn(K, generator=g), 0.5 + torch.rand(K, generator=g)
        x = torch.randn(N, C, S, S, generator=g)
        z = torch.randn(N, K, P, P, generator=g)
        if channels_last:
            x, z = (t.contiguous(memory_format=torch.channels_last) for t in (x, z))
        if op == "cbr":
            y = nft.conv_batchnorm_relu(x, w, gamma, beta, rm, rv, training=False,
                                        stride=stride, padding=pad)
        else:
            y = nft.conv_batchnorm_add_relu(x, w, z, gamma, beta, rm, rv, training=False,
                                            stride=stride, padding=pad)
        out.append(y)
    return out


@pytest.mark.parametrize("op", ["cbr", "cbar"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("channels_last", [False, True])
def test_prepared_eval_calls_give_the_layered_bits(op, shape, channels_last):
    layered = _evaluate(False, op, *shape, channels_last)
    prepared = _evaluate(True, op, *shape, channels_last)
    stats = recorded.stats()
    assert stats["prepared"] == 1 and stats["replays"] == 3, (stats, recorded.refusals())
    for u, v in zip(layered, prepared):
        assert _strides(u) == _strides(v) and torch.equal(u, v)


def _fit(enabled, steps=5):
    recorded.ENABLED = enabled
    recorded.clear()
    torch.manual_seed(0)
    model = nft.fuse(resnet.resnet18(num_classes=10), recompute="auto").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, t = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _fit_and_evaluate(enabled):
    losses, state = _fit(enabled)
    model = nft.fuse(resnet.resnet18(num_classes=10), recompute="auto")
    model.load_state_dict(state)
    model.eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        logits = [model(torch.randn(2, 3, 32, 32, generator=g)) for _ in range(5)]
    return losses, state, logits


def test_a_fused_resnet_trains_and_evaluates_to_the_same_bits():
    losses, state, logits = _fit_and_evaluate(False)
    prepared_losses, prepared_state, prepared_logits = _fit_and_evaluate(True)
    stats = recorded.stats()
    assert stats["prepared"] >= 35 and not stats["refused"], (stats, recorded.refusals())
    assert prepared_losses == losses
    assert all(torch.equal(state[k], prepared_state[k]) for k in state)
    assert all(torch.equal(a, b) for a, b in zip(logits, prepared_logits))
