"""BatchNorm -> Add -> ReLU and the unfused batchnorm: what the harness does not ask of every
op, on every backend (``backend`` is injected: CPU, and CUDA in the ``-m cuda`` process).

Forward (both modes, running statistics, momentum), backward (y, mask and recomputed ReLU
states), gradcheck, the unfused chain and reruns are in ``tests/test_ops.py``; task and
grid-stride boundaries in ``tests/test_boundaries.py``; bad input in ``tests/test_errors.py``.
Here: the numerics (channel means of 1e4 in float32, a constant channel, NaN), the save
policies' bytes and gradients, the gradients actually computed, thread-count independence
(CPU) and the warp-shuffle reduction (CUDA).
"""
import numpy as np
import pytest
from hypothesis import strategies as st

import numbafuse as nf
import numbafuse.testing.strategies as nfs
from numbafuse import reference as ref
from numbafuse import validate
from numbafuse.ops import batchnorm as bn

from .harness import BACKENDS, TOL, close, run_property

LARGE_MEAN = 1e4          # channel means of this size, unit variance (float32 accuracy test)
LARGE_MEAN_RTOL = 1e-4    # relative error allowed there, against a float64 reference


def _problem(layout="NCHW", shape=(2, 3, 4, 5), dtype=np.float64, seed=7):
    rng = np.random.default_rng(seed)
    C = shape[1] if layout == "NCHW" else shape[3]
    return nfs.BatchNormProblem(
        x=rng.standard_normal(shape).astype(dtype), z=rng.standard_normal(shape).astype(dtype),
        gamma=rng.uniform(0.5, 1.5, C).astype(dtype), beta=rng.standard_normal(C).astype(dtype),
        running_mean=rng.standard_normal(C).astype(dtype),
        running_var=rng.uniform(0.5, 2.0, C).astype(dtype), layout=layout)


def _leaves(backend, p):
    return [nf.Tensor(backend.put(a), requires_grad=True) for a in (p.x, p.z, p.gamma, p.beta)]


