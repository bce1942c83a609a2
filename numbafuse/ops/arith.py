"""Elementwise arithmetic on the tape: add, sub, mul, sum, mean, reshape.

These are what losses and residual connections need; ``add(x, z)`` is also the unfused ``Add``
of the BatchNorm -> Add -> ReLU chain. Operands are same-shape arrays or Python scalars (on the
host NumPy broadcasting is allowed too, and the gradient is summed back to each shape). The
work is done by the ``elementwise`` kernels of the arrays' backend. This module also gives
``Tensor`` its operators (``autograd.define_operators``), so the tape imports no op.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from .. import autograd, backend, kernels, reference, validate
from ..autograd import Function
from . import precision
from .spec import OpSpec


def _is_scalar(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _elementwise(a):
    """The elementwise kernel module of ``a``'s backend."""
    return kernels.module("elementwise", backend.backend_of_array(a))


def _sum_to_shape(g, shape):
    """Undo NumPy broadcasting: sum ``g`` down to ``shape`` (host only)."""
    if g.shape == tuple(shape):
        return g
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _check_pair(op, x, z):
    which = backend.backend_of(op, x=x, z=z)
    validate.check_half_dtypes(op, which, x=x, z=z)
    if which == backend.CUDA and tuple(x.shape) != tuple(z.shape):
        raise ValueError(f"{op}: on the device, x and z must have the same shape, got "
                         f"{tuple(x.shape)} and {tuple(z.shape)}")
    if which == backend.CPU:
        try:
            np.broadcast_shapes(x.shape, z.shape)
        except ValueError:
            raise ValueError(f"{op}: x of shape {x.shape} and z of shape {z.shape} do not "
                             f"broadcast") from None
    return which


def _check_one(op, x, half=False):
    which = backend.backend_of(op, x=x)
    if half:
        validate.check_half_dtypes(op, which, x=x)
    else:
        validate.check_float_dtypes(op, x=x)
    return kernels.contiguous(x)


# Half precision (float16; bfloat16 on the CPU): add, sub, mul and their scalar forms
# compute in float32 and round each result once to x's dtype (``ops/precision.py``).

def _f32(a):
    return precision.compute(kernels.contiguous(a))


# --------------------------------------------------------------------------- add / sub

class Add(Function):
    """``y = x + sign * z`` (``sign`` 1 or -1): add and sub share one rule.

    fwd :: (x, z) -> y;  bwd :: dy -> (dy, sign * dy), summed back to each input's shape.
    """

    @dataclasses.dataclass(frozen=True)
    class Params:
        sign: int                 # 1: add, -1: sub

    @property
    def name(self):
        return "add" if self.params.sign == 1 else "sub"

    def forward(self, x, z):
        _check_pair(self.name, x, z)
        self.x_shape, self.z_shape = tuple(x.shape), tuple(z.shape)
        dtype = x.dtype
        x, z = _f32(x), _f32(z)
        return precision.store(_elementwise(x).axpby(1.0, x, float(self.params.sign), z), dtype)

    def backward(self, dy):
        need_x, need_z = self.needs_input_grad
        dtype, host = dy.dtype, isinstance(dy, np.ndarray)
        g = _f32(dy) if host or self.params.sign != 1 else dy    # half: summed in float32
        dx = dz = None
        if need_x:
            dx = precision.store(_sum_to_shape(g, self.x_shape), dtype) if host else dy
        if need_z:
            dz = g if self.params.sign == 1 else _elementwise(g).axpby(-1.0, g, 0.0, g)
            dz = precision.store(_sum_to_shape(dz, self.z_shape) if host else dz, dtype)
        return dx, dz


class AffineScalar(Function):
    """``y = a*x + c`` for Python scalars ``a``, ``c``; ``op`` names the call that made it
    (add, sub or mul with a scalar), and is the node's name in a trace.

    fwd :: x -> y;  bwd :: dy -> a*dy.
    """

    @dataclasses.dataclass(frozen=True)
    class Params:
        a: float
        c: float
        op: str

    @property
    def name(self):
        return self.params.op

    def forward(self, x):
        x = _check_one(self.name, x, half=True)
        dtype, x = x.dtype, _f32(x)
        ew = _elementwise(x)
        if self.params.c == 0.0:
            return precision.store(ew.axpby(self.params.a, x, 0.0, x), dtype)
        shift = ew.fill(backend.empty(backend.backend_of_array(x), x.shape, x.dtype),
                        self.params.c)
        return precision.store(ew.axpby(self.params.a, x, 1.0, shift), dtype)

    def backward(self, dy):
        g = _f32(dy)
        return (precision.store(_elementwise(g).axpby(self.params.a, g, 0.0, g), dy.dtype),)


# --------------------------------------------------------------------------- mul

