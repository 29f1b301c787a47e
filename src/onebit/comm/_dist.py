"""The collectives every layer above calls: validated, timed out, metered.

Every wrapper takes ``group`` (``_transport.py``: a process group, an
:class:`onebit.comm.MPIGroup`, a backend name) and ``timeout`` (seconds or ``timedelta``;
``None``: :data:`DEFAULT_TIMEOUT`), records its bytes in the meter, and turns a failure or a
timeout into a :class:`CollectiveError` that names the operation and the group -- a dead peer
gives an error on every surviving rank, never a hang.
"""

from __future__ import annotations

import atexit
import ctypes
import time
from collections import deque
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from ._meter import record, record_time
from ._trace import traced
from ._transport import Group, Transport, Work, get_world_size, transport

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "Pending",
    "Stages",
    "all_gather_bytes",
    "all_gather_object_sizes",
    "all_reduce_max",
    "all_reduce_sum",
    "all_reduce_mean",
    "all_reduce_mean_stages",
    "all_to_all_bytes",
    "barrier",
    "broadcast",
    "duplicate",
    "reduce_scatter_mean",
    "run_stages",
    "split",
    "to_timedelta",
]

DEFAULT_TIMEOUT = timedelta(minutes=5)


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, stalled or disagreed on sizes)."""


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

    def __init__(self, where: str, work: Work | None, limit: timedelta, result: Tensor,
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
                limit = self._limit.total_seconds()
                raise CollectiveError(f"{self._where} {status} (timeout {limit:g}s): {exc}") from exc
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


def _start(op: str, transport: Transport, timeout: float | timedelta | None, launch: Callable[[], Work | None],
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
    t = transport(group)
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
    t = transport(group)
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
    t = transport(group)
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
    return transport(group).split(partition, timeout)


def duplicate(group: Group, timeout: timedelta) -> Any:
    """A new group of the same ranks, in the same order: its collectives run and are matched apart
    from the group's, so they may be issued at other times, each rank whenever it gets to them
    (one group of 1: the group itself). Collective over ``group`` only."""
    return group if get_world_size(group) == 1 else transport(group).duplicate(to_timedelta(timeout))


def all_reduce_mean(tensor: Tensor, group: Group = None, timeout: float | timedelta | None = None,
                    link: str = "flat", async_op: bool = False, divide_first: bool = False) -> Tensor | Pending:
    """In-place average over the group (sum, then divide by world size); ``async_op``: a
    :class:`Pending` whose ``wait()`` divides and returns ``tensor``. ``divide_first``: divide,
    then sum (DDP's order), so that the division runs at the launch -- during backward, for an
    exchange started there -- rather than where the result is awaited; the same bits where the
    world size is a power of two, barring values at the ends of the float range (subnormal once
    divided, or summing past the largest float)."""
    t = transport(group)
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
    t = transport(group)
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
    t = transport(group)
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
    t = transport(group)
    world = t.size()
    if world == 1:
        return tensor
    _start("broadcast", t, timeout, lambda: t.broadcast(tensor, src), tensor).wait()
    if t.rank() == src:
        record("broadcast", tensor.numel() * tensor.element_size() * (world - 1))
    return tensor


def barrier(group: Group = None, timeout: float | timedelta | None = None) -> None:
    """Wait until every rank of the group arrives (nothing is sent that the meter counts)."""
    t = transport(group)
    if t.size() > 1:
        _start("barrier", t, timeout, t.barrier, torch.empty(0)).wait()
