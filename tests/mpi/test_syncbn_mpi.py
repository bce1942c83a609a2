"""Synchronized batch norm inside the fused ops (comm=): each rank holds a slice of one global
batch (uneven slices, and an empty one with 3 ranks); values, running statistics and gradients
must be those of the single-process reference on the whole batch (numbafuse.reference)."""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference as ref

LAYOUTS = ["NCHW", "NHWC"]
TOL = {np.float64: dict(rtol=1e-9, atol=1e-11), np.float32: dict(rtol=2e-4, atol=2e-5)}


def _sizes(comm):
    """Batch sizes per rank: uneven, and rank 1 empty when there are 3 or more ranks."""
    sizes = [3, 2, 4, 1][:comm.size] if comm.size < 3 else [3, 0, 2] + [1] * (comm.size - 3)
    return sizes, sum(sizes)


def _slice(comm, a):
    sizes, _ = _sizes(comm)
    start = sum(sizes[:comm.rank])
    return np.ascontiguousarray(a[start:start + sizes[comm.rank]])


def _batch(comm, layout, dtype, C=3, H=4, W=5, seed=0):
    _, N = _sizes(comm)
    rng = np.random.default_rng(seed)
    shape = (N, C, H, W) if layout == "NCHW" else (N, H, W, C)
    x = (rng.standard_normal(shape) * 2 + 5).astype(dtype)
    z = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, C).astype(dtype)
    beta = rng.standard_normal(C).astype(dtype)
    return x, z, dy, gamma, beta


def _sum_over_ranks(comm, a):
    return comm.allreduce_sum(np.ascontiguousarray(a, dtype=np.float64))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batchnorm_add_relu_is_the_global_batch_norm(comm, layout, dtype):
    x, z, dy, gamma, beta = _batch(comm, layout, dtype)
    C = gamma.size
    rm, rv = np.zeros(C, dtype), np.ones(C, dtype)
    leaves = [nf.Tensor(a, requires_grad=True)
              for a in (_slice(comm, x), _slice(comm, z), gamma, beta)]
    y = nf.batchnorm_add_relu(*leaves, running_mean=rm, running_var=rv, layout=layout,
                              comm=comm)
    y.backward(_slice(comm, dy))
    y_ref, rm_ref, rv_ref = ref.batchnorm_add_relu(x, z, gamma, beta, np.zeros(C), np.ones(C),
                                                   layout=layout)
    dx, dz, dgamma, dbeta = ref.batchnorm_add_relu_backward(dy, x, z, gamma, beta,
                                                            layout=layout)
    np.testing.assert_allclose(y.numpy(), _slice(comm, y_ref), **TOL[dtype])
    np.testing.assert_allclose(rm, rm_ref, **TOL[dtype])          # the global update, every rank
    np.testing.assert_allclose(rv, rv_ref, **TOL[dtype])
    np.testing.assert_allclose(leaves[0].grad, _slice(comm, dx), **TOL[dtype])
    np.testing.assert_allclose(leaves[1].grad, _slice(comm, dz), **TOL[dtype])
    np.testing.assert_allclose(_sum_over_ranks(comm, leaves[2].grad), dgamma, **TOL[dtype])
    np.testing.assert_allclose(_sum_over_ranks(comm, leaves[3].grad), dbeta, **TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unfused_batchnorm_is_the_global_batch_norm(comm, layout):
    x, _, dy, gamma, beta = _batch(comm, layout, np.float64, seed=1)
    leaves = [nf.Tensor(a, requires_grad=True) for a in (_slice(comm, x), gamma, beta)]
    y = nf.batchnorm(*leaves, layout=layout, comm=comm)
    y.backward(_slice(comm, dy))
    y_ref, _, _ = ref.batchnorm_train(x, gamma, beta, layout=layout)
    dx, dgamma, dbeta = ref.batchnorm_backward(dy, x, gamma, layout=layout)
    np.testing.assert_allclose(y.numpy(), _slice(comm, y_ref), **TOL[np.float64])
    np.testing.assert_allclose(leaves[0].grad, _slice(comm, dx), **TOL[np.float64])
    np.testing.assert_allclose(_sum_over_ranks(comm, leaves[1].grad), dgamma, **TOL[np.float64])
    np.testing.assert_allclose(_sum_over_ranks(comm, leaves[2].grad), dbeta, **TOL[np.float64])


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_conv_batchnorm_relu_is_the_global_conv_batch_norm(comm, layout, relu):
    _, N = _sizes(comm)
    rng = np.random.default_rng(2)
    shape = (N, 2, 5, 6) if layout == "NCHW" else (N, 5, 6, 2)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((3, 2, 3, 3))
    gamma, beta = rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)
    kw = dict(padding=1, layout=layout, relu=relu)
    y_ref, rm_ref, rv_ref = ref.conv_batchnorm_relu(x, w, gamma, beta, np.zeros(3), np.ones(3),
                                                    **kw)
    dy = rng.standard_normal(y_ref.shape)
    grads = ref.conv_batchnorm_relu_backward(dy, x, w, gamma, beta, **kw)
    rm, rv = np.zeros(3), np.ones(3)
    leaves = [nf.Tensor(a, requires_grad=True) for a in (_slice(comm, x), w, gamma, beta)]
    y = nf.conv_batchnorm_relu(*leaves, running_mean=rm, running_var=rv, comm=comm, **kw)
    y.backward(_slice(comm, dy))
    tol = TOL[np.float64]
    np.testing.assert_allclose(y.numpy(), _slice(comm, y_ref), **tol)
    np.testing.assert_allclose(rm, rm_ref, **tol)
    np.testing.assert_allclose(rv, rv_ref, **tol)
    np.testing.assert_allclose(leaves[0].grad, _slice(comm, grads[0]), **tol)
    for leaf, expected in zip(leaves[1:], grads[1:]):                 # dw, dgamma, dbeta
        np.testing.assert_allclose(_sum_over_ranks(comm, leaf.grad), expected, **tol)


