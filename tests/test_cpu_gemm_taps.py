"""The implicit-GEMM micro-kernel (``kernels/cpu/gemm_taps.py``).

Both vector widths on any machine (the IR is target independent; ``wide`` is an argument):
every column panel of each (64, 32, 16 and 8 columns wide; 24, 16 and 8 narrow: n = 8 ... 72
and 136), the 4-row blocks and the 1-row remainder (m % 4 = 0 ... 3), k = 0, 1 and 64, one
and three taps, rows at unrelated addresses (not a strided matrix), tap offsets that
overlap, with and without the bias and the ReLU. Guard values around c's block must be left
as they were. The reference is a float64 NumPy sum.
"""
import numpy as np
import pytest

from numbafuse.kernels.cpu import gemm_taps as gt

GUARD = np.float32(-777.0)


def _problem(rng, m, n, k, ntaps, pad=3):
    """source pool, row starts (elements), tap offsets, b (ntaps, k, n + pad), c (m + 1,
    n + pad) with guards; the rows of tap t read pool[start_i + off_t : ... + k]."""
    offs = rng.integers(0, 2 * k + 2, ntaps)                   # may overlap each other
    pool = rng.standard_normal(40 * (k + 1) + 64).astype(np.float32)
    starts = rng.integers(0, pool.size - (offs.max() + k), m)   # any order, may repeat
    b = np.full((ntaps, k, n + pad), GUARD, np.float32)
    b[:, :, :n] = rng.standard_normal((ntaps, k, n))
    c = np.full((m + 1, n + pad), GUARD, np.float32)
    return pool, starts.astype(np.int64), offs.astype(np.int64), b, c


def _run(pool, starts, offs, b, c, m, n, k, bias, relu, wide):
    rows = pool.ctypes.data + 4 * starts                      # int64 addresses
    gt.gemm_taps((m, n, k), offs.size, rows.ctypes.data, offs.ctypes.data, b.ctypes.data,
                 b.shape[2], c.ctypes.data, c.shape[1],
                 0 if bias is None else bias.ctypes.data, int(relu), int(wide))


def _expected(pool, starts, offs, b, m, n, k, bias, relu):
    out = np.zeros((m, n))
    for i in range(m):
        for t, off in enumerate(offs):
            a = pool[starts[i] + off:starts[i] + off + k].astype(np.float64)
            out[i] += a @ b[t, :, :n].astype(np.float64)
    if bias is not None:
        out += bias
    return np.where((out > 0) | np.isnan(out), out, 0.0) if relu else out   # NaN kept


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("n", [8, 16, 24, 32, 40, 48, 56, 64, 72, 136])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 7, 13])
def test_gemm_taps_every_panel_and_row_remainder(wide, n, m, rng):
    for k, ntaps in ((0, 1), (1, 3), (64, 1), (5, 3)):
        for with_bias, relu in ((False, False), (True, True), (True, False)):
            pool, starts, offs, b, c = _problem(rng, m, n, k, ntaps)
            bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
            _run(pool, starts, offs, b, c, m, n, k, bias, relu, wide)
            want = _expected(pool, starts, offs, b, m, n, k, bias, relu)
            np.testing.assert_allclose(c[:m, :n], want, rtol=2e-5,
                                       atol=2e-5 * max(k * ntaps, 1) ** 0.5,
                                       err_msg=f"m={m} n={n} k={k} taps={ntaps} "
                                               f"bias={with_bias} relu={relu} wide={wide}")
            assert (c[:m, n:] == GUARD).all() and (c[m] == GUARD).all(), "wrote outside c"


@pytest.mark.parametrize("m, n", [(13, 136), (6, 24), (9, 40)])
def test_gemm_taps_widths_agree_bitwise_and_keep_nan(m, n, rng):
    """Each c element is one sum in tap, then p order: the two widths give the same bits;
    a NaN in a row's input reaches the whole row through the ReLU (the rows whose windows
    hold it: windows overlap)."""
    pool, starts, offs, b, c = _problem(rng, m, n, 7, 3)
    pool[starts[2] + offs[1] + 3] = np.nan                     # row 2's second tap
    bias = rng.standard_normal(n).astype(np.float32)
    out = {}
    for wide in (True, False):
        cw = c.copy()
        _run(pool, starts, offs, b, cw, m, n, 7, bias, True, wide)
        out[wide] = cw
    assert out[True].tobytes() == out[False].tobytes()
    want = _expected(pool, starts, offs, b, m, n, 7, bias, True)
    got = out[True][:m, :n]
    assert np.isnan(got[2]).all() and 0 < np.isnan(want).all(axis=1).sum() < m
    assert (np.isnan(got) == np.isnan(want)).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)        # NaN where NaN


