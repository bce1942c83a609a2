"""CUDA graphs (``numbafuse.cuda.graph``): a captured training step replayed on new batches
gives what eager steps give, bit for bit; what a capture refuses; bad labels inside a graph.

Under the simulator the capture records the launches and copies and a replay runs them one
by one (the same code path up to cuda.core's stream capture, which only a GPU has); on a GPU
it is cuda.core's stream capture and a graph launch.
"""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import backend, cuda as nfcuda


def _model():
    """Conv-BN-ReLU, pooling and a linear head on the device: a step has a conv, batch norm
    with running statistics, a reduction, a GEMM, cross-entropy and SGD with momentum (the
    simulator runs each GPU thread in Python: a ResNet block takes 20 s a step there)."""
    from numbafuse import nn
    nn.init.seed(0)
    return nn.Sequential(nn.ConvBatchNormReLU(1, 2, 3, padding=1), nn.GlobalAvgPool2d(),
                         nn.Linear(2, 3)).to("cuda")


def test_host_labels_give_the_device_labels_bits_and_are_checked_on_the_host():
    """cross_entropy of device logits takes host labels: the same loss and gradient bits as
    the same labels on the device; a bad one is a ValueError before any kernel runs; a
    capture refuses them (it cannot copy from the host)."""
    from numbafuse.kernels.cuda import launch
    from numbafuse.ops.basic import cross_entropy
    rng = np.random.default_rng(3)
    z = nfcuda.to_device(rng.standard_normal((5, 4)).astype(np.float32))
    for labels in (np.array([0, 3, 1, 2, 3], np.int64), np.array([3, 0, 0, 1, 2], np.int32)):
        got = []
        for y in (labels, nfcuda.to_device(labels)):
            logits = nf.Tensor(z, requires_grad=True)
            loss = cross_entropy(logits, y)
            loss.backward()
            got.append((loss.numpy(), logits.grad.copy_to_host()))
        assert got[0][0].tobytes() == got[1][0].tobytes()
        assert got[0][1].tobytes() == got[1][1].tobytes()
    ran = []
    stop = launch.observe(lambda kernel, args: ran.append(kernel))
    try:
        for bad in ([0, 4, 1, 2, 3], [0, -1, 1, 2, 3]):
            with pytest.raises(ValueError, match=r"cross_entropy: labels must lie in \[0, 4\)"):
                cross_entropy(nf.Tensor(z), np.array(bad))
    finally:
        stop()
    assert ran == []
    with pytest.raises(RuntimeError, match="host"):
        nfcuda.graph(lambda: cross_entropy(nf.Tensor(z), np.array([0, 1, 2, 3, 0])), warmup=0)


def _batches(n):
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((2, 1, 4, 4)).astype(np.float32),
             rng.integers(0, 3, 2).astype(np.int64)) for _ in range(n)]


def test_a_replayed_training_step_matches_eager_steps():
    from numbafuse import optim
    from numbafuse.train import train_step
    batches = _batches(3)
    eager, graphed = _model(), _model()
    opts = [optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
            for m in (eager, graphed)]
    # eager: the graph's two warm-up steps on the first batch, then one step per batch
    losses = []
    for x, y in (batches[0], batches[0], batches[1], batches[2]):
        loss, _, _ = train_step(eager, opts[0], nfcuda.to_device(x), nfcuda.to_device(y))
        losses.append(float(loss.numpy()))
    xb, yb = nfcuda.to_device(batches[0][0]), nfcuda.to_device(batches[0][1])
    step = nfcuda.graph(train_step, graphed, opts[1], xb, yb, warmup=2)
    replayed = []
    for x, y in batches[1:]:
        xb.copy_to_device(x)
        yb.copy_to_device(y)
        loss = step.replay()[0]
        replayed.append(float(loss.numpy()))
    assert replayed == losses[2:]
    for (name, a), (_, b) in zip(eager.state_dict().items(), graphed.state_dict().items()):
        if name.endswith("num_batches_tracked"):     # a host counter: replays run no Python
            assert (int(a), int(b)) == (4, 3)          # (2 warm-ups + the capture)
        else:
            np.testing.assert_array_equal(b, a, err_msg=name)
    step.close()
    with pytest.raises(RuntimeError, match="closed"):
        step.replay()


def test_the_capture_runs_nothing_and_replays_run_everything():
    x = nfcuda.to_device(np.arange(6, dtype=np.float32))
    out = nfcuda.empty(6, np.float32)
    from numbafuse.kernels import module
    ew = module("elementwise", backend.CUDA)
    g = nfcuda.graph(lambda: ew.copy_into(x, out), warmup=0)
    assert g.outputs is out
    x2 = np.arange(6, dtype=np.float32) * 3
    out.copy_to_device(np.full(6, -1, np.float32))
    assert (out.copy_to_host() == -1).all()                   # captured, not run
    x.copy_to_device(x2)
    g.replay()
    np.testing.assert_array_equal(out.copy_to_host(), x2)


@pytest.mark.parametrize("what", ["to_host", "to_device"])
def test_a_host_copy_inside_a_capture_is_refused(what):
    x = nfcuda.to_device(np.ones(4, np.float32))
    fn = {"to_host": lambda: backend.to_host(x),
          "to_device": lambda: backend.to_device(np.ones(3))}[what]
    with pytest.raises(RuntimeError, match="numbafuse.cuda.graph: a copy"):
        nfcuda.graph(fn, warmup=0)
    assert nfcuda.capture_in_progress() is None             # the failed capture ended
    backend.to_host(x)                                       # and eager copies work again


