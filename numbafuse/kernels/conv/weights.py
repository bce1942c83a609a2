"""Arrays the CPU conv passes derive from a weight (its transposes, the Winograd taps), kept
while the weight is unchanged, where a caller vouches for that.

    with enabled():                 # the user: weights change only in ways versions see
        with vouch(w, *owners):     # the caller: w's contents are a function of the owners'
            conv_forward(x, w, ...) # inside, derived(w, kind, make) -> make() or the cached one

A pass reorders w every call: an im2col GEMM over NHWC rows wants (K, R*S*C), the phase and
implicit passes (R*S, ...), Winograd its transformed taps. At ResNet-18's deepest layers that
is a 9.4 MB transpose (1.36 ms, bound by memory) per 3x3 512 -> 512 conv, every call: ~6 ms of
a 47 ms eval forward at batch 16, 64x64 on machine A, done again by the recompute in backward
(ResNet-18 eval forward 49.4 -> 36.5 ms with the cache, 96 MB of derived arrays held).

Off unless asked for: ``enabled()`` (``numbafuse.torch.weight_cache()``). A torch tensor's
version counter does not see every change: writes through ``w.data`` (``p.data.clamp_()``,
an old-style EMA or weight clipping) or through a NumPy view leave it as it was (checked:
``w.data.mul_(2)`` and ``w.detach().numpy()[:] = 5`` did not bump ``w._version``; an
optimizer step, ``torch.no_grad()`` in-place ops, ``load_state_dict`` and ``nn.init`` did).
Caching by version alone would then return arrays of the old weights, silently, so the user
opts in for code that changes weights only in the ways the counter sees.

NumPy arrays carry no version, so nothing is cached unless the caller vouches: ``vouch(w,
*owners)`` states that w's contents are a function of the owners' data at their ``_version``s
(torch tensors: every in-place change, an optimizer step included, bumps it): the weight's
tensor, and for a batch norm folded into it (inference) its four tensors too, through
``vouch_like`` for the folded array. ``derived`` keys its cache on w's address, shape, dtype
and the kind, and keeps the owners (weak references) and versions that made each entry: a hit
needs the same live owners at the same versions. One entry per (weight, kind): a new version
replaces the old; entries of dead owners are dropped when the next entry is stored. At most
``MAX_BYTES`` in all: when full, a new array is not kept (what is kept stays). Evicting the
least recently used instead thrashed: a fused ResNet-18 and ResNet-50, each trained and
served in one process (~280 MB of arrays, used in a cycle), missed on every call and ran
their cached eval slower than without the cache (44.8 against 39.9 ms, ResNet-18).
"""
import contextlib
import contextvars
import weakref

from ..cpu import recorded as _recorded

MAX_BYTES = 256 << 20          # derived arrays kept in all (ResNet-18's weights: 45 MB)

_ENABLED = contextvars.ContextVar("numbafuse_conv_weight_cache", default=False)
_VOUCHED = contextvars.ContextVar("numbafuse_conv_vouched_weights", default=())
_CACHE = {}                    # (address, shape, dtype, kind) -> (owner refs, versions, value)
_stats = {"hits": 0, "misses": 0, "bytes": 0, "refused": 0}


def is_enabled():
    """Whether :func:`vouch` caches in this thread and context (:func:`enabled`)."""
    return _ENABLED.get()


@contextlib.contextmanager
def enabled(on=True):
    """Within the block (this thread and context), :func:`vouch` caches (``on``) or not; the
    cache itself is kept across blocks (``clear`` empties it)."""
    token = _ENABLED.set(bool(on))
    try:
        yield
    finally:
        _ENABLED.reset(token)


_NOTHING = contextlib.nullcontext()     # the block of a call that vouches for nothing


def vouch(w, *owners):
    """Within the block, arrays derived from the NumPy array ``w`` may be cached: its contents
    are a function of the ``owners``' data alone (objects with an int ``_version`` that changes
    whenever their data does, weak-referenceable: torch tensors; None ones are skipped), at
    their versions now. ``w`` None or not a host array: nothing vouched. (Cache off, the
    default: a shared no-op block, no generator: every fused call enters one.)"""
    if not _ENABLED.get():
        return _NOTHING
    address = getattr(getattr(w, "ctypes", None), "data", None)
    if address is None:
        return _NOTHING
    owners = [o for o in owners if o is not None]
    return _vouching((address, w.shape, w.dtype.str, tuple(weakref.ref(o) for o in owners),
                      tuple(o._version for o in owners)))


