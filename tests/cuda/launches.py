"""Counting kernel launches (and the raw argument values numba prepares for them).

``with recording() as rec: ...`` records every kernel launch made inside, through the one
function every numbafuse launch goes through (``numbafuse.kernels.cuda.launch.launch``, its
``observe`` hook), under the simulator and on a GPU alike. ``rec.names`` lists the kernels
in launch order, ``rec.raw_values`` the values numba's argument preparation produces for
them: an array is its meminfo, parent, size, itemsize, data pointer, shape and strides
(5 + 2*ndim values), a tuple the sum of its members, a scalar one value. That is the host
work numba redoes at every launch (issue 17 measured 19-25 us for one argument, 61-92 us for
13 on an H100); a prepared launch lays out the same values (kernels/cuda/launch.py).
"""
from __future__ import annotations

import contextlib
import dataclasses


def raw_values(arg) -> int:
    """How many raw values numba's launch prepares for one kernel argument."""
    if isinstance(arg, tuple):
        return sum(raw_values(a) for a in arg)
    shape = getattr(arg, "shape", None)
    if shape is not None and (hasattr(arg, "__cuda_array_interface__")
                              or getattr(arg, "__cuda_ndarray__", False)
                              or hasattr(arg, "strides")):
        return 5 + 2 * len(shape)
    return 1


@dataclasses.dataclass
class Recorder:
    launches: list = dataclasses.field(default_factory=list)   # (name, raw values)

    @property
    def names(self):
        return [name for name, _ in self.launches]

    @property
    def count(self):
        return len(self.launches)

    @property
    def raw_values(self):
        return sum(n for _, n in self.launches)

    def clear(self):
        self.launches.clear()


def _name(fn):
    return getattr(fn, "__name__", "?")


@contextlib.contextmanager
def recording():
    """Record the kernel launches made inside the block (see the module docstring)."""
    from numbafuse.kernels.cuda import launch as cuda_launch
    rec = Recorder()

    def seen(kernel, args):
        name = kernel.__dict__.get("__name__") or _name(getattr(kernel, "py_func", kernel))
        rec.launches.append((name, sum(raw_values(a) for a in args)))
    stop = cuda_launch.observe(seen)
    try:
        yield rec
    finally:
        stop()