class Mul(Function):
    """``y = x * z`` elementwise.

    fwd :: (x, z) -> (y, residuals=(x, z));  bwd :: dy -> (dy * z, dy * x).
    """
    name = "mul"

    def forward(self, x, z):
        _check_pair(self.name, x, z)
        x, z = kernels.contiguous(x), kernels.contiguous(z)
        self.save_for_backward(x=x, z=z)                # half: kept in half
        return precision.store(_elementwise(x).mul(_f32(x), _f32(z)), x.dtype)

    def backward(self, dy):
        x, z = self.saved.x, self.saved.z
        g = _f32(dy)
        ew = _elementwise(g)
        need_x, need_z = self.needs_input_grad
        dx = ew.mul(g, _f32(z)) if need_x else None
        dz = ew.mul(g, _f32(x)) if need_z else None
        if isinstance(dy, np.ndarray):
            dx = None if dx is None else _sum_to_shape(dx, x.shape)
            dz = None if dz is None else _sum_to_shape(dz, z.shape)
        return precision.store(dx, dy.dtype), precision.store(dz, dy.dtype)


# --------------------------------------------------------------------------- sum / mean

class Sum(Function):
    """``y = scale * sum(x)``, a 0-d array (accumulated in float64); ``scale`` is 1 for sum,
    1/size for mean, ``op`` names which.

    fwd :: x -> y (nothing saved but the shape);  bwd :: dy -> scale * dy everywhere.
    """

    @dataclasses.dataclass(frozen=True)
    class Params:
        scale: float
        op: str

    @property
    def name(self):
        return self.params.op

    def forward(self, x):
        x = _check_one(self.name, x)
        self.x_shape, self.x_dtype = tuple(x.shape), np.dtype(x.dtype)
        return _elementwise(x).sum_all(x, self.params.scale)          # 0-d

    def backward(self, dy):
        ew = _elementwise(dy)
        which = backend.backend_of_array(dy)
        scale = ew.fill(backend.empty(which, self.x_shape, self.x_dtype), self.params.scale)
        return (ew.scale_by_device_scalar(kernels.contiguous(dy).reshape(1), scale),)


# --------------------------------------------------------------------------- reshape

class Reshape(Function):
    """A view with a new shape.

    fwd :: x -> x viewed as ``shape``;  bwd :: dy -> dy viewed back (the tape copies a leaf's
    gradient that shares memory with another's).
    """
    name = "reshape"

    @dataclasses.dataclass(frozen=True)
    class Params:
        shape: tuple

    def forward(self, x):
        self.x_shape = tuple(x.shape)
        return kernels.contiguous(x).reshape(self.params.shape)

    def backward(self, dy):
        return (kernels.contiguous(dy).reshape(self.x_shape),)


# --------------------------------------------------------------------------- public functions

def _apply_binary(x, z, sign, op):
    if _is_scalar(z):
        return AffineScalar(a=1.0, c=sign * float(z), op=op).apply(x)
    if _is_scalar(x):
        return AffineScalar(a=float(sign), c=float(x), op=op).apply(z)
    return Add(sign=sign).apply(x, z)


def add(x, z):
    """Elementwise ``x + z`` (the unfused Add of BatchNorm -> Add -> ReLU).

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> nf.add(np.ones(3), np.arange(3.0))
    array([1., 2., 3.])
    """
    return _apply_binary(x, z, 1, "add")


def sub(x, z):
    """Elementwise ``x - z`` (either may be a Python scalar).

    >>> import numpy as np, numbafuse.ops.arith as arith
    >>> arith.sub(np.ones(2), 0.5)
    array([0.5, 0.5])
    """
    return _apply_binary(x, z, -1, "sub")


def mul(x, z):
    """Elementwise ``x * z`` (either may be a Python scalar).

    >>> import numpy as np, numbafuse.ops.arith as arith
    >>> arith.mul(np.arange(3.0), np.arange(3.0))
    array([0., 1., 4.])
    """
    if _is_scalar(z):
        return AffineScalar(a=float(z), c=0.0, op="mul").apply(x)
    if _is_scalar(x):
        return AffineScalar(a=float(x), c=0.0, op="mul").apply(z)
    return Mul().apply(x, z)


def sum(x):  # noqa: A001 - the NumPy-style name
    """Sum of all elements, a 0-d array (or Tensor); accumulated in float64.

    >>> import numpy as np, numbafuse as nf
    >>> nf.Tensor(np.arange(4.0)).sum().item()
    6.0
    """
    return Sum(scale=1.0, op="sum").apply(x)


def mean(x):
    """Mean of all elements, a 0-d array (or Tensor).

    >>> import numpy as np, numbafuse as nf
    >>> nf.Tensor(np.arange(4.0)).mean().item()
    1.5
    """
    size = int(np.prod(autograd.unwrap(x).shape, dtype=np.int64))
    return Sum(scale=1.0 / max(size, 1), op="mean").apply(x)


def reshape(x, shape):
    """``x`` with a new shape (one dimension may be -1).

    >>> import numpy as np, numbafuse as nf
    >>> nf.Tensor(np.arange(6.0)).reshape(2, -1).shape
    (2, 3)
    """
    return Reshape(shape=tuple(shape)).apply(x)


autograd.define_operators(add=add, sub=sub, mul=mul, sum=sum, mean=mean, reshape=reshape)

SPECS = (
    OpSpec("add", add, Add, reference=reference.add, half=True),
    OpSpec("sub", sub, Add, half=True),
    OpSpec("mul", mul, Mul, half=True),
    OpSpec("sum", sum, Sum),
    OpSpec("mean", mean, Sum),
    OpSpec("reshape", reshape, Reshape),
)
