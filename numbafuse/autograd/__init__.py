"""A minimal define-by-run tape.

``tensor.py`` holds :class:`Tensor`; ``function.py`` :class:`Function` (one forward/backward
pair, typed parameters, named residuals), the grad mode and the apply hooks; ``engine.py`` the
backward pass, which is a topological sort and one loop. All cleverness lives in the per-op
``backward`` rules of ``numbafuse/ops``. Nothing here imports an op.
"""
from .engine import saved_bytes
from .function import Function, NoParams, apply_hook, is_recording, no_grad
from .tensor import Tensor, define_operators, unwrap

__all__ = ["Tensor", "Function", "NoParams", "no_grad", "is_recording", "apply_hook",
           "saved_bytes", "define_operators", "unwrap"]
