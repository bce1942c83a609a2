"""numbafuse.torch against PyTorch's own layers, and PyTorch checkpoints in numbafuse.nn.

The reference is torch itself: ``F.conv2d(...).relu()`` and ``relu(F.batch_norm(...) + z)`` in
float64 over several geometries, in training and in eval; ``torch.autograd.gradcheck``; a
residual block built with the numbafuse modules trains step for step like the one built from
``torch.nn`` layers; a torch checkpoint loaded into ``numbafuse.nn`` computes what torch
computes; bad input is refused by name. Skipped where torch is not installed (CI installs
it in its torch leg: ``.ci/run``).
"""
import doctest
import pathlib
import re
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                                            "'numbafuse[torch]'); .ci/run's torch leg has it")
F = torch.nn.functional

import numbafuse.torch as nft  # noqa: E402
from numbafuse import models, nn  # noqa: E402
from numbafuse.ops.batchnorm import mask_nbytes  # noqa: E402

pytestmark = pytest.mark.torch

F64 = dict(rtol=1e-10, atol=1e-12)       # float64: numbafuse's kernels vs torch's
F32 = dict(rtol=1e-4, atol=1e-5)
STEPS = 5                                # SGD steps of the block-training tests


def _t(rng, shape, dtype=torch.float64, requires_grad=True):
    return torch.tensor(rng.standard_normal(shape), dtype=dtype, requires_grad=requires_grad)


def _grads(*tensors):
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


# --------------------------------------------------------------------------- conv_bias_relu

CONV_CASES = [  # (N, C, H, W), (K, R, S), stride, padding, dilation, bias
    ((2, 3, 7, 7), (4, 3, 3), 1, 1, 1, True),
    ((1, 2, 9, 8), (3, 3, 2), 2, 0, 1, True),
    ((3, 4, 10, 11), (5, 3, 3), (2, 1), (1, 2), (2, 1), False),
    ((2, 1, 6, 6), (2, 1, 1), 1, 0, 1, True),
    ((4, 3, 8, 8), (6, 5, 5), 1, "same", 1, True),
    ((1, 5, 9, 9), (2, 3, 3), 3, "valid", 2, True),
]


@pytest.mark.parametrize("xs,ws,stride,padding,dilation,bias", CONV_CASES)
def test_conv_bias_relu_values_and_gradients_equal_torch(rng, xs, ws, stride, padding, dilation,
                                                         bias):
    K, R, S = ws
    x, w = _t(rng, xs), _t(rng, (K, xs[1], R, S))
    b = _t(rng, (K,)) if bias else None
    kw = dict(stride=stride, padding=padding, dilation=dilation)
    y = nft.conv_bias_relu(x, w, b, **kw)
    expected = F.conv2d(x, w, b, **kw).relu()
    torch.testing.assert_close(y, expected, **F64)
    assert 0 < (y > 0).float().mean() < 1                 # both sides of the ReLU are hit
    dy = _t(rng, tuple(y.shape), requires_grad=False)
    leaves = [t for t in (x, w, b) if t is not None]
    (y * dy).sum().backward()
    got = _grads(*leaves)
    (expected * dy).sum().backward()
    for g, e in zip(got, _grads(*leaves)):
        torch.testing.assert_close(g, e, **F64)


@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[2]])
def test_conv_bias_relu_gradcheck(rng, case):
    xs, (K, R, S), stride, padding, dilation, _ = case
    x, w, b = _t(rng, xs), _t(rng, (K, xs[1], R, S)), _t(rng, (K,))
    assert torch.autograd.gradcheck(
        lambda x, w, b: nft.conv_bias_relu(x, w, b, stride, padding, dilation), (x, w, b))


def test_conv_bias_relu_float32_and_partial_gradients(rng):
    x = _t(rng, (2, 3, 6, 6), torch.float32, requires_grad=False)
    w, b = _t(rng, (4, 3, 3, 3), torch.float32), _t(rng, (4,), torch.float32)
    y = nft.conv_bias_relu(x, w, b, padding=1)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.conv2d(x, w, b, padding=1).relu(), **F32)
    y.sum().backward()                                    # x needs no gradient: not computed
    assert x.grad is None and w.grad is not None and b.grad is not None


