"""kernels/cpu/steps.py: steps called through slots instead of linked into their callers.

The conv tests check the kernels that call steps (Winograd, the GEMMs) against references;
these check the mechanism: a declared signature is enforced when the caller is typed, a
caller run before ``ready`` raises instead of jumping to address 0, the caller's code does not
contain the step's, and a caller loaded from numba's disk cache in a new process finds its
step by the slot's name.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit, types
from numba.core import errors

from numbafuse.kernels.cpu.steps import Step


def _scale_into(x, a, out):
    for i in range(out.shape[0]):
        out[i] = a * x[i]


def _arr(f):
    return types.Array(f, 1, "C")


SCALE = Step(_scale_into, lambda f: [(_arr(f), types.int64, _arr(f))])
_scale = SCALE.call


@njit(nogil=True)
def _caller(x, out):
    for a in range(1, 3):
        _scale((x, a, out))


def test_a_call_runs_the_step_and_holds_none_of_its_code():
    x = np.arange(5, dtype=np.float32)
    out = np.zeros_like(x)
    SCALE.ready(np.float32)
    _caller(x, out)
    np.testing.assert_array_equal(out, 2 * x)
    # the step's compiled code is not in the caller's module: nothing there bears its numba
    # name (mangled as "11_scale_into"); the caller reads the address from the step's slot
    lines = _caller.inspect_llvm(_caller.signatures[0]).splitlines()
    assert not [ln for ln in lines if "11_scale_into" in ln]
    assert [ln for ln in lines if "_scale_into_float32_0" in ln and "external" in ln]
    # planted: a caller that calls the step's dispatcher itself has its code (inlined)
    direct = SCALE.dispatcher

    @njit(nogil=True)
    def linked(x, out):
        direct(x, 1, out)
    linked(x, out)
    assert [ln for ln in linked.inspect_llvm(linked.signatures[0]).splitlines()
            if "11_scale_into" in ln]


def test_an_undeclared_signature_is_a_typing_error():
    @njit
    def wrong(x, out):
        _scale((x, 1.5, out))            # a float where the step declared int64

    with pytest.raises(errors.TypingError, match="no declared signature"):
        wrong(np.zeros(3, np.float32), np.zeros(3, np.float32))


def test_a_call_before_ready_raises():
    step = Step(_double_into, lambda f: [(_arr(f), types.int64, _arr(f))])
    call = step.call

    @njit
    def early(x, out):
        call((x, 2, out))

    with pytest.raises(RuntimeError, match="before its ready"):
        early(np.zeros(3, np.float64), np.zeros(3, np.float64))
    step.ready(np.float64)
    out = np.zeros(3)
    early(np.ones(3), out)
    np.testing.assert_array_equal(out, 2.0)


def _double_into(x, a, out):
    for i in range(out.shape[0]):
        out[i] = a * x[i]


_MODULE = '''
import numpy as np
from numba import njit, types
from numbafuse.kernels.cpu.steps import Step

def _axpy(x, a, out):
    for i in range(out.shape[0]):
        out[i] += a * x[i]

def _one(f):
    return types.Array(f, 1, "C")

AXPY = Step(_axpy, lambda f: [(_one(f), f, _one(f))])
_axpy_call = AXPY.call

@njit(nogil=True, cache=True)
def kernel(x, out):
    _axpy_call((x, x.dtype.type(3), out))
'''

_RUN = '''
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import stepmod
stepmod.AXPY.ready(np.float32)
x = np.arange(4, dtype=np.float32)
out = np.ones(4, np.float32)
stepmod.kernel(x, out)
assert np.array_equal(out, 1 + 3 * x), out
print("cached" if stepmod.kernel.stats.cache_hits else "compiled")
'''


def test_a_cached_caller_finds_its_step_in_a_new_process(tmp_path):
    (tmp_path / "stepmod.py").write_text(textwrap.dedent(_MODULE))
    (tmp_path / "run.py").write_text(textwrap.dedent(_RUN))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert [r.stdout.split()[-1] for r in runs] == ["compiled", "cached"]


def test_a_step_made_again_shares_its_slot():
    # a module made again (reloaded) makes its Steps again: same names, the same slots, so
    # callers compiled against the first keep working
    again = Step(_scale_into, lambda f: [(_arr(f), types.int64, _arr(f))])
    assert [s for _, s, _ in again.slots] == [s for _, s, _ in SCALE.slots]
    again.ready(np.float64)
    x = np.arange(3.0)
    out = np.zeros(3)

    call = again.call

    @njit
    def use(x, out):
        call((x, 3, out))
    use(x, out)
    np.testing.assert_array_equal(out, 3 * x)


def _slice_from_slice(source):
    """Lines of ``source`` that assign an array slice from an array slice (``a[i:j] = b[k:]``)."""
    import ast

    def sliced(node):
        return isinstance(node, ast.Subscript) and any(
            isinstance(n, ast.Slice) for n in ast.walk(node.slice))
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Assign) and sliced(node.value)
            and any(sliced(t) for t in node.targets)]


def test_cpu_kernels_assign_no_array_slice_from_an_array():
    # Numba compiles an array-from-array slice assignment with its shape-mismatch message
    # (str, join, repr of ints): ~2.5 s on a cold start for the first one in a process, 0.5 s
    # for each new pair of ranks. The CPU kernels copy with element loops instead.
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent / "numbafuse" / "kernels"
    found = {str(p.relative_to(root)): lines for p in sorted(root.rglob("*.py"))
             if "cuda" not in p.name
             and (lines := _slice_from_slice(p.read_text()))}
    assert found == {}
    assert _slice_from_slice("d[a:b, :] = x[n, h, a:b, :]\nd[:, :] = 0\nd[i] = x[j]\n") == [1]