def test_only_needed_gradients_are_computed(backend):
    p = _problem()
    x, gamma = (nf.Tensor(backend.put(a), requires_grad=True) for a in (p.x, p.gamma))
    y = nf.batchnorm_add_relu(x, backend.put(p.z), gamma, backend.put(p.beta))
    fn = y._fn
    assert fn.needs_input_grad == (True, False, True, False)   # z, beta: plain arrays
    dx, dz, dgamma, dbeta = fn.backward(backend.put(np.ones(p.x.shape)))
    assert dz is None and dbeta is None and dx is not None and dgamma is not None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_policy_saves_y_minus_mask_bytes(backend, dtype):
    p = _problem(shape=(2, 3, 5, 7), dtype=dtype)                  # 210 elements: 27 mask bytes
    held = {}
    for save in validate.SAVE_POLICIES:
        y = nf.batchnorm_add_relu(nf.Tensor(backend.put(p.x), requires_grad=True),
                                  *map(backend.put, (p.z, p.gamma, p.beta)), save=save)
        held[save] = nf.saved_bytes(y)
    size, itemsize = p.x.size, np.dtype(dtype).itemsize
    mask_bytes = bn.mask_nbytes(size)
    assert mask_bytes == -(-size // 8)
    assert held["output"] - held["mask"] == size * itemsize - mask_bytes
    # x, mean and invstd (float64, C each), gamma, and the ReLU state
    assert held["mask"] == size * itemsize + 2 * 3 * 8 + 3 * itemsize + mask_bytes


@pytest.mark.parametrize("layout,shape", [("NCHW", (2, 3, 4, 4)), ("NCHW", (3, 2, 3, 5)),
                                          ("NHWC", (2, 3, 3, 8)), ("NHWC", (2, 3, 5, 3))])
def test_mask_and_output_states_give_the_same_gradients(backend, layout, shape):
    """Rows on and off mask-byte boundaries (HW or C a multiple of 8, or not); the packed mask
    is NumPy's packbits of y > 0."""
    p = _problem(layout, shape=shape)
    dy = np.random.default_rng(8).standard_normal(shape)
    grads = {}
    for save in validate.SAVE_POLICIES:
        leaves = _leaves(backend, p)
        nf.batchnorm_add_relu(*leaves, layout=layout, save=save).backward(backend.put(dy))
        grads[save] = [backend.get(t.grad) for t in leaves]
    for a, b in zip(grads["output"], grads["mask"]):
        np.testing.assert_array_equal(a, b)
    x = backend.put(p.x)
    mean, _, invstd = bn.bn_stats(x, layout=layout)
    y, mask = bn.bn_apply(x, mean, invstd, *map(backend.put, (p.gamma, p.beta)),
                          z=backend.put(p.z), layout=layout, with_mask=True)
    np.testing.assert_array_equal(backend.get(mask), np.packbits(backend.get(y).reshape(-1) > 0,
                                                                 bitorder="little"))


def test_float32_large_channel_means(backend):
    """float32 with |mean| ~ 1e4, unit variance: relative error <= 1e-4 vs float64."""
    def body(draw):
        p = draw(nfs.batchnorm_problems(dtype=np.float32, mean_scale=LARGE_MEAN,
                                        **(dict(max_batch=2, max_channels=3, max_size=3)
                                           if backend.small else {})))
        training = draw(st.booleans())
        f64 = [a.astype(np.float64) for a in (p.x, p.z, p.gamma, p.beta)]
        # running stats near the batch's (large) means, as float32 values
        rm = ref.batchnorm_train(f64[0], f64[2], f64[3], layout=p.layout)[1] \
            .astype(np.float32).astype(np.float64)
        rv = p.running_var.astype(np.float64)
        y_ref = ref.batchnorm_add_relu(*f64, rm, rv, training=training, layout=p.layout)[0]
        stats32 = [backend.put(a.astype(np.float32)) for a in (rm, rv)]
        y = backend.get(nf.batchnorm_add_relu(*map(backend.put, (p.x, p.z, p.gamma, p.beta)),
                                              running_mean=stats32[0], running_var=stats32[1],
                                              training=training, layout=p.layout))
        assert np.abs(y - y_ref).max() <= LARGE_MEAN_RTOL * np.abs(y_ref).max()
        dy = np.random.default_rng(5).standard_normal(p.x.shape)
        expected = ref.batchnorm_add_relu_backward(dy, *f64, rm, rv, training=training,
                                                   layout=p.layout)
        got = nf.batchnorm_add_relu_backward(
            *map(backend.put, (dy.astype(np.float32), p.x, p.z, p.gamma, p.beta,
                               rm.astype(np.float32), rv.astype(np.float32))),
            training, layout=p.layout)
        for g, e in zip(got, expected):
            assert np.abs(backend.get(g) - e).max() <= LARGE_MEAN_RTOL * max(np.abs(e).max(), 1)

    run_property(f"large-means:{backend.name}", 5 * backend.cost, body)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_constant_channel_is_finite(backend, layout):
    p = _problem(layout)
    x = p.x.copy()
    x[(slice(None), 1) if layout == "NCHW" else (..., 1)] = 3.0
    leaves = _leaves(backend, nfs.BatchNormProblem(x, p.z, p.gamma, p.beta, p.running_mean,
                                                   p.running_var, layout))
    y = nf.batchnorm_add_relu(*leaves, layout=layout)
    y.backward(backend.put(np.ones(x.shape)))
    assert np.isfinite(backend.get(y.data)).all()
    assert all(np.isfinite(backend.get(t.grad)).all() for t in leaves)
    close(backend.get(y.data), ref.batchnorm_add_relu(x, p.z, p.gamma, p.beta,
                                                      layout=layout)[0], np.float64)


def test_nan_in_x_propagates_through_the_relu(backend):
    p = _problem()
    x = p.x.copy()
    x[0, 0, 0, 0] = np.nan
    y = backend.get(nf.batchnorm_add_relu(*map(backend.put, (x, p.z, p.gamma, p.beta))))
    assert np.isnan(y[:, 0]).all()               # channel 0's statistics are NaN
    assert np.isfinite(y[:, 1:]).all()


def test_one_value_per_channel_is_fine_in_inference(backend):
    p = _problem(shape=(1, 3, 1, 1))
    y = nf.batchnorm_add_relu(*map(backend.put, (p.x, p.z, p.gamma, p.beta)), training=False,
                              running_mean=backend.put(p.running_mean),
                              running_var=backend.put(p.running_var))
    close(backend.get(y), ref.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, p.running_mean,
                                                 p.running_var, training=False)[0], np.float64)


