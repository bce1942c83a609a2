"""Register-tiled float32 GEMM for the small products of the convolution's chunks.

``gemm_small(ta, (m, n, k), pa, lda, pb, ldb, beta, pc, ldc)``: ``c (m, n) = op(a) (m, k) @ b
(k, n) + beta * c`` (row-major, addresses and strides of float32 matrices, ``a`` transposed
when ``ta``, ``beta`` 0 or 1), for ``n`` a multiple of 8. :func:`cpu.blas.gemm` sends the
products that fit (:func:`fits`: float32, ``b`` not transposed, alpha 1, ``n`` <= SMALL_N,
``k`` <= SMALL_K, a transposed ``a`` of at most SMALL_TA_ELEMENTS) here instead of OpenBLAS.

Why: the Winograd GEMMs of the digits net are (128, 24) @ (24, 24), 16 a chunk, and OpenBLAS
spends a third of each in packing and set-up: 50-60 GFLOP/s on one thread of the 2-core AMD
EPYC (AVX2), against ~80 here; at (160, 64) @ (64, 64) (the ResNet layer's Winograd GEMM, the
1x1 conv's) 64-78 against 81-94. With 128 columns OpenBLAS wins (85 against 72): these tiles
re-read ``a`` once per 24 columns, so wider products stay with it. A transposed ``a`` (the
Winograd dW's dM^T (K, T) @ V (T, C)) is read down its columns: at (24, 128) @ (128, 24) 98
against 69 GFLOP/s, at (64, 64) @ (64, 64) 88 against 78, but at (64, 128) @ (128, 64), 32 KB of
``a``, 70 against 78, so only an ``a`` of up to 16 KB comes here.

The micro-kernel computes a (rows, 8 * nv) block of ``c`` in rows * nv vector registers (4 x 3
of 8 floats: 12 accumulators, 3 loads of ``b``'s row and one broadcast of ``a`` per step of k;
16 registers on AVX2). It is written in target-independent LLVM IR (``<8 x float>`` vectors,
``llvm.fmuladd``), so it compiles on any CPU LLVM supports; on AVX2 + FMA it is vfmadd231ps
from loads that need no alignment. Each c element is one sum over k in order, with or without
a fused multiply-add as the target allows: results differ from OpenBLAS's by rounding only,
and do not depend on the thread count (a chunk's products are the same on any thread).
"""
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SMALL_N = 64     # widest c computed here (OpenBLAS is faster at 128 columns)
SMALL_EPILOGUE_N = 256   # ... with a bias and ReLU epilogue (it saves a pass over c)
SMALL_K = 128    # deepest product: b's 24-column panel (k x 24 floats) stays in L1
SMALL_TA_ELEMENTS = 4096   # a transposed: at most this many elements (16 KB, half of L1)
ROWS = 4         # rows of c per micro-tile (x 3 vectors of 8: 12 accumulators)

_I32, _I64 = ir.IntType(32), ir.IntType(64)


