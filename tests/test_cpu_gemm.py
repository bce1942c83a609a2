"""The register-tiled float32 GEMM (``kernels/cpu/gemm.py``) and ``cpu.blas.gemm``'s dispatch.

Every block of the tiling is reached: column panels of 24, 16 and 8 (n = 8 ... 64), the 4-row
tiles and the 1-row remainder (m % 4 = 0 ... 3, m < 4), k = 0, 1 and SMALL_K, beta 0 and 1,
a stored as is and transposed, row strides wider than the rows. Guard values around c's block
must be left as they were. The reference is a float64 NumPy product.
"""
import numpy as np
import pytest
from numba import njit

from numbafuse.kernels.cpu import blas as cpu_blas, gemm as cpu_gemm, gemm_taps

GUARD = np.float32(-777.0)


@njit(nogil=True)
def _via_blas(blas, ta, tb, mnk, alpha, a, lda, b, ldb, beta, c, ldc):
    cpu_blas.gemm(blas, ta, tb, mnk, alpha, a, lda, b, ldb, beta, c, ldc)


def _case(rng, m, n, k, pad=3):
    """a (m, k), b (k, n), c (m, n) as views into wider rows filled with guard values."""
    a = np.full((m, k + pad), GUARD)
    b = np.full((k, n + pad), GUARD)
    c = np.full((m + 1, n + pad), GUARD)
    a[:, :k] = rng.standard_normal((m, k))
    b[:, :n] = rng.standard_normal((k, n))
    c[:m, :n] = rng.standard_normal((m, n))
    return a.astype(np.float32), b.astype(np.float32), c.astype(np.float32)


def _expected(a, b, c, m, n, k, beta):
    out = c.astype(np.float64)
    out[:m, :n] = a[:, :k].astype(np.float64) @ b[:, :n].astype(np.float64) \
        + beta * c[:m, :n].astype(np.float64)
    return out


@pytest.mark.parametrize("n", [8, 16, 24, 32, 40, 48, 56, 64])
@pytest.mark.parametrize("m", [0, 1, 3, 4, 5, 6, 7, 13])
def test_gemm_small_every_panel_and_row_remainder(n, m, rng):
    for k in (0, 1, 24, cpu_gemm.SMALL_K):
        for beta in (0, 1):
            for ta in (0, 1):
                a, b, c = _case(rng, m, n, k)
                want = _expected(a, b, c, m, n, k, beta)
                if ta:                                 # the same a, stored transposed (k, m)
                    at = np.full((k, m + 2), GUARD, np.float32)
                    at[:, :m] = a[:, :k].T
                    pa, lda = at.ctypes.data, at.shape[1]
                else:
                    pa, lda = a.ctypes.data, a.shape[1]
                cpu_gemm.gemm_small(ta, (m, n, k), pa, lda, b.ctypes.data, b.shape[1], beta,
                                    c.ctypes.data, c.shape[1], 0, 0)
                np.testing.assert_allclose(c, want, rtol=2e-5, atol=2e-5 * max(k, 1) ** 0.5,
                                           err_msg=f"m={m} n={n} k={k} beta={beta} ta={ta}")
                assert (c[:m, n:] == GUARD).all() and (c[m] == GUARD).all(), "wrote outside c"


@njit(nogil=True)
def _bias_relu(blas, m, n, k, a, b, c, bias, relu):
    cpu_blas.gemm_bias_relu(blas, m, n, k, a, a.shape[1], b, b.shape[1], c[:m, :n], bias, relu)


@pytest.mark.parametrize("small", [True, False])
@pytest.mark.parametrize("n", [8, 24, 40, 128, 256, 264])
def test_gemm_bias_relu_epilogue(small, n, monkeypatch, rng):
    """relu?(a @ b + bias) with the epilogue in registers (n <= SMALL_EPILOGUE_N) or as a pass
    after the BLAS (small off, n = 264): the reference's values, a NaN kept by the ReLU, c's
    guard columns untouched."""
    monkeypatch.setattr(cpu_blas, "SMALL_GEMM", small)
    blas = cpu_blas.blas_for(np.float32)
    for m, k, relu in ((13, 24, True), (6, 64, False), (9, cpu_gemm.SMALL_K, True)):
        a, b, c = _case(rng, m, n, k)
        a[2, 1] = np.nan                                           # row 2 of c all NaN
        bias = rng.standard_normal(n).astype(np.float32)
        want = a[:, :k].astype(np.float64) @ b[:, :n].astype(np.float64) + bias
        want = np.where(want > 0, want, 0.0) if relu else want
        want[2] = np.nan
        _bias_relu(blas, m, n, k, a, b, c, bias, relu)
        np.testing.assert_allclose(c[:m, :n], want, rtol=2e-5, atol=2e-5 * k ** 0.5,
                                   err_msg=f"small={small} m={m} n={n} k={k} relu={relu}")
        if relu:
            assert (c[:m, :n] >= 0).sum() + n == m * n            # all but the NaN row
        assert (c[:m, n:] == GUARD).all() and (c[m] == GUARD).all(), "wrote outside c"


