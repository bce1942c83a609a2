"""The setup that puts numbafuse's launches on PyTorch's OpenMP team, for the tests of
the launcher on both backends (test_threading.py, test_native_launch.py)."""
import pytest


def share_torch_team(monkeypatch, threads=2):
    """torch imported (skipped where it is not, or has no GNU OpenMP team), numbafuse's
    launches on torch's team, torch on ``threads`` threads after a parallel region of its
    own; returns torch and the undo of its thread count (numbafuse's is the caller's)."""
    from numbafuse.kernels.cpu import launch
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if launch.torch_team() is None:
        pytest.skip("this torch build has no GNU OpenMP runtime (libgomp) loaded")
    monkeypatch.setattr(launch, "SHARE_TORCH_TEAM", True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.relu(torch.ones(1 << 16))
    return torch, lambda: torch.set_num_threads(before)
