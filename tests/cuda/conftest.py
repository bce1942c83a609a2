"""CUDA tests: run under the simulator (NUMBA_ENABLE_CUDASIM=1) or on a real GPU.

Every test here is marked ``cuda``. Launch sizes are shrunk so tiny inputs span several
blocks, and the simulator's per-thread cost stays small.
"""
import os

import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True)
def _cuda_available():
    from numba import cuda
    if not SIMULATOR and not cuda.is_available():
        pytest.skip("no GPU and NUMBA_ENABLE_CUDASIM is not set")


@pytest.fixture(autouse=True)
def small_launches(monkeypatch):
    """Shrink launch sizes (simulator only) so several blocks run on tiny inputs."""
    if SIMULATOR:
        from numbafuse.kernels.cuda import config
        monkeypatch.setattr(config, "threads", 8)
        monkeypatch.setattr(config, "max_blocks", 3)
        monkeypatch.setattr(config, "reduce_blocks", 3)
    yield
