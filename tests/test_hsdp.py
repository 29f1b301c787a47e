"""Onebit optimizers on FSDP2-sharded parameters (HSDP: 2 nodes x 2 ranks), on 4 real gloo ranks.

FSDP2 shards inside the node (``fully_shard(module, mesh=mesh["shard"])``, an exact
reduce-scatter); the optimizer exchanges each shard with its replica on the other node
(``group=mesh["replicate"].get_group()``). References: FSDP2's own HSDP with
``torch.optim.AdamW`` for the warm-up, the unsharded optimizer on 4 ranks where the exchange
is exact (the identity compressor), and an uninterrupted run for a checkpoint taken midway.
"""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import onebit
from _harness import run_ranks
from _problem import different_steps

fsdp = pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

_LR, _WD = 1e-2, 0.01
_ALL = tuple(onebit.optim.REGISTRY)


class _Net(nn.Module):
    """Uneven shards (33 rows over 2 ranks), a frozen layer and a parameter never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(16, 33)
        self.frozen = nn.Linear(33, 33)
        self.frozen.requires_grad_(False)
        self.lin2 = nn.Linear(33, 8)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.frozen(torch.tanh(self.lin1(x)))))


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _sharded(mesh) -> nn.Module:
    """``_Net`` sharded by FSDP2 on ``mesh`` (the node's 1-D mesh, or a 2-D one: FSDP2's HSDP)."""
    model = _Net()
    for layer in (model.lin1, model.frozen, model.lin2):
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    return nn.functional.mse_loss(model(x), y)


def _train(model, opt, rank, steps, first=1, nan_at=None):
    for step in range(first, first + steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, step, rank).backward()
        if step == nan_at and rank == 1:
            model.lin1.weight.grad.to_local().view(-1)[0] = float("nan")
        opt.step()


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _hsdp(name: str, mesh, **kw):
    model = _sharded(mesh["shard"])
    opt = onebit.optim.make_optimizer(name, model.parameters(), group=mesh["replicate"].get_group(), **kw)
    return model, opt


def _against_references(rank, world):
    mesh = _mesh()
    out = {}
    # warm-up: FSDP2's own HSDP with torch.optim.AdamW
    native = _sharded(mesh)
    adamw = torch.optim.AdamW(native.parameters(), lr=_LR, weight_decay=_WD, foreach=False)
    _train(native, adamw, rank, 4)
    model, opt = _hsdp("onebit_adam", mesh, lr=_LR, weight_decay=_WD, freeze_step=100)
    _train(model, opt, rank, 4)
    out["warmup"] = max((a - b).abs().max().item() for a, b in zip(_full(native), _full(model)))
    # compressed stage with an exact exchange: the unsharded optimizer on the 4 ranks
    kw = {"lr": _LR, "weight_decay": _WD, "freeze_step": 2, "compressor": "identity"}
    model, opt = _hsdp("onebit_adam", mesh, **kw)
    _train(model, opt, rank, 5)
    plain = _Net()
    ref = onebit.OnebitAdam(plain.parameters(), **kw)
    _train(plain, ref, rank, 5)
    out["identity"] = max((a - b).abs().max().item() for a, b in zip(_full(plain), _full(model)))
    out["state_values"] = sum(b.numel() for b in opt.flat.buffers.values())
    out["unsharded_state_values"] = sum(b.numel() for b in ref.flat.buffers.values())
    # 1-bit LAMB: its layer-wise norms and ratios over the shards are the whole parameters'
    for stage, steps, freeze in (("lamb_warmup", 4, 100), ("lamb_identity", 6, 2)):
        kw = {"lr": _LR, "weight_decay": _WD, "freeze_step": freeze, "compressor": "identity"}
        model, opt = _hsdp("onebit_lamb", mesh, **kw)
        _train(model, opt, rank, steps)
        plain = _Net()
        ref = onebit.OnebitLamb(plain.parameters(), **kw)
        _train(plain, ref, rank, steps)
        out[stage] = max((a - b).abs().max().item() for a, b in zip(_full(plain), _full(model)))
        out[stage + "_coefficients"] = max(abs(a - b) for a, b in zip(opt.last_coefficients, ref.last_coefficients))
    return out


def test_warmup_equals_fsdp2_hsdp_adamw_and_exact_exchange_equals_unsharded():
    for res in run_ranks(_against_references, 4):
        assert res["warmup"] < 1e-6, res
        assert res["identity"] < 1e-6, res
        # LAMB's norms are summed from the shards' squares: equal to rounding
        for stage in ("lamb_warmup", "lamb_identity"):
            assert res[stage] < 1e-5 and res[stage + "_coefficients"] < 1e-5, (stage, res)
        # the state is the shard's: half the trainable values, rounded up by the uneven rows
        assert res["state_values"] < 0.6 * res["unsharded_state_values"], res


def _sign_exchange(rank, world):
    """Each optimizer of the registry: replicas bit-identical after every step, a
    step skipped on every rank when one rank's gradient is NaN, frozen and unused parameters
    untouched, and a checkpoint taken midway resumes bit for bit."""
    mesh = _mesh()
    out = {}
    for name in _ALL:
        kw = {"check_replicas_every": 1}
        if onebit.optim.REGISTRY[name].freeze is not None:
            kw.update(onebit.optim.REGISTRY[name].freeze(2))
        model, opt = _hsdp(name, mesh, **kw)
        start = _full(model)
        _train(model, opt, rank, 3, nan_at=2)
        skipped = opt.stats["skipped_steps"]
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        mid = [p.to_local().clone() for p in model.parameters()]
        _train(model, opt, rank, 4, first=4)
        end = _full(model)
        with torch.no_grad():
            for p, m in zip(model.parameters(), mid):
                p.to_local().copy_(m)
        again = onebit.optim.make_optimizer(name, model.parameters(), group=mesh["replicate"].get_group(), **kw)
        buf.seek(0)
        again.load_state_dict(torch.load(buf, weights_only=True))
        _train(model, again, rank, 4, first=4)
        names = [n for n, _ in model.named_parameters()]
        out[name] = {
            "skipped": skipped,
            "resumed_exactly": all(torch.equal(a, b) for a, b in zip(end, _full(model))),
            "moved": {n: not torch.equal(a, b) for n, a, b in zip(names, start, end)},
        }
    return out


def test_every_optimizer_on_hsdp_agrees_skips_and_resumes():
    results = run_ranks(_sign_exchange, 4)
    for name in _ALL:
        for res in results:
            r = res[name]
            assert r["skipped"] == 1, (name, r)
            assert r["resumed_exactly"], (name, r)
            moved = r["moved"]
            assert moved["lin1.weight"] and moved["lin2.bias"], (name, moved)
            assert not moved["frozen.weight"] and not moved["unused"], (name, moved)


def _loads_by_rank(rank, world, picks):
    """1-bit Adam and DiLoCo: every rank saves its state and shards after steps 2 and 3, and rank
    ``r`` loads those of step ``picks[r]`` (None: none) into fresh optimizers; the next step's
    error, or None."""
    mesh = _mesh()
    out = {}
    for name in ("onebit_adam", "diloco"):
        kw = onebit.optim.REGISTRY[name].freeze(2)
        model, opt = _hsdp(name, mesh, **kw)
        saved = {}
        for step in (1, 2, 3):
            _train(model, opt, rank, 1, first=step)
            saved[step] = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "shards": [p.to_local() for p in model.parameters()]}, saved[step])
        model, opt = _hsdp(name, mesh, **kw)
        pick = picks[rank]
        if pick is not None:
            state = torch.load(io.BytesIO(saved[pick].getvalue()), weights_only=True)
            with torch.no_grad():
                for p, shard in zip(model.parameters(), state["shards"]):
                    p.to_local().copy_(shard)
            opt.load_state_dict(state["opt"])
        try:
            _train(model, opt, rank, 1, first=4)
            out[name] = None
        except onebit.ReplicaDivergence as exc:
            out[name] = str(exc)
    return out


# The mesh's rows are the nodes (ranks 0, 1 and 2, 3), its columns the replicate groups (0, 2 and 1, 3)
@pytest.mark.parametrize("picks", [(3, 2, 3, 2), (3, 3, None, None), (3, 3, 3, 3)],
                         ids=["shards-a-step-apart", "one-node-fresh", "alike"])
def test_ranks_that_load_states_of_different_steps_are_stopped_on_every_rank(picks):
    """The check runs over the whole job: with the shards of each node a step apart, every
    replicate group loaded one step, and only the whole job sees it."""
    for res in run_ranks(_loads_by_rank, 4, list(picks)):
        for name in ("onebit_adam", "diloco"):
            want = None if len(set(picks)) == 1 else different_steps(name, picks)
            assert res[name] == want, (name, res[name])


def _streamed_diloco(rank, world, strided):
    mesh = _mesh()
    model = _sharded(mesh["shard"])
    params = list(model.parameters())
    # strided: every other parameter in one fragment, the fragments given as the sharded parameters
    fragments = [params[0::2], params[1::2]] if strided else 2
    opt = onebit.optim.make_optimizer("diloco", params, group=mesh["replicate"].get_group(), sync_every=4,
                                      fragments=fragments, delay=1, check_replicas_every=1)
    # fragments sent at the odd steps, landing at the even ones: step 4 is an inner step, where fragment 1 lands
    _train(model, opt, rank, 10, nan_at=4)
    return opt.stats["skipped_steps"], opt.stats["step"]


@pytest.mark.parametrize("strided", [False, True])
def test_streamed_diloco_on_hsdp_skips_an_inner_step_per_node_and_keeps_the_anchors_identical(strided):
    # rank 1's NaN at an inner step: the two ranks holding node 0's shards skip it together (their
    # shards must take the same steps), node 1 does not wait for them; every step counts, and the
    # anchors of the replicas are compared after every step (check_replicas_every=1)
    results = run_ranks(_streamed_diloco, 4, strided)
    assert results == [(1, 10), (1, 10), (0, 10), (0, 10)]


def _refusals(rank, world):
    mesh = _mesh()
    group = mesh["replicate"].get_group()
    errors = {}

    def attempt(key, make):
        try:
            make()
        except (ValueError, TypeError) as exc:
            errors[key] = str(exc)

    attempt("native_hsdp", lambda: onebit.OnebitAdam(_sharded(mesh).parameters(), group=group))
    attempt("default_group", lambda: onebit.OnebitAdam(_sharded(mesh["shard"]).parameters()))
    attempt("clip", lambda: onebit.OnebitAdam(_sharded(mesh["shard"]).parameters(), group=group, max_grad_norm=1.0))
    attempt("overlap", lambda: onebit.OnebitAdam(_sharded(mesh["shard"]).parameters(), group=group, overlap=True))
    attempt("fsdp1", lambda: onebit.OnebitAdam(
        fsdp.FullyShardedDataParallel(nn.Linear(8, 8), device_id=torch.device("cpu")).parameters()))
    mixed = _Net()
    fsdp.fully_shard(mixed.lin1, mesh=mesh["shard"])
    attempt("mixed", lambda: onebit.OnebitAdam(mixed.parameters(), group=group))
    # a Quorum's replicas are one process each: FSDP2's shards would be replicas of their own
    quorum = onebit.comm.Quorum(dist.distributed_c10d._get_default_store(), f"r{rank}", min_replicas=world,
                                timeout=30, name="refusals")
    attempt("quorum", lambda: onebit.DiLoCo(_sharded(mesh["shard"]).parameters(), group=quorum))
    quorum.close()
    dist.barrier()
    return errors


def test_what_hsdp_does_not_support_is_refused_with_what_to_use():
    for errors in run_ranks(_refusals, 4):
        assert "mesh=mesh['shard']" in errors["native_hsdp"]
        assert "Invalid group" in errors["default_group"] and "mesh['replicate']" in errors["default_group"]
        assert "clip_grad_norm_" in errors["clip"]
        assert "overlap=False" in errors["overlap"]
        assert "shard every parameter or none" in errors["mixed"]
        assert "(FSDP1) flat parameter" in errors["fsdp1"] and "fully_shard" in errors["fsdp1"]
        assert "Invalid group for FSDP2-sharded parameters: Quorum" in errors["quorum"]