@contextlib.contextmanager
def _vouching(entry):
    token = _VOUCHED.set(_VOUCHED.get() + (entry,))
    try:
        yield
    finally:
        _VOUCHED.reset(token)


@contextlib.contextmanager
def vouch_like(new, base):
    """Within the block, ``new`` (an array made from ``base``, e.g. a cached fold of it) is
    vouched for by ``base``'s owners, where ``base`` is vouched for."""
    seen = _vouched(base)
    address = getattr(getattr(new, "ctypes", None), "data", None)
    if seen is None or address is None:
        yield
        return
    token = _VOUCHED.set(_VOUCHED.get() + ((address, new.shape, new.dtype.str) + seen,))
    try:
        yield
    finally:
        _VOUCHED.reset(token)


def _vouched(w):
    vouched = _VOUCHED.get()
    if not vouched:                 # (the cache off: w's address not asked, ~5 us cold)
        return None
    address = getattr(getattr(w, "ctypes", None), "data", None)
    for a, shape, dtype, refs, versions in vouched:
        if a == address and shape == w.shape and dtype == w.dtype.str:
            # a call recorded for a prepared call would replay a hit's arrays of an earlier
            # weight as constants (kernels/cpu/recorded.py): it stays layered
            _recorded.taint("the weight cache")
            return refs, versions
    return None


def _alive(refs):
    owners = tuple(r() for r in refs)
    return None if any(o is None for o in owners) else owners


def derived(w, kind, make):
    """``make()``, derived from ``w`` (read only by the caller; any value, an array or a tuple
    of arrays), or what it made before for this ``kind`` (hashable) if w is vouched for and
    its owners are the same objects at the same versions since."""
    if _vouched(w) is None:
        return make()
    kept = peek(w, kind)
    if kept is not None:
        return kept
    out = make()
    put(w, kind, out)
    return out


def peek(w, kind):
    """What :func:`derived` would return from the cache for ``w`` and ``kind`` (a hit,
    counted), or None: not cached, not vouched for, or changed since."""
    seen = _vouched(w)
    if seen is None:
        return None
    entry = _CACHE.get((w.ctypes.data, w.shape, w.dtype.str, kind))
    if entry is None or entry[1] != seen[1]:
        return None
    owners, made_by = _alive(seen[0]), _alive(entry[0])
    if owners is None or made_by is None or any(a is not b for a, b in zip(made_by, owners)):
        return None
    _stats["hits"] += 1
    return entry[2]


def will_keep(w):
    """Whether :func:`put` would keep an array derived from ``w`` (enabled and vouched)."""
    return _vouched(w) is not None


def put(w, kind, value):
    """Keep ``value``, derived from ``w`` by the caller, as :func:`derived` does on a miss
    (where w is vouched for; else nothing)."""
    seen = _vouched(w)
    if seen is not None:
        _stats["misses"] += 1
        _store((w.ctypes.data, w.shape, w.dtype.str, kind), (seen[0], seen[1], value))


def _nbytes(value):
    return sum(_nbytes(v) for v in value) if isinstance(value, tuple) else value.nbytes


def _store(key, entry):
    old = _CACHE.pop(key, None)
    if old is not None:
        _stats["bytes"] -= _nbytes(old[2])
    for k in [k for k, e in _CACHE.items() if _alive(e[0]) is None]:      # dead owners
        _stats["bytes"] -= _nbytes(_CACHE.pop(k)[2])
    size = _nbytes(entry[2])
    if _stats["bytes"] + size > MAX_BYTES:      # full: keep what is kept (see the docstring)
        _stats["refused"] += 1
        return
    _CACHE[key] = entry
    _stats["bytes"] += size


def clear():
    """Drop every cached array (and zero the counts)."""
    _CACHE.clear()
    _stats.update(hits=0, misses=0, bytes=0, refused=0)


def stats():
    """{"hits", "misses", "bytes", "refused", "entries"}: what the cache has done and holds
    (refused: arrays not kept, the cache being full)."""
    return dict(_stats, entries=len(_CACHE))
