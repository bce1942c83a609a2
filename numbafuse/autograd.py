"""A minimal define-by-run tape.

A :class:`Function` is one forward/backward pair. ``apply`` runs ``forward`` on plain arrays
and, when a ``Tensor`` input requires a gradient and recording is on, links the output
``Tensor`` to the Function so ``Tensor.backward`` can walk back. What ``backward`` needs is
declared with ``save_for_backward(name=array, ...)`` and read back as ``self.saved.name``.

The whole backward pass is :func:`_toposort` plus the loop in :meth:`Tensor.backward`; all
cleverness lives in the per-op ``backward`` methods (``numbafuse/ops``).
"""
from __future__ import annotations

import contextlib
import types

import numpy as np

from . import _arrays

_recording = True
_tracer = None  # set by numbafuse.remap.trace: called as _tracer(function, inputs, output)


@contextlib.contextmanager
def no_grad():
    """Context manager: nothing is recorded on the tape inside it."""
    global _recording
    previous, _recording = _recording, False
    try:
        yield
    finally:
        _recording = previous


def is_recording() -> bool:
    return _recording


class Tensor:
    """An array (NumPy or CUDA) with an optional gradient and a link to the op that made it."""

    __array_priority__ = 1000  # so ndarray (op) Tensor defers to Tensor's reflected operators

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data.data
        if not (isinstance(data, np.ndarray) or _arrays.is_device_array(data)):
            data = np.asarray(data)
        if _arrays.is_device_array(data):
            data = _arrays.as_device_array(data)
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._fn = None  # the Function whose output this is (None for leaves)

    # -- array-like facts
    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: np.dtype(self.data.dtype))
    ndim = property(lambda self: len(self.data.shape))
    size = property(lambda self: int(np.prod(self.data.shape, dtype=np.int64)))
    device = property(lambda self: _arrays.CUDA if _arrays.is_device_array(self.data)
                      else _arrays.CPU)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device!r}{grad})"

    def numpy(self) -> np.ndarray:
        """The data as a host NumPy array (a copy for device data)."""
        return _arrays.to_host(self.data)

    def item(self) -> float:
        return self.numpy().reshape(-1)[0].item()

    def detach(self) -> "Tensor":
        return Tensor(self.data)

    def zero_grad(self):
        self.grad = None

    # -- arithmetic (the Functions live in ops/arith.py)
    def __add__(self, other):
        from .ops import arith
        return arith.add(self, other)

    def __sub__(self, other):
        from .ops import arith
        return arith.sub(self, other)

    def __mul__(self, other):
        from .ops import arith
        return arith.mul(self, other)

    def __neg__(self):
        from .ops import arith
        return arith.mul(self, -1.0)

    def __radd__(self, other):
        return self.__add__(other)

    def __rmul__(self, other):
        return self.__mul__(other)

    def __rsub__(self, other):
        from .ops import arith
        return arith.sub(other, self)

    def sum(self):
        from .ops import arith
        return arith.sum(self)

    def mean(self):
        from .ops import arith
        return arith.mean(self)

    def reshape(self, *shape):
        from .ops import arith
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return arith.reshape(self, shape)

    # -- the backward pass
    def backward(self, grad=None):
        """Accumulate d(self)/d(leaf) . grad into ``.grad`` of every leaf that requires it."""
        if grad is None:
            if self.size != 1:
                raise ValueError(f"backward: grad must be given for a tensor of shape {self.shape}"
                                 f" (only one-element tensors default to 1)")
            grad = np.ones(self.shape, self.dtype)
            grad = _arrays.to_device(grad) if self.device == _arrays.CUDA else grad
        elif isinstance(grad, Tensor):
            grad = grad.data
        _check_grad(self, grad)
        grads, handed_out = {id(self): grad}, {_memory_key(grad)}
        for t in reversed(_toposort(self)):
            g = grads.pop(id(t), None)
            if g is None:
                continue
            if t._fn is None:  # a leaf
                if t.grad is not None:
                    t.grad = _accumulate(t.grad, g)
                else:  # its own memory, never shared with the caller's grad or another leaf's
                    key = _memory_key(g)
                    t.grad = _arrays.copy(g) if key is None or key in handed_out else g
                    handed_out.add(_memory_key(t.grad))
                continue
            for inp, g_in in zip(t._fn.inputs, t._fn.backward(g)):
                if inp is None or g_in is None or not inp.requires_grad:
                    continue
                grads[id(inp)] = g_in if id(inp) not in grads else _accumulate(grads[id(inp)],
                                                                               g_in)


