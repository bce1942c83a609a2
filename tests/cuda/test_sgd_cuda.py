"""The fused SGD step on the device (numbafuse/optim.py, kernels/elementwise/cuda.py:
_sgd): one launch per dtype updates every parameter, bit for bit as the per-parameter
``a*x + b*y`` steps it replaced, with PyTorch's semantics (momentum buffer copied from the
first gradient, parameters without a gradient skipped, their momentum kept)."""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import cuda as nfcuda
from numbafuse import optim
from numbafuse.kernels.cuda import config
from numbafuse.kernels.elementwise import cuda as ew

from .launches import recording

SHAPES = [(5,), (2, 3), (7,), (1,)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(config, "sgd_chunk", 3)     # parameters span several block rows


def _per_parameter(p0, grads, skip, lr, m, wd):
    """The device path before the fused step: three axpby launches per parameter."""
    ref, bufs = [nfcuda.to_device(a) for a in p0], [None] * len(p0)
    for step, gs in enumerate(grads):
        for i, g in enumerate(gs):
            if (step, i) in skip:
                continue
            g, w = nfcuda.to_device(g), ref[i]
            if wd:
                g = ew.axpby(1.0, g, wd, w)
            if m:
                bufs[i] = nfcuda.to_device(g.copy_to_host()) if bufs[i] is None else \
                    ew.axpby(m, bufs[i], 1.0, g)
                g = bufs[i]
            ref[i] = ew.axpby(1.0, w, -lr, g)
    return [r.copy_to_host() for r in ref]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m,wd", [(0.0, 0.0), (0.9, 0.0), (0.0, 0.1), (0.9, 0.01)])
def test_fused_step_is_the_per_parameter_step_bit_for_bit(dtype, m, wd):
    rng = np.random.default_rng(0)
    p0 = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [[rng.standard_normal(s).astype(dtype) for s in SHAPES] for _ in range(3)]
    skip = {(1, 2)}                                  # parameter 2 has no gradient at step 1
    ps = [nf.Tensor(nfcuda.to_device(a), requires_grad=True) for a in p0]
    opt = optim.SGD(ps, lr=0.1, momentum=m, weight_decay=wd)
    for step, gs in enumerate(grads):
        for i, p in enumerate(ps):
            p.grad = None if (step, i) in skip else nfcuda.to_device(gs[i])
        with recording() as rec:
            opt.step()
        assert rec.names == ["_sgd"]                 # one launch for the four parameters
    for got, want in zip(ps, _per_parameter(p0, grads, skip, 0.1, m, wd)):
        assert got.data.shape == want.shape
        np.testing.assert_array_equal(got.data.copy_to_host(), want)


def test_one_launch_per_dtype_and_per_32_parameters():
    ps = [nf.Tensor(nfcuda.to_device(np.ones(2, np.float32)), requires_grad=True)
          for _ in range(33)]
    ps += [nf.Tensor(nfcuda.to_device(np.ones(2)), requires_grad=True)]
    for p in ps:
        p.grad = nfcuda.to_device(np.ones(2, p.dtype))
    opt = optim.SGD(ps, lr=0.5)
    with recording() as rec:
        opt.step()
    assert rec.names == ["_sgd"] * 3                 # float32: 32 + 1; float64: 1
    for p in ps:
        np.testing.assert_array_equal(p.data.copy_to_host(), 0.5)


def test_reassigned_data_is_taken_in_and_momentum_survives():
    p = nf.Tensor(nfcuda.to_device(np.ones(3)), requires_grad=True)
    q = nf.Tensor(nfcuda.to_device(np.ones(2)), requires_grad=True)
    opt = optim.SGD([p, q], lr=0.1, momentum=0.5)
    p.grad, q.grad = nfcuda.to_device(np.full(3, 2.0)), nfcuda.to_device(np.full(2, 2.0))
    opt.step()                                       # p = 1 - 0.2, b = 2
    view = p.data
    p.data = nfcuda.to_device(np.full(3, 10.0))      # e.g. load_state_dict
    opt.step()                                       # b = 0.5*2 + 2 = 3; p = 10 - 0.3
    np.testing.assert_allclose(p.data.copy_to_host(), 9.7)
    np.testing.assert_allclose(q.data.copy_to_host(), 0.8 - 0.3)
    assert p.data is not view and p.data.shape == (3,)
    q.data = nfcuda.to_device(np.ones((2, 2)))       # a new shape: the flat layout is remade
    q.grad = nfcuda.to_device(np.ones((2, 2)))
    p.grad = nfcuda.to_device(np.zeros(3))
    opt.step()                                       # p: b = 1.5, p = 9.7 - 0.15; q fresh
    np.testing.assert_allclose(p.data.copy_to_host(), 9.55)
    np.testing.assert_allclose(q.data.copy_to_host(), 0.9)
    np.testing.assert_allclose(opt.momentum_buffers[0].copy_to_host(), 1.5)
