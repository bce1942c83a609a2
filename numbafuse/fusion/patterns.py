"""The rewrite rules, after TensorFlow Grappler's remapper.

Each pattern takes a :class:`Matcher` and a root node and returns a :class:`Rewrite` (the
chain's nodes replaced by fused ones), a :class:`Refusal` (the ops match but a condition does
not hold: the reason goes into ``Graph.log``) or None (no match). ``PATTERNS`` lists them by the
root's op, longest first. Fused nodes call the public functions of ``numbafuse.ops.OPS``, with
their keyword arguments taken from the traced nodes' parameters.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import validate
from ..ops import OPS
from .ir import Fold, Node, Value

# Grappler's names for the fusions, used in Graph.log
FUSE_CONV_BIAS_RELU = "Fuse Conv2D with BiasAdd and Relu"
FUSE_CONV_RELU = "Fuse Conv2D with Relu"
FUSE_CONV_BIAS = "Fuse Conv2D with BiasAdd"
FUSE_CONV_SQUEEZE_BIAS = "Fuse Conv2D with Squeeze and BiasAdd"
FUSE_CONV_SQUEEZE_BIAS_RELU = "Fuse Conv2D with Squeeze, BiasAdd and Relu"
FUSE_BN_ADD_RELU = "Fuse FusedBatchNorm with Add and Relu"
FUSE_CONV_BN = "Fuse Conv2D with FusedBatchNorm"
FUSE_CONV_BN_RELU = "Fuse Conv2D with FusedBatchNorm and Relu"
FOLD_CONV_BN = "Fold FusedBatchNorm into Conv2D"


@dataclasses.dataclass
class Rewrite:
    """A fusion: ``old`` nodes (in order, the root last) replaced by ``new`` nodes."""
    title: str
    old: list
    new: list
    folds: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Refusal:
    chain: list                    # the nodes matched, the root last
    reason: str


class Matcher:
    """Pattern matching over one graph (the facts every pattern needs)."""

    def __init__(self, graph):
        self.graph = graph
        self.producer = graph.producer()
        self.consumers = graph.consumers()
        self.outputs = set(graph.outputs)
        self.fused = set()         # nodes already part of a rewrite

    def source(self, v, op):
        """The live node of op ``op`` producing ``v`` (None if none)."""
        node = self.producer.get(v) if isinstance(v, Value) else None
        if node is None or node in self.fused or node.op != op:
            return None
        return node

    def intermediate_reason(self, chain):
        """Why the chain's intermediates cannot disappear (None if they can)."""
        for node in chain[:-1]:
            n = self.consumers.get(node.output, 0)
            if n != 1:
                return f"{node.op} output has {n} consumers"
            if node.output in self.outputs:
                return f"{node.op} output is a graph output"
        return None


def _same(label, pairs, attribute):
    """A reason if the ``attribute`` of the labelled Values differ (None if they agree)."""
    seen = [(name, getattr(v, attribute)) for name, v in pairs
            if isinstance(v, Value) and getattr(v, attribute) is not None]
    if len({value for _, value in seen}) > 1:
        return f"{label} mismatch: " + ", ".join(f"{name} {value}" for name, value in seen)
    return None


def _agree(pairs):
    return _same("dtype", pairs, "dtype") or _same("device", pairs, "device")


def _typed(pairs):
    """The labelled arguments that are arrays, by label: Values with a dtype (known at trace
    time) and the arrays a node holds in its params (running statistics); the rest (absent
    arguments, non-arrays) None, which ``validate``'s dtype checks skip."""
    return {name: v if getattr(v, "dtype", None) is not None else None for name, v in pairs}


def _dtype_reason(check, *args, **kwargs):
    """The message of the TypeError ``validate``'s dtype check ``check`` raises on the traced
    Values (they carry ``.dtype`` as arrays do; the message names the op that would refuse
    them), or None when it takes them: the fused op's own rule, not a copy of it."""
    try:
        check(*args, **kwargs)
    except TypeError as e:
        return str(e)
    return None


