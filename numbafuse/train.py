"""Train a small ResNet on the scikit-learn 8x8 digits, fused or unfused.

    python -m numbafuse.train [--epochs N] [--batch-size B] [--lr LR] [--momentum M]
                              [--weight-decay WD] [--seed S] [--unfused] [--device cpu|cuda]
                              [--layout NCHW|NHWC] [--fuse modules|remap] [--compare]
                              [--report FILE.json] [--plot FILE.png] [--width C]
                              [--blocks B] [--schedule cosine|constant] [--augment PIXELS]
                              [--recompute on|off] [--train-subset N] [--no-progress]

The model (``width`` C channels throughout, images stay 8x8)::

    stem      Conv2dBiasReLU(1 -> C, 3x3, pad 1)
    block x B ConvBatchNormReLU(C -> C, 3x3, pad 1)            h = relu(bn1(conv1(x)))
              Conv2d(C -> C, 3x3, pad 1, no bias)
              BatchNormAddReLU(C) with the block input as z    y = relu(bn2(conv2(h)) + x)
    head      GlobalAvgPool2d -> Linear(C -> 10)

``--unfused`` builds the same architecture from unfused ops (conv2d, bias_add, relu,
batchnorm, add) with identical initial weights for the same seed; ``--fuse remap`` builds the
fused model by remapping the unfused one with :func:`numbafuse.compile`.

:func:`fit` is the Python entry: it trains a model on a :class:`numbafuse.data.Digits` split
and returns the history (loss curve, per-epoch loss and accuracy, test accuracy, timing and
the bytes held for backward at the end of a forward pass).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tracemalloc

import numpy as np

from . import backend, nn, optim
from .autograd import Tensor, no_grad, saved_bytes
from .ops.arith import add
from .ops.basic import cross_entropy, relu

# Defaults chosen to reach >= 97% (typically ~98%) test accuracy on 2 CPU cores in well under
# a minute of training (see docs/training.md for the measurements).
DEFAULTS = dict(epochs=12, batch_size=32, lr=0.05, momentum=0.9, weight_decay=5e-4, seed=0,
                width=24, blocks=2, layout="NHWC", recompute=True, schedule="cosine", augment=1)
SCHEDULES = ("cosine", "constant")
WARMUP_STEPS = 3          # steps excluded from ms/step (Numba compilation, first touches)
EVAL_BATCH = 512
MIB = 2.0 ** 20
PLOT_HINT = "matplotlib is needed for --plot: pip install 'numbafuse[data]'"
TQDM_HINT = "(install tqdm for progress bars: pip install 'numbafuse[data]')"


# --------------------------------------------------------------------------- the model

class ResidualBlock(nn.Module):
    """Fused block: ConvBatchNormReLU -> Conv2d (no bias) -> BatchNormAddReLU(., x)."""

    def __init__(self, C, layout="NCHW", dtype=np.float32, recompute=True):
        super().__init__()
        self.conv_bn_relu = nn.ConvBatchNormReLU(C, C, 3, padding=1, layout=layout, dtype=dtype,
                                                 recompute=recompute)
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False, layout=layout, dtype=dtype)
        self.bn_add_relu = nn.BatchNormAddReLU(C, layout=layout, dtype=dtype)

    def forward(self, x):
        return self.bn_add_relu(self.conv(self.conv_bn_relu(x)), x)


class UnfusedResidualBlock(nn.Module):
    """The same block from unfused ops: conv, bn, relu, conv, bn, add, relu."""

    def __init__(self, C, layout="NCHW", dtype=np.float32, recompute=None):
        super().__init__()
        self.conv1 = nn.Conv2d(C, C, 3, padding=1, bias=False, layout=layout, dtype=dtype)
        self.bn1 = nn.BatchNorm2d(C, layout=layout, dtype=dtype)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1, bias=False, layout=layout, dtype=dtype)
        self.bn2 = nn.BatchNorm2d(C, layout=layout, dtype=dtype)

    def forward(self, x):
        h = relu(self.bn1(self.conv1(x)))
        return relu(add(self.bn2(self.conv2(h)), x))


def build_model(fused=True, width=DEFAULTS["width"], blocks=DEFAULTS["blocks"], layout="NCHW",
                seed=DEFAULTS["seed"], num_classes=10, in_channels=1, dtype=np.float32,
                recompute=DEFAULTS["recompute"]):
    """The digits ResNet, fused or unfused; the same seed gives the same initial weights.

    ``recompute`` (fused only): ConvBatchNormReLU recomputes its conv in backward (least
    memory) or keeps the conv output and a 1-bit mask (faster).
    """
    nn.init.seed(seed)
    if fused:
        stem = nn.Conv2dBiasReLU(in_channels, width, 3, padding=1, layout=layout, dtype=dtype)
    else:
        stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, layout=layout,
                                       dtype=dtype), nn.ReLU())
    block = ResidualBlock if fused else UnfusedResidualBlock
    body = [block(width, layout, dtype, recompute) for _ in range(blocks)]
    return nn.Sequential(stem, *body, nn.GlobalAvgPool2d(layout),
                         nn.Linear(width, num_classes, dtype=dtype))


class Remapped(nn.Module):
    """An unfused model run through :func:`numbafuse.compile` (trace + remap + cache).

    The compiled callable keys its cache on the input signature and on the module's training
    flags, so train and eval mode each get their own remapped graph (training: conv ->
    batchnorm -> relu becomes conv_batchnorm_relu; eval: batch norm folded into the conv).
    Weights and running statistics are read by reference at every run.
    """

    def __init__(self, unfused):
        super().__init__()
        from .fusion.compile import compile as remap_compile
        self.model = unfused
        self.compiled = remap_compile(unfused)

    def forward(self, x):
        return self.compiled(x)

    def remap_log(self):
        """The remapper's log lines of every cached graph (train, eval, batch sizes), deduped."""
        lines = []
        for graph in self.compiled.graphs.values():
            lines += [line for line in graph.log if line not in lines]
        return lines


