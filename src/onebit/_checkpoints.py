"""Per-rank checkpoints that a death in the middle of a save cannot break (:class:`Checkpoints`)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import torch

from . import comm

__all__ = ["Checkpoints"]

_log = logging.getLogger("onebit")
_STEP = re.compile(r"step-(\d{9})")
_DONE = "complete.json"  # written last, by rank 0, once every rank's file is in place


class Checkpoints:
    """A run's checkpoints in ``directory``, one file per rank and step, each step a whole.

    The onebit optimizers keep state of each rank's own (error-feedback buffers, random state,
    DiLoCo's parameters between synchronisations), so every rank saves its own file. A save
    writes ``step-<step>/rank<r>.pt`` through a temporary file and a rename, waits for every
    rank (a barrier), and only then marks the step complete; the ``keep`` newest complete steps
    stay. A rank that dies in the middle of a save -- a node lost, the job killed -- leaves that
    step unmarked, and :meth:`load` resumes from the last complete one: no rank resumes from a
    step another rank never finished saving. ``torch.distributed.checkpoint`` is built for
    state that is the same on every rank or sharded by key, and would merge the ranks'
    differing buffers saved under one name.

    ``directory`` must be the same storage on every rank (one machine, or a shared filesystem).
    Loaded on another world size (an elastic restart after a node was lost or came back), rank
    ``r`` reads the file of rank ``r`` modulo the saved world size; the optimizer then restarts
    its per-rank buffers and says so.

    Example::

        checkpoints = onebit.Checkpoints("checkpoints")
        start = 0
        if (found := checkpoints.load()) is not None:
            start, state = found
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        for step in range(start + 1, steps + 1):
            ...
            if step % 100 == 0:
                checkpoints.save(step, model=model.state_dict(), opt=opt.state_dict())
    """

    __slots__ = ("directory", "keep", "group", "timeout")

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 2, group: comm.Group = None,
                 timeout: float | timedelta | None = None) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"Invalid directory: {directory!r} (expected a path)")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Invalid keep value: {keep!r} (expected an int >= 1)")
        if comm.reforms(group):
            raise ValueError("Invalid group for Checkpoints: a onebit.comm.Quorum (its barrier would stop the "
                             "others when a replica is lost during a save); save the state of the quorum's rank 0 "
                             "with no group, as docs/node-loss.md shows")
        self.directory, self.keep, self.group = Path(directory), keep, group
        self.timeout = comm.to_timedelta(timeout)
        _warn_if_store_shared_across_restarts()

    def save(self, step: int, **state: Any) -> Path:
        """Save this rank's ``state`` (keyword arguments: state dicts, tensors, plain values) as
        ``step``; every rank calls it. Returns this rank's file."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Invalid step value: {step!r} (expected an int >= 0)")
        rank, world = comm.get_rank(self.group), comm.get_world_size(self.group)
        where = self.directory / f"step-{step:09d}"
        where.mkdir(parents=True, exist_ok=True)
        path = where / f"rank{rank}.pt"
        _write_atomically(path, lambda f: torch.save(state, f))
        comm.barrier(self.group, self.timeout)  # every rank's file is in place
        if rank == 0:
            done = json.dumps({"step": step, "world_size": world}).encode()
            _write_atomically(where / _DONE, lambda f: f.write(done))
            self._prune(step)
        return path

    def latest(self) -> int | None:
        """The newest complete step in the directory (None: none)."""
        steps = self._steps()
        return steps[-1] if steps else None

    def load(self) -> tuple[int, dict[str, Any]] | None:
        """``(step, state)`` of the newest step every rank sees complete (None: nothing saved
        yet); every rank calls it. The files load with ``weights_only=True``; where one cannot be
        read (truncated, or not a checkpoint), every rank raises ``ValueError`` naming it."""
        rank, world = comm.get_rank(self.group), comm.get_world_size(self.group)
        newest = self.latest()
        mine = -1.0 if newest is None else float(newest)
        # The ranks agree on one step: the oldest of their newest (a shared filesystem may show
        # a new step to some ranks first). One all-reduce(max) of (newest, -newest).
        both = torch.tensor([mine, -mine], dtype=torch.float64, device=comm.device_of(self.group))
        highest, lowest = (int(v) for v in comm.all_reduce_max(both, self.group, self.timeout).tolist())
        agreed = -lowest
        if highest < 0:
            return None
        if agreed < 0:
            raise RuntimeError(f"{self.directory}: rank {rank} or another finds no complete "
                               f"checkpoint where a rank finds step {highest}: the directory must be the same "
                               "storage on every rank")
        where = self.directory / f"step-{agreed:09d}"
        try:
            state, error = self._read(where, rank, world), None
        except Exception as exc:  # raised below, once every rank knows: the others would wait for this one
            state, error = None, exc
        # Every rank learns which could not read its files (one flag a rank, all-reduce(max)) and
        # raises: a rank going on alone would wait in its first collective for the one stopped
        # here until the timeout, and the error that says why would be on that rank only.
        flags = torch.zeros(world, dtype=torch.float64, device=comm.device_of(self.group))
        flags[rank] = error is not None
        failed = comm.all_reduce_max(flags, self.group, self.timeout).nonzero().flatten().tolist()
        if error is not None:
            raise error
        if failed:
            who = f"rank {failed[0]} cannot read its" if len(failed) == 1 else \
                f"ranks {', '.join(map(str, failed))} cannot read their"
            raise ValueError(f"checkpoint {where} cannot be resumed: {who} files there (the error on each says "
                             f"why); to resume from the step before, if one is kept, remove {where / _DONE}")
        return agreed, state

    def _read(self, where: Path, rank: int, world: int) -> dict[str, Any]:
        """This rank's state in the complete step ``where``: the file of rank ``rank`` modulo the
        saved world size (its own, on the same world size); ``ValueError`` naming a file that
        cannot be read."""
        try:
            saved = int(json.loads((where / _DONE).read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"checkpoint {where / _DONE} cannot be read: {exc!r}") from None
        source = rank % saved
        if saved != world:
            _log.warning("checkpoint %s was saved on %d ranks, loaded on %d: rank %d reads rank %d's file",
                         where.name, saved, world, rank, source)
        path = where / f"rank{source}.pt"
        try:
            return torch.load(path, weights_only=True)
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as exc:
            raise ValueError(f"checkpoint {path} cannot be read (truncated or not a checkpoint): {exc}") from None

    def _prune(self, step: int) -> None:
        """Remove the complete steps older than the ``keep`` newest, and the unfinished saves
        older than ``step`` (a rank died in them)."""
        complete = self._steps()
        oldest_kept = complete[-self.keep:][0]
        for path in self.directory.iterdir():
            m = _STEP.fullmatch(path.name)
            n = int(m.group(1)) if m else None
            if n is not None and (n < oldest_kept or (n < step and n not in complete)):
                shutil.rmtree(path, ignore_errors=True)

    def _steps(self) -> list[int]:
        """The complete steps, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (_STEP.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m and (self.directory / m.group(0) / _DONE).is_file())


def _warn_if_store_shared_across_restarts() -> None:
    """Under torchrun with restarts allowed, say so where its workers reuse one store across
    restarts (torchrun's default on torch 2.13): a worker started again can read the address a
    peer of the previous round published and fail to connect (connection refused, one more
    restart each time, until ``--max-restarts`` runs out), and a node that comes back cannot
    join (it waits for keys the others never write again: pytorch#147064). With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment, each round's rank 0
    starts a new store: measured on the emulated cluster (``benchmarks/node_loss.py``)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        warnings.warn("torchrun shares one rendezvous store with its workers across restarts: a restarted worker can "
                      "read a dead peer's address (connection refused, more restarts) and a node that comes back "
                      "cannot rejoin (pytorch#147064); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                      "its environment on every node", stacklevel=3)


def _write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` into a temporary file, on disk before it takes ``path``'s name: a crash leaves the
    old file or the whole new one, never a part."""
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