def _layouts(*nodes):
    layouts = [(n.op, n.arg("layout", "NCHW")) for n in nodes]
    if len({layout for _, layout in layouts}) > 1:
        return "layout mismatch: " + ", ".join(f"{op} {layout}" for op, layout in layouts)
    return None


def _keywords(op, *sources, **given):
    """The keyword arguments of ``op``'s public function (``OPS[op].keywords``), each taken
    from ``given`` or else from the first source node that has a parameter of that name."""
    kwargs = {}
    for name in OPS[op].keywords:
        if name in given:
            kwargs[name] = given[name]
            continue
        for node in sources:
            if name in node.params:
                kwargs[name] = node.params[name]
                break
    return kwargs


def _out_channels(conv):
    w = conv.arg("w")
    return w.shape[0] if isinstance(w, Value) and w.shape else None


def _bias_reason(b, K, op="bias_add"):
    if not isinstance(b, Value) or b.shape is None:
        return f"{op} b is not an array"
    if K is not None and b.shape != (K,):
        return f"b has shape {b.shape}, conv2d has {K} output channels"
    return None


def _public(op, output, arrays, keywords):
    """A node calling ``op``'s public function: ``arrays`` by name (``OPS[op].arrays``)."""
    return Node(op, {k: arrays[k] for k in OPS[op].arrays if k in arrays}, keywords, output)


def _new_value(like, **changes):
    return dataclasses.replace(like, kind="node", index=None, obj=None, **changes)


def _is_training(bn):
    return bool(bn.params["training"])


# Each pattern takes (matcher, root) and returns a Rewrite, a Refusal or None (no match).

def _conv_bias_chain(m, root, with_relu, with_squeeze):
    """conv2d [-> squeeze] -> bias_add [-> relu] ending at ``root``: one conv with the bias
    (and the ReLU) in its epilogue, then the squeeze (Grappler's Conv2D+Squeeze+BiasAdd)."""
    badd = m.source(root.arg("x"), "bias_add") if with_relu else root
    squeeze = badd and m.source(badd.arg("x"), "squeeze") if with_squeeze else None
    below = squeeze if with_squeeze else badd
    conv = below and m.source(below.arg("x"), "conv2d")
    if conv is None:
        return None
    chain = [n for n in (conv, squeeze, badd) if n is not None] + ([root] if with_relu else [])
    b = badd.arg("b")
    values = [("conv2d output", conv.output), ("b", b)] + (
        [("relu output", root.output)] if with_relu else [])
    reason = (m.intermediate_reason(chain) or _layouts(conv, badd) or _agree(values)
              or _bias_reason(b, _out_channels(conv))
              or (_squeeze_channel_reason(conv, squeeze, badd) if with_squeeze else None))
    if reason:
        return Refusal(chain, reason)
    op = "conv_bias_relu" if with_relu else "conv_bias"
    title = {(True, False): FUSE_CONV_BIAS_RELU, (False, False): FUSE_CONV_BIAS,
             (True, True): FUSE_CONV_SQUEEZE_BIAS_RELU,
             (False, True): FUSE_CONV_SQUEEZE_BIAS}[with_relu, with_squeeze]
    y = _new_value(conv.output) if with_squeeze else root.output
    fused = [_public(op, y, dict(x=conv.arg("x"), w=conv.arg("w"), b=b), _keywords(op, conv))]
    if with_squeeze:
        fused.append(_public("squeeze", root.output, dict(x=y),
                             _keywords("squeeze", squeeze)))
    return Rewrite(title, chain, fused)


