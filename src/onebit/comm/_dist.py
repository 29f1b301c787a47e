"""The only module that calls ``torch.distributed``.

Every wrapper takes ``group`` (``None``: the default group) and ``timeout`` (seconds or
``timedelta``; ``None``: :data:`DEFAULT_TIMEOUT`), records its bytes in the meter, and
turns a failure or a timeout into a :class:`CollectiveError` that names the operation and
the group -- a dead peer gives an error on every surviving rank, never a hang.
Without an initialised process group every wrapper behaves as world size 1.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ._meter import record, record_time

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "all_gather_bytes",
    "all_gather_object_sizes",
    "all_reduce_max",
    "all_reduce_mean",
    "all_to_all_bytes",
    "broadcast",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "new_subgroups",
    "reduce_scatter_mean",
    "to_timedelta",
]

DEFAULT_TIMEOUT = timedelta(minutes=5)

# all_gather_into_tensor is deprecated in favour of all_gather_single from torch 2.13.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, stalled or disagreed on sizes)."""


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when a process group is initialised and has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


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


def _describe(group: dist.ProcessGroup | None) -> str:
    name = "default" if group is None else getattr(group, "group_name", None) or repr(group)
    return f"group {name} (rank {get_rank(group)} of {get_world_size(group)})"


def _run(op: str, group: dist.ProcessGroup | None, timeout: float | timedelta | None, launch) -> None:
    limit = to_timedelta(timeout)
    where = f"{op} on {_describe(group)}"
    start = time.perf_counter()
    try:
        work = launch()
        completed = work is None or work.wait(limit)
        record_time(time.perf_counter() - start)
    except RuntimeError as exc:
        status = "timed out" if "timed out" in str(exc).lower() else "failed"
        raise CollectiveError(f"{where} {status} (timeout {limit.total_seconds():g}s): {exc}") from exc
    if not completed:
        raise CollectiveError(f"{where} timed out (timeout {limit.total_seconds():g}s)")


def all_to_all_bytes(
    send: Tensor, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None, link: str = "flat"
) -> Tensor:
    """Exchange equal slots: slot ``j`` of ``send`` goes to rank ``j``; returns the received slots."""
    world = get_world_size(group)
    if world == 1:
        return send
    recv = torch.empty_like(send)
    _run("all_to_all_single", group, timeout, lambda: dist.all_to_all_single(recv, send, group=group, async_op=True))
    record("all_to_all", send.numel() * send.element_size() * (world - 1) // world, link)
    return recv


def all_gather_bytes(
    slot: Tensor, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None, link: str = "flat"
) -> Tensor:
    """Concatenate every rank's equal-sized flat ``slot`` in rank order."""
    world = get_world_size(group)
    if world == 1:
        return slot
    out = slot.new_empty(world * slot.numel())
    _run("all_gather", group, timeout, lambda: _all_gather_flat(out, slot, group=group, async_op=True))
    record("all_gather", slot.numel() * slot.element_size() * (world - 1), link)
    return out


def all_gather_object_sizes(
    values: list[int],
    group: dist.ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """All ranks' integer vectors as a ``(world, len(values))`` int64 CPU tensor (cheap agreement checks).

    ``device`` is where the exchange happens: the parameters' device, so NCCL gets CUDA tensors.
    """
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    return all_gather_bytes(mine, group, timeout).view(-1, len(values)).cpu()


def reduce_scatter_mean(
    tensor: Tensor, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None, link: str = "flat"
) -> Tensor:
    """Average of slot ``rank`` of ``tensor`` (``world`` equal slots) over the group; returns that slot."""
    world = get_world_size(group)
    if world == 1:
        return tensor
    out = tensor.new_empty(tensor.numel() // world)
    _run("reduce_scatter", group, timeout, lambda: _reduce_scatter_flat(out, tensor, group=group, async_op=True))
    record("reduce_scatter", (world - 1) * out.numel() * out.element_size(), link)
    return out.div_(world)


def new_subgroups(partition: list[list[int]], group: dist.ProcessGroup | None, timeout: timedelta) -> list:
    """One process group per list of group ranks in ``partition`` (every rank must call, in the same order)."""
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return [dist.new_group([to_global(r) for r in ranks], timeout=timeout) for ranks in partition]


def all_reduce_mean(
    tensor: Tensor, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None, link: str = "flat"
) -> Tensor:
    """In-place average over the group (sum, then divide by world size)."""
    world = get_world_size(group)
    if world == 1:
        return tensor
    _run("all_reduce", group, timeout, lambda: dist.all_reduce(tensor, group=group, async_op=True))
    record("all_reduce", 2 * (world - 1) * tensor.numel() * tensor.element_size() // world, link)
    return tensor.div_(world)


def all_reduce_max(
    tensor: Tensor, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None
) -> Tensor:
    """In-place element-wise maximum over the group."""
    world = get_world_size(group)
    if world == 1:
        return tensor
    _run(
        "all_reduce(max)",
        group,
        timeout,
        lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True),
    )
    record("all_reduce", 2 * (world - 1) * tensor.numel() * tensor.element_size() // world)
    return tensor


def broadcast(
    tensor: Tensor, src: int = 0, group: dist.ProcessGroup | None = None, timeout: float | timedelta | None = None
) -> Tensor:
    """In-place broadcast from group rank ``src``."""
    world = get_world_size(group)
    if world == 1:
        return tensor
    global_src = src if group is None else dist.get_global_rank(group, src)
    _run("broadcast", group, timeout, lambda: dist.broadcast(tensor, global_src, group=group, async_op=True))
    if get_rank(group) == src:
        record("broadcast", tensor.numel() * tensor.element_size() * (world - 1))
    return tensor
