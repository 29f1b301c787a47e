"""Checkpoints written by onebit 0.1.0 (``fixtures/checkpoints-0.1.pt``; DiLoCo's,
``fixtures/diloco-0.1.pt``, by 0.1.0 as it stood before DiLoCo stood apart from the 1-bit
family's base, its outer momentum a flat buffer) load into today's optimizers and resume to the
bits the saving version reached -- but Birder, whose random draws come from another generator
since (SplitMix64, not a ``torch.Generator``): it resumes from the saved state with new draws,
and warns.

The fixture holds, per optimizer, a state_dict saved mid-run (compression stage where there
is one; 1-bit Adam also bucketed, with ``overlap=True``), the model at that step, and the
parameters after the rest of the run. A change to the checkpoint format, or to the math,
fails here. The 1-bit exchanges are built with 0.1.0's arguments where a default has changed
since (one scale per chunk, 1-bit LAMB's largest-element ratio).

"The same bits" is the saving machine's: another CPU's SIMD kernels round the model's forward
and backward differently in the last bits (up to 3e-8 in these parameters between an AVX2 and
an AVX-512 machine), so the parameters are compared to 1e-6, far below what a change of format
or math moves them (1e-3 and more).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

import onebit

FIXTURES = pathlib.Path(__file__).with_name("fixtures")

MAKERS = {
    "OnebitAdam": lambda p: onebit.OnebitAdam(p, lr=1e-2, freeze_step=2, scales="chunk"),
    "OnebitAdam/overlap": lambda p: onebit.OnebitAdam(p, lr=1e-2, freeze_step=2, overlap=True, bucket_cap_mb=0.002,
                                                      scales="chunk"),
    "OnebitAdamNaive": lambda p: onebit.OnebitAdamNaive(p, lr=1e-2, scales="chunk"),
    "OnebitLamb": lambda p: onebit.OnebitLamb(p, lr=1e-2, freeze_step=2, scales="chunk", scaling_ratio="max"),
    "Birder": lambda p: onebit.Birder(p, lr=1e-2, seed=5, threshold_step=3),
    "SoftSignSGD": lambda p: onebit.SoftSignSGD(p, lr=1e-2),
    "CompAMS/topk": lambda p: onebit.CompAMS(p, lr=1e-2, compressor="topk", ratio=0.2),
    "CompAMS/block_sign/overlap": lambda p: onebit.CompAMS(p, lr=1e-2, compressor="block_sign", overlap=True,
                                                           bucket_cap_mb=0.002),
    "QAdam": lambda p: onebit.QAdam(p, lr=1e-2, bits=2),
}
# Saved inside an interval of inner steps, after two synchronisations; the streamed one with a
# synchronisation in flight; the all-reduce's with its errors kept. With the paper's outer step
# and one scale per tensor piece, DiLoCo's defaults then.
PAPER = {"outer_step": "nesterov", "scales": "tensor"}
DILOCO_MAKERS = {
    "DiLoCo": lambda p: onebit.DiLoCo(p, lr=1e-2, sync_every=2, **PAPER),
    "DiLoCo/streamed": lambda p: onebit.DiLoCo(p, lr=1e-2, sync_every=4, fragments=2, delay=1, **PAPER),
    "DiLoCo/allreduce": lambda p: onebit.DiLoCo(p, lr=1e-2, sync_every=2, collective="allreduce",
                                                error_feedback=True, **PAPER),
}
# The fixture files, and the optimizers each holds.
FIXTURE_MAKERS = {"checkpoints-0.1.pt": MAKERS, "diloco-0.1.pt": DILOCO_MAKERS}


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))
    net[0].bias.requires_grad_(False)  # a frozen parameter
    return net


def batch(step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(step))


def _resume(fixture: str, name: str) -> tuple[list[torch.Tensor], dict]:
    """The fixture's optimizer loaded and run to the end: its parameters, and the saved entry."""
    torch.set_num_threads(1)
    saved = torch.load(FIXTURES / fixture, weights_only=True)[name]
    net = model()
    net.load_state_dict(saved["model"])
    opt = FIXTURE_MAKERS[fixture][name](net.parameters())
    opt.load_state_dict(saved["optimizer"])
    at, steps = saved["steps"]
    for step in range(at + 1, steps + 1):
        opt.zero_grad()
        net(batch(step)).pow(2).mean().backward()
        opt.step()
    assert opt.stats["step"] == steps
    return [p.detach() for p in net.parameters()], saved


# Birder's draws came from a torch.Generator in 0.1; they come from SplitMix64 since.
@pytest.mark.parametrize("fixture,name", [(f, n) for f, makers in FIXTURE_MAKERS.items() for n in sorted(makers)
                                          if n != "Birder"])
def test_a_checkpoint_of_version_0_1_resumes_to_the_same_bits(fixture, name):
    params, saved = _resume(fixture, name)
    for i, (got, want) in enumerate(zip(params, saved["final"])):
        diff = float((got - want).abs().max())
        assert diff <= 1e-6, f"{name}: parameter {i} differs after resuming by {diff:.3g}"


def test_a_birder_checkpoint_of_version_0_1_resumes_with_new_draws_and_says_so():
    with pytest.warns(UserWarning, match=r"draws come from onebit 0.1's torch.Generator: they go on from position "
                                         r"\d+ of the SplitMix64 stream of seed 5"):
        params, saved = _resume("checkpoints-0.1.pt", "Birder")
    with pytest.warns(UserWarning):
        again, _ = _resume("checkpoints-0.1.pt", "Birder")
    assert all(torch.equal(a, b) for a, b in zip(params, again)), "the new position is not the same on every resume"
    # Its moments and errors are the saved ones: each step moves a value by at most lr (|u_bar| <= 1)
    # beyond its weight decay, and the draws differ, so the end is near the old one but not on it.
    at, steps = saved["steps"]
    diffs = [float((got - want).abs().max()) for got, want in zip(params, saved["final"])]
    assert 0 < max(diffs) <= 2 * 1e-2 * (steps - at), diffs


def test_a_diloco_checkpoint_of_version_0_1_keeps_its_outer_momentum():
    # an outer optimizer without momentum would drop it: refused
    saved = torch.load(FIXTURES / "diloco-0.1.pt", weights_only=True)["DiLoCo"]
    net = model()
    opt = onebit.DiLoCo(net.parameters(), lr=1e-2, sync_every=2, outer_step="nesterov", outer_lr=1.0,
                        outer_momentum=0.0)
    with pytest.raises(ValueError, match="holds an outer momentum; this optimizer's outer optimizer has none "
                                         "\\(outer_momentum=0.0\\): build it with the outer_momentum it was saved"):
        opt.load_state_dict(saved["optimizer"])
