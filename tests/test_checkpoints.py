"""onebit.Checkpoints on real gloo ranks: a resume bit for bit, a save a rank never finished, another
world size, pruning, a file a rank cannot read, and its arguments."""

import json
import warnings

import pytest
import torch
from torch.distributed import TCPStore

import onebit
from _harness import run_ranks

STEPS, SAVE_AT = 8, 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _train(rank, model, opt, steps):
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * rank + step)
        opt.zero_grad()
        x, y = torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _resumed(rank, world, directory):
    """Straight to STEPS, saving every step; then a new run from the newest complete save."""
    torch.set_num_threads(1)
    checkpoints = onebit.Checkpoints(directory, keep=2)

    def build():
        model = _model()
        return model, onebit.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)

    model, opt = build()
    for step in range(1, SAVE_AT + 1):
        _train(rank, model, opt, [step])
        checkpoints.save(step, model=model.state_dict(), opt=opt.state_dict())
    _train(rank, model, opt, range(SAVE_AT + 1, STEPS + 1))
    straight = [p.detach().clone() for p in model.parameters()]
    model, opt = build()
    step, state = checkpoints.load()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    _train(rank, model, opt, range(step + 1, STEPS + 1))
    torch.distributed.barrier()  # rank 0 prunes after the last save
    kept = sorted(p.name for p in checkpoints.directory.iterdir())
    return step, all(torch.equal(a, b) for a, b in zip(straight, model.parameters())), kept


@pytest.mark.parametrize("world", [2, 3])
def test_a_resume_from_the_newest_save_continues_bit_for_bit(tmp_path, world):
    for step, same, kept in run_ranks(_resumed, world, str(tmp_path)):
        assert step == SAVE_AT and same
        assert kept == ["step-000000004", "step-000000005"]  # keep=2
    assert sorted(p.name for p in (tmp_path / "step-000000005").iterdir()) == \
        ["complete.json"] + [f"rank{r}.pt" for r in range(world)]


def _unfinished(rank, world, directory):
    """Step 1 saved by every rank; step 2 by rank 0 only (rank 1 never arrives: its barrier times out)."""
    lost = onebit.Checkpoints(directory, group=torch.distributed.new_group(), timeout=3)
    lost.save(1, rank=rank)
    if rank != 1:
        with pytest.raises(onebit.comm.CollectiveError, match="barrier"):
            lost.save(2, rank=rank)
    torch.distributed.barrier()  # the restart, on a group of its own
    restarted = onebit.Checkpoints(directory)
    found = restarted.load()
    restarted.save(3, rank=rank)  # its next save clears the unfinished one (rank 0, once all are in)
    torch.distributed.barrier()
    return found, sorted(p.name for p in restarted.directory.iterdir())


def test_a_save_a_rank_never_finished_is_not_loaded_and_is_cleared(tmp_path):
    for rank, (found, kept) in enumerate(run_ranks(_unfinished, 3, str(tmp_path))):
        assert found == (1, {"rank": rank})
        assert kept == ["step-000000001", "step-000000003"]


def _saved(rank, world, directory):
    onebit.Checkpoints(directory).save(7, rank=rank, world=world)


def _loaded(rank, world, directory):
    step, state = onebit.Checkpoints(directory).load()
    return step, state


@pytest.mark.parametrize("saved,loaded", [(3, 2), (2, 3)])
def test_on_another_world_size_rank_r_reads_rank_r_modulo_the_saved_world(tmp_path, saved, loaded, caplog):
    run_ranks(_saved, saved, str(tmp_path))
    assert json.loads((tmp_path / "step-000000007" / "complete.json").read_text()) == {"step": 7, "world_size": saved}
    assert run_ranks(_loaded, loaded, str(tmp_path)) == [(7, {"rank": r % saved, "world": saved}) for r in range(loaded)]


