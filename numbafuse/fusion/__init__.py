"""The remapper, after TensorFlow Grappler's: trace unfused code, rewrite op chains into fused
ops, and say what was fused and why a fusion was refused.

    ir.py        Value, Node, Fold, Graph: what a trace records and a remap rewrites
    trace.py     trace(fn, *example_inputs) -> Graph (an autograd apply hook)
    patterns.py  the rewrite rules (Grappler's conv/bias/relu, batchnorm/add/relu, conv/batchnorm
                 recompute and folding patterns), built from numbafuse.ops.OPS
    remap.py     remap(graph) -> Graph: the driver and its log
    compile.py   compile(fn): trace + remap per input signature, cached

The functions are the top-level ``numbafuse.trace``, ``numbafuse.remap`` and
``numbafuse.compile``; this package re-exports none of them, so ``numbafuse.fusion.remap`` is
always the module and ``numbafuse.remap`` always the function.
"""
