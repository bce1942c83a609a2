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
    """
    name: str
    function: Callable
    function_class: type
    reference: Callable | None = None
    backward: Callable | None = None
    fuses: tuple = ()

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
