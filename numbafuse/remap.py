r"""A Grappler-style remapper: trace unfused code, rewrite op chains into fused ops.

Three steps, after TensorFlow Grappler's ``remapper`` pass:

1. :func:`trace` runs a function once and records every numbafuse op it calls (through the
   ``autograd._tracer`` hook) as a :class:`Graph`: graph inputs, constants (weights, running
   statistics: captured *by reference*), op nodes and outputs.
2. :func:`remap` walks that graph from its roots (reverse topological order, as Grappler does)
   and replaces known chains by one fused op, but only where the rewrite is exact; every fusion
   made *and every fusion refused, with its reason* is one line of ``Graph.log``.
3. ``graph(*inputs)`` runs a graph: arrays in, arrays out; Tensors in, recorded on the tape.
   :func:`compile` does 1-3 on the first call per input signature and caches the result.

Patterns (the root is the last op; intermediates must have exactly one consumer and must not be
graph outputs; dtypes, layouts and devices must agree)::

    conv2d -> bias_add -> relu                     => conv_bias_relu
    conv2d -> relu                                 => conv_bias_relu (b=None)
    conv2d -> squeeze -> bias_add -> relu          => conv_bias_relu -> squeeze
    batchnorm -> add(., z) -> relu (either order)  => batchnorm_add_relu
    conv2d -> batchnorm(training) [-> relu]        => conv_batchnorm_relu (recompute)
    conv2d [-> bias_add] -> batchnorm(inference) [-> relu]
                                                   => conv_bias_relu / conv2d -> bias_add with
                                                      batch norm folded into w', b'

Folded weights are recomputed from the referenced constants at every run (a few small NumPy
operations), so a cached graph never uses stale weights or running statistics.

Notation in shape comments: K output channels, C input channels, R, S filter size.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import itertools
import logging
import os
import sys

import numpy as np

from . import _arrays, autograd
from .autograd import Function, Tensor

LOG_ENV = "NUMBAFUSE_LOG"      # NUMBAFUSE_LOG=remap prints the remap log to stderr
LOG_TOPIC = "remap"
logger = logging.getLogger("numbafuse.remap")

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

# the public functions fused nodes call: op name -> (module, attribute), looked up at run time
_PUBLIC = {
    "conv_bias_relu": ("numbafuse.ops.conv", "conv_bias_relu"),
    "conv_bias": ("numbafuse.ops.conv", "conv_bias"),
    "squeeze": ("numbafuse.ops.basic", "squeeze"),
    "batchnorm_add_relu": ("numbafuse.ops.batchnorm", "batchnorm_add_relu"),
    "conv_batchnorm_relu": ("numbafuse.ops.conv_batchnorm", "conv_batchnorm_relu"),
}
# positional arguments of those public functions (the rest are keywords)
_PUBLIC_POSITIONAL = {
    "conv_bias_relu": ("x", "w", "b"),
    "conv_bias": ("x", "w", "b"),
    "squeeze": ("x", "axis"), "batchnorm_add_relu": ("x", "z", "gamma", "beta"),
    "conv_batchnorm_relu": ("x", "w", "gamma", "beta"),
}
_CONV_DEFAULTS = dict(stride=1, padding=0, dilation=1, layout="NCHW")
_BN_DEFAULTS = dict(running_mean=None, running_var=None, training=True, momentum=0.1, eps=1e-5,
                    layout="NCHW")


# --------------------------------------------------------------------------- graph pieces

@dataclasses.dataclass(eq=False)  # identity semantics: a Value is a key of the run environment
class Value:
    """One value flowing in a graph: a graph input, a constant, an op output or a folded weight.

    ``shape``/``dtype``/``device`` describe the value seen at trace time (``None`` for
    non-arrays); ``is_tensor``/``requires_grad`` whether it was a Tensor and needed a gradient.
    """
    kind: str                      # "input" | "const" | "node" | "folded"
    index: int | None = None       # input position (kind "input")
    obj: object = None             # the captured object (kind "const"; example for "input")
    shape: tuple | None = None
    dtype: np.dtype | None = None
    device: str | None = None
    is_tensor: bool = False
    requires_grad: bool = False

    @classmethod
    def of(cls, kind, obj, index=None):
        data = _arrays.data(obj)
        is_array = isinstance(data, np.ndarray) or _arrays.is_device_array(data)
        return cls(kind, index, obj if kind in ("const", "input") else None,
                   tuple(data.shape) if is_array else None,
                   np.dtype(data.dtype) if is_array else None,
                   (_arrays.CUDA if _arrays.is_device_array(data) else _arrays.CPU)
                   if is_array else None,
                   isinstance(obj, Tensor), isinstance(obj, Tensor) and obj.requires_grad)

    def describe(self):
        if self.shape is None:
            return repr(self.obj) if self.kind == "const" else self.kind
        kind = "Tensor" if self.is_tensor else "array"
        return f"{kind}{self.shape} {self.dtype}{' cuda' if self.device == _arrays.CUDA else ''}"


@dataclasses.dataclass(eq=False)
class Node:
    """One op call. ``args`` are its array arguments by name, in call order (Values or None);
    ``params`` its other arguments (plain values, or Values for arrays such as running stats).

    A traced node rebuilds its Function: ``target(**params).apply(*args)``; a node made by
    :func:`remap` calls the public function of its op: ``f(*args, **params)``.
    """
    op: str
    args: dict
    params: dict
    output: Value
    target: object = None          # a Function subclass (traced) or None (public function)
    name: str = ""

    def arg(self, key, default=None):
        if key in self.args:
            return self.args[key]
        return self.params.get(key, default)

    def value_args(self):
        return [v for v in itertools.chain(self.args.values(), self.params.values())
                if isinstance(v, Value)]

    def run(self, env):
        def resolve(v):
            return env[v] if isinstance(v, Value) else v
        args = [resolve(v) for v in self.args.values()]
        params = {k: resolve(v) for k, v in self.params.items()}
        if self.target is not None:
            return self.target(**params).apply(*args)
        module, attribute = _PUBLIC[self.op]
        return getattr(importlib.import_module(module), attribute)(*args, **params)


@dataclasses.dataclass(eq=False)
class Fold:
    """Inference batch norm folded into the conv before it, recomputed at every run.

    ``w' = w * scale[k]``, ``b' = (b - running_mean) * scale + beta``,
    ``scale = gamma / sqrt(running_var + eps)``; sources are the captured constants.
    """
    sources: dict                  # w, b (or None), gamma, beta, running_mean, running_var
    eps: float
    w: Value                       # the folded weight (K, C, R, S)
    b: Value                       # the folded bias (K,)

    def compute(self):
        from .ops.conv_batchnorm import fold_batchnorm  # runs on the arrays' own device
        src = {k: _arrays.data(v.obj if isinstance(v, Value) else v)
               for k, v in self.sources.items()}
        return fold_batchnorm(src["w"], src["b"], src["gamma"], src["beta"],
                              src["running_mean"], src["running_var"], eps=self.eps)

    def differentiated_sources(self):
        return [k for k, v in self.sources.items()
                if isinstance(v, Value) and isinstance(v.obj, Tensor) and v.obj.requires_grad]


class Graph:
    """A traced (or remapped) sequence of numbafuse ops; call it to run it.

    Attributes
    ----------
    ops : list of str
        The op names, in execution order.
    log : list of str
        One line per fusion made or refused by :func:`remap` (empty for a traced graph).
    nodes, inputs, outputs, folds
        The graph itself: :class:`Node` objects, input :class:`Value` objects, output Values
        and the batch-norm folds recomputed at every run.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> g = nf.trace(lambda x, z: nf.add(x, z), np.ones(3), np.ones(3))
    >>> g.ops
    ['add']
    >>> g(np.ones(3), np.arange(3.0))
    array([1., 2., 3.])
    """

    def __init__(self, inputs, nodes, outputs, *, single_output=True, folds=(), log=(),
                 recording=True):
        self.inputs = list(inputs)
        self.nodes = list(nodes)
        self.outputs = list(outputs)
        self.single_output = single_output
        self.folds = list(folds)
        self.log = list(log)
        self.recording = recording  # was the tape recording when this graph was traced?
        for i, node in enumerate(self.nodes):
            node.name = f"{node.op}_{i}"
        self._last_use = {}
        for i, node in enumerate(self.nodes):
            for v in node.value_args():
                self._last_use[v] = i

    @property
    def ops(self):
        return [n.op for n in self.nodes]

    def producer(self):
        """Map from each node-made Value to its Node."""
        return {n.output: n for n in self.nodes}

    def consumers(self):
        """Map from each Value to the number of times ops use it as an argument."""
        counts = {}
        for n in self.nodes:
            for v in n.value_args():
                counts[v] = counts.get(v, 0) + 1
        return counts

    def __call__(self, *inputs):
        if len(inputs) != len(self.inputs):
            raise TypeError(f"Graph: takes {len(self.inputs)} inputs, got {len(inputs)}")
        env = {}
        for v, given in zip(self.inputs, inputs):
            _check_input(v, given)
            env[v] = given
        for fold in self.folds:
            self._check_fold(fold)
            env[fold.w], env[fold.b] = fold.compute()
        outputs = set(self.outputs)
        for i, node in enumerate(self.nodes):
            for v in node.value_args():
                if v.kind == "const":
                    env[v] = v.obj
            env[node.output] = node.run(env)
            for v in node.value_args():  # free intermediates after their last use
                if self._last_use.get(v) == i and v not in outputs and v.kind == "node":
                    env.pop(v, None)
        results = tuple(env[v] if v.kind != "const" else v.obj for v in self.outputs)
        return results[0] if self.single_output else results

    def _check_fold(self, fold):
        grads = fold.differentiated_sources()
        if grads and autograd.is_recording():
            raise ValueError(
                f"Graph: batch norm was folded into constant weights, but "
                f"{', '.join(grads)} now require gradients and the tape is recording; "
                f"trace and remap again (numbafuse.compile does so by itself)")

    # -- printing
    def _name(self, v, names):
        if v is None:
            return "None"
        if not isinstance(v, Value):
            if isinstance(v, np.ndarray) or _arrays.is_device_array(v):
                return f"array{tuple(v.shape)}"
            return repr(v)
        return names.get(v, "?")

    def summary(self) -> str:
        """A readable listing: inputs, folded weights, one line per op, outputs, the log."""
        names = {}
        lines = [f"Graph: {len(self.inputs)} inputs, {len(self.nodes)} ops"]
        for v in self.inputs:
            names[v] = f"%in{v.index}"
            lines.append(f"  {names[v]}: {v.describe()}")
        consts = itertools.count()
        for i, fold in enumerate(self.folds):
            names[fold.w], names[fold.b] = f"%w_folded{i}", f"%b_folded{i}"
            lines.append(f"  {names[fold.w]}, {names[fold.b]} = fold_batchnorm(...) "
                         f"(recomputed each run)")
        for node in self.nodes:
            for v in node.value_args():
                if v not in names and v.kind == "const":
                    names[v] = f"%c{next(consts)}"
            args = ", ".join([self._name(v, names) for v in node.args.values()]
                             + [f"{k}={self._name(v, names)}" for k, v in node.params.items()
                                if k != "name"])
            names[node.output] = f"%{node.name}"
            lines.append(f"  %{node.name} = {node.op}({args})")
        lines.append("  return " + ", ".join(self._name(v, names) for v in self.outputs))
        lines += [f"  # {line}" for line in self.log]
        return "\n".join(lines)

    def __repr__(self):
        return (f"Graph(inputs={len(self.inputs)}, ops=[{', '.join(self.ops)}], "
                f"outputs={len(self.outputs)})")


def _check_input(v, given):
    """Refuse an input unlike the traced one where fusion decisions depended on it.

    dtype, device and rank must match; sizes may change (a smaller last batch), and arrays
    and Tensors are interchangeable (batch-norm folds check gradients at run time).
    """
    if v.shape is None:
        if not (given is v.obj or _same_plain(given, v.obj)):
            raise ValueError(f"Graph: input {v.index} was traced as {v.obj!r}, got {given!r}"
                             f" (non-array inputs are baked into the trace)")
        return
    got = Value.of("input", given, v.index)
    if got.shape is None or (len(got.shape), got.dtype, got.device) != (
            len(v.shape), v.dtype, v.device):
        raise ValueError(f"Graph: input {v.index} is {got.describe()}, the graph was traced "
                         f"with {v.describe()} (trace again, or use numbafuse.compile)")


def _same_plain(a, b):
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - any comparison failure means "not the same"
        return False


# --------------------------------------------------------------------------- tracing

_FORWARD_NAMES = {}


def _input_names(cls, count):
    """The names of ``cls.forward``'s array arguments (``arg0``... for ``*arrays``)."""
    names = _FORWARD_NAMES.get(cls)
    if names is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # drop self
        if any(p.kind == p.VAR_POSITIONAL for p in params):
            names = ()
        else:
            names = tuple(p.name for p in params)
        _FORWARD_NAMES[cls] = names
    if len(names) < count:
        names = names + tuple(f"arg{i}" for i in range(len(names), count))
    return names[:count]


