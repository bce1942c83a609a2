"""Conv -> BatchNorm (-> ReLU) and fold_batchnorm on device arrays, vs the NumPy reference.

Run under the simulator (tiny shapes):
    NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda/test_conv_batchnorm_cuda.py -q
The op has no kernels of its own: it chains the conv and batch-norm device helpers, so these
tests check that chaining on the device (results stay there, nothing comes back to the host).
"""
import numpy as np
import pytest
from numba import cuda

import numbafuse as nf
from numbafuse import backend
from numbafuse import reference as ref

TOL = {np.float32: dict(rtol=2e-3, atol=2e-3), np.float64: dict(rtol=1e-9, atol=1e-10)}
GEOMETRY = dict(stride=1, padding=1, dilation=1)     # tiny: x (2, 2, 4, 4), w (3, 2, 3, 3)


def _problem(dtype, layout="NCHW", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 2, 4, 4) if layout == "NCHW" else (2, 4, 4, 2)).astype(dtype)
    w = (rng.standard_normal((3, 2, 3, 3)) / 4).astype(dtype)
    bn = dict(gamma=rng.uniform(0.5, 1.5, 3).astype(dtype),
              beta=rng.standard_normal(3).astype(dtype),
              running_mean=rng.standard_normal(3).astype(dtype),
              running_var=rng.uniform(0.5, 2.0, 3).astype(dtype))
    return x, w, bn


def _dev(*arrays):
    return [cuda.to_device(a) for a in arrays]


@pytest.mark.parametrize("dtype,layout,relu", [(np.float64, "NCHW", True),
                                               (np.float32, "NHWC", False)])
def test_training_forward_and_running_stats(dtype, layout, relu):
    x, w, bn = _problem(dtype, layout)
    rm, rv = _dev(bn["running_mean"], bn["running_var"])
    y = nf.conv_batchnorm_relu(*_dev(x, w, bn["gamma"], bn["beta"]), running_mean=rm,
                               running_var=rv, relu=relu, layout=layout, **GEOMETRY)
    assert backend.is_device_array(y)
    y_ref, rm_ref, rv_ref = ref.conv_batchnorm_relu(
        x, w, bn["gamma"], bn["beta"], bn["running_mean"], bn["running_var"], True,
        relu=relu, layout=layout, **GEOMETRY)
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **TOL[dtype])
    np.testing.assert_allclose(rm.copy_to_host(), rm_ref, **TOL[dtype])   # updated in place
    np.testing.assert_allclose(rv.copy_to_host(), rv_ref, **TOL[dtype])


def test_inference_forward_folds():
    x, w, bn = _problem(np.float64)
    y = nf.conv_batchnorm_relu(*_dev(x, w, bn["gamma"], bn["beta"]),
                               running_mean=cuda.to_device(bn["running_mean"]),
                               running_var=cuda.to_device(bn["running_var"]), training=False,
                               **GEOMETRY)
    y_ref = ref.conv_batchnorm_relu(x, w, bn["gamma"], bn["beta"], bn["running_mean"],
                                    bn["running_var"], False, **GEOMETRY)[0]
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **TOL[np.float64])


def test_tape_backward_on_device():
    x, w, bn = _problem(np.float64)
    host = (x, w, bn["gamma"], bn["beta"])
    ts = [nf.Tensor(d, requires_grad=True) for d in _dev(*host)]
    y = nf.conv_batchnorm_relu(*ts, **GEOMETRY)
    gy = np.random.default_rng(1).standard_normal(y.shape)
    y.backward(cuda.to_device(gy))
    expected = ref.conv_batchnorm_relu_backward(gy, *host, **GEOMETRY)
    for t, e in zip(ts, expected):
        assert backend.is_device_array(t.grad)
        np.testing.assert_allclose(t.grad.copy_to_host(), e, **TOL[np.float64])
    assert nf.saved_bytes(y) == sum(a.nbytes for a in host) + 2 * 3 * 8   # + mean, invstd


def test_numpy_style_backward_inference_on_device():
    x, w, bn = _problem(np.float64)
    gy = np.random.default_rng(2).standard_normal((2, 3, 4, 4))
    stats = dict(running_mean=bn["running_mean"], running_var=bn["running_var"],
                 training=False)
    grads = nf.conv_batchnorm_relu_backward(
        *_dev(gy, x, w, bn["gamma"], bn["beta"]), **{k: (cuda.to_device(v) if
                                                       isinstance(v, np.ndarray) else v)
                                                    for k, v in stats.items()}, **GEOMETRY)
    expected = ref.conv_batchnorm_relu_backward(gy, x, w, bn["gamma"], bn["beta"], **stats,
                                                **GEOMETRY)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g.copy_to_host(), e, **TOL[np.float64])


