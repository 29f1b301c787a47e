"""Faults: non-finite gradients on one rank, GradScaler, a rank that dies mid-run."""

import copy
import os

import pytest
import torch

import onebit
from _harness import run_ranks
from _problem import OPTIMIZERS, digest, grads, initial_params, optimizer_class
from onebit.launch import RankFailure

def _loop(rank, world, name, kwargs, poison_step, poison_rank, skip_step=None, steps=7):
    """Step on the least-squares gradients; at ``poison_step`` rank ``poison_rank`` gets a NaN/Inf gradient;
    at ``skip_step`` no rank calls step() (the reference for "the step left everything untouched")."""
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = optimizer_class(name)(params, **kwargs)
    digests, skipped = [], []
    for step in range(1, steps + 1):
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        if step == poison_step and rank == poison_rank:
            params[0].grad[3] = float("nan") if step % 2 else float("inf")
        if step != skip_step:
            opt.step()
        digests.append(digest(params))
        skipped.append(opt.stats["skipped_steps"])
    state = opt.state_dict()["onebit"]
    finite = all(bool(torch.isfinite(t).all()) for t in state["flat"].values())
    return {"digests": digests, "skipped": skipped, "finite": finite, "step": opt.stats["step"]}


def _poisoned_and_reference(rank, world, name, kwargs, step):
    """Both runs in one job: a NaN on rank 1 at ``step``, and no step() call at ``step``."""
    return _loop(rank, world, name, kwargs, step, 1), _loop(rank, world, name, kwargs, None, None, step)


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_nonfinite_gradient_on_one_rank_skips_the_step_everywhere(name, kwargs):
    res = run_ranks(_poisoned_and_reference, 3, name, kwargs, 4)
    poisoned = [r[0] for r in res]
    for r, ref in res:
        assert r["digests"] == poisoned[0]["digests"], "replicas differ"
        # Skipping equals not calling step(): parameters, moments, errors and RNG untouched.
        assert r["digests"] == ref["digests"]
        assert r["skipped"] == [0, 0, 0, 1, 1, 1, 1] and r["step"] == 6 and r["finite"]


def test_raise_mode_raises_on_every_rank():
    with pytest.raises(RankFailure) as exc:
        run_ranks(_loop, 2, "onebit_adam", dict(lr=0.01, freeze_step=2, on_nonfinite="raise"), 3, 1)
    text = str(exc.value)
    assert "rank 0 failed" in text and "rank 1 failed" in text
    assert "FloatingPointError: non-finite gradient at step 3: another rank than 0" in text
    assert "FloatingPointError: non-finite gradient at step 3: parameter 0 (shape (37,)) on rank 1" in text