class _Tracer:
    """The ``autograd._tracer`` hook: records each outermost ``Function.apply``."""

    def __init__(self):
        self.values = {}           # id(object) -> Value
        self.alive = []            # keeps traced objects alive so their ids stay unique
        self.nodes = []

    def value_of(self, obj, kind="const", index=None):
        if obj is None:
            return None
        v = self.values.get(id(obj))
        if v is None:
            v = Value.of(kind, obj, index)
            self.values[id(obj)] = v
            self.alive.append(obj)
        return v

    def __call__(self, function, inputs, output):
        if _nested_apply():
            return  # an op called inside another op's forward: part of that op
        names = _input_names(type(function), len(inputs))
        args = {name: self.value_of(i) for name, i in zip(names, inputs)}
        out = Value.of("node", output)
        self.values[id(output)] = out
        self.alive.append(output)
        self.nodes.append(Node(function.name, args, dict(function.params), out,
                               target=type(function)))


def _nested_apply():
    """True when more than one ``Function.apply`` is on the stack (the hook runs in one)."""
    code, depth = Function.apply.__code__, 0
    frame = sys._getframe(1)
    while frame is not None:
        depth += frame.f_code is code
        frame = frame.f_back
    return depth > 1


def _trace(fn, example_inputs):
    tracer = _Tracer()
    inputs = []
    for i, obj in enumerate(example_inputs):
        v = tracer.value_of(obj, "input", i) if obj is not None else Value("input", i)
        if v.index != i and Value.of("input", obj).shape is not None:
            raise ValueError(f"trace: example inputs {v.index} and {i} are the same object; "
                             f"pass distinct arrays so that their uses can be told apart")
        inputs.append(v if v.index == i else Value.of("input", obj, i))
    previous, autograd._tracer = autograd._tracer, tracer
    try:
        result = fn(*example_inputs)
    finally:
        autograd._tracer = previous
    single = not isinstance(result, (tuple, list))
    outputs = [tracer.value_of(r) for r in ((result,) if single else result)]
    if any(v is None for v in outputs):
        raise ValueError("trace: fn returned None; return the arrays or Tensors it computes")
    graph = Graph(inputs, tracer.nodes, outputs, single_output=single,
                  recording=autograd.is_recording())
    return graph, result


