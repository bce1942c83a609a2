"""numbafuse's private single-threaded BLAS, callable from ``nogil`` Numba kernels.

The convolution runs one GEMM per cache-sized chunk inside each task of the thread pool
(``_launch.py``), so each GEMM must run on the thread that calls it. NumPy's and SciPy's
OpenBLAS keep their own thread pools, and their thread count is a process-wide setting
(``openblas_set_num_threads_local`` is thread-local only in OpenMP builds; the wheels are
pthreads builds): setting it would slow the user's NumPy/SciPy. So numbafuse loads its own
copy of OpenBLAS, the ``scipy-openblas32`` wheel (its symbols carry a ``scipy_`` prefix: a
library instance of its own, not the one inside NumPy's or SciPy's wheel) and sets *that*
instance to one thread, and to the instruction set of numbafuse's own kernels
(:func:`_coretype`; ``CORENAME`` says which kernels it runs). On a 2-core AMD EPYC with AVX-512:
SGEMM (m, 576) @ (576, 64) at ~100 GFLOP/s per calling thread for m = 256..2048, two threads
calling at once ~200 GFLOP/s together. On a 2-core EPYC with AVX2 (OpenBLAS picks its Haswell
kernels), one thread: 69-89 GFLOP/s
at (1024, 576) @ (576, 64), 45-59 at (128, 24) @ (24, 24) (a Winograd GEMM of the digits
net); two threads at once, each pinned to its own CPU: up to 86 + 88 and 56 + 56, with the
same VM giving 34-60 a thread in other minutes (host load, not the library: it moved the
same way for one thread alone).

Without the wheel (or with NUMBAFUSE_PRIVATE_BLAS=0), the GEMMs fall back to SciPy's BLAS
(``scipy.linalg.cython_blas``, the one Numba's ``np.dot`` uses): correct, but its own threads
then compete with the pool's (``PRIVATE`` tells which one is in use). Small float32 products
(n <= 64 columns, k <= 128) go to numbafuse's own register-tiled kernel instead
(``cpu/gemm.py``, ``SMALL_GEMM``), which is faster than OpenBLAS there.

``gemm(blas, ta, tb, (m, n, k), alpha, a, lda, b, ldb, beta, c, ldc)`` (``blas`` from
:func:`blas_for`, the function's address: compiled kernels stay cacheable) is row-major CBLAS:
``c (m, n) = alpha * op(a) @ op(b) + beta * c``, ``op`` transposing where ``ta``/``tb`` is
true; ``a``, ``b``, ``c`` are arrays (or views) whose first element starts the matrix, all of
one dtype (float32 or float64).
"""
import ctypes
import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import gemm as _small, gemm_taps as _tiles
from .steps import Step, ready as _ready_steps
from ..scalar import cpu_scalar, relu as _relu_math

_relu = cpu_scalar(_relu_math)

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@intrinsic
def _call(typingctx, fptr, args):
    """Call the C function at address ``fptr`` with the values of the tuple ``args`` as they
    are typed (CBLAS gemm: order, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c,
    ldc; Fortran gemm: 13 pointers as int64)."""
    def codegen(context, builder, signature, llargs):
        fnty = ir.FunctionType(ir.VoidType(),
                               [context.get_value_type(t) for t in signature.args[1].types])
        values = cgutils.unpack_tuple(builder, llargs[1], len(signature.args[1].types))
        builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), values)
        return context.get_dummy_value()
    return types.void(fptr, args), codegen


# OpenBLAS's x86 kernels for CPUs with AVX-512 (F, CD, BW, DQ, VL): its SkylakeX target,
# whose SGEMM/DGEMM kernels its Cooperlake, Sapphire Rapids and Zen 4 targets use as well
_AVX512_CORE = "SkylakeX"
_AVX512_FEATURES = ("+avx512f", "+avx512cd", "+avx512bw", "+avx512dq", "+avx512vl")


