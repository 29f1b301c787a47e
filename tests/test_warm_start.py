"""No stall mid-training: the compression kernels are loaded when the optimizer is built.

A fused kernel's first call loads it from numba's cache (~0.5 s) or compiles it (~2 s);
before, that landed on the first compressed step, a visible gap in the middle of a run.
Run in fresh spawned processes, as a user's job starts.
"""

import statistics
import time

import torch

import onebit
from _harness import run_ranks


def _steps(rank, world):
    from onebit.ops import _cpu

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=3)
    loaded = (len(_cpu._pack_signs_update.signatures), len(_cpu._average_signs.signatures))
    gen = torch.Generator().manual_seed(rank)
    times, stages = [], []
    for _ in range(14):
        x = torch.randn(64, 512, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x).backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        stages.append(opt.stats["stage"])
    after = (len(_cpu._pack_signs_update.signatures), len(_cpu._average_signs.signatures))
    return {"loaded": loaded, "after": after, "times": times, "stages": stages}


def test_kernels_are_loaded_at_construction_and_the_first_compressed_step_does_not_stall():
    ratios = []
    for r in run_ranks(_steps, 2):
        assert r["stages"][:4] == ["warmup", "warmup", "warmup", "compressed"]
        assert min(r["loaded"]) > 0, "kernels not loaded at construction"
        assert r["after"] == r["loaded"], "a kernel was compiled during training"
        ratios.append(r["times"][3] / statistics.median(r["times"][4:]))
    # A kernel load stalls every rank by ~0.5 s (20x these ~25 ms steps); one rank's scheduling
    # noise on a shared 2-core machine reaches ~1.8x, so the quieter rank is the measure.
    assert min(ratios) <= 2.0, f"first compressed step / the next ones' median: {ratios}"
