"""What a prepared call's recording is made into (``recorded.py``): a call's signature
(:func:`key`), its arrays as slots (:class:`Slot`: a view of one of the call's inputs or
allocations), the templates of its steps' arguments and its output, and the
:class:`Program` that replays them; how two programs compare (:func:`same`, and where they
differ first, :func:`difference`)."""
import hashlib
import threading

import numpy as np

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


def key(obj, arrays):
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
            out.append(key(v, arrays))
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


class Slot:
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
        """The :class:`_Built` that makes this container (what :meth:`Program.run` calls)."""
        base, dynamic = [], []
        for i, v in enumerate(self.items):
            kind = type(v)
            if kind is _Const:
                base.append(v.value)
            elif kind is _Vacant:
                base.append(v.array)
            elif kind in (Slot, _Node):
                base.append(None)
                dynamic.append((i, v.fast() if kind is _Node else v))
            else:
                base.append(v)
        return _Built(self.cls, self.keys, base, dynamic)


class _Built:
    """A container made at each call from a list of its constant items (``base``) with the
    slots' arrays put in (``dynamic``: (position, a Slot or _Built); a :class:`_Vacant`'s
    array is a constant)."""
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


_MADE = (Slot, _Built)                   # what Program.run makes at each call


def _fast(t):
    """What :meth:`Program.run` makes from the template ``t``: a constant as it is, else an
    object whose ``make(sources)`` makes it."""
    kind = type(t)
    if kind is _Node:
        return t.fast()
    if kind is _Vacant:
        return t.array
    return t.value if kind is _Const else t


def _folded(t, kept, top=False):
    """``t`` (what :func:`_fast` made) with the slots of the sources in ``kept`` (a list by
    source index: the array kept from one run to the next, or None) made once: a constant
    where nothing is left to make at a call (a tuple or named tuple; ``top``: the step's
    argument list or keyword dict, which the call unpacks), else a :class:`_Built` with
    fewer slots. A list or dict inside is made again at each call (a step may change it)."""
    kind = type(t)
    if kind is Slot:
        return t.make(kept) if kept[t.index] is not None else t
    if kind is not _Built:
        return t
    base, dynamic = t.base.copy(), []
    for i, d in t.dynamic:
        v = _folded(d, kept)
        if type(v) in _MADE:
            dynamic.append((i, v))
        else:
            base[i] = v
    built = _Built(t.cls, t.keys, base, dynamic)
    if not dynamic and (top or t.cls not in (list, dict)):
        return built.make(kept)
    return built


class Unreplayable(Exception):
    pass


def _template(obj, find):
    """``obj`` with each array replaced by its :class:`Slot` (``find``) or kept as a
    :class:`_Const` (an array no source holds)."""
    if isinstance(obj, np.ndarray):
        slot = find(obj)
        return _Const(obj) if slot is None else slot            # (a Slot or _Vacant)
    cls = type(obj)
    kind = _kinds.get(cls)
    if kind is None:
        kind = _kind(cls)
    if kind == _SEQ or kind == _DICT or kind == _NAMED:       # (as :func:`key` enters them)
        keys = tuple(obj) if cls is dict else None
        items = [_template(v, find) for v in (obj.values() if cls is dict else obj)]
        if any(type(v) in (Slot, _Node, _Const, _Vacant) for v in items):
            return _Node(cls, keys, items)
        return obj
    return obj


def same(a, b):
    """Whether two templates make the same replay (constants: the same object, or equal
    values of one type)."""
    ta, tb = type(a), type(b)
    if ta is not tb:
        return False
    if ta is Slot or ta is _Vacant:
        return a.same() == b.same()
    if ta is _Const:         # the same array, or equal index tables made from the shapes
        u, v = a.value, b.value
        return u is v or (u.dtype == v.dtype and u.dtype.kind == "i" and u.shape == v.shape
                          and np.array_equal(u, v))
    if ta is _Node:
        return (a.cls is b.cls and a.keys == b.keys and len(a.items) == len(b.items)
                and all(same(x, y) for x, y in zip(a.items, b.items)))
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and not isinstance(a, np.ndarray):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:                            # noqa: BLE001 (an object without ==)
        return False