def test_wide_follows_what_numba_compiles_for(monkeypatch):
    """16-float tiles where Numba's target has AVX-512: NUMBA_CPU_FEATURES when set, else the
    host's, unless NUMBA_CPU_NAME names another CPU (then 8: its features are not known)."""
    from numba.core import config
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+avx512f,+fma")
    assert gt._has_avx512()
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert not gt._has_avx512()
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    assert not gt._has_avx512()
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(gt._llvm, "get_host_cpu_features", lambda: _Features("+avx512f,+avx2"))
    assert gt._has_avx512()
    monkeypatch.setattr(gt._llvm, "get_host_cpu_features", lambda: _Features("+avx2,-avx512f"))
    assert not gt._has_avx512()


class _Features:
    def __init__(self, s):
        self.s = s

    def flatten(self):
        return self.s


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("n", [8, 16, 24, 40, 64, 72, 136])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
def test_gemm_gather_every_panel_row_remainder_and_beta(wide, n, m, rng):
    """The dW kernel: c (+)= a @ b with b's rows at gathered addresses (any order, repeats);
    k = 0 (beta 0: zeros), 1, 7 and 40; guards around c untouched; the widths bitwise equal."""
    for k in (0, 1, 7, 40):
        for beta in (0, 1):
            a = np.full((m, k + 3), GUARD, np.float32)
            a[:, :k] = rng.standard_normal((m, k))
            pool = rng.standard_normal(20 * n + 64).astype(np.float32)
            boff = int(rng.integers(0, 5))
            starts = rng.integers(0, pool.size - n - boff, k).astype(np.int64)
            rows = pool.ctypes.data + 4 * starts
            c = np.full((m + 1, n + 3), GUARD, np.float32)
            c[:m, :n] = rng.standard_normal((m, n))
            b = np.array([pool[s + boff:s + boff + n] for s in starts]).reshape(k, n)
            want = a[:, :k].astype(np.float64) @ b.astype(np.float64)
            if beta:
                want += c[:m, :n]
            out = {}
            for w in (wide, not wide):
                cw = c.copy()
                gt.gemm_gather(m, n, k, a.ctypes.data, a.shape[1], rows.ctypes.data, boff,
                               cw.ctypes.data, cw.shape[1], beta, int(w))
                out[w] = cw
            got = out[wide]
            np.testing.assert_allclose(got[:m, :n], want, rtol=2e-5, atol=2e-5 * max(k, 1) ** 0.5,
                                       err_msg=f"m={m} n={n} k={k} beta={beta} wide={wide}")
            assert (got[:m, n:] == GUARD).all() and (got[m] == GUARD).all(), "wrote outside c"
            assert out[True].tobytes() == out[False].tobytes()


def test_a_split_512_bit_fma_is_zen_4_alone():
    """gemm_taps.splits_512_bit_fma reads /proc/cpuinfo's first processor: AMD family 25 with
    AVX-512 (Zen 4) is the one; Zen 3 (no AVX-512), Zen 5 (family 26), Intel and an empty or
    unreadable text are not."""
    def info(vendor, family, flags):
        return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
                f"model\t\t: 17\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n"
                "vendor_id\t: GenuineIntel\n")
    assert gt.splits_512_bit_fma(info("AuthenticAMD", 25, "avx2 avx512f avx512bw"))
    assert not gt.splits_512_bit_fma(info("AuthenticAMD", 25, "avx2 fma"))
    assert not gt.splits_512_bit_fma(info("AuthenticAMD", 26, "avx2 avx512f"))
    assert not gt.splits_512_bit_fma(info("GenuineIntel", 6, "avx2 avx512f"))
    assert not gt.splits_512_bit_fma(info("AuthenticAMD", 25, "avx512fx"))  # a whole flag
    assert not gt.splits_512_bit_fma("")
    assert gt.SPLIT_512 == (gt.WIDE and gt.splits_512_bit_fma())


