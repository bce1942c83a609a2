"""Every op of ``numbafuse.ops.OPS``, every check of the harness, every backend.

The op cases are in ``tests/op_cases.py``, the checks in ``tests/harness.py``; the ``backend``
argument is injected by ``tests/conftest.py`` (CPU here, CUDA in the ``-m cuda`` process).
Run one op: ``python -m pytest tests/test_ops.py -k conv_bias_relu``.
"""
import contextlib

import numpy as np
import pytest
from hypothesis import settings

from numbafuse import kernels

from .harness import CHECKS, OpCase, run_property
from .op_cases import CASES
from numbafuse.ops import OPS


def _ops(check):
    """The ops a check applies to: all, or the fused ones (NumPy-style backward, chain)."""
    if check == "numpy_backward":
        return sorted(n for n in CASES if OPS[n].backward is not None)
    if check == "chain":
        return sorted(n for n in CASES if OPS[n].fuses)
    return sorted(CASES)


def _run(check, op, backend, dtype=None):
    case = CASES[op]
    fn, cost = CHECKS[check]
    run_property(f"{check}:{op}:{backend.name}", cost * case.cost * backend.cost,
                 lambda draw: fn(case, backend, case.draw(draw, backend, dtype=dtype), draw))


@contextlib.contextmanager
def _ci_examples(backend):
    """Within the block, CI's derandomized examples for ``backend`` (the profile of the leg
    that runs it: "ci" on the CPU, "quick" on the simulator) where the loaded profile draws
    at random (the README's "dev"); a derandomized profile stays."""
    if settings.default.derandomize:
        yield
        return
    name = (settings.get_current_profile_name() if hasattr(settings, "get_current_profile_name")
            else settings._current_profile)                  # (hypothesis before 6.1xx)
    settings.load_profile("ci" if backend.name == "cpu" else "quick")
    try:
        yield
    finally:
        settings.load_profile(name)


def test_every_op_has_a_case():
    assert sorted(CASES) == sorted(OPS), "an op of numbafuse.ops.OPS has no case in " \
                                         "tests/op_cases.py (or a case names no op)"


def test_fused_ops_declare_their_numpy_backward_and_chain():
    for name in _ops("numpy_backward"):
        assert type(CASES[name]).numpy_backward is not OpCase.numpy_backward, name
    for name in _ops("chain"):
        assert CASES[name].chain is not None, name


@pytest.mark.parametrize("op", _ops("forward"))
def test_forward(op, backend):
    _run("forward", op, backend)


@pytest.mark.parametrize("op", _ops("tape"))
def test_tape_backward(op, backend):
    _run("tape", op, backend)


@pytest.mark.parametrize("op", _ops("gradcheck"))
def test_gradcheck(op, backend):
    _run("gradcheck", op, backend, dtype=np.float64)


@pytest.mark.parametrize("op", _ops("numpy_backward"))
def test_numpy_style_backward(op, backend):
    _run("numpy_backward", op, backend)


@pytest.mark.parametrize("op", _ops("chain"))
def test_fused_equals_unfused_chain(op, backend):
    _run("chain", op, backend)


@pytest.mark.parametrize("op", _ops("deterministic"))
def test_deterministic(op, backend):
    _run("deterministic", op, backend)


@pytest.mark.parametrize("kernel", ["conv_forward", "conv_backward"])
def test_the_checks_fail_on_a_wrong_kernel(kernel, backend):
    """A check that cannot fail is a defect: results of the conv kernels scaled by 1.001 fail
    the forward (conv_forward) and the tape's backward (conv_backward) checks."""
    module = kernels.module("conv", backend.name)
    elementwise = kernels.module("elementwise", backend.name)
    real = getattr(module, kernel)

    def wrong(*args):
        out = real(*args)
        scale = lambda a: None if a is None else elementwise.axpby(1.001, a, 0.0, a)  # noqa
        return tuple(map(scale, out)) if isinstance(out, tuple) else scale(out)

    # the examples CI draws, under any profile: some random draws had gradients too small for
    # a 1.001 scale to leave the tolerance (the README's dev profile: 1 of 27 runs on machine
    # A, 2026-12-01)
    with pytest.MonkeyPatch.context() as mp, _ci_examples(backend):
        mp.setattr(module, kernel, wrong)
        with pytest.raises(AssertionError):
            _run("forward" if kernel == "conv_forward" else "tape", "conv2d", backend)
