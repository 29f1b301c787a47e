"""A replica's place in a :class:`onebit.comm.Quorum`: what torchft's ``Manager`` does for its
DiLoCo -- every collective committed by each member, re-run among the survivors where one died,
the newcomers given a live peer's state -- for an optimizer that hands it three operations:
rebuild its collectives over the new group, give its state, take a peer's.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from .. import comm

__all__ = ["Healed", "Membership"]

_log = logging.getLogger("onebit.optim")


class Healed(Exception):
    """This replica was left out of the quorum and took a peer's state: the step it was in is over."""


class Membership:
    """``quorum``'s protocol for ``owner``: ``regroup()`` rebuilds its collectives over the group of
    a new epoch (called once per epoch, every member in the same order); ``save()`` is the state
    a newcomer takes (any object ``torch.save`` writes and ``weights_only`` loads) and
    ``load(state)`` takes it; ``step()`` is the owner's step count, for the log. The optimizer
    keeps its own loop: it calls :meth:`run` around each collective whose failure must not
    diverge the replicas, and :meth:`follow` after an admission."""

    __slots__ = ("quorum", "owner", "timeout", "epoch", "_regroup", "_save", "_load", "_step")

    def __init__(self, quorum: comm.Quorum, owner: str, timeout: timedelta, *, regroup: Callable[[], None],
                 save: Callable[[], Any], load: Callable[[Any], None], step: Callable[[], int]) -> None:
        self.quorum, self.owner, self.timeout = quorum, owner, timeout
        self._regroup, self._save, self._load, self._step = regroup, save, load, step
        if not quorum.member:
            quorum.join()
        self.epoch = quorum.epoch  # the epoch the owner's collectives are built for (after this, in its constructor)

    def run(self, first: Callable[[], Any], again: Callable[[], Any] | None = None) -> Any:
        """``first()``, whose collectives only read this replica's state, committed on every member;
        where a member's failed, the quorum re-forms among the survivors and ``again()`` (default
        ``first()``) runs on the new group, until one commits. Raises :class:`Healed` where this
        replica was left out and took a peer's state instead."""
        quorum, attempt = self.quorum, first
        while True:
            try:
                out, ok = attempt(), True
            except comm.CollectiveError as exc:
                _log.warning("%s at step %d: %s; re-forming %s", self.owner, self._step(), exc, quorum.describe())
                out, ok = None, False
            if quorum.commit(ok):
                return out
            quorum.recover()
            if self.follow():
                raise Healed
            attempt = again or first

    def follow(self) -> bool:
        """After the quorum entered an epoch: the collectives rebuilt over its group, the state sent
        to its newcomers, committed (else on to the next epoch). This replica joins again where
        it was left out. True where it received a peer's state."""
        quorum, received = self.quorum, False
        while True:
            if not quorum.member:
                quorum.join()
            ok = True
            try:
                if quorum.epoch != self.epoch:
                    self._regroup()
                    self.epoch = quorum.epoch
                if quorum.newcomers:
                    received = self._share_state() or received
            except comm.CollectiveError as exc:
                _log.warning("%s: %s taking in replicas: %s", self.owner, quorum.describe(), exc)
                ok = False
            if quorum.commit(ok):
                quorum.healed()
                return received
            quorum.recover()

    def _share_state(self) -> bool:
        """The :attr:`~onebit.comm.Quorum.source`'s state broadcast to every member as bytes and
        loaded by the newcomers; True here if loaded."""
        quorum, timeout = self.quorum, self.timeout
        payload = torch.empty(0, dtype=torch.uint8)
        if quorum.rank() == quorum.source:
            buffer = io.BytesIO()
            torch.save(self._save(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = comm.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), quorum.source, quorum, timeout)
        if quorum.rank() != quorum.source:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        comm.broadcast(payload, quorum.source, quorum, timeout)
        if not quorum.needs_state:
            return False
        self._load(torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True))
        _log.info("%s: replica %s took the state of step %d from rank %d of %s", self.owner, quorum.replica_id,
                  self._step(), quorum.source, quorum.describe())
        return True
