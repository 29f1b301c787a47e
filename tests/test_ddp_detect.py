"""A model wrapped in DDP is refused with an error that says what to do (2 real gloo ranks).

DDP all-reduces gradients in backward; an onebit optimizer on the same parameters would
exchange them a second time and save nothing.
"""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import onebit
from _harness import run_ranks
from _problem import OPTIMIZERS


def _run(rank, world):
    torch.manual_seed(0)
    out = {}
    for name, kw in OPTIMIZERS:
        cls = getattr(onebit, name)
        # wrapped first, optimizer second: refused at construction
        wrapped = DDP(torch.nn.Linear(4, 2))
        try:
            cls(wrapped.parameters(), **kw)
            out[(name, "construct")] = None
        except ValueError as exc:
            out[(name, "construct")] = str(exc)
        # optimizer first, wrapped afterwards: refused at the first step, before any exchange
        model = torch.nn.Linear(4, 2)
        opt = cls(model.parameters(), **kw)
        late = DDP(model)
        late(torch.randn(3, 4)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
            out[(name, "step")] = None
        except ValueError as exc:
            out[(name, "step")] = str(exc)
        out[(name, "untouched")] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        # another DDP model in the process does not concern an unwrapped one
        alone = torch.nn.Linear(4, 2)
        opt = cls(alone.parameters(), **kw)
        alone(torch.randn(3, 4)).sum().backward()
        opt.step()
        out[(name, "unwrapped steps")] = opt.stats["step"]
        del wrapped, late
    return out


def test_ddp_wrapped_parameters_are_refused_at_construction_or_first_step():
    results = run_ranks(_run, 2)
    for out in results:
        for name, _ in OPTIMIZERS:
            for when in ("construct", "step"):
                msg = out[(name, when)]
                assert msg is not None, f"{name}: DDP-wrapped parameters accepted at {when}"
                assert "DistributedDataParallel" in msg and name in msg
                assert "unwrapped model" in msg and "onebit.hooks" in msg  # says what to do
            assert out[(name, "untouched")], f"{name} moved parameters before refusing"
            assert out[(name, "unwrapped steps")] == 1


def test_world_size_one_does_not_look_for_ddp():
    # Without a process group there is no DDP to pay for; nothing is scanned or refused.
    model = torch.nn.Linear(4, 2)
    opt = onebit.OnebitAdam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert opt.stats["step"] == 1

