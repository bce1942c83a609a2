"""An implicit-GEMM micro-kernel: c = relu?(sum over taps of a_tap @ b_tap + bias), float32.

``gemm_taps((m, n, k), ntaps, prow, paoff, pb, ldb, pc, ldc, pbias, relu, wide)`` computes

    c[i, :n] = relu?(sum over t < ntaps, p < k of a(i, t)[p] * b[t, p, :n] + bias?)

where row i of tap t starts at the address ``row[i] + 4 * aoff[t]`` (``prow``, ``paoff``:
addresses of int64 arrays of m addresses and ntaps element offsets), ``b`` is (ntaps, k,
ldb) float32 at ``pb`` and ``c`` (m, ldc) at ``pc``; ``n`` a multiple of 8. No matrix of
rows is built: a convolution passes one row per output pixel, the address of its receptive
field's corner in a zero-padded copy of the input, and one offset per tap (``conv/
cpu_implicit.py``). That replaced im2col (a (pixels, R*S*C) copy of the input per chunk) and
OpenBLAS's packing of it: at the stride-2 ResNet shape, (32, 64, 32, 32) -> 128 channels,
the NHWC forward on one thread took 13.7-14.1 ms by im2col + OpenBLAS and 12.1 by these
tiles (docs/conv_bias_relu.md).

``gemm_gather(m, n, k, pa, lda, prow, boff, pc, ldc, beta, wide)`` is the dW's kernel, the
other way round: ``c (m, n) (+)= a (m, k) @ b (k, n)`` with ``a`` a plain matrix (g^T, (K,
pixels)) and b's row p at ``row[p] + boff`` (pixel p's tap in the slab): dW_rs (K, C) with no
im2col either.

Each (rows, vectors) block of c is summed in registers over every tap and every p (rows *
vectors accumulators), then the bias and ReLU, and stored once. Where b's panels spread wide
(``packs_panel``), both drivers copy each panel a block of depth at a time into an L1-sized
buffer (``PACK_BYTES``) and sum block after block, c stored after each and read back by the
next (the same float32 values in the same order), the bias and ReLU with the last. Each c
element is one sum in tap order, then p order, with a fused multiply-add where the target has
one, so results do not depend on the block shape, the packing, the vector width or the thread
count.

Vector width: 16 floats where the CPU has AVX-512 (``WIDE``: 4 x 4 zmm accumulators, 32
registers), else 8 (4 x 3 ymm of AVX2's 16). The IR is target independent, so either width
compiles anywhere (LLVM splits a 16-float vector on AVX2, slowly): ``wide`` is an argument,
not a compile-time constant, and the tests run both on any machine. Measured on the 2-core
AMD EPYC (Zen 4, AVX-512), one thread, 4 x 4 x 16 against 4 x 3 x 8:
~108 against ~83 GFLOP/s over the stride-2 conv's 9 taps of k = 64.
"""
import functools

import llvmlite.binding as _llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from .gemm import Vec, row_offset
from .steps import Step, ready as _ready_steps

ROWS = 4          # rows of c per block (1-row blocks finish a chunk's last m % ROWS rows)

_I64 = ir.IntType(64)


def _has_avx512():
    """Whether Numba compiles for a CPU with AVX-512: NUMBA_CPU_FEATURES if set, else the host's
    unless NUMBA_CPU_NAME names another CPU (a portable cache's "generic", say): no."""
    if config.CPU_FEATURES:
        features = config.CPU_FEATURES
    elif config.CPU_NAME in (None, "host"):
        features = _llvm.get_host_cpu_features().flatten()
    else:
        return False
    return "+avx512f" in features.split(",")


# 16-float vectors (read at each call by the convolution, so tests can switch it)
WIDE = _has_avx512()


def _cpuinfo(cpuinfo=None):
    """The first processor's vendor_id, cpu family and flags in ``/proc/cpuinfo`` (read once
    a process) or the text ``cpuinfo``, by name; {} where that cannot be read."""
    return _host_cpuinfo() if cpuinfo is None else _fields(cpuinfo)


@functools.cache
def _host_cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            return _fields(f.read(1 << 16))
    except OSError:
        return {}


def _fields(cpuinfo):
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("vendor_id", "cpu family", "flags") and key not in fields:
            fields[key] = value.strip()
    return fields


