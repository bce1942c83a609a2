"""The elementwise helpers of ``cuda.py`` for host arrays, with NumPy: fill, copy,
a*x + b*y, x*y, sum. Same names and semantics, so callers dispatch by backend alone; on the
host ``axpby`` and ``mul`` also broadcast (NumPy's rules). And the host SGD step of one
parameter, compiled (:func:`sgd_param_step`)."""
import numpy as np
from numba import njit


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


def cast(src, dtype):
    """``src`` converted to ``dtype`` (a C-contiguous copy; ``src`` itself when it already is
    ``dtype``): NumPy's conversion, round to nearest even."""
    if np.dtype(src.dtype) == np.dtype(dtype):
        return src
    return src.astype(dtype)


def cast_into(src, dst):
    """``dst[...] = src`` converted to dst's dtype; returns ``dst``."""
    np.copyto(dst, src, casting="unsafe")
    return dst


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


@njit(nogil=True, cache=True)
def _sgd_step(p, g, b, s, use_wd, use_m, first):
    # s = (lr, momentum, weight_decay) in p's dtype; each operation rounded as NumPy's
    # elementwise steps round it (no contraction into FMAs: Numba leaves fastmath off)
    lr, m, wd = s[0], s[1], s[2]
    for i in range(p.size):
        gi = g[i]
        if use_wd:
            gi = gi + wd * p[i]
        if use_m:
            if first:
                b[i] = gi
            else:
                b[i] = b[i] * m + gi
            gi = b[i]
        p[i] = p[i] - lr * gi


def sgd_scalars(lr, momentum, weight_decay, dtype):
    """``s`` of :func:`sgd_param_step`: (lr, momentum, weight_decay) in the parameters' dtype."""
    return np.array((lr, momentum, weight_decay), dtype)


def sgd_param_step(p, g, b, s, use_wd, use_m, first):
    """One SGD step of a parameter, in place: ``p``, ``g`` and the momentum buffer ``b``
    C-contiguous arrays of one float dtype and one shape (``b`` unused without momentum);
    ``s`` from :func:`sgd_scalars`; ``use_wd``, ``use_m``: weight decay, momentum nonzero;
    ``first``: b gets g instead of ``momentum * b + g``. The arithmetic of the NumPy steps
    ``g = g + wd*p; b *= m; b += g; p -= lr*b`` in p's dtype, bit for bit (tests/test_nn.py),
    in one pass: ~2-4 us a parameter of the digits net against ~10 for the NumPy calls."""
    _sgd_step(p.reshape(-1), g.reshape(-1), b.reshape(-1), s, use_wd, use_m, first)
