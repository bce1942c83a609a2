"""Compiled steps that their callers reach through a slot, not by linking their code in.

Numba compiles a call from one jitted function to another by linking the callee's LLVM
module into the caller's, then optimises and generates machine code for the whole again: a
task kernel pays for the code of every step it calls, once more per kernel (measured on
this machine's 2 cores: a function that does nothing but call ``cpu_winograd._in_hwc``
twice took 1.88 s to compile, ``_in_hwc`` itself 1.48 s). A :class:`Step` is compiled once,
for signatures declared up front (a function of the dtype), and its callers call it
through ``STEP.call((arg, ...))``, an intrinsic that makes an indirect call through the
step's *slot*: an 8-byte global that this process's LLVM JIT knows by name
(``llvmlite.binding.add_symbol``) and that :meth:`Step.ready` fills with the address of
numba's C-ABI wrapper of the compiled step. A caller's code holds only the slot's name, so
it stays cacheable on disk and compiles without the step's code.

Rules:

- A call's argument types must equal one of the step's declared signatures exactly
  (checked when the caller is typed: a TypingError names the declared ones), so the caller
  and the wrapper agree on the machine-level arguments.
- Host code calls :func:`ready` with the dtype before it launches a caller (a dictionary
  lookup once done); a caller that meets an empty slot raises a RuntimeError instead of
  jumping to address 0.
- A step returns nothing and raises nothing (its C wrapper cannot hand an exception back):
  the steps are loops over arrays. A step that calls steps names them (``calls=``), and
  its ``ready`` fills their slots first: an empty slot met inside a step would be reported
  and ignored, not raised.
"""
from __future__ import annotations

import ctypes
import re
import threading

import numpy as np
from llvmlite import binding as ll, ir
from numba import njit, types
from numba.core import cgutils, errors
from numba.extending import intrinsic

_LOCK = threading.Lock()
_SLOTS = {}          # slot name -> its 8 bytes (ctypes), kept for the process's lifetime
_ANY = "any"         # the key of a step whose signatures do not depend on the dtype
_MADE = []           # every Step made in this process (made())


def made():
    """Every :class:`Step` made in this process (the tests empty their slots)."""
    return tuple(_MADE)


def array(f, ndim):
    """The numba type of a C-contiguous ``ndim``-d array of ``f``: what signatures declare."""
    return types.Array(f, ndim, "C")


class Step:
    """``fn`` compiled with ``njit(nogil=True, cache=True)`` for the signatures
    ``signatures(numba_float_type)`` returns (argument type tuples) at float32 and float64
    (``per_dtype=False``: ``signatures(None)``, one set for every dtype), each with a slot
    its callers call through (see the module docstring)."""

    def __init__(self, fn, signatures, per_dtype=True, calls=()):
        self.dispatcher = njit(nogil=True, cache=True)(fn)
        self.calls = tuple(calls)       # the steps this one calls: ready() fills them first
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.per_dtype = per_dtype
        self.slots_of = {}                      # dtype key -> [(argument types, slot, name)]
        for ftype in (types.float32, types.float64) if per_dtype else (None,):
            entries = self.slots_of[str(ftype) if per_dtype else _ANY] = []
            for i, argtypes in enumerate(signatures(ftype)):
                # a name fixed by the step and the signature's place, never by import order:
                # a kernel loaded from the disk cache in another process finds its slot by it
                symbol = re.sub(r"\W", "_", f"numbafuse_step.{self.name}.{ftype}.{i}")
                slot = _SLOTS.get(symbol)
                if slot is None:        # (a module made again, e.g. reloaded, keeps its slots:
                    slot = _SLOTS[symbol] = ctypes.c_void_p(0)   # callers hold their address)
                    ll.add_symbol(symbol, ctypes.addressof(slot))
                entries.append((tuple(argtypes), slot, symbol))
        self._ready = set()
        self.call = _caller(self)
        _MADE.append(self)

    @property
    def slots(self):
        """Every (argument types, slot, name), all dtypes."""
        return [entry for entries in self.slots_of.values() for entry in entries]

    def ready(self, dtype=None):
        """Compile (or load from the disk cache) this step's signatures of ``dtype`` and fill
        their slots."""
        self._fill(_key(dtype))

    def _fill(self, key):
        key = key if self.per_dtype else _ANY
        if key in self._ready:                  # (every call after the first: host hot path)
            return
        for step in self.calls:         # (an empty slot met inside a step cannot raise:
            step._fill(key)             # the step's C wrapper drops the exception)
        with _LOCK:
            if key in self._ready:
                return
            for argtypes, slot, _ in self.slots_of[key]:
                self.dispatcher.compile(argtypes)
                slot.value = _wrapper_address(self.dispatcher, argtypes)
            self._ready.add(key)


def ready(dtype, steps):
    """:meth:`Step.ready` of each of ``steps`` (``dtype`` None: steps that take any)."""
    key = _key(dtype)
    for step in steps:
        step._fill(key)


def _key(dtype):
    key = _KEYS.get(dtype)                      # (the host path: a dictionary lookup)
    if key is None:
        key = _ANY if dtype is None else str(
            types.float64 if np.dtype(dtype) == np.float64 else types.float32)
        if len(_KEYS) < 64:                 # (dtypes, their type objects and names: few)
            _KEYS[dtype] = key
    return key


_KEYS = {}           # dtype (a NumPy dtype, its type or name, or None) -> its slots' key


def _wrapper_address(dispatcher, argtypes):
    """The address of numba's C-ABI wrapper of ``dispatcher`` compiled for ``argtypes``
    (what numba's first-class function types call: ``numba.experimental.function_type``)."""
    cres = dispatcher.overloads[argtypes]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)


def _caller(step):
    """The intrinsic ``call((arg, ...))`` of ``step``."""
    @intrinsic
    def call(typingctx, args):
        if not isinstance(args, types.BaseTuple):
            raise errors.TypingError(f"{step.name}.call takes one tuple of arguments")
        given = tuple(types.unliteral(a) for a in args)    # a literal 0 passes as int64
        found = [(a, s) for a, _, s in step.slots if a == given]
        if not found:
            declared = "; ".join(str(a) for a, _, _ in step.slots)
            raise errors.TypingError(f"{step.name}: no declared signature is {given} "
                                     f"(declared: {declared})")
        argtypes, symbol = found[0]

        def codegen(context, builder, signature, llargs):
            values = [builder.extract_value(llargs[0], i) for i in range(len(argtypes))]
            fnty = ir.FunctionType(context.get_value_type(types.none),
                                   [context.get_value_type(t) for t in argtypes])
            module = builder.module
            slot = module.globals.get(symbol)
            if slot is None:
                slot = ir.GlobalVariable(module, fnty.as_pointer(), symbol)
                slot.linkage = "external"
            fn = builder.load(slot)
            with cgutils.if_unlikely(builder, cgutils.is_null(builder, fn)):
                context.call_conv.return_user_exc(
                    builder, RuntimeError, (f"numbafuse: step {step.name} was called before "
                                            f"its ready() (kernels/cpu/steps.py)",))
            builder.call(fn, values)
            return context.get_dummy_value()
        return types.none(args), codegen
    return call
