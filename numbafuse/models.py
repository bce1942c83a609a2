"""The digits ResNets the training loop and the benchmarks use, fused and unfused.

The model (``width`` C channels throughout, images stay 8x8)::

    stem      Conv2dBiasReLU(1 -> C, 3x3, pad 1)
    block x B ConvBatchNormReLU(C -> C, 3x3, pad 1)            h = relu(bn1(conv1(x)))
              Conv2d(C -> C, 3x3, pad 1, no bias)
              BatchNormAddReLU(C) with the block input as z    y = relu(bn2(conv2(h)) + x)
    head      GlobalAvgPool2d -> Linear(C -> 10)

The unfused model is the same architecture from unfused ops (conv2d, bias_add, relu,
batchnorm, add) with identical initial weights for the same seed; :class:`Remapped` runs the
unfused one through :func:`numbafuse.compile` (the remapper fuses it).

State dicts use PyTorch's names. The unfused model's keys are those of the same network written
with ``torch.nn`` layers in torchvision's style (``0.0.weight``, ``1.conv1.weight``,
``1.bn1.running_mean``, ``1.bn1.num_batches_tracked``, ``1.conv2.weight``, ``1.bn2.weight``...,
``4.weight``); the fused model keeps the same tensors under its own module names
(``1.conv_bn_relu.bn.running_mean``...); :func:`state_dict_for` renames a checkpoint of
any kind for a model of any kind.
"""
from __future__ import annotations

import re

import numpy as np

from . import nn
from .fusion.compile import compile as remap_compile
from .ops.arith import add
from .ops.basic import relu

# The model's defaults, defined here only (the trainer and its command line read them).
# NHWC: the conv GEMMs write straight into y (docs/benchmarks.md#conv_bias_relu).
DEFAULTS = dict(width=24, blocks=2, layout="NHWC", recompute=True, seed=0)
KINDS = ("fused", "unfused", "remap")


class ResidualBlock(nn.Module):
    """Fused block: ConvBatchNormReLU -> Conv2d (no bias) -> BatchNormAddReLU(., x)."""

    def __init__(self, C, layout=DEFAULTS["layout"], dtype=np.float32,
                 recompute=DEFAULTS["recompute"], comm=None):
        super().__init__()
        self.conv_bn_relu = nn.ConvBatchNormReLU(C, C, 3, padding=1, layout=layout, dtype=dtype,
                                                 recompute=recompute, comm=comm)
        self.conv = nn.Conv2d(C, C, 3, padding=1, bias=False, layout=layout, dtype=dtype)
        self.bn_add_relu = nn.BatchNormAddReLU(C, layout=layout, dtype=dtype, comm=comm)

    def forward(self, x):
        return self.bn_add_relu(self.conv(self.conv_bn_relu(x)), x)


class UnfusedResidualBlock(nn.Module):
    """The same block from unfused ops: conv, bn, relu, conv, bn, add, relu."""

    def __init__(self, C, layout=DEFAULTS["layout"], dtype=np.float32, recompute=None,
                 comm=None):
        super().__init__()
        self.conv1 = nn.Conv2d(C, C, 3, padding=1, bias=False, layout=layout, dtype=dtype)
        self.bn1 = nn.BatchNorm2d(C, layout=layout, dtype=dtype, comm=comm)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1, bias=False, layout=layout, dtype=dtype)
        self.bn2 = nn.BatchNorm2d(C, layout=layout, dtype=dtype, comm=comm)

    def forward(self, x):
        h = relu(self.bn1(self.conv1(x)))
        return relu(add(self.bn2(self.conv2(h)), x))


def build_model(fused=True, width=DEFAULTS["width"], blocks=DEFAULTS["blocks"],
                layout=DEFAULTS["layout"], seed=DEFAULTS["seed"], num_classes=10, in_channels=1,
                dtype=np.float32, recompute=DEFAULTS["recompute"], comm=None):
    """The digits ResNet, fused or unfused; the same seed gives the same initial weights.

    ``recompute`` (fused only): ConvBatchNormReLU recomputes its conv in backward (least
    memory) or keeps the conv output and a 1-bit mask (faster). ``comm``: synchronized batch
    norm over its ranks (data-parallel training, ``numbafuse.distributed``).
    """
    nn.init.seed(seed)
    if fused:
        stem = nn.Conv2dBiasReLU(in_channels, width, 3, padding=1, layout=layout, dtype=dtype)
    else:
        stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, layout=layout,
                                       dtype=dtype), nn.ReLU())
    block = ResidualBlock if fused else UnfusedResidualBlock
    body = [block(width, layout, dtype, recompute, comm) for _ in range(blocks)]
    return nn.Sequential(stem, *body, nn.GlobalAvgPool2d(layout),
                         nn.Linear(width, num_classes, dtype=dtype))


