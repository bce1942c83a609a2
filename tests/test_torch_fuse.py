"""numbafuse.torch.fuse: a converted model computes what the model computes.

The reference is the unconverted model itself, in float64: outputs, the gradients of the input
and of every parameter, and every state_dict entry (running statistics, num_batches_tracked)
agree to 1e-10 after training steps and in eval. Models: torchvision's ResNet code
(numbafuse.torch.resnet, tiny widths) and a hand-written one with the patterns in odd places;
the log lists each match and refusal. Skipped where torch is not installed.
"""
import copy
import inspect
import io
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install "
                                            "'numbafuse[torch]'); .ci/run's torch leg has it")
nn, F = torch.nn, torch.nn.functional

import numbafuse.torch as nft  # noqa: E402

pytestmark = pytest.mark.torch

F64 = dict(rtol=1e-10, atol=1e-10)


def _step(model, x, target):
    """One forward and backward of ``(model(x) * target).sum()``: (y, dx, {name: grad})."""
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * target).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _assert_same(model, fused, x, steps=2, tol=F64):
    """``steps`` training steps then one in eval: the same values, gradients and state (to
    ``tol``)."""
    target = torch.randn(model(x).shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    model.load_state_dict(fused.state_dict())          # undo the probe call's batch count
    for mode in ["train"] * steps + ["eval"]:
        model.train(mode == "train")
        fused.train(mode == "train")
        (y, dx, grads), (y_f, dx_f, grads_f) = _step(model, x, target), _step(fused, x, target)
        torch.testing.assert_close(y_f, y, **tol)
        torch.testing.assert_close(dx_f, dx, **tol)
        assert grads_f.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(grads_f[name], grads[name], **tol, msg=name)
        state, state_f = model.state_dict(), fused.state_dict()
        assert list(state_f) == list(state)
        for key in state:
            torch.testing.assert_close(state_f[key], state[key], **tol, msg=key)


@pytest.mark.parametrize("recompute", [True, False, "auto"])
@pytest.mark.parametrize("block,width", [(nft.BasicBlock, 4), (nft.Bottleneck, 2)])
def test_fuse_torchvision_resnet(block, width, recompute):
    torch.manual_seed(0)
    model = nft.ResNet(block, [1, 1], num_classes=3, width=width).double()
    for m in model.modules():          # non-trivial batch-norm parameters and statistics
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
            m.running_var.data.uniform_(0.5, 2.0)
    fused = nft.fuse(model, recompute=recompute)
    log = fused.fuse_log
    convs = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    bns = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert not any(line.startswith("refused") for line in log), log
    fused_names = {n for line in log for n in line.split(": ", 1)[1].split(" -> ")[0].split(", ")}
    assert convs | bns <= fused_names, "every conv and batch norm is fused"
    tails = [line for line in log if line.startswith("Fuse Conv2d with BatchNorm2d, add and ReLU")]
    assert len(tails) == 2                                 # one block tail per stage
    assert len([line for line in log if line.startswith("Fuse Conv2d with BatchNorm2d:")]) == \
        (2 if block is nft.Bottleneck else 1)              # the downsample branches
    # the module tree is the model's: same names, the BatchNorm2d modules themselves
    assert [n for n, _ in fused.named_modules()][1:] == [n for n, _ in model.named_modules()][1:]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in fused.modules()) == len(bns)
    assert type(fused.get_submodule("layer1.0")) is block
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    _assert_same(model, fused, x)
    # checkpoints load both ways (strict); unfuse gives the model back; fusing again: nothing
    model.load_state_dict(fused.state_dict())
    fused.load_state_dict(model.state_dict())
    back = nft.unfuse(fused)
    assert type(back) is nft.ResNet and back.layer1 is fused.layer1
    assert nft.fuse(fused).fuse_log == []
    # deepcopy and torch.save/load: the same module tree, graph and outputs
    saved = io.BytesIO()
    torch.save(fused, saved)
    saved.seek(0)
    def recomputes(m):                 # each site call's recompute= (the default: True)
        return [n.kwargs.get("recompute", True) for n in m.graph.nodes if n.op == "call_function"]
    assert {r for r in recomputes(fused) if r is not True} == {recompute} - {True}
    for clone in (copy.deepcopy(fused), torch.load(saved, weights_only=False)):
        assert recomputes(clone) == recomputes(fused)
        assert type(clone.layer1) is nn.Sequential and clone.layer1 is not fused.layer1
        assert list(clone.state_dict()) == list(fused.state_dict())
        assert clone.fuse_log == log and not clone.training
        torch.testing.assert_close(clone(x), fused(x), rtol=0, atol=0)


