"""BatchNorm -> Add -> ReLU on the device (simulator or GPU): the essentials, tiny shapes.

Run: NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda/test_batchnorm_cuda.py -q -p no:cacheprovider
"""
import numpy as np
import pytest
from hypothesis import given, settings
from numba import cuda

import numbafuse as nf
from numbafuse import backend
from numbafuse import reference as ref
from numbafuse.ops import batchnorm as bn
import numbafuse.testing.strategies as nfs

TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-12)}
SMALL = dict(max_batch=2, max_channels=3, max_size=3)   # simulator: a few hundred threads


def _tol(dtype):
    return TOL[np.dtype(dtype).type]


def _dev(*arrays):
    return [cuda.to_device(a) for a in arrays]


@settings(max_examples=5)
@given(nfs.batchnorm_problems(**SMALL), nfs.dtypes())
def test_forward_backward_training_matches_reference(p, dtype):
    x, z, gamma, beta = (a.astype(dtype) for a in (p.x, p.z, p.gamma, p.beta))
    rm, rv = p.running_mean.astype(dtype), p.running_var.astype(dtype)
    y_ref, rm_ref, rv_ref = ref.batchnorm_add_relu(x, z, gamma, beta, rm, rv, layout=p.layout)
    dx, dz, dgamma, dbeta, drm, drv = _dev(x, z, gamma, beta, rm, rv)
    y = nf.batchnorm_add_relu(dx, dz, dgamma, dbeta, running_mean=drm, running_var=drv,
                              layout=p.layout)
    assert backend.is_device_array(y)
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **_tol(dtype))
    np.testing.assert_allclose(drm.copy_to_host(), rm_ref, **_tol(dtype))
    np.testing.assert_allclose(drv.copy_to_host(), rv_ref, **_tol(dtype))
    gy = np.random.default_rng(0).standard_normal(x.shape).astype(dtype)
    expected = ref.batchnorm_add_relu_backward(gy, x, z, gamma, beta, layout=p.layout)
    y_mask = bn.bn_apply(*_dev(x), *bn.bn_stats(dx, layout=p.layout)[::2], dgamma, dbeta,
                         z=dz, layout=p.layout, with_mask=True)[1]
    for kw in (dict(y=y), dict(mask=y_mask)):
        got = nf.batchnorm_add_relu_backward(cuda.to_device(gy), dx, dz, dgamma, dbeta,
                                             layout=p.layout, **kw)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g.copy_to_host(), e, **_tol(dtype))


@settings(max_examples=4)
@given(nfs.batchnorm_problems(dtype=np.float64, **SMALL))
def test_inference_matches_reference_and_leaves_running_stats(p):
    rm0, rv0 = p.running_mean.copy(), p.running_var.copy()
    y_ref, _, _ = ref.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, rm0, rv0, training=False,
                                         layout=p.layout)
    dx, dz, dgamma, dbeta, drm, drv = _dev(p.x, p.z, p.gamma, p.beta, rm0, rv0)
    y = nf.batchnorm_add_relu(dx, dz, dgamma, dbeta, running_mean=drm, running_var=drv,
                              training=False, layout=p.layout)
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **TOL[np.float64])
    np.testing.assert_array_equal(drm.copy_to_host(), rm0)
    np.testing.assert_array_equal(drv.copy_to_host(), rv0)
    gy = np.random.default_rng(1).standard_normal(p.x.shape)
    expected = ref.batchnorm_add_relu_backward(gy, p.x, p.z, p.gamma, p.beta, rm0, rv0,
                                               training=False, layout=p.layout)
    got = nf.batchnorm_add_relu_backward(cuda.to_device(gy), dx, dz, dgamma, dbeta, drm, drv,
                                         training=False, layout=p.layout, y=y)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.copy_to_host(), e, **TOL[np.float64])


@pytest.mark.parametrize("save", ["output", "mask"])
def test_tape_gradients_on_device_match_host(save):
    rng = np.random.default_rng(3)
    x, z = rng.standard_normal((2, 2, 2, 3)), rng.standard_normal((2, 2, 2, 3))
    gamma, beta = rng.uniform(0.5, 1.5, 2), rng.standard_normal(2)
    gy = rng.standard_normal(x.shape)
    grads = []
    for to in (lambda a: a, cuda.to_device):
        leaves = [nf.Tensor(to(a), requires_grad=True) for a in (x, z, gamma, beta)]
        y = nf.batchnorm_add_relu(*leaves, save=save)
        y.backward(to(gy))
        grads.append([t.grad if isinstance(t.grad, np.ndarray) else t.grad.copy_to_host()
                      for t in leaves])
    for host, device in zip(*grads):
        np.testing.assert_allclose(device, host, **TOL[np.float64])


def test_unfused_batchnorm_matches_reference():
    rng = np.random.default_rng(4)
    x, gamma, beta = rng.standard_normal((2, 3, 2, 2)), rng.uniform(0.5, 1.5, 3), \
        rng.standard_normal(3)
    y_ref, _, _ = ref.batchnorm_train(x, gamma, beta)
    y = nf.batchnorm(*_dev(x, gamma, beta))
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **TOL[np.float64])