# --------------------------------------------------------------------------- batchnorm_add_relu

BN_CASES = [(2, 3, 4, 4), (1, 5, 3, 7), (8, 2, 1, 1), (3, 4, 9, 2)]


@pytest.mark.parametrize("shape", BN_CASES)
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_add_relu_values_gradients_and_running_stats_equal_torch(rng, shape,
                                                                           training):
    C = shape[1]
    x, z = _t(rng, shape) * 2 + 1, _t(rng, shape)
    x = x.detach().requires_grad_()
    weight = torch.tensor(rng.uniform(0.5, 1.5, C), requires_grad=True)
    bias = _t(rng, (C,))
    rm, rv = torch.tensor(rng.standard_normal(C)), torch.tensor(rng.uniform(0.5, 2, C))
    rm_t, rv_t = rm.clone(), rv.clone()
    y = nft.batchnorm_add_relu(x, z, weight, bias, rm, rv, training=training, momentum=0.3,
                               eps=1e-3)
    expected = (F.batch_norm(x, rm_t, rv_t, weight, bias, training, 0.3, 1e-3) + z).relu()
    torch.testing.assert_close(y, expected, **F64)
    torch.testing.assert_close(rm, rm_t, **F64)
    torch.testing.assert_close(rv, rv_t, **F64)
    dy = _t(rng, shape, requires_grad=False)
    (y * dy).sum().backward()
    got = _grads(x, z, weight, bias)
    (expected * dy).sum().backward()
    for g, e in zip(got, _grads(x, z, weight, bias)):
        torch.testing.assert_close(g, e, **F64)


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_add_relu_gradcheck(rng, training):
    shape = (3, 2, 3, 4)
    x, z = _t(rng, shape), _t(rng, shape)
    weight = torch.tensor(rng.uniform(0.5, 1.5, 2), requires_grad=True)
    bias = _t(rng, (2,))
    rm, rv = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x, z, w, b: nft.batchnorm_add_relu(x, z, w, b, rm, rv, training=training),
        (x, z, weight, bias))


def test_batchnorm_add_relu_float32_without_running_stats(rng):
    x, z = _t(rng, (4, 3, 5, 5), torch.float32), _t(rng, (4, 3, 5, 5), torch.float32)
    w, b = torch.ones(3), torch.zeros(3)
    y = nft.batchnorm_add_relu(x, z, w, b)
    torch.testing.assert_close(y, (F.batch_norm(x, None, None, w, b, True) + z).relu(), **F32)


# --------------------------------------------------------------------------- zero copy, residuals

def test_zero_copy_both_ways_and_running_stats_updated_in_place(rng):
    x, z = _t(rng, (2, 3, 4, 4), requires_grad=False), _t(rng, (2, 3, 4, 4),
                                                           requires_grad=False)
    w, b = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    assert np.shares_memory(nft.as_array(x), x.numpy())             # a view, not a copy
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    ptr, version = rm.data_ptr(), rm._version
    y = nft.batchnorm_add_relu(x, z, w, b, rm, rv)
    assert rm.data_ptr() == ptr and rm._version > version and rm.abs().sum() > 0
    y_array = nft.as_array(y)
    assert y._base is None and np.shares_memory(y_array, y.numpy())
    y_array[0, 0, 0, 0] = 123.0                                      # one memory
    assert y[0, 0, 0, 0] == 123.0


def _saved(fn):
    """(tensors autograd saved while ``fn()`` ran, each storage once; the output)."""
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return list(saved.values()), out


