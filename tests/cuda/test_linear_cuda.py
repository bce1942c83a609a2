"""The linear layer's backward on the device (kernels/basic/cuda.py): its three gradients in
one launch (``_linear_bwd``), each summed as the separate kernels summed it.

Run: NUMBA_ENABLE_CUDASIM=1 python -m pytest -q tests/cuda/test_linear_cuda.py
"""
import numpy as np
import pytest
from numba import cuda

from numbafuse.kernels.basic import cuda as basic
from numbafuse.kernels.cuda import config

from .launches import recording

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("need", [(True, True, True), (False, True, True), (True, False, False),
                                  (False, False, True)])
def test_one_launch_gives_the_separate_kernels_bits(need, monkeypatch):
    # N = 18, F_in = 17, F_out = 260: gx, gw past the 16 x 16 tiles (partial last ones), gb
    # in two chunks of 256 columns; two blocks walk the mixed work items (grid-stride)
    monkeypatch.setattr(config, "max_blocks", 2)
    rng = np.random.default_rng(3)
    N, F_in, F_out = 18, 17, 260
    gy, x, w = (rng.standard_normal(s).astype(np.float32)
                for s in ((N, F_out), (N, F_in), (F_out, F_in)))
    d_gy, d_x, d_w = (cuda.to_device(a) for a in (gy, x, w))
    with recording() as rec:
        gx, gw, gb = basic.linear_backward(d_gy, d_x, d_w, *need)
    assert rec.names == ["_linear_bwd"]
    for got, wanted in zip((gx, gw, gb), need):
        assert (got is None) == (not wanted)
    if need[0]:
        alone = basic._matmul(d_gy, d_w, None, False, False, (N, F_in))
        np.testing.assert_array_equal(gx.copy_to_host(), alone.copy_to_host())
        np.testing.assert_allclose(gx.copy_to_host(), gy.astype(np.float64) @ w, rtol=1e-5,
                                   atol=1e-5)
    if need[1]:
        alone = basic._matmul(d_gy, d_x, None, True, False, (F_out, F_in))
        np.testing.assert_array_equal(gw.copy_to_host(), alone.copy_to_host())
        np.testing.assert_allclose(gw.copy_to_host(), gy.T.astype(np.float64) @ x, rtol=1e-5,
                                   atol=1e-5)
    if need[2]:       # one thread a column, rows in order, in float64
        in_order = np.cumsum(gy.astype(np.float64), axis=0)[-1].astype(np.float32)
        np.testing.assert_array_equal(gb.copy_to_host(), in_order)


def test_nothing_wanted_launches_nothing():
    d = cuda.to_device(np.ones((2, 3), np.float32))
    with recording() as rec:
        assert basic.linear_backward(d, d, cuda.to_device(np.ones((3, 3), np.float32)),
                                     False, False, False) == (None, None, None)
    assert rec.names == []