def splits_512_bit_fma(cpuinfo=None):
    """Whether this CPU runs a 512-bit fused multiply-add as two 256-bit halves (AMD Zen 4:
    an AuthenticAMD family 25 that has AVX-512; Zen 3, the same family, has none), from
    ``/proc/cpuinfo`` (or the text ``cpuinfo``); False where that does not say. There the
    tiles' 16-float FMAs issue at half the rate of a Zen 5 or an Intel core with AVX-512, and
    a pass that does fewer multiplies (Winograd's) beats them where it loses elsewhere
    (``conv/cpu_plan.Rules.implicit_s1_max_channels``)."""
    fields = _cpuinfo(cpuinfo)
    return (fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"
            and "avx512f" in fields.get("flags", "").split())


def is_amd(cpuinfo=None):
    """Whether ``/proc/cpuinfo`` (or the text ``cpuinfo``) names an AMD processor (False where
    it does not say). A few plan rules measured on AMD's full-width AVX-512 (Zen 5) lose on
    Intel's (``conv/cpu_rules.Rules.pointwise_chunked_pixels``)."""
    return _cpuinfo(cpuinfo).get("vendor_id") == "AuthenticAMD"


SPLIT_512 = WIDE and splits_512_bit_fma()
AMD = is_amd()


def _taps_tile(rows, nv, width):
    """The micro-kernel intrinsic for a (rows, width * nv) block of c."""

    @intrinsic
    def tile(typingctx, ntaps, k, prow, paoff, b, ldb, c, ldc, bias, relu, beta):
        """c[r, :width*nv] = relu?((c[r] if beta) + sum over t, p of a_r,t[p] * b[t*k + p,
        :width*nv] + bias?) for r < rows; a_r,t = row[r] + aoff[t] (float32 elements); prow,
        paoff, b, c, bias: addresses (bias 0: none); ldb, ldc row strides in elements; relu,
        beta 0 or 1 (all int64). The epilogue is the scalar one's: the float32 sum + bias,
        then ReLU keeping NaN."""
        def codegen(context, builder, signature, args):
            ntaps, k, prow, paoff, b, ldb, c, ldc, bias, relu, beta = args
            V = Vec(builder, width)
            prow = builder.inttoptr(prow, _I64.as_pointer())
            paoff = builder.inttoptr(paoff, _I64.as_pointer())
            b, c = V.floats(b), V.floats(c)
            row = [V.floats(builder.load(builder.gep(prow, [ir.Constant(_I64, r)])))
                   for r in range(rows)]
            acc = V.accumulators(rows, nv)
            with builder.if_then(builder.icmp_signed("!=", beta, ir.Constant(_I64, 0))):
                V.load_rows(acc, c, ldc)
            tap_stride = builder.mul(k, ldb)
            with cgutils.for_range(builder, ntaps) as taps:
                t = taps.index
                off = builder.load(builder.gep(paoff, [t]))
                bt = builder.gep(b, [builder.mul(t, tap_stride)])
                a = [builder.gep(r, [off]) for r in row]
                with cgutils.for_range(builder, k) as loop:
                    p = loop.index
                    bp = builder.mul(p, ldb)
                    V.accumulate(acc, [builder.gep(ar, [p]) for ar in a],
                                 [V.load(bt, bp, v) for v in range(nv)])
            V.bias_relu(acc, bias, relu)
            V.store_rows(acc, c, ldc)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 11)), codegen

    return tile


