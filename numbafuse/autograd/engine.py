"""The backward pass: a topological sort and one loop; all cleverness lives in the per-op
``Function.backward`` rules (``numbafuse/ops``).

Gradients are summed where a tensor feeds several ops. The first contribution is kept as it
is (no copy); a second one makes a new array that the tape owns, and every later one is added
into it in place. A Function with ``backward_adding(dy, addends)`` is offered the gradients
already summed for its inputs (``addends``, None where there is none yet) and may return some
of its input gradients with them added in (the indices it names in ``added``): a conv adds the
skip connection's gradient in its dx kernel's epilogue, with no sum kernel after it.

A leaf's ``.grad`` never shares memory with the caller's ``grad`` or another leaf's (a shared
array is copied once), and on a later ``backward()`` the new gradient is added *in place* into
a ``.grad`` the tape made itself (one the user assigned is replaced, not written).
"""
from __future__ import annotations

from .. import backend, kernels, validate


def toposort(root) -> list:
    """Tensors reachable from ``root`` through requires-grad links, inputs before outputs."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if t._fn is not None:
            stack.extend((i, False) for i in t._fn.inputs if i is not None and i.requires_grad)
    return order


def add_into(a, b):
    """``a += b`` in place (``a`` a contiguous array the caller owns); returns ``a``. Half
    precision: the sum computed in float32 and rounded to half (IEEE half addition, without
    a half arithmetic kernel on the device)."""
    ew = kernels.module("elementwise", backend.backend_of_array(a))
    if validate.is_half(a.dtype):
        return ew.cast_into(_half_sum(ew, a, b), a)
    return ew.axpby(1.0, a, 1.0, kernels.contiguous(b), out=a)


def add_new(a, b):
    """``a + b`` in a new array (half precision: as :func:`add_into`)."""
    ew = kernels.module("elementwise", backend.backend_of_array(a))
    if validate.is_half(a.dtype):
        return ew.cast(_half_sum(ew, a, b), a.dtype)
    return ew.axpby(1.0, kernels.contiguous(a), 1.0, kernels.contiguous(b))


def _half_sum(ew, a, b):
    a32, b32 = (ew.cast(kernels.contiguous(v), validate.COMPUTE_DTYPE) for v in (a, b))
    return ew.axpby(1.0, a32, 1.0, b32)


def backward(root, grad):
    """Accumulate d(root)/d(leaf) . grad into ``.grad`` of every leaf that requires it."""
    grads, owned = {id(root): grad}, set()       # owned: ids of sums the tape allocated
    handed_out = {backend.memory_key(grad)}      # memory already behind the caller or a leaf
    for t in reversed(toposort(root)):
        g = grads.pop(id(t), None)
        if g is None:
            continue
        owned.discard(id(g))     # no longer in grads: its id may be reused by another array
        if t._fn is None:
            _deliver(t, g, handed_out)
            continue
        grads_in, added = _input_grads(t._fn, g, grads)
        for i, (inp, g_in) in enumerate(zip(t._fn.inputs, grads_in)):
            if inp is None or g_in is None or not inp.requires_grad:
                continue
            if i in added:                        # g_in holds the sum so far: a new array
                owned.discard(id(grads[id(inp)]))
                grads[id(inp)] = g_in
                owned.add(id(g_in))
            elif id(inp) not in grads:
                grads[id(inp)] = g_in
            elif id(grads[id(inp)]) in owned:
                add_into(grads[id(inp)], g_in)
            else:
                grads[id(inp)] = add_new(grads[id(inp)], g_in)
                owned.add(id(grads[id(inp)]))


def _input_grads(fn, g, grads):
    """(the input gradients of ``fn`` for its output's gradient ``g``, the indices of those
    that include the input's gradient summed so far): ``backward_adding`` where ``fn`` has it
    and an input has a gradient already, offered only for an input ``fn`` takes once (two
    uses of one tensor would add it twice), else ``backward``."""
    adding = getattr(fn, "backward_adding", None)
    if adding is not None:
        ids = [id(i) if i is not None and i.requires_grad else None for i in fn.inputs]
        addends = [grads.get(k) if k is not None and ids.count(k) == 1 else None for k in ids]
        if any(a is not None for a in addends):
            grads_in, added = adding(g, tuple(addends))
            return grads_in, frozenset(added)
    return fn.backward(g), ()


def _deliver(leaf, g, handed_out):
    if leaf.grad is not None and leaf._grad_owned:
        add_into(leaf.grad, g)                    # in place: the tape made this buffer
        return
    if leaf.grad is not None:                     # the user's array: never written
        total = add_new(leaf.grad, g)
    else:
        key = backend.memory_key(g)
        total = backend.copy(kernels.contiguous(g)) if key is None or key in handed_out \
            else kernels.contiguous(g)
    handed_out.add(backend.memory_key(total))
    leaf._set_grad(total)


def saved_bytes(root) -> int:
    """Bytes held for backward by the graph reaching ``root``, each array counted once."""
    seen, total = set(), 0
    for node in toposort(root):
        if node._fn is None:
            continue
        for a in vars(node._fn.saved).values():
            if a is None or not hasattr(a, "nbytes") or id(a) in seen:
                continue
            seen.add(id(a))
            total += int(a.nbytes)
    return total