def trace(fn, *example_inputs) -> Graph:
    """Run ``fn(*example_inputs)`` once and record the numbafuse ops it performs.

    Values are followed by object identity: arguments of ``fn`` become graph inputs, outputs
    of recorded ops become op nodes, and any other array or Tensor an op reads (weights, running
    statistics) is a constant captured *by reference* (its current contents are used at run
    time). Only numbafuse ops are recorded, like ``torch.jit.trace``: arithmetic done outside
    them (e.g. plain NumPy on an intermediate) is frozen into a constant, and Python control
    flow is fixed by the examples. Running ``fn`` has its usual side effects: a training batch
    norm updates its running statistics once.

    Parameters
    ----------
    fn : callable
        Takes the example inputs, returns one array/Tensor or a tuple of them (e.g. a
        ``numbafuse.nn.Module``).
    *example_inputs
        Arrays, Tensors (recorded on the tape as usual) or plain values (baked in).

    Returns
    -------
    Graph

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> g = nf.trace(lambda x: nf.add(x, x), np.ones(2))
    >>> g.ops
    ['add']
    """
    return _trace(fn, example_inputs)[0]


# --------------------------------------------------------------------------- remapping

@dataclasses.dataclass
class _Rewrite:
    """A fusion: ``old`` nodes (in order, the root last) replaced by ``new`` nodes."""
    title: str
    old: list
    new: list
    folds: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Refusal:
    chain: list                    # the nodes matched, the root last
    reason: str


