"""No stall mid-training: the compression kernels are loaded when the optimizer is built.

A fused kernel's first call loads it from numba's cache (~0.5 s) or compiles it (~2 s);
before, that landed on the first compressed step, a visible gap in the middle of a run.
Run by torchrun in fresh interpreters, as a user's job starts (the tests' other ranks fork from
a server that has loaded the kernels already). The check is on numba's own record
of what each kernel has loaded (its signatures), never on a timing: a timed assertion on a
shared 2-core machine measures the neighbours as much as the code.
"""

import json
from pathlib import Path

import pytest
import torch

import onebit
import onebit.launch
from _harness import run_ranks, run_torchrun


def _kernels() -> dict:
    """Every numba kernel of the fused CPU path and the signatures it has loaded so far."""
    import numba.core.registry

    from onebit.ops import _cpu

    return {name: len(k.signatures) for name, k in vars(_cpu).items()
            if isinstance(k, numba.core.registry.CPUDispatcher)}


# the kernels called from Python, and those called only from other kernels (compiled into them:
# loaded from numba's cache with their caller, they may never get a signature of their own)
_ENTRIES = {"_pack_signs_update", "_average_blocks", "_unpack_signs", "_clamp_scaled", "_zero_where_equal",
            "_stochastic_signs_update", "_max_ratio", "_pack_codes", "_unpack_codes", "_topk_indices", "_soft_sign"}
_INNER = {"_pack_range", "_average_range", "_few_range", "_few_sum", "_few_tail", "_unpack_range", "_random_plus"}

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
def test_kernels_are_loaded_at_construction_and_none_during_training(tmp_path, name):
    # each rank writes a file: lines two ranks print at once can interleave on the shared stdout
    body = (f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import json\nfrom test_warm_start import _steps\n"
            f"open(f'{tmp_path}/result{{rank}}.json', 'w').write(json.dumps(_steps(rank, world, {name!r})))\n")
    code, out = run_torchrun(tmp_path, body, 2)
    assert code == 0, out
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    for r in results:
        if name == "OnebitAdam":
            assert r["stages"] == ["warmup"] * 3 + ["compressed"] * 3
        assert set(r["loaded"]) == _ENTRIES | _INNER
        assert all(n == 0 for n in r["fresh"].values()), f"kernels loaded before the optimizer: {r['fresh']}"
        assert all(r["loaded"][n] > 0 for n in _ENTRIES), f"kernels not loaded at construction: {r['loaded']}"
        assert r["after"] == r["loaded"], "a kernel was loaded or compiled during training"


def _preloaded(rank, world):
    import sys

    return {"dynamo": "torch._dynamo" in sys.modules, "kernels": _kernels()}


@pytest.mark.skipif(onebit.launch._CTX.get_start_method() != "forkserver",
                    reason="no fork server here: every rank is a fresh interpreter")
def test_ranks_forked_by_spawn_start_with_what_the_first_optimizer_loads():
    # what makes a multi-rank test start in a fraction of a second: loaded once in the fork server
    for r in run_ranks(_preloaded, 2):
        assert r["dynamo"], "torch._dynamo is not loaded in a forked rank"
        assert all(r["kernels"][n] > 0 for n in _ENTRIES), f"kernels not loaded in a forked rank: {r['kernels']}"