def test_is_amd_reads_the_first_processors_vendor():
    def info(vendor):
        return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 26\n\n"
                "processor\t: 1\nvendor_id\t: GenuineIntel\n")
    assert gt.is_amd(info("AuthenticAMD"))
    assert not gt.is_amd(info("GenuineIntel"))
    assert not gt.is_amd("")
    assert gt.AMD == gt.is_amd()


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("m", [16, 19, 64, 67])
def test_gemm_gather_packed_panels_every_depth_block_the_same_bits(wide, m, rng):
    """Where gemm_gather copies b's panels into blocks of depth (``packs_panel``: b's rows
    spread over more than PACK_SPREAD_BYTES), c is the same sum over p in order: the same bits
    as each row alone (one row: never packed), and the float64 product. Depths around the
    blocks (PACK_BYTES of a 64-column panel: 64 rows; of an 8-column one: 512), panels of 64,
    32/24, 16 and 8 columns, beta 0 and 1, rows 4 KiB apart or (m >= PACK_ROWS) a contiguous
    panel spread wide; guards around c untouched."""
    kc64 = gt.PACK_BYTES // (4 * 64)
    for n in (8, 72, 120):
        for k in (gt.PACK_MIN_DEPTH + 1, kc64, kc64 + 1, 2 * kc64 + 3, 520):
            for beta in (0, 1):
                dense = m >= gt.PACK_ROWS and k >= 300 and n > 8
                ldb = n if dense else 1024
                pool = rng.standard_normal(k * ldb + 64).astype(np.float32)
                boff = 0 if dense else int(rng.integers(0, 5))
                rows = pool.ctypes.data + 4 * (np.arange(k, dtype=np.int64) * ldb)
                stride = 4 * ldb
                cols = 64 if wide else 24
                assert gt.packs_panel(m, k, stride, min(cols, n)), (m, k, n)
                a = np.full((m, k + 3), GUARD, np.float32)
                a[:, :k] = rng.standard_normal((m, k))
                c = np.full((m + 1, n + 3), GUARD, np.float32)
                c[:m, :n] = rng.standard_normal((m, n))
                b = pool[:k * ldb].reshape(k, ldb)[:, boff:boff + n]
                want = a[:, :k].astype(np.float64) @ b.astype(np.float64)
                if beta:
                    want += c[:m, :n]
                got = c.copy()
                gt.gemm_gather(m, n, k, a.ctypes.data, a.shape[1], rows.ctypes.data, boff,
                               got.ctypes.data, got.shape[1], beta, int(wide))
                np.testing.assert_allclose(got[:m, :n], want, rtol=2e-5, atol=2e-5 * k ** 0.5,
                                           err_msg=f"m={m} n={n} k={k} beta={beta}")
                assert (got[:m, n:] == GUARD).all() and (got[m] == GUARD).all()
                alone = c.copy()
                for i in range(m):
                    gt.gemm_gather(1, n, k, a[i:].ctypes.data, a.shape[1], rows.ctypes.data,
                                   boff, alone[i:].ctypes.data, alone.shape[1], beta, int(wide))
                assert got.tobytes() == alone.tobytes(), (m, n, k, beta)
                inplace = c.copy()               # UNPACKED (blas.PACK_B False): b read in place
                gt.gemm_gather(m, n, k, a.ctypes.data, a.shape[1], rows.ctypes.data, boff,
                               inplace.ctypes.data, inplace.shape[1], beta,
                               int(wide) | gt.UNPACKED)
                assert got.tobytes() == inplace.tobytes(), (m, n, k, beta)


def test_gemm_gather_packs_where_its_rules_say():
    """packs_panel: a wide spread, enough rows and depth; a contiguous panel only with
    PACK_ROWS rows; never a panel within PACK_SPREAD_BYTES."""
    far, cols = 4096, 64
    k = gt.PACK_SPREAD_BYTES // far + 1
    assert gt.packs_panel(gt.PACK_MIN_ROWS, k, far, cols)
    assert not gt.packs_panel(gt.PACK_MIN_ROWS - 1, k, far, cols)
    assert not gt.packs_panel(gt.PACK_MIN_ROWS, k - 1, far, cols)
    dense = 4 * cols
    kd = gt.PACK_SPREAD_BYTES // dense + 1
    assert not gt.packs_panel(gt.PACK_ROWS - 1, kd, dense, cols)
    assert gt.packs_panel(gt.PACK_ROWS, kd, dense, cols)
    assert not gt.packs_panel(gt.PACK_ROWS, kd - 1, dense, cols)


