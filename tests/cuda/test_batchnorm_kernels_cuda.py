"""Batch-norm kernels (kernels/cuda/batchnorm.py, reduce.py) called directly, against the
reference and against the CPU kernels' packed mask, at shapes that span several reduction
parts, several grid-stride rounds and partial groups; the GPU paths (warp shuffles,
ballot_sync) through the conftest emulation.

Run: NUMBA_ENABLE_CUDASIM=1 python -m pytest -q tests/cuda/test_batchnorm_kernels_cuda.py
"""
import numpy as np
import pytest
from numba import cuda

from numbafuse import reference as ref
from numbafuse.kernels.batchnorm import cpu
from numbafuse.kernels.cuda import config
from numbafuse.kernels.cuda import reduce
from numbafuse.kernels.batchnorm import cuda as bn

TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-10, atol=1e-12)}
SHAPES = {"NCHW": (3, 2, 5, 7), "NHWC": (3, 5, 7, 37)}   # NHWC: C over one 32-lane group


def _axes(layout):
    return (0, 2, 3) if layout == "NCHW" else (0, 1, 2)


def _chan(a, layout):
    return a.reshape(1, -1, 1, 1) if layout == "NCHW" else a.reshape(1, 1, 1, -1)


def _data(layout, dtype, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    shape = SHAPES[layout]
    C = shape[1] if layout == "NCHW" else shape[3]
    x = (rng.standard_normal(shape) + offset).astype(dtype)
    z, gy = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    gamma, beta = rng.uniform(0.5, 1.5, C).astype(dtype), rng.standard_normal(C).astype(dtype)
    return x, z, gy, gamma, beta


def _full_pass(layout, dtype, x, z, gy, gamma, beta, want_mask=True):
    d = [cuda.to_device(a) for a in (x, z, gy, gamma, beta)]
    mean, var, invstd = bn.stats(d[0], layout, 1e-5)
    y, mask = bn.apply(d[0], mean, invstd, d[3], d[4], d[1], True, layout, want_mask)
    state_kind, state = (bn.STATE_MASK, mask) if want_mask else (bn.STATE_Y, y)
    grads = bn.backward(d[2], d[0], mean, invstd, d[3], state_kind, state, layout, True,
                        (True, True, True, True))
    return mean, var, y, mask, grads


def _garbage_outputs(monkeypatch):
    """Outputs start as garbage (NaN, 0xA5 bytes): an element a kernel forgets is seen."""
    def empty(shape, dtype):
        fill = 0xA5 if np.dtype(dtype) == np.uint8 else np.nan
        return cuda.to_device(np.full(shape, fill, dtype))
    monkeypatch.setattr(bn, "_empty", empty)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype,threads", [(np.float32, 16), (np.float64, 64)])
def test_stats_apply_backward_match_reference(layout, dtype, threads, monkeypatch):
    # 16 threads: several rounds and parts per channel; 64: NHWC blocks of 2 row groups
    monkeypatch.setattr(config, "threads", threads)
    _garbage_outputs(monkeypatch)
    x, z, gy, gamma, beta = _data(layout, dtype)
    mean, var, y, mask, grads = _full_pass(layout, dtype, x, z, gy, gamma, beta)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean.copy_to_host(), x64.mean(axis=_axes(layout)), rtol=1e-6,
                               atol=1e-6 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(var.copy_to_host(), x64.var(axis=_axes(layout)), rtol=1e-5)
    y_ref, _, _ = ref.batchnorm_add_relu(x, z, gamma, beta, layout=layout)
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **TOL[dtype])
    dx, dz, dgamma, dbeta = ref.batchnorm_add_relu_backward(gy, x, z, gamma, beta,
                                                            layout=layout)
    for g, e in zip(grads, (dx, dgamma, dbeta, dz)):     # the kernel's (dx, dgamma, dbeta, dz)
        np.testing.assert_allclose(g.copy_to_host(), e, **TOL[dtype])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("target,parts", [(2, 1), (5, 3)])
