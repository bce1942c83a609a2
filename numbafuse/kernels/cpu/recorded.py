"""Prepared calls: a host function's launches recorded once per signature and replayed for
its later calls, without the Python that decided them (docs/architecture.md, "Prepared
calls").

    out = recorded.call(fn, args)    # fn(*args), or its replay once prepared

A fused op's host path (the torch layer, the ops layer, the conv's driver, the batch norm's
setup) decides, from shapes, strides, dtypes and flags alone, which compiled launches and
steps to run on which arrays; at ResNet sizes that Python costs 0.2-0.8 ms a call, as much as
the short kernels it drives. :func:`call` runs ``fn(*args)`` as it is until a *signature*
(``fn`` and the arguments' structure: each array's shape, strides and dtype, every other
value itself, and the thread count) has been seen; the next calls of that signature are
*recorded*: every outermost :func:`~numbafuse.kernels.cpu.launch.launch` (and
``launch_all``, ``concurrently``), every compiled step called from Python (:func:`step`),
every array allocated (the output cache's, ``np.empty``'s, ``np.zeros``'s), with each array
argument written as a *slot* (a view, by byte offset, shape and strides, of one of the call's
input arrays or of one of its allocations), and what ``fn`` returned the same way. Two
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

import hashlib
import os
import threading

import numpy as np

ENABLED = os.environ.get("NUMBAFUSE_PREPARED", "1") != "0"
MAX_SIGNATURES = 4096
SAME_DATA_LIMIT = 8       # recordings on the data the first one had, then refused
ACTIVE = 0                # recordings in progress (any thread): the hooks' fast test

_local = threading.local()
_lock = threading.Lock()
_programs = {}            # signature -> _SEEN, a _Program (ready once checked) or a _Refused
_SEEN = object()
_stats = {"prepared": 0, "replays": 0, "recordings": 0, "refused": {}}
_np_empty, _np_zeros, _np_contiguous = np.empty, np.zeros, np.ascontiguousarray
_np_empty_like, _np_zeros_like, _np_ones = np.empty_like, np.zeros_like, np.ones


class _Refused:
    __slots__ = ("reason",)

    def __init__(self, reason):
        self.reason = reason


def stats():
    """Counts: signatures ``prepared``, calls replayed, ``recordings`` made, and ``refused``
    signatures by reason."""
    return dict(_stats, refused=dict(_stats["refused"]), signatures=len(_programs))


def clear():
    """Forget every signature (the next calls record again) and the counts."""
    with _lock:
        _programs.clear()
        _details.clear()
        _stats.update(prepared=0, replays=0, recordings=0, refused={})


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
    ``np.zeros``, ``np.ones`` and the ``_like`` ones while a recording is on)."""
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


def _empty_like(a, dtype=None, **kwargs):
    if kwargs or not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        return _np_empty_like(a, dtype, **kwargs)     # (not recorded: a replay refuses it)
    return allocated(False, _np_empty, a.shape, a.dtype if dtype is None else dtype)


def _zeros_like(a, dtype=None, **kwargs):
    if kwargs or not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
        return _np_zeros_like(a, dtype, **kwargs)
    return allocated(True, _np_zeros, a.shape, a.dtype if dtype is None else dtype)


def _contiguous(a, dtype=None, **kwargs):
    out = _np_contiguous(a, dtype, **kwargs)
    rec = here()
    if (rec is not None and not rec.depth and isinstance(a, np.ndarray)
            and not np.may_share_memory(out, a)):     # a copy: an allocation and a step
        rec.calls.append(("alloc", False, out, _np_empty, (out.shape, out.dtype), {}))
        rec.calls.append((np.copyto, (out, a.reshape(out.shape)), {}))
    return out


def _start():
    global ACTIVE
    with _lock:
        if ACTIVE == 0:     # (np.empty is looked up at each call by the drivers' modules)
            np.empty, np.zeros, np.ascontiguousarray = _empty, _zeros, _contiguous
            np.empty_like, np.zeros_like, np.ones = _empty_like, _zeros_like, _ones
        ACTIVE += 1
    _local.recording = _Recording()
    return _local.recording


def _stop():
    global ACTIVE
    _local.recording = None
    with _lock:
        ACTIVE -= 1
        if ACTIVE == 0:
            np.empty, np.zeros, np.ascontiguousarray = _np_empty, _np_zeros, _np_contiguous
            np.empty_like, np.zeros_like, np.ones = _np_empty_like, _np_zeros_like, _np_ones


# ------------------------------------------------------------------------- structure

_ARRAY, _ATOM, _SEQ, _NAMED, _DICT, _FIELDS, _DEEP, _OTHER = range(8)
_kinds = {np.ndarray: _ARRAY, tuple: _SEQ, list: _SEQ, dict: _DICT,
          **{c: _ATOM for c in (int, float, str, bool, type(None))}}


