"""Launches per op and allocations per training step, counted under the simulator (or on a
GPU): a regression in either shows here.

Kernel launches are counted by wrapping the launch (tests/cuda/launches.py). The numbers are
those of the float32 NHWC ops with running statistics and momentum SGD; issue 17's "before"
counts are in the comments (150db89). A steady-state training step makes no new device
allocation (``numbafuse.cuda.memory_stats()["allocations"]`` stops growing), and a planted
leak is caught by the same check.
"""
import gc

import numpy as np
import pytest

import numbafuse as nf
from numbafuse import cuda as nfcuda
from numbafuse import models, optim
from numbafuse.kernels.cuda import config
from numbafuse.kernels.batchnorm import cuda as bn_cuda
from numbafuse.train import train_step

from .launches import recording

N, H, W, C = 2, 4, 4, 3


def _t(a, grad=True):
    return nf.Tensor(nfcuda.to_device(np.ascontiguousarray(a)), requires_grad=grad)


@pytest.fixture(autouse=True)
def counters_made():
    """The last-block counters are made (and zeroed, one launch) on first use: not counted."""
    from numbafuse.kernels.cuda import reduce as cuda_reduce
    cuda_reduce.counters(4096)


@pytest.fixture
def problem():
    rng = np.random.default_rng(0)
    f = np.float32
    return dict(x=_t(rng.standard_normal((N, H, W, C)).astype(f)),
                z=_t(rng.standard_normal((N, H, W, C)).astype(f)),
                w=_t(rng.standard_normal((C, C, 3, 3)).astype(f)),
                b=_t(rng.standard_normal(C).astype(f)),
                gamma=_t(rng.uniform(0.5, 1.5, C).astype(f)),
                beta=_t(rng.standard_normal(C).astype(f)),
                rm=nfcuda.to_device(np.zeros(C, f)), rv=nfcuda.to_device(np.ones(C, f)),
                dy=nfcuda.to_device(rng.standard_normal((N, H, W, C)).astype(f)))


def _count(fn):
    with recording() as rec:
        out = fn()
    # the GEMMs are named per pass and tiling; here "gemm" for each
    return out, ["gemm" if n.startswith("gemm") else n for n in rec.names]


def test_conv_bias_relu(problem):
    p = problem
    y, fwd = _count(lambda: nf.conv_bias_relu(p["x"], p["w"], p["b"], padding=1,
                                              layout="NHWC"))
    _, bwd = _count(lambda: y._fn.backward(p["dy"]))
    assert fwd == ["gemm"]                                                  # before: 1
    # dx, dw (split-K partials) and their ordered sum, db (reduction finished by its last
    # block); before: 5 (db's finalize was a kernel of its own). The dw GEMM's last blocks
    # summed the splits for a while (3 launches), slower on a GPU at every shape timed (run 15)
    assert sorted(bwd) == sorted(["gemm", "gemm", "_sum_splits", "channel_reduce_grad_nhwc"])


@pytest.mark.parametrize("save", ["output", "mask"])
def test_batchnorm_add_relu(problem, save):
    p = problem
    y, fwd = _count(lambda: nf.batchnorm_add_relu(
        p["x"], p["z"], p["gamma"], p["beta"], running_mean=p["rm"], running_var=p["rv"],
        layout="NHWC", save=save))
    _, bwd = _count(lambda: y._fn.backward(p["dy"]))
    # statistics + running-statistics update in one launch, then the apply; before: 4
    assert fwd == ["channel_reduce_stats_nhwc", "_apply"]
    # sums + coefficients in one launch, then dx/dz; before: 3
    assert bwd == ["channel_reduce_bwd_nhwc", "_bwd_apply"]


def test_batchnorm_add_relu_inference(problem):
    p = problem
    _, fwd = _count(lambda: nf.batchnorm_add_relu(
        p["x"], p["z"], p["gamma"], p["beta"], running_mean=p["rm"], running_var=p["rv"],
        layout="NHWC", training=False))
    assert fwd == ["_apply_running"]                                          # before: 2


def test_conv_batchnorm_relu(problem):
    p = problem
    y, fwd = _count(lambda: nf.conv_batchnorm_relu(
        p["x"], p["w"], p["gamma"], p["beta"], running_mean=p["rm"], running_var=p["rv"],
        padding=1, layout="NHWC"))
    _, bwd = _count(lambda: y._fn.backward(p["dy"]))
    assert fwd == ["gemm", "channel_reduce_stats_nhwc", "_apply"]           # before: 5
    # recompute the conv (the ReLU's gate re-derived from h in the batch-norm backward,
    # STATE_AFFINE: no mask rebuilt; GPU runs 17 and 18), batch-norm backward, conv dx, dw
    # and dw's ordered split sum; before: 8
    assert bwd == ["gemm", "channel_reduce_bwd_nhwc", "_bwd_apply", "gemm", "gemm",
                   "_sum_splits"]


def _digits_step_setup(width=2, batch=1):
    rng = np.random.default_rng(1)
    model = models.make_model("fused", width=width, blocks=1).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    xb = nfcuda.to_device(rng.standard_normal((batch, 8, 8, 1)).astype(np.float32))
    yb = nfcuda.to_device(rng.integers(0, 10, batch))
    return model, opt, xb, yb


@pytest.fixture
def fast_gemms(monkeypatch):
    """Training steps under the simulator: larger GEMM tiles and one dw split (fewer
    simulated threads; the tile-boundary tests use the tiny tiles)."""
    monkeypatch.setattr(config, "tile_override", config.Tile(64, 8, 8, 8, 8, 4))
    monkeypatch.setattr(config, "dw_target_blocks", 1)


