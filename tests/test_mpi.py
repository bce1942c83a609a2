"""Run the MPI tests (tests/mpi) under ``mpiexec -n 2`` and ``-n 3`` (an uneven split), and
check what a failing rank does to the others. Skipped without mpi4py / mpiexec."""
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np

import pytest

pytest.importorskip("mpi4py", reason="mpi4py is needed: pip install 'numbafuse[distributed]'")
MPIEXEC = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not os.path.exists(MPIEXEC),
                                                  reason="mpiexec not found")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 240          # a hang fails the test instead of blocking CI forever


def _mpiexec(n, args, timeout=TIMEOUT, env=None):
    cmd = [MPIEXEC, "-n", str(n), sys.executable] + args
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_suite(ranks):
    run = _mpiexec(ranks, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mpi", "-k",
                           "not device"])         # the device tests: under the simulator below
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout.split("\n")[-2]


def test_mpi_device_tests_under_the_cuda_simulator():
    run = _mpiexec(2, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/mpi", "-k",
                       "device"], env={"NUMBA_ENABLE_CUDASIM": "1"})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.split("\n")[-2]


def test_a_rank_that_raises_ends_the_job_instead_of_hanging(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from numbafuse import distributed
        comm = distributed.init()
        if comm.rank == 1:
            raise RuntimeError("rank 1 breaks")
        comm.allreduce_sum(np.ones(3))      # rank 0 waits here for a rank that is gone
    """))
    run = _mpiexec(2, [str(script)], timeout=60)
    assert run.returncode != 0
    assert "rank 1 breaks" in run.stderr and "aborting all 2 ranks" in run.stderr


def test_a_failing_mpi_test_ends_the_job_instead_of_hanging(tmp_path):
    # rank 1 fails an assertion while rank 0 goes on to a collective of the same test: without
    # tests/mpi/conftest.py's abort the job would hang until TIMEOUT
    shutil.copy(os.path.join(ROOT, "tests", "mpi", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_fails_mpi.py").write_text(textwrap.dedent("""
        import numpy as np

        def test_one_rank_fails(comm):
            assert comm.rank != 1, "rank 1 disagrees"
            comm.allreduce_sum(np.ones(3))

        def test_after(comm):
            comm.allreduce_sum(np.ones(3))
    """))
    run = _mpiexec(2, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                       str(tmp_path), str(tmp_path)], timeout=90)
    assert run.returncode != 0
    out = run.stdout + run.stderr
    assert "rank 1 disagrees" in out and "[rank 1] " in out and "aborting all 2 ranks" in out, \
        f"returncode {run.returncode}, output:\n{out[-3000:]}"


def test_an_mpi_test_that_hangs_without_failing_ends_the_job(tmp_path):
    # rank 0 waits for a message that never comes, rank 1 in a barrier that rank 0 never
    # reaches: no failure to abort on, the watchdog ends the job
    shutil.copy(os.path.join(ROOT, "tests", "mpi", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_hangs_mpi.py").write_text(textwrap.dedent("""
        from mpi4py import MPI

        def test_rank_0_waits_alone(comm):
            if comm.rank == 0:
                MPI.COMM_WORLD.recv(source=1, tag=7)
            else:
                MPI.COMM_WORLD.Barrier()
    """))
    run = _mpiexec(2, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                       str(tmp_path), str(tmp_path)], timeout=90,
                   env={"NUMBAFUSE_MPI_TEST_TIMEOUT": "5"})
    assert run.returncode != 0
    assert "Timeout" in run.stderr and "test_rank_0_waits_alone" in run.stderr


def test_distributed_training_follows_the_one_process_loss_curve(tmp_path):
    import json
    args = ["-m", "numbafuse.train", "--epochs", "1", "--train-subset", "160",
            "--test-subset", "64", "--batch-size", "32", "--no-progress"]
    one = subprocess.run([sys.executable] + args + ["--report", str(tmp_path / "one.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr[-3000:]
    for ranks in (2, 3):                                      # 3: shards of 11 and 10 rows
        report = tmp_path / f"ranks{ranks}.json"
        run = _mpiexec(ranks, args + ["--distributed", "--report", str(report)])
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        a = json.loads((tmp_path / "one.json").read_text())
        b = json.loads(report.read_text())
        assert len(a["loss_curve"]) == len(b["loss_curve"]) == 5
        np.testing.assert_allclose(b["loss_curve"], a["loss_curve"], rtol=1e-5)
        assert b["test_accuracy"] == a["test_accuracy"]
        assert run.stdout.count("test accuracy") == 1            # rank 0 reports alone
