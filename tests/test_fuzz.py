"""Property tests on real ranks: random shapes, dtypes, optimizers and NaN faults, world sizes 1-4.

Every rank runs the same derandomized hypothesis sequence (no shrinking, so ranks never
diverge in what they run); a failed invariant on one rank fails the run.
"""

import zlib

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import onebit
from _harness import run_ranks
from onebit.comm import _dist

OPTIMIZERS = {
    "OnebitAdam": dict(lr=0.01, freeze_step=2),
    "OnebitLamb": dict(lr=0.01, freeze_step=2),
    "CompAMS": dict(lr=0.01, compressor="block_sign"),
    "QAdam": dict(lr=0.01),
    "Birder": dict(lr=0.01),
    "SoftSignSGD": dict(lr=0.01),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _crc(tensors) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def _agree(value: int) -> bool:
    table = _dist.all_gather_object_sizes([value])
    return bool((table == table[0]).all())


def _fuzz(rank, world, examples):
    checked = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(
        name=st.sampled_from(sorted(OPTIMIZERS)),
        shapes=st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=3), min_size=1, max_size=3),
        dtype=st.sampled_from(sorted(DTYPES)),
        fault=st.one_of(st.none(), st.tuples(st.integers(0, world - 1), st.integers(1, 4))),
        seed=st.integers(0, 2**16),
    )
    def run(name, shapes, dtype, fault, seed):
        gen = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(DTYPES[dtype])) for s in shapes]
        opt = getattr(onebit, name)(params, timeout=30, **OPTIMIZERS[name])
        data = torch.Generator().manual_seed(seed * 10 + rank)
        for step in range(1, 5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=data).to(p.dtype)
            if fault == (rank, step):
                params[0].grad.view(-1)[0] = float("nan")
            before = _crc(params)
            opt.step()
            assert _agree(_crc(params)), f"replicas differ after step {step}"
            if fault is not None and fault[1] == step:
                assert _crc(params) == before, "a step with a NaN gradient changed parameters"
        skipped = 0 if fault is None else 1
        assert opt.stats["skipped_steps"] == skipped and opt.stats["step"] == 4 - skipped
        state = opt.state_dict()["onebit"]["flat"]
        assert all(bool(torch.isfinite(t).all()) for t in state.values())
        assert all(bool(torch.isfinite(p).all()) for p in params)
        checked.append((name, dtype))

    run()
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_invariants_hold_for_random_problems_and_faults(world):
    results = run_ranks(_fuzz, world, 30, timeout=600)
    assert results[0] == results[-1] and len(results[0]) == 30
    assert {name for name, _ in results[0]} == set(OPTIMIZERS)


def test_world_size_one():
    checked = _fuzz(0, 1, 30)
    assert len(checked) == 30
