"""Compiled launches: a parallel region whose threads take their ranges and call the task
kernel's machine code with no Python and no GIL between the launch and its return.

A launch otherwise runs Python on every thread: on PyTorch's OpenMP team (``cpu.team``) the
ctypes callback that takes the GIL, and on either the job's lock and one Numba dispatch a
range (the arguments typed and unboxed again each time): ~21 us a launch of two threads on
the team, warm, ~110-130 with the caches cold (docs/threading.md, "Compiled launches": ~11
and ~75 here; in a ResNet step 0-5% of the launches' time). Here a
launch is one dispatch of :func:`enter` on the calling thread, which unboxes the arguments
once, keeps them in a record on its stack, and then runs :func:`_ranges` (compiled: ranges of
tasks taken from an atomic counter, the kernel's native function called by its address) on
every thread of the region:

- on PyTorch's team, ``GOMP_parallel`` called from :func:`enter` itself, each team thread
  calling the record's entry;
- on numbafuse's own pool, the record's entry and address published in the pool's *native
  flag* (an int64 array: :data:`ENTRY`, :data:`RECORD`, :data:`WORD`, :data:`FINISHED`),
  which the helpers join with :func:`join` (compiled; a helper woken for the launch calls it).
  ``WORD`` is twice the helpers joined plus 1 while the launch is open: a helper joins by a
  compare-and-swap that needs the open bit, the caller closes it by an exchange after its own
  ranges and waits until as many helpers have finished as had joined, so no helper touches
  the record once :func:`enter` has returned;
- on this thread alone (``gomp`` 0 and an empty flag).

The kernel is called by address, not linked into :func:`enter` (linking would compile its
whole body again in every caller), so :func:`enter` is compiled once per tuple of argument
*types* (~0.25 s, ``cache=True``), not per kernel: :func:`address` finds the kernel's native
function for the arguments' types (compiling the kernel as a call would) and, the first time
a type tuple is seen, runs :func:`enter` on no tasks, so that its compilation (or its load
from the cache) happens there, where ``first_calls``' probe and compiling process see it,
and not in the first parallel launch.

A kernel's error (a Numba exception in nopython code) stops the handing out of ranges and is
counted in the state; ``cpu.launch`` then runs the kernel once more on the calling thread,
through its dispatcher, to raise it with its message.
"""
import ctypes
import warnings

import numpy as np
from llvmlite import ir
from numba import njit, types, typeof
try:                        # (Numba's own C helper, used by its dispatcher: private)
    from numba._dispatcher import compute_fingerprint
except ImportError:         # pragma: no cover  (then no launch runs compiled)
    compute_fingerprint = None
from numba.core import callconv, cgutils
from numba.core.typing.typeof import Purpose
from numba.extending import intrinsic

from .sync import (SLOT, call_int, call_void, compare_swap, cpu_relax, exchange, fetch_add,
                   load_acquire, park, store_release)

# the state of one launch: an int64 array of STATE_SIZE; [0] the next task to hand out,
# [ERRORS] the ranges whose kernel call failed (on its own cache line)
ERRORS = SLOT
STATE_SIZE = 2 * SLOT
# a pool's native flag (module docstring), each field on its own cache line; [YIELD] the C
# library's sched_yield (or 0), called while the launching thread waits for a helper;
# [SEQUENCE] the pool generation of the launch last opened (or given up: set_opened), from
# [NEXT], which the pool sets before :func:`enter`
ENTRY, RECORD, WORD, FINISHED, YIELD, SEQUENCE = 0, SLOT, 2 * SLOT, 3 * SLOT, 4 * SLOT, 5 * SLOT
NEXT = YIELD + 1
FLAG_SIZE = 6 * SLOT
NO_FLAG = np.zeros(0, np.int64)


def _sched_yield_address():
    try:
        return ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0
    except (OSError, AttributeError, TypeError):
        return 0


def pool_flag():
    """A new native flag for a pool."""
    flag = np.zeros(FLAG_SIZE, np.int64)
    flag[YIELD] = _sched_yield_address()
    return flag