def _coretype():
    """The ``OPENBLAS_CORETYPE`` the private OpenBLAS loads with, or None (the environment's
    ``OPENBLAS_CORETYPE`` if set, else OpenBLAS's own detection): ``NUMBAFUSE_BLAS_CORETYPE``
    if set; else ``_AVX512_CORE`` where numbafuse's own kernels are compiled for AVX-512
    (``gemm_taps.WIDE``'s test: Numba's target) and the host has the features its kernels
    use (LLVM's host features include the OS's support for the AVX-512 state); else None.

    The private BLAS is part of numbafuse's kernels, so it takes the instruction set they take.
    A process-wide ``OPENBLAS_CORETYPE`` (machine E's environment sets ``Haswell``) addresses
    NumPy's and SciPy's OpenBLAS; followed here it ran numbafuse's GEMMs on AVX2 kernels beside
    its AVX-512 ones: one thread's SGEMM at (512, 512, 512) 129-131 GFLOP/s against 242-244
    with the SkylakeX kernels, (64, 128) @ k 4608 118-121 against 194-199 (machine E, Zen 5).
    Only this instance is loaded so: the variable is set around its ``dlopen`` (OpenBLAS reads
    it then) and restored, so NumPy's and SciPy's OpenBLAS, and PyTorch, keep their own."""
    forced = os.environ.get("NUMBAFUSE_BLAS_CORETYPE")
    if forced:
        return forced
    from . import gemm_taps
    if not gemm_taps._has_avx512():
        return None
    try:
        import llvmlite.binding as llvm
        features = llvm.get_host_cpu_features().flatten().split(",")
    except Exception:                                        # no answer: OpenBLAS decides
        return None
    return _AVX512_CORE if all(f in features for f in _AVX512_FEATURES) else None


def _private_openblas():
    """(sgemm, dgemm) addresses of CBLAS functions of a private one-thread OpenBLAS, or None."""
    if os.environ.get("NUMBAFUSE_PRIVATE_BLAS", "1") == "0":
        return None
    # the wheel's module loads the library when imported (RTLD_GLOBAL, for NumPy and SciPy
    # builds that link it; this one is not NumPy's or SciPy's own copy): the core type is set
    # around that import and the load below, where OpenBLAS reads it
    core, before = _coretype(), os.environ.get("OPENBLAS_CORETYPE")
    if core is not None:
        os.environ["OPENBLAS_CORETYPE"] = core
    try:
        try:
            import scipy_openblas32
        except ImportError:
            return None
        lib_dir = scipy_openblas32.get_lib_dir()
        names = sorted(f for f in os.listdir(lib_dir) if f.startswith("libscipy_openblas")
                       and f.split(".")[-1] in ("so", "dylib", "dll"))
        if not names:
            return None
        lib = ctypes.CDLL(os.path.join(lib_dir, names[0]))
    finally:
        if core is not None:
            if before is None:
                del os.environ["OPENBLAS_CORETYPE"]
            else:
                os.environ["OPENBLAS_CORETYPE"] = before
    lib.scipy_openblas_set_num_threads(1)
    _private_openblas.lib = lib                              # keep it loaded
    try:
        corename = lib.scipy_openblas_get_corename
        corename.restype = ctypes.c_char_p
        _private_openblas.corename = corename().decode()
    except AttributeError:
        _private_openblas.corename = None
    return tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
                 for n in ("scipy_cblas_sgemm", "scipy_cblas_dgemm"))


def _scipy_fortran():
    from numba.core.extending import get_cython_function_address
    return tuple(get_cython_function_address("scipy.linalg.cython_blas", n)
                 for n in ("sgemm", "dgemm"))


_private = _private_openblas()
PRIVATE = _private is not None
# the private OpenBLAS's kernels (its core name, e.g. "SkylakeX"), None without it
CORENAME = getattr(_private_openblas, "corename", None) if PRIVATE else None
_ADDRESSES = _private if PRIVATE else _scipy_fortran()


# float32 products that fit go to numbafuse's register-tiled kernel (cpu/gemm.py) instead of
# the BLAS; read at each call (blas_for), so it can be switched without recompiling
SMALL_GEMM = True
# ... and the other float32 products c = a @ b + beta c (neither operand transposed, alpha 1,
# beta 0 or 1, n % 8 == 0, at least 16 rows: fewer run 1-row tiles, a ResNet stem's phase dX
# 3.3 -> 5.1 ms) to cpu.gemm_taps's gather tiles (b's rows by address: a table of k
# addresses), read the same way. Machine A (Zen 4), one thread, GFLOP/s tiles / OpenBLAS:
# (128, 2304) @ (2304, 256)-shaped products 113 / 104, with k = 64 113 / 80-84; the passes
# and networks: docs/conv_bias_relu.md, "The GEMMs on numbafuse's own tiles".
TILE_GEMM = True
# ... with b's panels packed where gemm_taps.packs_panel says (False: read in place, as before
# 8e30507; read at each call, for in-process comparisons: benchmarks/bench_tiles.py --compare
# pack)
PACK_B = True


