"""Data-parallel training on MPI, through mpi4py (extra ``distributed``).

    comm = distributed.init()        the MPI world, or a one-process communicator off MPI
    comm.rank, comm.size
    comm.allreduce_sum(a) -> array   elementwise sum over ranks (host or device array)
    distributed.broadcast_parameters(module, comm)
    distributed.average_gradients(module, comm)

Launch with ``mpiexec -n P python script.py`` (the extra installs mpi4py and an MPI; ``mpiexec``
is then on the environment's PATH) or a cluster scheduler; the same script runs as one process
without ``mpiexec``. Batch norm is synchronized inside the fused ops: pass ``comm=`` to
``batchnorm_add_relu``, ``batchnorm``, ``conv_batchnorm_relu`` or their ``nn`` layers.

Every collective uses mpi4py's buffer (uppercase) calls: no pickling, fixed order, so results
are bitwise repeatable. Device arrays travel through the host unless the MPI library says it
is CUDA-aware (:meth:`Communicator.cuda_aware`; the MPICH and Open MPI wheels on PyPI are not).

Faults. A rank whose arrays disagree with the others' (shape, dtype) gets a ``ValueError`` on
every rank, not a hang: :meth:`Communicator.check_same` compares a 16-byte hash of each
call's signature before the call's collectives. A rank that dies (killed, crashed) makes
``mpiexec`` end the others. A rank that raises an exception would otherwise leave the others
blocked in a collective while it exits through ``MPI_Finalize``: :func:`init` therefore
installs an exception hook that prints the traceback and, half a second later (time for
``mpiexec`` to forward it), calls ``MPI_Abort`` (``abort_on_exception=False`` leaves
``sys.excepthook`` alone; ``python -m mpi4py script.py`` does the same job).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

from . import backend
from .kernels.cpu import launch as cpu_launch

INSTALL_HINT = "mpi4py is needed for distributed training: pip install 'numbafuse[distributed]'"
ABORT_GRACE_S = 0.5      # seconds from a failed rank's traceback to MPI_Abort (_install_abort_hook)


class Communicator:
    """A group of processes: ``rank`` of ``size``; ``mpi_comm`` is the mpi4py communicator
    (``None`` for the one-process communicator, whose collectives are copies)."""

    def __init__(self, mpi_comm=None):
        self.mpi_comm = mpi_comm
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()

    def __repr__(self):
        kind = "MPI" if self.mpi_comm is not None else "local"
        return f"Communicator({kind}, rank {self.rank} of {self.size})"

    # -- capabilities
    def cuda_aware(self) -> bool:
        """True when the MPI library takes device pointers (then device arrays are reduced in
        place on the device); detected, never assumed."""
        if self.mpi_comm is None:
            return False
        from mpi4py import MPI
        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query()) if query is not None else False

    # -- collectives (every rank must call them, in the same order)
    def allreduce_sum(self, a):
        """Elementwise sum of ``a`` over ranks, a new array on ``a``'s device.

        Reduced on rank 0 and broadcast, so every rank gets the same bits (an all-reduce may
        add in a different order on each rank, and replicas would drift apart).
        """
        if backend.is_device_array(a) and not self.cuda_aware():
            return backend.to_device(self.allreduce_sum(backend.to_host(a)))
        a = backend.host_contiguous(np.asarray(a)) if isinstance(a, np.ndarray) else a
        out = backend.copy(a)
        if self.mpi_comm is not None and self.size > 1:
            from mpi4py import MPI
            if self.rank == 0:
                self.mpi_comm.Reduce(MPI.IN_PLACE, out, op=MPI.SUM, root=0)
            else:
                self.mpi_comm.Reduce(out, None, op=MPI.SUM, root=0)
            self.mpi_comm.Bcast(out, root=0)
        return out

    def allgather(self, a: np.ndarray) -> np.ndarray:
        """Every rank's host array ``a`` (same shape on all ranks), stacked: (size, *a.shape)."""
        a = np.ascontiguousarray(a)
        out = np.empty((self.size,) + a.shape, a.dtype)
        if self.mpi_comm is None or self.size == 1:
            out[0] = a
        else:
            self.mpi_comm.Allgather(a, out)
        return out

    def broadcast(self, a: np.ndarray, root: int = 0) -> np.ndarray:
        """``a`` (a contiguous host array) overwritten in place with rank ``root``'s."""
        if self.mpi_comm is not None and self.size > 1:
            self.mpi_comm.Bcast(a, root=root)
        return a

    def check_same(self, op: str, signature) -> None:
        """Raise ``ValueError`` on every rank unless every rank passes the same ``signature``
        (a tuple of shapes, dtypes, flags): one 16-byte all-gather of its hash per call.

        It is not cached per rank: a rank that met a new signature would wait in the
        all-gather for ranks that skip it as already checked, which is the hang this check
        exists to prevent. (At a few microseconds per call it costs nothing next to the
        collectives it guards.)
        """
        if self.size == 1:
            return
        digest = np.frombuffer(hashlib.blake2b(repr(signature).encode(), digest_size=16)
                               .digest(), dtype=np.uint8)
        everyone = self.allgather(digest)
        if not (everyone == everyone[0]).all():
            odd = [r for r in range(self.size) if not (everyone[r] == everyone[0]).all()]
            raise ValueError(f"{op}: ranks disagree on the arrays of this call (shapes, dtypes "
                             f"or options): rank {self.rank} has {signature}; ranks {odd} differ "
                             f"from rank 0")

    def abort(self, code: int = 1) -> None:
        if self.mpi_comm is not None:
            self.mpi_comm.Abort(code)