def _conv_relu(m, relu):
    conv = m.source(relu.arg("x"), "conv2d")
    if conv is None:
        return None
    chain = [conv, relu]
    reason = (m.intermediate_reason(chain)
              or _agree([("conv2d output", conv.output), ("relu output", relu.output)]))
    if reason:
        return Refusal(chain, reason)
    fused = _public("conv_bias_relu", relu.output, dict(x=conv.arg("x"), w=conv.arg("w")),
                    _keywords("conv_bias_relu", conv))
    return Rewrite(FUSE_CONV_RELU, chain, [fused])


def _squeeze_channel_reason(conv, squeeze, badd):
    """Is bias_add's channel axis, after the squeeze, the conv's channel axis?"""
    layout = conv.arg("layout", "NCHW")
    axes = squeeze.arg("axis")
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes or ())
    ndim = 4
    axes = tuple(int(a) % ndim for a in axes)
    if not axes:
        return "squeeze without an explicit axis"
    channel = validate.channel_axis(layout)
    if channel in axes:
        return "squeeze removes the channel axis"
    after = channel - sum(a < channel for a in axes)
    out_ndim = ndim - len(axes)
    expected = 1 if badd.arg("layout", "NCHW") == "NCHW" else out_ndim - 1
    if after != expected:
        return (f"after the squeeze, bias_add ({badd.arg('layout', 'NCHW')}) adds along axis "
                f"{expected}, the conv's channels are axis {after}")
    return None


def _bn_add_relu(m, relu):
    add = m.source(relu.arg("x"), "add")
    if add is None or add.params.get("sign") != 1:
        return None
    operands = list(add.args.values())
    if len(operands) != 2:
        return None
    refusal = None
    for side in (0, 1):
        bn = m.source(operands[side], "batchnorm")
        if bn is None:
            continue
        z = operands[1 - side]
        chain = [bn, add, relu]
        reason = (m.intermediate_reason(chain)
                  or _agree([("batchnorm output", bn.output), ("z", z),
                             ("relu output", relu.output)])
                  or (None if isinstance(z, Value) and z.shape == bn.output.shape else
                      f"z has shape {getattr(z, 'shape', None)}, batchnorm output "
                      f"{bn.output.shape} (add would broadcast)"))
        if reason:
            refusal = refusal or Refusal(chain, reason)
            continue
        fused = _public("batchnorm_add_relu", relu.output,
                        dict(x=bn.arg("x"), z=z, gamma=bn.arg("gamma"), beta=bn.arg("beta")),
                        _keywords("batchnorm_add_relu", bn))
        return Rewrite(FUSE_BN_ADD_RELU, chain, [fused])
    return refusal


def _conv_bn(m, root):
    """conv2d [-> bias_add] -> batchnorm [-> relu], root a relu or a batchnorm."""
    with_relu = root.op == "relu"
    bn = m.source(root.arg("x"), "batchnorm") if with_relu else root
    if bn is None:
        return None
    badd = m.source(bn.arg("x"), "bias_add")
    conv = m.source((badd or bn).arg("x"), "conv2d")
    if conv is None:
        return None
    chain = [conv] + ([badd] if badd else []) + [bn] + ([root] if with_relu else [])
    b = badd.arg("b") if badd else None
    # the activations share one dtype; x, w and the batch-norm parameters and running
    # statistics are checked as conv_batchnorm_relu checks them (validate's
    # check_half_dtypes, check_param_dtypes): the parameters x's dtype or, for a half x,
    # float32 (autocast's mix)
    activations = [("conv2d output", conv.output), ("b", b),
                   (f"{root.op} output", root.output)]
    params = [(k, bn.arg(k)) for k in ("gamma", "beta", "running_mean", "running_var")]
    op = "conv_batchnorm_relu"
    reason = (m.intermediate_reason(chain) or _layouts(*chain[:-1] if with_relu else chain)
              or _agree(activations)
              or _same("device", activations + [(f"batchnorm {k}", v) for k, v in params],
                       "device")
              or _dtype_reason(validate.check_half_dtypes, op, conv.output.device,
                               **_typed([("x", conv.arg("x")), ("w", conv.arg("w"))]))
              or _dtype_reason(validate.check_param_dtypes, op, conv.output.dtype,
                               **_typed(params))
              or (_bias_reason(b, _out_channels(conv)) if badd else None))
    if reason:
        return Refusal(chain, reason)
    if _is_training(bn):
        if badd:
            return Refusal(chain, "batchnorm is in training mode: folding needs "
                                   "training=False, and conv_batchnorm_relu takes no bias")
        return _recompute(conv, bn, root, chain, with_relu)
    refusal = _fold_reason(m, bn, conv, b)
    if refusal is None:
        return _fold(conv, b, bn, root, chain, with_relu)
    if badd:
        return Refusal(chain, refusal)
    # inference batch norm that cannot be folded: conv_batchnorm_relu(training=False) is exact
    rewrite = _recompute(conv, bn, root, chain, with_relu)
    rewrite.title += f" (inference, not folded: {refusal})"
    return rewrite