@intrinsic
def _gomp_parallel(typingctx, gomp, entry, record, threads):
    """``GOMP_parallel(entry, record, threads, 0)`` of the runtime whose function is at
    ``gomp``: each of ``threads`` team threads calls ``entry(record)``."""
    sig = types.void(types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        entryty = ir.FunctionType(ir.VoidType(), [i8p]).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [entryty, i8p, i32, i32])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()),
                     [builder.inttoptr(args[1], entryty), builder.inttoptr(args[2], i8p),
                      builder.trunc(args[3], i32), ir.Constant(i32, 0)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _call_kernel(typingctx, kaddr, t0, t1, args):
    """The task kernel at ``kaddr`` (Numba's native calling convention, compiled for the
    argument types ``(int64, int64, *args)``) on tasks [t0, t1); 1 if it raised, else 0."""
    sig = types.int32(types.intp, types.int64, types.int64, args)

    def codegen(context, builder, sig, llargs):
        argtys = (types.int64, types.int64) + tuple(sig.args[3])
        cc = context.call_conv
        fn = builder.inttoptr(llargs[0], cc.get_function_type(types.none, argtys).as_pointer())
        values = [llargs[1], llargs[2]] + [builder.extract_value(llargs[3], i)
                                           for i in range(len(sig.args[3]))]
        retty = cc.get_return_type(types.none).pointee
        ret = cgutils.alloca_once(builder, retty)
        builder.store(cgutils.get_null_value(retty), ret)
        exc = cgutils.alloca_once(builder, ir.PointerType(callconv.excinfo_t))
        code = builder.call(fn, [ret, exc] + list(cc._get_arg_packer(argtys)
                                                  .as_arguments(builder, values)))
        status = cc._get_return_status(builder, code, builder.load(exc))
        return builder.select(status.is_error, ir.Constant(ir.IntType(32), 1),
                              ir.Constant(ir.IntType(32), 0))
    return sig, codegen


def _ranges(kaddr, state, ntasks, grain, args):
    """One thread's part of a launch: ranges of ``grain`` tasks until none is left. (Compiled
    into :func:`enter` by :func:`_record`.)"""
    while True:
        t0 = fetch_add(state, grain)
        if t0 >= ntasks:
            return 0
        if _call_kernel(kaddr, t0, min(t0 + grain, ntasks), args) != 0:
            fetch_add(state[ERRORS:], 1)
            fetch_add(state, ntasks)           # no more ranges for anyone
            return 0


@intrinsic
def _record(typingctx, kaddr, state, ntasks, grain, args):
    """(entry, record): the arguments of :func:`_ranges` in a record on the calling
    function's stack (valid until it returns), and a C function ``void entry(void *record)``
    that runs :func:`_ranges` on them."""
    sig = types.UniTuple(types.intp, 2)(types.intp, state, types.int64, types.int64, args)

    def codegen(context, builder, sig, llargs):
        lsig = types.int64(*sig.args)
        cres = context.compile_subroutine(builder, _ranges, lsig)
        recty = ir.LiteralStructType([v.type for v in llargs])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        zero = ir.Constant(i32, 0)
        entry = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p]),
            f"numbafuse_native_{cres.fndesc.mangled_name}")
        if entry.is_declaration:
            entry.linkage = "internal"
            eb = ir.IRBuilder(entry.append_basic_block("entry"))
            rec = eb.bitcast(entry.args[0], recty.as_pointer())
            values = [eb.load(eb.gep(rec, [zero, ir.Constant(i32, i)]))
                      for i in range(len(llargs))]
            context.call_internal_no_propagate(eb, cres.fndesc, lsig, values)
            eb.ret_void()
        rec = cgutils.alloca_once(builder, recty)
        for i, v in enumerate(llargs):
            builder.store(v, builder.gep(rec, [zero, ir.Constant(i32, i)]))
        intp = context.get_value_type(types.intp)
        return context.make_tuple(builder, sig.return_type,
                                  [builder.ptrtoint(entry, intp), builder.ptrtoint(rec, intp)])
    return sig, codegen


@njit(nogil=True, cache=True)
def _pool_region(flag, entry, record):
    """The launching thread's side of a region on numbafuse's pool (module docstring)."""
    flag[ENTRY] = entry
    flag[RECORD] = record
    flag[FINISHED] = 0
    store_release(flag[WORD:], 1)                   # open, no helper joined
    store_release(flag[SEQUENCE:], flag[NEXT])
    call_void(entry, record)
    joined = exchange(flag[WORD:], 0) >> 1         # closed
    spins = 0
    while load_acquire(flag[FINISHED:]) < joined:   # (a helper in its last range)
        cpu_relax()
        spins += 1
        if spins >= 4096 and flag[YIELD] != 0:     # (its core may be this one)
            call_int(flag[YIELD])


@njit(nogil=True, cache=True)
def join(flag, generation):
    """A helper of numbafuse's pool, woken for the launch of pool generation
    ``generation``: wait until that launch is open (or given up), join it (or a later one)
    if it still is, and run its ranges; whether it did."""
    while load_acquire(flag[SEQUENCE:]) < generation:     # (its caller still in Python)
        cpu_relax()
    while True:
        word = load_acquire(flag[WORD:])
        if word & 1 == 0:
            return False
        if compare_swap(flag[WORD:], word, word + 2):
            break
    call_void(flag[ENTRY], flag[RECORD])
    fetch_add(flag[FINISHED:], 1)
    return True