@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize("m", [16, 21, 64])
def test_gemm_taps_packed_blocks_of_taps_and_of_one_tap_the_same_bits(wide, m, rng):
    """Where gemm_taps copies b's panels (``packs_panel``: b's rows spread wide), a block of
    depth is whole taps (k below the block's rows: several taps, the last block short) or part
    of one tap (k above: the tap split, its offsets moved on): c is the same sum in tap, then p
    order, the bias and ReLU applied once, at the end: the same bits as each row alone (one
    row: never packed) and the float64 sum; guards untouched."""
    rows64 = gt.PACK_BYTES // (4 * 64)
    for n in (8, 72):
        for k, ntaps in ((24, 9), (rows64, 3), (rows64 + 5, 2), (3 * rows64 + 1, 1), (40, 5)):
            for with_bias, relu in ((False, False), (True, True)):
                pad = 1024 - n                                  # b's rows 4 KiB apart
                pool, starts, offs, b, c = _problem(rng, m, n, k, ntaps, pad=pad)
                assert gt.packs_panel(m, k * ntaps, 4 * (n + pad), min(n, 24))
                bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
                got = c.copy()
                _run(pool, starts, offs, b, got, m, n, k, bias, relu, wide)
                want = _expected(pool, starts, offs, b, m, n, k, bias, relu)
                np.testing.assert_allclose(got[:m, :n], want, rtol=2e-5,
                                           atol=2e-5 * (k * ntaps) ** 0.5,
                                           err_msg=f"m={m} n={n} k={k} taps={ntaps}")
                assert (got[:m, n:] == GUARD).all() and (got[m] == GUARD).all()
                alone = c.copy()
                for i in range(m):
                    _run(pool, starts[i:i + 1], offs, b, alone[i:], 1, n, k, bias, relu, wide)
                assert got.tobytes() == alone.tobytes(), (m, n, k, ntaps, with_bias)


_THREADS_AT_ONCE = """
import threading
import numpy as np
from numbafuse.kernels.cpu import gemm_taps as gt
rng = np.random.default_rng(0)
m, n, k, kt, taps = 64, 136, 300, 40, 9
a = rng.standard_normal((m, k)).astype(np.float32)
pool = rng.standard_normal(k * 1024 + 64).astype(np.float32)
rows = pool.ctypes.data + 4 * (np.arange(k, dtype=np.int64) * 1024)
src = rng.standard_normal(m * 64 + 2 * kt * taps).astype(np.float32)
arows = src.ctypes.data + 4 * 64 * np.arange(m, dtype=np.int64)
offs = np.arange(taps, dtype=np.int64) * kt
b = rng.standard_normal((taps, kt, 1024)).astype(np.float32)
assert gt.packs_panel(m, k, 4096, 64) and gt.packs_panel(m, kt * taps, 4096, 64)

def once():
    c, d = np.zeros((m, n), np.float32), np.zeros((m, n), np.float32)
    gt.gemm_gather(m, n, k, a.ctypes.data, k, rows.ctypes.data, 0, c.ctypes.data, n, 0, 1)
    gt.gemm_taps((m, n, kt), taps, arows.ctypes.data, offs.ctypes.data, b.ctypes.data, 1024,
                 d.ctypes.data, n, 0, 0, 1)
    return c.tobytes() + d.tobytes()

want, bad = once(), []

def work():
    for _ in range(40):
        if once() != want:
            bad.append(1)

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("differ", len(bad))
"""


def test_packed_drivers_keep_their_buffers_on_threads_at_once():
    """The packing buffers are reached by address only: each driver keeps its arrays alive
    until it returns (Numba frees an array after its last use: freed, another thread's
    allocation took the memory, and a ResNet step segfaulted once). Four threads run both
    drivers at once, 40 calls each, in a process with one malloc arena (MALLOC_ARENA_MAX=1:
    the threads share the freed memory at once); every result bitwise the first's. Without
    the drivers' ``kept`` calls this process crashed or differed in each of three runs."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, MALLOC_ARENA_MAX="1")
    out = subprocess.run([sys.executable, "-c", _THREADS_AT_ONCE], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["differ", "0"], out.stdout


def test_blas_pack_b_switch_reaches_the_driver(monkeypatch):
    """blas.PACK_B False sets blas_for's flag 8, which gemm_at hands gemm_gather as UNPACKED
    (b read in place); True: packed where the rules say. Both the same bits (test above)."""
    from numbafuse.kernels.cpu import blas
    assert gt.may_pack(64, 64, 1) and gt.may_pack(64, 64, 0)
    assert not gt.may_pack(64, 64, 1 | gt.UNPACKED) and not gt.may_pack(64, 64, gt.UNPACKED)
    assert blas.blas_for(np.float32)[2] & 8 == 0
    monkeypatch.setattr(blas, "PACK_B", False)
    assert blas.blas_for(np.float32)[2] & 8 == 8