class _Matcher:
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


def _layouts(*nodes):
    layouts = [(n.op, n.arg("layout", "NCHW")) for n in nodes]
    if len({layout for _, layout in layouts}) > 1:
        return "layout mismatch: " + ", ".join(f"{op} {layout}" for op, layout in layouts)
    return None


def _conv_kwargs(conv):
    return {k: conv.arg(k, d) for k, d in _CONV_DEFAULTS.items()}


def _bn_kwargs(bn):
    return {k: bn.arg(k, d) for k, d in _BN_DEFAULTS.items()}


def _out_channels(conv):
    w = conv.arg("w")
    return w.shape[0] if isinstance(w, Value) and w.shape else None


def _bias_reason(b, K, op="bias_add"):
    if not isinstance(b, Value) or b.shape is None:
        return f"{op} b is not an array"
    if K is not None and b.shape != (K,):
        return f"b has shape {b.shape}, conv2d has {K} output channels"
    return None


def _public(op, output, **kwargs):
    positional = _PUBLIC_POSITIONAL[op]
    return Node(op, {k: kwargs[k] for k in positional if k in kwargs},
                {k: v for k, v in kwargs.items() if k not in positional}, output)


def _new_value(like, **changes):
    return dataclasses.replace(like, kind="node", index=None, obj=None, **changes)


