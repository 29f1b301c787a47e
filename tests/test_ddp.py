"""Onebit optimizers on DDP-wrapped models, on real gloo ranks.

DDP's all-reduce is switched off (``local_gradient_hook``) so that nothing is sent twice:
a wrapped run equals the unwrapped run bit for bit, DDP's logging data names the hook, and
each rank writes no more bytes than in the unwrapped run. Gradient
accumulation (with DDP's ``no_sync`` or without DDP) exchanges once per ``step()``.
"""

import contextlib

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import onebit
from _harness import run_ranks
from _problem import OPTIMIZERS, optimizer_class
from _problem import digest as _digest


def _written_bytes() -> int:
    """Bytes this process has written so far, sockets included (``wchar`` of ``/proc/self/io``):
    the rank's own traffic, whatever else runs on the machine."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))


def _train(rank, name, kw, wrap, steps=6, accumulate=1, attach_late=False, opt_no_sync=False):
    """``steps`` steps of ``name`` on rank-specific data; ``wrap``: DDP first (auto-attach at
    construction), or ``attach_late``: optimizer first, DDP after, ``onebit.attach``;
    ``opt_no_sync``: unwrapped, all micro-batches but the last inside ``opt.no_sync()``."""
    model = _model()
    net = model
    if wrap and not attach_late:
        net = DDP(model)
    opt = optimizer_class(name)(model.parameters(), **kw)
    if attach_late:
        net = DDP(model)
        onebit.attach(opt)
    gen = torch.Generator().manual_seed(100 + rank)
    sent, written_before = [], _written_bytes()
    for _ in range(steps):
        x = torch.randn(8 * accumulate, 64, generator=gen)
        opt.zero_grad()
        for k in range(accumulate):
            last = k == accumulate - 1
            quiet = net.no_sync() if net is not model else opt.no_sync() if opt_no_sync else contextlib.nullcontext()
            with quiet if not last else contextlib.nullcontext():
                part = x[8 * k : 8 * (k + 1)]
                (torch.nn.functional.mse_loss(net(part), part.flip(1)) / accumulate).backward()
        opt.step()
        sent.append(opt.stats["bytes_sent"])
    hook = net._get_ddp_logging_data().get("comm_hook") if net is not model else None
    return {"digest": _digest(list(model.parameters())), "sent": sent, "written": _written_bytes() - written_before,
            "hook": hook, "params": [p.detach().clone() for p in model.parameters()]}


def _wrapped_equals_unwrapped(rank, world):
    out = {}
    for name, kw in OPTIMIZERS:
        plain = _train(rank, name, kw, wrap=False)
        wrapped = _train(rank, name, kw, wrap=True)
        late = _train(rank, name, kw, wrap=True, attach_late=True)
        out[name] = (plain, wrapped, late)
    return out


def test_wrapped_model_trains_exactly_as_unwrapped_and_sends_nothing_twice():
    res = run_ranks(_wrapped_equals_unwrapped, 2)
    for rank_out in res:
        for name, (plain, wrapped, late) in rank_out.items():
            assert wrapped["digest"] == plain["digest"] == late["digest"], f"{name}: DDP changed the run"
            assert wrapped["hook"] == late["hook"] == "local_gradient_hook", name
            assert wrapped["sent"] == plain["sent"], name  # the optimizer's own bytes, per step
            # Everything this rank wrote: DDP's fp32 all-reduce of 66k values would add >= 260 kB
            # per step; allow 64 kB of other writes.
            assert wrapped["written"] <= plain["written"] + 64_000, (name, wrapped["written"], plain["written"])


def _late_without_attach(rank, world):
    out = {}
    for name, kw in OPTIMIZERS:
        model = _model()
        opt = optimizer_class(name)(model.parameters(), **kw)
        net = DDP(model)
        torch.nn.functional.mse_loss(net(torch.ones(2, 64)), torch.zeros(2, 64)).backward()
        before = _digest(list(model.parameters()))
        with pytest.raises(ValueError, match=r"onebit\.attach\(optimizer\)") as info:
            opt.step()
        out[name] = (before == _digest(list(model.parameters())), type(opt).__name__ in str(info.value))
        # another hook already on the DDP model: attach refuses to replace it
        other = DDP(_model())
        other.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
        with pytest.raises(ValueError, match="already has the comm hook"):
            optimizer_class(name)(other.parameters(), **kw)
    return out


def test_wrapped_after_construction_without_attach_is_refused_untouched():
    for rank_out in run_ranks(_late_without_attach, 2):
        for name, (untouched, named) in rank_out.items():
            assert untouched and named, name


def _accumulation(rank, world):
    kw = dict(lr=0.01, freeze_step=3)
    once = _train(rank, "onebit_adam", kw, wrap=False, accumulate=1)
    plain = _train(rank, "onebit_adam", kw, wrap=False, accumulate=3)
    quiet = _train(rank, "onebit_adam", kw, wrap=False, accumulate=3, opt_no_sync=True)
    ddp = _train(rank, "onebit_adam", kw, wrap=True, accumulate=3)
    return once, plain, quiet, ddp, sum(p.numel() for p in _model().parameters())


def test_accumulation_exchanges_once_per_step_with_and_without_ddp():
    for once, plain, quiet, ddp, numel in run_ranks(_accumulation, 2):
        assert ddp["digest"] == plain["digest"] == quiet["digest"]
        assert quiet["sent"] == ddp["sent"] == once["sent"]  # three micro-batches, one exchange of the same size
        # Without no_sync() the first warm-up step's buckets left during the first backward and went
        # stale: one more fp32 exchange (2 ranks: 4 bytes a value), then the warm-up stays in step().
        assert plain["sent"][0] == once["sent"][0] + 4 * numel and plain["sent"][1:] == once["sent"][1:]
        assert plain["digest"] != once["digest"]  # it did see three times the data


def test_world_size_one_needs_no_process_group():
    model = _model()
    opt = onebit.OnebitAdam(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    assert opt.stats["step"] == 1


def _built_before_init(rank, world):
    # run_ranks initialises the group first: agree on a port, tear it down, build the
    # optimizer without a group, then initialise a new one.
    import socket

    import torch.distributed as dist

    port = [None]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, 0)
    dist.destroy_process_group()
    opt = onebit.OnebitAdam(_model().parameters())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world)
    with pytest.raises(RuntimeError, match="built before torch.distributed.init_process_group"):
        opt.step()
    return True


def test_optimizer_built_before_the_process_group_is_refused():
    assert all(run_ranks(_built_before_init, 2))
