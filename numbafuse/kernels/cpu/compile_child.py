"""The compiling process of ``first_calls.py``: runs calls described by specs, on zeros, so
that Numba compiles their functions into its on-disk cache, where the parent then loads them.

Started by the parent (``python -m numbafuse.kernels.cpu.compile_child``) with its environment
(the same ``NUMBA_CACHE_DIR``) plus ``NUMBAFUSE_FIRST_CALL_WAIT=inf`` and
``NUMBAFUSE_NUM_THREADS=1`` (a launch then runs its tasks on this one thread: the same task
kernels, compiled once), at the parent's priority: niced (10), it got ~10% of a core beside
a training loop on both cores, and the quick start ran its whole warm-up on NumPy.
Protocol on stdin/stdout: each message is a 4-byte length and a pickle; a request is
``(job_id, spec)``, the reply ``(job_id, None)`` or ``(job_id, "error text")``.

A spec is ``(module, function, args, rules)``: ``module.function(*args)`` in a context with
the CPU conv plan rules ``rules`` (``cpu_plan.current_rules()`` of the caller). An argument
``Zeros(shape, dtype)`` becomes a zero array; ``Values(k, dtype)`` a callable returning
``(ones(k), zeros(k))`` (a folded batch norm's scale and shift); anything else is passed as is.
Values do not decide what compiles (shapes, dtypes and flags do), so zeros compile the same
functions the caller's arrays would.
"""
import importlib
import pickle
import struct
import sys
from typing import NamedTuple


class Zeros(NamedTuple):
    shape: tuple
    dtype: str


class Values(NamedTuple):
    k: int
    dtype: str


def write_message(stream, obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def read_message(stream):
    """The next message, or None at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def _argument(a):
    import numpy as np
    if isinstance(a, Zeros):
        return np.zeros(a.shape, np.dtype(a.dtype))
    if isinstance(a, Values):
        k, dtype = a.k, np.dtype(a.dtype)
        return lambda: (np.ones(k, dtype), np.zeros(k, dtype))
    return a


def run_spec(spec):
    """Run one spec in this process (what the compiling process does with a request)."""
    module, function, args, rules = spec
    from ..conv import cpu_plan
    token = cpu_plan._CURRENT.set(rules)
    try:
        fn = getattr(importlib.import_module(module), function)
        fn(*(_argument(a) for a in args))
    finally:
        cpu_plan._CURRENT.reset(token)


def main():
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr                 # nothing else may write to the protocol stream
    while True:
        request = read_message(stdin)
        if request is None:
            return
        job_id, spec = request
        try:
            run_spec(spec)
            error = None
        except Exception as exc:            # reported to the parent, which compiles itself
            error = f"{type(exc).__name__}: {exc}"
        try:
            write_message(stdout, (job_id, error))
        except (BrokenPipeError, OSError):  # the parent has ended: its cache files are written
            return


if __name__ == "__main__":          # run as a script: the classes the specs pickle are the
    from numbafuse.kernels.cpu.compile_child import main as _main     # package module's
    _main()