def _is_training(bn):
    return bool(bn.arg("training", True))


# Each pattern takes (matcher, root) and returns a _Rewrite, a _Refusal or None (no match).

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
        return _Refusal(chain, reason)
    op = "conv_bias_relu" if with_relu else "conv_bias"
    title = {(True, False): FUSE_CONV_BIAS_RELU, (False, False): FUSE_CONV_BIAS,
             (True, True): FUSE_CONV_SQUEEZE_BIAS_RELU,
             (False, True): FUSE_CONV_SQUEEZE_BIAS}[with_relu, with_squeeze]
    y = _new_value(conv.output) if with_squeeze else root.output
    fused = [_public(op, y, x=conv.arg("x"), w=conv.arg("w"), b=b, **_conv_kwargs(conv))]
    if with_squeeze:
        fused.append(_public("squeeze", root.output, x=y, axis=squeeze.arg("axis")))
    return _Rewrite(title, chain, fused)


def _conv_relu(m, relu):
    conv = m.source(relu.arg("x"), "conv2d")
    if conv is None:
        return None
    chain = [conv, relu]
    reason = (m.intermediate_reason(chain)
              or _agree([("conv2d output", conv.output), ("relu output", relu.output)]))
    if reason:
        return _Refusal(chain, reason)
    fused = _public("conv_bias_relu", relu.output, x=conv.arg("x"), w=conv.arg("w"), b=None,
                    **_conv_kwargs(conv))
    return _Rewrite(FUSE_CONV_RELU, chain, [fused])


def _squeeze_channel_reason(conv, squeeze, badd):
    """Is bias_add's channel axis, after the squeeze, the conv's channel axis?"""
    layout = conv.arg("layout", "NCHW")
    axes = squeeze.arg("axis")
    axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes or ())
    ndim = 4
    axes = tuple(int(a) % ndim for a in axes)
    if not axes:
        return "squeeze without an explicit axis"
    channel = _arrays.channel_axis(layout)
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
    if add is None or add.arg("b", 1) != 1:
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
            refusal = refusal or _Refusal(chain, reason)
            continue
        fused = _public("batchnorm_add_relu", relu.output, x=bn.arg("x"), z=z,
                        gamma=bn.arg("gamma"), beta=bn.arg("beta"), **_bn_kwargs(bn))
        return _Rewrite(FUSE_BN_ADD_RELU, chain, [fused])
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
    reason = (m.intermediate_reason(chain) or _layouts(*chain[:-1] if with_relu else chain)
              or _agree([("conv2d output", conv.output), ("b", b)]
                        + [(f"batchnorm {k}", bn.arg(k)) for k in ("gamma", "beta")]
                        + [(f"{root.op} output", root.output)])
              or (_bias_reason(b, _out_channels(conv)) if badd else None))
    if reason:
        return _Refusal(chain, reason)
    if _is_training(bn):
        if badd:
            return _Refusal(chain, "batchnorm is in training mode: folding needs "
                                   "training=False, and conv_batchnorm_relu takes no bias")
        return _recompute(conv, bn, root, chain, with_relu)
    refusal = _fold_reason(m, bn, conv, b)
    if refusal is None:
        return _fold(conv, b, bn, root, chain, with_relu)
    if badd:
        return _Refusal(chain, refusal)
    # inference batch norm that cannot be folded: conv_batchnorm_relu(training=False) is exact
    rewrite = _recompute(conv, bn, root, chain, with_relu)
    rewrite.title += f" (inference, not folded: {refusal})"
    return rewrite


