"""Tests run under MPI: ``mpiexec -n P python -m pytest tests/mpi`` (P = 2 and 3 in CI).

Every rank runs the same tests in the same order, so their collectives match; only rank 0
reports (the others run with ``-p no:terminal``-like quiet output, see ``tests/test_mpi.py``,
which launches these runs). Skipped when mpi4py is missing or the process is not under MPI.

A failure on one rank ends the whole job at once: the ranks would otherwise drift apart (the
failing rank goes on to the next test while the others wait in a collective of this one, and
the job hangs until test_mpi.py's timeout). So a failed test report on any rank prints the
failure to stderr with the rank and calls ``MPI_Abort``; and a test that runs longer than
``MPI_TEST_TIMEOUT`` s (``NUMBAFUSE_MPI_TEST_TIMEOUT``; a hang without a failure: a rank in
a collective the others never reach) dumps every thread's traceback and exits that rank,
which ends the job as well.
"""
import faulthandler
import os
import sys
import time

import pytest

mpi4py = pytest.importorskip("mpi4py",
                             reason="mpi4py is needed: pip install 'numbafuse[distributed]'")


@pytest.fixture(scope="session")
def comm():
    from numbafuse import distributed
    c = distributed.init(abort_on_exception=False)
    if c.size < 2:
        pytest.skip("run under mpiexec -n 2 (or more)")
    return c


# seconds a single test may take on a rank before the job ends
MPI_TEST_TIMEOUT = float(os.environ.get("NUMBAFUSE_MPI_TEST_TIMEOUT", "120"))


def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _real_stderr(config):
    """A descriptor of the process's stderr as it was before pytest captured it (what is
    written to fd 2 while a test runs goes to pytest's capture file, lost when the rank exits)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    saved = getattr(getattr(getattr(capman, "_global_capturing", None), "err", None),
                    "targetfd_save", None)
    return saved if isinstance(saved, int) else sys.stderr.fileno()


@pytest.fixture(autouse=True)
def _hang_watchdog(request):
    faulthandler.dump_traceback_later(MPI_TEST_TIMEOUT, exit=True,
                                      file=_real_stderr(request.config))
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    world = _world()
    if report.failed and world.Get_size() > 1:
        sys.stderr.write(f"\n[rank {world.Get_rank()}] {item.nodeid} failed ({report.when}); "
                         f"aborting all {world.Get_size()} ranks:\n{report.longreprtext}\n")
        sys.stderr.flush()
        # mpiexec forwards a rank's output through its own process: MPI_Abort right after the
        # write lost the whole message now and then under load (CI, 2026-12-01: empty stdout
        # and stderr); the same grace as numbafuse.distributed's abort hook
        from numbafuse.distributed import ABORT_GRACE_S
        time.sleep(ABORT_GRACE_S)
        world.Abort(1)
