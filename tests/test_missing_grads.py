"""One missing-gradient rule for every optimizer, on real ranks, through the compressed stage.

A parameter whose gradient is None on every rank is not updated (value and moments, no
weight decay), as in torch.optim; one with a gradient on some ranks only is updated
identically everywhere (replicas stay bit-identical). A zero-size parameter simply works.
"""

import pytest
import torch

from _harness import run_ranks
from _problem import OPTIMIZERS, grads, initial_params, last_stage, optimizer_class
from _problem import digest as _digest


def _run(rank, world, name, kw, steps):
    torch.manual_seed(0)
    w, b = (p.clone().requires_grad_() for p in initial_params())
    frozen = torch.randn(5)  # requires_grad=False, passed in as model.parameters() would
    sometimes = torch.randn(4, requires_grad=True)
    empty = torch.zeros(0, 3, requires_grad=True)
    opt = optimizer_class(name)([w, b, frozen, empty, sometimes], weight_decay=0.01, **kw)
    frozen0 = frozen.clone()
    untouched_when_unused = []
    for step in range(1, steps + 1):
        for p, g in zip((w, b), grads([w.detach(), b.detach()], rank, step)):
            p.grad = g
        empty.grad = torch.zeros(0, 3)
        # step % 3 == 0: no rank has a gradient; == 1: rank 0 only; == 2: every rank
        if step % 3 == 1 and rank == 0 or step % 3 == 2:
            sometimes.grad = torch.full((4,), 0.1 * (rank + 1))
        else:
            sometimes.grad = None
        before = sometimes.detach().clone()
        opt.step()
        if step % 3 == 0:
            untouched_when_unused.append(torch.equal(before, sometimes.detach()))
    return {
        "digest": _digest([w, b, frozen, sometimes]),
        "frozen_unchanged": torch.equal(frozen, frozen0),
        "untouched": untouched_when_unused,
        "stage": opt.stats["stage"],
    }


@pytest.mark.parametrize("name,kw", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_missing_gradients_follow_one_rule_and_replicas_stay_identical(name, kw):
    res = run_ranks(_run, 3, name, kw, 12)
    assert len({r["digest"] for r in res}) == 1, "replicas differ"
    for r in res:
        assert r["frozen_unchanged"]
        assert r["untouched"] and all(r["untouched"]), "a parameter without a gradient anywhere moved"
        assert r["stage"] == last_stage(name)
