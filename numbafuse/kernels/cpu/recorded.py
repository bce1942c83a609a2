"""Prepared calls: a host function's launches recorded once per signature and replayed for
its later calls, without the Python that decided them (docs/architecture.md, "Prepared
calls").

    out = recorded.call(fn, args, context)    # fn(*args), or its replay once prepared

A fused op's host path (the torch layer, the ops layer, the conv's driver, the batch norm's
setup) decides, from shapes, strides, dtypes and flags alone, which compiled launches and
steps to run on which arrays; at ResNet sizes that Python costs 0.2-0.8 ms a call, as much as
the short kernels it drives. :func:`call` runs ``fn(*args)`` as it is until a *signature*
(``fn``, the ``context`` its plan depends on, and the arguments' structure: each array's
shape, strides and dtype, every other value itself) has been seen; the next calls of that
signature are *recorded*: every outermost :func:`~numbafuse.kernels.cpu.launch.launch` (and
``launch_all``; ``concurrently``'s calls one after another), every compiled step and copy
called from Python between launches (:func:`step`, :func:`copy`), every array allocated
(the output cache's; ``np.empty``, ``np.zeros``, ``np.ones``, ``np.full``, their ``_like``s
and the copies ``np.ascontiguousarray`` makes, replaced on the recording thread only), with
each array argument written as a *slot* (a view, by byte offset, shape and strides, of one of
the call's input arrays or of one of its allocations), and what ``fn`` returned the same way. Two
recordings of calls whose inputs differ must make the same program, which is then checked:
run as a replay on the second call's inputs (restored to what they were before it), its
fresh arrays filled with 0xFF bytes (NaN), it must give bit for bit the outputs and the input
writes (running statistics) the call made. Then the signature is *prepared*: its later calls
make their allocations and run the recorded launches and steps in order, on views cut from
their own arrays, and return the recorded output structure.

What makes a signature stay on the layered path (``stats()["refused"]`` says why): an
argument of a launch that is not an array and differs between the two recordings (a Python
closure such as ``concurrently``'s; a value computed from data), an array the call did not
allocate and that is not the same object both times (NumPy's own copies), an output or
input write the replay does not reproduce (NumPy work between launches, which the recording
does not see), or a source that ``taint`` marks (the weight cache: a hit returns arrays of
an earlier call). A call on a thread while a kernel of it still compiles
(``first_calls``' NumPy fallback) is not recorded (it is recorded later). The replay trusts
that the host path decides from the signature alone: the recordings' check finds a value
that differs with the data, not one that would differ only with other data than those two
calls had. ``NUMBAFUSE_PREPARED=0`` turns prepared calls off.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from .programs import (Program, Unreplayable, bits, difference, digest, key, leaves,
                       name)

ENABLED = os.environ.get("NUMBAFUSE_PREPARED", "1") != "0"
MAX_SIGNATURES = 4096
SAME_DATA_LIMIT = 8       # recordings on the data the first one had, then refused
# a prepared program keeps its scratch arrays up to this size (0: none): what a replay saves
# is a count (an allocation, its views), not bytes; at 4 KiB a fused ResNet-18 keeps 95 of the
# 164 it could keep at 64 KiB in 146 KB (2.2 MB), ResNet-50 117 of 223 in 197 KB (3.4 MB)
SCRATCH_BYTES = 4096
ACTIVE = 0                # recordings in progress (any thread): the hooks' fast test

_local = threading.local()
_lock = threading.Lock()
_programs = {}            # signature -> _SEEN, a Program (ready once checked) or a _Refused
_SEEN = object()
_stats = {"prepared": 0, "replays": 0, "recordings": 0, "refused": {}, "scratch bytes": 0,
          "scratch refused": 0}
# NumPy's allocators, replaced by the recording's own (_REPLACEMENTS) while one is on
_NUMPY = {n: getattr(np, n) for n in ("empty", "zeros", "ones", "full", "empty_like",
                                      "zeros_like", "ascontiguousarray")}
_np_empty, _np_zeros, _np_ones = _NUMPY["empty"], _NUMPY["zeros"], _NUMPY["ones"]


class _Refused:
    __slots__ = ("reason",)

    def __init__(self, reason):
        self.reason = reason


def stats():
    """Counts: signatures ``prepared``, calls replayed, ``recordings`` made, and ``refused``
    signatures by reason."""
    return dict(_stats, refused=dict(_stats["refused"]), signatures=len(_programs))


@contextlib.contextmanager
def off():
    """Within the block, prepared calls are off (every call takes the layered path: what a
    wrapper of its functions sees, what a change of a module's knob changes)."""
    global ENABLED
    enabled, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = enabled


def clear():
    """Forget every signature (the next calls record again) and the counts."""
    with _lock:
        _programs.clear()
        _details.clear()
        _stats.update({"prepared": 0, "replays": 0, "recordings": 0, "refused": {},
                       "scratch bytes": 0, "scratch refused": 0})


# ------------------------------------------------------------------------- the hooks

class _Recording:
    def __init__(self):
        self.calls = []           # (fn, args, kwargs) or ("alloc", filled, array, make, ...)
        self.depth = 0
        self.tainted = None       # why the recording cannot be replayed, or None
        self.transient = False    # ... and whether a later recording may succeed


def here():
    """The recording in progress on this thread, or None."""
    return getattr(_local, "recording", None)


def recorded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: recorded as one step when a recording is on at this depth
    (the hook of ``launch``, ``launch_all`` and ``concurrently``; callers test ``ACTIVE``
    first)."""
    rec = here()
    if rec is None or rec.depth:
        return fn(*args, **kwargs)
    rec.calls.append((fn, args, kwargs))
    rec.depth += 1
    try:
        return fn(*args, **kwargs)
    finally:
        rec.depth -= 1


def step(fn, *args):
    """Call the compiled step ``fn(*args)`` from host code between launches (a statistics
    merge, a running-statistics update): recorded as a launch is."""
    if ACTIVE:
        return recorded(fn, *args)
    return fn(*args)


def copy(out, a):
    """``out`` after ``np.copyto(out, a)`` (NumPy's casts), a step as :func:`step`'s: the
    copies between launches a prepared call must make again."""
    step(np.copyto, out, a)
    return out


def joined(a, b):
    """``np.concatenate((a, b))`` of the 1-d ``a`` and ``b`` (an array of a's length, or a
    number repeated), by :func:`copy` steps."""
    n = a.shape[0]
    out = np.empty(2 * n, a.dtype)
    copy(out[:n], a)
    copy(out[n:], b)
    return out


def outermost():
    """Whether a recording is on on this thread, outside any recorded step."""
    rec = here()
    return rec is not None and rec.depth == 0


def allocated(filled, make, *args, **kwargs):
    """``make(*args, **kwargs)``, a fresh array (its values set by ``make``: ``filled``),
    recorded as one of the call's allocations (the output cache's hook; ``np.empty``,
    ``np.zeros``, ``np.ones``, ``np.full`` and the ``_like`` ones while a recording is on)."""
    rec = here()
    if rec is None or rec.depth:
        return make(*args, **kwargs)
    rec.depth += 1
    try:
        out = make(*args, **kwargs)
    finally:
        rec.depth -= 1
    rec.calls.append(("alloc", filled, out, make, args, kwargs))
    return out


def taint(reason, transient=False):
    """Mark the recording in progress on this thread (if any) as not replayable: it used
    state no slot can carry (``reason`` says which). ``transient``: a later call may be
    recorded instead (a kernel still compiling)."""
    rec = here()
    if rec is not None and rec.tainted is None:
        rec.tainted, rec.transient = reason, transient


def _empty(*args, **kwargs):
    return allocated(False, _np_empty, *args, **kwargs)


def _zeros(*args, **kwargs):
    return allocated(True, _np_zeros, *args, **kwargs)


def _ones(*args, **kwargs):
    return allocated(True, _np_ones, *args, **kwargs)


def _full(*args, **kwargs):
    return allocated(True, _NUMPY["full"], *args, **kwargs)


def _like(filled, make, original):
    """The recording's ``np.empty_like`` (``np.zeros_like``): ``make`` of a C-contiguous
    prototype's shape, recorded; ``original`` otherwise (not recorded: a replay refuses
    it)."""
    def like(a, dtype=None, **kwargs):
        if kwargs or not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
            return original(a, dtype, **kwargs)
        return allocated(filled, make, a.shape, a.dtype if dtype is None else dtype)
    return like


def _contiguous(a, dtype=None, **kwargs):
    out = _NUMPY["ascontiguousarray"](a, dtype, **kwargs)
    rec = here()
    if (rec is not None and not rec.depth and isinstance(a, np.ndarray)
            and not np.may_share_memory(out, a)):     # a copy: an allocation and a step
        rec.calls.append(("alloc", False, out, _np_empty, (out.shape, out.dtype), {}))
        rec.calls.append((np.copyto, (out, a.reshape(out.shape)), {}))
    return out


_REPLACEMENTS = {"empty": _empty, "zeros": _zeros, "ones": _ones, "full": _full,
                 "empty_like": _like(False, _np_empty, _NUMPY["empty_like"]),
                 "zeros_like": _like(True, _np_zeros, _NUMPY["zeros_like"]),
                 "ascontiguousarray": _contiguous}


def _start():
    global ACTIVE
    with _lock:
        if ACTIVE == 0:     # (np.empty is looked up at each call by the drivers' modules)
            for name, fn in _REPLACEMENTS.items():
                setattr(np, name, fn)
        ACTIVE += 1
    _local.recording = _Recording()
    return _local.recording


def _stop():
    global ACTIVE
    _local.recording = None
    with _lock:
        ACTIVE -= 1
        if ACTIVE == 0:
            for name, fn in _NUMPY.items():
                setattr(np, name, fn)


_details = []             # (function, why in detail) of the latest refusals


def refusals():
    """The latest refused signatures (at most 64): (the function's name, what was seen)."""
    return list(_details)


def _refuse(sig, reason, detail=""):
    with _lock:
        _programs[sig] = _Refused(reason)
        _stats["refused"][reason] = _stats["refused"].get(reason, 0) + 1
        _details.append((name(sig[0]), f"{reason}: {detail}" if detail else reason))
        del _details[:-64]


def _record(sig, fn, args, inputs, earlier):
    """``fn(*args)``, recorded: the signature's state moves on (module docstring)."""
    check = earlier is not None
    if check:
        before = [a.copy() for a in inputs]
    rec = _start()
    try:
        out = fn(*args)
    finally:
        _stop()
    _stats["recordings"] += 1
    if rec.tainted is not None:
        if rec.transient:
            return out
        _refuse(sig, rec.tainted)
        return out
    try:
        program = Program(rec, inputs, out)
    except Unreplayable as e:
        _refuse(sig, str(e))
        return out
    if not check:
        program.digest = digest(inputs)
        with _lock:
            _programs[sig] = program
        return out
    if not program.same(earlier):
        _refuse(sig, "two recordings differ (a closure, or a value from the data)",
                difference(earlier, program))
        return out
    if digest(before) == earlier.digest:       # the same data: record a later call again
        earlier.same_data += 1
        if earlier.same_data >= SAME_DATA_LIMIT:
            _refuse(sig, f"the same data in {SAME_DATA_LIMIT} recordings")
        return out
    after = [a.copy() for a in inputs]
    expected = [a.copy() for a in leaves(out, [])]
    wrong = _replayed(lambda a: program.run(a, poison=True), inputs, before, after, expected)
    if wrong:
        _refuse(sig, *wrong)
        return out
    if SCRATCH_BYTES:
        try:
            kept = program.keep_scratch(SCRATCH_BYTES)              # (poisoned: checked)
        except Exception:                        # noqa: BLE001 (made at each call instead)
            kept = None
        if kept is None or kept and _replayed(program.run_kept, inputs, before, after,
                                               expected):
            program.kept = None                  # (a bug, if ever)
            _stats["scratch refused"] += 1
    with _lock:
        _programs[sig] = program
        program.ready = True
        _stats["prepared"] += 1
        _stats["scratch bytes"] += program.kept.nbytes if program.kept is not None else 0
    return out


def _replayed(run, inputs, before, after, expected):
    """None if ``run(inputs)`` (a replay, its fresh arrays poisoned) on ``inputs`` restored to
    ``before`` gives the ``expected`` outputs and leaves the inputs as ``after``, bit for bit;
    else (the reason, what differed). The inputs are left as ``after``."""
    for a, b in zip(inputs, before):
        a[...] = b
    try:
        got = leaves(run(inputs), [])
    except Exception as e:                       # noqa: BLE001 (a replay that cannot run)
        for a, b in zip(inputs, after):
            a[...] = b
        return "the replay failed", f"{type(e).__name__}: {e}"
    wrong = [f"output {i} {e.shape}" for i, (g, e) in enumerate(zip(got, expected))
             if g.dtype != e.dtype or g.shape != e.shape or bits(g) != bits(e)]
    wrong += [f"input {i} {b.shape}" for i, (a, b) in enumerate(zip(inputs, after))
              if bits(a) != bits(b)]
    if len(got) != len(expected):
        wrong.append(f"{len(got)}/{len(expected)} outputs")
    for a, b in zip(inputs, after):
        a[...] = b
    if wrong:
        return "the replay's results differ (work the recording does not see)", ", ".join(wrong)
    return None


def call(fn, args, context):
    """``fn(*args)`` (a host function of arrays and hashable values, in nested tuples,
    lists, dicts, named tuples and dataclasses): run as it is, recorded, or replayed (module
    docstring). ``context``: hashable, what else ``fn``'s plan depends on (the thread count
    launches use, rules in force)."""
    if not ENABLED or here() is not None:
        return fn(*args)
    inputs = []
    try:
        sig = (fn, context, key(args, inputs))
    except TypeError:
        return fn(*args)
    state = _programs.get(sig)
    if type(state) is Program:
        if getattr(state, "ready", False):
            _stats["replays"] += 1
            return state.run(inputs)
        return _record(sig, fn, args, inputs, state)
    if state is None:
        if len(_programs) < MAX_SIGNATURES:
            with _lock:
                _programs.setdefault(sig, _SEEN)
        return fn(*args)
    if state is _SEEN:
        if any(not a.flags.writeable for a in inputs):
            _refuse(sig, "a read-only input")
            return fn(*args)
        return _record(sig, fn, args, inputs, None)
    return fn(*args)                           # refused
