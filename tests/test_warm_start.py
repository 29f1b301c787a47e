"""No stall mid-training: the compression kernels are loaded when the optimizer is built.

A fused kernel's first call loads it from numba's cache (~0.5 s) or compiles it (~2 s);
before, that landed on the first compressed step, a visible gap in the middle of a run.
Run in fresh spawned processes, as a user's job starts. The check is on numba's own record
of what each kernel has loaded (its signatures), never on a timing: a timed assertion on a
shared 2-core machine measures the neighbours as much as the code.
"""

import pytest
import torch

import onebit
from _harness import run_ranks


def _kernels() -> dict:
    """Every numba kernel of the fused CPU path and the signatures it has loaded so far."""
    import numba.core.registry

    from onebit.ops import _cpu

    return {name: len(k.signatures) for name, k in vars(_cpu).items()
            if isinstance(k, numba.core.registry.CPUDispatcher)}


# the kernels called from Python, and those called only from other kernels (compiled into them:
# loaded from numba's cache with their caller, they may never get a signature of their own)
_ENTRIES = {"_pack_signs_update", "_average_blocks", "_unpack_signs", "_clamp_scaled", "_zero_where_equal",
            "_stochastic_signs_update", "_max_ratio", "_pack_codes", "_unpack_codes", "_topk_indices"}
_INNER = {"_pack_range", "_average_range", "_few_range", "_few_sum", "_unpack_range", "_random_plus"}

OPTIMIZERS = {
    "OnebitAdam": lambda params: onebit.OnebitAdam(params, lr=1e-3, freeze_step=3),
    # Block-Sign runs no kernel of its own, but decodes with the numba sign decoder.
    "CompAMS/block_sign": lambda params: onebit.CompAMS(params, lr=1e-3, compressor="block_sign"),
}


def _steps(rank, world, name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    fresh = _kernels()
    opt = OPTIMIZERS[name](model.parameters())
    loaded = _kernels()
    gen = torch.Generator().manual_seed(rank)
    stages = []
    for _ in range(6):
        x = torch.randn(16, 64, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        stages.append(opt.stats["stage"])
    return {"fresh": fresh, "loaded": loaded, "after": _kernels(), "stages": stages}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_kernels_are_loaded_at_construction_and_none_during_training(name):
    for r in run_ranks(_steps, 2, name):
        if name == "OnebitAdam":
            assert r["stages"] == ["warmup"] * 3 + ["compressed"] * 3
        assert set(r["loaded"]) == _ENTRIES | _INNER
        assert all(n == 0 for n in r["fresh"].values()), f"kernels loaded before the optimizer: {r['fresh']}"
        assert all(r["loaded"][n] > 0 for n in _ENTRIES), f"kernels not loaded at construction: {r['loaded']}"
        assert r["after"] == r["loaded"], "a kernel was loaded or compiled during training"