def test_sgd_step_and_training_step(fast_gemms):
    model, opt, xb, yb = _digits_step_setup()
    n_params = len(list(model.parameters()))
    train_step(model, opt, xb, yb)                   # first step: momentum buffers made
    opt.zero_grad()
    loss = nf.cross_entropy(model(nf.Tensor(xb)), yb)
    loss.backward()
    _, sgd = _count(opt.step)
    assert sgd == ["_sgd"]                           # before: 3 per parameter (axpby)
    assert n_params == 10
    _, step = _count(lambda: train_step(model, opt, xb, yb))
    assert step == [
        # forward: stem conv_bias_relu; conv_bn_relu; conv; bn_add_relu; pool, linear,
        # cross entropy (label check; rows and their mean in one block)
        "gemm", "gemm", "channel_reduce_stats_nhwc", "_apply", "gemm",
        "channel_reduce_stats_nhwc", "_apply", "_gap_fwd", "_matmul_tiled",
        "_flag_bad_labels", "_xent_one_block",
        # backward (the loss's seed gradient, ones, was made on the device by the first
        # step and is reused: no fill): cross entropy, linear (dx, dw, db: one launch), pool,
        # bn_add_relu, conv (dx, dw)
        "_xent_bwd", "_linear_bwd", "_gap_bwd",
        "channel_reduce_bwd_nhwc", "_bwd_apply", "gemm", "gemm",
        # conv_bn_relu (recompute the conv, bn backward with the gate re-derived from h, dx
        # with the skip connection's gradient added by its epilogue, dw), the stem (dw, db:
        # the image needs no dx)
        "gemm", "channel_reduce_bwd_nhwc", "_bwd_apply", "gemm", "gemm",
        "gemm", "channel_reduce_grad_nhwc",
        # the optimizer
        "_sgd"]
    # before (150db89): 70 launches, with 30 SGD axpby, 5 per-channel finalize kernels and
    # 2 running-statistics updates; 34 with the seed's fill and 3 split sums; 30 with the
    # recompute's mask rebuilt; 29 with the residual's gradients summed by a kernel (_axpby);
    # 28 with the linear layer's three gradients in three launches; 26 with the recompute's
    # gate re-derived from h (STATE_AFFINE; off from GPU run 16, slower on the device there,
    # until runs 17-18 timed it faster once its walk loaded g first)
    assert len(step) == 26
    # labels from the host (as numbafuse.train.fit passes them): checked there, uploaded
    # without a wait, no flag kernel and nothing read back
    reads = []
    real = type(xb).copy_to_host

    def spy(self, *a, **k):
        reads.append(self.shape)
        return real(self, *a, **k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(xb), "copy_to_host", spy)
        host_yb = yb.copy_to_host()
        assert reads == [yb.shape]               # the spy sees a read
        reads.clear()
        _, host = _count(lambda: train_step(model, opt, xb, host_yb))
    assert host == [n for n in step if n != "_flag_bad_labels"] and reads == []
    from numbafuse import kernels                # the shared seeds were never written
    assert kernels._ONES and all((a.copy_to_host() == 1).all() for a in kernels._ONES.values())


def test_the_skip_gradient_added_by_the_dx_epilogue_changes_no_bit(fast_gemms, monkeypatch):
    """The block input's two gradients (the skip's dz, conv_bn_relu's dx) summed by the dx
    GEMM's epilogue (``DX_ADDEND``) or by the tape's _axpby afterwards: the same bits in
    every parameter's gradient (one float32 rounding of the same two values)."""
    from numbafuse.kernels.conv import cuda as conv_cuda
    runs = []
    for adds in (True, False):
        monkeypatch.setattr(conv_cuda, "DX_ADDEND", adds)
        model, opt, xb, yb = _digits_step_setup()
        with recording() as rec:
            nf.cross_entropy(model(nf.Tensor(xb)), yb).backward()
        runs.append(([p.grad.copy_to_host() for p in model.parameters()], rec.names))
    assert "_axpby" not in runs[0][1] and "_axpby" in runs[1][1]
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a, b)


def _allocations_after(steps, model, opt, xb, yb):
    for _ in range(steps):
        loss, _, _ = train_step(model, opt, xb, yb)
        loss.item()
    gc.collect()
    return nfcuda.memory_stats()


def steady_state(model, opt, xb, yb, warm=2, more=2):
    """(pool counters after ``warm`` steps, after ``more`` further steps)."""
    return (_allocations_after(warm, model, opt, xb, yb),
            _allocations_after(more, model, opt, xb, yb))


def test_steady_state_training_makes_no_new_allocation(fast_gemms):
    before, after = steady_state(*_digits_step_setup())
    assert after["requests"] - before["requests"] > 50    # the steps did ask the pool
    assert after["allocations"] == before["allocations"]
    assert after["bytes_in_use"] == before["bytes_in_use"]   # nothing kept alive


def test_a_planted_leak_is_caught(fast_gemms, monkeypatch):
    kept = []                                        # a cache that keeps every output alive
    real = bn_cuda._empty

    def leaky(shape, dtype):
        a = real(shape, dtype)
        kept.append(a)
        return a
    monkeypatch.setattr(bn_cuda, "_empty", leaky)
    before, after = steady_state(*_digits_step_setup())
    # CUDA's pool reserves memory in large chunks, so a small leak need not reserve more
    # (it did not on an H100); the bytes held by live arrays grow whatever the pool
    assert after["bytes_in_use"] > before["bytes_in_use"]