@pytest.mark.parametrize("with_bias", [False, True])
def test_fold_batchnorm_on_device(with_bias):
    _, w, bn = _problem(np.float32)
    b = np.arange(3, dtype=np.float32) if with_bias else None
    args = (bn["gamma"], bn["beta"], bn["running_mean"], bn["running_var"])
    wf, bf = nf.fold_batchnorm(cuda.to_device(w), None if b is None else cuda.to_device(b),
                               *_dev(*args))
    wf_ref, bf_ref = ref.fold_batchnorm(w, b, *args)
    np.testing.assert_allclose(wf.copy_to_host(), wf_ref, **TOL[np.float32])
    np.testing.assert_allclose(bf.copy_to_host(), bf_ref, **TOL[np.float32])


def test_mixing_host_and_device_is_a_type_error():
    x, w, bn = _problem(np.float64)
    rm = cuda.to_device(bn["running_mean"])
    with pytest.raises(TypeError, match="conv_batchnorm_relu: cannot mix host and device"):
        nf.conv_batchnorm_relu(cuda.to_device(x), w, bn["gamma"], bn["beta"])
    with pytest.raises(TypeError, match="conv_batchnorm_relu: cannot mix"):
        nf.conv_batchnorm_relu(*_dev(x, w, bn["gamma"], bn["beta"]), running_mean=rm,
                               running_var=bn["running_var"])
    np.testing.assert_array_equal(rm.copy_to_host(), bn["running_mean"])


def test_running_stats_checked_like_batchnorm_and_left_untouched():
    """Non-contiguous device running stats and a non-boolean training are refused first."""
    x, w, bn = _problem(np.float64)
    args = _dev(x, w, bn["gamma"], bn["beta"])
    strided = cuda.to_device(np.repeat(bn["running_mean"], 2))[::2]   # (3,), stride 2
    rm, rv = _dev(bn["running_mean"], bn["running_var"])
    with pytest.raises(ValueError, match="conv_batchnorm_relu: running_mean must be "
                                         "contiguous on the device"):
        nf.conv_batchnorm_relu(*args, running_mean=strided, running_var=rv)
    with pytest.raises(TypeError, match="conv_batchnorm_relu: training must be True or False"):
        nf.conv_batchnorm_relu(*args, running_mean=rm, running_var=rv, training="no")
    np.testing.assert_array_equal(strided.copy_to_host(), bn["running_mean"])
    np.testing.assert_array_equal(rm.copy_to_host(), bn["running_mean"])
    np.testing.assert_array_equal(rv.copy_to_host(), bn["running_var"])


# --------------------------------------------------------------------------- nn / optim on device

def test_sgd_step_on_device_matches_host():
    from numbafuse import optim
    rng = np.random.default_rng(3)
    p0, grads = rng.standard_normal(5), [rng.standard_normal(5) for _ in range(2)]
    host, dev = nf.Tensor(p0.copy(), requires_grad=True), nf.Tensor(cuda.to_device(p0),
                                                                     requires_grad=True)
    opts = [optim.SGD([t], lr=0.1, momentum=0.9, weight_decay=0.01) for t in (host, dev)]
    for g in grads:
        host.grad, dev.grad = g.copy(), cuda.to_device(g)
        for opt in opts:
            opt.step()
    assert backend.is_device_array(dev.data)
    np.testing.assert_allclose(dev.data.copy_to_host(), host.data, rtol=1e-12)


def test_sgd_device_momentum_buffer_is_a_copy_of_the_gradient():
    from numbafuse import optim
    p = nf.Tensor(cuda.to_device(np.ones(3)), requires_grad=True)
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = cuda.to_device(np.full(3, 2.0))
    opt.step()
    buf = opt.momentum_buffers[0]
    assert buf is not p.grad and backend.is_device_array(buf)
    p.grad.copy_to_device(np.full(3, 100.0))           # the gradient changed in place
    np.testing.assert_array_equal(buf.copy_to_host(), 2.0)


def test_module_to_cuda_train_step_matches_host():
    from numbafuse import nn, optim
    from numbafuse.train import train_step

    def model():
        nn.init.seed(0)
        return nn.Sequential(nn.ConvBatchNormReLU(1, 2, 3, padding=1, dtype=np.float64),
                             nn.GlobalAvgPool2d(), nn.Linear(2, 3, dtype=np.float64))

    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((2, 1, 4, 4)), np.array([0, 2])
    host, dev = model(), model().to("cuda")
    assert dev.device == "cuda" and backend.is_device_array(dev[0].running_mean)
    for m, xb, yb in ((host, x, y), (dev, cuda.to_device(x), cuda.to_device(y))):
        train_step(m, optim.SGD(m.parameters(), lr=0.1), xb, yb)
    for (name, a), (_, b) in zip(host.state_dict().items(), dev.state_dict().items()):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-12, err_msg=name)


def test_module_to_cuda_moves_a_reassigned_buffer():
    from numbafuse import nn
    bn = nn.BatchNorm2d(2, dtype=np.float64)
    bn.running_mean = np.full(2, 3.0)                  # reassigned: still a buffer
    bn.to("cuda")
    assert backend.is_device_array(bn.running_mean)
    np.testing.assert_array_equal(bn.running_mean.copy_to_host(), 3.0)