def _scaler_loop(rank, world, use_scaler, inf_step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = onebit.OnebitAdam(model.parameters(), lr=0.01, freeze_step=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000) if use_scaler else None
    gen = torch.Generator().manual_seed(rank)
    out = []
    for step in range(1, 6):
        x = torch.randn(16, 8, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        (scaler.scale(loss) if scaler else loss).backward()
        if step == inf_step and rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        out.append(digest(list(model.parameters())))
    return out, opt.stats["skipped_steps"]


def _scaler_runs(rank, world):
    """Without a scaler, with one, and with one and an inf on rank 1 at step 3."""
    return _scaler_loop(rank, world, False, None), _scaler_loop(rank, world, True, None), _scaler_loop(rank, world, True, 3)


def test_grad_scaler_unscales_and_skips_on_every_rank():
    res = run_ranks(_scaler_runs, 2)
    for plain, scaled, (digests, skipped) in res:
        # A power-of-two scale unscales exactly: the same run bit for bit.
        assert scaled[0] == plain[0]
        assert skipped == 1 and digests[2] == digests[1] and digests == res[0][2][0]


def _dying_loop(rank, world):
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = onebit.Birder(params, lr=0.01, timeout=20)
    for step in range(1, 6):
        if step == 3 and rank == 2:
            os._exit(3)  # killed mid-run, no clean-up
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
    return "finished"


def test_killed_rank_fails_the_survivors_with_a_named_collective_error():
    with pytest.raises(RankFailure) as exc:
        run_ranks(_dying_loop, 3, timeout=120)
    text = str(exc.value)
    assert "ranks [2] exited without a result" in text
    for rank in (0, 1):
        assert f"rank {rank} failed" in text
        assert f"on group default (rank {rank} of 3)" in text
    assert "CollectiveError" in text


def _diverging_loop(rank, world, check_every):
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = onebit.Birder([("weight", params[0]), ("bias", params[1])], lr=0.01, check_replicas_every=check_every)
    for step in range(1, 5):
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        if step == 3 and rank == 1:
            with torch.no_grad():
                params[1].add_(1e-6)  # a silent corruption on one rank
        try:
            opt.step()
        except onebit.ReplicaDivergence as exc:
            return step, str(exc)
    return None


def test_replica_check_names_the_divergent_parameter():
    for step, message in run_ranks(_diverging_loop, 3, 2):
        assert step == 4
        assert message == "replicas differ after step 4: bias on ranks [1] differs from rank 0"
    assert run_ranks(_diverging_loop, 2, 0) == [None, None]  # off by default


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_reliability_options_are_validated_everywhere(name, kwargs):
    cls = optimizer_class(name)
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="Invalid on_nonfinite value: 'ignore'"):
        cls(p, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="Invalid check_replicas_every value: -1"):
        cls(p, check_replicas_every=-1)


def _resume_runs(rank, world, name, kwargs):
    """Straight, resumed after step 3 (1-bit Adam/LAMB then compress), and the final state."""
    from _problem import run_problem

    cls = optimizer_class(name)
    holder = {}
    straight = run_problem(lambda params: holder.setdefault("opt", cls(params, **kwargs)), rank, 7)
    resumed = run_problem(lambda params: cls(params, **kwargs), rank, 7, 3)
    return straight["digests"], resumed["digests"], holder["opt"].state_dict()


def _entries(state, path=()):
    """The path of every entry of a saved state, at any depth (inside lists of entries too), but
    inside an inner torch optimizer's own state."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        if isinstance(key, str):
            yield (*path, key)
        if key not in ("state", "param_groups"):
            yield from _entries(value, (*path, key))


@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_checkpoints_resume_exactly_and_across_world_sizes(name, kwargs, caplog):
    # Same world size: save after step 3, reload into fresh objects, continue.
    res = run_ranks(_resume_runs, 2, name, kwargs)
    for straight, resumed, _ in res:
        assert resumed == straight
    # Another world size: loads with a warning, errors restart at zero, training goes on.
    state = res[0][2]
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = optimizer_class(name)(params, **kwargs)
    with caplog.at_level("WARNING"):
        opt.load_state_dict(state)
    assert "saved on world size 2 by rank 0, loaded on world size 1 by rank 0" in caplog.text
    for p, g in zip(params, grads([p.detach() for p in params], 0, 8)):
        p.grad = g
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in params) and opt.stats["step"] == 8
    # A truncated or foreign state dict is refused with a clear message.
    broken = {**state, "onebit": {k: v for k, v in state["onebit"].items() if k != "flat"}}
    with pytest.raises(ValueError, match=r"incomplete .* state_dict: missing \['flat'\]"):
        opt.load_state_dict(broken)
    with pytest.raises(ValueError, match="missing the 'onebit' entry"):
        opt.load_state_dict(torch.optim.SGD(params, lr=0.1).state_dict())
    # Another model's state (its buffers a value short) is refused before anything changes: a
    # fresh optimizer keeps its own stage's buffers, bit for bit, and still steps.
    fresh_params = [p.clone().requires_grad_() for p in initial_params()]
    fresh = optimizer_class(name)(fresh_params, **kwargs)
    before, stage = fresh.state_dict()["onebit"], fresh.stats["stage"]
    short = {**state, "onebit": {**state["onebit"], "flat": {k: v[:-1] for k, v in state["onebit"]["flat"].items()}}}
    with pytest.raises(ValueError, match=r"state_dict buffer .* has \d+ values, the parameters have \d+"):
        fresh.load_state_dict(short)
    after = fresh.state_dict()["onebit"]
    assert sorted(after["flat"]) == sorted(before["flat"])
    assert all(torch.equal(after["flat"][k], before["flat"][k]) for k in before["flat"])
    assert fresh.stats["step"] == 0 and fresh.stats["stage"] == stage
    # Each entry left out in turn, at any depth: refused before anything changes, naming it, or
    # (one that older states lack, or one not read) loaded.
    optional = {"rank", "updated_at", "refreshes", "warmup_in_backward", "own_parameters", "synchronised",
                "streaming", "fragment_of", "collective", "error_feedback", "scales", "sent", "arrivals",
                "allreduce", "numel", "max_refresh_interval", "refresh_weight"}
    # (DiLoCo: older states; a collective's size, not read; 0/1 Adam's refreshes: a record, compared)
    own = opt.state_dict()  # this world size's and rank's: its collectives' entries are read
    for path in _entries(own["onebit"]):
        probe = optimizer_class(name)([p.clone().requires_grad_() for p in initial_params()], **kwargs)
        lacking = copy.deepcopy(own)
        inside = lacking["onebit"]
        for key in path[:-1]:
            inside = inside[key]
        del inside[path[-1]]
        try:
            probe.load_state_dict(lacking)
            assert path[-1] in optional, path
        except ValueError as exc:
            # (a flat buffer left out: the buffers held are named, against a stage's)
            assert path[-1] in str(exc) or path[0] == "flat" and "holds buffers" in str(exc), (path, str(exc))
            after = probe.state_dict()["onebit"]
            assert all(torch.equal(after["flat"][k], before["flat"][k]) for k in before["flat"]), path
            assert probe.stats["step"] == 0 and probe.stats["stage"] == stage, path
    for p, g in zip(fresh_params, grads([p.detach() for p in fresh_params], 0, 1)):
        p.grad = g
    fresh.step()
    assert all(bool(torch.isfinite(p).all()) for p in fresh_params) and fresh.stats["step"] == 1
