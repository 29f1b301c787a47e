"""DiLoCo on a onebit.comm.Quorum: replicas (real processes, gloo groups over a TCPStore served by
the test) that lose one of theirs or take one in, and go on without a restart.

The oracle is the same training restarted by hand: the plain DiLoCo on torch.distributed's
process groups up to the step before the synchronisation the change lands in, each rank's state
saved, then a new job of the new world size loading them (the newcomer: rank 0's state). The
replicas of the live run must end bit for bit where the restarted job ends.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _harness import run_ranks
from torch.distributed import TCPStore

import onebit
from onebit.optim import _flight, _fragments

STEPS = 24
SYNC = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train_step(model: torch.nn.Module, opt: onebit.DiLoCo, replica: int, step: int) -> None:
    """Replica ``replica``'s batch of ``step``: its own data whatever its rank."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(16, 8, generator=g)
    opt.zero_grad()
    F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()


def _result(model: torch.nn.Module, opt: onebit.DiLoCo) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "anchors": [a.clone() for a in opt._anchors], "world": opt.world_size, "rank": opt.rank,
            "step": opt.stats["step"]}


def _replica(replica: int, port: int, replicas: int, config: dict, die: tuple[int, str] | None, out: str,
             go_at: int | None) -> None:
    """One live replica: trains to STEPS on the quorum; ``die=(step, how)`` ends it there, before
    the step (``"before"``) or inside it, once its exchange is due (``"exchange"``)."""
    torch.set_num_threads(1)
    if go_at is not None and replica == replicas:  # a joiner: starts once the others are under way
        TCPStore("127.0.0.1", port, is_master=False).wait(["go"], timedelta(seconds=120))
    quorum = onebit.comm.Quorum(f"127.0.0.1:{port}", f"r{replica}", min_replicas=replicas, timeout=30,
                                heartbeat=0.2, dead_after=2.0)
    model = _model()
    opt = onebit.DiLoCo(model.parameters(), lr=1e-2, sync_every=SYNC, group=quorum, **config)
    joined = opt.stats["step"]
    while opt.stats["step"] < STEPS:
        step = opt.stats["step"] + 1
        if die is not None and step == die[0]:
            if die[1] == "before":
                os._exit(3)
            _fragments.Fragment.send = lambda *a, **k: os._exit(3)  # after the agreement, before its exchange
        if go_at is not None and replica < replicas and step == go_at:  # the joiner starts; wait until it has come
            store = TCPStore("127.0.0.1", port, is_master=False)
            store.set("go", "1")
            while len(store.get("onebit/joiners").split()) <= replicas:  # the quorum's register of joiners
                time.sleep(0.01)
        _train_step(model, opt, replica, step)
    torch.save({**_result(model, opt), "joined": joined}, out)
    quorum.close()


def _run(procs: list) -> None:
    """Start the replicas and wait for them; one still running after 240 s is killed (it hung)."""
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        if p.is_alive():
            p.kill()
            p.join()