def test_the_block_cap_sets_the_parts(layout, target, parts, monkeypatch):
    # reduce_target_blocks bounds the reduction's blocks in all: NCHW 2 channels per block
    # row each, NHWC one 8-lane group of its 37 channels... with 8 threads, parts of M
    monkeypatch.setattr(config, "threads", 8)
    monkeypatch.setattr(config, "reduce_blocks", 64)
    monkeypatch.setattr(config, "reduce_target_blocks", target)
    _garbage_outputs(monkeypatch)
    x = _data(layout, np.float64, seed=3)[0]
    rows = 2 if layout == "NCHW" else -(-37 // 8)
    expect = max(1, min(64, -(-x.size // x.shape[1 if layout == "NCHW" else 3] // (8 * reduce.U)),
                        -(-target // rows)))
    partials, got = reduce.channel_partials(reduce.ELEM_STATS, *(cuda.to_device(x),) * 3,
                                            reduce._NO_MASK(), reduce._NO_MEAN(),
                                            bn.STATE_NONE, layout, bn._empty)
    assert got == expect and (layout == "NHWC" or got == parts)
    mean, var, _ = bn.stats(cuda.to_device(x), layout, 1e-5)     # finished by the last block
    np.testing.assert_allclose(mean.copy_to_host(), x.mean(axis=_axes(layout)), rtol=1e-10)
    np.testing.assert_allclose(var.copy_to_host(), x.var(axis=_axes(layout)), rtol=1e-10)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("ballot", [False, True])
def test_mask_is_the_cpu_format(layout, ballot, monkeypatch, warp_shuffles):
    # warp-sized blocks: the ballot path (emulated) and the shared-memory path build the same
    # bytes as the CPU kernels, including a partial last byte (size not a multiple of 8)
    monkeypatch.setattr(config, "threads", 32)
    monkeypatch.setattr(bn, "USE_BALLOT", ballot)
    monkeypatch.setattr(reduce, "USE_SHUFFLE", ballot)
    _garbage_outputs(monkeypatch)
    x, z, gy, gamma, beta = _data(layout, np.float64, seed=2)
    x = x[:, :, :, :-1].copy() if layout == "NCHW" else x[:, :, :-1, :].copy()
    z = np.zeros_like(x)
    mean, var, invstd = bn.stats(cuda.to_device(x), layout, 1e-5)
    y, mask = bn.apply(cuda.to_device(x), mean, invstd, cuda.to_device(gamma),
                       cuda.to_device(beta), cuda.to_device(z), True, layout, True)
    y_cpu, mask_cpu = cpu.apply(x, mean.copy_to_host(), invstd.copy_to_host(), gamma, beta, z,
                                True, layout, True)
    assert x.size % 8 != 0
    np.testing.assert_allclose(y.copy_to_host(), y_cpu, **TOL[np.float64])
    np.testing.assert_array_equal(mask.copy_to_host(), mask_cpu)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_large_means_keep_their_digits_in_float32(layout):
    x, z, gy, gamma, beta = _data(layout, np.float32, seed=3, offset=1e4)
    mean, var, y, mask, grads = _full_pass(layout, np.float32, x, z, gy, gamma, beta)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(var.copy_to_host(), x64.var(axis=_axes(layout)), rtol=1e-5)
    y_ref, _, _ = ref.batchnorm_add_relu(x64, z, gamma, beta, layout=layout)
    np.testing.assert_allclose(y.copy_to_host(), y_ref, **TOL[np.float32])
    gx_ref = ref.batchnorm_add_relu_backward(gy, x64, z, gamma, beta, layout=layout)[0]
    np.testing.assert_allclose(grads[0].copy_to_host(), gx_ref, rtol=1e-3, atol=1e-4)


def test_reruns_are_bit_identical(monkeypatch):
    monkeypatch.setattr(config, "threads", 16)
    data = _data("NHWC", np.float32, seed=4)
    runs = []
    for _ in range(2):
        mean, var, y, mask, grads = _full_pass("NHWC", np.float32, *data)
        runs.append([a.copy_to_host() for a in (mean, var, y, mask) + tuple(grads)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_channel_sums_masked(layout):
    x, z, gy, gamma, beta = _data(layout, np.float64, seed=5)
    got = reduce.channel_sums(cuda.to_device(gy), cuda.to_device(x), layout).copy_to_host()
    np.testing.assert_allclose(got, (gy * (x > 0)).sum(axis=_axes(layout)), **TOL[np.float64])


def test_a_tensor_past_the_index_range_is_refused_before_anything_is_written(monkeypatch):
    # the walks' offsets are uint32 (x.size <= bn.MAX_SIZE); past that, a ValueError naming
    # the op, raised before the running statistics change (MAX_SIZE lowered to reach it)
    import numbafuse as nf
    x, z, gy, gamma, beta = _data("NCHW", np.float32)
    rm, rv = cuda.to_device(np.zeros(2, np.float32)), cuda.to_device(np.ones(2, np.float32))
    args = [cuda.to_device(a) for a in (x, z, gamma, beta)]
    monkeypatch.setattr(bn, "MAX_SIZE", x.size - 1)
    with pytest.raises(ValueError, match="batch norm .cuda.: x has 210 elements"):
        nf.batchnorm_add_relu(*args, running_mean=rm, running_var=rv)
    np.testing.assert_array_equal(rm.copy_to_host(), 0.0)
    np.testing.assert_array_equal(rv.copy_to_host(), 1.0)
    monkeypatch.setattr(bn, "MAX_SIZE", x.size)
    nf.batchnorm_add_relu(*args, running_mean=rm, running_var=rv)       # at the limit: runs
    assert np.all(rm.copy_to_host() != 0.0)


def _planted_near_zero(layout, dtype, rng):
    """(x, gamma, beta, at_x0, above, pdt): x with half of each channel's values at x0 or
    1-3 ulps from it, beta chosen after the statistics so that gamma*xhat + beta at x0 is
    exactly 0 in the kernels' arithmetic (mean split hi + lo, every operation rounded to the
    element math's dtype ``pdt``: float32 for a float16 x)."""
    shape = SHAPES[layout]
    axis = 1 if layout == "NCHW" else 3
    C = shape[axis]
    pdt = np.float32 if dtype == np.float16 else dtype
    x = rng.standard_normal(shape).astype(dtype)
    x0 = rng.standard_normal(C).astype(dtype)
    xc = np.moveaxis(x, axis, -1)                                    # (..., C) view of x
    pick = rng.random(xc.shape[:-1]) < 0.5
    ulps = rng.integers(-3, 4, xc.shape)
    near = np.broadcast_to(x0, xc.shape).copy()
    for step in range(1, 4):
        for sign in (-1, 1):
            at = ulps * sign >= step
            near[at] = np.nextafter(near[at], dtype(sign * np.inf)).astype(dtype)
    xc[pick] = near[pick]
    mean, _, invstd = (a.copy_to_host() for a in bn.stats(cuda.to_device(x), layout, 1e-5))
    gamma = rng.uniform(0.5, 1.5, C).astype(pdt)
    hi = mean.astype(pdt)
    lo = (mean - hi).astype(pdt)
    scale = (gamma.astype(np.float64) * invstd).astype(pdt)
    beta = (-(((x0.astype(pdt) - hi) - lo) * scale)).astype(pdt)
    at_x0 = xc == x0
    above = xc == np.nextafter(x0, dtype(np.inf)).astype(dtype)
    return x, gamma, beta, at_x0, above, pdt


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_affine_gate_decides_as_the_forward(layout, dtype, monkeypatch):
    """STATE_AFFINE (Conv-BatchNorm-ReLU's recompute): the backward's two kernels gate g by
    ``gamma*xhat + beta > 0`` of x itself, computed as the forward's apply computes it
    (``reduce.affine`` in all three), so the gradients equal the forward mask's bit for bit,
    pre-activations of exactly 0 and 1-3 ulps from it included; through the reduction
    (training, with and without dz) and without it (inference dx: ``_bwd_finalize``)."""
    from numbafuse.cuda import SIMULATOR
    monkeypatch.setattr(config, "threads", 32)       # several parts and rounds per channel
    _garbage_outputs(monkeypatch)
    rng = np.random.default_rng(21)
    x, gamma, beta, at_x0, above, pdt = _planted_near_zero(layout, dtype, rng)
    gy = rng.standard_normal(x.shape).astype(dtype)
    d_x, d_gy, d_gamma, d_beta = (cuda.to_device(a) for a in (x, gy, gamma, beta))
    mean, var, invstd = bn.stats(d_x, layout, 1e-5)
    y, mask = bn.apply(d_x, mean, invstd, d_gamma, d_beta, None, True, layout, True)
    y = np.moveaxis(y.copy_to_host(), 1 if layout == "NCHW" else 3, -1)
    assert at_x0.sum() >= 8 and above.any()
    if SIMULATOR:      # (a GPU may contract the apply into an FMA: exactly 0 is not promised)
        assert (y[at_x0] == 0).all() and (y[above] > 0).any()   # the crossing is reached
    for training, need in [(True, (True, True, True, False)), (True, (True, True, True, True)),
                           (False, (True, False, False, True))]:
        by_mask = bn.backward(d_gy, d_x, mean, invstd, d_gamma, bn.STATE_MASK, mask, layout,
                              training, need)
        by_affine = bn.backward(d_gy, d_x, mean, invstd, d_gamma, bn.STATE_AFFINE, d_beta,
                                layout, training, need)
        for a, b in zip(by_mask, by_affine):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a.copy_to_host(), b.copy_to_host())
