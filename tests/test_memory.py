"""What each optimizer holds between steps stays at its algorithm's footprint (README, "Memory"):
measured on real gloo ranks with a model that has what real ones have, at every stage."""

import pytest
import torch
from torch import nn

import onebit
from _harness import run_ranks
from onebit.bench._memory import FOOTPRINTS, WIRE_ALLOWANCE, held_bytes
from onebit.optim import REGISTRY, make_optimizer
from onebit.optim._functional import UpdateByChunks, apply_update_


class _Model(nn.Module):
    """A conv in channels_last, a linear layer, an embedding with rows never looked up, a frozen
    tensor, an unused one and a zero-size one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3).to(memory_format=torch.channels_last)
        self.embed = nn.Embedding(512, 16)
        self.head = nn.Linear(16 * 6 * 6 + 16, 256)
        self.frozen = nn.Parameter(torch.randn(300), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(200))
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x, tokens):
        features = torch.cat([self.conv(x).flatten(1), self.embed(tokens)], dim=1)
        return self.head(features).square().mean()


def _held(rank, world):
    out = {}
    for name, spec in REGISTRY.items():  # the warm-ups end after step 2 of 5
        torch.manual_seed(0)
        model = _Model()
        model_bytes = 4 * sum(p.numel() for p in model.parameters())
        groups = [{"params": [model.conv.weight, model.conv.bias, model.frozen, model.unused, model.empty]},
                  {"params": [p for n, p in model.named_parameters() if n.startswith(("embed", "head"))],
                   "lr": 1e-4}]
        opt = make_optimizer(name, groups, **(spec.freeze(2) if spec.freeze is not None else {}))
        gen = torch.Generator().manual_seed(rank)
        stages = {}
        for _ in range(5):
            x = torch.randn(4, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)
            model(x, torch.randint(0, 8, (4,), generator=gen)).backward()  # rows 8.. never looked up
            opt.step()
            opt.zero_grad()
            stage = opt.stats["stage"]
            stages[stage] = max(stages.get(stage, 0.0), held_bytes(opt) / model_bytes)
        out[name] = stages
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_held_state_is_at_the_documented_footprint(world):
    for held in run_ranks(_held, world, timeout=240.0):
        for name, stages in held.items():
            allowed = FOOTPRINTS[name](world) + WIRE_ALLOWANCE
            expected_stages = {"onebit_adam": {"warmup", "compressed"}, "onebit_lamb": {"warmup", "compressed"},
                               "zero_one_adam": {"variance", "compressed", "local"},
                               "diloco": {"local", "outer"}}.get(name)
            assert expected_stages is None or set(stages) == expected_stages, (name, stages)
            for stage, multiple in stages.items():
                assert multiple <= allowed, f"{name} holds {multiple:.3f} model sizes in {stage}, documented {allowed:.3f}"
            # and, at its largest, no less than the algorithm itself needs: the walk does find the state
            assert max(stages.values()) >= FOOTPRINTS[name](world) - 1e-6, (name, stages)


def test_held_bytes_counts_storages_once_and_leaves_out_the_model():
    params = [nn.Parameter(torch.randn(10, 3)), nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    # exp_avg and exp_avg_sq of 37 values, plus each parameter's fp32 0-d step counter
    assert held_bytes(opt) == 2 * 4 * 37 + 2 * 4
    opt.state[params[0]]["alias"] = opt.state[params[0]]["exp_avg"][1:]  # a view: no new storage
    opt.state[params[1]]["grad_again"] = params[1].grad  # the model's gradient: not the optimizer's
    assert held_bytes(opt) == 2 * 4 * 37 + 2 * 4
    opt.state[params[1]]["extra"] = torch.zeros(5, dtype=torch.float64)
    assert held_bytes(opt) == 2 * 4 * 37 + 2 * 4 + 40


def test_update_by_chunks_equals_one_update_per_parameter():
    """Chunks that split parameters anywhere give exactly apply_update_ on whole parameters,
    for fp32, bfloat16 and channels_last parameters, a zero-size one and an inactive one."""
    gen = torch.Generator().manual_seed(3)
    shapes_dtypes = [((4, 3, 2, 2), torch.float32, True), ((5,), torch.bfloat16, False), ((0,), torch.float32, False),
                     ((6, 2), torch.float32, False), ((3,), torch.float32, False)]
    params = []
    for shape, dtype, channels_last in shapes_dtypes:
        t = torch.randn(shape, generator=gen).to(dtype)
        params.append(t.to(memory_format=torch.channels_last) if channels_last else t)
    offsets, start = [], 0
    for p in params:
        offsets.append((start, start + p.numel()))
        start += p.numel()
    u = torch.randn(start, generator=gen)
    lrs, wds, active = [0.1, 0.2, 0.3, 0.4, 0.5], [0.01, 0.0, 0.1, 0.05, 0.0], [True, True, True, True, False]
    expected = [p.clone() for p in params]
    for p, (lo, hi), lr, wd, on in zip(expected, offsets, lrs, wds, active):
        if on:
            apply_update_(p, u[lo:hi], None, lr=lr, weight_decay=wd, step_size=lr)
    update = UpdateByChunks(params, offsets, lrs=lrs, weight_decays=wds, active=active)
    for lo, hi in [(0, 7), (7, 50), (50, 53), (53, start)]:
        update(lo, hi, u[lo:hi].clone())
    for got, want in zip(params, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert not update._pending  # every split parameter was completed


def _added_vs_call(rank, world):
    x = torch.randn(1001, generator=torch.Generator().manual_seed(rank))
    twin = [onebit.comm.CompressedAllReduce("sign") for _ in range(2)]
    results = []
    for _ in range(3):  # errors carry over between calls
        whole = twin[0](x)
        pieces = torch.full_like(x, float("nan"))
        twin[1].input_buffer(x.numel(), x.device).add_(x)
        gathered = onebit.comm.run_stages(twin[1].stages(None))
        twin[1].land(gathered, lambda lo, hi, values: pieces[lo:hi].copy_(values))
        results.append((whole, pieces))
    return results, twin[0].worker_error.error, twin[1].worker_error.error


@pytest.mark.parametrize("world", [2, 3])
def test_the_added_input_handed_out_by_chunks_is_the_compressed_allreduce(world):
    for results, e_call, e_added in run_ranks(_added_vs_call, world):
        for whole, pieces in results:
            assert torch.equal(whole, pieces)
        assert torch.equal(e_call, e_added)
