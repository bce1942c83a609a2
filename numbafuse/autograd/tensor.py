"""``Tensor``: an array (NumPy or CUDA) with an optional gradient and a link to the op that
made it.

Arithmetic on Tensors (``+ - *``, ``.sum()``, ``.mean()``, ``.reshape()``) is defined by the
ops layer, which registers its public functions with :func:`define_operators` (as HIPS
autograd's numpy layer defines the operators of its boxes), so this module imports no op.
"""
from __future__ import annotations

import numpy as np

from .. import backend, kernels
from . import engine

_OPERATORS = {}   # name -> public op function, filled by numbafuse.ops.arith


def define_operators(**functions):
    """Register the functions behind Tensor arithmetic: add, sub, mul, sum, mean, reshape."""
    _OPERATORS.update(functions)


def _operator(name):
    try:
        return _OPERATORS[name]
    except KeyError:
        raise TypeError(f"Tensor.{name}: no op is registered (import numbafuse)") from None


def unwrap(a):
    """A ``Tensor``'s array (its ``.data``); anything else (an array, ``None``) as it is."""
    return a.data if isinstance(a, Tensor) else a


class Tensor:
    """An array (NumPy or CUDA) with an optional gradient and a link to the op that made it."""

    __array_priority__ = 1000  # so ndarray (op) Tensor defers to Tensor's reflected operators

    def __init__(self, data, requires_grad=False):
        if isinstance(data, Tensor):
            data = data.data
        if not (isinstance(data, np.ndarray) or backend.is_device_array(data)):
            data = np.asarray(data)
        if backend.is_device_array(data):
            data = backend.as_device_array(data)
        self.data = data
        self.requires_grad = bool(requires_grad)
        self._grad = None
        self._grad_owned = False   # True while .grad is a buffer the tape allocated
        self._fn = None            # the Function whose output this is (None for leaves)

    # -- the gradient: assigned by the tape (which may then add into it in place) or the user
    @property
    def grad(self):
        return self._grad

    @grad.setter
    def grad(self, value):
        self._grad, self._grad_owned = value, False

    def _set_grad(self, value):
        self._grad, self._grad_owned = value, True

    def zero_grad(self):
        self.grad = None

    # -- array-like facts
    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: np.dtype(self.data.dtype))
    ndim = property(lambda self: len(self.data.shape))
    size = property(lambda self: int(np.prod(self.data.shape, dtype=np.int64)))
    device = property(lambda self: backend.CUDA if backend.is_device_array(self.data)
                      else backend.CPU)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device!r}{grad})"

    def numpy(self) -> np.ndarray:
        """The data as a host NumPy array (a copy for device data)."""
        return backend.to_host(self.data)

    def item(self) -> float:
        return self.numpy().reshape(-1)[0].item()

    def detach(self) -> "Tensor":
        return Tensor(self.data)

    # -- arithmetic (the ops layer's functions; see define_operators)
    def __add__(self, other):
        return _operator("add")(self, other)

    def __radd__(self, other):
        return _operator("add")(self, other)

    def __sub__(self, other):
        return _operator("sub")(self, other)

    def __rsub__(self, other):
        return _operator("sub")(other, self)

    def __mul__(self, other):
        return _operator("mul")(self, other)

    def __rmul__(self, other):
        return _operator("mul")(self, other)

    def __neg__(self):
        return _operator("mul")(self, -1.0)

    def sum(self):
        return _operator("sum")(self)

    def mean(self):
        return _operator("mean")(self)

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _operator("reshape")(self, shape)

    # -- the backward pass
    def backward(self, grad=None):
        """Accumulate d(self)/d(leaf) . grad into ``.grad`` of every leaf that requires it.

        ``grad`` defaults to 1 for a one-element tensor; otherwise pass an array (or Tensor)
        of this tensor's shape, dtype and device.
        """
        if grad is None:
            if self.size != 1:
                raise ValueError(f"backward: grad must be given for a tensor of shape {self.shape}"
                                 f" (only one-element tensors default to 1)")
            grad = kernels.ones_seed(self.device, self.shape, self.dtype)   # (no host copy)
        grad = unwrap(grad)
        _check_grad(self, grad)
        engine.backward(self, grad)


def _check_grad(t, grad):
    if not (isinstance(grad, np.ndarray) or backend.is_device_array(grad)):
        raise TypeError(f"backward: grad must be an array or a Tensor, got {type(grad).__name__}")
    if tuple(grad.shape) != t.shape:
        raise ValueError(f"backward: grad has shape {tuple(grad.shape)}, tensor has {t.shape}")
    device = backend.backend_of_array(grad)
    if device != t.device or np.dtype(grad.dtype) != t.dtype:
        raise TypeError(f"backward: grad is a {device} {np.dtype(grad.dtype)} array but the "
                        f"tensor is {t.device} {t.dtype}")
