"""The ops at the kernels' partition boundaries, on every backend.

For each (backend, op family) of ``tests/harness.py``'s ``BOUNDARIES`` table: the knobs are
patched (chunk sizes, launch sizes), the shapes drawn past the boundaries they and the
compile-time tiles set (H past the CPU row blocks, C and K past the CUDA tiles, M past a
reduction's grid-stride step...), ``crosses`` confirms each example really crosses them, and
the op's forward and tape backward are checked against the reference there.
"""
import pytest

from numbafuse import kernels
from numbafuse.kernels import interfaces

from .harness import BACKENDS, BOUNDARIES, check_forward, check_tape, knob, patched, \
    run_property
from .op_cases import CASES

COST = 2     # an example here runs the forward twice and the backward once, on larger shapes

# (backend, family) pairs with nothing to partition, and why
NO_BOUNDARIES = {("cpu", "elementwise"): "NumPy expressions, no kernels of numbafuse's own"}


def _params():
    return [pytest.param(b, family, op, id=f"{b}-{family}-{op}",
                         marks=[pytest.mark.cuda] if b == "cuda" else [])
            for (b, family), boundary in BOUNDARIES.items() for op in boundary.ops]


def test_every_kernel_family_has_a_boundary_table():
    for family in kernels.FAMILIES:
        for b in BACKENDS:
            assert (b, family) in BOUNDARIES or (b, family) in NO_BOUNDARIES, (b, family)
    for family, (_, modules) in interfaces.FAMILIES.items():   # grouped kernels (cpu_grouped,
        for module in modules:                                  # cuda_grouped): a table each
            b, _, kind = module.partition("_")
            if kind == "grouped":
                assert (b, f"grouped_{family}") in BOUNDARIES, module
    for boundary in BOUNDARIES.values():
        assert set(boundary.ops) <= set(CASES)


@pytest.mark.parametrize("backend_name, family, op", _params())
def test_ops_across_kernel_boundaries(backend_name, family, op):
    backend, boundary, case = BACKENDS[backend_name], BOUNDARIES[backend_name, family], CASES[op]

    def body(draw):
        ex = case.draw(draw, backend, **boundary.shapes())
        with patched(boundary, draw, ex.dims):
            assert boundary.crosses(ex.dims, knob), (
                f"BOUNDARIES[{backend_name!r}, {family!r}] no longer reaches its boundaries "
                f"with {ex.dims}: adapt the table to the kernels ({boundary.why})")
            check_forward(case, backend, ex, draw)
            check_tape(case, backend, ex, draw)

    run_property(f"boundary:{backend_name}:{family}:{op}", COST * case.cost * backend.cost,
                 body)
