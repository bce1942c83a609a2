"""Tracing: run a function once and record the numbafuse ops it calls as a :class:`Graph`.

The recorder is an ``autograd.apply_hook``: it sees every outermost ``Function.apply`` (an op
called inside another op's forward is part of that op), and follows values by identity.
"""
from __future__ import annotations

import inspect

from .. import autograd
from .ir import Graph, Node, Value


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
    """An ``autograd.apply_hook``: records each outermost ``Function.apply``."""

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
        names = _input_names(type(function), len(inputs))
        args = {name: self.value_of(i) for name, i in zip(names, inputs)}
        out = Value.of("node", output)
        self.values[id(output)] = out
        self.alive.append(output)
        self.nodes.append(Node(function.name, args, function.param_dict(), out,
                               target=type(function)))


def trace_calls(fn, example_inputs):
    """``(graph, result)``: the Graph of the Function calls made by ``fn(*example_inputs)``
    and what that call returned (``trace`` keeps only the graph; ``fusion.compile`` needs
    both)."""
    tracer = _Tracer()
    inputs = []
    for i, obj in enumerate(example_inputs):
        v = tracer.value_of(obj, "input", i) if obj is not None else Value("input", i)
        if v.index != i and Value.of("input", obj).shape is not None:
            raise ValueError(f"trace: example inputs {v.index} and {i} are the same object; "
                             f"pass distinct arrays so that their uses can be told apart")
        inputs.append(v if v.index == i else Value.of("input", obj, i))
    with autograd.apply_hook(tracer):
        result = fn(*example_inputs)
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
    return trace_calls(fn, example_inputs)[0]