def test_backward_keeps_the_mask_not_the_output_or_the_pre_activation(rng):
    shape = (4, 8, 6, 6)
    x, z = _t(rng, shape, torch.float32), _t(rng, shape, torch.float32)
    w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    saved, y = _saved(lambda: nft.batchnorm_add_relu(x, z, w, b))
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    assert x.untyped_storage().data_ptr() in ptrs and y.untyped_storage().data_ptr() not in ptrs
    masks = [t for t in saved if t.dtype == torch.uint8]
    assert len(masks) == 1 and masks[0].numel() == mask_nbytes(x.numel())
    assert sorted(str(t.dtype) for t in saved if t.numel() == 8) == [
        "torch.float32", "torch.float64", "torch.float64"]                # weight, mean, invstd
    total = sum(t.nbytes for t in saved)
    torch_saved, _ = _saved(lambda: (F.batch_norm(x, None, None, w, b, True) + z).relu())
    assert total < sum(t.nbytes for t in torch_saved) - 0.9 * x.nbytes   # torch keeps y too
    # conv: x, w and y (the ReLU's mask), nothing else
    wc, bc = _t(rng, (5, 8, 3, 3), torch.float32), _t(rng, (5,), torch.float32)
    saved, y = _saved(lambda: nft.conv_bias_relu(x, wc, bc, padding=1))
    assert {t.untyped_storage().data_ptr() for t in saved} == {
        t.untyped_storage().data_ptr() for t in (x, wc, y)}


def test_no_grad_keeps_nothing_and_computes_the_same(rng):
    shape = (2, 3, 4, 4)
    x, z = _t(rng, shape), _t(rng, shape)
    w, b = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        saved, y = _saved(lambda: nft.batchnorm_add_relu(x, z, w, b))
    assert saved == [] and not y.requires_grad
    torch.testing.assert_close(y, nft.batchnorm_add_relu(x, z, w, b).detach(), **F64)


def test_unrecorded_calls_skip_function_apply(rng, monkeypatch):
    """Where autograd records nothing (no_grad, or no input requiring grad) the Functions'
    forward runs without ``Function.apply``: the same outputs and running statistics, bit for
    bit, as through ``apply``; with an input requiring grad, ``apply`` runs."""
    shape = (2, 3, 5, 5)
    x, z = _t(rng, shape, requires_grad=False), _t(rng, shape, requires_grad=False)
    w, b = _t(rng, (3, 3, 3, 3), requires_grad=False), _t(rng, (3,), requires_grad=False)
    gamma, beta = _t(rng, (3,), requires_grad=False), _t(rng, (3,), requires_grad=False)

    def run():
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        h = nft.conv_bias_relu(x, w, b, padding=1)
        y = nft.batchnorm_add_relu(h, z, gamma, beta, rm, rv, training=True)
        e = nft.batchnorm_add_relu(h, z, gamma, beta, rm, rv, training=False)
        return [h, y, e, rm, rv]

    monkeypatch.setattr(nft.layers, "needs_grad", lambda *tensors: True)      # all through apply
    through_apply = run()
    monkeypatch.undo()
    applied = []
    for fn in (nft.ConvBiasReLUFunction, nft.BatchNormAddReLUFunction):
        monkeypatch.setattr(fn, "apply", classmethod(
            lambda cls, *a: applied.append(cls) or pytest.fail("Function.apply ran")))
    for out in (run(), _no_grad(run)):
        for a, b_ in zip(out, through_apply):
            assert not a.requires_grad and torch.equal(a, b_)
    assert applied == []
    monkeypatch.undo()
    x.requires_grad_(True)
    y = nft.conv_bias_relu(x, w, b, padding=1)
    assert y.grad_fn is not None


def _no_grad(fn):
    with torch.no_grad():
        return fn()


# --------------------------------------------------------------------------- modules