def test_tensor_arguments_are_accepted_everywhere(backend):
    """Tensors where arrays go (NumPy-style backward, running statistics): their data is used."""
    p = _problem(shape=(2, 2, 2, 3) if backend.small else (2, 3, 4, 5))
    T = nf.Tensor
    a = {k: backend.put(v) for k, v in vars(p).items() if k != "layout"}
    dy = backend.put(np.random.default_rng(1).standard_normal(p.x.shape))
    order = ("x", "z", "gamma", "beta", "running_mean", "running_var")
    for training in (True, False):
        expected = nf.batchnorm_add_relu_backward(dy, *(a[k] for k in order), training)
        got = nf.batchnorm_add_relu_backward(T(dy), *(T(a[k]) for k in order), training)
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(backend.get(g), backend.get(e))
    y = nf.batchnorm_add_relu(a["x"], a["z"], a["gamma"], a["beta"])
    got = nf.batchnorm_add_relu_backward(T(dy), T(a["x"]), None, T(a["gamma"]), None, y=T(y))
    expected = nf.batchnorm_add_relu_backward(dy, a["x"], None, a["gamma"], None, y=y)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(backend.get(g), backend.get(e))
    rm, rv = T(backend.put(p.running_mean)), T(backend.put(p.running_var))
    nf.batchnorm_add_relu(a["x"], a["z"], a["gamma"], a["beta"], running_mean=rm,
                          running_var=rv)
    nf.batchnorm(a["x"], a["gamma"], a["beta"], running_mean=rm, running_var=rv)
    assert not np.array_equal(backend.get(rm.data), p.running_mean)   # updated, via .data


@pytest.mark.parametrize("layout, shape", [("NHWC", (4, 32, 32, 24)), ("NCHW", (4, 24, 32, 32))])
def test_result_does_not_depend_on_thread_count(layout, shape, monkeypatch):
    """CPU: the reductions' partials are fixed by the shape, not by the threads (98304
    elements: past the passes' parallel threshold, set to 65536 here, several tasks per
    pass)."""
    from numbafuse.kernels.batchnorm import cpu as bn_cpu
    from numbafuse.kernels.cpu import launch as cpu_launch
    monkeypatch.setattr(bn_cpu, "PARALLEL_MIN", 1 << 16)
    p = _problem(layout, shape=shape)
    dy = np.random.default_rng(6).standard_normal(p.x.shape)
    runs = []
    before = cpu_launch.num_threads()
    try:
        for threads in (1, 3):
            cpu_launch.set_num_threads(threads)
            runs.append([nf.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, layout=layout),
                         *nf.batchnorm_add_relu_backward(dy, p.x, p.z, p.gamma, p.beta,
                                                         layout=layout)])
    finally:
        cpu_launch.set_num_threads(before)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_small_batch_norm_passes_stay_on_the_calling_thread(layout, monkeypatch):
    """CPU: an x of fewer than ``PARALLEL_MIN`` elements runs every pass on the calling thread
    (the helpers' hand-off cost more than they saved there); a larger one is split."""
    from numbafuse.kernels.batchnorm import cpu as bn_cpu
    from numbafuse.kernels.cpu import launch as cpu_launch
    seen = []
    real = cpu_launch.launch

    def spy(kernel, ntasks, *args, work=None, grain=None, parallel_min=None):
        least = cpu_launch.PARALLEL_MIN_ELEMENTS if parallel_min is None else parallel_min
        seen.append(work is not None and work < least)
        return real(kernel, ntasks, *args, work=work, grain=grain, parallel_min=parallel_min)
    monkeypatch.setattr(bn_cpu, "launch", spy)
    for shape, serial in (((16, 256, 4, 4), True), ((16, 128, 8, 8), True),
                          ((16, 64, 16, 16), False), ((8, 64, 32, 32), False)):
        C = shape[1]
        shape = shape if layout == "NCHW" else (shape[0], shape[2], shape[3], C)
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        g, b = np.ones(C, np.float32), np.zeros(C, np.float32)
        seen.clear()
        y = nf.batchnorm_add_relu(x, x, g, b, layout=layout)
        nf.batchnorm_add_relu_backward(np.ones_like(y), x, x, g, b, layout=layout, y=y)
        assert len(seen) >= 4 and all(s == serial for s in seen), (shape, seen)
    assert bn_cpu.PARALLEL_MIN == 1 << 18