class Leaf(nn.Module):
    """A user leaf: conv -> batch norm inside, not traced into."""

    def __init__(self, C):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(C)

    def forward(self, x):
        return self.bn(self.conv(x))


def _conv(C, bias=False, **kw):
    return nn.Conv2d(C, C, 3, padding=1, bias=bias, **kw)


class Odd(nn.Module):
    """The patterns in odd places (each line of forward says which)."""

    def __init__(self, C=4):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.relu = nn.ReLU()                                  # called at two sites
        self.conv1, self.bn1 = _conv(C), nn.BatchNorm2d(C, momentum=None)
        self.conv2, self.bn2 = _conv(C, stride=2), nn.BatchNorm2d(C, affine=False)
        self.down = nn.Sequential(nn.Conv2d(C, C, 1, stride=2, bias=False), nn.BatchNorm2d(C))
        self.grouped, self.bn3 = _conv(C, groups=2), nn.BatchNorm2d(C)
        self.leaf = Leaf(C)
        self.conv4, self.bn4 = _conv(C, bias=True), nn.BatchNorm2d(C, track_running_stats=False)
        self.conv5, self.bn5 = _conv(C), nn.BatchNorm2d(C)
        self.conv6, self.bn6 = _conv(C), nn.BatchNorm2d(C)
        self.tail = nft.BatchNormAddReLU2d(C)              # numbafuse's own: a leaf

    def forward(self, x):
        h = F.relu(self.stem(x))                    # Conv(bias) -> F.relu
        out = self.relu(self.bn1(self.conv1(h)))    # Conv-BN-ReLU, the shared ReLU's 1st site
        out = self.bn2(self.conv2(out))             # Conv-BN-Add-ReLU ...
        out += self.down(h)                         # ... in-place add, downsample: Conv-BN
        out = self.relu(out)                        # ... the shared ReLU's 2nd site
        g = self.bn3(self.grouped(out))             # groups=2: Conv-BN-Add-ReLU, with
        g = torch.relu(out + g)                     # bn on the right
        leaf = torch.relu(self.leaf(g))             # across a user leaf: nothing fused
        b = self.bn4(self.conv4(leaf))              # conv with a bias: refused with bn4;
        b = b.add_(leaf).relu_()                    # BN-Add-ReLU by methods, in place
        d = self.bn5(self.conv5(b))                 # bn5's output has two users: Conv-BN
        e = self.bn6(self.conv6(b))                 # Conv-BN, whose add below writes into
        r = F.relu(b.clone().add_(e))               # the residual, not into bn6's output
        return self.tail(torch.relu(d) * 0.5 + d, r)


ODD_LOG = [
    "refused Conv2d->BatchNorm2d->relu: bn5's output has 2 users [nodes conv5, bn5, relu_6]",
    "refused Conv2d->BatchNorm2d->add->relu: add__1 adds in place into clone, not into the "
    "batch norm's output [nodes conv6, bn6, add__1, relu_5]",
    "Fuse Conv2d with BatchNorm2d: conv6, bn6 -> fused_conv6_bn6",
    "Fuse Conv2d with BatchNorm2d: conv5, bn5 -> fused_conv5_bn5",
    "refused Conv2d->BatchNorm2d->add->relu: the conv has a bias (numbafuse's Conv-BatchNorm "
    "takes a bias-free conv; the bias moves the running mean) [nodes conv4, bn4, add_, relu_]",
    "Fuse BatchNorm2d with add and ReLU: bn4, add_, relu_ -> fused_bn4_add__relu_",
    "Fuse Conv2d with BatchNorm2d, add and ReLU: grouped, bn3, add_1, relu_3 -> "
    "fused_grouped_bn3_add_1_relu_3",
    "Fuse Conv2d with BatchNorm2d, add and ReLU: conv2, bn2, add, relu -> "
    "fused_conv2_bn2_add_relu",
    "Fuse Conv2d with BatchNorm2d: down.0, down.1 -> fused_down_0_1",
    "Fuse Conv2d with BatchNorm2d and ReLU: conv1, bn1, relu -> fused_conv1_bn1_relu",
    "Fuse Conv2d with ReLU: stem, relu -> fused_stem_relu",
]


