"""Training as a library: :func:`fit`, :func:`evaluate`, :func:`train_step`.

:func:`fit` trains a model on a :class:`numbafuse.data.Digits` split with SGD and returns the
history (loss curve, per-epoch loss and accuracy, test accuracy, timing and the bytes held for
backward at the end of a forward pass). The models are in :mod:`numbafuse.models`; the command
line (``python -m numbafuse.train``, ``numbafuse-train``) is :mod:`numbafuse.cli`.
"""
from __future__ import annotations

import math
import time
import tracemalloc

import numpy as np

from .. import backend, distributed, models, optim
from ..autograd import Tensor, no_grad, saved_bytes
from ..ops.basic import cross_entropy

# The training defaults, defined here only (the model's are models.DEFAULTS). Chosen to reach
# >= 97% (typically ~98%) test accuracy on 2 CPU cores in well under a minute of training
# (docs/training.md has the measurements).
DEFAULTS = dict(epochs=12, batch_size=32, lr=0.05, momentum=0.9, weight_decay=5e-4,
                seed=models.DEFAULTS["seed"], schedule="cosine", augment=1)
SCHEDULES = ("cosine", "constant")
WARMUP_STEPS = 3          # steps excluded from ms/step (Numba compilation, first touches)
EVAL_BATCH = 512
MIB = 2.0 ** 20
TQDM_HINT = "(install tqdm for progress bars: pip install 'numbafuse[data]')"


def _to(device, a):
    return backend.to_device(a) if device == backend.CUDA else a


def _accuracy(logits, labels):
    return float(np.mean(np.argmax(backend.to_host(logits), axis=1) == backend.to_host(labels)))


def evaluate(model, x, y, device="cpu", batch_size=EVAL_BATCH):
    """Accuracy of ``model`` (in eval mode, no tape) on ``(x, y)``; restores the mode."""
    was_training = model.training
    model.eval()
    correct = 0
    with no_grad():
        for start in range(0, len(x), batch_size):
            xb = Tensor(_to(device, np.ascontiguousarray(x[start:start + batch_size])))
            logits = model(xb)
            correct += int(np.sum(np.argmax(logits.numpy(), axis=1) ==
                                  y[start:start + batch_size]))
    model.train(was_training)
    return correct / max(len(x), 1)


def train_step(model, opt, xb, yb, comm=None, global_size=None, measure=False):
    """One SGD step; returns (loss Tensor, logits Tensor, bytes saved for backward, or None
    unless ``measure``: walking the graph for them costs ~40-55 us a step on the CPU, 1% of
    the digits step, so :func:`fit` measures one full batch and a plain step does not).

    Data parallel (``comm`` of more than one rank): ``xb, yb`` are this rank's rows of a
    global batch of ``global_size``. The local mean loss is scaled by ``len(yb) * P /
    global_size`` before backward, so that the mean of the ranks' gradients
    (:func:`numbafuse.distributed.average_gradients`) is the gradient of the global mean loss,
    for uneven shards too; the loss returned is the local (unscaled) one.
    """
    opt.zero_grad()
    logits = model(Tensor(xb))
    loss = cross_entropy(logits, yb)
    held = saved_bytes(loss) if measure else None
    if comm is None or comm.size == 1:
        loss.backward()
    else:
        (loss * (len(yb) * comm.size / global_size)).backward()
        distributed.average_gradients(model, comm)
    opt.step()
    return loss, logits, held


class GraphStep:
    """:func:`train_step` replayed from a CUDA graph (``numbafuse.cuda.graph``), for
    :func:`fit` with ``cuda_graph=True``: the first ``warmup`` batches run eagerly (kernel
    compilation, the optimizer's momentum buffers, one-time uploads), the next one is
    captured into a graph with its batch in device arrays of its own, and every later batch of
    that size is copied into those arrays and replayed: no Python between the kernels. A
    batch of another size than the first one's (an epoch's last, smaller one) runs eagerly
    and is never the one captured.

    What a replay cannot do, and so what ``fit`` refuses with this option: a learning rate
    that changes between steps (the captured SGD launch holds its value: ``schedule``
    must be "constant"), data-parallel ranks (the gradient all-reduce goes through the host),
    batch norm with ``momentum=None`` (its factor is a host counter; refused at the capture).
    Labels are checked on the host before each copy (inside a graph cross-entropy cannot
    check them). A batch norm layer's ``num_batches_tracked`` counts eager steps and the
    capture only.
    """

    def __init__(self, model, opt, warmup=2):
        self.model, self.opt, self.warmup = model, opt, warmup
        self.graph = self.x = self.y = self.shapes = None
        self.eager_steps = 0
        self.classes = None

    def __call__(self, xb, yb, measure=False):
        """One step on host batch ``(xb, yb)``: (loss Tensor, logits Tensor, saved bytes or
        None), as :func:`train_step` returns them (replayed steps: the graph's own Tensors,
        rewritten by each replay)."""
        if self.classes is not None and len(yb) and (yb.min() < 0 or yb.max() >= self.classes):
            raise ValueError(f"fit: labels must lie in [0, {self.classes}), got "
                             f"[{yb.min()}, {yb.max()}]")
        if self.shapes is None:
            self.shapes = (xb.shape, yb.shape)       # the batch size the graph is made for
        full = (xb.shape, yb.shape) == self.shapes
        if self.eager_steps < self.warmup or not full:
            self.eager_steps += 1
            out = train_step(self.model, self.opt, backend.to_device(xb), backend.to_device(yb),
                             measure=measure)
            self.classes = out[1].shape[1]
            return out
        if self.graph is None:
            from .. import cuda
            self.x, self.y = backend.to_device(xb), backend.to_device(yb)
            self.graph = cuda.graph(train_step, self.model, self.opt, self.x, self.y,
                                    warmup=0)
        else:
            self.x.copy_to_device(xb)
            self.y.copy_to_device(yb)
        loss, logits, _ = self.graph.replay()
        return loss, logits, None

    def close(self):
        """Release the graph and the device memory it holds."""
        if self.graph is not None:
            self.graph.close()
            self.graph = None