def make_model(kind, layout="NCHW", seed=DEFAULTS["seed"], width=DEFAULTS["width"],
               blocks=DEFAULTS["blocks"], recompute=DEFAULTS["recompute"]):
    """``kind``: "fused" (fused modules), "unfused", or "remap" (the unfused one remapped)."""
    if kind not in ("fused", "unfused", "remap"):
        raise ValueError(f"make_model: kind must be 'fused', 'unfused' or 'remap', got {kind!r}")
    model = build_model(kind == "fused", width, blocks, layout, seed, recompute=recompute)
    return Remapped(model) if kind == "remap" else model


# --------------------------------------------------------------------------- training

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


def train_step(model, opt, xb, yb):
    """One SGD step; returns (loss Tensor, logits Tensor, bytes saved for backward)."""
    opt.zero_grad()
    logits = model(Tensor(xb))
    loss = cross_entropy(logits, yb)
    held = saved_bytes(loss)
    loss.backward()
    opt.step()
    return loss, logits, held


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
        schedule=DEFAULTS["schedule"], augment=DEFAULTS["augment"], progress=True, log=print):
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

    Returns
    -------
    dict
        ``loss_curve`` (every step), ``epoch_loss``, ``epoch_accuracy`` (training),
        ``test_accuracy``, ``train_seconds`` (wall, compilation included), ``ms_per_step``
        (median after ``WARMUP_STEPS``), ``steps``, ``saved_bytes`` (held for backward at the
        end of a full-batch forward pass).

    Examples
    --------
    >>> from numbafuse import data, train
    >>> d = data.load_digits().subset(64, 32)
    >>> h = train.fit(train.make_model("fused"), d, epochs=1, progress=False, log=None)
    >>> sorted(h)[:3]
    ['epoch_accuracy', 'epoch_loss', 'loss_curve']
    """
    say = log or (lambda *a, **k: None)
    if device == backend.CUDA:
        model.to(device)
    opt = optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    rng = np.random.default_rng(seed)
    from .data import batches, num_batches, random_shift
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
    t_start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        bar = _progress(n_batches, f"epoch {epoch}/{epochs}", progress)
        losses, correct, seen = [], 0.0, 0
        for xb, yb in batches(data.x_train, data.y_train, batch_size, seed=rng):
            if schedule == "cosine":
                step = len(history["step_ms"])
                opt.lr = lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
            xb = random_shift(xb, rng, augment, data.layout)
            t0 = time.perf_counter()
            loss, logits, held_now = train_step(model, opt, _to(device, xb), _to(device, yb))
            loss_value = loss.item()                       # syncs the device
            history["step_ms"].append((time.perf_counter() - t0) * 1e3)
            if len(yb) == batch_size:
                held = held_now
            losses.append(loss_value)
            correct += _accuracy(logits.data, yb) * len(yb)
            seen += len(yb)
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


# --------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="numbafuse-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--momentum", type=float, default=DEFAULTS["momentum"])
    p.add_argument("--weight-decay", type=float, default=DEFAULTS["weight_decay"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--schedule", choices=SCHEDULES, default=DEFAULTS["schedule"],
                   help="learning-rate schedule over all steps")
    p.add_argument("--augment", type=int, default=DEFAULTS["augment"], metavar="PIXELS",
                   help="random shifts of training images by up to PIXELS (0: none)")
    p.add_argument("--width", type=int, default=DEFAULTS["width"], help="channels per layer")
    p.add_argument("--blocks", type=int, default=DEFAULTS["blocks"], help="residual blocks")
    p.add_argument("--unfused", action="store_true", help="train the unfused model")
    p.add_argument("--fuse", choices=("modules", "remap"), default="modules",
                   help="fused model from fused modules, or by remapping the unfused one")
    p.add_argument("--recompute", choices=("on", "off"),
                   default="on" if DEFAULTS["recompute"] else "off",
                   help="fused ConvBatchNormReLU: recompute the conv in backward (least memory)"
                        " or keep its output and a 1-bit mask (faster)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layout", choices=("NCHW", "NHWC"), default=DEFAULTS["layout"],
                   help="activation layout (NHWC: the conv GEMMs write straight into y)")
    p.add_argument("--compare", action="store_true",
                   help="train fused and unfused and print a side-by-side table")
    p.add_argument("--report", metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot loss and accuracy curves")
    p.add_argument("--train-subset", type=int, default=None, metavar="N",
                   help="train on the first N training examples only (quick runs)")
    p.add_argument("--test-subset", type=int, default=None, metavar="N")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "width", "blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _kinds(args):
    fused = "remap" if args.fuse == "remap" else "fused"
    if args.compare:
        return [fused, "unfused"]
    return ["unfused" if args.unfused else fused]


def run(args, log=print):
    """Train the model(s) ``args`` asks for; returns ``{kind: history}``."""
    from .data import load_digits
    data = load_digits(layout=args.layout).subset(args.train_subset, args.test_subset)
    results = {}
    for kind in _kinds(args):
        log(f"== {kind} model ({args.layout}, {args.device})")
        model = make_model(kind, args.layout, args.seed, args.width, args.blocks,
                           recompute=args.recompute == "on")
        history = fit(model, data, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                      momentum=args.momentum, weight_decay=args.weight_decay, seed=args.seed,
                      device=args.device, schedule=args.schedule, augment=args.augment,
                      progress=not args.no_progress, log=log)
        if args.compare:
            history["peak_bytes"] = peak_step_bytes(model, data, args.batch_size, args.device)
        if kind == "remap":
            history["remap_log"] = model.remap_log()
            log("remap log (all graphs):\n  " + "\n  ".join(history["remap_log"]))
        results[kind] = history
    return results


def comparison_table(results):
    """Markdown table: accuracy, ms/step, MiB saved for backward, peak MiB, per model."""
    kinds = list(results)
    rows = [("test accuracy", lambda h: f"{h['test_accuracy']:.4f}"),
            ("ms / step (median)", lambda h: f"{h['ms_per_step']:.2f}"),
            ("train seconds", lambda h: f"{h['train_seconds']:.1f}"),
            ("saved for backward (MiB)", lambda h: f"{h['saved_bytes'] / MIB:.3f}"),
            ("peak step memory (MiB)", lambda h: "n/a" if h.get("peak_bytes") is None
             else f"{h['peak_bytes'] / MIB:.3f}")]
    lines = ["| | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    lines += ["| " + name + " | " + " | ".join(fmt(results[k]) for k in kinds) + " |"
              for name, fmt in rows]
    if len(kinds) == 2:
        a, b = (results[k] for k in kinds)
        lines.append(f"\n{kinds[0]} / {kinds[1]}: ms/step x{a['ms_per_step'] / b['ms_per_step']:.2f}, "
                     f"saved bytes x{a['saved_bytes'] / max(b['saved_bytes'], 1):.2f}")
    return "\n".join(lines)


def write_report(path, args, results):
    main_kind = _kinds(args)[0]
    main = results[main_kind]
    report = dict(model=main_kind, device=args.device, layout=args.layout,
                  config={k: v for k, v in vars(args).items()
                          if k not in ("report", "plot")})
    report.update({k: v for k, v in main.items() if k != "step_ms"})
    if len(results) > 1:
        report["compare"] = {k: {kk: vv for kk, vv in h.items() if kk != "step_ms"}
                             for k, h in results.items()}
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def plot(path, results):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(PLOT_HINT) from None
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, h in results.items():
        steps = np.arange(1, len(h["loss_curve"]) + 1)
        ax_loss.plot(steps, h["loss_curve"], alpha=0.35, label=f"{kind} (per step)")
        per_epoch = len(h["loss_curve"]) / max(len(h["epoch_loss"]), 1)
        ax_loss.plot(per_epoch * np.arange(1, len(h["epoch_loss"]) + 1), h["epoch_loss"],
                     marker="o", label=f"{kind} (epoch mean)")
        epochs = np.arange(1, len(h["epoch_accuracy"]) + 1)
        ax_acc.plot(epochs, h["epoch_accuracy"], marker="o", label=f"{kind} train")
        ax_acc.axhline(h["test_accuracy"], linestyle="--", color=ax_acc.lines[-1].get_color(),
                       label=f"{kind} test {h['test_accuracy']:.3f}")
    ax_loss.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="training loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    ax_loss.legend()
    ax_acc.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cuda_problem():
    """None if a CUDA device (or the simulator) is usable, else a one-line reason."""
    try:
        from . import cuda
    except (ImportError, RuntimeError) as exc:   # no numba-cuda, or an incompatible NumPy
        return str(exc)
    if not cuda.is_available():
        return "--device cuda: no CUDA device found (numba.cuda.is_available() is False)"
    return None


def main(argv=None):
    args = parse_args(argv)
    problem = _cuda_problem() if args.device == "cuda" else None
    if problem:
        print(f"numbafuse-train: {problem}", file=sys.stderr)
        return 1
    try:
        results = run(args)
    except ImportError as e:  # an optional dependency, with its one-line hint
        print(f"numbafuse-train: {e}", file=sys.stderr)
        return 1
    if args.compare:
        print(comparison_table(results))
    if args.report:
        write_report(args.report, args, results)
    if args.plot:
        plot(args.plot, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