class Remapped(nn.Module):
    """An unfused model run through :func:`numbafuse.compile` (trace + remap + cache).

    The compiled callable keys its cache on the input signature and on the module's training
    flags, so train and eval mode each get their own remapped graph (training: conv ->
    batchnorm -> relu becomes conv_batchnorm_relu; eval: batch norm folded into the conv).
    Weights and running statistics are read by reference at every run. A cached graph runs the
    ops, not the modules, so in training this counts each batch norm's ``num_batches_tracked``
    as the modules' forward would; ``momentum=None`` (whose factor changes every batch, while
    the graph keeps the traced one) is refused.
    """

    def __init__(self, unfused):
        super().__init__()
        cumulative = [name for name, m in unfused.named_modules()
                      if hasattr(m, "step_momentum") and m.momentum is None]
        if cumulative:
            raise ValueError(f"Remapped: {cumulative} use momentum=None (a cumulative average); "
                             f"a remapped graph keeps the momentum of the traced call")
        self.model = unfused
        self.compiled = remap_compile(unfused)

    def forward(self, x):
        graphs = len(self.compiled.graphs)
        y = self.compiled(x)
        if self.training and len(self.compiled.graphs) == graphs:   # a cached graph ran
            for m in self.model.modules():
                if hasattr(m, "step_momentum"):
                    m.step_momentum()                                # num_batches_tracked += 1
        return y

    def remap_log(self):
        """The remapper's log lines of every cached graph (train, eval, batch sizes), deduped."""
        lines = []
        for graph in self.compiled.graphs.values():
            lines += [line for line in graph.log if line not in lines]
        return lines


def make_model(kind, layout=DEFAULTS["layout"], seed=DEFAULTS["seed"], width=DEFAULTS["width"],
               blocks=DEFAULTS["blocks"], recompute=DEFAULTS["recompute"], comm=None):
    """``kind``: "fused" (fused modules), "unfused", or "remap" (the unfused one remapped);
    ``comm``: synchronized batch norm (see :func:`build_model`)."""
    if kind not in KINDS:
        raise ValueError(f"make_model: kind must be 'fused', 'unfused' or 'remap', got {kind!r}")
    model = build_model(kind == "fused", width, blocks, layout, seed, recompute=recompute,
                        comm=comm)
    return Remapped(model) if kind == "remap" else model


# --------------------------------------------------------------------------- checkpoints

# fused module names -> unfused (torchvision-style) names, one rule per layer; and back
_FUSED_TO_UNFUSED = ((r"^0\.(weight|bias)$", r"0.0.\1"),
                     (r"^(\d+)\.conv_bn_relu\.weight$", r"\1.conv1.weight"),
                     (r"^(\d+)\.conv_bn_relu\.bn\.(\w+)$", r"\1.bn1.\2"),
                     (r"^(\d+)\.conv\.weight$", r"\1.conv2.weight"),
                     (r"^(\d+)\.bn_add_relu\.(\w+)$", r"\1.bn2.\2"))
_UNFUSED_TO_FUSED = ((r"^0\.0\.(weight|bias)$", r"0.\1"),
                     (r"^(\d+)\.conv1\.weight$", r"\1.conv_bn_relu.weight"),
                     (r"^(\d+)\.bn1\.(\w+)$", r"\1.conv_bn_relu.bn.\2"),
                     (r"^(\d+)\.conv2\.weight$", r"\1.conv.weight"),
                     (r"^(\d+)\.bn2\.(\w+)$", r"\1.bn_add_relu.\2"))
REMAP_PREFIX = "model."          # Remapped keeps the unfused model as its ``model``


def _rename(key, rules):
    for pattern, replacement in rules:
        new, n = re.subn(pattern, replacement, key)
        if n:
            return new
    return key


def state_dict_for(kind, state):
    """``state``, a checkpoint of a digits ResNet of any kind (fused, unfused, remap, or the
    unfused network written in PyTorch), with its keys renamed for a model of ``kind``.

    Values are passed through (arrays or torch tensors); keys that no rule knows are kept, so
    ``load_state_dict`` still names what does not fit.

    Examples
    --------
    >>> from numbafuse import models
    >>> fused = models.make_model("fused", width=4, blocks=1)
    >>> sorted(models.state_dict_for("unfused", fused.state_dict()))[:3]
    ['0.0.bias', '0.0.weight', '1.bn1.bias']
    """
    if kind not in KINDS:
        raise ValueError(f"state_dict_for: kind must be one of {KINDS}, got {kind!r}")
    unfused = {_rename(k.removeprefix(REMAP_PREFIX), _FUSED_TO_UNFUSED): v
               for k, v in state.items()}
    if kind == "fused":
        return {_rename(k, _UNFUSED_TO_FUSED): v for k, v in unfused.items()}
    if kind == "remap":
        return {REMAP_PREFIX + k: v for k, v in unfused.items()}
    return unfused
