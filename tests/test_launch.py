"""CPU kernels run on the calling thread alone for small inputs (kernels/cpu_launch.py).

Property tests draw small shapes, which run on the calling thread; here the same ops run with
the threshold at 0 (every kernel on the pool) and at infinity (every kernel on the calling
thread), and must agree bit for bit with each other and with the reference.
"""
import numpy as np
import pytest

import numbafuse as nf
from numbafuse import reference
from numbafuse.kernels import cpu_launch as _launch


def _run_all(x, w, b, z, gamma, beta, layout):
    y = nf.conv_bias_relu(x, w, b, padding=1, layout=layout)
    grads = nf.conv_bias_relu_backward(np.ones_like(y), x, w, y, padding=1, layout=layout)
    rm, rv = np.zeros_like(gamma), np.ones_like(gamma)
    out = nf.batchnorm_add_relu(y, z, gamma, beta, running_mean=rm, running_var=rv,
                                layout=layout)
    bn_grads = nf.batchnorm_add_relu_backward(np.ones_like(out), y, z, gamma, beta,
                                              layout=layout, y=out)
    pooled = nf.max_pool2d(nf.relu(out), 2, layout=layout)
    return [y, *grads, out, rm, rv, *bn_grads, pooled]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_parallel_and_serial_builds_agree(layout, monkeypatch, rng):
    shape = (3, 4, 6, 6) if layout == "NCHW" else (3, 6, 6, 4)
    x = rng.standard_normal(shape).astype(np.float32)
    z = rng.standard_normal(shape).astype(np.float32)
    w = (rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    gamma, beta = rng.uniform(0.5, 1.5, 4).astype(np.float32), np.zeros(4, np.float32)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 0)
    parallel = _run_all(x, w, b, z, gamma, beta, layout)
    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 2**62)
    serial = _run_all(x, w, b, z, gamma, beta, layout)
    for p, s in zip(parallel, serial):
        assert p.tobytes() == s.tobytes()
    ref = reference.conv_bias_relu(x, w, b, padding=1, layout=layout)
    np.testing.assert_allclose(parallel[0], ref, rtol=1e-4, atol=1e-5)


def test_threshold_picks_the_threads(monkeypatch):
    """Below PARALLEL_MIN_ELEMENTS a launch is one call on the calling thread."""
    import threading

    calls = []

    def kernel(t0, t1):
        calls.append((t0, t1, threading.get_ident()))

    monkeypatch.setattr(_launch, "PARALLEL_MIN_ELEMENTS", 10)
    _launch.launch(kernel, 8, work=9)
    assert calls == [(0, 8, threading.get_ident())]
    calls.clear()
    _launch.launch(kernel, 8, work=10)
    assert sorted(t for c in calls for t in range(c[0], c[1])) == list(range(8))
    if _launch.num_threads() > 1:
        assert len(calls) > 1                          # ranges handed out, not one call