@pytest.mark.parametrize("small", [True, False])
def test_blas_gemm_dispatch_gives_the_product(small, monkeypatch, rng):
    """cpu.blas.gemm with the small kernel on and off, on products that fit and that do not
    (n not a multiple of 8, n or k too large, transposed, alpha != 1, beta 0.5, float64)."""
    monkeypatch.setattr(cpu_blas, "SMALL_GEMM", small)
    cases = [(13, 24, 24, False, False, 1.0, 0.0), (13, 24, 24, False, False, 1.0, 1.0),
             (9, 20, 24, False, False, 1.0, 0.0), (9, 72, 16, False, False, 1.0, 0.0),
             (9, 16, cpu_gemm.SMALL_K + 1, False, False, 1.0, 0.0),
             (9, 16, 24, True, False, 1.0, 0.0), (9, 16, 24, False, True, 1.0, 1.0),
             (9, 16, 24, False, False, 2.0, 0.0), (9, 16, 24, False, False, 1.0, 0.5)]
    for dtype in (np.float32, np.float64):
        blas = cpu_blas.blas_for(dtype)
        for m, n, k, ta, tb, alpha, beta in cases:
            a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
            b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
            c = rng.standard_normal((m, n)).astype(dtype)
            want = alpha * ((a.T if ta else a).astype(np.float64)
                            @ (b.T if tb else b).astype(np.float64)) + beta * c
            _via_blas(blas, ta, tb, (m, n, k), alpha, a, a.shape[1], b, b.shape[1], beta, c, n)
            tol = 1e-5 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(c, want, rtol=tol, atol=tol * 10,
                                       err_msg=f"{dtype.__name__} {(m, n, k, ta, tb, alpha, beta)}")


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("tiles", [True, False])
def test_blas_gemm_takes_the_gather_tiles_where_they_fit(tiles, wide, monkeypatch, rng):
    """cpu.blas.gemm's other float32 products (not the small kernel's) on gemm_taps' gather
    tiles (TILE_GEMM; 16- and 8-float): m >= 16 rows (4-row tiles and the 1-row rest), every
    column panel (n = 8 ... 136), k = 1 to past SMALL_K, beta 0 and 1, row strides wider than
    the rows; c's guard values untouched; and the products they do not take (m < 16, n not a
    multiple of 8, a or b transposed, alpha 2, beta 0.5) by the BLAS, the same values."""
    monkeypatch.setattr(cpu_blas, "SMALL_GEMM", False)
    monkeypatch.setattr(cpu_blas, "TILE_GEMM", tiles)
    monkeypatch.setattr(gemm_taps, "WIDE", wide)
    blas = cpu_blas.blas_for(np.float32)
    assert blas[2] == (2 if tiles else 0) | (4 if wide else 0)
    for m, n, k in ((16, 8, 1), (17, 24, 40), (19, 136, 300), (37, 64, 129), (22, 96, 7)):
        for beta in (0.0, 1.0):
            a, b, c = _case(rng, m, n, k)
            want = _expected(a, b, c, m, n, k, beta)
            _via_blas(blas, False, False, (m, n, k), 1.0, a, a.shape[1], b, b.shape[1], beta,
                      c, c.shape[1])
            np.testing.assert_allclose(c, want, rtol=2e-5, atol=2e-5 * k ** 0.5,
                                       err_msg=f"m={m} n={n} k={k} beta={beta}")
            assert (c[:m, n:] == GUARD).all() and (c[m] == GUARD).all(), "wrote outside c"
    for m, n, k, ta, tb, alpha, beta in ((15, 16, 24, False, False, 1.0, 0.0),
                                         (20, 20, 24, False, False, 1.0, 0.0),
                                         (20, 16, 24, True, False, 1.0, 0.0),
                                         (20, 16, 24, False, True, 1.0, 1.0),
                                         (20, 16, 24, False, False, 2.0, 0.0),
                                         (20, 16, 24, False, False, 1.0, 0.5)):
        a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
        c = rng.standard_normal((m, n)).astype(np.float32)
        want = alpha * ((a.T if ta else a).astype(np.float64)
                        @ (b.T if tb else b).astype(np.float64)) + beta * c
        _via_blas(blas, ta, tb, (m, n, k), alpha, a, a.shape[1], b, b.shape[1], beta, c, n)
        np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-4)