def test_modules_have_exactly_the_torch_state_dict_and_init():
    for ours, theirs in ((lambda: nft.ConvBiasReLU2d(3, 5, 3, stride=2, padding=1),
                          lambda: torch.nn.Conv2d(3, 5, 3, stride=2, padding=1)),
                         (lambda: nft.ConvBiasReLU2d(3, 5, (3, 1), dilation=(1, 2), bias=False),
                          lambda: torch.nn.Conv2d(3, 5, (3, 1), dilation=(1, 2), bias=False)),
                         (lambda: nft.BatchNormAddReLU2d(6, eps=1e-3, momentum=0.2),
                          lambda: torch.nn.BatchNorm2d(6, eps=1e-3, momentum=0.2)),
                         (lambda: nft.ConvBiasReLU2d(3, 5, 3, dtype=torch.float64),  # dtype=
                          lambda: torch.nn.Conv2d(3, 5, 3, dtype=torch.float64)),
                         (lambda: nft.BatchNormAddReLU2d(6, dtype=torch.float64, device="cpu"),
                          lambda: torch.nn.BatchNorm2d(6, dtype=torch.float64, device="cpu"))):
        torch.manual_seed(11)
        a = ours()
        torch.manual_seed(11)
        b = theirs()
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb) and sa._metadata == sb._metadata
        for k in sb:
            assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)      # same draws
        a.load_state_dict(b.state_dict())
    assert nft.ConvBiasReLU2d(3, 5, 3, device="meta").weight.is_meta      # device=
    bn = nft.BatchNormAddReLU2d(2)
    old = {k: v for k, v in torch.nn.BatchNorm2d(2).state_dict().items()
           if k != "num_batches_tracked"}
    bn.load_state_dict(old)                  # a checkpoint from before version 2, as torch does


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_module_counts_batches_like_torch(rng, momentum):
    ours = nft.BatchNormAddReLU2d(3, momentum=momentum).double()
    theirs = torch.nn.BatchNorm2d(3, momentum=momentum).double()
    for step in range(3):
        x, z = _t(rng, (4, 3, 5, 5), requires_grad=False) + step, _t(rng, (4, 3, 5, 5))
        torch.testing.assert_close(ours(x, z), (theirs(x) + z).relu(), **F64)
    ours.eval()
    theirs.eval()
    torch.testing.assert_close(ours(x, z), (theirs(x) + z).relu(), **F64)
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, **F64)
    assert int(ours.num_batches_tracked) == 3


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_pytorch  # noqa: E402  (the blocks benchmarks/bench_pytorch.py times)

TorchBlock, FusedBlock = bench_pytorch.blocks()


class BasicBlock(torch.nn.Module):
    """torchvision's BasicBlock (no downsample): relu(bn2(conv2(relu(bn1(conv1(x))))) + x);
    ``fused=True`` swaps bn2 + add + relu for BatchNormAddReLU2d."""

    def __init__(self, C, fused):
        super().__init__()
        self.fused = fused
        self.conv1 = torch.nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(C)
        self.conv2 = torch.nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn2 = nft.BatchNormAddReLU2d(C) if fused else torch.nn.BatchNorm2d(C)

    def forward(self, x):
        out = self.conv2(torch.relu(self.bn1(self.conv1(x))))
        return self.bn2(out, x) if self.fused else (self.bn2(out) + x).relu()


def _train(block, batches, dtype):
    block.to(dtype).train()
    opt = torch.optim.SGD(block.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    losses = []
    for x, target in batches:
        opt.zero_grad()
        loss = ((block(x.to(dtype)) - target.to(dtype)) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make", [(TorchBlock, FusedBlock),
                                  (lambda C: BasicBlock(C, False), lambda C: BasicBlock(C, True))],
                         ids=["conv-bias-relu+bn-add-relu", "torchvision-basic-block"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)])
def test_residual_block_trains_like_the_torch_one(rng, make, dtype, tol):
    torch_block, fused_block = make[0](4), make[1](4)
    fused_block.load_state_dict(torch_block.state_dict())          # the torch checkpoint
    batches = [(torch.tensor(rng.standard_normal((3, 4, 6, 6))),
                torch.tensor(rng.standard_normal((3, 4, 6, 6)))) for _ in range(STEPS)]
    expected = _train(torch_block, batches, dtype)
    got = _train(fused_block, batches, dtype)
    np.testing.assert_allclose(got, expected, **tol)
    assert expected[-1] < expected[0]
    ours, theirs = fused_block.state_dict(), torch_block.state_dict()
    assert list(ours) == list(theirs)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype, k
        torch.testing.assert_close(ours[k], v, **tol)
    assert int(ours["bn2.num_batches_tracked"]) == STEPS
    torch_block.eval()
    fused_block.eval()
    x = batches[0][0].to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(fused_block(x), torch_block(x), **tol)


# --------------------------------------------------------------------------- torch -> numbafuse.nn

