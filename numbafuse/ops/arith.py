"""Elementwise arithmetic on the tape: add, sub, mul, sum, mean, reshape.

These are what losses and residual connections need. ``add(x, z)`` is also the unfused
``Add`` of the BatchNorm -> Add -> ReLU chain. Operands are same-shape arrays or Python scalars
(on the host, NumPy broadcasting is allowed too and the gradient is summed back to shape).
"""
import numbers

import numpy as np

from .. import _arrays
from ..autograd import Function, Tensor


def _is_scalar(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def add_arrays(a, b):
    """``a + b`` for two same-backend arrays (used for gradient accumulation)."""
    if isinstance(a, np.ndarray):
        return a + b
    from ..kernels.cuda import elementwise as ew
    return ew.axpby(1.0, _arrays.contiguous(a), 1.0, _arrays.contiguous(b))


def _sum_to_shape(g, shape):
    """Undo NumPy broadcasting: sum ``g`` down to ``shape`` (host only)."""
    if g.shape == tuple(shape):
        return g
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _check_pair(op, x, z):
    backend = _arrays.backend_of(op, x=x, z=z)
    _arrays.check_float_dtypes(op, x=x, z=z)
    if backend == _arrays.CUDA and tuple(x.shape) != tuple(z.shape):
        raise ValueError(f"{op}: on the device, x and z must have the same shape, got "
                         f"{tuple(x.shape)} and {tuple(z.shape)}")
    if backend == _arrays.CPU:
        try:
            np.broadcast_shapes(x.shape, z.shape)
        except ValueError:
            raise ValueError(f"{op}: x of shape {x.shape} and z of shape {z.shape} do not "
                             f"broadcast") from None
    return backend


class Add(Function):
    """``y = a*x + b*z`` (``a``, ``b`` in {1, -1}): add and sub share one rule.

    fwd :: (x, z) -> y;  bwd :: gy -> (a*gy, b*gy), summed back to each input's shape.
    """
    name = "add"

    def forward(self, x, z):
        backend = _check_pair(self.name, x, z)
        self.x_shape, self.z_shape = tuple(x.shape), tuple(z.shape)
        if backend == _arrays.CPU:
            return x + z if self.b == 1 else x - z
        from ..kernels.cuda import elementwise as ew
        return ew.axpby(1.0, _arrays.contiguous(x), float(self.b), _arrays.contiguous(z))

    def backward(self, gy):
        gx = gz = None
        if isinstance(gy, np.ndarray):
            if self.needs_input_grad[0]:
                gx = _sum_to_shape(gy, self.x_shape)
            if self.needs_input_grad[1]:
                gz = _sum_to_shape(gy if self.b == 1 else -gy, self.z_shape)
            return gx, gz
        from ..kernels.cuda import elementwise as ew
        return (gy if self.needs_input_grad[0] else None,
                (gy if self.b == 1 else ew.axpby(-1.0, gy, 0.0, gy))
                if self.needs_input_grad[1] else None)


class AffineScalar(Function):
    """``y = a*x + c`` for Python scalars ``a``, ``c`` (``name``: the op that made it: add,
    sub or mul with a scalar).

    fwd :: x -> y;  bwd :: gy -> a*gy.
    """
    name = "affine"

    def forward(self, x):
        _arrays.backend_of(self.name, x=x)
        _arrays.check_float_dtypes(self.name, x=x)
        if isinstance(x, np.ndarray):
            return (x * x.dtype.type(self.a) + x.dtype.type(self.c)).astype(x.dtype, copy=False)
        from ..kernels.cuda import elementwise as ew
        x = _arrays.contiguous(x)
        if self.c == 0.0:
            return ew.axpby(self.a, x, 0.0, x)
        ones = ew.fill(_arrays.empty_like_backend(_arrays.CUDA, x.shape, x.dtype), self.c)
        return ew.axpby(self.a, x, 1.0, ones)

    def backward(self, gy):
        if isinstance(gy, np.ndarray):
            return (gy * gy.dtype.type(self.a),)
        from ..kernels.cuda import elementwise as ew
        return (ew.axpby(self.a, gy, 0.0, gy),)


class Mul(Function):
    """``y = x * z`` elementwise.  fwd :: (x, z) -> (y, residuals=(x, z));  bwd :: gy -> (gy*z, gy*x)."""
    name = "mul"

    def forward(self, x, z):
        backend = _check_pair("mul", x, z)
        self.save_for_backward(x=x, z=z)
        if backend == _arrays.CPU:
            return x * z
        from ..kernels.cuda import elementwise as ew
        return ew.mul(_arrays.contiguous(x), _arrays.contiguous(z))

    def backward(self, gy):
        x, z = self.saved.x, self.saved.z
        if isinstance(gy, np.ndarray):
            return (_sum_to_shape(gy * z, x.shape) if self.needs_input_grad[0] else None,
                    _sum_to_shape(gy * x, z.shape) if self.needs_input_grad[1] else None)
        from ..kernels.cuda import elementwise as ew
        return (ew.mul(gy, z) if self.needs_input_grad[0] else None,
                ew.mul(gy, x) if self.needs_input_grad[1] else None)


class Sum(Function):
    """``y = scale * sum(x)`` (a 0-d array); ``scale`` is 1 for sum, 1/size for mean.

    bwd :: gy -> scale * gy broadcast to x's shape.
    """
    name = "sum"

    # fwd :: x -> y (0-d);  bwd :: gy -> gy * scale everywhere (nothing saved but the shape)
    def forward(self, x):
        _arrays.backend_of(self.name, x=x)
        _arrays.check_float_dtypes(self.name, x=x)
        self.x_shape, self.x_dtype = tuple(x.shape), np.dtype(x.dtype)
        if isinstance(x, np.ndarray):
            # float64 accumulation keeps float32 losses accurate
            return np.asarray(x.sum(dtype=np.float64) * self.scale, dtype=x.dtype)
        from ..kernels.cuda import elementwise as ew
        total = ew.sum_all(_arrays.contiguous(x))
        return total if self.scale == 1.0 else ew.axpby(self.scale, total.reshape(1), 0.0,
                                                        total.reshape(1)).reshape(())

    def backward(self, gy):
        if isinstance(gy, np.ndarray):
            return (np.full(self.x_shape, gy.reshape(()) * self.scale, dtype=self.x_dtype),)
        from ..kernels.cuda import elementwise as ew
        ones = ew.fill(_arrays.empty_like_backend(_arrays.CUDA, self.x_shape, self.x_dtype),
                       self.scale)
        return (ew.scale_by_device_scalar(gy.reshape(1), ones),)


class Reshape(Function):
    """A view with a new shape.  fwd :: x -> x viewed as ``shape``;  bwd :: gy -> gy reshaped
    back (a view: the tape copies a leaf's gradient that shares memory with another's)."""
    name = "reshape"

    def forward(self, x):
        self.x_shape = tuple(x.shape)
        return _arrays.contiguous(x).reshape(self.shape)

    def backward(self, gy):
        return (_arrays.contiguous(gy).reshape(self.x_shape),)


def _apply_binary(x, z, sign, op):
    if _is_scalar(z):
        return AffineScalar(a=1.0, c=sign * float(z), name=op).apply(x)
    if _is_scalar(x):
        return AffineScalar(a=float(sign), c=float(x), name=op).apply(z)
    return Add(b=sign, name=op).apply(x, z)


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
        return AffineScalar(a=float(z), c=0.0, name="mul").apply(x)
    if _is_scalar(x):
        return AffineScalar(a=float(x), c=0.0, name="mul").apply(z)
    return Mul().apply(x, z)


def sum(x):  # noqa: A001 - the NumPy-style name
    """Sum of all elements, a 0-d array (or Tensor); accumulated in float64 on the host.

    >>> import numpy as np, numbafuse as nf
    >>> nf.Tensor(np.arange(4.0)).sum().item()
    6.0
    """
    return Sum(scale=1.0, name="sum").apply(x)


def mean(x):
    """Mean of all elements, a 0-d array (or Tensor).

    >>> import numpy as np, numbafuse as nf
    >>> nf.Tensor(np.arange(4.0)).mean().item()
    1.5
    """
    size = int(np.prod((x.data if isinstance(x, Tensor) else x).shape, dtype=np.int64))
    return Sum(scale=1.0 / max(size, 1), name="mean").apply(x)


def reshape(x, shape):
    """``x`` with a new shape (one dimension may be -1).

    >>> import numpy as np, numbafuse as nf
    >>> nf.Tensor(np.arange(6.0)).reshape(2, -1).shape
    (2, 3)
    """
    return Reshape(shape=tuple(shape)).apply(x)