def test_fuse_patterns_in_odd_places(caplog):
    torch.manual_seed(0)
    model = Odd().double()
    with caplog.at_level(logging.INFO, logger="numbafuse.torch"):
        fused = nft.fuse(model, leaf_modules=[Leaf])
    assert fused.fuse_log == ["kept leaf (Leaf) as a leaf: not traced into, nothing inside it "
                              "fused"] + ODD_LOG
    assert [r.getMessage() for r in caplog.records] == fused.fuse_log
    assert isinstance(fused.leaf, Leaf) and "leaf.conv" in dict(fused.named_modules())
    _assert_same(model, fused, torch.randn(2, 3, 8, 8, dtype=torch.float64), steps=3)
    assert int(fused.bn1.num_batches_tracked) == 3     # momentum=None: 1/n, n counted


class Mutating(nn.Module):
    """The conv's input is modified in place between the conv and the ReLU."""

    def __init__(self, C=4):
        super().__init__()
        self.conv, self.bn = _conv(C), nn.BatchNorm2d(C)

    def forward(self, x):
        h = x + 0
        y = self.bn(self.conv(h))
        h.mul_(0.5)
        return F.relu(y) + h


def test_an_input_modified_in_place_is_read_where_the_model_reads_it():
    """A fused op runs where its chain ends: a chain whose input is modified in place before
    that is refused (here the ReLU), its shorter part (Conv-BN) fused. Forward only: torch's
    own backward refuses an input that a conv saved and that was modified since."""
    torch.manual_seed(0)
    model = Mutating().double()
    fused = nft.fuse(model)
    assert fused.fuse_log == [
        "refused Conv2d->BatchNorm2d->relu: add is modified in place by mul_ before relu "
        "[nodes conv, bn, relu]",
        "Fuse Conv2d with BatchNorm2d: conv, bn -> fused_conv_bn"]
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        for mode in (True, False):
            torch.testing.assert_close(fused.train(mode)(x), model.train(mode)(x), **F64)
    torch.testing.assert_close(fused.bn.running_mean, model.bn.running_mean, **F64)


def test_fused_sites_run_the_modules_where_the_kernels_cannot(caplog):
    """Changed after fuse (a hook on a batch norm): the site runs the model's own modules,
    and says so once per site. A channels_last input runs fused (NHWC kernels)."""
    torch.manual_seed(0)
    model = nft.ResNet(nft.BasicBlock, [1], num_classes=3, width=4).double().eval()
    fused = nft.fuse(model, copy=False)                      # shares the modules
    assert fused.conv1 is model.conv1
    seen = []
    model.layer1[0].bn1.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="numbafuse.torch"):
        y_cl = fused(x.to(memory_format=torch.channels_last))
        y = fused(x)
    torch.testing.assert_close(y, model(x), **F64)
    torch.testing.assert_close(y_cl, y, **F64)
    assert len(seen) == 3                                     # the hook ran at every call
    warnings = [r.getMessage().removeprefix("numbafuse.torch.fuse: ")
                for r in caplog.records]
    assert warnings == [      # once per site, channels_last or not
        "layer1.0.conv1, layer1.0.bn1, layer1.0.relu runs unfused: the batch norm has hooks "
        "(a fused call would skip them)"]


