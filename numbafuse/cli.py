"""The command line: train a small ResNet on the scikit-learn 8x8 digits, fused or unfused.

    python -m numbafuse.train [--epochs N] [--batch-size B] [--lr LR] [--momentum M]
                              [--weight-decay WD] [--seed S] [--unfused] [--device cpu|cuda]
                              [--layout NCHW|NHWC] [--fuse modules|remap] [--compare]
                              [--report FILE.json] [--plot FILE.png] [--width C]
                              [--blocks B] [--schedule cosine|constant] [--augment PIXELS]
                              [--recompute on|off] [--train-subset N] [--no-progress]
                              [--save FILE.npz] [--load FILE.npz]

``--unfused`` trains the unfused model (same architecture and initial weights); ``--fuse
remap`` builds the fused model by remapping the unfused one with :func:`numbafuse.compile`;
``--compare`` trains fused and unfused and prints a table. The loop is
:func:`numbafuse.train.fit`, the models :mod:`numbafuse.models`.

Checkpoints: ``--save FILE.npz`` writes the trained model's ``state_dict()`` with
``numpy.savez`` (one array per key, PyTorch's names; no torch needed to read or write it);
``--load FILE.npz`` loads one before training (renamed for the model being built by
:func:`numbafuse.models.state_dict_for`, so a fused, unfused or remapped model's checkpoint, or
the same network's PyTorch ``state_dict()`` saved the same way, fits any kind); with
``--epochs 0`` the loaded model is only evaluated.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from . import distributed, models
from .models import make_model, state_dict_for
from .train import DEFAULTS, MIB, SCHEDULES, evaluate, fit, peak_step_bytes

PLOT_HINT = "matplotlib is needed for --plot: pip install 'numbafuse[data]'"
MODEL = models.DEFAULTS


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
    p.add_argument("--width", type=int, default=MODEL["width"], help="channels per layer")
    p.add_argument("--blocks", type=int, default=MODEL["blocks"], help="residual blocks")
    p.add_argument("--unfused", action="store_true", help="train the unfused model")
    p.add_argument("--fuse", choices=("modules", "remap"), default="modules",
                   help="fused model from fused modules, or by remapping the unfused one")
    p.add_argument("--recompute", choices=("on", "off"),
                   default="on" if MODEL["recompute"] else "off",
                   help="fused ConvBatchNormReLU: recompute the conv in backward (least memory)"
                        " or keep its output and a 1-bit mask (faster)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cuda-graph", action="store_true",
                   help="with --device cuda and --schedule constant: each step replayed from "
                        "a CUDA graph captured once (numbafuse.cuda.graph), not op by op")
    p.add_argument("--layout", choices=("NCHW", "NHWC"), default=MODEL["layout"],
                   help="activation layout (NHWC: the conv GEMMs write straight into y)")
    p.add_argument("--compare", action="store_true",
                   help="train fused and unfused and print a side-by-side table")
    p.add_argument("--report", metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot loss and accuracy curves")
    p.add_argument("--train-subset", type=int, default=None, metavar="N",
                   help="train on the first N training examples only (quick runs)")
    p.add_argument("--test-subset", type=int, default=None, metavar="N")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--distributed", action="store_true",
                   help="data-parallel training on MPI: run under mpiexec -n P; every global "
                        "batch is split across the ranks, batch norm is synchronized and "
                        "gradients averaged; rank 0 reports (docs/distributed.md)")
    p.add_argument("--save", metavar="FILE.npz",
                   help="write the trained model's state_dict (numpy.savez) to FILE.npz")
    p.add_argument("--load", metavar="FILE.npz",
                   help="start from this checkpoint (--epochs 0: evaluate it only)")
    args = p.parse_args(argv)
    for name in ("batch_size", "width", "blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.epochs < (0 if args.load else 1):
        p.error("--epochs must be >= 1 (0 only with --load: evaluate the checkpoint)")
    if args.epochs == 0 and (args.compare or args.plot):
        p.error("--epochs 0 only evaluates: no --compare or --plot")
    if args.save and args.compare:
        p.error("--save takes one model; --compare trains two")
    if args.cuda_graph and (args.device != "cuda" or args.schedule != "constant"
                            or args.distributed):
        p.error("--cuda-graph needs --device cuda and --schedule constant, in one process "
                "(a replayed step keeps the learning rate it was captured with)")
    return args


def save_checkpoint(path, model):
    """``model.state_dict()`` to ``path`` with ``numpy.savez`` (keys as they are)."""
    with open(path, "wb") as f:             # a file object: savez adds no ".npz" to the name
        np.savez(f, **model.state_dict())


def load_checkpoint(path, model, kind):
    """Load the ``numpy.savez`` checkpoint at ``path`` into ``model`` (of ``kind``)."""
    with np.load(path) as saved:
        state = {k: saved[k] for k in saved.files}
    model.load_state_dict(state_dict_for(kind, state))


def _kinds(args):
    fused = "remap" if args.fuse == "remap" else "fused"
    if args.compare:
        return [fused, "unfused"]
    return ["unfused" if args.unfused else fused]


def run(args, log=print, comm=None):
    """Train the model(s) ``args`` asks for; returns ``{kind: history}``. With ``comm`` (of
    more than one rank) the training is data-parallel (``--distributed``)."""
    from .data import load_digits
    say = log or (lambda *a, **k: None)
    data = load_digits(layout=args.layout).subset(args.train_subset, args.test_subset)
    results = {}
    distributed_run = comm is not None and comm.size > 1
    for kind in _kinds(args):
        where = f", {comm.size} ranks" if distributed_run else ""
        say(f"== {kind} model ({args.layout}, {args.device}{where})")
        model = make_model(kind, args.layout, args.seed, args.width, args.blocks,
                           recompute=args.recompute == "on",
                           comm=comm if distributed_run else None)
        if distributed_run:
            distributed.broadcast_parameters(model, comm)
        if args.load:
            load_checkpoint(args.load, model, kind)
            say(f"loaded {args.load}")
        if args.epochs == 0:
            history = dict(test_accuracy=evaluate(model.to(args.device), data.x_test,
                                                  data.y_test, args.device))
            say(f"test accuracy {history['test_accuracy']:.4f} (no training)")
            results[kind] = history
            continue
        history = fit(model, data, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                      momentum=args.momentum, weight_decay=args.weight_decay, seed=args.seed,
                      device=args.device, schedule=args.schedule, augment=args.augment,
                      progress=not args.no_progress and log is not None, log=log,
                      comm=comm if distributed_run else None, cuda_graph=args.cuda_graph)
        if args.save and (comm is None or comm.rank == 0):
            save_checkpoint(args.save, model)
            say(f"saved {args.save}")
        if args.compare:
            history["peak_bytes"] = peak_step_bytes(model, data, args.batch_size, args.device)
        if kind == "remap":
            history["remap_log"] = model.remap_log()
            say("remap log (all graphs):\n  " + "\n  ".join(history["remap_log"]))
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
    comm = None
    if args.distributed:
        comm = distributed.init()
        if comm.mpi_comm is None:
            print(f"numbafuse-train: --distributed: {distributed.INSTALL_HINT}", file=sys.stderr)
            return 1
    lead = comm is None or comm.rank == 0
    try:
        results = run(args, log=print if lead else None, comm=comm)
    except ImportError as e:  # an optional dependency, with its one-line hint
        print(f"numbafuse-train: {e}", file=sys.stderr)
        return 1
    if not lead:                                   # rank 0 reports, writes and plots
        return 0
    if args.compare:
        print(comparison_table(results))
    if args.report:
        write_report(args.report, args, results)
    if args.plot:
        plot(args.plot, results)
    return 0