def test_fits_is_the_documented_rule():
    f = cpu_gemm.fits
    assert f(False, False, 1.0, 0.0, 16, 24, 24, 4)
    assert f(False, False, 1.0, 1.0, 300, 64, 128, 4)
    assert f(True, False, 1.0, 0.0, 16, 24, 24, 4)                     # a transposed ...
    assert f(True, False, 1.0, 0.0, 32, 24, 128, 4)                    # ... in half of L1
    assert not f(True, False, 1.0, 0.0, 64, 24, 128, 4)
    assert not f(False, False, 1.0, 0.0, 16, 24, 24, 8)                # float64
    assert not f(False, True, 1.0, 0.0, 16, 24, 24, 4)                 # b transposed
    assert not f(False, False, 2.0, 0.0, 16, 24, 24, 4)                # alpha, beta
    assert not f(False, False, 1.0, 0.5, 16, 24, 24, 4)
    assert not f(False, False, 1.0, 0.0, 16, 20, 24, 4)                # n
    assert not f(False, False, 1.0, 0.0, 16, 72, 24, 4)
    assert not f(False, False, 1.0, 0.0, 16, 0, 24, 4)
    assert not f(False, False, 1.0, 0.0, 16, 24, 129, 4)               # k
    e = cpu_gemm.fits_epilogue                                 # with a bias and ReLU: wider
    assert e(256, 128, 4) and not e(264, 128, 4) and not e(256, 129, 4) and not e(256, 64, 8)


def test_private_blas_takes_the_kernels_instruction_set(monkeypatch):
    """_coretype: NUMBAFUSE_BLAS_CORETYPE wins; else SkylakeX where numbafuse's kernels are
    compiled for AVX-512 and the host has the features its kernels use; else OpenBLAS's own
    choice (None)."""
    from numbafuse.kernels.cpu import gemm_taps
    monkeypatch.setenv("NUMBAFUSE_BLAS_CORETYPE", "Zen")
    assert cpu_blas._coretype() == "Zen"
    monkeypatch.delenv("NUMBAFUSE_BLAS_CORETYPE")
    monkeypatch.setattr(gemm_taps, "_has_avx512", lambda: False)
    assert cpu_blas._coretype() is None
    monkeypatch.setattr(gemm_taps, "_has_avx512", lambda: True)
    import llvmlite.binding as llvm

    class Features:
        def __init__(self, text):
            self.text = text

        def flatten(self):
            return self.text
    full = ",".join(cpu_blas._AVX512_FEATURES + ("+avx2",))
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: Features(full))
    assert cpu_blas._coretype() == "SkylakeX"
    monkeypatch.setattr(llvm, "get_host_cpu_features",
                        lambda: Features(full.replace("+avx512bw", "-avx512bw")))
    assert cpu_blas._coretype() is None


def test_private_blas_core_leaves_the_environment_as_it_was():
    """In a new process with OPENBLAS_CORETYPE=Haswell (machine E's environment): the private
    OpenBLAS runs the core _coretype chose, and the variable is Haswell again afterwards
    (NumPy's and SciPy's OpenBLAS, loaded later, see it)."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json, os; from numbafuse.kernels.cpu import blas; "
            "print(json.dumps([blas.PRIVATE, blas.CORENAME, blas._coretype(), "
            "os.environ.get('OPENBLAS_CORETYPE')]))")
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell")
    env.pop("NUMBAFUSE_BLAS_CORETYPE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    private, corename, chosen, after = json.loads(out)
    assert after == "Haswell"
    if private:
        assert corename == (chosen or "Haswell")
