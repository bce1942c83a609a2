"""Which NumPy and numba-cuda pairs the CUDA backend can run with (see ``numbafuse.cuda``'s
docstring, "NumPy 2.5"): checked before ``numba.cuda`` is imported."""
from __future__ import annotations

from importlib import metadata

import numpy as np

SUPPORTED_NUMBA_CUDA = ">=0.20, tested 0.30.4"
NUMPY_WITHOUT_ROW_STACK = (2, 5)
# No numba-cuda release works with NumPy >= 2.5 yet; the first that does goes here.
FIRST_NUMBA_CUDA_WITH_NUMPY_25 = None


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def compatibility_error(numpy_version: str, numba_cuda_version: str | None) -> str | None:
    """Why this NumPy / numba-cuda pair cannot compile CUDA kernels, or None if it can."""
    if _version_tuple(numpy_version)[:2] < NUMPY_WITHOUT_ROW_STACK:
        return None
    if numba_cuda_version is not None and FIRST_NUMBA_CUDA_WITH_NUMPY_25 is not None and \
            _version_tuple(numba_cuda_version) >= _version_tuple(FIRST_NUMBA_CUDA_WITH_NUMPY_25):
        return None
    return (f"numbafuse: the CUDA backend cannot run with NumPy {numpy_version} and numba-cuda "
            f"{numba_cuda_version or '(version unknown)'}: NumPy 2.5 removed np.row_stack, "
            f"which numba-cuda 0.30 (in maintenance mode) still registers, so every kernel "
            f"compilation fails. Install NumPy < 2.5 in this environment: "
            f"pip install 'numpy<2.5' (or reinstall with pip install 'numbafuse[cuda]', "
            f"which pins it). The CPU path is unaffected.")


def _numba_cuda_version() -> str | None:
    try:
        return metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return None


def require_compatible(numpy_version: str | None = None,
                       numba_cuda_version: str | None = None) -> None:
    """Raise ``RuntimeError`` when the installed NumPy and numba-cuda cannot work together."""
    message = compatibility_error(numpy_version or np.__version__,
                                  numba_cuda_version or _numba_cuda_version())
    if message:
        raise RuntimeError(message)


# numba-cuda's lowering finds the variables assigned once (kept in registers, not stack slots)
# by listing, for every such candidate, every assignment of its block: quadratic in a block's
# length. The conv GEMM kernels' unrolled register tiles make blocks of thousands of
# statements, so that scan was a third of their compilation (conv.gemm_fwd_nchw_32: 24 of 67 s
# under cProfile, numba-cuda 0.30.4). numba's own CPU lowering counts each block's assignments
# once (numba/core/lowering.py in numba 0.68); this is that count, installed on numba-cuda's
# Lower class while its method is still the scanning one (a later numba-cuda that changes it
# keeps its own). The same variables are found, so the same code is generated:
# tests/test_ptx.py compares the PTX both ways.
_SCANNING_LINE = "assign_stmts = self.blocks[defblk].find_insts("
_LOWERING = []                           # numba.cuda.lowering, once speed_up_lowering ran


def _counted_singly_assigned_variable(self):
    from collections import defaultdict

    lowering = _LOWERING[0]
    ir = lowering.ir
    sav = set()
    if not self.func_ir.func_id.is_generator:
        blocks = self.func_ir.blocks
        use_defs = lowering.compute_use_defs(blocks)
        alloca_vars = lowering.must_use_alloca(blocks)
        defined_in = defaultdict(set)
        for blk, names in use_defs.defmap.items():
            for name in names:
                defined_in[name].add(blk)
        used_in = defaultdict(set)
        for blk, names in use_defs.usemap.items():
            for name in names:
                used_in[name].add(blk)
        assignments = {}                 # block label -> {variable name: assignments}
        for label, block in self.blocks.items():
            counts = defaultdict(int)
            for stmt in block.find_insts(ir.assign_types):
                counts[stmt.target.name] += 1
            assignments[label] = counts
        for name, where in defined_in.items():
            if name not in alloca_vars and len(where) == 1 and not used_in[name]:
                [label] = where
                if assignments[label][name] == 1:
                    sav.add(name)
    self._singly_assigned_vars = sav
    self._blk_local_varmap = {}


def speed_up_lowering(lowering) -> bool:
    """Install the linear count on ``numba.cuda.lowering.Lower`` (the module is passed: this
    package imports numba.cuda in its ``__init__`` only) if it still scans; True if installed,
    now or before. Not for the simulator, which lowers nothing."""
    import inspect

    lower = getattr(lowering, "Lower", None)
    method = getattr(lower, "_find_singly_assigned_variable", None)
    if method is None:
        return False
    if method is _counted_singly_assigned_variable:
        return True
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    if _SCANNING_LINE not in source:
        return False
    _LOWERING[:] = [lowering]
    lower._scanning_singly_assigned_variable = method      # kept for the PTX comparison
    lower._find_singly_assigned_variable = _counted_singly_assigned_variable
    return True