def _live(tmp_path: Path, starting: int, config: dict, *, die=None, joiner: bool = False) -> dict[int, dict]:
    """The live run: ``starting`` replicas (and a joiner, replica ``starting``, which they wait for
    at step 6: it is taken in after the synchronisation of step 8); each survivor's result."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    count = starting + joiner
    procs = [ctx.Process(target=_replica, args=(r, store.port, starting, config, die if r == starting - 1 else None,
                                                 str(tmp_path / f"live{r}.pt"), 6 if joiner else None))
             for r in range(count)]
    _run(procs)
    codes = [p.exitcode for p in procs]
    expected = [0] * count
    if die is not None:
        expected[starting - 1] = 3
    assert codes == expected, codes
    return {r: torch.load(tmp_path / f"live{r}.pt") for r in range(count) if codes[r] == 0}


def _phase(rank: int, world: int, config: dict, replicas: list[int], first: int, last: int,
           load: list[str] | None, save: str) -> dict:
    """The restarted job's phase: DiLoCo on the default group, rank r training replica
    ``replicas[r]`` from step ``first`` to ``last``, after loading ``load[r]``; saves its state."""
    model = _model()
    opt = onebit.DiLoCo(model.parameters(), lr=1e-2, sync_every=SYNC, **config)
    if load is not None:
        saved = torch.load(load[rank])
        opt.load_state_dict(saved["state"])
        with torch.no_grad():
            for p, v in zip(model.parameters(), saved["params"]):
                p.copy_(v)
    for step in range(first, last + 1):
        _train_step(model, opt, replicas[rank], step)
    torch.save({"state": opt.state_dict(), "params": [p.detach() for p in model.parameters()]},
               os.path.join(save, f"rank{rank}.pt"))
    return _result(model, opt)


def _assert_same(live: dict, reference: dict) -> None:
    for name in ("params", "anchors"):
        for i, (a, b) in enumerate(zip(live[name], reference[name])):
            assert torch.equal(a, b), f"{name}[{i}] differs by {(a - b).abs().max().item():.3g}"
    assert (live["world"], live["rank"], live["step"]) == (reference["world"], reference["rank"], reference["step"])


# Without errors carried (the paper's outer step): a survivor keeps its own error through a new
# epoch, where a job restarted on another number of ranks starts its errors at zero
NO_ERRORS = {"outer_step": "nesterov"}


@pytest.mark.parametrize(("config", "die", "cut"), [
    # a replica gone before step 10; the survivors notice at the synchronisation of step 12
    (NO_ERRORS, (10, "before"), 11),
    # gone after the agreement of step 12, before its exchange: the survivors' exchange fails
    (NO_ERRORS, (12, "exchange"), 11),
    # streaming: the flight launched at step 9 (fragment 0 of 2, delay 1) lands at 10 without it
    ({"fragments": 2, "delay": 1, "collective": "allreduce"}, (10, "before"), 8),
])
def test_survivors_go_on_as_a_job_restarted_without_the_lost_replica(tmp_path: Path, config: dict, die: tuple,
                                                                     cut: int) -> None:
    live = _live(tmp_path, 3, config, die=die)
    save_a, save_b = tmp_path / "a", tmp_path / "b"
    save_a.mkdir()
    save_b.mkdir()
    run_ranks(_phase, 3, config, [0, 1, 2], 1, cut, None, str(save_a))
    reference = run_ranks(_phase, 2, config, [0, 1], cut + 1, STEPS, [str(save_a / f"rank{r}.pt") for r in (0, 1)],
                          str(save_b))
    assert sorted(live) == [0, 1]
    for r in (0, 1):
        assert live[r]["world"] == 2
        _assert_same(live[r], reference[r])


def test_a_joiner_takes_a_peers_state_and_trains_with_the_others(tmp_path: Path) -> None:
    live = _live(tmp_path, 2, NO_ERRORS, joiner=True)
    admitted = live[2]["joined"]  # the step the others had landed when they took it in
    assert admitted == 8
    save_a, save_b = tmp_path / "a", tmp_path / "b"
    save_a.mkdir()
    save_b.mkdir()
    run_ranks(_phase, 2, NO_ERRORS, [0, 1], 1, admitted, None, str(save_a))
    reference = run_ranks(_phase, 3, NO_ERRORS, [0, 1, 2], admitted + 1, STEPS,
                          [str(save_a / f"rank{r}.pt") for r in (0, 1, 0)], str(save_b))
    for r in (0, 1, 2):
        assert live[r]["world"] == 3
        _assert_same(live[r], reference[r])


def _checkpointed(replica: int, port: int, config: dict, directory: str, cut: int | None, out: str,
                  replicas: int = 2, dies_at: int | None = None) -> None:
    """A replica of a quorum that checkpoints as the page says: the replica of rank 0 saves
    (``onebit.Checkpoints`` with no group) at step ``cut`` and the job ends there; started again
    (``cut=None``), every replica loads that checkpoint and trains to STEPS (the last replica
    dies at step ``dies_at``, as a flight lands)."""
    torch.set_num_threads(1)
    quorum = onebit.comm.Quorum(f"127.0.0.1:{port}", f"r{replica}", min_replicas=replicas, timeout=30,
                                heartbeat=0.2, dead_after=2.0)
    model = _model()
    opt = onebit.DiLoCo(model.parameters(), lr=1e-2, sync_every=SYNC, group=quorum, **config)
    checkpoints = onebit.Checkpoints(directory)
    if opt.stats["step"] == 0 and (found := checkpoints.load()) is not None:
        model.load_state_dict(found[1]["model"])
        opt.load_state_dict(found[1]["opt"])
    while opt.stats["step"] < (cut or STEPS):
        step = opt.stats["step"] + 1
        if step == dies_at and replica == replicas - 1:  # as the flight lands: after the step's checks
            _flight.Flight.join = lambda *a, **k: os._exit(3)
        _train_step(model, opt, replica, step)
        if step == cut and quorum.rank() == 0:
            try:
                state = opt.state_dict()
            except onebit.comm.CollectiveError:
                continue
            checkpoints.save(step, model=model.state_dict(), opt=state)
    opt.wait()
    torch.save(_result(model, opt), out)
    quorum.close()


@pytest.mark.parametrize(("config", "cut"), [
    ({}, 10),  # between synchronisations: each replica's parameters its own, rank 0's taken by all
    ({"fragments": 2, "delay": 1, "collective": "allreduce"}, 9),  # a flight launched at 9, in the checkpoint
])
def test_a_quorum_started_again_from_one_replicas_checkpoint_goes_on_as_a_restarted_job(
        tmp_path: Path, config: dict, cut: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    directory = tmp_path / "checkpoints"
    live = {}
    for phase, until in (("first", cut), ("again", None)):  # a new store: the whole job started again
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs = [ctx.Process(target=_checkpointed, args=(r, store.port, config, str(directory), until,
                                                          str(tmp_path / f"{phase}{r}.pt"))) for r in (0, 1)]
        _run(procs)
        assert [p.exitcode for p in procs] == [0, 0]
        live[phase] = {r: torch.load(tmp_path / f"{phase}{r}.pt") for r in (0, 1)}
    # The reference: the plain DiLoCo, ranks ordered as the quorum's were, every rank of the
    # restarted job loading the state and parameters rank 0 had at the cut.
    save_a, save_b = tmp_path / "a", tmp_path / "b"
    save_a.mkdir()
    save_b.mkdir()
    before = sorted((0, 1), key=lambda r: live["first"][r]["rank"])
    after = sorted((0, 1), key=lambda r: live["again"][r]["rank"])
    run_ranks(_phase, 2, config, before, 1, cut, None, str(save_a))
    reference = run_ranks(_phase, 2, config, after, cut + 1, STEPS, [str(save_a / "rank0.pt")] * 2, str(save_b))
    for rank, replica in enumerate(after):
        _assert_same(live["again"][replica], reference[rank])


def test_a_replica_lost_as_the_checkpoints_flight_lands_leaves_the_others_going_on(tmp_path: Path) -> None:
    # Started again from a checkpoint that holds a flight (launched at 7, landing at 8), a replica
    # dies at step 8 as it lands: the survivors' commit of the landing fails, and they land the
    # loaded flight on the group they re-form (it has nothing to send again).
    ctx = multiprocessing.get_context("spawn")
    config = {"delay": 1}
    codes = {}
    for phase, until, dies_at in (("first", 7, None), ("again", None, 8)):
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs = [ctx.Process(target=_checkpointed, args=(r, store.port, config, str(tmp_path / "checkpoints"), until,
                                                          str(tmp_path / f"{phase}{r}.pt"), 3, dies_at))
                 for r in range(3)]
        _run(procs)
        codes[phase] = [p.exitcode for p in procs]
    assert codes == {"first": [0, 0, 0], "again": [0, 0, 3]}
    a, b = (torch.load(tmp_path / f"again{r}.pt") for r in (0, 1))
    assert a["world"] == b["world"] == 2 and a["step"] == b["step"] == STEPS
    assert all(torch.equal(x, y) for x, y in zip(a["anchors"], b["anchors"]))


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"store": "nohost"}, ValueError, "Invalid store value: 'nohost'"),
    ({"store": 29400}, TypeError, "Invalid store value: 29400"),
    ({"min_replicas": 0}, ValueError, "min_replicas"),
    ({"heartbeat": 1.0, "dead_after": 2.0}, ValueError, "Invalid dead_after value: 2.0"),
    ({"replica_id": ""}, ValueError, "Invalid replica_id value: ''"),
    ({"replica_id": "a\nb"}, ValueError, "Invalid replica_id value: 'a\\\\nb'"),
    ({"name": ""}, ValueError, "Invalid name value: ''"),
])
def test_bad_arguments_are_refused_by_name(kwargs: dict, error: type, words: str) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    kwargs = {"store": f"127.0.0.1:{store.port}", **kwargs}
    with pytest.raises(error, match=words):
        onebit.comm.Quorum(**kwargs)


def _member(name: str, port: int, out: str) -> None:
    """A bare quorum member: two commits, then ``c`` dies, ``b`` comes to the next epoch after
    the others have decided it (left out), and joins again at ``a``'s next admission."""
    torch.set_num_threads(1)
    quorum = onebit.comm.Quorum(f"127.0.0.1:{port}", name, min_replicas=3, timeout=2, heartbeat=0.2,
                                dead_after=1.5)
    quorum.join()
    seen = [(quorum.epoch, quorum.size())]
    onebit.comm.all_reduce_sum(torch.ones(2), quorum, 5)
    assert quorum.commit(True)
    if name == "c":
        os._exit(3)
    try:
        onebit.comm.all_reduce_sum(torch.ones(2), quorum, 5)
        ok = True
    except onebit.comm.CollectiveError:
        ok = False
    assert not quorum.commit(ok)
    if name == "b":
        time.sleep(6)  # past the others' deadline (twice the timeout): they decide without it
    quorum.recover()
    seen.append((quorum.epoch, quorum.size() if quorum.member else 0))
    if name == "b":
        assert not quorum.member
        quorum.join()  # registered again; taken in by a's admission, its state to receive
        seen.append((quorum.epoch, quorum.size(), quorum.needs_state, quorum.rank()))
    else:
        point = 1
        while not quorum.admit(point):  # admission points until the joiner has registered
            point += 1
            time.sleep(0.2)
        seen.append((quorum.epoch, quorum.size(), quorum.newcomers))
    onebit.comm.all_reduce_sum(torch.ones(2), quorum, 5)
    assert quorum.commit(True)
    torch.save(seen, out)
    quorum.close()


def test_a_member_left_out_of_an_epoch_joins_again_and_takes_no_epoch_over(tmp_path: Path) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    procs = {n: ctx.Process(target=_member, args=(n, store.port, str(tmp_path / f"{n}.pt"))) for n in "abc"}
    for p in procs.values():
        p.start()
    for p in procs.values():
        p.join(120)
    assert [p.exitcode for p in procs.values()] == [0, 0, 3]
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a == [(0, 3), (1, 1), (2, 2, [1])]  # alone in epoch 1; epoch 2 takes b back in, as rank 1
    assert b == [(0, 3), (1, 0), (2, 2, True, 1)]
