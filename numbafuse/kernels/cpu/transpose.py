"""A 2-d transpose for compiled CPU kernels, in 8 x 8 tiles of vector loads and shuffles.

``transpose(src, dst)``: ``dst[j, i] = src[i, j]`` for a (rows, cols) ``src`` and a (cols,
rows) ``dst``, both with unit inner stride (any row stride). The 8 x 8 tiles of the interior
load eight rows of ``src`` as vectors, transpose them with three rounds of LLVM
``shufflevector`` (the unpack / shuffle / 128-bit permute of the classic AVX 8 x 8 transpose;
target independent IR, so it compiles on any CPU LLVM supports) and store eight rows of
``dst``; the edges (rows or columns past the last multiple of 8) are copied one value at a
time. Numba's scalar loop (``dst[w, c] = src[c, w]``) writes one value per cache line touched
and does not vectorise: the NCHW slabs of the strided convolution (``conv/cpu_im2col.py``)
took 1.53 ns a value that way over a (32, 64, 32, 32) float32 input, 0.85 with OpenBLAS's
``somatcopy``, and 0.3-0.4 ns with these tiles (2-core AMD EPYC, AVX2).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .launch import launch, task_kernel
from .steps import Step, array

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)

# the three rounds, as (operand pair, lane indices into the pair's 16 lanes) per output
_UNPACK = ((0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15))
_PAIRS = ((0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))
_HALVES = ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))


def _shuffle(builder, a, b, lanes):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8),
                                                    [ir.Constant(_I32, i) for i in lanes]))


@intrinsic
def _tile8(typingctx, src, lds, dst, ldd, like):
    """dst[j*ldd + i] = src[i*lds + j] for i, j < 8: ``src``, ``dst`` addresses (integers),
    ``lds``, ``ldd`` row strides in elements (int64), ``like`` an array of the dtype."""
    dtype = like.dtype

    def codegen(context, builder, signature, args):
        s, ls, d, ld = args[:4]
        el = context.get_value_type(dtype)
        vec = ir.VectorType(el, 8)
        align = context.get_abi_sizeof(el)
        s = builder.inttoptr(s, el.as_pointer())
        d = builder.inttoptr(d, el.as_pointer())
        ls = builder.sext(ls, _I64) if ls.type.width < 64 else ls
        ld = builder.sext(ld, _I64) if ld.type.width < 64 else ld

        def row(base, stride, i):
            p = builder.gep(base, [builder.mul(stride, ir.Constant(_I64, i))])
            return builder.bitcast(p, vec.as_pointer())

        r = [builder.load(row(s, ls, i), align=align) for i in range(8)]
        t = [None] * 8                          # t[2k], t[2k+1]: unpack lo/hi of r[2k], r[2k+1]
        for k in range(4):
            t[2 * k] = _shuffle(builder, r[2 * k], r[2 * k + 1], _UNPACK[0])
            t[2 * k + 1] = _shuffle(builder, r[2 * k], r[2 * k + 1], _UNPACK[1])
        u = [None] * 8                          # rows 0-3 (u[0..3]) and 4-7 (u[4..7]) in pairs
        for half in range(2):
            a, b = t[4 * half], t[4 * half + 2]          # unpack lo of rows (0,1) and (2,3)
            c, e = t[4 * half + 1], t[4 * half + 3]      # unpack hi
            u[4 * half + 0] = _shuffle(builder, a, b, _PAIRS[0])
            u[4 * half + 1] = _shuffle(builder, a, b, _PAIRS[1])
            u[4 * half + 2] = _shuffle(builder, c, e, _PAIRS[0])
            u[4 * half + 3] = _shuffle(builder, c, e, _PAIRS[1])
        for j in range(4):                      # columns j and j + 4
            builder.store(_shuffle(builder, u[j], u[4 + j], _HALVES[0]), row(d, ld, j),
                          align=align)
            builder.store(_shuffle(builder, u[j], u[4 + j], _HALVES[1]), row(d, ld, j + 4),
                          align=align)
        return context.get_dummy_value()

    return types.void(src, lds, dst, ldd, like), codegen


# Which side's rows the tiles go along (``transpose``): the source's where its row stride is at
# least this many times the destination's, else the destination's (writes are the dearer to
# scatter: a square transpose gains too). One thread, machine E (Zen 5), float32, ms for 16
# transposes of (rows, cols), source rows then destination rows first: (1024, 64) 1.13 ->
# 0.15, (4096, 64) 4.98 -> 1.03, (256, 128) 0.25 -> 0.08, (128, 256) 0.10 -> 0.07; 4 of
# (1024, 1024) 3.8-4.9 -> 1.9-2.8; (64, 1024) 0.12 and (64, 4096) 0.90-1.00 either way (the
# source's rows first, as before)
ORDER_RATIO = 4


@njit(nogil=True, inline="always")
def transpose(src, dst):
    """dst (cols, rows) <- src (rows, cols) transposed; both with unit inner stride."""
    rows, cols = src.shape
    isz = src.itemsize
    r8, c8 = rows - rows % 8, cols - cols % 8
    if src.strides[1] != isz or dst.strides[1] != isz:      # (not the callers' case)
        r8 = c8 = 0
    lds, ldd = src.strides[0] // isz, dst.strides[0] // isz
    s0, d0 = np.intp(src.ctypes.data), np.intp(dst.ctypes.data)
    # The tiles go along 8 rows of the side whose rows lie farther apart (ORDER_RATIO), so
    # that the other side's rows are the ones swept: 8 rows a power of two apart share an L1
    # set and stay in it, 64 of them do not (a 4 KB row stride, e.g. an NCHW output at 32x32,
    # had every line of dst evicted half written and read back for its other half)
    if lds >= ORDER_RATIO * ldd:      # 8 source rows at a time, dst's rows swept
        n_out, n_in, s_out, d_out, s_in, d_in = r8, c8, lds, 1, 1, ldd
    else:                             # 8 destination rows at a time, src's rows swept
        n_out, n_in, s_out, d_out, s_in, d_in = c8, r8, 1, ldd, lds, 1
    for o in range(0, n_out, 8):
        sp, dp = s0 + o * s_out * isz, d0 + o * d_out * isz
        for i in range(0, n_in, 8):
            _tile8(sp + i * s_in * isz, lds, dp + i * d_in * isz, ldd, src)
    for i in range(r8):                                     # the last columns of the tiled rows
        for j in range(c8, cols):
            dst[j, i] = src[i, j]
    for i in range(r8, rows):                               # the last rows
        for j in range(cols):
            dst[j, i] = src[i, j]


@njit(nogil=True, cache=True)
def transpose_rows(src, dst):
    """dst[i] = src[i].T for each i: src (n, rows, cols) and dst (n, cols, rows), C-contiguous
    (a weight tensor's taps reordered, e.g. (K, C, 9) -> (K, 9, C))."""
    for i in range(src.shape[0]):
        transpose(src[i], dst[i])


@njit(nogil=True, cache=True)
def _rows_step(src, dst):
    transpose_rows(src, dst)


# transpose_rows as a step (cpu.steps): its callers (the k-blocked im2col passes reordering
# a block of weights or of dW between (C, R*S) and (R*S, C)) call it through a slot, not
# compiled into each of them; ROWS.call((src, dst)) with 3-d C-contiguous arrays
ROWS = Step(_rows_step.py_func, lambda f: [(array(f, 3), array(f, 3))])


# --------------------------------------------------------------------------- a matrix's transpose

TRANSPOSE_ROWS = 64         # source rows a task of transposed() transposes


@njit(nogil=True, cache=True)
def _transpose_tasks(t0, t1, src, dst, rows):
    # task t: src's rows [rows*t, rows*t + rows) into dst's columns
    for t in range(t0, t1):
        r0 = t * rows
        r1 = min(src.shape[0], r0 + rows)
        transpose(src[r0:r1], dst[:, r0:r1])


def transposed(a, out):
    """``out`` (cols, rows) <- ``a`` (rows, cols) transposed (both C-contiguous, one dtype),
    in 8 x 8 tiles, row blocks in parallel (``launch``); returns ``out``.

    For a weight matrix transposed at every call (a 1x1 conv's dX in NCHW: ``w^T @ g``),
    where NumPy's ``np.ascontiguousarray(a.T)`` walks the source one value at a time: one
    thread, machine A (Zen 4), float32, (2048, 512) 3.29 ms against 0.67 with the tiles
    (one task), (256, 1024) 0.80 against 0.065, (1024, 256) 0.24 against 0.13. The same
    values (a copy)."""
    launch(_transpose_tasks, -(-a.shape[0] // TRANSPOSE_ROWS), a, out, TRANSPOSE_ROWS,
           work=a.size)
    return out


@task_kernel
def _image_tasks(t0, t1, src, dst):
    # dst[n] (cols, rows) <- src[n] (rows, cols) for images n in [t0, t1)
    for n in range(t0, t1):
        transpose(src[n], dst[n])


def transposed_images(a, out):
    """``out`` (N, cols, rows) <- each of ``a``'s N (rows, cols) matrices transposed (both
    C-contiguous, one dtype), in 8 x 8 tiles, an image a task (``launch``); returns ``out``.
    An NCHW batch's NHWC copy and back: (C, H*W) <-> (H*W, C) an image (the depthwise
    convs of small NCHW maps, ``conv/cpu_depthwise_nchw.swapped``)."""
    launch(_image_tasks, a.shape[0], a, out, work=a.size)
    return out
