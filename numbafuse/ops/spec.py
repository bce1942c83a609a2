"""How an op is described, once: :class:`OpSpec`.

Each op module ends with ``SPECS``, one :class:`OpSpec` per public op; ``numbafuse.ops.OPS``
collects them by name. The remapper builds fused nodes from them, the test harness finds each
op's reference and backward in them, and ``docs/ops.md`` is generated from them
(``python -m numbafuse.ops`` prints it), instead of each keeping its own table.

What a spec does not hold it derives, so nothing is written twice: the array arguments are
those of ``Function.forward``, the parameters are the fields of ``Function.Params``, and the
defaults are those of the public function's signature.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One public op.

    name : the op's name (``Function.name``, the trace's node name, the public function's name)
    function : the public function, ``function(*arrays, **keywords)``
    function_class : the ``autograd.Function`` subclass it applies
    reference : the plain NumPy forward in ``numbafuse.reference`` (None where there is none)
    backward : the NumPy-style backward, gradients in the order of the forward's arrays
        (fused ops; None elsewhere)
    fuses : the unfused ops it replaces, in order (empty for an unfused op)
    half : the arrays of the op may be half precision (float16; bfloat16 on the CPU with
        ``ml_dtypes``), computed in float32 (``ops/precision.py``); else float32 or float64
    half_params : the arguments (arrays or keyword arrays) that may be float32 when x is half
        (a batch norm's parameters and running statistics); the others share x's dtype
    """
    name: str
    function: Callable
    function_class: type
    reference: Callable | None = None
    backward: Callable | None = None
    fuses: tuple = ()
    half: bool = False
    half_params: tuple = ()

    @property
    def arrays(self) -> tuple:
        """Names of the array arguments, in order (``Function.forward``'s parameters)."""
        params = list(inspect.signature(self.function_class.forward).parameters)[1:]
        return tuple(params)

    @property
    def params(self) -> tuple:
        """Names of the Function's non-array parameters (``Function.Params``)."""
        return tuple(f.name for f in dataclasses.fields(self.function_class.Params))

    @property
    def keywords(self) -> dict:
        """The public function's non-array arguments and their defaults (``inspect.Parameter
        .empty`` where there is none)."""
        signature = inspect.signature(self.function)
        return {n: p.default for n, p in signature.parameters.items() if n not in self.arrays}

    def summary(self) -> str:
        """The first line of the public function's docstring."""
        return (inspect.getdoc(self.function) or "").splitlines()[0]


DTYPE_RULES = """\
## Dtypes

One dtype for every floating array of a call (float32 or float64), except where the table says
otherwise; a mix is a `TypeError` naming the op and the argument. The half-precision ops take
float16 arrays (bfloat16 too on the CPU where `ml_dtypes` is importable; numba.cuda has no
bfloat16) and compute in float32, as cuDNN and PyTorch autocast do: float32 accumulation, one
rounding of each result to half. Batch-norm parameters and running statistics of a half x are
x's dtype or float32, all one dtype; those of a float32 or float64 x are x's dtype (PyTorch's
rules: it refuses float64 parameters with a float32 x, and float16 ones with a float32 or
bfloat16 x). The batch statistics and the saved mean/invstd are float64 (as for every dtype),
and dgamma, dbeta come back in the parameters' dtype.

How half runs. Batch norm on CUDA: its kernels load and store float16 x, z, y, dy, dx, dz
themselves and compute in float32 (the reductions sum in float64, as for every dtype), so a
half batch norm moves half the bytes of a float32 one; half parameters and running statistics
are converted to float32 first (C values each). Everywhere else the conversion is at the op
boundary, in one place (`numbafuse/ops/precision.py`: `compute`, `store`, `store_into`): half
inputs are converted to float32, the float32 kernels run, the results are converted back
(half running statistics are written back in place). On the CPU (Numba has no fast float16
arithmetic) that conversion is NumPy's; for the convolutions on CUDA it is one elementwise
kernel per array (for relu, bias_add, add, sub and mul as well), an extra pass over each half
array (2 bytes read and 4 written per element going in, 4 read and 2 written coming out) and
float32 temporaries: there half precision
saves memory where its arrays are kept (x, w, y for backward), not time inside the op. The
Conv-BatchNorm ops (`conv_batchnorm_relu`, and `ConvBatchNormAddReLU` beneath
`numbafuse.torch`) convert x, w (and z) once at their boundary and run the float32 chain; their
residuals keep x and w as given (half), so the recompute in backward converts them again. The
float32 and float64 paths are unchanged.
"""


def dtype_table(specs) -> str:
    """The ``docs/ops.md`` section on dtypes: :data:`DTYPE_RULES` and one row per op of
    ``specs`` (a name -> :class:`OpSpec` mapping) that takes half precision."""
    lines = [DTYPE_RULES, "| op | x, w, z, y and their gradients | float32 when x is half "
             "| computed in |", "|---|---|---|---|"]
    for name in sorted(specs):
        spec = specs[name]
        if spec.half:
            params = ", ".join(f"`{p}`" for p in spec.half_params) or "(none)"
            lines.append(f"| `{name}` | float16, bfloat16 (CPU), float32, float64 | {params} "
                         f"| float32 for half, else x's dtype |")
    return "\n".join(lines) + "\n"