def _shard(n, comm):
    """Rows [lo, hi) of a global batch of n that this rank trains on (as even as possible)."""
    if comm is None or comm.size == 1:
        return 0, n
    if n < comm.size:
        raise ValueError(f"fit: a global batch of {n} cannot give each of {comm.size} ranks "
                         f"a sample; use a larger batch size or fewer ranks")
    base, extra = divmod(n, comm.size)
    lo = comm.rank * base + min(comm.rank, extra)
    return lo, lo + base + (comm.rank < extra)


def _global_sum(comm, *values):
    """Each value summed over the ranks."""
    return tuple(comm.allreduce_sum(np.array(values, np.float64)).tolist())


def _progress(total, desc, enabled):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def fit(model, data, epochs=DEFAULTS["epochs"], batch_size=DEFAULTS["batch_size"],
        lr=DEFAULTS["lr"], momentum=DEFAULTS["momentum"],
        weight_decay=DEFAULTS["weight_decay"], seed=DEFAULTS["seed"], device="cpu",
        schedule=DEFAULTS["schedule"], augment=DEFAULTS["augment"], progress=True, log=print,
        comm=None, cuda_graph=False):
    """Train ``model`` on ``data`` (a :class:`numbafuse.data.Digits`) with SGD.

    Parameters
    ----------
    model : nn.Module
        Takes ``(N, 1, 8, 8)`` (or NHWC) images, returns ``(N, classes)`` logits.
    data : numbafuse.data.Digits
    epochs, batch_size, lr, momentum, weight_decay : training hyper-parameters
    seed : int
        Seeds the batch shuffling (the weights are seeded when the model is built).
    schedule : {"cosine", "constant"}
        Learning rate per step: ``lr * (1 + cos(pi * step / steps)) / 2``, or ``lr``.
    augment : int
        Training images are shifted by up to this many pixels (0: no augmentation).
    device : {"cpu", "cuda"}
        Moves the model and every batch there.
    progress : bool
        A tqdm bar per epoch (plain per-epoch lines when tqdm is missing).
    log : callable or None
        Where per-epoch lines go (``None``: silent).
    comm : numbafuse.distributed.Communicator, optional
        Data-parallel training: every rank draws the same global batches (same seed, same
        augmentation) and trains on its own rows of each (:func:`train_step`); build the model
        with the same ``comm`` for synchronized batch norm. The loss curve and accuracies
        reported are those of the global batches; with the same seed they match a
        one-process run up to the order of floating-point sums.
    cuda_graph : bool
        With ``device="cuda"``: each full batch's step replayed from a CUDA graph
        (:class:`GraphStep`) instead of run op by op; the same results as eager steps, bit for
        bit, at a fraction of the host time (an H100, the digits model: 0.84 ms a step
        against 3.5 ms eagerly, docs/benchmarks.md#gpu). Needs ``schedule="constant"`` and
        one process.

    Returns
    -------
    dict
        ``loss_curve`` (every step), ``epoch_loss``, ``epoch_accuracy`` (training),
        ``test_accuracy``, ``train_seconds`` (wall, compilation included), ``ms_per_step``
        (median after ``WARMUP_STEPS``), ``steps``, ``saved_bytes`` (held for backward at the
        end of a full-batch forward pass).

    Examples
    --------
    >>> from numbafuse import data, models, train
    >>> d = data.load_digits(layout=models.DEFAULTS["layout"]).subset(64, 32)
    >>> h = train.fit(models.make_model("fused"), d, epochs=1, progress=False, log=None)
    >>> sorted(h)[:3]
    ['epoch_accuracy', 'epoch_loss', 'loss_curve']
    """
    say = log or (lambda *a, **k: None)
    if cuda_graph:
        if device != backend.CUDA:
            raise ValueError(f"fit: cuda_graph=True needs device='cuda', got {device!r}")
        if schedule != "constant":
            raise ValueError(f"fit: cuda_graph=True replays a captured step whose learning "
                             f"rate is fixed at the capture; use schedule='constant' (got "
                             f"{schedule!r})")
        if comm is not None and comm.size > 1:
            raise ValueError("fit: cuda_graph=True trains in one process (the gradients' "
                             "all-reduce between ranks goes through the host)")
    if device == backend.CUDA:
        model.to(device)
    opt = optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    rng = np.random.default_rng(seed)
    from ..data import batches, num_batches, random_shift
    n_batches = num_batches(len(data.x_train), batch_size)
    if schedule not in SCHEDULES:
        raise ValueError(f"fit: schedule must be one of {SCHEDULES}, got {schedule!r}")
    total_steps = epochs * n_batches
    history = dict(loss_curve=[], epoch_loss=[], epoch_accuracy=[], step_ms=[])
    held = 0
    if progress:
        try:
            import tqdm  # noqa: F401
        except ImportError:
            say(TQDM_HINT)
    model.train()
    graph_step = GraphStep(model, opt) if cuda_graph else None
    t_start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        bar = _progress(n_batches, f"epoch {epoch}/{epochs}", progress)
        losses, correct, seen = [], 0.0, 0
        for xb, yb in batches(data.x_train, data.y_train, batch_size, seed=rng):
            if schedule == "cosine":
                step = len(history["step_ms"])
                opt.lr = lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
            xb = random_shift(xb, rng, augment, data.layout)
            n_global = len(yb)
            lo, hi = _shard(n_global, comm)
            xb, yb = np.ascontiguousarray(xb[lo:hi]), np.ascontiguousarray(yb[lo:hi])
            t0 = time.perf_counter()
            full = n_global == batch_size
            if graph_step is not None:
                loss, logits, held_now = graph_step(xb, yb, measure=full and not held)
            else:
                # the labels stay on the host: cross_entropy checks them there and, on
                # CUDA, uploads them without waiting for the device
                loss, logits, held_now = train_step(model, opt, _to(device, xb), yb, comm,
                                                    n_global, measure=full and not held)
            loss_value = loss.item()                       # syncs the device
            history["step_ms"].append((time.perf_counter() - t0) * 1e3)
            if held_now is not None:                       # the first full batch's
                held = held_now
            right = _accuracy(logits.data, yb) * len(yb)
            if comm is not None and comm.size > 1:         # the global batch's loss, accuracy
                loss_sum, right = _global_sum(comm, loss_value * len(yb), right)
                loss_value = loss_sum / n_global
            losses.append(loss_value)
            correct += right
            seen += n_global
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", acc=f"{correct / seen:.3f}")
        if bar is not None:
            bar.close()
        history["loss_curve"].extend(losses)
        history["epoch_loss"].append(float(np.mean(losses)))
        history["epoch_accuracy"].append(correct / max(seen, 1))
        say(f"epoch {epoch}/{epochs}: loss {history['epoch_loss'][-1]:.4f}, "
            f"train accuracy {history['epoch_accuracy'][-1]:.4f}")
    train_seconds = time.perf_counter() - t_start
    if graph_step is not None:
        graph_step.close()
    history["test_accuracy"] = evaluate(model, data.x_test, data.y_test, device)
    timed = history["step_ms"][WARMUP_STEPS:] or history["step_ms"]
    history.update(train_seconds=train_seconds, ms_per_step=float(np.median(timed)),
                   ms_per_step_mean=float(np.mean(timed)), steps=len(history["step_ms"]),
                   saved_bytes=int(held))
    say(f"test accuracy {history['test_accuracy']:.4f}, {history['ms_per_step']:.2f} ms/step, "
        f"{train_seconds:.1f} s training, saved for backward {held / MIB:.3f} MiB")
    return history


def peak_step_bytes(model, data, batch_size, device="cpu"):
    """Peak host bytes (tracemalloc) of one training step at ``batch_size`` (CPU only).

    Runs on a copy of the parameters' values: the model's state is restored afterwards.
    """
    if device != backend.CPU:
        return None
    state = model.state_dict()
    opt = optim.SGD(model.parameters(), lr=DEFAULTS["lr"])
    xb = np.ascontiguousarray(data.x_train[:batch_size])
    yb = np.ascontiguousarray(data.y_train[:batch_size])
    train_step(model, opt, xb, yb)                         # warm: nothing left to compile
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        train_step(model, opt, xb, yb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        model.load_state_dict(state)
    return int(peak)