def test_batch_norm_with_a_cumulative_average_is_refused_inside_a_capture():
    from numbafuse import nn
    bn = nn.BatchNorm2d(2, momentum=None).to("cuda")
    x = nf.Tensor(nfcuda.to_device(np.ones((2, 2, 3, 3), np.float32)))
    with pytest.raises(RuntimeError, match="momentum=None"):
        nfcuda.graph(bn, x, warmup=0)
    assert int(bn.num_batches_tracked) == 0           # the refused call counted nothing


def test_captures_do_not_nest_and_warmup_is_checked():
    with pytest.raises(ValueError, match="warmup"):
        nfcuda.graph(lambda: None, warmup=-1)
    with pytest.raises(RuntimeError, match="nest"):
        nfcuda.graph(lambda: nfcuda.graph(lambda: None, warmup=0), warmup=0)
    assert nfcuda.capture_in_progress() is None


def test_a_bad_label_inside_a_graph_gives_a_nan_loss():
    from numbafuse.ops.basic import cross_entropy
    rng = np.random.default_rng(0)
    logits = nf.Tensor(nfcuda.to_device(rng.standard_normal((3, 4)).astype(np.float32)))
    labels = nfcuda.to_device(np.array([0, 3, 1], np.int64))
    with pytest.raises(ValueError, match="labels must lie"):      # eager: refused
        cross_entropy(logits, nfcuda.to_device(np.array([0, 4, 1], np.int64)))
    assert np.isfinite(cross_entropy(logits, labels).numpy())     # the flag was set back
    with pytest.raises(ValueError, match="labels must lie"):      # and is set again
        cross_entropy(logits, nfcuda.to_device(np.array([-1, 0, 1], np.int64)))
    g = nfcuda.graph(lambda: cross_entropy(logits, labels), warmup=1)
    assert np.isfinite(g.replay().numpy())
    labels.copy_to_device(np.array([0, 4, 1], np.int64))
    assert np.isnan(g.replay().numpy())
    labels.copy_to_device(np.array([0, -1, 1], np.int64))
    assert np.isnan(g.replay().numpy())


def _digits(n_train, n_test):
    """A tiny stand-in for the digits split: 4x4 one-channel images, 3 classes."""
    from numbafuse.data import Digits
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n_train + n_test, 1, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, n_train + n_test).astype(np.int64)
    return Digits(x[:n_train], y[:n_train], x[n_train:], y[n_train:], "NCHW", 3)


def test_fit_with_cuda_graph_matches_eager_fit():
    """fit(cuda_graph=True): two eager steps, the capture, replays, and each epoch's last,
    smaller batch eagerly between replays (7 samples in batches of 2): the same loss curve
    and parameters as eager fit, bit for bit."""
    from numbafuse.train import fit
    data = _digits(7, 3)
    runs = []
    for cuda_graph in (False, True):
        model = _model()
        h = fit(model, data, epochs=2, batch_size=2, lr=0.1, momentum=0.9,
                weight_decay=1e-3, device="cuda", schedule="constant", augment=1,
                progress=False, log=None, cuda_graph=cuda_graph)
        runs.append((h, model.state_dict()))
    (eager, eager_state), (graphed, graphed_state) = runs
    assert len(eager["loss_curve"]) == 8
    assert graphed["loss_curve"] == eager["loss_curve"]
    assert graphed["test_accuracy"] == eager["test_accuracy"]
    for name, a in eager_state.items():
        if not name.endswith("num_batches_tracked"):   # a host counter (GraphStep's doc)
            np.testing.assert_array_equal(graphed_state[name], a, err_msg=name)


@pytest.mark.parametrize("kw, match", [
    (dict(device="cpu"), "needs device='cuda'"),
    (dict(schedule="cosine"), "schedule='constant'"),
])
def test_fit_with_cuda_graph_refuses_what_a_replay_cannot_do(kw, match):
    from numbafuse.train import fit
    args = dict(device="cuda", schedule="constant") | kw
    with pytest.raises(ValueError, match=match):
        fit(_model(), _digits(4, 2), epochs=1, batch_size=2, progress=False, log=None,
            cuda_graph=True, **args)


def test_graph_step_captures_a_batch_of_the_first_size_only():
    """Two eager warm-up steps, then a smaller batch (an epoch's last): it runs eagerly and
    the next full batch is the one captured (a graph of the small batch would leave every
    later full batch eager)."""
    from numbafuse import optim
    from numbafuse.train import GraphStep
    model = _model()
    step = GraphStep(model, optim.SGD(model.parameters(), lr=0.1), warmup=2)
    (x, y), = _batches(1)
    step(x, y)
    step(x, y)
    step(x[:1], y[:1])
    assert step.graph is None and step.eager_steps == 3
    step(x, y)
    assert step.graph is not None and step.x.shape == x.shape
    step.close()


def test_graph_step_checks_labels_on_the_host():
    """Inside a graph cross-entropy cannot check labels: GraphStep checks them before the
    copy, once it knows the class count (from its eager steps)."""
    from numbafuse import optim
    from numbafuse.train import GraphStep
    model = _model()
    step = GraphStep(model, optim.SGD(model.parameters(), lr=0.1), warmup=1)
    (x, y), = _batches(1)
    step(x, y)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        step(x, np.array([0, 3], np.int64))
    step.close()


def test_counters_first_needed_inside_a_capture_stay_the_graphs():
    """Last-block counters grown inside a capture are the graph's memory (released with it):
    the eager launches after it keep the counters made outside."""
    from numbafuse.kernels.cuda import reduce
    eager = reduce.counters(4)
    grown = []
    nfcuda.graph(lambda: grown.append(reduce.counters(eager.size + 1)), warmup=0).close()
    assert grown[0].size > eager.size
    assert reduce.counters(4) is eager