def test_one_process_and_an_empty_directory(tmp_path):
    checkpoints = onebit.Checkpoints(tmp_path / "new")
    assert checkpoints.load() is None and checkpoints.latest() is None
    (tmp_path / "new" / "step-000000009").mkdir(parents=True)  # a save that never completed
    assert checkpoints.load() is None
    assert checkpoints.save(4, x=torch.ones(2)).name == "rank0.pt"
    assert checkpoints.latest() == 4
    step, state = checkpoints.load()
    assert step == 4 and torch.equal(state["x"], torch.ones(2))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"directory": 3}, TypeError, "Invalid directory: 3"),
    ({"directory": "d", "keep": 0}, ValueError, "Invalid keep value: 0"),
    ({"directory": "d", "keep": True}, ValueError, "Invalid keep value: True"),
    ({"directory": "d", "timeout": -1}, ValueError, "timeout must be positive"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        onebit.Checkpoints(**kwargs)


def test_a_quorum_is_refused_as_the_group(tmp_path):
    # its barrier would stop the others when a replica is lost during a save: one replica saves
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with onebit.comm.Quorum(f"127.0.0.1:{store.port}", "a", min_replicas=1) as quorum:
        with pytest.raises(ValueError, match="Invalid group for Checkpoints: a onebit.comm.Quorum"):
            onebit.Checkpoints(tmp_path, group=quorum)


@pytest.mark.parametrize("step", [-1, 2.0, True])
def test_a_bad_step_is_named(tmp_path, step):
    with pytest.raises(ValueError, match=f"Invalid step value: {step!r}"):
        onebit.Checkpoints(tmp_path).save(step)


@pytest.mark.parametrize("shared,restarts,warns", [("True", "3", True), ("False", "3", False), ("True", "0", False)])
def test_a_store_torchrun_shares_across_restarts_is_named(tmp_path, monkeypatch, shared, restarts, warns):
    # What torchrun's agent sets in its workers' environment (torch 2.13's local_elastic_agent).
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        onebit.Checkpoints(tmp_path)
    said = [str(w.message) for w in caught if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(w.message)]
    assert len(said) == warns and all(w.filename == __file__ for w in caught)


def _apart(rank, world, directory):
    """Each rank a directory of its own; only rank 0's holds a complete save."""
    if rank == 0:
        onebit.Checkpoints(f"{directory}/rank0", group=torch.distributed.new_group([0])).save(5, rank=rank)
    else:
        torch.distributed.new_group([0])  # every rank creates every group
    try:
        onebit.Checkpoints(f"{directory}/rank{rank}").load()
    except RuntimeError as exc:
        return str(exc)


def test_ranks_that_do_not_share_the_directory_are_told_so(tmp_path):
    for message in run_ranks(_apart, 2, str(tmp_path)):
        assert "finds no complete checkpoint where a rank finds step 5: the directory must be the same storage" \
            in message


def _unreadable(rank, world, directory, broken):
    """Step 7 saved by every rank; the files of the ranks ``broken`` then cut short (a disk that filled up)."""
    onebit.Checkpoints(directory).save(7, rank=rank)
    torch.distributed.barrier()
    if rank in broken:
        path = onebit.Checkpoints(directory).directory / "step-000000007" / f"rank{rank}.pt"
        path.write_bytes(path.read_bytes()[:100])
    torch.distributed.barrier()
    try:
        onebit.Checkpoints(directory).load()
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("world,broken,who", [(2, [1], "rank 1 cannot read its"),
                                               (3, [0, 2], "ranks 0, 2 cannot read their")])
def test_a_file_a_rank_cannot_read_stops_every_rank_naming_it(tmp_path, world, broken, who):
    # Before, only the rank that read it raised; the others went on to wait for it in their next collective.
    step = tmp_path / "step-000000007"
    for rank, message in enumerate(run_ranks(_unreadable, world, str(tmp_path), broken)):
        if rank in broken:
            assert message.startswith(f"checkpoint {step / f'rank{rank}.pt'} cannot be read (truncated or not a "
                                      "checkpoint): ")
        else:
            assert message == (f"checkpoint {step} cannot be resumed: {who} files there (the error on each says "
                               f"why); to resume from the step before, if one is kept, remove {step / 'complete.json'}")
