"""An epoch's gloo group as a quorum's members use it: each collective waited for while the store
says whether a member gave the epoch up (``_quorum.py``)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._transport import Work, _GlooGroup

if TYPE_CHECKING:
    from ._quorum import Quorum

__all__ = ["EpochGroup", "POLL_MAX"]

POLL_MAX = 0.05  # seconds between two looks at the store, at most


class _Watched:
    """A collective of an epoch's group, waited for while the store is asked, every few hundredths
    of a second, whether a member has given the epoch up: a member waiting on a live peer that has
    left the collective (after its own failed) would otherwise wait for the whole timeout."""

    __slots__ = ("work", "quorum", "epoch")

    def __init__(self, work: Work, quorum: Quorum, epoch: int) -> None:
        self.work, self.quorum, self.epoch = work, quorum, epoch

    def wait(self, timeout: timedelta) -> bool:
        # Polled, not waited for in slices: gloo may fail a collective whose wait timed out.
        start = time.monotonic()
        looked, pause = start, 0.0002
        while not self.work.is_completed():
            now = time.monotonic()
            if now - looked > POLL_MAX:
                looked = now
                if self.quorum._given_up(self.epoch):
                    raise RuntimeError(f"a member of {self.quorum.describe()} gave the epoch up (a peer died or "
                                       "failed)")
            if now - start > timeout.total_seconds():
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        return self.work.wait(timeout)  # its result, or what failed it


class EpochGroup:
    """The :class:`Transport` of one of an epoch's gloo groups: its collectives watched (:class:`_Watched`)."""

    backend = "torch"
    concurrent = True
    worker_threads = True
    sums_half = True
    device = torch.device("cpu")
    __slots__ = ("group", "quorum", "epoch")

    def __init__(self, group: _GlooGroup, quorum: Quorum, epoch: int) -> None:
        self.group, self.quorum, self.epoch = group, quorum, epoch

    def size(self) -> int:
        return self.group.size()

    def rank(self) -> int:
        return self.group.rank()

    def describe(self) -> str:
        return f"{self.quorum.describe()} ({self.group.describe()})"

    def all_to_all(self, recv: Tensor, send: Tensor) -> Work:
        return _Watched(self.group.all_to_all(recv, send), self.quorum, self.epoch)

    def all_gather(self, out: Tensor, slot: Tensor) -> Work:
        return _Watched(self.group.all_gather(out, slot), self.quorum, self.epoch)

    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> Work:
        return _Watched(self.group.reduce_scatter_sum(out, tensor), self.quorum, self.epoch)

    def all_reduce(self, tensor: Tensor, op: str) -> Work:
        return _Watched(self.group.all_reduce(tensor, op), self.quorum, self.epoch)

    def broadcast(self, tensor: Tensor, src: int) -> Work:
        return _Watched(self.group.broadcast(tensor, src), self.quorum, self.epoch)

    def barrier(self) -> Work:
        return _Watched(self.group.barrier(), self.quorum, self.epoch)

    def split(self, partition: list[list[int]], timeout: timedelta) -> Any:
        return self.group.split(partition, timeout)

    def duplicate(self, timeout: timedelta) -> Any:
        return self.quorum.duplicate(timeout)
