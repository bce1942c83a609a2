"""The ops: one module per op family, each holding its ``autograd.Function`` subclasses and
public functions, and ending with ``SPECS``, the one description of each public op
(:class:`~numbafuse.ops.spec.OpSpec`) that the remapper, the test harness and the docs read.

``OPS`` maps each op's name to its spec. ``python -m numbafuse.ops`` prints the op table of
``docs/ops.md``.
"""
from . import arith, basic, batchnorm, conv, conv_batchnorm
from .spec import OpSpec

OPS = {spec.name: spec
       for module in (conv, batchnorm, conv_batchnorm, basic, arith)
       for spec in module.SPECS}

__all__ = ["OPS", "OpSpec"]