def _recompute(conv, bn, root, chain, with_relu):
    fused = _public("conv_batchnorm_relu", root.output, x=conv.arg("x"), w=conv.arg("w"),
                    gamma=bn.arg("gamma"), beta=bn.arg("beta"), **_bn_kwargs(bn),
                    **{k: v for k, v in _conv_kwargs(conv).items() if k != "layout"},
                    relu=with_relu)
    return _Rewrite(FUSE_CONV_BN_RELU if with_relu else FUSE_CONV_BN, chain, [fused])


def _fold_reason(m, bn, conv, b):
    """Why batch norm cannot be folded into the conv's constants (None if it can)."""
    sources = dict(w=conv.arg("w"), b=b, gamma=bn.arg("gamma"), beta=bn.arg("beta"),
                   running_mean=bn.arg("running_mean"), running_var=bn.arg("running_var"))
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
    fold = Fold(sources, float(bn.arg("eps", 1e-5)),
                dataclasses.replace(w, kind="folded", obj=None, is_tensor=False,
                                    requires_grad=False),
                Value("folded", shape=(w.shape[0],), dtype=w.dtype, device=w.device))
    kwargs = _conv_kwargs(conv)
    if with_relu:
        new = [_public("conv_bias_relu", root.output, x=conv.arg("x"), w=fold.w, b=fold.b,
                       **kwargs)]
    else:
        new = [_public("conv_bias", root.output, x=conv.arg("x"), w=fold.w, b=fold.b,
                       **kwargs)]
    return _Rewrite(FOLD_CONV_BN, chain, new, [fold])


# patterns tried at a root, by the root's op, longest first
_PATTERNS = {
    "relu": (functools.partial(_conv_bias_chain, with_relu=True, with_squeeze=False),
             functools.partial(_conv_bias_chain, with_relu=True, with_squeeze=True),
             _bn_add_relu, _conv_bn, _conv_relu),
    "batchnorm": (_conv_bn,),
    "bias_add": (functools.partial(_conv_bias_chain, with_relu=False, with_squeeze=True),
                 functools.partial(_conv_bias_chain, with_relu=False, with_squeeze=False)),
}


def remap(graph: Graph) -> Graph:
    """Rewrite the fusable chains of ``graph`` into fused ops; a new Graph (``graph`` untouched).

    Nodes are visited from the roots back (reverse topological order, as Grappler does); at
    each node not yet fused, the patterns ending there are tried longest first. A pattern whose
    ops match but whose conditions fail is *refused* with its reason, and the next pattern is
    tried. ``Graph.log`` of the result has one line per fusion made or refused; with
    ``NUMBAFUSE_LOG=remap`` the lines are also printed to stderr.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> w, b = np.ones((2, 1, 3, 3)), np.zeros(2)
    >>> def f(x):
    ...     return nf.relu(nf.bias_add(nf.conv2d(x, w, padding=1), b))
    >>> g = nf.remap(nf.trace(f, np.ones((1, 1, 4, 4))))
    >>> g.ops
    ['conv_bias_relu']
    """
    m = _Matcher(graph)
    replaced = {}                  # root node -> _Rewrite
    events = []                    # _Rewrite or _Refusal, in the order decided
    for root in reversed(graph.nodes):
        if root in m.fused:
            continue
        for pattern in _PATTERNS.get(root.op, ()):
            result = pattern(m, root)
            if result is None or _already_refused(result, events):
                continue
            events.append(result)
            if isinstance(result, _Rewrite):
                replaced[root] = result
                m.fused.update(result.old)
                break
    nodes, folds = [], []
    for node in graph.nodes:
        if node in replaced:
            nodes.extend(replaced[node].new)
            folds.extend(replaced[node].folds)
        elif node not in m.fused:
            nodes.append(dataclasses.replace(node))
    old_names = {n: n.name for n in graph.nodes}
    new_graph = Graph(graph.inputs, nodes, graph.outputs, single_output=graph.single_output,
                      folds=folds, recording=graph.recording)
    new_graph.log = [_describe(e, old_names) for e in events]
    if LOG_TOPIC in os.environ.get(LOG_ENV, "").split(","):
        for line in new_graph.log:
            print(f"numbafuse.remap: {line}", file=sys.stderr)
    for line in new_graph.log:
        logger.info(line)
    return new_graph