@pytest.mark.parametrize("need_gz", [True, False])
@pytest.mark.parametrize("parallel_min", [0, 1 << 30])
@pytest.mark.parametrize("layout, shape", [("NCHW", (6, 20, 9, 7)), ("NCHW", (4, 8, 5, 5)),
                                           ("NHWC", (6, 9, 7, 20))])
def test_backward_gated_by_the_mask_is_the_backward_gated_by_y(layout, shape, parallel_min,
                                                                need_gz, monkeypatch):
    """CPU: the backward gated by the packed 1-bit ReLU mask (the kept-h path) gives the bits of
    the one gated by y: every row's own mask bits, over maps past FLAT_MAX_HW (the NCHW row
    kernels: 63 values a row, rows not a multiple of 8, several tasks) and a flat small map,
    on one thread and split; with gz (the second pass reads the first's g) and without (it
    gates again)."""
    from numbafuse.kernels.batchnorm import cpu as bn_cpu
    monkeypatch.setattr(bn_cpu, "PARALLEL_MIN", parallel_min)
    monkeypatch.setattr(bn_cpu, "REDUCE_CHUNK", 512)               # several tasks a pass
    monkeypatch.setattr(bn_cpu, "CHUNK", 512)
    rng = np.random.default_rng(7)
    C = shape[1] if layout == "NCHW" else shape[3]
    x = rng.standard_normal(shape).astype(np.float32)
    gy = rng.standard_normal(shape).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, C).astype(np.float32)
    mean, _, invstd = bn_cpu.stats(x, layout, 1e-5)
    y, mask = bn_cpu.apply(x, mean, invstd, gamma, beta, None, True, layout, True)
    assert 0.2 < (y > 0).mean() < 0.8
    need = (True, True, True, need_gz)
    by_y = bn_cpu.backward(gy, x, mean, invstd, gamma, bn_cpu.STATE_Y, y, layout, True, need)
    by_mask = bn_cpu.backward(gy, x, mean, invstd, gamma, bn_cpu.STATE_MASK, mask, layout,
                              True, need)
    for a, b in zip(by_y, by_mask):
        np.testing.assert_array_equal(a, b)
    if need_gz:
        np.testing.assert_array_equal(by_mask[3], np.where(y > 0, gy, 0))   # gz = the gate


def _near_zero_preactivations(layout, dtype, shape, rng):
    """(x, mean, invstd, gamma, beta, x0): a quarter of each channel's x at x0 (where
    gamma*xhat + beta is exactly 0 in the kernels' arithmetic) or a few ulps from it."""
    C = shape[1] if layout == "NCHW" else shape[3]
    x = rng.standard_normal(shape).astype(dtype)
    mean, _, invstd = bn.bn_stats(x, layout=layout)
    gamma = rng.uniform(0.5, 1.5, C).astype(dtype)
    x0 = rng.standard_normal(C).astype(dtype)
    # beta so that normalize_affine(x0 - mean_hi, mean_lo, scale, beta) == 0, as the CPU
    # kernels round it (mean split into hi + lo, every operation rounded to dtype)
    hi = mean.astype(dtype)
    lo = (mean - hi).astype(dtype)
    scale = (invstd * gamma).astype(dtype)
    beta = -(((x0 - hi) - lo) * scale)
    xc = np.moveaxis(x, 1 if layout == "NCHW" else 3, -1)          # (..., C) view of x
    pick = rng.random(xc.shape[:-1]) < 0.25
    ulps = rng.integers(-3, 4, xc.shape)                           # -3 .. 3 ulps from x0
    near = np.broadcast_to(x0, xc.shape).copy()
    for step in range(1, 4):
        for sign in (-1, 1):
            at = ulps * sign >= step
            near[at] = np.nextafter(near[at], sign * np.inf).astype(dtype)
    xc[pick] = near[pick]
    return x, mean, invstd, gamma, beta, x0