def init(abort_on_exception: bool = True, share_cores: bool = True) -> Communicator:
    """The MPI world (``MPI.COMM_WORLD``), or a one-process communicator when mpi4py is not
    installed. Under ``mpiexec`` with more than one process, an uncaught exception on any rank
    then aborts the whole job with its traceback (see the module docstring), and with
    ``share_cores`` numbafuse's CPU thread pool on each rank gets its share of the node's cores
    (cores / ranks on the node, at least 1) unless ``NUMBAFUSE_NUM_THREADS`` says otherwise:
    P ranks each running a pool as wide as the machine would oversubscribe it P times."""
    try:
        from mpi4py import MPI
    except ImportError:
        return Communicator(None)
    comm = Communicator(MPI.COMM_WORLD)
    if comm.size > 1:
        if abort_on_exception:
            _install_abort_hook(comm)
        if share_cores and "NUMBAFUSE_NUM_THREADS" not in os.environ:
            local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
            cpu_launch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return comm


def _install_abort_hook(comm):
    previous = sys.excepthook
    if getattr(previous, "_numbafuse_abort", False):
        return

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        sys.stderr.write(f"numbafuse.distributed: rank {comm.rank} failed; aborting all "
                         f"{comm.size} ranks\n")
        sys.stderr.flush()
        # mpiexec forwards each rank's output through its own process: give it a moment to pass
        # the traceback on before MPI_Abort tears the job down (without it mpich's hydra lost
        # the whole message in about 1 run of 10 here)
        time.sleep(ABORT_GRACE_S)
        comm.abort(1)

    hook._numbafuse_abort = True
    sys.excepthook = hook


# --------------------------------------------------------------------------- model helpers

def _by_dtype(arrays):
    """{dtype: [(index, array)]} in the given order (fixed: the module's registration order)."""
    groups = {}
    for i, a in enumerate(arrays):
        groups.setdefault(np.dtype(a.dtype), []).append((i, a))
    return groups


def broadcast_parameters(module, comm: Communicator, root: int = 0) -> None:
    """Rank ``root``'s parameters and buffers to every rank, in place (one message per dtype,
    in the module's registration order)."""
    named = [(n, p.data) for n, p in module.named_parameters()] + list(module.named_buffers())
    comm.check_same("broadcast_parameters", tuple((n, tuple(a.shape), str(a.dtype))
                                                  for n, a in named))
    if comm.size == 1:
        return
    arrays = [a for _, a in named]
    for dtype, members in _by_dtype(arrays).items():
        flat = np.concatenate([backend.to_host(a).reshape(-1) for _, a in members])
        comm.broadcast(flat, root)
        offset = 0
        for _, a in members:
            values = flat[offset:offset + a.size].reshape(a.shape)
            offset += a.size
            if isinstance(a, np.ndarray):
                a[...] = values
            else:
                backend.as_device_array(a).copy_to_device(values)


def average_gradients(module, comm: Communicator) -> None:
    """Each parameter's ``.grad`` := its mean over ranks (a missing gradient counts as zeros).

    All gradients of one dtype go in one buffer and one all-reduce (Horovod's tensor fusion), in
    the module's registration order, so the result is the same bits on every rank and run.
    """
    params = [p for _, p in module.named_parameters()]
    comm.check_same("average_gradients", tuple((tuple(p.shape), str(p.dtype)) for p in params))
    if comm.size == 1:
        return
    for dtype, members in _by_dtype([p.data for p in params]).items():
        parts = [np.zeros(p.size, dtype) if params[i].grad is None
                 else backend.to_host(params[i].grad).reshape(-1) for i, p in members]
        total = comm.allreduce_sum(np.concatenate(parts))
        total /= dtype.type(comm.size)
        offset = 0
        for i, a in members:
            mean = total[offset:offset + a.size].reshape(a.shape)
            offset += a.size
            params[i].grad = mean if isinstance(a, np.ndarray) else backend.to_device(mean)