def _already_refused(result, events):
    """A refusal already logged for a longer chain, with the same reason (say it once)."""
    return isinstance(result, _Refusal) and any(
        isinstance(e, _Refusal) and e.reason == result.reason and set(result.chain) <= set(e.chain)
        for e in events)


def _describe(event, old_names):
    if isinstance(event, _Refusal):
        return (f"refused {'->'.join(n.op for n in event.chain)}: {event.reason} "
                f"[nodes {', '.join(old_names[n] for n in event.chain)}]")
    return (f"{event.title}: {', '.join(old_names[n] for n in event.old)} -> "
            f"{', '.join(n.name for n in event.new)}")


# --------------------------------------------------------------------------- compile

def _signature(obj):
    if isinstance(obj, Tensor):
        return ("Tensor", obj.shape, str(obj.dtype), obj.device, obj.requires_grad)
    if isinstance(obj, np.ndarray) or _arrays.is_device_array(obj):
        v = Value.of("input", obj)
        return ("array", v.shape, str(v.dtype), v.device)
    try:
        hash(obj)
        return ("value", type(obj).__name__, obj)
    except TypeError:
        return ("object", id(obj))


def _module_state(fn):
    """Training flags and parameter/buffer identities of an ``nn.Module`` (else empty)."""
    module = fn if hasattr(fn, "modules") else getattr(fn, "__self__", None)
    if module is None or not hasattr(module, "modules"):
        return ()
    state = []
    for sub in module.modules():
        state.append(bool(getattr(sub, "training", False)))
        for registry in ("_parameters", "_buffers"):
            state.extend(id(a) for a in getattr(sub, registry, {}).values())
    return tuple(state)


class Compiled:
    """``fn`` traced and remapped once per input signature; call it like ``fn``.

    The key is each argument's kind (array or Tensor), shape, dtype, device and
    ``requires_grad`` (plain values by value), whether the tape records, and for an
    ``nn.Module`` the training flags and identities of its parameters and buffers. The first
    call with a new key runs ``fn`` itself (the traced run; its results are returned) and
    caches the remapped graph; later calls run the graph. Weights and running statistics are
    read by reference at every run, and folded weights are recomputed at every run, so updating
    them in place needs no invalidation; :meth:`clear` drops the cache (e.g. after replacing a
    layer).
    """

    def __init__(self, fn):
        self.fn = fn
        self.graphs = {}
        self.graph = None          # the graph run by the last call

    def key(self, inputs):
        return (tuple(_signature(i) for i in inputs), autograd.is_recording(),
                _module_state(self.fn))

    def __call__(self, *inputs):
        key = self.key(inputs)
        graph = self.graphs.get(key)
        if graph is None:
            traced, result = _trace(self.fn, inputs)
            self.graph = self.graphs[key] = remap(traced)
            return result
        self.graph = graph
        return graph(*inputs)

    def clear(self):
        """Forget every cached graph: the next call traces again."""
        self.graphs.clear()
        self.graph = None

    def __repr__(self):
        return f"Compiled({getattr(self.fn, '__name__', type(self.fn).__name__)}, " \
               f"{len(self.graphs)} graphs)"


def compile(fn):  # noqa: A001 - the name of the contract
    """Trace + remap ``fn`` on the first call per input signature; run the cached graph after.

    Parameters
    ----------
    fn : callable
        A function of arrays/Tensors made of numbafuse ops, or an ``nn.Module`` (its
        ``__call__``), e.g. ``compile(model)``.

    Returns
    -------
    Compiled
        Callable like ``fn``; ``.graph`` is the remapped graph of the last call (see its
        ``log``), ``.clear()`` empties the cache.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> f = nf.compile(lambda x, z: nf.relu(nf.add(x, z)))
    >>> f(np.ones(2), -np.arange(2.0)).tolist(), f(np.ones(2), np.ones(2)).tolist()
    ([1.0, 0.0], [2.0, 2.0])
    """
    return Compiled(fn)
