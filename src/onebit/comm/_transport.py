"""Transports, and what a ``group`` is: the only module that calls ``torch.distributed``.

``group`` is a ``torch.distributed`` process group (``None``: the default group), an
:class:`onebit.comm.MPIGroup`, or a backend name (:data:`BACKENDS`: ``"torch"`` is the
default process group, ``"mpi"`` mpi4py's ``COMM_WORLD``). Every collective goes through a
:class:`Transport`; ``_dist.py`` adds the validation, timeouts and metering. Without an
initialised process group the torch transport behaves as world size 1.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "BACKENDS",
    "Group",
    "Transport",
    "Work",
    "backend_of",
    "check_world_size",
    "concurrent",
    "connect_store",
    "device_of",
    "get_rank",
    "get_world_size",
    "gloo_group",
    "is_distributed",
    "reforms",
    "resolve_group",
    "transport",
]

BACKENDS = ("torch", "mpi")
# What every ``group`` argument accepts: a process group, None (the default group), a
# transport such as onebit.comm.MPIGroup, or a name from BACKENDS.
Group = Union[dist.ProcessGroup, "Transport", str, None]

# all_gather_into_tensor is deprecated in favour of all_gather_single from torch 2.13.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Work(Protocol):
    """What a transport's collective returns: ``wait(timeout)``, False where it timed out."""

    def wait(self, timeout: timedelta) -> bool: ...


class Transport(Protocol):
    """What a group must provide: equal-slot collectives that return a waitable work.

    ``onebit.comm.MPIGroup`` implements it over mpi4py; :class:`_TorchGroup` over
    ``torch.distributed``. ``_dist.py``'s wrappers add validation, timeouts and metering.
    ``concurrent``: collectives of two groups may be issued from two threads at once, each rank
    issuing them at its own times (in the same order within each group). ``worker_threads``: a
    collective's work is finished and released by the backend's own threads (gloo's, NCCL's
    watchdog), which must never hold its last reference (``_dist._HELD``). ``device``: where the
    tensors of its collectives live. ``sums_half``: its sums travel and add in bf16 and fp16
    themselves (not widened to fp32 first).
    """

    backend: str
    concurrent: bool
    worker_threads: bool
    sums_half: bool
    device: torch.device

    def size(self) -> int: ...
    def rank(self) -> int: ...
    def describe(self) -> str: ...
    def all_to_all(self, recv: Tensor, send: Tensor) -> Work: ...
    def all_gather(self, out: Tensor, slot: Tensor) -> Work: ...
    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> Work: ...
    def all_reduce(self, tensor: Tensor, op: str) -> Work: ...
    def broadcast(self, tensor: Tensor, src: int) -> Work: ...
    def barrier(self) -> Work: ...
    def split(self, partition: list[list[int]], timeout: timedelta) -> Any: ...
    def duplicate(self, timeout: timedelta) -> Any: ...


