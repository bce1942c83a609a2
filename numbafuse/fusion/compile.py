"""``compile(fn)``: trace and remap ``fn`` once per input signature, run the cached graph
after."""
from __future__ import annotations

import numpy as np

from .. import autograd, backend
from ..autograd import Tensor
from .ir import Value
from .remap import remap
from .trace import trace_calls


def _signature(obj):
    if isinstance(obj, Tensor):
        return ("Tensor", obj.shape, str(obj.dtype), obj.device, obj.requires_grad)
    if isinstance(obj, np.ndarray) or backend.is_device_array(obj):
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
            traced, result = trace_calls(self.fn, inputs)
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