def _kind(cls):
    if issubclass(cls, np.ndarray):
        kind = _ARRAY
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        kind = _NAMED
    elif hasattr(cls, "__dataclass_fields__"):                    # (the ops' Params)
        kind = _FIELDS
    else:
        kind = _OTHER
    _kinds[cls] = kind
    return kind


def _key(obj, arrays):
    """The hashable structure of ``obj`` (arrays as their shape, strides and dtype, appended
    to ``arrays``; tuples, lists, dicts, named tuples and dataclasses entered), or raises
    TypeError. (A call's host cost: ~5 us for a Conv-BN-ReLU's arguments.)"""
    cls = type(obj)
    kind = _kinds.get(cls)
    if kind is None:
        kind = _kind(cls)
    if kind == _ATOM:
        return (cls, obj)
    if kind == _ARRAY:
        arrays.append(obj)
        return (obj.shape, obj.strides, obj.dtype)
    if kind == _DEEP:                          # (the ops' Params: the running statistics)
        return (cls,) + _keys(vars(obj).values(), arrays)
    if kind == _NAMED or kind == _FIELDS:
        try:
            hash(obj)                          # (a geometry: no array inside)
            return (cls, obj)
        except TypeError:
            if kind == _FIELDS:                # (an array inside: entered from now on)
                _kinds[cls] = _DEEP
                return (cls,) + _keys(vars(obj).values(), arrays)
    elif kind == _DICT:
        return (dict, tuple(obj)) + _keys(obj.values(), arrays)
    elif kind == _OTHER:
        hash(obj)
        return (cls, obj)
    return (cls,) + _keys(obj, arrays)


def _keys(values, arrays):
    """:func:`_key` of each of ``values``, atoms and arrays inline (the common case)."""
    out = []
    for v in values:
        cls = type(v)
        kind = _kinds.get(cls)
        if kind == _ATOM:
            out.append((cls, v))
        elif kind == _ARRAY:
            arrays.append(v)
            out.append((v.shape, v.strides, v.dtype))
        else:
            out.append(_key(v, arrays))
    return tuple(out)


def _range(a):
    """(lowest byte address, one past the highest) of the array ``a``'s elements."""
    lo = hi = a.__array_interface__["data"][0]
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + a.itemsize


class _Slot:
    """An array of the replay: source ``index`` (inputs, then allocations) whole, or the view
    of it at ``offset`` bytes with ``shape``, ``strides``, ``dtype`` (of a C-contiguous
    source: a reshape, a slice of its flat view reshaped, or any view by NumPy's constructor,
    the fastest that makes it)."""
    __slots__ = ("index", "whole", "offset", "shape", "strides", "dtype", "how", "lo", "hi")

    def __init__(self, index, whole, offset=0, view=None, source=None):
        self.index, self.whole, self.offset, self.how = index, whole, offset, 0
        if not whole:
            a = view
            self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
            if (a.flags.c_contiguous and a.dtype == source.dtype
                    and offset % a.dtype.itemsize == 0):
                self.lo = offset // a.dtype.itemsize
                self.hi = self.lo + a.size
                self.how = 1 if self.lo == 0 and a.size == source.size else 2
            else:
                self.how = 3
        else:
            self.shape = self.strides = self.dtype = None

    def same(self):
        return (self.index, self.whole, self.offset, self.shape, self.strides, self.dtype)

    def make(self, sources):
        a = sources[self.index]
        how = self.how
        if how == 0:
            return a
        if how == 1:
            return a.reshape(self.shape)
        if how == 2:
            return a.reshape(-1)[self.lo:self.hi].reshape(self.shape)
        return np.ndarray(self.shape, self.dtype, buffer=a, offset=self.offset,
                          strides=self.strides)


class _Vacant:
    """An array of no elements: the recorded one, whatever the call (no data to carry)."""
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def same(self):
        return (self.array.shape, self.array.strides, self.array.dtype)

    def make(self, sources):
        return self.array


class _Const:
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class _Node:
    """A container of the replay with a slot inside: rebuilt at each call."""
    __slots__ = ("cls", "keys", "items")

    def __init__(self, cls, keys, items):
        self.cls, self.keys, self.items = cls, keys, items

    def fast(self):
        """The :class:`_Built` that makes this container (what :meth:`_Program.run` calls)."""
        base, dynamic = [], []
        for i, v in enumerate(self.items):
            kind = type(v)
            if kind is _Node:
                v = v.fast()
            if kind is _Const:
                base.append(v.value)
            else:
                base.append(None if kind in (_Slot, _Vacant, _Node) else v)
                if kind in (_Slot, _Vacant, _Node):
                    dynamic.append((i, v))
        return _Built(self.cls, self.keys, base, dynamic)