class Program:
    """One recorded call: its allocations, its steps (templates) and its output."""

    def __init__(self, rec, inputs, out):
        self.allocs = []              # (filled, make, its args, its kwargs)
        self.ready, self.digest, self.same_data = False, None, 0
        self.inputs, self.kept = len(inputs), None
        sources = list(inputs)
        for c in rec.calls:
            if c[0] == "alloc":
                self.allocs.append((c[1], c[3], c[4], c[5]))
                sources.append(c[2])
        spans = [(_range(a), a.flags.c_contiguous) for a in sources]
        ordered = sorted(r for r, _ in spans[:len(inputs)])
        if any(b[0] < a[1] for a, b in zip(ordered, ordered[1:])):
            raise Unreplayable("inputs that share memory")

        def find(a):
            if a.size == 0:
                return _Vacant(a)
            lo, hi = _range(a)
            for i, ((slo, shi), contiguous) in enumerate(spans):
                if slo <= lo and hi <= shi:
                    s = sources[i]
                    if (a.shape == s.shape and a.strides == s.strides and a.dtype == s.dtype
                            and lo == slo):
                        return Slot(i, True)
                    if not contiguous or any(st < 0 for st in a.strides):
                        raise Unreplayable("a view of an array not C-contiguous")
                    return Slot(i, False, a.__array_interface__["data"][0] - slo, a, s)
            return None

        self.steps = [(fn, _template(list(args), find), _template(dict(kwargs), find))
                      for fn, args, kwargs in (c for c in rec.calls if c[0] != "alloc")]
        self.out = _template(out, find)
        self.fast = [(fn, _fast(args), _fast(kwargs)) for fn, args, kwargs in self.steps]
        self.fast_out = _fast(self.out)

    def same(self, other):
        return (len(self.allocs) == len(other.allocs) and len(self.steps) == len(other.steps)
                and all(a[0] == b[0] and a[1] == b[1] and same(a[2], b[2])
                        and same(a[3], b[3]) for a, b in zip(self.allocs, other.allocs))
                and all(a[0] is b[0] and same(a[1], b[1]) and same(a[2], b[2])
                        for a, b in zip(self.steps, other.steps))
                and same(self.out, other.out))

    def escaping(self):
        """The indices of the sources the output holds (itself or a view of it)."""
        found, todo = set(), [self.out]
        while todo:
            t = todo.pop()
            if type(t) is Slot:
                found.add(t.index)
            elif type(t) is _Node:
                todo.extend(t.items)
        return found

    def keep_scratch(self, limit):
        """Keep this program's small scratch from one run to the next (:class:`Kept`): each
        allocation that the output does not hold, that its maker leaves unset (``np.empty``'s;
        the check ran with them filled with 0xFF: no run reads what an earlier one left) and
        that has at most ``limit`` bytes (``recorded.SCRATCH_BYTES``), allocated once here,
        with every step argument cut from it made once. Returns the bytes kept."""
        out, sources = self.escaping(), [None] * (self.inputs + len(self.allocs))
        for i, (filled, make, args, kwargs) in enumerate(self.allocs):
            n = self.inputs + i
            if filled or n in out:
                continue
            a = make(*args, **kwargs)
            if a.nbytes <= limit and a.ndim and a.flags.c_contiguous:
                a.view(np.uint8).fill(0xFF)      # (as the check's fresh arrays: poisoned)
                sources[n] = a
        if not any(a is not None for a in sources):
            return 0
        self.kept = Kept(self, sources)
        return self.kept.nbytes

    def run(self, inputs, poison=False):
        kept = self.kept
        if kept is not None and not poison and kept.free.acquire(blocking=False):
            try:                            # (another thread replaying it: arrays of its own)
                return self.run_kept(inputs)
            finally:
                kept.free.release()
        return _run(inputs, self.allocs, self.fast, self.fast_out, poison)

    def run_kept(self, inputs):
        """:meth:`run` with the scratch kept, whoever else uses it (the check's: the program
        is not in use yet)."""
        return _run(inputs, self.kept.allocs, self.kept.fast, self.fast_out)


class Kept:
    """A :class:`Program`'s run with its small scratch kept (:meth:`Program.keep_scratch`):
    ``allocs`` (an array kept, or what makes one at each call), the steps with the kept
    arrays' slots made once (the output holds none: the program's own), ``free`` held by the
    run that uses them."""

    def __init__(self, program, sources):
        self.allocs = [a if a is not None else program.allocs[i]
                       for i, a in enumerate(sources[program.inputs:])]
        self.nbytes = sum(a.nbytes for a in sources if a is not None)
        self.fast = [(fn, _folded(args, sources, True), _folded(kwargs, sources, True))
                     for fn, args, kwargs in program.fast]
        self.free = threading.Lock()


def _run(inputs, allocs, steps, out, poison=False):
    """The replay: the call's allocations (or arrays kept, :class:`Kept`), its steps on
    their arguments made from ``inputs`` and them, its output."""
    sources = list(inputs)
    for alloc in allocs:
        if type(alloc) is np.ndarray:
            sources.append(alloc)
            continue
        filled, make, args, kwargs = alloc
        a = make(*args, **kwargs)
        if poison and not filled:              # (what the replay leaves unwritten shows)
            a.view(np.uint8).fill(0xFF) if a.flags.c_contiguous else a.fill(np.nan)
        sources.append(a)
    made = _MADE
    for fn, args, kwargs in steps:
        fn(*(args.make(sources) if type(args) in made else args),
           **(kwargs.make(sources) if type(kwargs) in made else kwargs))
    return out.make(sources) if type(out) in made else out


def bits(a):
    return np.ascontiguousarray(a).tobytes()


def digest(arrays):
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.digest()


def leaves(obj, arrays):
    """Append the arrays of ``obj`` (a nested output) to ``arrays``."""
    if isinstance(obj, np.ndarray):
        arrays.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            leaves(v, arrays)
    elif isinstance(obj, dict):
        for v in obj.values():
            leaves(v, arrays)
    return arrays



def name(fn):
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))


def difference(a, b):
    """Where two programs differ first (for :func:`refusals`)."""
    if len(a.allocs) != len(b.allocs) or len(a.steps) != len(b.steps):
        return f"{len(a.allocs)}/{len(b.allocs)} allocations, {len(a.steps)}/{len(b.steps)} steps"
    for i, (s, t) in enumerate(zip(a.steps, b.steps)):
        if s[0] is not t[0]:
            return f"step {i}: {name(s[0])} / {name(t[0])}"
        for j, (u, v) in enumerate(zip(_flat(s[1]), _flat(t[1]))):
            if not same(u, v):
                what = (f"an array {u.value.shape} {u.value.dtype} made outside the recording"
                        if type(u) is _Const else repr(u)[:60])
                first = _flat(s[1])[0]
                kernel = f" {name(first)}" if callable(first) else ""
                return f"step {i} ({name(s[0])}{kernel}), argument {j}: {what}"
    return "allocations or output"


def _flat(t):
    return t.items if type(t) is _Node else t