class Vec:
    """LLVM IR helpers for ``<width x float>`` code in one intrinsic's builder (this module's
    micro-kernel and ``cpu.gemm_taps``'s)."""

    def __init__(self, builder, width):
        self.b, self.width = builder, width
        self.el = ir.FloatType()
        self.vec = ir.VectorType(self.el, width)
        self.zero = ir.Constant(self.vec, [ir.Constant(self.el, 0.0)] * width)
        self._fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(self.vec, [self.vec] * 3),
            "llvm.fmuladd.v%df32" % width)
        self._splat = ir.Constant(ir.VectorType(_I32, width), [ir.Constant(_I32, 0)] * width)

    def floats(self, address):                       # an int64 address as float*
        return self.b.inttoptr(address, self.el.as_pointer())

    def ptr(self, base, off, v=0):                   # &base[off + width v] as a vector*
        if v:
            off = self.b.add(off, ir.Constant(_I64, self.width * v))
        return self.b.bitcast(self.b.gep(base, [off]), self.vec.as_pointer())

    def load(self, base, off, v=0):
        return self.b.load(self.ptr(base, off, v), align=4)

    def store(self, value, base, off, v=0):
        self.b.store(value, self.ptr(base, off, v), align=4)

    def splat(self, scalar_ptr):                     # the float at scalar_ptr in every lane
        s = self.b.insert_element(ir.Constant(self.vec, ir.Undefined),
                                  self.b.load(scalar_ptr, align=4), ir.Constant(_I32, 0))
        return self.b.shuffle_vector(s, ir.Constant(self.vec, ir.Undefined), self._splat)

    def accumulators(self, rows, nv):
        return [[cgutils.alloca_once_value(self.b, self.zero) for _ in range(nv)]
                for _ in range(rows)]

    def accumulate(self, acc, a, bv):                # acc[r][v] += a[r] * bv[v]
        for r in range(len(acc)):
            s = self.splat(a[r])
            for v in range(len(bv)):
                self.b.store(self.b.call(self._fma, [s, bv[v], self.b.load(acc[r][v])]),
                             acc[r][v])

    def load_rows(self, acc, c, ldc):                # acc[r][v] = c[r*ldc + width v ...]
        for r, row in enumerate(acc):
            for v, a in enumerate(row):
                self.b.store(self.load(c, row_offset(self.b, r, ldc), v), a)

    def store_rows(self, acc, c, ldc, stream=None):  # c[r*ldc + width v ...] = acc[r][v]
        """``stream``: an int64 value; where it is not 0, non-temporal stores (no read of the
        lines first, not kept in the caches; every vector's address a multiple of its size,
        which the caller guarantees, and a :func:`store_fence` before anyone reads them)."""
        if stream is None:
            self._store_rows(acc, c, ldc, False)
            return
        b = self.b
        with b.if_else(b.icmp_signed("!=", stream, ir.Constant(_I64, 0))) as (nt, plain):
            with nt:
                self._store_rows(acc, c, ldc, True)
            with plain:
                self._store_rows(acc, c, ldc, False)

    def _store_rows(self, acc, c, ldc, nt):
        for r, row in enumerate(acc):
            for v, a in enumerate(row):
                if nt:
                    st = self.b.store(self.b.load(a), self.ptr(c, row_offset(self.b, r, ldc), v),
                                      align=4 * self.width)
                    st.set_metadata("nontemporal", self.b.module.add_metadata(
                        [ir.Constant(_I32, 1)]))
                else:
                    self.store(self.b.load(a), c, row_offset(self.b, r, ldc), v)

    def bias_relu(self, acc, bias, relu):
        """The micro-kernels' epilogue: + bias[width v ...] where the int64 address ``bias``
        is not 0, then the ReLU (v > 0 or NaN, unordered: v, else 0) where ``relu`` is not 0;
        the scalar epilogue's arithmetic."""
        b = self.b
        with b.if_then(b.icmp_signed("!=", bias, ir.Constant(_I64, 0))):
            base = self.floats(bias)
            bv = [self.load(base, ir.Constant(_I64, 0), v) for v in range(len(acc[0]))]
            for row in acc:
                for v, a in enumerate(row):
                    b.store(b.fadd(b.load(a), bv[v]), a)
        with b.if_then(b.icmp_signed("!=", relu, ir.Constant(_I64, 0))):
            for row in acc:
                for a in row:
                    x = b.load(a)
                    b.store(b.select(b.fcmp_unordered(">", x, self.zero), x, self.zero), a)


def row_offset(builder, r, ld):
    """r * ld (int64) for a constant row r."""
    return builder.mul(ir.Constant(_I64, r), ld)


