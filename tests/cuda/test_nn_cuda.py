"""Modules and optimizers on the device (CUDA-only: no CPU counterpart to share a harness
with): SGD steps, ``Module.to("cuda")`` and a training step on the device vs the host.

Run under the simulator: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cuda tests/cuda``
"""
import numpy as np
from numba import cuda

import numbafuse as nf
from numbafuse import backend


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