def blas_for(dtype):
    """What the kernels' ``gemm`` takes as ``blas``: (function address, 1 if CBLAS else 0,
    flags: 1 if small float32 products go to cpu.gemm, + 2 if the other float32 products
    that fit go to gemm_taps' tiles, + 4 if those are 16 floats wide, + 8 if b is read in
    place there, never packed: ``PACK_B`` False). Host code asks for it
    before it launches a kernel that multiplies, so the GEMM steps are made ready here."""
    _ready_steps(None, _GEMM_STEPS)
    key = (dtype, SMALL_GEMM, TILE_GEMM, _tiles.WIDE, PACK_B)
    made = _MADE.get(key)                       # (the host path: a dictionary lookup)
    if made is None:
        made = (_ADDRESSES[0 if np.dtype(dtype) == np.float32 else 1], 1 if PRIVATE else 0,
                (1 if SMALL_GEMM else 0) | (2 if TILE_GEMM else 0) | (4 if _tiles.WIDE else 0)
                | (0 if PACK_B else 8))
        if len(_MADE) < 64:
            _MADE[key] = made
    return made


_MADE = {}           # blas_for's answers by (dtype, SMALL_GEMM, TILE_GEMM, WIDE, PACK_B)


@njit(nogil=True, cache=True, inline="always")
def _gemm_small(ta, mnk, a, lda, b, ldb, beta, c, ldc, pbias, relu):
    # cpu.gemm.gemm_small on arrays: their addresses, every argument as int64 (the kernel's one
    # compiled signature, whatever integer and flag types the calling kernel has)
    q = np.int64
    m, n, k = mnk
    _gemm_small_step((q(1 if ta else 0), (q(m), q(n), q(k)), q(a.ctypes.data), q(lda),
                      q(b.ctypes.data), q(ldb), q(1 if beta else 0), q(c.ctypes.data), q(ldc),
                      q(pbias), q(1 if relu else 0)))


@njit(nogil=True, cache=True)
def gemm_at(blas, ta, tb, mnk, alpha, pa, pb, beta, pc, lds, itemsize):
    """:func:`gemm` on addresses: ``mnk`` = (m, n, k), ``lds`` = (lda, ldb, ldc), every
    integer int64 and alpha, beta float64: one compiled signature for every kernel's products
    (inlined at each call site, its three paths cost each calling kernel their compile
    time)."""
    i = np.int32
    fptr, cblas, flags = blas
    m, n, k = mnk
    lda, ldb, ldc = lds
    if flags & 1 and _small.fits(ta, tb, alpha, beta, m, n, k, itemsize):
        _small.gemm_small(ta, mnk, pa, lda, pb, ldb, np.int64(1 if beta != 0.0 else 0), pc,
                          ldc, np.int64(0), np.int64(0))
    elif (flags & 2 and itemsize == 4 and not ta and not tb and alpha == 1.0
          and (beta == 0.0 or beta == 1.0) and n % 8 == 0 and m >= 16 and k > 0):
        rows = np.empty(k, np.int64)                              # b's rows
        _tiles.dense_rows(rows, pb, k, ldb)
        _tiles.gemm_gather(m, n, k, pa, lda, np.int64(rows.ctypes.data), np.int64(0), pc, ldc,
                           np.int64(1 if beta != 0.0 else 0),
                           np.int64((1 if flags & 4 else 0)
                                    | (_tiles.UNPACKED if flags & 8 else 0)))
    elif cblas:
        opa = _TRANS if ta else _NO_TRANS
        opb = _TRANS if tb else _NO_TRANS
        if itemsize == 4:
            _call(fptr, (i(_ROW_MAJOR), i(opa), i(opb), i(m), i(n), i(k), np.float32(alpha),
                         pa, i(lda), pb, i(ldb), np.float32(beta), pc, i(ldc)))
        else:
            _call(fptr, (i(_ROW_MAJOR), i(opa), i(opb), i(m), i(n), i(k), alpha, pa, i(lda),
                         pb, i(ldb), beta, pc, i(ldc)))
    else:
        # Fortran BLAS, every argument by pointer, column-major: row-major c = op(a) op(b) is
        # column-major c^T = op(b)^T op(a)^T, so the operands swap
        ints = np.empty(6, np.int32)                      # m, n, k, ldb, lda, ldc (Fortran)
        ints[0], ints[1], ints[2], ints[3], ints[4], ints[5] = n, m, k, ldb, lda, ldc
        flags = np.empty(2, np.uint8)                     # transb, transa
        flags[0] = 84 if tb else 78                       # "T", "N" (ord() would compile
                                                          # numba's str support)
        flags[1] = 84 if ta else 78
        scal = np.empty(3)                                # alpha, beta in c's dtype: float64
        scal[0], scal[1] = alpha, beta                    # [0:2], or float32 in bytes 16-23
        s32 = scal[2:].view(np.float32)
        s32[0], s32[1] = alpha, beta
        p, ps = ints.ctypes.data, scal.ctypes.data + (16 if itemsize == 4 else 0)
        _call(fptr, (flags.ctypes.data, flags.ctypes.data + 1, p, p + 4, p + 8, ps, pb, p + 12,
                     pa, p + 16, ps + itemsize, pc, p + 20))
        # the buffers were passed by address: used after the call, they live until it returns
        ints[0] = flags[0] = 0
        scal[0] = 0.0