def _gather_tile(rows, nv, width):
    """The dW micro-kernel intrinsic: a (rows, width * nv) block of c, b's rows gathered."""

    @intrinsic
    def tile(typingctx, k, a, lda, prow, boff, c, ldc, beta):
        """c[r, :width*nv] (+)= sum over p < k of a[r*lda + p] * b_p[:width*nv] for r < rows,
        where b_p = row[p] + boff (float32 elements); a, prow (int64 addresses of k rows), c:
        addresses; lda, ldc row strides in elements; beta 1: add to c, 0: overwrite (int64)."""
        def codegen(context, builder, signature, args):
            k, a, lda, prow, boff, c, ldc, beta = args
            V = Vec(builder, width)
            prow = builder.inttoptr(prow, _I64.as_pointer())
            a, c = V.floats(a), V.floats(c)
            acc = V.accumulators(rows, nv)
            with builder.if_then(builder.icmp_signed("!=", beta, ir.Constant(_I64, 0))):
                V.load_rows(acc, c, ldc)
            arow = [builder.gep(a, [row_offset(builder, r, lda)]) for r in range(rows)]
            with cgutils.for_range(builder, k) as loop:
                p = loop.index
                bp = builder.gep(V.floats(builder.load(builder.gep(prow, [p]))), [boff])
                V.accumulate(acc, [builder.gep(ar, [p]) for ar in arow],
                             [V.load(bp, ir.Constant(_I64, 0), v) for v in range(nv)])
            V.store_rows(acc, c, ldc)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 8)), codegen

    return tile


# AVX-512: panels of 64, 32, 16 columns (4, 2, 1 vectors of 16), then 8; AVX2: 24, 16, 8
_w4, _w2, _w1 = _taps_tile(ROWS, 4, 16), _taps_tile(ROWS, 2, 16), _taps_tile(ROWS, 1, 16)
_w4r, _w2r, _w1r = _taps_tile(1, 4, 16), _taps_tile(1, 2, 16), _taps_tile(1, 1, 16)
_n3, _n2, _n1 = _taps_tile(ROWS, 3, 8), _taps_tile(ROWS, 2, 8), _taps_tile(ROWS, 1, 8)
_n3r, _n2r, _n1r = _taps_tile(1, 3, 8), _taps_tile(1, 2, 8), _taps_tile(1, 1, 8)


@njit(nogil=True, cache=True, inline="always")
def panel(wide, rem):
    """Columns of the next panel of c, with ``rem`` columns (a multiple of 8) left."""
    if wide:
        return 64 if rem >= 64 else 32 if rem >= 32 else 16 if rem >= 16 else 8
    return 24 if rem >= 24 else 16 if rem >= 16 else 8


@njit(nogil=True, cache=True, inline="always")
def dense_rows(rows, address, m, ld):
    """rows[i] = the address of row i of a float32 matrix at ``address`` with row stride
    ``ld`` elements, for i < m (gemm_taps's row table of a plain matrix)."""
    for i in range(m):
        rows[i] = address + 4 * i * ld