def test_large_mean_float32_and_constant_channel():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((2, 2, 3, 3)) + np.array([1e4, -3e3]).reshape(1, 2, 1, 1))
    x[:, 1] = 7.0                                                  # a constant channel
    z, gamma, beta = rng.standard_normal(x.shape), np.ones(2), np.full(2, 0.5)
    x32, z32, g32, b32 = (a.astype(np.float32) for a in (x, z, gamma, beta))
    # float64 reference on the very float32 values
    y_ref, _, _ = ref.batchnorm_add_relu(*(a.astype(np.float64) for a in (x32, z32, g32, b32)))
    y = nf.batchnorm_add_relu(*_dev(x32, z32, g32, b32)).copy_to_host()
    np.testing.assert_allclose(y, y_ref, **TOL[np.float32])
    gx = nf.batchnorm_add_relu_backward(cuda.to_device(np.ones_like(x32)),
                                        *_dev(x32, z32, g32, b32))[0].copy_to_host()
    assert np.isfinite(gx).all()


def test_nan_propagates():
    x = np.arange(8.0).reshape(1, 2, 2, 2)
    x[0, 0, 0, 0] = np.nan
    y = nf.batchnorm_add_relu(*_dev(x, np.zeros_like(x), np.ones(2), np.zeros(2)))
    assert np.isnan(y.copy_to_host()[0, 0]).all()


def test_deterministic():
    rng = np.random.default_rng(6)
    x, z = rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((2, 2, 3, 3))
    args = _dev(x, z, rng.uniform(0.5, 1.5, 2), rng.standard_normal(2))
    gy = cuda.to_device(rng.standard_normal(x.shape))
    runs = [[a.copy_to_host() for a in nf.batchnorm_add_relu_backward(gy, *args)]
            for _ in range(2)]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_bad_input_leaves_running_stats_untouched():
    x, z = np.ones((2, 2, 2, 2)), np.ones((2, 2, 2, 2))
    gamma, beta, rm, rv = np.ones(2), np.zeros(2), np.zeros(2), np.ones(2)
    dx, dz, dg, db, drm, drv = _dev(x, z, gamma, beta, rm, rv)
    with pytest.raises(TypeError, match="batchnorm_add_relu: cannot mix host and device"):
        nf.batchnorm_add_relu(dx, z, dg, db, running_mean=drm, running_var=drv)
    with pytest.raises(ValueError, match="batchnorm_add_relu: momentum"):
        nf.batchnorm_add_relu(dx, dz, dg, db, running_mean=drm, running_var=drv, momentum=2.0)
    np.testing.assert_array_equal(drm.copy_to_host(), rm)
    np.testing.assert_array_equal(drv.copy_to_host(), rv)


@pytest.mark.parametrize("threads, shuffle, layout", [(32, True, "NCHW"), (64, True, "NHWC"),
                                                      (64, False, "NCHW")])
def test_warp_sized_blocks_shuffle_path_and_channel_stride(threads, shuffle, layout, monkeypatch,
                                                           warp_shuffles):
    # A real GPU's path: warp-sized blocks and the warp-shuffle reduction (emulated here by the
    # warp_shuffles fixture); gridDim.y capped below C, so each block loops over channels and
    # reuses its shared buffers; M = 2*5*7 = 70 values per channel leave the grid-stride loops
    # uneven (threads of a block leave at different iterations).
    from numbafuse.kernels import cuda_config as config
    from numbafuse.kernels import cuda_reduce as kernels
    monkeypatch.setattr(config, "threads", threads)
    monkeypatch.setattr(config, "max_grid_y", 2)
    monkeypatch.setattr(kernels, "USE_SHUFFLE", shuffle)
    rng = np.random.default_rng(11)
    shape = (2, 3, 5, 7) if layout == "NCHW" else (2, 5, 7, 3)
    x, z, gy = (rng.standard_normal(shape) for _ in range(3))
    gamma, beta = rng.uniform(0.5, 1.5, 3), rng.standard_normal(3)
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2.0, 3)
    y_ref, rm_ref, rv_ref = ref.batchnorm_add_relu(x, z, gamma, beta, rm, rv, layout=layout)
    dx, dz, dgamma, dbeta, drm, drv = _dev(x, z, gamma, beta, rm, rv)
    y = nf.batchnorm_add_relu(dx, dz, dgamma, dbeta, running_mean=drm, running_var=drv,
                              layout=layout)
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **TOL[np.float64])
    np.testing.assert_allclose(drm.copy_to_host(), rm_ref, **TOL[np.float64])
    np.testing.assert_allclose(drv.copy_to_host(), rv_ref, **TOL[np.float64])
    expected = ref.batchnorm_add_relu_backward(gy, x, z, gamma, beta, layout=layout)
    got = nf.batchnorm_add_relu_backward(cuda.to_device(gy), dx, dz, dgamma, dbeta, y=y,
                                         layout=layout)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.copy_to_host(), e, **TOL[np.float64])
