"""A quorum of replicas that re-forms itself, over a store: training that goes on when a replica
dies and takes in one that comes, without a restart (torchft's quorum, on torch.distributed's own
pieces: a ``TCPStore`` that no replica hosts, and gloo groups made directly over it).

The replicas agree through the store's atomic ``compare_set``: whoever writes a key first decides
it, and every other replica reads that decision. What is agreed:

- **an epoch's plan**: its members in rank order (``"members"``), those of them that must receive
  the training state from a peer before they count (``"new"``), and how many registered joiners it
  has taken in (``"joined"``). Each epoch has a gloo group of its own.
- **a commit** after each exchange: every member writes whether its collectives completed; the
  exchange is committed only where every member's did, else every member drops its result and
  the epoch ends. A dead peer can leave some ranks with a complete all-gather and others with an
  error: without the commit they would go on from different states.
- **the next epoch** after an aborted commit: the members that still hold the state arrive; the
  plan is the ones that arrived, decided once every other member of the epoch has arrived or its
  heartbeat (a counter each replica's thread advances every ``heartbeat`` seconds) has stood
  still for ``dead_after`` seconds.
- **admissions**: at the points the optimizer offers (after a synchronisation has landed), the
  joiners registered so far, taken in by a new epoch.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from ._dist import CollectiveError, to_timedelta
from ._epoch import POLL_MAX, EpochGroup
from ._transport import Work, connect_store, gloo_group

__all__ = ["Quorum"]

_log = logging.getLogger("onebit.comm")
_POLL = 0.002  # seconds between two looks at the store, doubled up to POLL_MAX while waiting


class Quorum:
    """A group of replicas (one process each) whose membership changes while they train: a replica
    that dies is left behind at the next synchronisation, one that starts is taken in after one,
    its state copied from a live peer. Pass it as ``group`` to :class:`onebit.DiLoCo`, which
    commits each synchronisation and re-runs it among the survivors where a peer died.

    The store is a ``torch.distributed.TCPStore`` served by a process that does not train (a
    replica that served it would take the quorum down with it): ``store="host:port"``, or a
    store client. The replicas' collectives run on gloo groups made over it, on the CPU.

    Args:
        store: ``"host:port"`` of the store, or a ``torch.distributed.Store``.
        replica_id: this replica's name in messages (default: host name and process id); a
            replica that starts again takes a new identity under it.
        min_replicas: the replicas the first epoch waits for (later ones join it).
        timeout: seconds a collective, a group's formation or a commit may take before the
            epoch is given up (a peer that hangs without dying).
        join_timeout: seconds :meth:`join` waits to be taken in.
        heartbeat: seconds between two beats of this replica's heartbeat.
        dead_after: seconds without a beat after which a replica counts as dead.
        name: the prefix of this quorum's keys in the store (several jobs may share a store).

    Examples:
        >>> quorum = onebit.comm.Quorum("storehost:29400", min_replicas=4)  # doctest: +SKIP
        >>> opt = onebit.DiLoCo(model.parameters(), sync_every=64, group=quorum)  # doctest: +SKIP
    """

    backend = "torch"
    concurrent = True
    worker_threads = True
    sums_half = True
    device = torch.device("cpu")
    # Capability: its membership changes between collectives (see onebit.comm.reforms)
    reforms = True

    def __init__(self, store: str | torch.distributed.Store, replica_id: str | None = None, *,
                 min_replicas: int = 1, timeout: float = 60.0, join_timeout: float = 600.0,
                 heartbeat: float = 0.5, dead_after: float = 3.0, name: str = "onebit") -> None:
        from .._checks import check_positive, check_positive_int

        self.min_replicas = check_positive_int("min_replicas", min_replicas)
        self.timeout = to_timedelta(timeout)
        self.join_timeout = check_positive("join_timeout", join_timeout)
        self.heartbeat = check_positive("heartbeat", heartbeat)
        self.dead_after = check_positive("dead_after", dead_after)
        if self.dead_after <= 2 * self.heartbeat:
            raise ValueError(f"Invalid dead_after value: {dead_after!r} (expected more than twice heartbeat="
                             f"{heartbeat!r}: a live replica would count as dead between two beats)")
        if not isinstance(name, str) or not name:
            raise ValueError(f"Invalid name value: {name!r} (expected a non-empty str)")
        if replica_id is None:
            replica_id = f"{socket.gethostname()}-{os.getpid()}"
        if not isinstance(replica_id, str) or not replica_id or "\n" in replica_id:
            raise ValueError(f"Invalid replica_id value: {replica_id!r} (expected a non-empty str on one line)")
        self.replica_id, self.name = replica_id, name
        self.token = f"{replica_id}#{uuid.uuid4().hex[:8]}"  # this incarnation: a restart is a new replica
        # Two clients: the heartbeat's thread never waits behind the main thread's requests.
        if isinstance(store, str):
            self._store = torch.distributed.PrefixStore(name, connect_store(store, self.timeout))
            beat_store = torch.distributed.PrefixStore(name, connect_store(store, self.timeout))
        elif isinstance(store, torch.distributed.Store):
            self._store = torch.distributed.PrefixStore(name, store)
            beat_store = torch.distributed.PrefixStore(name, store.clone() if hasattr(store, "clone") else store)
        else:
            raise TypeError(f"Invalid store value: {store!r} (expected 'host:port' or a torch.distributed.Store)")
        self._beat_store = beat_store  # also where the collectives' waits look for a member giving up
        self.epoch = -1
        self.plan: dict[str, Any] = {"members": [], "new": [], "joined": 0}
        self.member = False  # in the current epoch's plan, its group formed
        self.needs_state = True  # until a peer's state has been committed here (or the first epoch)
        self.reformed = 0  # epochs entered after a failure
        self._group: EpochGroup | None = None
        self._duplicates: list[EpochGroup] = []
        self._votes = 0
        self._tried = -1  # the highest epoch this replica has entered or tried to
        self._unhealed: list[str] = []  # this epoch's newcomers until their state is committed
        self._beats: dict[str, tuple[int, float]] = {}  # replica -> (its last count seen, when it changed)
        self._stop = threading.Event()
        self._beat_thread = threading.Thread(target=self._beat, args=(beat_store,), daemon=True,
                                             name="onebit-quorum-heartbeat")
        self._beat_thread.start()

    # ------------------------------------------------------------------ membership
    def join(self) -> None:
        """Register, and wait until an epoch takes this replica in: the first one once
        ``min_replicas`` have registered, else the next admission of a running quorum (then
        :attr:`needs_state`: a peer's state must be received and committed first). Registers
        again where the epoch that took it in could not form."""
        self._leave_group()
        self.member, self.needs_state = False, True
        deadline = time.monotonic() + self.join_timeout
        while True:
            self._store.append("joiners", self.token + "\n")  # one atomic write: a joiner half-registered is none
            pause = _POLL
            while True:
                if not self._store.check(["e0/plan"]):  # the job's first epoch
                    tokens = self._registered()
                    if len(tokens) >= self.min_replicas:
                        # ranks in the order of the replicas' names: the first ranks do not depend on who came first
                        self._decide(0, {"members": sorted(set(tokens)), "new": [], "joined": len(tokens)})
                if self._store.check([f"admit/{self.token}"]):
                    epoch = int(self._store.get(f"admit/{self.token}"))
                    if epoch > self._tried:  # (not an admission this replica has already tried)
                        self._settle(epoch, self._read_plan(epoch))
                        if self.member:
                            return
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {self.replica_id} was not taken into quorum {self.name!r} within "
                                       f"join_timeout={self.join_timeout:g}s")
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX)

    def admit(self, step: int) -> bool:
        """At an admission point of every member (the same ``step``): take in the joiners
        registered so far whose heartbeat moves; True where a new epoch was entered (see
        :attr:`member`)."""
        self._check_member()
        count = len(self._registered())
        agreed = int(self._store.compare_set(f"e{self.epoch}/admit@{step}", "", str(count)))
        if agreed <= self.plan["joined"]:
            return False
        registered = self._registered()  # at least ``agreed`` now: a member saw that many
        tokens = [t for t in dict.fromkeys(registered[self.plan["joined"]:agreed]) if t not in self.plan["members"]]
        tokens = self._moving(tokens)
        epoch = self._tried + 1
        self._decide(epoch, {"members": self.plan["members"] + tokens, "new": tokens, "joined": agreed})
        self._settle(epoch, self._read_plan(epoch))
        return True

    def commit(self, ok: bool) -> bool:
        """Whether every member's collectives since the last commit completed (``ok`` here):
        the same answer on every member. False ends the epoch: call :meth:`recover`."""
        self._check_member()
        v, rank, size = self._votes, self.rank(), self.size()
        self._votes += 1
        base = f"e{self.epoch}/v{v}"
        if not ok:  # first: the members still waiting in a collective of this epoch stop now
            self._store.set(f"e{self.epoch}/down", "1")
        self._store.set(f"{base}/{rank}", "1" if ok else "0")
        if v >= 2:  # every member wrote vote v-1 after deciding v-2: nobody reads it again
            self._store.delete_key(f"e{self.epoch}/v{v - 2}/{rank}")
        proposal = "abort"
        if ok:
            keys = [f"{base}/{r}" for r in range(size)]
            start, pause = time.monotonic(), _POLL
            looked = start
            while not self._store.check([f"{base}/d"]):
                if self._store.check(keys):
                    if all(vote == b"1" for vote in self._store.multi_get(keys)):
                        proposal = "commit"
                    break
                now = time.monotonic()
                if now - start > self.timeout.total_seconds():
                    break
                if now - looked > self.heartbeat:  # a member that died before it could vote
                    looked = now
                    if not all(map(self._alive, self.plan["members"])):
                        break
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX)
        return self._store.compare_set(f"{base}/d", "", proposal) == b"commit"

    def healed(self) -> None:
        """The newcomers' state has been committed: they hold the training state now."""
        self._unhealed = []
        self.needs_state = False

    def recover(self) -> None:
        """After an aborted :meth:`commit`: the next epoch, among this epoch's members that hold
        the state and are alive. A replica that must receive the state first leaves instead, and
        so does one that arrived after the others had decided (see :attr:`member`); either
        :meth:`join`\\ s again."""
        self._check_member()
        self.reformed += 1
        self._store.set(f"e{self.epoch}/down", "1")  # a member still in a collective of this epoch stops
        self._leave_group()
        if self.needs_state:
            self.member = False
            return
        epoch, plan = self._after_failure()
        self._settle(epoch, plan)

    def close(self) -> None:
        """Stop the heartbeat and retire this replica's groups (it counts as dead ``dead_after``
        seconds later)."""
        self._stop.set()
        self._leave_group()
        self.member = False

    def __enter__(self) -> Quorum:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def newcomers(self) -> list[int]:
        """The ranks of this epoch that must receive the state (empty once healed)."""
        return [self.plan["members"].index(t) for t in self._unhealed]

    @property
    def source(self) -> int:
        """The rank that sends the state to the newcomers: the first that holds it."""
        return next(r for r, t in enumerate(self.plan["members"]) if t not in self._unhealed)

    # ------------------------------------------------------------------ the Transport of the epoch
    def size(self) -> int:
        return self._current().size()

    def rank(self) -> int:
        return self._current().rank()

    def describe(self) -> str:
        return f"quorum {self.name!r} epoch {self.epoch}"

    def all_to_all(self, recv: Tensor, send: Tensor) -> Work:
        return self._current().all_to_all(recv, send)

    def all_gather(self, out: Tensor, slot: Tensor) -> Work:
        return self._current().all_gather(out, slot)

    def reduce_scatter_sum(self, out: Tensor, tensor: Tensor) -> Work:
        return self._current().reduce_scatter_sum(out, tensor)

    def all_reduce(self, tensor: Tensor, op: str) -> Work:
        return self._current().all_reduce(tensor, op)

    def broadcast(self, tensor: Tensor, src: int) -> Work:
        return self._current().broadcast(tensor, src)

    def barrier(self) -> Work:
        return self._current().barrier()

    def split(self, partition: list[list[int]], timeout: timedelta) -> Any:
        return self._current().split(partition, timeout)

    def duplicate(self, timeout: timedelta) -> EpochGroup:
        """A second group of this epoch's members (every member calls it, in the same order)."""
        group = self._current()
        name = f"e{self.epoch}/dup{len(self._duplicates)}"
        try:
            made = EpochGroup(gloo_group(self._store, name, group.rank(), group.size(), timeout), self, self.epoch)
        except RuntimeError as exc:
            raise CollectiveError(f"forming {self.describe()}'s group {name} failed: {exc}") from exc
        self._duplicates.append(made)
        return made

    # ------------------------------------------------------------------ internals
    def _current(self) -> EpochGroup:
        if self._group is None:
            raise RuntimeError(f"replica {self.replica_id} is not a member of {self.describe()}: join() first")
        return self._group

    def _check_member(self) -> None:
        self._current()

    def _given_up(self, epoch: int) -> bool:
        # On the heartbeat's client: the main one may be held by a group's formation, which waits
        return self._beat_store.check([f"e{epoch}/down"])

    def _registered(self) -> list[str]:
        """The joiners registered so far, in order (a replica registered again appears again)."""
        if not self._store.check(["joiners"]):
            return []
        return [t for t in self._store.get("joiners").decode().split("\n") if t]

    def _moving(self, tokens: list[str]) -> list[str]:
        """Those of ``tokens`` whose heartbeat moves within ``dead_after`` seconds: a joiner that
        died before it was taken in would hold its epoch's group up for the whole ``timeout``."""
        first = {t: self._store.add(f"hb/{t}", 0) for t in tokens}
        moving: set[str] = set()
        deadline = time.monotonic() + self.dead_after
        while len(moving) < len(tokens) and time.monotonic() < deadline:
            time.sleep(self.heartbeat / 4)
            moving.update(t for t in tokens if t not in moving and self._store.add(f"hb/{t}", 0) != first[t])
        return [t for t in tokens if t in moving]

    def _decide(self, epoch: int, plan: dict[str, Any]) -> None:
        """Propose ``plan`` for ``epoch`` (the first proposal stands) and admit its newcomers."""
        decided = json.loads(self._store.compare_set(f"e{epoch}/plan", "", json.dumps(plan)))
        for token in decided["members"]:
            if token in decided["new"] or epoch == 0:
                self._store.set(f"admit/{token}", str(epoch))

    def _read_plan(self, epoch: int) -> dict[str, Any]:
        return json.loads(self._store.get(f"e{epoch}/plan"))

    def _settle(self, epoch: int, plan: dict[str, Any]) -> None:
        """Enter ``epoch``; where its group cannot form (a member died meanwhile), the next one
        among the live, until one forms or this replica is left out."""
        first = self._tried < 0  # the job's first epoch, entered by its first replicas: nothing to receive
        while True:
            self._leave_group()
            self.epoch, self.plan, self._votes = epoch, plan, 0
            self._tried = max(self._tried, epoch)
            self._unhealed = list(plan["new"])
            if self.token not in plan["members"]:
                self.member = False
                return
            if epoch == 0 and first:
                self.needs_state = False
            rank, size = plan["members"].index(self.token), len(plan["members"])
            try:
                self._group = EpochGroup(gloo_group(self._store, f"e{epoch}/pg", rank, size, self.timeout), self,
                                          epoch)
                self.member = True
                _log.info("replica %s: epoch %d, rank %d of %d", self.replica_id, epoch, rank, size)
                return
            except RuntimeError as exc:
                _log.warning("replica %s: epoch %d's group did not form (%s)", self.replica_id, epoch, exc)
                if self.needs_state:  # nothing to carry on from: join again
                    self.member = False
                    return
                self.reformed += 1
                epoch, plan = self._after_failure()

    def _after_failure(self) -> tuple[int, dict[str, Any]]:
        """Arrive at the next epoch; decide it (if nobody has) once every other member of this
        one that holds the state has arrived or stopped beating."""
        epoch = self._tried + 1
        self._tried = epoch
        self._store.append(f"e{epoch}/arrivals", self.token + "\n")
        expected = [t for t in self.plan["members"] if t not in self._unhealed]
        # A live member may come up to a group formation's timeout later than the first (its own
        # formation still waiting when another's had failed): twice that, for those still beating
        deadline, pause = time.monotonic() + 2 * self.timeout.total_seconds(), _POLL
        while not self._store.check([f"e{epoch}/plan"]):
            arrived = set(self._arrivals(epoch))
            waiting = [t for t in expected if t not in arrived and self._alive(t)]
            if not waiting or time.monotonic() > deadline:
                members = [t for t in expected if t in arrived]
                self._decide(epoch, {"members": members, "new": [], "joined": self.plan["joined"]})
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX)
        return epoch, self._read_plan(epoch)

    def _arrivals(self, epoch: int) -> list[str]:
        key = f"e{epoch}/arrivals"
        return [t for t in self._store.get(key).decode().split("\n") if t] if self._store.check([key]) else []

    def _alive(self, token: str) -> bool:
        """Whether ``token``'s heartbeat has moved within ``dead_after`` seconds of this replica's
        looks at it (a replica seen for the first time counts as alive)."""
        if token == self.token:
            return True
        count, now = self._store.add(f"hb/{token}", 0), time.monotonic()
        last = self._beats.get(token)
        if last is None or last[0] != count:
            self._beats[token] = (count, now)
            return True
        return now - last[1] < self.dead_after

    def _beat(self, store: torch.distributed.Store) -> None:
        while not self._stop.is_set():
            try:
                store.add(f"hb/{self.token}", 1)
            except RuntimeError as exc:  # the store is gone: the next request of the main thread raises
                _log.error("replica %s: heartbeat stopped (%s)", self.replica_id, exc)
                return
            self._stop.wait(self.heartbeat)

    def _leave_group(self) -> None:
        """Retire this epoch's groups. Never aborted nor destroyed here: with a peer dead, gloo's
        abort and its destructor wait for the collectives still on the group to time out."""
        _RETIRED.extend(g for g in [self._group, *self._duplicates] if g is not None)
        self._group, self._duplicates = None, []


# The groups of past epochs, kept to the end of the process (a few per failure or admission): the
# thread that dropped the last reference to one would run its destructor, which waits for the
# collectives a dead peer left on it. At exit they are left to the OS, as onebit.comm's _HELD.
_RETIRED: list[EpochGroup] = []


@atexit.register
def _leave_them() -> None:
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_RETIRED))
