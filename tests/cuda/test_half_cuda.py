"""float16 batch norm on the device: ``kernels/batchnorm/cuda.py`` and ``cuda/reduce.py`` load
and store half and compute in float32 (``reduce.widen``). Checked against the CPU, which
converts to float32 and back, on the same inputs: forward, running statistics and tape
gradients within one half ulp (each side rounds a float32-arithmetic result once; the
reference-based checks are ``tests/test_half.py``), with the launch sizes patched small so
the reductions span several parts and channel loops and the elementwise walks several
grid-stride rounds. Every float16 kernel signature is also compiled for sm_90
(``tests/test_ptx.py``).
"""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import backend as nfb
from numbafuse.kernels.cuda import config

SHAPES = {"NCHW": (3, 4, 3, 5), "NHWC": (2, 3, 3, 11)}   # NHWC: channels over 2 lane groups


@pytest.fixture
def small_launches(monkeypatch):
    for name, value in (("threads", 8), ("reduce_blocks", 2), ("max_blocks", 2),
                        ("max_grid_y", 2)):
        monkeypatch.setattr(config, name, value)


def _within_one_ulp(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, f"{what}: {a.dtype} vs {b.dtype}"
    if a.dtype != np.float16:                       # float32 parameters and their gradients
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6, err_msg=what)
        return
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    ulp = np.spacing(np.abs(b)).astype(np.float64)
    assert (diff <= ulp * 1.001).all(), f"{what}: {diff.max()} > 1 ulp ({np.argmax(diff)})"


def _run(put, arrays, stats, kw, dy):
    """(y, running mean, running var, gradients) of the tape on one backend, as host arrays."""
    tensors = [nf.Tensor(put(a), requires_grad=True) for a in arrays]
    rm, rv = (put(s.copy()) for s in stats)
    y = nf.batchnorm_add_relu(*tensors, running_mean=rm, running_var=rv, **kw)
    y.backward(put(dy))
    host = nfb.to_host
    return [host(y.data), host(rm), host(rv)] + [host(t.grad) for t in tensors]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("params", [np.float16, np.float32])
@pytest.mark.parametrize("training, save", [(True, "output"), (True, "mask"),
                                            (False, "output")])
def test_half_batchnorm_on_the_device_matches_the_cpu(layout, params, training, save,
                                                      small_launches):
    rng = np.random.default_rng(11)
    shape = SHAPES[layout]
    C = shape[1] if layout == "NCHW" else shape[3]
    x = (rng.standard_normal(shape) * 2 + 3).astype(np.float16)     # a mean to subtract
    z, dy = (rng.standard_normal(shape).astype(np.float16) for _ in range(2))
    arrays = (x, z, rng.uniform(0.5, 1.5, C).astype(params),
              rng.standard_normal(C).astype(params))
    stats = (rng.standard_normal(C).astype(params), rng.uniform(0.5, 2.0, C).astype(params))
    kw = dict(training=training, momentum=0.3, eps=1e-3, layout=layout, save=save)
    host = _run(lambda a: a, arrays, stats, kw, dy)
    device = _run(nfb.to_device, arrays, stats, kw, dy)
    names = ("y", "running_mean", "running_var", "dx", "dz", "dgamma", "dbeta")
    for got, want, name in zip(device, host, names):
        _within_one_ulp(got, want, name)
