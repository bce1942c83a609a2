"""Half precision at the op boundary: the one place half arrays become float32 and back.

The ops that take half precision (``conv_bias_relu``, ``conv2d``, ``conv_bias``, their
backward, ``batchnorm_add_relu``, ``batchnorm``, their backward, and the elementwise ops of an
unfused model: ``relu``, ``bias_add``, ``add``, ``sub``, ``mul``) store x, w, z, y and the
activation gradients in float16 (or bfloat16 on the CPU, with ``ml_dtypes``) and compute in
float32 (``validate.compute_dtype``), as cuDNN and PyTorch autocast do: their array helpers
convert the half inputs with :func:`compute`, run the float32 kernels, and convert the results
with :func:`store` (the CUDA batch-norm kernels take float16 activations themselves: there
only the parameters are converted, ``ops/batchnorm.py``'s ``HALF_KERNELS``).
On the CPU the conversion is NumPy's; on the device it is one elementwise
kernel per array (``kernels/elementwise/cuda.py``: ``cast``), an extra pass over each half
array (reads 2 bytes and writes 4 per element going in, reads 4 and writes 2 coming out).
Conversions round to nearest even; float32 -> float16 overflows to inf past 65504.

    compute(a) -> a in its compute dtype (float32 for a half array; ``a`` itself otherwise)
    store(a, dtype) -> a converted to ``dtype`` (``a`` itself when it already is)
    store_into(dst, src) -> dst, with ``dst[...] = src`` converted (in place: running stats)

Each takes and returns arrays on one backend (NumPy, or CUDA device arrays); ``None`` passes
through. Other op families (Conv-BatchNorm-ReLU, the PyTorch front end) reuse them.
"""
from __future__ import annotations

import numpy as np

from .. import backend, kernels, validate


def _elementwise(a):
    return kernels.module("elementwise", backend.backend_of_array(a))


def compute(a):
    """``a`` in its compute dtype: a float32 copy of a half array, else ``a`` itself."""
    if a is None or not validate.is_half(a.dtype):
        return a
    return _elementwise(a).cast(kernels.contiguous(a), validate.COMPUTE_DTYPE)


def store(a, dtype):
    """``a`` converted to ``dtype`` (``a`` itself when it already is ``dtype``, or None)."""
    if a is None or np.dtype(a.dtype) == np.dtype(dtype):
        return a
    return _elementwise(a).cast(kernels.contiguous(a), dtype)


def store_into(dst, src):
    """``dst[...] = src`` converted to dst's dtype, in place (``dst`` contiguous on the
    device); returns ``dst``."""
    if dst is not None and src is not dst:
        which = backend.backend_of_array(dst)
        target = dst if which == backend.CPU else backend.as_device_array(dst)
        _elementwise(dst).cast_into(kernels.contiguous(src), target)
    return dst
