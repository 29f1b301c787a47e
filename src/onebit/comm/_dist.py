"""The only module that calls ``torch.distributed``, and the one entry to every transport.

Every wrapper takes ``group`` and ``timeout`` (seconds or ``timedelta``; ``None``:
:data:`DEFAULT_TIMEOUT`), records its bytes in the meter, and turns a failure or a timeout
into a :class:`CollectiveError` that names the operation and the group -- a dead peer
gives an error on every surviving rank, never a hang. ``group`` is a ``torch.distributed``
process group (``None``: the default group), an :class:`onebit.comm.MPIGroup`, or a
backend name (:data:`BACKENDS`: ``"torch"`` is the default process group, ``"mpi"``
mpi4py's ``COMM_WORLD``). Without an initialised process group the torch transport
behaves as world size 1.
"""

from __future__ import annotations

import atexit
import ctypes
import time
from collections import deque
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ._meter import record, record_time
from ._trace import traced

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "Group",
    "Pending",
    "Stages",
    "Transport",
    "all_gather_bytes",
    "all_gather_object_sizes",
    "all_reduce_max",
    "all_reduce_sum",
    "all_reduce_mean",
    "all_reduce_mean_stages",
    "all_to_all_bytes",
    "backend_of",
    "barrier",
    "broadcast",
    "check_world_size",
    "concurrent",
    "duplicate",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "reduce_scatter_mean",
    "resolve_group",
    "run_stages",
    "split",
    "to_timedelta",
]

DEFAULT_TIMEOUT = timedelta(minutes=5)
BACKENDS = ("torch", "mpi")
# What every ``group`` argument accepts: a process group, None (the default group), a
# transport such as onebit.comm.MPIGroup, or a name from BACKENDS.
Group = Union[dist.ProcessGroup, "Transport", str, None]

# all_gather_into_tensor is deprecated in favour of all_gather_single from torch 2.13.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Work(Protocol):
    def wait(self, timeout: timedelta) -> bool: ...


class Transport(Protocol):
    """What a group must provide: equal-slot collectives that return a waitable work.

    ``onebit.comm.MPIGroup`` implements it over mpi4py; :class:`_TorchGroup` over
    ``torch.distributed``. The wrappers below add validation, timeouts and metering.
    ``concurrent``: collectives of two groups may be issued from two threads at once, each rank
    issuing them at its own times (in the same order within each group). ``worker_threads``: a
    collective's work is finished and released by the backend's own threads (gloo's, NCCL's
    watchdog), which must never hold its last reference (see ``_HELD``). ``device``: where the
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
    def all_to_all(self, recv: Tensor, send: Tensor) -> _Work: ...
    def all_gather(self, out: Tensor, slot: Tensor) -> _Work: ...
    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> _Work: ...
    def all_reduce(self, tensor: Tensor, op: str) -> _Work: ...
    def broadcast(self, tensor: Tensor, src: int) -> _Work: ...
    def barrier(self) -> _Work: ...
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

    def all_to_all(self, recv: Tensor, send: Tensor) -> _Work:
        return dist.all_to_all_single(recv, send, group=self.group, async_op=True)

    def all_gather(self, out: Tensor, slot: Tensor) -> _Work:
        return _all_gather_flat(out, slot, group=self.group, async_op=True)

    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> _Work:
        return _reduce_scatter_flat(out, tensor, group=self.group, async_op=True)

    def all_reduce(self, tensor: Tensor, op: str) -> _Work:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)

    def broadcast(self, tensor: Tensor, src: int) -> _Work:
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        return dist.broadcast(tensor, global_src, group=self.group, async_op=True)

    def barrier(self) -> _Work:
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


def _transport(group: Group) -> Transport:
    group = resolve_group(group)
    return group if hasattr(group, "backend") else _TorchGroup(group)


def backend_of(group: Group) -> str:
    """The backend name of ``group`` (``"torch"`` or ``"mpi"``)."""
    return _transport(group).backend


def device_of(group: Group) -> torch.device:
    """Where the tensors of ``group``'s collectives must live: the current CUDA device on NCCL,
    else the CPU."""
    return _transport(group).device


def concurrent(group: Group) -> bool:
    """Whether a second thread may issue collectives on a duplicate of ``group`` at times that
    differ between ranks, while this one issues its own (gloo: yes; NCCL: no, by NCCL's rule on
    the order of collectives over several communicators; MPI: only where the library was
    initialised with ``MPI_THREAD_MULTIPLE``)."""
    return bool(_transport(group).concurrent)


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, stalled or disagreed on sizes)."""