def _check_grad(t, grad):
    if not (isinstance(grad, np.ndarray) or _arrays.is_device_array(grad)):
        raise TypeError(f"backward: grad must be an array or a Tensor, got {type(grad).__name__}")
    if tuple(grad.shape) != t.shape:
        raise ValueError(f"backward: grad has shape {tuple(grad.shape)}, tensor has {t.shape}")
    device = _arrays.CUDA if _arrays.is_device_array(grad) else _arrays.CPU
    if device != t.device or np.dtype(grad.dtype) != t.dtype:
        raise TypeError(f"backward: grad is a {device} {np.dtype(grad.dtype)} array but the "
                        f"tensor is {t.device} {t.dtype}")


def _memory_key(a):
    """What identifies the memory behind ``a`` (its owner's id, or the device pointer); None
    where that cannot be told (the simulator's device arrays)."""
    if isinstance(a, np.ndarray):
        return id(a if a.base is None else a.base)
    interface = getattr(a, "__cuda_array_interface__", None)
    return None if interface is None else interface["data"][0]


def _accumulate(a, b):
    from .ops import arith
    return arith.add_arrays(a, b)


def _toposort(root: Tensor) -> list:
    """Tensors reachable from ``root`` through requires-grad links, inputs before outputs."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if t._fn is not None:
            stack.extend((i, False) for i in t._fn.inputs if i is not None and i.requires_grad)
    return order


class Function:
    """One forward/backward pair. Subclasses define ``forward(*arrays)`` and ``backward(gy)``.

    ``forward`` receives plain arrays (``None`` for absent optional inputs) and returns one
    array; ``backward`` receives the output's gradient and returns one gradient (or ``None``)
    per input, computing only those in ``self.needs_input_grad``. Constructor keyword
    arguments are the op's non-differentiable parameters, available as attributes.
    """

    name = "function"  # the public op name (``"conv2d"``...), used by the remapper and in errors

    def __init__(self, **params):
        self.params = params  # kept whole so the remapper can rebuild the op
        self.__dict__.update(params)
        self.saved = types.SimpleNamespace()
        self.inputs = ()
        self.needs_input_grad = ()

    def forward(self, *arrays):
        raise NotImplementedError

    def backward(self, gy):
        raise NotImplementedError

    def save_for_backward(self, **residuals):
        """Declare what backward reads: ``self.saved.<name>``; counted by :func:`saved_bytes`."""
        self.saved = types.SimpleNamespace(**residuals)

    def apply(self, *inputs):
        """Run forward. Arrays in: an array out. Any Tensor in: a Tensor out, on the tape."""
        any_tensor = any(isinstance(i, Tensor) for i in inputs)
        arrays = [i.data if isinstance(i, Tensor) else i for i in inputs]
        self.needs_input_grad = tuple(_recording and isinstance(i, Tensor) and i.requires_grad
                                      for i in inputs)
        out = self.forward(*arrays)
        if any_tensor:
            out = Tensor(out)
            if _recording and any(self.needs_input_grad):
                out.requires_grad = True
                out._fn = self
                self.inputs = tuple(i if isinstance(i, Tensor) else None for i in inputs)
        if out is None or not getattr(out, "_fn", None):
            self.saved = types.SimpleNamespace()  # nothing will read it: free it now
        if _tracer is not None:
            _tracer(self, inputs, out)
        return out


def saved_bytes(t: Tensor) -> int:
    """Bytes held for backward by the graph reaching ``t``, each array counted once."""
    seen, total = set(), 0
    for node in _toposort(t):
        if node._fn is None:
            continue
        for a in vars(node._fn.saved).values():
            if a is None or not hasattr(a, "nbytes") or id(a) in seen:
                continue
            seen.add(id(a))
            total += int(a.nbytes)
    return total
