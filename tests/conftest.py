"""Test configuration: Hypothesis profiles and the CUDA marker.

Profiles (choose with HYPOTHESIS_PROFILE=dev|quick|ci|thorough; default "dev"):
``dev`` is for editing, ``ci`` is what .ci/run uses on the newest Python and ``quick`` on the
oldest (both derandomized), ``thorough`` is for a long local run.
CUDA tests live in tests/cuda/ and run in their own process under NUMBA_ENABLE_CUDASIM=1
(the simulator is chosen when numba is first imported, so never in the same process).
"""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("dev", max_examples=10, **_common)
settings.register_profile("quick", max_examples=15, derandomize=True, **_common)
settings.register_profile("ci", max_examples=50, derandomize=True, **_common)
settings.register_profile("thorough", max_examples=300, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

# tests/mpi runs under mpiexec (tests/test_mpi.py launches it); elsewhere it is not collected.
UNDER_MPI = any(v in os.environ for v in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE"))
collect_ignore = [] if UNDER_MPI else ["mpi"]