@njit(nogil=True, cache=True)
def gemm_taps(mnk, ntaps, prow, paoff, pb, ldb, pc, ldc, pbias, relu, wide):
    """See the module docstring; every argument int64 (one compilation), n % 8 == 0. Where
    :func:`packs_panel` says (b's panels spread over ntaps * k rows, ``ldb`` apart), each
    panel is copied a block of depth at a time as in :func:`gemm_gather`: a block is whole
    taps (k at most the block's rows) or part of one tap's k; the blocks after the first add
    into c, the bias and ReLU come with the last; the same sums in order, the same bits."""
    m, n, k = mnk
    depth = ntaps * k
    packs = packs_panel(m, depth, 4 * ldb, np.int64(0))   # (any panel may: cols 0 is never
    #  contiguous; each panel's own cols decide below)
    buf = np.empty(PACK_BYTES // 4 if packs else 0, np.float32)
    brows = np.empty(PACK_BYTES // 32 if packs else 0, np.int64)
    boffs = np.empty(PACK_BYTES // 32 if packs else 0, np.int64)
    pbuf, pbrows = np.int64(buf.ctypes.data), np.int64(brows.ctypes.data)
    pboffs = np.int64(boffs.ctypes.data)
    j = 0
    while j < n:
        cols = panel(wide, n - j)
        pbj = pb + 4 * j
        pbiasj = pbias + 4 * j if pbias != 0 else 0
        pack = packs and packs_panel(m, depth, 4 * ldb, cols)
        rows = PACK_BYTES // (4 * cols) if pack else max(depth, 1)
        # a block: taps [t0, t0 + nt), p in [p0, p0 + kb) of each
        nt = max(1, min(ntaps, rows // max(k, 1))) if pack else max(ntaps, 1)
        kb = min(k, rows) if pack else k
        parts = max(1, -(-k // kb)) if k > 0 else 1
        t0 = 0
        while t0 < max(ntaps, 1):
            nt = min(nt, ntaps - t0) if ntaps > 0 else 0
            for part in range(parts):
                p0 = part * kb
                kp = min(kb, k - p0)
                last = t0 + nt >= ntaps and part == parts - 1
                first = t0 == 0 and part == 0
                if pack:
                    for i in range(nt):
                        dense_rows(brows[i * kp:], pbj + 4 * ((t0 + i) * k + p0) * ldb, kp, ldb)
                        boffs[i] = _address_at(paoff, t0 + i) + p0
                    _pack(nt * kp, pbrows, np.int64(0), cols // 8, pbuf, pbrows)
                    aoff, bt, ld, bias = pboffs, pbuf, cols, pbiasj if last else 0
                    act, beta = relu if last else 0, 0 if first else 1
                else:
                    aoff, bt, ld, bias = paoff + 8 * t0, pbj + 4 * t0 * k * ldb, ldb, pbiasj
                    act, beta = relu, 0
                _taps_panel(m, nt, kp, prow, aoff, bt, ld, pc + 4 * j, ldc, (bias, act, beta),
                            (cols, wide))
            t0 += max(nt, 1)
        j += cols
    kept(buf, brows, boffs)


@njit(nogil=True, cache=True, inline="always")
def _taps_panel(m, ntaps, k, prow, paoff, pb, ldb, pc, ldc, epilogue, shape):
    # c[:, :cols] = relu?((c if beta) + the taps' sum over b's panel at pb + bias?);
    # epilogue = (pbias, relu, beta), shape = (cols, wide)
    pbias, relu, beta = epilogue
    cols, wide = shape
    i = 0
    while i < m:
        pr, pci = prow + 8 * i, pc + 4 * i * ldc
        if i + ROWS <= m:
            if cols == 64:
                _w4(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            elif cols == 32:
                _w2(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            elif cols == 24:
                _n3(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            elif cols == 16:
                if wide:
                    _w1(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
                else:
                    _n2(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            else:
                _n1(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            i += ROWS
        else:
            if cols == 64:
                _w4r(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            elif cols == 32:
                _w2r(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            elif cols == 24:
                _n3r(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            elif cols == 16:
                if wide:
                    _w1r(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
                else:
                    _n2r(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            else:
                _n1r(ntaps, k, pr, paoff, pb, ldb, pci, ldc, pbias, relu, beta)
            i += 1


# the dW tiles: the same panels, b's rows gathered
_g4, _g2, _g1 = _gather_tile(ROWS, 4, 16), _gather_tile(ROWS, 2, 16), _gather_tile(ROWS, 1, 16)
_g4r, _g2r, _g1r = _gather_tile(1, 4, 16), _gather_tile(1, 2, 16), _gather_tile(1, 1, 16)
_h3, _h2, _h1 = _gather_tile(ROWS, 3, 8), _gather_tile(ROWS, 2, 8), _gather_tile(ROWS, 1, 8)
_h3r, _h2r, _h1r = _gather_tile(1, 3, 8), _gather_tile(1, 2, 8), _gather_tile(1, 1, 8)


@njit(nogil=True, cache=True)
def gemm_gather(m, n, k, pa, lda, prow, boff, pc, ldc, beta, wide):
    """c (m, n) = a (m, k) @ b (k, n) (+ c where beta), row p of b at ``row[p] + boff``
    (``prow``: the address of k int64 addresses); pa, pc addresses of float32 matrices with
    row strides lda, ldc; n % 8 == 0; every argument int64. Each c element is one sum over p
    in order (after c's old value), as in gemm_taps.

    Where :data:`PACK_ROWS` and the rules below it say, each panel of b is copied, a block of
    depth at a time, into a contiguous buffer that stays in L1 while every row block of c
    runs its tiles over it (GotoBLAS's packing of b; a is read in place): the tiles read b's
    rows by address, whose stride (a weight matrix's width, an image row's) can map a panel
    onto few cache sets (rows 2 KiB apart: 64 rows in 4 of L1's 64 sets) or outgrow L1. The
    blocks after the first add into c: each c element is the same sum over p in order, the
    same bits (docs/conv_bias_relu.md, "Packed panels of b")."""
    packs = may_pack(m, k, wide)
    wide &= 1
    stride = _address_at(prow, 1) - _address_at(prow, 0) if packs else np.int64(0)
    buf = np.empty(PACK_BYTES // 4 if packs else 0, np.float32)
    brows = np.empty(PACK_BYTES // 32 if packs else 0, np.int64)     # (at least kc rows)
    pbuf, pbrows = np.int64(buf.ctypes.data), np.int64(brows.ctypes.data)
    j = 0
    while j < n:
        cols = panel(wide, n - j)
        pack = packs and packs_panel(m, k, stride, cols)
        kc = PACK_BYTES // (4 * cols) if pack else max(k, 1)
        for block in range(max(1, -(-k // kc))):       # (k = 0: one block, c = beta c)
            p0 = block * kc
            kb = min(kc, k - p0)
            rows, bo = prow + 8 * p0, boff + j
            if pack:
                _pack(kb, rows, bo, cols // 8, pbuf, pbrows)
                rows, bo = pbrows, np.int64(0)
            _gather_panel(m, kb, cols, pa + 4 * p0, lda, rows, bo, pc + 4 * j, ldc,
                          beta if p0 == 0 else np.int64(1), wide)
        j += cols
    kept(buf, brows, brows)


# gemm_gather packs b where its panel spreads over more than PACK_SPREAD_BYTES (k rows times
# their stride) and c has at least PACK_ROWS rows, or PACK_MIN_ROWS and the panel is no
# contiguous block (its rows further apart than its width); never below PACK_MIN_DEPTH.
# Fewer rows (few tiles for each copied row), a panel in L1 anyway or a contiguous one of few
# rows of c (streamed well by the prefetchers) lost: machine B, one thread, best of 7
# alternating, GFLOP/s before / packed, (m, n, k, b's row stride in floats): (16, 64, 256,
# 64) 159 / 123, (20, 128, 128, 128) 154 / 123, (48, 64, 576, 64) 158 / 130, (64, 64, 64,
# 64) 150 / 134; but (147, 64, 1024, 64) 117 / 160, (16, 512, 576, 512) 102 / 116, (1152,
# 128, 256, 128) 104 / 134, (128, 512, 2304, 512) 26 / 127
PACK_ROWS = 64
PACK_MIN_ROWS = 16
PACK_MIN_DEPTH = 16
PACK_SPREAD_BYTES = 64 << 10
# the blocks of depth copied: at most this many bytes (64 columns: 64 rows of b)
PACK_BYTES = 16 << 10
# gemm_gather's ``wide`` with this bit set: b read in place, never packed (blas.PACK_B False)
UNPACKED = 2


@njit(nogil=True, cache=True, inline="always")
def kept(a, b, c):
    """A use of three arrays where it is called: Numba frees an array after its last use in
    the function, so a kernel that hands its own arrays' addresses to tiles (its buffers,
    row tables) calls this after the last such call to keep them until then (else their
    memory may go to another allocation first, another thread's: ``tests/
    test_cpu_gemm_taps.py``, the drivers on threads at once)."""
    return a.size + b.size + c.size


@njit(nogil=True, cache=True, inline="always")
def may_pack(m, k, wide):
    """Whether gemm_gather may pack b at all: enough rows and depth, and ``wide`` without
    the :data:`UNPACKED` bit."""
    return m >= PACK_MIN_ROWS and k >= PACK_MIN_DEPTH and wide & UNPACKED == 0


@njit(nogil=True, cache=True, inline="always")
def packs_panel(m, k, stride, cols):
    """Whether a driver copies a panel of ``cols`` columns of b (k rows, the first two
    ``stride`` bytes apart; gemm_taps: its ntaps * k rows, ``ldb`` apart) for c's m rows (the
    rules above)."""
    return (m >= PACK_MIN_ROWS and k >= PACK_MIN_DEPTH and k * abs(stride) > PACK_SPREAD_BYTES
            and (m >= PACK_ROWS or stride != 4 * cols))


@njit(nogil=True, cache=True, inline="always")
def _gather_panel(m, k, cols, pa, lda, prow, bo, pc, ldc, beta, wide):
    # c[:, :cols] (+)= a (m, k) @ b's panel of ``cols`` columns (its row p at row[p] + bo)
    i = 0
    while i < m:
        pai, pcij = pa + 4 * i * lda, pc + 4 * i * ldc
        if i + ROWS <= m:
            if cols == 64:
                _g4(k, pai, lda, prow, bo, pcij, ldc, beta)
            elif cols == 32:
                _g2(k, pai, lda, prow, bo, pcij, ldc, beta)
            elif cols == 24:
                _h3(k, pai, lda, prow, bo, pcij, ldc, beta)
            elif cols == 16:
                if wide:
                    _g1(k, pai, lda, prow, bo, pcij, ldc, beta)
                else:
                    _h2(k, pai, lda, prow, bo, pcij, ldc, beta)
            else:
                _h1(k, pai, lda, prow, bo, pcij, ldc, beta)
            i += ROWS
        else:
            if cols == 64:
                _g4r(k, pai, lda, prow, bo, pcij, ldc, beta)
            elif cols == 32:
                _g2r(k, pai, lda, prow, bo, pcij, ldc, beta)
            elif cols == 24:
                _h3r(k, pai, lda, prow, bo, pcij, ldc, beta)
            elif cols == 16:
                if wide:
                    _g1r(k, pai, lda, prow, bo, pcij, ldc, beta)
                else:
                    _h2r(k, pai, lda, prow, bo, pcij, ldc, beta)
            else:
                _h1r(k, pai, lda, prow, bo, pcij, ldc, beta)
            i += 1


@intrinsic
def _address_at(typingctx, prow, p):
    """The int64 at index ``p`` of the int64 array at the address ``prow``."""
    def codegen(context, builder, signature, args):
        prow, p = args
        return builder.load(builder.gep(builder.inttoptr(prow, _I64.as_pointer()), [p]))

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _pack(typingctx, k, prow, boff, nv8, dst, drows):
    """dst[p, :8 nv8] = b_p[:8 nv8] for p < k, b_p = row[p] + boff (float32 elements), dst
    (k, 8 nv8) contiguous at the address ``dst``; drows[p] = dst's row p's address (the
    tiles' row table of the copy; it may be prow itself: row p is read before its entry is
    written). Every argument int64 (prow, dst, drows addresses)."""
    def codegen(context, builder, signature, args):
        k, prow, boff, nv8, dst, drows = args
        V = Vec(builder, 8)
        prow = builder.inttoptr(prow, _I64.as_pointer())
        drows = builder.inttoptr(drows, _I64.as_pointer())
        d = V.floats(dst)
        ld = builder.mul(nv8, ir.Constant(_I64, 8))
        with cgutils.for_range(builder, k) as loop:
            p = loop.index
            src = builder.gep(V.floats(builder.load(builder.gep(prow, [p]))), [boff])
            dp = builder.mul(p, ld)
            builder.store(builder.add(dst, builder.mul(dp, ir.Constant(_I64, 4))),
                          builder.gep(drows, [p]))
            with cgutils.for_range(builder, nv8) as vec:
                off = builder.mul(vec.index, ir.Constant(_I64, 8))
                V.store(V.load(src, off), d, builder.add(dp, off))
        return context.get_dummy_value()

    return types.void(*([types.int64] * 6)), codegen


# The two drivers as steps (cpu/steps.py): the conv kernels call them through slots, so
# their code is compiled once, not again inside each caller. Every argument int64: one
# signature for any dtype. :func:`ready` compiles them and fills the slots.
_T3 = types.UniTuple(types.int64, 3)
GEMM_TAPS = Step(gemm_taps.py_func, lambda f: [(_T3,) + (types.int64,) * 10], per_dtype=False)
GEMM_GATHER = Step(gemm_gather.py_func, lambda f: [(types.int64,) * 11], per_dtype=False)
taps_step, gather_step = GEMM_TAPS.call, GEMM_GATHER.call


def ready(gather=True):
    """The drivers compiled and their slots filled: host code calls this before it launches
    a kernel that calls :data:`taps_step` or :data:`gather_step` (not sooner: a cold start
    that runs neither does not compile them). ``gather`` False: :data:`taps_step` alone, for
    kernels that never reach the other slot (the pointwise passes and the phase dX: 0.26 s
    less of a cold NHWC 1x1 forward)."""
    _ready_steps(None, (GEMM_TAPS, GEMM_GATHER) if gather else (GEMM_TAPS,))