def _tile(rows, nv):
    """The micro-kernel intrinsic for a (rows, 8 * nv) block of c."""

    @intrinsic
    def tile(typingctx, k, a, sa, sk, b, ldb, beta, c, ldc, bias, relu):
        """c[r, :8nv] = relu?(sum over p < k of a[r*sa + p*sk] * b[p, :8nv] (+ c[r, :8nv] if
        beta) (+ bias[:8nv] if bias)) for r < rows: a, b, c, bias addresses of float32
        (integers; bias 0 for none); sa, sk the strides of a's rows and columns (lda, 1; or 1,
        lda for a transposed), ldb, ldc row strides, in elements; beta, relu 0 or 1 (all
        int64). The epilogue is the scalar one's (the sum rounded to float32, + bias, then
        relu keeping NaN): the same bits as a bias + ReLU pass over the stored product."""
        def codegen(context, builder, signature, args):
            k, a, sa, sk, b, ldb, beta, c, ldc, bias, relu = args
            V = Vec(builder, 8)
            a, b, c = V.floats(a), V.floats(b), V.floats(c)
            acc = V.accumulators(rows, nv)
            with builder.if_then(builder.icmp_signed("!=", beta, ir.Constant(_I64, 0))):
                V.load_rows(acc, c, ldc)
            with cgutils.for_range(builder, k) as loop:
                p = loop.index
                bp = builder.mul(p, ldb)
                pk = builder.mul(p, sk)
                V.accumulate(acc, [builder.gep(a, [builder.add(row_offset(builder, r, sa), pk)])
                                   for r in range(rows)],
                             [V.load(b, bp, v) for v in range(nv)])
            V.bias_relu(acc, bias, relu)
            V.store_rows(acc, c, ldc)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 11)), codegen

    return tile


_t43, _t42, _t41 = _tile(ROWS, 3), _tile(ROWS, 2), _tile(ROWS, 1)
_t13, _t12, _t11 = _tile(1, 3), _tile(1, 2), _tile(1, 1)


@njit(nogil=True, cache=True, inline="always")
def fits(ta, tb, alpha, beta, m, n, k, itemsize):
    """Whether :func:`gemm_small` computes this product (see the module docstring)."""
    return (not tb and itemsize == 4 and alpha == 1.0 and (beta == 0.0 or beta == 1.0)
            and n % 8 == 0 and 0 < n <= SMALL_N and k <= SMALL_K
            and (not ta or m * k <= SMALL_TA_ELEMENTS))


@njit(nogil=True, cache=True, inline="always")
def fits_epilogue(n, k, itemsize):
    """Whether :func:`gemm_small` computes a product with a bias and ReLU epilogue (wider n
    than plain products: the epilogue in registers saves a pass over c)."""
    return itemsize == 4 and n % 8 == 0 and 0 < n <= SMALL_EPILOGUE_N and k <= SMALL_K


@njit(nogil=True, cache=True)
def gemm_small(ta, mnk, pa, lda, pb, ldb, beta, pc, ldc, pbias, relu):
    """c (m, n) = relu?(op(a) (m, k) @ b (k, n) + beta c + bias?), ``mnk`` = (m, n, k), op
    transposing when ``ta`` (1 or 0); pa, pb, pc, pbias: addresses of float32 matrices and of
    the (n,) bias (0: none); n a multiple of 8, beta and relu 0 or 1 (all int64: one
    compilation)."""
    m, n, k = mnk
    sa, sk = (1, lda) if ta else (lda, 1)                # a's row and column strides
    j = 0
    while j < n:                                   # column panels of 24, then 16 or 8
        nv = min(3, (n - j) // 8)
        pbj = pb + 4 * j
        pbiasj = pbias + 4 * j if pbias != 0 else 0
        i = 0
        while i < m:
            pai, pcij = pa + 4 * i * sa, pc + 4 * (i * ldc + j)
            if i + ROWS <= m:
                if nv == 3:
                    _t43(k, pai, sa, sk, pbj, ldb, beta, pcij, ldc, pbiasj, relu)
                elif nv == 2:
                    _t42(k, pai, sa, sk, pbj, ldb, beta, pcij, ldc, pbiasj, relu)
                else:
                    _t41(k, pai, sa, sk, pbj, ldb, beta, pcij, ldc, pbiasj, relu)
                i += ROWS
            else:
                if nv == 3:
                    _t13(k, pai, sa, sk, pbj, ldb, beta, pcij, ldc, pbiasj, relu)
                elif nv == 2:
                    _t12(k, pai, sa, sk, pbj, ldb, beta, pcij, ldc, pbiasj, relu)
                else:
                    _t11(k, pai, sa, sk, pbj, ldb, beta, pcij, ldc, pbiasj, relu)
                i += 1
        j += 8 * nv