def test_reruns_give_the_same_bits(comm):
    x, z, dy, gamma, beta = _batch(comm, "NCHW", np.float32, seed=3)
    runs = []
    for _ in range(2):
        leaves = [nf.Tensor(a, requires_grad=True)
                  for a in (_slice(comm, x), _slice(comm, z), gamma, beta)]
        y = nf.batchnorm_add_relu(*leaves, comm=comm)
        y.backward(_slice(comm, dy))
        runs.append([y.numpy().tobytes()] + [t.grad.tobytes() for t in leaves])
    assert runs[0] == runs[1]


def test_ranks_that_disagree_all_raise(comm):
    C = 3 if comm.rank == 0 else 4
    x = np.ones((2, C, 2, 2))
    with pytest.raises(ValueError, match="batchnorm: ranks disagree"):
        nf.batchnorm(x, np.ones(C), np.zeros(C), comm=comm)


def test_a_global_batch_of_one_value_per_channel_is_refused_everywhere(comm):
    n = 1 if comm.rank == 0 else 0
    rm = np.zeros(2)
    with pytest.raises(ValueError, match="more than one value per channel"):
        nf.batchnorm_add_relu(np.ones((n, 2, 1, 1)), np.ones((n, 2, 1, 1)), np.ones(2),
                              np.zeros(2), running_mean=rm, running_var=np.ones(2), comm=comm)
    np.testing.assert_array_equal(rm, 0.0)                                 # nothing written


def _device_or_skip():
    import os
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        from numbafuse import cuda
        if not cuda.is_available():
            pytest.skip("no GPU, and NUMBA_ENABLE_CUDASIM is not set")
    from numbafuse import backend
    return backend.to_device


@pytest.mark.parametrize("layout", LAYOUTS)
def test_on_the_device(comm, layout):
    to_device = _device_or_skip()
    x, z, dy, gamma, beta = _batch(comm, layout, np.float64, C=2, H=2, W=3, seed=4)
    rm, rv = to_device(np.zeros(2)), to_device(np.ones(2))
    leaves = [nf.Tensor(to_device(a), requires_grad=True)
              for a in (_slice(comm, x), _slice(comm, z), gamma, beta)]
    y = nf.batchnorm_add_relu(*leaves, running_mean=rm, running_var=rv, layout=layout,
                              comm=comm)
    y.backward(to_device(_slice(comm, dy)))
    y_ref, rm_ref, _ = ref.batchnorm_add_relu(x, z, gamma, beta, np.zeros(2), np.ones(2),
                                              layout=layout)
    dx, dz, dgamma, _ = ref.batchnorm_add_relu_backward(dy, x, z, gamma, beta, layout=layout)
    tol = TOL[np.float64]
    np.testing.assert_allclose(y.numpy(), _slice(comm, y_ref), **tol)
    np.testing.assert_allclose(rm.copy_to_host(), rm_ref, **tol)
    np.testing.assert_allclose(leaves[0].grad.copy_to_host(), _slice(comm, dx), **tol)
    np.testing.assert_allclose(leaves[1].grad.copy_to_host(), _slice(comm, dz), **tol)
    np.testing.assert_allclose(_sum_over_ranks(comm, leaves[2].grad.copy_to_host()), dgamma,
                               **tol)