@njit(nogil=True, cache=True)
def serve(pool_flag, flag, generation, slot, clock, ns):
    """A pool helper woken for the compiled launch of pool generation ``generation``: join
    it, then ``sync.park`` (``pool_flag[slot]``, at most ``ns``) and join the
    next launches as long as they are compiled ones (``flag[NEXT]`` is their generation), all
    without Python. Returns the last generation served, at the park's end or where the next
    generation is not a compiled launch (a Python job, the pool's end)."""
    while True:
        join(flag, generation)
        if not park(pool_flag, generation, slot, clock, ns, 0):
            return generation
        following = load_acquire(pool_flag)
        if flag[NEXT] != following:
            return generation
        generation = following


@njit(nogil=True, cache=True)
def enter(kaddr, gomp, threads, flag, state, ntasks, grain, *args):
    """Tasks [0, ntasks) of the kernel at ``kaddr`` on ``args``, in ranges of ``grain``
    counted in ``state`` (an int64 array of STATE_SIZE): by ``GOMP_parallel`` at ``gomp`` on
    ``threads`` threads; else on numbafuse's pool through its native ``flag``; else (``flag``
    empty) on this thread. Returns the count of failed kernel calls."""
    state[0] = 0
    state[ERRORS] = 0
    entry, record = _record(kaddr, state, ntasks, grain, args)
    if gomp != 0:
        _gomp_parallel(gomp, entry, record, threads)
    elif flag.size >= FLAG_SIZE:
        _pool_region(flag, entry, record)
    else:
        call_void(entry, record)
    return state[ERRORS]


# (kernel, the arguments' fingerprint) -> [native address or 0, entry key, entry ready]: one
# lookup by a bytes key a launch (hashing the entry key, a tuple of Numba types, is Python
# code: ~25 us a launch with the caches cold)
_addresses = {}
_ready = set()      # the entry keys whose enter is compiled (or loaded) in this process


def address(kernel, args):
    """The native address of ``kernel`` (a Numba dispatcher) for ``(t0, t1, *args)`` where
    :func:`enter` is ready for the arguments' types, else 0 (the launch then runs through the
    dispatcher). The first call for a kernel and types compiles the kernel as a call would;
    the first for a tuple of types hands :func:`enter`'s compilation to ``first_calls`` (its
    compiling process, meanwhile 0), unless the cache has it."""
    if compute_fingerprint is None:
        return 0
    try:
        key = (kernel, compute_fingerprint(args))
    except (TypeError, ValueError, NotImplementedError):   # a type without a fingerprint
        return 0
    found = _addresses.get(key)
    if found is None:
        found = _addresses[key] = [*_resolve(kernel, args), False]
    if not found[2]:
        if not found[0] or not (found[1] in _ready or _entry_ready(found[1])):
            if found[1] in _failed:
                found[0] = 0
            return 0
        found[2] = True
    return found[0]


def _resolve(kernel, args):
    """(the kernel's native address for ``args``' types, or 0; :func:`enter`'s signature)."""
    try:
        argtypes = tuple(typeof(a, Purpose.argument) for a in args)
    except (TypeError, ValueError):
        return 0, None
    sig = (types.int64, types.int64) + argtypes
    cres = kernel.overloads.get(sig)
    if cres is None:
        kernel.compile(sig)
        cres = kernel.overloads.get(sig)
    if cres is None or cres.objectmode or cres.signature.return_type != types.none:
        return 0, None
    found = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name) or 0
    return found, _ENTRY_HEAD + (typeof(tuple(args), Purpose.argument),)   # (*args: a tuple)


_ENTRY_HEAD = tuple(typeof(a, Purpose.argument) for a in
                    (1, 1, 1, NO_FLAG, np.zeros(STATE_SIZE, np.int64), 1, 1))


# ``first_calls.run`` (set by that module, which imports this one): how an entry's first
# call runs; without it, compiled on the calling thread
first_calls_run = None


_failed = set()     # the entry keys enter could not be compiled for (the Python job runs)


def _entry_ready(entry):
    if entry in _failed:
        return False
    try:
        if first_calls_run is None:
            ready = compile_entry(entry)
        else:
            ready = first_calls_run(("native entry",) + entry, lambda: compile_entry(entry),
                                    lambda: False,
                                    spec=(__name__, "compile_entry", (entry,), None))
    except Exception as error:      # (a Numba that compiles enter differently): never again
        _failed.add(entry)
        warnings.warn(f"numbafuse: compiled launches are off for arguments {entry[7]} "
                      f"({type(error).__name__}: {error}); their launches run as before",
                      RuntimeWarning, stacklevel=3)
        return False
    if ready:
        _ready.add(entry)
    return ready


def compile_entry(entry):
    """Compile (or load from the cache) :func:`enter` for the signature ``entry``; True."""
    enter.compile(entry)
    return True
