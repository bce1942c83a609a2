"""Spin-wait primitives for numbafuse's CPU threads, called from compiled code with the GIL
released: a monotonic clock (the C library's ``clock_gettime``), atomic acquire loads, release
stores, fetch-add, exchange and compare-and-swap on int64 arrays, calls of C functions by
address, the ``pause`` hint, and the waits built on them (a helper parking between calls, the
launching thread waiting for parked helpers). Used by ``cpu.launch`` (its own pool),
``cpu.team`` (PyTorch's OpenMP team) and ``cpu.native`` (compiled launches).
"""
import ctypes
import sys

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SLOT = 8                  # int64s per flag slot: one cache line each


def _clock_address():
    """Address of the C library's clock_gettime on Linux (whose CLOCK_MONOTONIC id and 64-bit
    timespec :func:`monotonic_ns` assumes), else 0: then nothing parks."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        return ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value or 0
    except (OSError, AttributeError, TypeError):
        return 0


CLOCK = _clock_address()
CLOCK_MONOTONIC_ID = 1          # Linux's clock id


def _x86(builder):
    return builder.module.triple.startswith(("x86_64", "amd64"))


@intrinsic
def monotonic_ns(typingctx, fptr):
    """CLOCK_MONOTONIC in ns by clock_gettime at address ``fptr`` (a 64-bit timespec)."""
    sig = types.int64(types.intp)

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        ts = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), ir.IntType(8).as_pointer()])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()),
                     [ir.Constant(ir.IntType(32), CLOCK_MONOTONIC_ID),
                      builder.bitcast(ts, ir.IntType(8).as_pointer())])
        zero, one = ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 1)
        sec = builder.load(builder.gep(ts, [zero, zero]))
        nsec = builder.load(builder.gep(ts, [zero, one]))
        return builder.add(builder.mul(sec, ir.Constant(i64, 10 ** 9)), nsec)
    return sig, codegen


@intrinsic
def load_acquire(typingctx, flag):
    """flag[0] (an int64 array) by an atomic acquire load: a spin loop sees other threads'
    stores (a plain load may be hoisted out of the loop)."""
    sig = types.int64(flag)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load_atomic(ary.data, "acquire", 8)
    return sig, codegen


@intrinsic
def store_release(typingctx, flag, value):
    """flag[0] = value by an atomic release store."""
    sig = types.void(flag, types.int64)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        builder.store_atomic(args[1], ary.data, "release", 8)
        return context.get_dummy_value()
    return sig, codegen


def _read_modify_write(op, name, doc):
    """An intrinsic ``name(flag, value)``: flag[0] = flag[0] ``op`` value atomically
    (acquire-release), returning the old value."""
    def rmw(typingctx, flag, value):
        sig = types.int64(flag, types.int64)

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            return builder.atomic_rmw(op, ary.data, args[1], "acq_rel")
        return sig, codegen
    rmw.__name__ = rmw.__qualname__ = name
    rmw.__doc__ = doc
    return intrinsic(rmw)


fetch_add = _read_modify_write("add", "fetch_add", "flag[0] += value, atomically; the old value.")
exchange = _read_modify_write("xchg", "exchange", "flag[0] = value, atomically; the old value.")


@intrinsic
def compare_swap(typingctx, flag, expected, value):
    """flag[0] = value if it is ``expected``, atomically; whether it was."""
    sig = types.boolean(flag, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        pair = builder.cmpxchg(ary.data, args[1], args[2], "acq_rel", "acquire")
        return builder.extract_value(pair, 1)
    return sig, codegen


@intrinsic
def call_int(typingctx, fptr):
    """``int f(void)`` at address ``fptr``."""
    sig = types.int32(types.intp)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [])
    return sig, codegen


@intrinsic
def call_void(typingctx, fptr, data):
    """``void f(void *data)`` at address ``fptr``; ``data`` a pointer or an address."""
    sig = types.void(types.intp, data)

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p])
        data = (builder.bitcast(args[1], i8p) if isinstance(sig.args[1], types.CPointer)
                else builder.inttoptr(args[1], i8p))
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [data])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def cpu_relax(typingctx):
    """x86 ``pause`` (a spin loop's hint to the core); nothing elsewhere."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if _x86(builder):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


@njit(nogil=True, cache=True)
def park(flag, seen, slot, clock, ns, late_ns):
    """A helper done with generation ``seen``: says so in flag[slot] (the caller's thread is
    then in compiled code, GIL released), then waits while flag[0] == seen, at most ``ns``, and
    ``late_ns`` more once it changed (the launching thread holds the GIL a few microseconds
    after it publishes; asking for the GIL then puts this thread to sleep on it). Returns
    whether flag[0] changed."""
    store_release(flag[slot:], seen)
    end = monotonic_ns(clock) + ns
    while load_acquire(flag) == seen:
        for _ in range(64):
            cpu_relax()
        if monotonic_ns(clock) >= end:
            return False
    end = monotonic_ns(clock) + late_ns
    while monotonic_ns(clock) < end:
        cpu_relax()
    return True


@njit(nogil=True, cache=True)
def await_parked(flag, slots, gen, clock, ns):
    """The launching thread: wait, GIL released, at most ``ns`` until flag[s] >= gen for every
    s in ``slots``; whether they all did."""
    end = monotonic_ns(clock) + ns
    while True:
        done = True
        for s in slots:
            if load_acquire(flag[s:]) < gen:
                done = False
                break
        if done:
            return True
        for _ in range(64):
            cpu_relax()
        if monotonic_ns(clock) >= end:
            return False


@njit(nogil=True, cache=True)
def publish(flag, value):
    store_release(flag, value)
