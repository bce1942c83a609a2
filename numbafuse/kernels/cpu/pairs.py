"""Stride-2 splits and merges of a row for compiled CPU kernels, in vector shuffles.

``split_pairs(src, even, odd)``: ``even[k] = src[2k]``, ``odd[k] = src[2k + 1]`` for k <
len(even) (odd as long or one shorter); ``merge_pairs(even, odd, dst)`` is its inverse. Blocks
of 8 pairs are one 16-value load and two ``shufflevector``s (the even and the odd lanes) and
two 8-value stores (a merge: two loads, two shuffles, one store). The last 8 pairs past the
last whole block are one more block overlapping the one before (values written twice, the
same); a row of fewer than 8 pairs goes one value at a time. ``split_pairs_at`` and
``merge_pairs_at`` take addresses (what ``conv/cpu_phases`` calls, a row at a time);
``split_pairs`` and ``merge_pairs`` are the same on 1-d arrays. Target-independent LLVM IR,
any float dtype.

Why: the depthwise NCHW kernels split each zero-padded input plane into its stride phases
(``conv/cpu_phases.split_phases``). A loop over every other value alone does not
vectorise, and a loop over whole pairs vectorises 16 or 32 pairs at a time, which a 28-pair
row (a 56-wide plane at stride 2) mostly leaves to its scalar remainder: the split took 4.2
ms of the 6.9 ms 3x3 stride-2 forward at (32, 64, 56, 56) on one thread of machine A.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_EVEN = tuple(range(0, 16, 2))
_ODD = tuple(range(1, 16, 2))
_ZIP = tuple(i // 2 + 8 * (i % 2) for i in range(16))      # e0 o0 e1 o1 ... of (e, o)


def _lanes(n, lanes):
    return ir.Constant(ir.VectorType(_I32, n), [ir.Constant(_I32, i) for i in lanes])


def _vectors(context, builder, like, width):
    el = context.get_value_type(like.dtype)
    return el, ir.VectorType(el, width), context.get_abi_sizeof(el)


@intrinsic
def _split8(typingctx, src, even, odd, like):
    """even[0:8] = src[0:16:2], odd[0:8] = src[1:16:2]: addresses (integers), ``like`` an
    array of the dtype."""
    def codegen(context, builder, signature, args):
        s, e, o = args[:3]
        el, v16, align = _vectors(context, builder, like, 16)
        v8 = ir.VectorType(el, 8)
        v = builder.load(builder.inttoptr(s, v16.as_pointer()), align=align)
        undef = ir.Constant(v16, ir.Undefined)
        builder.store(builder.shuffle_vector(v, undef, _lanes(8, _EVEN)),
                      builder.inttoptr(e, v8.as_pointer()), align=align)
        builder.store(builder.shuffle_vector(v, undef, _lanes(8, _ODD)),
                      builder.inttoptr(o, v8.as_pointer()), align=align)
        return context.get_dummy_value()

    return types.void(src, even, odd, like), codegen


@intrinsic
def _merge8(typingctx, even, odd, dst, like):
    """dst[0:16:2] = even[0:8], dst[1:16:2] = odd[0:8]: addresses (integers)."""
    def codegen(context, builder, signature, args):
        e, o, d = args[:3]
        el, v16, align = _vectors(context, builder, like, 16)
        v8 = ir.VectorType(el, 8)
        ev = builder.load(builder.inttoptr(e, v8.as_pointer()), align=align)
        ov = builder.load(builder.inttoptr(o, v8.as_pointer()), align=align)
        builder.store(builder.shuffle_vector(ev, ov, _lanes(16, _ZIP)),
                      builder.inttoptr(d, v16.as_pointer()), align=align)
        return context.get_dummy_value()

    return types.void(even, odd, dst, like), codegen


@intrinsic
def copy_at(typingctx, dst, src, n, like):
    """dst[0:n] = src[0:n]: addresses (integers) of unit-stride values of ``like``'s dtype,
    not overlapping (``llvm.memcpy``)."""
    def codegen(context, builder, signature, args):
        d, s, count = args[:3]
        el = context.get_value_type(like.dtype)
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), count,
                           context.get_abi_sizeof(el), 1)
        return context.get_dummy_value()
    return types.void(dst, src, n, like), codegen


@njit(nogil=True, inline="always")
def split_pairs(src, even, odd):
    """even[k] = src[2k] for k < len(even), odd[k] = src[2k + 1] for k < len(odd): 1-d
    arrays of one dtype with unit stride; len(odd) is len(even) or one less, and src has
    len(even) + len(odd) values at least."""
    n = odd.shape[0]
    isz = src.itemsize
    done = 0
    if n >= 8 and src.strides[0] == even.strides[0] == odd.strides[0] == isz:
        split_pairs_at(np.intp(src.ctypes.data), np.intp(even.ctypes.data),
                       np.intp(odd.ctypes.data), n, src)
        done = n
    for k in range(done, n):
        even[k] = src[2 * k]
        odd[k] = src[2 * k + 1]
    for k in range(n, even.shape[0]):
        even[k] = src[2 * k]


@njit(nogil=True, inline="always")
def split_pairs_at(ps, pe, po, n, like):
    """:func:`split_pairs` of ``n >= 8`` pairs at addresses (integers) of unit-stride values
    of ``like``'s dtype: blocks of 8 pairs, the last one overlapping the block before."""
    isz = like.itemsize
    for b in range(n // 8):
        _split8(ps + 16 * b * isz, pe + 8 * b * isz, po + 8 * b * isz, like)
    if n % 8:
        k = n - 8
        _split8(ps + 2 * k * isz, pe + k * isz, po + k * isz, like)


@njit(nogil=True, inline="always")
def merge_pairs_at(pe, po, pd, n, like):
    """:func:`merge_pairs` of ``n >= 8`` pairs at addresses (integers) of unit-stride values
    of ``like``'s dtype: blocks of 8 pairs, the last one overlapping the block before (its
    values written twice, the same)."""
    isz = like.itemsize
    for b in range(n // 8):
        _merge8(pe + 8 * b * isz, po + 8 * b * isz, pd + 16 * b * isz, like)
    if n % 8:
        k = n - 8
        _merge8(pe + k * isz, po + k * isz, pd + 2 * k * isz, like)


@njit(nogil=True, inline="always")
def merge_pairs(even, odd, dst):
    """dst[2k] = even[k] for k < len(even), dst[2k + 1] = odd[k] for k < len(odd) (the
    inverse of :func:`split_pairs`)."""
    n = odd.shape[0]
    isz = dst.itemsize
    done = 0
    if n >= 8 and dst.strides[0] == even.strides[0] == odd.strides[0] == isz:
        merge_pairs_at(np.intp(even.ctypes.data), np.intp(odd.ctypes.data),
                       np.intp(dst.ctypes.data), n, dst)
        done = n
    for k in range(done, n):
        dst[2 * k] = even[k]
        dst[2 * k + 1] = odd[k]
    for k in range(n, even.shape[0]):
        dst[2 * k] = even[k]

