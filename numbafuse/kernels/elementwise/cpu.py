"""The elementwise helpers of ``cuda.py`` for host arrays, with NumPy: fill, copy,
a*x + b*y, x*y, sum. Same names and semantics, so callers dispatch by backend alone; on the
host ``axpby`` and ``mul`` also broadcast (NumPy's rules)."""
import numpy as np


def fill(out, value):
    out[...] = value
    return out


def axpby(a, x, b, y, out=None):
    """``a*x + b*y`` in x's dtype; ``b == 0``: ``a*x`` (y unread, so 0*inf makes no NaN).

    Into ``out`` when given (it may be ``x`` or ``y``), else into a new array.
    """
    dtype = x.dtype.type
    if b == 0:
        return np.multiply(x, dtype(a), out=out)
    if a == 1 and b == 1:
        return np.add(x, y, out=out)
    if a == 1 and b == -1:
        return np.subtract(x, y, out=out)
    result = dtype(a) * x + dtype(b) * y
    if out is None:
        return result
    out[...] = result
    return out


def mul(x, y):
    return x * y


def scale_by_device_scalar(scale, x):
    """``scale[0] * x`` (``scale`` a one-element array)."""
    return x * scale.reshape(())


def contiguous_copy(src):
    """A C-contiguous copy of ``src``."""
    return np.array(src, order="C")


def sum_all(x, scale=1.0):
    """``scale`` times the sum of every element (both in float64), as a 0-d array of x's
    dtype."""
    return np.asarray(x.sum(dtype=np.float64) * scale, dtype=x.dtype)