class _Built:
    """A container made at each call from a list of its constant items (``base``) with the
    slots' arrays put in (``dynamic``: (position, a _Slot, _Vacant or _Built))."""
    __slots__ = ("cls", "keys", "base", "dynamic")

    def __init__(self, cls, keys, base, dynamic):
        self.cls, self.keys, self.base, self.dynamic = cls, keys, base, dynamic

    def make(self, sources):
        values = self.base.copy()
        for i, t in self.dynamic:
            values[i] = t.make(sources)
        cls = self.cls
        if cls is list:
            return values
        if cls is tuple:
            return tuple(values)
        if cls is dict:
            return dict(zip(self.keys, values))
        return cls(*values)                                      # a named tuple


_MADE = (_Slot, _Vacant, _Built)          # what _Program.run makes at each call


def _fast(t):
    """What :meth:`_Program.run` makes from the template ``t``: a constant as it is, else an
    object whose ``make(sources)`` makes it."""
    kind = type(t)
    if kind is _Node:
        return t.fast()
    return t.value if kind is _Const else t


class _Unreplayable(Exception):
    pass


def _template(obj, find):
    """``obj`` with each array replaced by its :class:`_Slot` (``find``) or kept as a
    :class:`_Const` (an array no source holds)."""
    if isinstance(obj, np.ndarray):
        slot = find(obj)
        return _Const(obj) if slot is None else slot            # (a _Slot or _Vacant)
    cls = type(obj)
    named = isinstance(obj, tuple) and hasattr(obj, "_fields")
    if cls is tuple or cls is list or cls is dict or named:
        keys = tuple(obj) if cls is dict else None
        items = [_template(v, find) for v in (obj.values() if cls is dict else obj)]
        if any(type(v) in (_Slot, _Node, _Const, _Vacant) for v in items):
            return _Node(cls, keys, items)
        return obj
    return obj


def _same(a, b):
    """Whether two templates make the same replay (constants: the same object, or equal
    values of one type)."""
    ta, tb = type(a), type(b)
    if ta is not tb:
        return False
    if ta is _Slot or ta is _Vacant:
        return a.same() == b.same()
    if ta is _Const:         # the same array, or equal index tables made from the shapes
        u, v = a.value, b.value
        return u is v or (u.dtype == v.dtype and u.dtype.kind == "i" and u.shape == v.shape
                          and np.array_equal(u, v))
    if ta is _Node:
        return (a.cls is b.cls and a.keys == b.keys and len(a.items) == len(b.items)
                and all(_same(x, y) for x, y in zip(a.items, b.items)))
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and not isinstance(a, np.ndarray):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:                            # noqa: BLE001 (an object without ==)
        return False


class _Program:
    """One recorded call: its allocations, its steps (templates) and its output."""

    def __init__(self, rec, inputs, out):
        self.allocs = []              # (filled, make, its args, its kwargs)
        self.ready, self.digest, self.same_data = False, None, 0
        sources = list(inputs)
        for c in rec.calls:
            if c[0] == "alloc":
                self.allocs.append((c[1], c[3], c[4], c[5]))
                sources.append(c[2])
        spans = [(_range(a), a.flags.c_contiguous) for a in sources]
        ordered = sorted(r for r, _ in spans[:len(inputs)])
        if any(b[0] < a[1] for a, b in zip(ordered, ordered[1:])):
            raise _Unreplayable("inputs that share memory")

        def find(a):
            if a.size == 0:
                return _Vacant(a)
            lo, hi = _range(a)
            for i, ((slo, shi), contiguous) in enumerate(spans):
                if slo <= lo and hi <= shi:
                    s = sources[i]
                    if (a.shape == s.shape and a.strides == s.strides and a.dtype == s.dtype
                            and lo == slo):
                        return _Slot(i, True)
                    if not contiguous or any(st < 0 for st in a.strides):
                        raise _Unreplayable("a view of an array not C-contiguous")
                    return _Slot(i, False, a.__array_interface__["data"][0] - slo, a, s)
            return None

        self.steps = [(fn, _template(list(args), find), _template(dict(kwargs), find))
                      for fn, args, kwargs in (c for c in rec.calls if c[0] != "alloc")]
        self.out = _template(out, find)
        self.fast = [(fn, _fast(args), _fast(kwargs)) for fn, args, kwargs in self.steps]
        self.fast_out = _fast(self.out)

    def same(self, other):
        return (len(self.allocs) == len(other.allocs) and len(self.steps) == len(other.steps)
                and all(a[0] == b[0] and a[1] == b[1] and _same(a[2], b[2])
                        and _same(a[3], b[3]) for a, b in zip(self.allocs, other.allocs))
                and all(a[0] is b[0] and _same(a[1], b[1]) and _same(a[2], b[2])
                        for a, b in zip(self.steps, other.steps))
                and _same(self.out, other.out))

    def run(self, inputs, poison=False):
        sources = list(inputs)
        for filled, make, args, kwargs in self.allocs:
            a = make(*args, **kwargs)
            if poison and not filled:          # (what the replay leaves unwritten shows)
                a.view(np.uint8).fill(0xFF) if a.flags.c_contiguous else a.fill(np.nan)
            sources.append(a)
        made = _MADE
        for fn, args, kwargs in self.fast:
            fn(*(args.make(sources) if type(args) in made else args),
               **(kwargs.make(sources) if type(kwargs) in made else kwargs))
        out = self.fast_out
        return out.make(sources) if type(out) in made else out