def test_recompute_keeps_the_conv_input_not_the_conv_output():
    """What torch.autograd holds for backward (saved_tensors_hooks): Conv-BN-ReLU keeps x, w,
    weight, bias and two K-vectors; Conv-BN-Add-ReLU x, w, weight, two K-vectors and the
    1-bit mask. Neither keeps a tensor of the conv output's size."""
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(4, dtype=torch.float64, requires_grad=True)
    bias = torch.rand(4, dtype=torch.float64, requires_grad=True)
    for fn, args, numels in [
            (nft.conv_batchnorm_relu, (x, w, weight, bias), [x.numel(), w.numel(), 4, 4, 4, 4]),
            (nft.conv_batchnorm_add_relu, (x, w, z, weight, bias),
             [x.numel(), w.numel(), 4, 4, 4, z.numel() // 8])]:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            y = fn(*args, padding=1)
        assert [t.numel() for t in saved] == numels, fn.__name__
        assert saved[0] is x and saved[1] is w
        y.sum().backward()


@pytest.mark.parametrize("fn,relu", [(nft.conv_batchnorm_relu, True),
                                     (nft.conv_batchnorm_relu, False),
                                     (nft.conv_batchnorm_add_relu, True)])
def test_recompute_auto_keeps_the_conv_output_where_it_is_dear_to_recompute(fn, relu):
    """recompute="auto" keeps h (as recompute=False) exactly where a value of h costs at least
    KEEP_H_MIN_MACS multiply-adds (C/groups * R * S), at the line and one below it, grouped
    or not, with the ReLU or without, or where h has at most half x's values (a strided 1x1:
    at half and one channel past it); the values and gradients are the recomputing op's.
    fuse's default stays True (DESIGN.md: the fused chains keep only the conv input)."""
    from numbafuse.torch.conv_batchnorm import KEEP_H_MIN_MACS as LINE
    assert inspect.signature(nft.fuse).parameters["recompute"].default is True
    torch.manual_seed(0)
    for C, groups, R, stride, K, keeps in [
            (LINE, 1, 1, 1, None, True), (LINE - 1, 1, 1, 1, None, False),
            (2 * LINE, 2, 1, 1, None, True), (2 * LINE - 2, 2, 1, 1, None, False),
            (-(-LINE // 9), 1, 3, 1, None, True), (3, 1, 3, 1, None, False),
            (12, 1, 1, 2, 24, True), (12, 1, 1, 2, 25, False)]:  # h 192 or 200 values, x 384
        P = (4 - R) // stride + 1
        # (None: the fewest channels whose h has more than half x's values)
        K = K or groups * (C * 16 // (2 * P * P * groups) + 1)
        x = torch.randn(2, C, 4, 4, dtype=torch.float64, requires_grad=True)
        w = torch.randn(K, C // groups, R, R, dtype=torch.float64, requires_grad=True)
        z = torch.randn(2, K, P, P, dtype=torch.float64, requires_grad=True)
        weight = torch.rand(K, dtype=torch.float64, requires_grad=True)
        bias = torch.rand(K, dtype=torch.float64, requires_grad=True)
        args = (x, w, weight, bias) if fn is nft.conv_batchnorm_relu else (x, w, z, weight, bias)
        results = []
        for recompute in (True, "auto"):
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                          lambda t: t):
                y = fn(*args, stride=stride, groups=groups, recompute=recompute,
                       **({} if fn is nft.conv_batchnorm_add_relu else {"relu": relu}))
            kept = z.numel() in [t.numel() for t in saved]
            assert kept == (keeps and recompute == "auto"), (C, groups, R, K, recompute)
            results.append((y, *torch.autograd.grad(y, args, torch.ones_like(y))))
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, **F64)
    with pytest.raises(TypeError, match="recompute must be True, False or 'auto'"):
        fn(*args, stride=stride, groups=groups, recompute="yes")
    with pytest.raises(TypeError, match="recompute"):
        nft.ConvBatchNormReLU2d(3, 4, 3, recompute="sometimes")


@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_batchnorm_relu_output_is_rebuilt_not_kept(channels_last, monkeypatch):
    """A Conv-BN-ReLU that keeps h (recompute=False, or "auto" on a deep conv) marks its output
    y with its source; the next fused conv (Conv-BN-ReLU, Conv-BN-Add-ReLU) keeps that h,
    mean, invstd, weight and bias instead of y, and its backward rebuilds y bit for bit. So
    no saved tensor is y; the gradients are the unfused chain's (float64); y changed in place
    after the forward, or made by a recomputing producer, is kept as itself."""
    from numbafuse.torch import conv_batchnorm as tcb
    F = torch.nn.functional
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def leaf(*shape, positive=False):
        t = torch.rand(*shape, dtype=torch.float64) + 0.5 if positive else \
            torch.randn(*shape, dtype=torch.float64)
        return (t.contiguous(memory_format=fmt) if t.dim() == 4 else t).requires_grad_()

    x, z = leaf(2, 3, 6, 6), leaf(2, 4, 6, 6)
    w1, w2, w3 = leaf(5, 3, 3, 3), leaf(6, 5, 1, 1), leaf(4, 6, 3, 3)
    g1, g2, g3 = leaf(5, positive=True), leaf(6, positive=True), leaf(4, positive=True)
    b1, b2, b3 = leaf(5), leaf(6), leaf(4)
    leaves = (x, z, w1, w2, w3, g1, g2, g3, b1, b2, b3)

    def chain(recompute, touch=False, fused=True):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            if fused:
                y1 = nft.conv_batchnorm_relu(x, w1, g1, b1, padding=1, recompute=recompute)
                if touch:
                    y1 = y1.mul_(1.0)                        # the same values, a new version
                y2 = nft.conv_batchnorm_relu(y1, w2, g2, b2, recompute=recompute)
                y3 = nft.conv_batchnorm_add_relu(y2, w3, z, g3, b3, padding=1,
                                                 recompute=recompute)
                ref = getattr(y1, tcb.SOURCE, None)
                sources.append(None if ref is None else ref().h.untyped_storage().data_ptr())
            else:
                y1 = F.batch_norm(F.conv2d(x, w1, padding=1), None, None, g1, b1, True).relu()
                y2 = F.batch_norm(F.conv2d(y1, w2), None, None, g2, b2, True).relu()
                y3 = (F.batch_norm(F.conv2d(y2, w3, padding=1), None, None, g3, b3, True)
                      + z).relu()
        weights = torch.linspace(-1, 1, y3.numel(), dtype=torch.float64).reshape(y3.shape)
        return y1, y2, y3, saved, torch.autograd.grad((y3 * weights).sum(), leaves,
                                                      retain_graph=True)

    sources = []
    *_, expected = chain(None, fused=False)
    monkeypatch.setattr(tcb, "KEEP_H_MIN_MACS", 1)        # "auto" keeps every h here
    for recompute in (False, "auto"):
        sources = []
        y1, y2, y3, saved, grads = chain(recompute)
        assert getattr(y1, tcb.SOURCE)() is None      # the producer's backward dropped it
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, **F64)
        storages = {t.untyped_storage().data_ptr() for t in saved}
        assert y1.untyped_storage().data_ptr() not in storages, recompute
        assert y2.untyped_storage().data_ptr() not in storages, recompute
        assert sources[-1] in storages                 # the producer's h, kept by y2
        # y2's backward rebuilds y1 bit for bit
        rebuilt = tcb.restore(y2.grad_fn)[0]["x"]
        layout = "NHWC" if channels_last else "NCHW"
        assert np.array_equal(rebuilt, tcb.as_array(y1.detach(), layout))
    if not channels_last:   # (torch refuses in-place changes of a Function's view output)
        # changed in place after the forward: kept as itself (and still right)
        y1, y2, y3, saved, grads = chain(False, touch=True)
        assert y1.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr()
                                                   for t in saved}
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, **F64)
    # a recomputing producer keeps no h: no source, its output kept by the next conv
    y1, y2, y3, saved, grads = chain(True)
    assert sources[-1] is None and not hasattr(y1, tcb.SOURCE)
    assert y1.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in saved}


def test_recompute_false_keeps_the_conv_output_and_computes_the_same():
    """recompute=False (the functions and the modules; fuse's in test_fuse_torchvision_resnet):
    torch.autograd holds h (a tensor of the conv output's size) besides what the recompute
    keeps, and values, gradients and the running statistics are those of the recomputing op,
    in training and in inference."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.rand(4, dtype=torch.float64, requires_grad=True)
    bias = torch.rand(4, dtype=torch.float64, requires_grad=True)
    h_numel = z.numel()
    for fn, args in [(nft.conv_batchnorm_relu, (x, w, weight, bias)),
                     (nft.conv_batchnorm_add_relu, (x, w, z, weight, bias))]:
        for training in (True, False):
            results = []
            for recompute in (True, False):
                rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
                saved = []
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                              lambda t: t):
                    y = fn(*args, rm, rv, training, padding=1, recompute=recompute)
                # (Conv-BN-ReLU in inference folds the batch norm into the conv: no h either way)
                keeps_h = not recompute and (training or fn is nft.conv_batchnorm_add_relu)
                assert (h_numel in [t.numel() for t in saved]) == keeps_h, fn.__name__
                grads = torch.autograd.grad(y, args, torch.ones_like(y))
                results.append((y, *grads, rm, rv))
            for a, b in zip(*results):
                torch.testing.assert_close(b, a, **F64)
    with pytest.raises(TypeError, match="recompute"):
        nft.conv_batchnorm_relu(x, w, weight, bias, padding=1, recompute="no")
    for cls in (nft.ConvBatchNormReLU2d, nft.ConvBatchNormAddReLU2d):
        torch.manual_seed(1)
        m = cls(3, 4, 3, padding=1, dtype=torch.float64)
        kept = cls.from_modules(copy.deepcopy(m.conv), copy.deepcopy(m.bn), recompute=False)
        assert m.recompute and not kept.recompute
        extra = (z,) if cls is nft.ConvBatchNormAddReLU2d else ()
        y, y_kept = m(x, *extra), kept(x, *extra)
        torch.testing.assert_close(y_kept, y, **F64)
        g, g_kept = (torch.autograd.grad(t, (x, w_), torch.ones_like(t))
                     for t, w_ in ((y, m.conv.weight), (y_kept, kept.conv.weight)))
        for a, b in zip(g, g_kept):
            torch.testing.assert_close(b, a, **F64)


def test_torch_compile_and_jit_trace_see_the_fused_ops_as_custom_ops():
    """While torch captures a graph the fused ops are torch.library custom ops: torch.compile
    (aot_eager: autograd through the ops' registered backward) makes one graph of a fused
    ResNet, with no break, that trains as the eager one does; torch.jit.trace records the
    ops (not constants: a new input gives a new output)."""
    import torch._dynamo
    torch.manual_seed(0)
    fused = nft.fuse(nft.ResNet(nft.BasicBlock, [1], num_classes=3, width=4).double())
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert torch._dynamo.explain(copy.deepcopy(fused))(x).graph_break_count == 0
    compiled = copy.deepcopy(fused)
    target = torch.randn(2, 3, dtype=torch.float64)
    (y, dx, grads) = _step(fused, x, target)
    (y_c, dx_c, grads_c) = _step(torch.compile(compiled, backend="aot_eager"), x, target)
    torch.testing.assert_close(y_c, y, **F64)
    torch.testing.assert_close(dx_c, dx, **F64)
    grads_c = {name.removeprefix("_orig_mod."): g for name, g in grads_c.items()}
    assert grads_c.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], **F64, msg=name)
    for key, value in fused.state_dict().items():     # running statistics, batch counts
        torch.testing.assert_close(compiled.state_dict()[key], value, **F64, msg=key)
    fused.eval()
    with torch.no_grad():
        traced = torch.jit.trace(fused, x, check_trace=False)
        other = torch.randn(2, 3, 16, 16, dtype=torch.float64)
        torch.testing.assert_close(traced(other), fused(other), **F64)
    assert "numbafuse::conv_batchnorm_add_relu" in str(traced.graph)


@pytest.mark.parametrize("training", [True, False])
def test_bad_running_statistics_are_refused_while_torch_compiles(training):
    """Under torch.compile the functions check the running statistics' shapes and the
    scalars on the fake tensors (their custom ops get them as None in training, and the
    running update op checks none): a wrong length is the eager call's ValueError, and
    nothing is written. (It had passed silently, the update writing K values into a
    5-element buffer.)"""
    g = torch.Generator().manual_seed(5)
    x, w, z = torch.randn(2, 4, 6, 6, generator=g), torch.randn(8, 4, 3, 3, generator=g), None
    z = torch.randn(2, 8, 6, 6, generator=g)
    ones, zeros = torch.ones(8), torch.zeros(8)
    calls = {"numbafuse.torch.conv_batchnorm_relu": lambda x, rm, rv, **kw:
             nft.conv_batchnorm_relu(x, w, ones, zeros, rm, rv, padding=1, **kw),
             "numbafuse.torch.conv_batchnorm_add_relu": lambda x, rm, rv, **kw:
             nft.conv_batchnorm_add_relu(x, w, z, ones, zeros, rm, rv, padding=1, **kw),
             "numbafuse.torch.batchnorm_add_relu": lambda x, rm, rv, **kw:
             nft.batchnorm_add_relu(z, z, ones, zeros, rm, rv, **kw)}
    for op, call in calls.items():
        for bad in (dict(rm=torch.zeros(5), rv=torch.ones(5)),
                    dict(rm=torch.zeros(8), rv=torch.ones(8), momentum=1.5)):
            kept = [t.clone() for t in (bad["rm"], bad["rv"])]
            compiled = torch.compile(lambda x: call(x, training=training, **bad),
                                     backend="eager")
            if not training and "momentum" in bad:     # (momentum unused in inference)
                compiled(x)
                continue
            with pytest.raises(ValueError, match=op):
                compiled(x)
            assert all(torch.equal(a, b) for a, b in zip(kept, (bad["rm"], bad["rv"])))


@pytest.mark.parametrize("training", [True, False])
def test_conv_batchnorm_functions_equal_torch(training):
    """conv_batchnorm_relu (with and without the ReLU) and conv_batchnorm_add_relu against
    F.conv2d -> F.batch_norm (-> + z) -> relu, at a geometry the ResNets do not have
    (padding "same", dilation (2, 1)): values, the four or five gradients, the running
    statistics."""
    g = torch.Generator().manual_seed(3)

    def t(*shape, grad=True):
        return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(grad)

    x, w, z = t(2, 3, 7, 6), t(4, 3, 3, 3), t(2, 4, 7, 6)
    weight, bias = t(4), t(4)
    geometry = dict(stride=1, padding="same", dilation=(2, 1))
    for name, fn, inputs in [("relu", nft.conv_batchnorm_relu, (x, w, weight, bias)),
                             ("no relu", nft.conv_batchnorm_relu, (x, w, weight, bias)),
                             ("add", nft.conv_batchnorm_add_relu, (x, w, z, weight, bias))]:
        stats = [(torch.rand(4, dtype=torch.float64, generator=g),
                  torch.rand(4, dtype=torch.float64, generator=g) + 0.5)]
        stats.append(tuple(s.clone() for s in stats[0]))
        kw = dict(training=training, momentum=0.3, eps=1e-3, **geometry)
        extra = dict(relu=False) if name == "no relu" else {}
        y = fn(*inputs, *stats[0], **kw, **extra)
        h = F.batch_norm(F.conv2d(x, w, None, **geometry), *stats[1], weight, bias, training,
                         0.3, 1e-3)
        expected = (h + z).relu() if name == "add" else h if extra else h.relu()
        torch.testing.assert_close(y, expected, **F64, msg=name)
        for a, b in zip(stats[0], stats[1]):
            torch.testing.assert_close(a, b, **F64, msg=name)
        dy = t(*y.shape, grad=False)
        got = torch.autograd.grad((y * dy).sum(), inputs)
        for a, b, n in zip(got, torch.autograd.grad((expected * dy).sum(), inputs), "xwzgb"):
            torch.testing.assert_close(a, b, **F64, msg=f"{name}: d{n}")
    with pytest.raises(ValueError, match="conv_batchnorm_add_relu: z has shape"):
        nft.conv_batchnorm_add_relu(x, w, z[:, :, :3].contiguous(), weight, bias, **geometry)


@pytest.mark.parametrize("relu", [False, True])
def test_fuse_torchvision_mobilenet_v2(relu):
    """torchvision's MobileNetV2 (numbafuse.torch.mobilenet, a quarter width): every Conv-BN
    fused, with its activation where it is a ReLU (ReLU6 stays torch's), the depthwise convs
    among them; the same values, gradients and state as the model."""
    torch.manual_seed(0)
    make = nft.mobilenet_v2_relu if relu else nft.mobilenet_v2
    model = make(num_classes=3, width_mult=0.25, dropout=0.0).double()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
            m.running_var.data.uniform_(0.5, 2.0)
    fused = nft.fuse(model)
    log = fused.fuse_log
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    depthwise = [n for n, m in model.named_modules()
                 if isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels]
    assert len(convs) == 52 and len(depthwise) == 17
    fused_names = {n for line in log if not line.startswith("refused")
                   for n in line.split(": ", 1)[1].split(" -> ")[0].split(", ")}
    assert set(convs) <= fused_names, "every conv is fused with its batch norm"
    with_relu = [line for line in log if line.startswith("Fuse Conv2d with BatchNorm2d and ReLU")]
    assert len(with_relu) == (35 if relu else 0)
    assert [n for n, _ in fused.named_modules()][1:] == [n for n, _ in model.named_modules()][1:]
    # (52 convs and batch norms deep: float64 sums in other orders differ by up to 1.1e-9 in
    # the input's gradient, whose values reach 19 (6e-11 of it), where a 2-block ResNet stays
    # within 1e-10)
    _assert_same(model, fused, torch.randn(2, 3, 32, 32, dtype=torch.float64),
                 tol=dict(rtol=1e-8, atol=1e-8))