def _recompute(conv, bn, root, chain, with_relu):
    fused = _public("conv_batchnorm_relu", root.output,
                    dict(x=conv.arg("x"), w=conv.arg("w"), gamma=bn.arg("gamma"),
                         beta=bn.arg("beta")),
                    _keywords("conv_batchnorm_relu", bn, conv, relu=with_relu))
    return Rewrite(FUSE_CONV_BN_RELU if with_relu else FUSE_CONV_BN, chain, [fused])


def _fold_reason(m, bn, conv, b):
    """Why batch norm cannot be folded into the conv's constants (None if it can)."""
    sources = dict(w=conv.arg("w"), b=b, gamma=bn.arg("gamma"), beta=bn.arg("beta"),
                   running_mean=bn.arg("running_mean"), running_var=bn.arg("running_var"))
    # fold_batchnorm's dtypes (float32 or float64, one for all): a half conv, or half
    # activations with float32 parameters, is not folded but recomputed (exact)
    reason = _dtype_reason(validate.check_float_dtypes, "fold_batchnorm",
                           **_typed(sources.items()))
    if reason:
        return reason
    for name, v in sources.items():
        if v is None and name == "b":
            continue
        if isinstance(v, Value) and v.kind != "const":
            return f"{name} is not a constant (a graph input or computed)"
        if v is None:
            return f"batchnorm has no {name}"
        if isinstance(v, Value) and v.requires_grad and m.graph.recording:
            return f"{name} requires a gradient (folding would drop it; trace under no_grad)"
    return None


def _fold(conv, b, bn, root, chain, with_relu):
    w = conv.arg("w")
    sources = dict(w=w, b=b, gamma=bn.arg("gamma"), beta=bn.arg("beta"),
                   running_mean=bn.arg("running_mean"), running_var=bn.arg("running_var"))
    fold = Fold(sources, float(bn.params["eps"]),
                dataclasses.replace(w, kind="folded", obj=None, is_tensor=False,
                                    requires_grad=False),
                Value("folded", shape=(w.shape[0],), dtype=w.dtype, device=w.device))
    op = "conv_bias_relu" if with_relu else "conv_bias"
    new = [_public(op, root.output, dict(x=conv.arg("x"), w=fold.w, b=fold.b),
                   _keywords(op, conv))]
    return Rewrite(FOLD_CONV_BN, chain, new, [fold])


# patterns tried at a root, by the root's op, longest first
PATTERNS = {
    "relu": (functools.partial(_conv_bias_chain, with_relu=True, with_squeeze=False),
             functools.partial(_conv_bias_chain, with_relu=True, with_squeeze=True),
             _bn_add_relu, _conv_bn, _conv_relu),
    "batchnorm": (_conv_bn,),
    "bias_add": (functools.partial(_conv_bias_chain, with_relu=False, with_squeeze=True),
                 functools.partial(_conv_bias_chain, with_relu=False, with_squeeze=False)),
}