def _bits(a):
    return np.ascontiguousarray(a).tobytes()


def _digest(arrays):
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.digest()


def _leaves(obj, arrays):
    """Append the arrays of ``obj`` (a nested output) to ``arrays``."""
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _leaves(v, arrays)
    elif isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, arrays)
    return arrays


_details = []             # (function, why in detail) of the latest refusals


def refusals():
    """The latest refused signatures (at most 64): (the function's name, what was seen)."""
    return list(_details)


def _name(fn):
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


def _difference(a, b):
    """Where two programs differ first (for :func:`refusals`)."""
    if len(a.allocs) != len(b.allocs) or len(a.steps) != len(b.steps):
        return f"{len(a.allocs)}/{len(b.allocs)} allocations, {len(a.steps)}/{len(b.steps)} steps"
    for i, (s, t) in enumerate(zip(a.steps, b.steps)):
        if s[0] is not t[0]:
            return f"step {i}: {_name(s[0])} / {_name(t[0])}"
        for j, (u, v) in enumerate(zip(_flat(s[1]), _flat(t[1]))):
            if not _same(u, v):
                what = (f"an array {u.value.shape} {u.value.dtype} made outside the recording"
                        if type(u) is _Const else repr(u)[:60])
                first = _flat(s[1])[0]
                kernel = f" {_name(first)}" if callable(first) else ""
                return f"step {i} ({_name(s[0])}{kernel}), argument {j}: {what}"
    return "allocations or output"


def _flat(t):
    return t.items if type(t) is _Node else t


def _refuse(sig, reason, detail=""):
    with _lock:
        _programs[sig] = _Refused(reason)
        _stats["refused"][reason] = _stats["refused"].get(reason, 0) + 1
        _details.append((_name(sig[0]), f"{reason}: {detail}" if detail else reason))
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
        program = _Program(rec, inputs, out)
    except _Unreplayable as e:
        _refuse(sig, str(e))
        return out
    if not check:
        program.digest = _digest(inputs)
        with _lock:
            _programs[sig] = program
        return out
    if not program.same(earlier):
        _refuse(sig, "two recordings differ (a closure, or a value from the data)",
                _difference(earlier, program))
        return out
    if _digest(before) == earlier.digest:       # the same data: record a later call again
        earlier.same_data += 1
        if earlier.same_data >= SAME_DATA_LIMIT:
            _refuse(sig, f"the same data in {SAME_DATA_LIMIT} recordings")
        return out
    after = [a.copy() for a in inputs]
    expected = [a.copy() for a in _leaves(out, [])]
    for a, b in zip(inputs, before):
        a[...] = b
    try:
        got = _leaves(program.run(inputs, poison=True), [])
    except Exception as e:                       # noqa: BLE001 (a replay that cannot run)
        for a, b in zip(inputs, after):
            a[...] = b
        _refuse(sig, "the replay failed", f"{type(e).__name__}: {e}")
        return out
    wrong = [f"output {i} {e.shape}" for i, (g, e) in enumerate(zip(got, expected))
             if g.dtype != e.dtype or g.shape != e.shape or _bits(g) != _bits(e)]
    wrong += [f"input {i} {b.shape}" for i, (a, b) in enumerate(zip(inputs, after))
              if _bits(a) != _bits(b)]
    if len(got) != len(expected):
        wrong.append(f"{len(got)}/{len(expected)} outputs")
    for a, b in zip(inputs, after):
        a[...] = b
    if wrong:
        _refuse(sig, "the replay's results differ (work the recording does not see)",
                ", ".join(wrong))
        return out
    with _lock:
        _programs[sig] = program
        program.ready = True
        _stats["prepared"] += 1
    return out


def call(fn, args, context):
    """``fn(*args)`` (a host function of arrays and hashable values, in nested tuples,
    lists, dicts, named tuples and dataclasses): run as it is, recorded, or replayed (module
    docstring). ``context``: hashable, what else ``fn``'s plan depends on (the thread count
    launches use, rules in force)."""
    if not ENABLED or here() is not None:
        return fn(*args)
    inputs = []
    try:
        sig = (fn, context, _key(args, inputs))
    except TypeError:
        return fn(*args)
    state = _programs.get(sig)
    if type(state) is _Program:
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
