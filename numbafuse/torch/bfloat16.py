"""bfloat16 torch tensors on the CPU, with or without ``ml_dtypes``.

NumPy has a bfloat16 dtype only where the optional ``ml_dtypes`` package is importable
(:data:`NUMPY_BF16`). There the bridge views a bfloat16 tensor's bits as such an array
(``bridge.as_array``, zero-copy) and numbafuse's ops convert it to float32 themselves
(``numbafuse/ops/precision.py``). Without it, :func:`widened` lets torch do the same
conversions around the float32 path of a public function:

    x.float() etc. (exact) -> the function on float32 tensors -> y.to(torch.bfloat16)

so the arithmetic is float32 and each result is rounded to bfloat16 once, as with
``ml_dtypes``: y by ``.to``, the input gradients by the backward of ``.float()``, which
rounds numbafuse's float32 dx, dw (and dz) to bfloat16. Batch-norm parameters and running
statistics given in float32 (autocast's mix) are passed as they are (their gradients and
updates stay float32); bfloat16 ones go through float32 copies, and updated running
statistics are copied back (one rounding each). The costs: one conversion pass per tensor
each way, and what backward keeps (x, w) is the float32 copy (twice the bytes of the
bfloat16 tensor).
"""
from __future__ import annotations

import functools
import inspect

import torch

from .. import validate

NUMPY_BF16 = next((d for d in validate.HALF_DTYPES if d.name == "bfloat16"), None)
"""NumPy's bfloat16 dtype (``ml_dtypes``), or None where it is not importable."""

RUNNING = ("running_mean", "running_var")


def numpy_dtype():
    """NumPy's bfloat16 dtype, for a view of a bfloat16 tensor's bits (a TypeError without
    ``ml_dtypes``: only :func:`widened`'s float32 copies reach the kernels then)."""
    if NUMPY_BF16 is None:
        raise TypeError("numbafuse: a bfloat16 tensor reached numbafuse's kernels without "
                        "ml_dtypes (pip install ml_dtypes); the public functions of "
                        "numbafuse.torch take bfloat16 tensors without it")
    return NUMPY_BF16


def widened(check):
    """Decorator: ``fn``, a public function of numbafuse.torch whose first argument is x, also
    for a bfloat16 x where NumPy has no bfloat16 (module docstring). ``check(op, **tensors)``
    (``bridge.check_tensors``) checks the tensors as given first: a bfloat16 x with a float32
    w is refused, as PyTorch refuses it, and not hidden by the conversion."""
    return functools.partial(_widened, check)


def _widened(check, fn):
    signature = inspect.signature(fn)
    op = f"numbafuse.torch.{fn.__name__}"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        x = args[0] if args else kwargs.get("x")
        if NUMPY_BF16 is not None or not isinstance(x, torch.Tensor) or \
                x.dtype != torch.bfloat16:
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        check(op, **{k: v for k, v in given.items() if isinstance(v, torch.Tensor)})
        wide = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16
                else v for k, v in given.items()}
        y = fn(**wide)
        with torch.no_grad():                       # updated running statistics, rounded
            for k in RUNNING:
                if wide.get(k) is not given.get(k) and given["training"]:
                    given[k].copy_(wide[k])
        return y.to(torch.bfloat16)

    return call
