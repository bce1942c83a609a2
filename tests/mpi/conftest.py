"""Tests run under MPI: ``mpiexec -n P python -m pytest tests/mpi`` (P = 2 and 3 in CI).

Every rank runs the same tests in the same order, so their collectives match; only rank 0
reports (the others run with ``-p no:terminal``-like quiet output, see ``tests/test_mpi.py``,
which launches these runs). Skipped when mpi4py is missing or the process is not under MPI.
"""
import pytest

mpi4py = pytest.importorskip("mpi4py", reason="mpi4py is needed: pip install 'numbafuse[distributed]'")


@pytest.fixture(scope="session")
def comm():
    from numbafuse import distributed
    c = distributed.init(abort_on_exception=False)
    if c.size < 2:
        pytest.skip("run under mpiexec -n 2 (or more)")
    return c
