"""Counting kernel launches (and the raw argument values numba prepares for them).

``with recording() as rec: ...`` records every kernel launch made inside: under the simulator
by wrapping ``FakeCUDAKernel.__call__`` (device-function calls inside kernels are not
launches and are not recorded), on a GPU by wrapping ``CUDADispatcher.call`` (the one path
``kernel[grid, block](...)`` takes). ``rec.names`` lists the kernels in launch order,
``rec.raw_values`` the values numba's argument preparation produces for them: an array is
its meminfo, parent, size, itemsize, data pointer, shape and strides (5 + 2*ndim values), a
tuple the sum of its members, a scalar one value. That is the host work numba redoes at every
launch (issue 17 measured 19-25 us for one argument, 61-92 us for 13 on an H100).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


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
    rec = Recorder()
    if SIMULATOR:
        from numba.cuda.simulator import kernel as sim

        real = sim.FakeCUDAKernel.__call__

        def call(self, *args):
            if not (self._device or sim._kernel_context):
                name = self.__dict__.get("__name__") or _name(self.fn)   # factories rename
                rec.launches.append((name, sum(raw_values(a) for a in args)))
            return real(self, *args)

        sim.FakeCUDAKernel.__call__ = call
        try:
            yield rec
        finally:
            sim.FakeCUDAKernel.__call__ = real
        return
    from numba.cuda.dispatcher import CUDADispatcher

    real_call = CUDADispatcher.call

    depth = [0]

    def dispatch(self, args, launch_config):
        if depth[0] == 0:        # a dispatcher may hand the call on to another one
            name = self.__dict__.get("__name__") or _name(self.py_func)  # factories rename
            rec.launches.append((name, sum(raw_values(a) for a in args)))
        depth[0] += 1
        try:
            return real_call(self, args, launch_config)
        finally:
            depth[0] -= 1

    CUDADispatcher.call = dispatch
    try:
        yield rec
    finally:
        CUDADispatcher.call = real_call