# gemm_at and cpu.gemm.gemm_small as steps (kernels/cpu/steps.py): the conv task kernels
# call them through slots, so their code is compiled once, not again in every kernel.
_I64 = types.int64
_T3 = types.UniTuple(_I64, 3)
GEMM_AT = Step(gemm_at.py_func, lambda f: [
    (_T3, _I64, _I64, _T3, types.float64, _I64, _I64, types.float64, _I64, _T3, _I64)],
    per_dtype=False)
GEMM_SMALL = Step(_small.gemm_small.py_func, lambda f: [(_I64, _T3) + (_I64,) * 9],
                  per_dtype=False)
_GEMM_STEPS = (GEMM_AT, GEMM_SMALL)
_gemm_at_step, _gemm_small_step = GEMM_AT.call, GEMM_SMALL.call


@njit(nogil=True, cache=True, inline="always")
def gemm(blas, ta, tb, mnk, alpha, a, lda, b, ldb, beta, c, ldc):
    """c (m, n) = alpha op(a) @ op(b) + beta c, row-major, ``mnk`` = (m, n, k); ``blas`` from
    :func:`blas_for`. The arrays stay alive in the caller; :func:`gemm_at` takes their
    addresses."""
    q = np.int64
    m, n, k = mnk
    _gemm_at_step((blas, q(1 if ta else 0), q(1 if tb else 0), (q(m), q(n), q(k)),
                   np.float64(alpha), q(a.ctypes.data), q(b.ctypes.data), np.float64(beta),
                   q(c.ctypes.data), (q(lda), q(ldb), q(ldc)), q(c.itemsize)))


@njit(nogil=True, cache=True, inline="always")
def gemm_bias_relu(blas, m, n, k, a, lda, b, ldb, c, bias, relu):
    """c (m, n) = relu?(a (m, k) @ b (k, n) + bias (n,)), row-major, c a 2-d view; the bias and
    ReLU in registers (cpu.gemm) when the product fits, else one pass over c after the GEMM,
    while it is in cache. The same arithmetic either way: the float32 sum, + bias, ReLU."""
    fptr, cblas, flags = blas
    if flags & 1 and _small.fits_epilogue(n, k, c.itemsize):
        _gemm_small(False, (m, n, k), a, lda, b, ldb, False, c, c.strides[0] // c.itemsize,
                    bias.ctypes.data, relu)
    else:
        gemm(blas, False, False, (m, n, k), 1.0, a, lda, b, ldb, 0.0, c,
             c.strides[0] // c.itemsize)
        for i in range(m):
            r = c[i]                                              # (n,)
            for j in range(n):
                v = r[j] + bias[j]
                r[j] = _relu(v) if relu else v
