"""The communicator and the model helpers under MPI (numbafuse/distributed.py)."""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import distributed, nn


def test_rank_and_size(comm):
    ranks = comm.allgather(np.array([comm.rank]))
    assert ranks.ravel().tolist() == list(range(comm.size))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_allreduce_sum_is_the_sum_and_the_same_bits_everywhere(comm, dtype):
    rng = np.random.default_rng(100 + comm.rank)
    a = rng.standard_normal(1000).astype(dtype)
    got = comm.allreduce_sum(a)
    everyone = comm.allgather(a)                                # (size, 1000)
    np.testing.assert_allclose(got, everyone.sum(axis=0), rtol=1e-5 if dtype == np.float32
                               else 1e-12)
    assert got.dtype == dtype and got is not a
    same = comm.allgather(got)
    assert all(same[r].tobytes() == got.tobytes() for r in range(comm.size))


def test_check_same_raises_on_every_rank_when_ranks_disagree(comm):
    comm.check_same("op", ((4, 3), "float32"))                  # agreed: fine
    shape = (4, 3) if comm.rank == 0 else (5, 3)
    with pytest.raises(ValueError, match="op2: ranks disagree"):
        comm.check_same("op2", (shape, "float32"))


def _model(seed):
    nn.init.seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                         nn.GlobalAvgPool2d(), nn.Linear(3, 4))


def test_broadcast_parameters_makes_every_rank_equal_rank_0(comm):
    model = _model(seed=comm.rank)                 # different weights on every rank
    for _, b in model.named_buffers():
        b += comm.rank
    distributed.broadcast_parameters(model, comm)
    reference = _model(seed=0)
    for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    for (_, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        np.testing.assert_array_equal(b, c)


def test_average_gradients_is_the_mean_over_ranks_in_one_fixed_order(comm):
    model = _model(seed=0)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((3, 2, 5, 5)).astype(np.float32)
    loss = nf.cross_entropy(model(nf.Tensor(x)), np.arange(3) % 4)
    loss.backward()
    local = [p.grad.copy() for p in model.parameters()]
    distributed.average_gradients(model, comm)
    for p, g in zip(model.parameters(), local):
        everyone = comm.allgather(g)
        np.testing.assert_allclose(p.grad, everyone.mean(axis=0), rtol=1e-5, atol=1e-7)
        same = comm.allgather(p.grad)
        assert all(same[r].tobytes() == p.grad.tobytes() for r in range(comm.size))


def test_average_gradients_counts_a_missing_gradient_as_zeros(comm):
    model = _model(seed=0)
    for p in model.parameters():
        p.grad = np.full(p.shape, 1.0, p.dtype) if comm.rank == 0 else None
    distributed.average_gradients(model, comm)
    for p in model.parameters():
        np.testing.assert_allclose(p.grad, 1.0 / comm.size)