def _torch_digits_net(width, blocks):
    """The digits ResNet, unfused, in torch.nn layers: numbafuse.models' key names."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn1 = torch.nn.BatchNorm2d(width)
            self.conv2 = torch.nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn2 = torch.nn.BatchNorm2d(width)

        def forward(self, x):
            h = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(h)) + x)

    class Pool(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    return torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Conv2d(1, width, 3, padding=1), torch.nn.ReLU()),
        *[Block() for _ in range(blocks)], Pool(), torch.nn.Linear(width, 10))


@pytest.mark.parametrize("kind", ["unfused", "fused", "remap"])
def test_a_torch_checkpoint_loads_into_numbafuse_models_and_computes_the_same(rng, kind):
    net = _torch_digits_net(width=4, blocks=2).double()
    x = torch.tensor(rng.standard_normal((8, 1, 8, 8)))
    for _ in range(2):                    # move the running stats and counters off their init
        net(x + rng.standard_normal())
    state = net.state_dict()              # torch tensors, float64, num_batches_tracked 2
    model = models.make_model(kind, "NCHW", width=4, blocks=2)
    model.load_state_dict(models.state_dict_for(kind, state))
    ours = models.state_dict_for("unfused", model.state_dict())
    assert sorted(ours) == sorted(state) and int(ours["1.bn1.num_batches_tracked"]) == 2
    net.eval()
    model.eval()
    with torch.no_grad():
        expected = net(x).numpy()
    np.testing.assert_allclose(model(x.numpy().astype(np.float32)).numpy(), expected,
                               rtol=1e-4, atol=1e-5)


def test_torch_layers_checkpoints_load_into_nn_layers(rng):
    x = rng.standard_normal((3, 4, 6, 6))
    z = rng.standard_normal((3, 4, 6, 6))
    conv = torch.nn.Conv2d(4, 4, 3, stride=2, padding=1).double()
    bn = torch.nn.BatchNorm2d(4).double()
    bn(torch.tensor(x) * 3 + 1)                               # running stats off 0 / 1
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    tx, tz = torch.tensor(x), torch.tensor(z)
    for training in (True, False):
        bn.train(training)
        ours = {"conv": nn.Conv2dBiasReLU(4, 4, 3, stride=2, padding=1, dtype=np.float64),
                "bn": nn.BatchNorm2d(4, dtype=np.float64),
                "bnar": nn.BatchNormAddReLU(4, dtype=np.float64),
                "cbr": nn.ConvBatchNormReLU(4, 4, 3, padding=1, dtype=np.float64)}
        ours["conv"].load_state_dict(conv.state_dict())
        ours["bn"].load_state_dict(bn.state_dict())
        ours["bnar"].load_state_dict(bn.state_dict())
        conv_nobias = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False).double()
        ours["cbr"].load_state_dict({"weight": conv_nobias.weight.detach(),
                                     **{"bn." + k: v for k, v in bn.state_dict().items()}})
        for m in ours.values():
            m.train(training)
        state = {k: v.clone() for k, v in bn.state_dict().items()}
        with torch.no_grad():
            expected = {"conv": F.conv2d(tx, conv.weight, conv.bias, 2, 1).relu(),
                        "bn": bn(tx)}
            bn.load_state_dict(state)                  # each layer starts from the checkpoint
            expected["cbr"] = bn(conv_nobias(tx)).relu()
            cbr_state = {k: v.clone() for k, v in bn.state_dict().items()}
            bn.load_state_dict(state)
            expected["bnar"] = (bn(tx) + tz).relu()    # bn's state is now that after one call
        got = {"conv": ours["conv"](x), "bn": ours["bn"](x), "bnar": ours["bnar"](x, z),
               "cbr": ours["cbr"](x)}
        for name in got:
            np.testing.assert_allclose(got[name].numpy(), expected[name].numpy(), **F64,
                                       err_msg=f"{name}, training={training}")
        for m, after in ((ours["bn"], bn.state_dict()), (ours["bnar"], bn.state_dict()),
                         (ours["cbr"].bn, cbr_state)):
            np.testing.assert_allclose(m.running_mean, after["running_mean"].numpy(), **F64)
            np.testing.assert_allclose(m.running_var, after["running_var"].numpy(), **F64)
            assert int(m.num_batches_tracked) == int(after["num_batches_tracked"])
        bn.load_state_dict(state)


# --------------------------------------------------------------------------- bad input

class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 (no GPU is needed to test the dispatch)."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False


def _bn_args(dtype=torch.float64):
    x = torch.zeros(2, 3, 4, 4, dtype=dtype)
    return dict(x=x, z=torch.zeros_like(x), weight=torch.ones(3, dtype=dtype),
                bias=torch.zeros(3, dtype=dtype), running_mean=torch.zeros(3, dtype=dtype),
                running_var=torch.ones(3, dtype=dtype))


BN_BAD = [
    (dict(x=torch.zeros(2, 4, 3, 4, dtype=torch.float64).transpose(1, 2)),   # neither format
     ValueError, "batchnorm_add_relu: x is not contiguous"),
    (dict(z=torch.zeros(2, 3, 4, 8, dtype=torch.float64)[..., ::2]), ValueError,
     "z is not contiguous"),
    (dict(x=torch.zeros(2, 3, 4, 4, dtype=torch.int64)), TypeError,
     r"x must be float32 or float64 \(or float16.*\), got torch.int64"),
    (dict(weight=torch.ones(3)), TypeError, "weight is torch.float32 but x is torch.float64"),
    (dict(bias=torch.zeros(4, dtype=torch.float64)), ValueError, r"bias must have shape \(3,\)"),
    (dict(running_mean=torch.zeros(3, dtype=torch.float64, requires_grad=True)), ValueError,
     "running_mean requires grad"),
    (dict(running_var=None), ValueError, "running_mean and running_var go together"),
    (dict(z=np.zeros((2, 3, 4, 4))), TypeError, "z must be a torch.Tensor, got ndarray"),
    (dict(weight=None), TypeError, "weight must be a torch.Tensor, got None"),
    (dict(x=torch.zeros(2, 3, 4, dtype=torch.float64)), ValueError, "x must have 4 dimensions"),
    (dict(weight=torch.ones(3, dtype=torch.float64).as_subclass(FakeCudaTensor)), TypeError,
     "weight is on cuda:0 but x is on cpu"),
    (dict(bias=torch.zeros(3, dtype=torch.float64, device="meta")), ValueError,
     "bias is on meta"),
]


@pytest.mark.parametrize("change,error,match", BN_BAD)
def test_batchnorm_add_relu_refuses_bad_input_by_name(change, error, match):
    args = {**_bn_args(), **change}
    before = args["running_mean"].clone() if args["running_mean"] is not None else None
    with pytest.raises(error, match=match):
        nft.batchnorm_add_relu(**args)
    if before is not None:
        assert torch.equal(args["running_mean"].detach(), before)      # nothing written


def test_batchnorm_add_relu_refuses_bad_modes():
    with pytest.raises(ValueError, match="inference .* needs running_mean"):
        nft.batchnorm_add_relu(**{**_bn_args(), "running_mean": None, "running_var": None},
                               training=False)
    with pytest.raises(ValueError, match="momentum must lie in"):
        nft.batchnorm_add_relu(**_bn_args(), momentum=2.0)



def test_batchnorm_add_relu_module_checks_momentum_where_it_is_used():
    """Any momentum is accepted at construction and in eval (torch.nn.BatchNorm2d's rule:
    it is unused there); a training call refuses one outside [0, 1], naming the module,
    before anything is written (the running statistics and the batch count)."""
    x, z = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    for bad in (-1, 5):
        m = nft.BatchNormAddReLU2d(3, momentum=bad).eval()
        ours = m(x, z)
        theirs = torch.relu(torch.nn.functional.batch_norm(
            x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.1, m.eps) + z)
        torch.testing.assert_close(ours, theirs)
        m.train()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(ValueError, match="BatchNormAddReLU2d: momentum must lie in"):
            m(x, z)
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), k                       # nothing written


CONV_BAD = [
    (dict(x=torch.zeros(1, 5, 3, 5).transpose(1, 2)), ValueError,       # neither format
     "conv_bias_relu: x is not contiguous"),
    (dict(w=torch.zeros(2, 4, 3, 3)), ValueError, "w has 4 input channels, x has 3"),
    (dict(b=torch.zeros(3)), ValueError, r"b must have shape \(2,\)"),
    (dict(x=torch.zeros(1, 3, 5, 5, dtype=torch.int32)), TypeError, "x must be float32"),
    (dict(w=torch.zeros(2, 3, 3, 3, dtype=torch.float64)), TypeError,
     "w is torch.float64 but x is torch.float32"),
    (dict(b=torch.zeros(2).as_subclass(FakeCudaTensor)), TypeError,
     "b is on cuda:0 but x is on cpu"),
    (dict(stride=2, padding="same"), ValueError, "padding='same' needs stride 1"),
    (dict(stride=0), ValueError, "stride must be >= 1"),
    (dict(x=torch.zeros(1, 3, 2, 2)), ValueError, "output size would be 0x0"),
]


@pytest.mark.parametrize("change,error,match", CONV_BAD)
def test_conv_bias_relu_refuses_bad_input_by_name(change, error, match):
    args = {**dict(x=torch.zeros(1, 3, 5, 5), w=torch.zeros(2, 3, 3, 3), b=torch.zeros(2)),
            **change}
    with pytest.raises(error, match=match):
        nft.conv_bias_relu(**args)


# --------------------------------------------------------------------------- the CUDA branch

def test_cuda_tensors_take_the_cuda_array_interface_branch(monkeypatch):
    """No GPU here: fakes check that CUDA tensors go through __cuda_array_interface__ (numba
    device arrays) and come back by torch.as_tensor on their device, and what the stream guard
    does on a non-default stream. The CUDA path itself is untested on a GPU."""
    seen = []
    monkeypatch.setattr(nft.backend, "as_device_array", lambda t: seen.append(t) or "device")
    fake = torch.zeros(3).as_subclass(FakeCudaTensor)
    assert nft.as_array(fake) == "device" and seen and seen[0].device.type == "cuda"

    class DeviceArray:                     # a numba device array stand-in
        __cuda_array_interface__ = {}

    calls = []
    monkeypatch.setattr(nft.torch, "as_tensor", lambda a, device: calls.append((a, device)))
    a = DeviceArray()
    nft.as_tensor(a, torch.device("cuda", 0))
    assert calls == [(a, torch.device("cuda", 0))]

    class Stream:
        def __init__(self, handle):
            self.cuda_stream, self.waited = handle, []

        def wait_stream(self, other):
            self.waited.append(other)

    default, side = Stream(0), Stream(1234)
    monkeypatch.setattr(nft.torch.cuda, "default_stream", lambda device: default)
    monkeypatch.setattr(nft.torch.cuda, "current_stream", lambda device: side)
    with nft.launch_order(torch.device("cuda", 0)):
        assert default.waited == [side] and side.waited == []   # numbafuse waits for torch
    assert side.waited == [default]                              # torch waits for numbafuse
    monkeypatch.setattr(nft.torch.cuda, "current_stream", lambda device: default)
    with nft.launch_order(torch.device("cuda", 0)):
        pass
    assert default.waited == [side]                              # default stream: no waits


@pytest.mark.parametrize("module", ["layers", "conv_batchnorm", "fx", "modules"])
def test_module_docstring_examples(module):
    result = doctest.testmod(getattr(nft, module), raise_on_error=False)
    assert result.failed == 0 and result.attempted > 0



def test_the_examples_of_docs_pytorch_md_run(capsys):
    """The fuse example prints the log the document shows; the by-hand example trains."""
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "pytorch.md").read_text()
    fuse_example, by_hand = re.findall(r"```python\n(.+?)\n```", text, re.S)
    exec(compile(fuse_example, "docs/pytorch.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    log = out.splitlines()[:7]
    assert len(log) == 7 and all(f"    {line}\n" in text for line in log), out
    assert "layer1.0.bn1 has seen 3 batches" in out
    exec(compile(by_hand, "docs/pytorch.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "num_batches_tracked 3" in out and "torch.Size([2, 16, 12, 12])" in out