def is_distributed(group: Group = None) -> bool:
    """True when ``group`` (a process group or MPI communicator) has more than one rank."""
    return get_world_size(group) > 1


def get_world_size(group: Group = None) -> int:
    return _transport(group).size()


def get_rank(group: Group = None) -> int:
    return _transport(group).rank()


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


def to_timedelta(timeout: float | timedelta | None) -> timedelta:
    """Validate a timeout argument (seconds or ``timedelta``; ``None`` for the default)."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds or a timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return timedelta(seconds=seconds)


# The collectives of the backends with worker threads, from their launch until a few collectives
# after they complete. A gloo worker drops its own reference to a collective just after it
# signals completion (or fails it). Were that the last one, the worker would free the
# collective's tensors -- views it made, their bases, receive buffers already decoded and
# dropped -- whose Python objects need the GIL: a deadlock when the main thread is joining the
# workers in destroy_process_group, an abort at interpreter exit (the race of pytorch#179291).
# Held here, the worker's drop is a plain decrement and the main thread frees them. Held from
# the launch too, so that one never waited for (an exchange abandoned by an error) is covered.
_HELD: deque[Any] = deque(maxlen=16)


@atexit.register
def _outlive_the_workers() -> None:
    # A process group still referenced at exit (by an optimizer, a DDP model: destroy_process_group
    # only unregisters it) keeps its workers running into interpreter finalization, where one
    # that has not yet dropped its last collective would become its last holder. The process is
    # ending: the last collectives are left to the OS instead (CPython's own reference count).
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_HELD))


class Pending:
    """A collective in flight (``async_op=True``): :meth:`wait` blocks until it completes, or
    raises :class:`CollectiveError` after the timeout, and returns its result."""

    __slots__ = ("_op", "_where", "_work", "_limit", "_result", "_then", "_start", "_tensors", "_held")

    def __init__(self, where: str, work: _Work | None, limit: timedelta, result: Tensor,
                 then: Callable[[Tensor], Tensor] | None = None, inputs: tuple[Tensor, ...] = (),
                 op: str = "", held: bool = False) -> None:
        self._where, self._work, self._limit, self._result, self._then = where, work, limit, result, then
        self._op = op
        self._tensors = (result, *inputs)
        self._held = held and work is not None
        if self._held:
            _HELD.append((work, self._tensors))
        self._start = time.perf_counter()

    def wait(self) -> Tensor:
        """The result (the same tensor on every call); the first call waits for it."""
        if self._work is not None:
            work, self._work = self._work, None
            if self._held:
                _HELD.append((work, self._tensors))
            try:
                completed = work.wait(self._limit)
            except RuntimeError as exc:
                status = "timed out" if "timed out" in str(exc).lower() else "failed"
                raise CollectiveError(f"{self._where} {status} (timeout {self._limit.total_seconds():g}s): {exc}") from exc
            if not completed:
                raise CollectiveError(f"{self._where} timed out (timeout {self._limit.total_seconds():g}s)")
            end = time.perf_counter()
            record_time(end - self._start)
            trace = traced()
            if trace is not None:  # in flight from its launch to the wait that returned it
                trace.add(self._op, "wire", self._start, end)
            if self._then is not None:
                self._result = self._then(self._result)
        return self._result


# An exchange in stages: each ``next()`` waits for the collective the previous stage left in
# flight, computes, and yields the next one's Pending; the generator returns the result.
Stages = Generator[Pending, None, Any]


def run_stages(stages: Stages) -> Any:
    """Run every remaining stage of ``stages`` (one after another) and return its result."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def _start(op: str, transport: Transport, timeout: float | timedelta | None, launch: Callable[[], _Work | None],
           result: Tensor, then: Callable[[Tensor], Tensor] | None = None, inputs: tuple[Tensor, ...] = ()) -> Pending:
    limit = to_timedelta(timeout)
    where = f"{op} on {transport.describe()} (rank {transport.rank()} of {transport.size()})"
    try:
        work = launch()
    except RuntimeError as exc:
        raise CollectiveError(f"{where} failed: {exc}") from exc
    return Pending(where, work, limit, result, then, inputs, op, transport.worker_threads)


