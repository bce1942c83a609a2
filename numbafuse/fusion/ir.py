"""The graph a trace records and the remapper rewrites: values, op nodes, batch-norm folds.

A :class:`Graph` holds its input :class:`Value` objects, its op :class:`Node` objects in
execution order, its output Values and the :class:`Fold` objects (inference batch norm folded
into a conv's weights, recomputed at every run); calling it runs the ops.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from .. import autograd, backend
from ..autograd import Tensor
from ..ops import OPS
from ..ops.conv_batchnorm import fold_batchnorm


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
        data = autograd.unwrap(obj)
        is_array = isinstance(data, np.ndarray) or backend.is_device_array(data)
        return cls(kind, index, obj if kind in ("const", "input") else None,
                   tuple(data.shape) if is_array else None,
                   np.dtype(data.dtype) if is_array else None,
                   (backend.CUDA if backend.is_device_array(data) else backend.CPU)
                   if is_array else None,
                   isinstance(obj, Tensor), isinstance(obj, Tensor) and obj.requires_grad)

    def describe(self):
        if self.shape is None:
            return repr(self.obj) if self.kind == "const" else self.kind
        kind = "Tensor" if self.is_tensor else "array"
        return f"{kind}{self.shape} {self.dtype}{' cuda' if self.device == backend.CUDA else ''}"


@dataclasses.dataclass(eq=False)
class Node:
    """One op call. ``args`` are its array arguments by name, in call order (Values or None);
    ``params`` its other arguments (plain values, or Values for arrays such as running stats).

    A traced node rebuilds its Function: ``target(**params).apply(*args)``; a node made by
    :func:`~numbafuse.fusion.remap` calls the public function of its op (``OPS[op]``):
    ``f(*args, **params)``.
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
        return OPS[self.op].function(*args, **params)


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
        src = {k: autograd.unwrap(v.obj if isinstance(v, Value) else v)
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
            if isinstance(v, np.ndarray) or backend.is_device_array(v):
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