class _TorchGroup:
    """The :class:`Transport` of a ``torch.distributed`` process group (``None``: the default)."""

    backend = "torch"
    worker_threads = True
    sums_half = True
    __slots__ = ("group",)

    @property
    def concurrent(self) -> bool:
        # gloo's groups are independent; NCCL's kernels on two communicators can wait on each other
        # where the ranks issue them in different orders (NCCL's own rule), so not there.
        return "nccl" not in str(dist.get_backend(self.group))

    @property
    def device(self) -> torch.device:
        if self.size() > 1 and "nccl" in str(dist.get_backend(self.group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    def describe(self) -> str:
        name = "default" if self.group is None else getattr(self.group, "group_name", None) or repr(self.group)
        return f"group {name}"

    def all_to_all(self, recv: Tensor, send: Tensor) -> Work:
        return dist.all_to_all_single(recv, send, group=self.group, async_op=True)

    def all_gather(self, out: Tensor, slot: Tensor) -> Work:
        return _all_gather_flat(out, slot, group=self.group, async_op=True)

    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> Work:
        return _reduce_scatter_flat(out, tensor, group=self.group, async_op=True)

    def all_reduce(self, tensor: Tensor, op: str) -> Work:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)

    def broadcast(self, tensor: Tensor, src: int) -> Work:
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        return dist.broadcast(tensor, global_src, group=self.group, async_op=True)

    def barrier(self) -> Work:
        return dist.barrier(group=self.group, async_op=True)

    def split(self, partition: list[list[int]], timeout: timedelta) -> dist.ProcessGroup:
        # new_group is collective over the default group: every rank creates every sub-group.
        to_global = (lambda r: r) if self.group is None else (lambda r: dist.get_global_rank(self.group, r))
        mine = self.rank()
        own = None
        for ranks in partition:
            created = dist.new_group([to_global(r) for r in ranks], timeout=timeout)
            if mine in ranks:
                own = created
        return own

    def duplicate(self, timeout: timedelta) -> dist.ProcessGroup:
        # Only the group's own ranks take part (a replica group of HSDP, whose peers in the other
        # replica groups make theirs at the same time).
        ranks = [r if self.group is None else dist.get_global_rank(self.group, r) for r in range(self.size())]
        return dist.new_group(ranks, timeout=timeout, backend=dist.get_backend(self.group),
                              use_local_synchronization=True)


class _GlooGroup:
    """The :class:`Transport` of a gloo process group made directly over a store, outside
    ``torch.distributed``'s registry (a :class:`onebit.comm.Quorum`'s epoch): its collectives
    are the backend's own methods, as torchft calls them, since the registry's functions look
    the group up by its global ranks."""

    backend = "torch"
    concurrent = True  # gloo's groups are independent
    worker_threads = True
    sums_half = True
    device = torch.device("cpu")
    __slots__ = ("pg", "name")

    def __init__(self, pg: Any, name: str) -> None:
        self.pg, self.name = pg, name

    def size(self) -> int:
        return self.pg.size()

    def rank(self) -> int:
        return self.pg.rank()

    def describe(self) -> str:
        return f"group {self.name}"

    def all_to_all(self, recv: Tensor, send: Tensor) -> Work:
        return self.pg.alltoall_base(recv, send, [], [], dist.AllToAllOptions())

    def all_gather(self, out: Tensor, slot: Tensor) -> Work:
        return self.pg._allgather_base(out, slot)

    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> Work:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self.pg._reduce_scatter_base(out, tensor, opts)

    def all_reduce(self, tensor: Tensor, op: str) -> Work:
        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self.pg.allreduce([tensor], opts)

    def broadcast(self, tensor: Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self.pg.broadcast([tensor], opts)

    def barrier(self) -> Work:
        return self.pg.barrier(dist.BarrierOptions())

    def split(self, partition: list[list[int]], timeout: timedelta) -> Any:
        raise ValueError(f"{self.describe()} cannot be split into sub-groups (it is made over a store, outside "
                         "torch.distributed's registry): hierarchical exchanges need init_process_group's groups")

    def duplicate(self, timeout: timedelta) -> Any:
        raise ValueError(f"{self.describe()} is duplicated by the Quorum that made it")


def gloo_group(store: dist.Store, name: str, rank: int, size: int, timeout: timedelta) -> _GlooGroup:
    """A gloo group of ``size`` ranks made over ``store``'s keys under ``name`` (every rank calls
    it with the same name; it returns once all have connected, or raises ``RuntimeError`` after
    ``timeout``)."""
    return _GlooGroup(dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timeout), name)


def connect_store(address: str, timeout: timedelta) -> dist.Store:
    """A client of the ``torch.distributed.TCPStore`` served at ``address`` (``"host:port"``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Invalid store value: {address!r} (expected 'host:port')")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def resolve_group(group: Group) -> Any:
    """``group`` as given, or the group a backend name stands for (``"torch"``: ``None``)."""
    if isinstance(group, str):
        if group == "torch":
            return None
        if group == "mpi":
            from ._mpi import world_group

            return world_group()
        raise ValueError(f"group must be a process group, an MPIGroup or one of {BACKENDS}, got {group!r}")
    if group is not None and not isinstance(group, dist.ProcessGroup) and not hasattr(group, "backend"):
        raise TypeError(f"group must be a process group, an MPIGroup or one of {BACKENDS}, got {group!r}")
    return group


def transport(group: Group) -> Transport:
    """The :class:`Transport` that carries ``group``'s collectives."""
    group = resolve_group(group)
    return group if hasattr(group, "backend") else _TorchGroup(group)


def backend_of(group: Group) -> str:
    """The backend name of ``group`` (``"torch"`` or ``"mpi"``)."""
    return transport(group).backend


def device_of(group: Group) -> torch.device:
    """Where the tensors of ``group``'s collectives must live: the current CUDA device on NCCL,
    else the CPU."""
    return transport(group).device


def concurrent(group: Group) -> bool:
    """Whether a second thread may issue collectives on a duplicate of ``group`` at times that
    differ between ranks, while this one issues its own (gloo: yes; NCCL: no, by NCCL's rule on
    the order of collectives over several communicators; MPI: only where the library was
    initialised with ``MPI_THREAD_MULTIPLE``)."""
    return bool(transport(group).concurrent)


def reforms(group: Group) -> bool:
    """Whether ``group``'s membership changes between collectives (an :class:`onebit.comm.Quorum`):
    its users commit each exchange and follow it to the next epoch."""
    return bool(getattr(transport(group), "reforms", False))


def is_distributed(group: Group = None) -> bool:
    """True when ``group`` (a process group or MPI communicator) has more than one rank."""
    return get_world_size(group) > 1


def get_world_size(group: Group = None) -> int:
    return transport(group).size()


def get_rank(group: Group = None) -> int:
    return transport(group).rank()


def check_world_size(group: Group, expected: int, owner: str) -> None:
    """Raise if ``group`` no longer has the ``expected`` ranks ``owner`` was built for.

    ``group=None`` means the default group, resolved at each call: an object built before
    ``init_process_group`` (world size 1) and used after it would size its buffers for one
    rank and exchange with several -- garbage, not an error, without this check.
    """
    now = get_world_size(group)
    if now != expected:
        raise RuntimeError(
            f"{owner} was built for {expected} rank(s), but its process group now has {now}"
            + (": it was built before torch.distributed.init_process_group; build it after "
               "(HF Trainer: after TrainingArguments(...), which initialises the process group)"
               if expected == 1 else "")
        )