@pytest.mark.parametrize("layout, shape", [("NCHW", (3, 5, 70, 70)), ("NHWC", (3, 70, 70, 5))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_affine_gate_decides_as_the_forward(layout, shape, dtype, threads):
    """CPU: Conv-BatchNorm-ReLU's recompute gates the backward by ``gamma*xhat + beta > 0`` of
    x itself (STATE_AFFINE): it opens exactly where the forward's y > 0, pre-activations of
    exactly 0 and 1-3 ulps from it included, so the gradients equal those of the y state bit
    for bit (with and without dz written by pass 1); 73500 elements, 3 tasks per pass."""
    from numbafuse.kernels.cpu import launch as cpu_launch
    rng = np.random.default_rng(11)
    x, mean, invstd, gamma, beta, x0 = _near_zero_preactivations(layout, dtype, shape, rng)
    y = bn.bn_apply(x, mean, invstd, gamma, beta, relu=True, layout=layout)
    axis = 1 if layout == "NCHW" else 3
    at_x0 = np.moveaxis(x, axis, -1) == x0                           # pre-activation exactly 0
    above = np.moveaxis(x, axis, -1) == np.nextafter(x0, np.inf).astype(dtype)
    assert at_x0.sum() > 100 and (np.moveaxis(y, axis, -1)[at_x0] == 0).all()
    assert (np.moveaxis(y, axis, -1)[above] > 0).any()             # the crossing is reached
    dy = rng.standard_normal(shape).astype(dtype)
    before = cpu_launch.num_threads()
    try:
        cpu_launch.set_num_threads(threads)
        for need in [(True, True, True, False), (True, True, True, True)]:
            by_y = bn.bn_backward(dy, x, mean, invstd, gamma, y, layout=layout, need=need)
            by_affine = bn.bn_backward(dy, x, mean, invstd, gamma, bn.AffineGate(beta),
                                       layout=layout, need=need)
            for a, b in zip(by_y, by_affine):
                if a is None:
                    assert b is None
                else:
                    np.testing.assert_array_equal(a, b)
    finally:
        cpu_launch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(5, 6, 1, 1), (4, 7, 2, 2), (3, 4, 2, 3), (6, 3, 4, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_nchw_maps_walk_one_row_a_sample(shape, dtype, monkeypatch):
    """CPU: an NCHW map of at most FLAT_MAX_HW pixels runs the row kernels on (N, C*H*W)
    rows, each channel's values repeated along the row and its sums folded at a task's end
    (kernels/batchnorm/cpu_rows.py). In tasks of one or two rows (several a pass, the last one
    partial where N is odd), on the pool: the statistics, the forward with z and the ReLU,
    and the backward of every ReLU state against the float64 reference."""
    from numbafuse.kernels.batchnorm import cpu as bn_cpu
    from numbafuse.kernels.cpu import launch as cpu_launch
    monkeypatch.setattr(bn_cpu, "FLAT_CHUNK", 2 * shape[1] * shape[2] * shape[3])
    monkeypatch.setattr(bn_cpu, "CHUNK", 1)
    monkeypatch.setattr(bn_cpu, "PARALLEL_MIN", 0)
    monkeypatch.setattr(cpu_launch, "PARALLEL_MIN_ELEMENTS", 0)
    assert bn_cpu._view(shape, "NCHW").family == "flat"
    kernels = []
    real = bn_cpu.launch

    def spy(kernel, ntasks, *args, **kwargs):
        kernels.append((kernel.py_func.__name__, ntasks))
        return real(kernel, ntasks, *args, **kwargs)
    monkeypatch.setattr(bn_cpu, "launch", spy)
    p = _problem("NCHW", shape=shape, dtype=dtype, seed=12)
    p.x[:] += 3.0                                                  # a shift to subtract
    dy = np.random.default_rng(13).standard_normal(shape).astype(dtype)
    mean, var, invstd = bn.bn_stats(p.x, layout="NCHW")
    y_ref, mean_ref, var_ref = ref.batchnorm_train(p.x, p.gamma, p.beta)
    pre = y_ref.astype(np.float64) + p.z                           # before the ReLU
    y, mask = bn.bn_apply(p.x, mean, invstd, p.gamma, p.beta, z=p.z, relu=True,
                          with_mask=True)
    close(mean, mean_ref, dtype)
    close(var, var_ref, dtype)
    close(y, np.maximum(pre, 0), dtype)
    g = dy * (pre > 0)
    dx_ref, dgamma_ref, dbeta_ref = ref.batchnorm_backward(g, p.x, p.gamma)
    need = (True, True, True, True)
    for state in (y, mask):                                       # STATE_Y, STATE_MASK
        dx, dgamma, dbeta, dz = bn.bn_backward(dy, p.x, mean, invstd, p.gamma, state,
                                               need=need)
        close(dz, g, dtype)
        close(dx, dx_ref, dtype)
        close(dgamma, dgamma_ref, dtype)
        close(dbeta, dbeta_ref, dtype)
    y_affine = bn.bn_apply(p.x, mean, invstd, p.gamma, p.beta, relu=True)
    g = dy * (y_affine > 0)
    dx_ref, dgamma_ref, dbeta_ref = ref.batchnorm_backward(g, p.x, p.gamma)
    dx, dgamma, dbeta, _ = bn.bn_backward(dy, p.x, mean, invstd, p.gamma,
                                          bn.AffineGate(p.beta), need=need)
    close(dx, dx_ref, dtype)
    close(dgamma, dgamma_ref, dtype)
    close(dbeta, dbeta_ref, dtype)
    ran = dict(kernels)
    assert set(ran) == {"_stats_nhwc", "_apply_nhwc", "_bwd_reduce_nhwc", "_bwd_apply_nhwc"}
    assert all(n >= 2 for n in ran.values()), kernels          # several tasks a pass


@pytest.mark.cuda
@pytest.mark.parametrize("threads, shuffle, layout", [(32, True, "NCHW"), (64, True, "NHWC"),
                                                      (64, False, "NCHW")])
def test_warp_sized_blocks_shuffle_path_and_channel_stride(threads, shuffle, layout, monkeypatch,
                                                           warp_shuffles):
    # A real GPU's path: warp-sized blocks and the warp-shuffle reduction (emulated by the
    # warp_shuffles fixture under the simulator); gridDim.y capped below C, so each block
    # loops over channels and reuses its shared buffers; M = 2*5*7 = 70 values per channel
    # leave the grid-stride loops uneven (threads of a block leave at different iterations).
    from numbafuse.kernels.cuda import config
    from numbafuse.kernels.cuda import reduce as kernels      # USE_SHUFFLE lives there
    cuda = BACKENDS["cuda"]
    monkeypatch.setattr(config, "threads", threads)
    monkeypatch.setattr(config, "max_grid_y", 2)
    monkeypatch.setattr(kernels, "USE_SHUFFLE", shuffle)
    p = _problem(layout, shape=(2, 3, 5, 7) if layout == "NCHW" else (2, 5, 7, 3), seed=11)
    dy = np.random.default_rng(12).standard_normal(p.x.shape)
    y_ref, rm_ref, rv_ref = ref.batchnorm_add_relu(p.x, p.z, p.gamma, p.beta, p.running_mean,
                                                   p.running_var, layout=layout)
    args = [cuda.put(a) for a in (p.x, p.z, p.gamma, p.beta)]
    rm, rv = cuda.put(p.running_mean), cuda.put(p.running_var)
    y = nf.batchnorm_add_relu(*args, running_mean=rm, running_var=rv, layout=layout)
    for got, expected in ((y, y_ref), (rm, rm_ref), (rv, rv_ref)):
        np.testing.assert_allclose(cuda.get(got), expected, **TOL[np.dtype(np.float64)])
    expected = ref.batchnorm_add_relu_backward(dy, p.x, p.z, p.gamma, p.beta, layout=layout)
    got = nf.batchnorm_add_relu_backward(cuda.put(dy), *args, y=y, layout=layout)
    for g, e in zip(got, expected):
        close(cuda.get(g), e, np.float64)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape, layout", [((0, 3, 4, 4), "NCHW"), ((2, 3, 0, 4), "NCHW"),
                                           ((0, 4, 4, 3), "NHWC")])
def test_an_empty_batch_gives_empty_outputs_and_updates_nothing(backend, shape, layout,
                                                                 training):
    """N*H*W = 0, as PyTorch's batch_norm: y (and dx, dz) empty, the running statistics left
    as they are, dgamma = dbeta = 0 (sums over no values); on the tape and NumPy style."""
    C = shape[1] if layout == "NCHW" else shape[3]
    rng = np.random.default_rng(0)
    rm, rv = rng.standard_normal(C), rng.uniform(0.5, 2.0, C)
    x, z = np.zeros(shape), np.zeros(shape)
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.standard_normal(C)
    stats = dict(running_mean=backend.put(rm), running_var=backend.put(rv))
    kw = dict(training=training, layout=layout, **stats)
    for fused in (True, False):
        ts = [nf.Tensor(backend.put(a), requires_grad=True) for a in (x, z, gamma, beta)]
        y = nf.batchnorm_add_relu(*ts, **kw) if fused else \
            nf.batchnorm(ts[0], ts[2], ts[3], **kw)
        assert backend.get(y.data).shape == shape
        y.backward(backend.put(np.zeros(shape)))
        assert backend.get(ts[0].grad).shape == shape
        for t in ts[2:]:
            np.testing.assert_array_equal(backend.get(t.grad), np.zeros(C))
    dx, dz, dgamma, dbeta = nf.batchnorm_add_relu_backward(
        *map(backend.put, (x, x, z, gamma, beta)), training=training, layout=layout, **stats)
    assert backend.get(dx).shape == backend.get(dz).shape == shape
    np.testing.assert_array_equal(backend.get(dgamma), np.zeros(C))
    np.testing.assert_array_equal(backend.get(dbeta), np.zeros(C))
    np.testing.assert_array_equal(backend.get(stats["running_mean"]), rm)
    np.testing.assert_array_equal(backend.get(stats["running_var"]), rv)


@pytest.mark.parametrize("params", [np.float32, np.float64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scale_shift_gives_numpys_bits(params, dtype):
    # the inference batch norm as a conv's scale and shift (ops/fold.py), by a compiled step
    # since prepared calls record the eval calls: the bits NumPy's expression gave
    from numbafuse.kernels.batchnorm import cpu_running
    rng = np.random.default_rng(5)
    K = 1000
    gamma = (rng.standard_normal(K) * 10.0 ** rng.integers(-3, 4, K)).astype(params)
    beta = (rng.standard_normal(K) * 10.0 ** rng.integers(-3, 4, K)).astype(params)
    mean = rng.standard_normal(K) * 10.0 ** rng.integers(-3, 4, K)
    invstd = 1.0 / np.sqrt(rng.random(K) * 10.0 ** rng.integers(-3, 4, K) + 1e-5)
    scale, shift = cpu_running.scale_shift(gamma, beta, mean, invstd, np.dtype(dtype))
    s = gamma * invstd
    assert scale.dtype == shift.dtype == dtype
    assert scale.tobytes() == s.astype(dtype).tobytes()
    assert shift.tobytes() == (beta - mean * s).astype(dtype).tobytes()
