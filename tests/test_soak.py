"""Soak (not in the default run: ``python -m pytest -m slow``): 3 ranks, thousands of steps,
killed mid-run several times and resumed from their checkpoints; the end must equal an
uninterrupted run bit for bit."""

import os

import pytest
import torch

from _harness import run_ranks
from _problem import digest, grads, initial_params, optimizer_class
from onebit.launch import RankFailure
from test_reliability import OPTIMIZERS

STEPS, EVERY = 3000, 100
KILLS = (450, 1130, 1777, 2501)  # never on a checkpoint step


def _segment(rank, world, name, kwargs, folder, kill_at):
    path = os.path.join(folder, f"rank{rank}.pt") if folder else None
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = optimizer_class(name)(params, timeout=30, **kwargs)
    first = 1
    if path and os.path.exists(path):
        ckpt = torch.load(path, weights_only=True)
        with torch.no_grad():
            for p, saved in zip(params, ckpt["params"]):
                p.copy_(saved)
        opt.load_state_dict(ckpt["opt"])
        first = ckpt["step"] + 1
    for step in range(first, STEPS + 1):
        if step == kill_at and rank == step % world:
            os._exit(9)
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
        if path and step % EVERY == 0:
            tmp = path + ".tmp"
            torch.save({"step": step, "opt": opt.state_dict(), "params": [p.detach() for p in params]}, tmp)
            os.replace(tmp, path)
    return digest(params)


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_kill_and_resume_cycles_end_where_an_uninterrupted_run_ends(name, kwargs, tmp_path):
    straight = run_ranks(_segment, 3, name, kwargs, None, None, timeout=900)
    for kill_at in KILLS:
        with pytest.raises(RankFailure, match="exited without a result"):
            run_ranks(_segment, 3, name, kwargs, str(tmp_path), kill_at, timeout=900)
    resumed = run_ranks(_segment, 3, name, kwargs, str(tmp_path), None, timeout=900)
    assert resumed == straight and len(set(straight)) == 1