def _finish(result: Tensor | Pending, async_op: bool) -> Tensor | Pending:
    """``result`` as the caller asked for it: waited for, or (``async_op``) a :class:`Pending`."""
    if isinstance(result, Tensor):  # one rank: nothing was in flight
        return Pending("", None, DEFAULT_TIMEOUT, result) if async_op else result
    return result if async_op else result.wait()


def all_to_all_bytes(send: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                     link: str = "flat", async_op: bool = False) -> Tensor | Pending:
    """Exchange equal slots: slot ``j`` of ``send`` goes to rank ``j``; returns the received slots
    (``async_op``: a :class:`Pending` of them; ``send`` must stay untouched until it completes)."""
    t = _transport(group)
    world = t.size()
    if world == 1:
        return _finish(send, async_op)
    recv = torch.empty_like(send)
    pending = _start("all_to_all", t, timeout, lambda: t.all_to_all(recv, send), recv, inputs=(send,))
    record("all_to_all", send.numel() * send.element_size() * (world - 1) // world, link)
    return _finish(pending, async_op)


def all_gather_bytes(slot: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                     link: str = "flat", async_op: bool = False) -> Tensor | Pending:
    """Concatenate every rank's equal-sized flat ``slot`` in rank order (``async_op``: a
    :class:`Pending`; ``slot`` must stay untouched until it completes)."""
    t = _transport(group)
    world = t.size()
    if world == 1:
        return _finish(slot, async_op)
    out = slot.new_empty(world * slot.numel())
    pending = _start("all_gather", t, timeout, lambda: t.all_gather(out, slot), out, inputs=(slot,))
    record("all_gather", slot.numel() * slot.element_size() * (world - 1), link)
    return _finish(pending, async_op)


def all_gather_object_sizes(
    values: list[int],
    group: Group = None,
    timeout: float | timedelta | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """All ranks' integer vectors as a ``(world, len(values))`` int64 CPU tensor (cheap agreement checks).

    ``device`` is where the exchange happens: the parameters' device, so NCCL gets CUDA tensors.
    """
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    return all_gather_bytes(mine, group, timeout).view(-1, len(values)).cpu()


def reduce_scatter_mean(tensor: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                        link: str = "flat", async_op: bool = False) -> Tensor | Pending:
    """Average of slot ``rank`` of ``tensor`` (``world`` equal slots) over the group; returns that slot
    (``async_op``: a :class:`Pending` of it; ``tensor`` must stay untouched until it completes)."""
    t = _transport(group)
    world = t.size()
    if world == 1:
        return _finish(tensor, async_op)
    out = tensor.new_empty(tensor.numel() // world)
    pending = _start("reduce_scatter", t, timeout, lambda: t.reduce_scatter_sum(out, tensor), out,
                     lambda summed: summed.div_(world), inputs=(tensor,))
    record("reduce_scatter", (world - 1) * out.numel() * out.element_size(), link)
    return _finish(pending, async_op)


def split(partition: list[list[int]], group: Group, timeout: timedelta) -> Any:
    """This rank's sub-group of ``partition`` (lists of group ranks covering the group).

    Collective: every rank of the group must call it with the same partition.
    """
    return _transport(group).split(partition, timeout)


def duplicate(group: Group, timeout: timedelta) -> Any:
    """A new group of the same ranks, in the same order: its collectives run and are matched apart
    from the group's, so they may be issued at other times, each rank whenever it gets to them
    (one group of 1: the group itself). Collective over ``group`` only."""
    return group if get_world_size(group) == 1 else _transport(group).duplicate(to_timedelta(timeout))


def all_reduce_mean(tensor: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                    link: str = "flat", async_op: bool = False, divide_first: bool = False) -> Tensor | Pending:
    """In-place average over the group (sum, then divide by world size); ``async_op``: a
    :class:`Pending` whose ``wait()`` divides and returns ``tensor``. ``divide_first``: divide,
    then sum (DDP's order), so that the division runs at the launch -- during backward, for an
    exchange started there -- rather than where the result is awaited; the same bits where the
    world size is a power of two, barring values at the ends of the float range (subnormal once
    divided, or summing past the largest float)."""
    t = _transport(group)
    world = t.size()
    if world == 1:
        return _finish(tensor, async_op)
    if divide_first:
        tensor.div_(world)
    pending = _start("all_reduce", t, timeout, lambda: t.all_reduce(tensor, "sum"), tensor,
                     None if divide_first else lambda summed: summed.div_(world))
    record("all_reduce", 2 * (world - 1) * tensor.numel() * tensor.element_size() // world, link)
    return _finish(pending, async_op)


def all_reduce_mean_stages(tensor: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                           divide_first: bool = False, dtype: torch.dtype | None = None) -> Stages:
    """:func:`all_reduce_mean` of ``tensor`` in place, as stages (see :func:`run_stages`): the
    first ``next()`` starts it and yields its :class:`Pending`; the result is ``tensor``.
    ``dtype`` (None: ``tensor``'s): what goes on the wire -- ``tensor`` divided by the world size
    in its own precision, cast to ``dtype``, summed in it (half the bytes of fp32 in bf16; every
    rank gets the same sum) and copied back; on one rank nothing is sent, nor rounded, and
    over a group that widens half precision to fp32 to sum it (MPI's) it goes in ``tensor``'s."""
    t = _transport(group)
    world = t.size()
    if dtype is None or dtype == tensor.dtype or world == 1 or not t.sums_half:
        inflight = all_reduce_mean(tensor, group, timeout, async_op=True, divide_first=divide_first)
        yield inflight
        return inflight.wait()
    wire = tensor.div_(world).to(dtype)
    inflight = _all_reduce(wire, "sum", group, timeout, "flat", async_op=True)
    yield inflight
    return tensor.copy_(inflight.wait())


def _all_reduce(tensor: Tensor, op: str, group: Group, timeout: float | timedelta | None, link: str,
                async_op: bool = False) -> Tensor | Pending:
    t = _transport(group)
    world = t.size()
    if world == 1:
        return _finish(tensor, async_op)
    pending = _start(f"all_reduce({op})", t, timeout, lambda: t.all_reduce(tensor, op), tensor)
    record("all_reduce", 2 * (world - 1) * tensor.numel() * tensor.element_size() // world, link)
    return _finish(pending, async_op)


def all_reduce_sum(tensor: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                   link: str = "flat") -> Tensor:
    """In-place sum over the group."""
    return _all_reduce(tensor, "sum", group, timeout, link)


def all_reduce_max(tensor: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                   async_op: bool = False) -> Tensor | Pending:
    """In-place element-wise maximum over the group (``async_op``: its :class:`Pending`)."""
    return _all_reduce(tensor, "max", group, timeout, "flat", async_op)


def broadcast(tensor: Tensor, src: int = 0, group: Group = None, timeout: float | timedelta | None = None) -> Tensor:
    """In-place broadcast from group rank ``src``."""
    t = _transport(group)
    world = t.size()
    if world == 1:
        return tensor
    _start("broadcast", t, timeout, lambda: t.broadcast(tensor, src), tensor).wait()
    if t.rank() == src:
        record("broadcast", tensor.numel() * tensor.element_size() * (world - 1))
    return tensor


def barrier(group: Group = None, timeout: float | timedelta | None = None) -> None:
    """Wait until every rank of the group arrives (nothing is sent that the meter counts)."""
    t = _transport(group)
    if t.size() > 1:
        _start("barrier", t, timeout, t.barrier, torch.empty(0)).wait()
