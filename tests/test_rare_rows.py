"""Regression tests for the divergences the convergence benchmark found (issue: "Convergence you
can trust").

1-bit Adam and 1-bit LAMB diverged to NaN on a byte-level language model over English text:
embedding rows of rare bytes (UTF-8 continuation bytes seen once in the warm-up) had a tiny
frozen variance, the 1-bit exchange gave their momentum the chunk's magnitude, and the step
``lr * scale / sqrt(v)`` moved them by hundreds; the next lookup of such a row blew up the
loss. Rows never looked up (``v == 0``) have the same problem with ``eps`` alone below.
"""

import math
import warnings

import pytest
import torch

import onebit
from _harness import run_ranks
from onebit.optim import adam_step_bound, clip_to_adam_step_

ROWS, DIM, FREEZE, STEPS, LR = 32, 4, 10, 40, 0.01


def _run(rank, world, name, kw):
    emb = torch.nn.Parameter(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    w = torch.nn.Parameter(torch.zeros(64))
    opt = getattr(onebit, name)([emb, w], lr=LR, freeze_step=FREEZE, **kw)
    start = emb.detach().clone()
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, STEPS + 1):
        g = torch.zeros(ROWS, DIM)
        g[:8] = torch.randn(8, DIM, generator=gen)  # frequent rows
        if step == 1:
            g[8] = 1e-4  # a rare row: one tiny gradient in the whole warm-up
        emb.grad, w.grad = g, torch.randn(64, generator=gen)
        opt.step()
    moved = (emb.detach() - start).abs().amax(dim=1)
    return {"rare": float(moved[8]), "never": float(moved[9:].max()), "finite": bool(torch.isfinite(emb).all())}


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb"])
def test_rare_and_never_seen_rows_stay_put_under_1bit_exchange(name):
    default = run_ranks(_run, 2, name, {})
    paper = run_ranks(_run, 2, name, {"clip_update": None})
    for r in default:
        assert r["finite"]
        assert r["never"] == 0.0  # zero frozen variance: momentum held at zero
        # each compressed step is at most 10x Adam's largest step (the default clip); LAMB's
        # variance is frozen without bias correction and its coefficient is at most max_coeff = 10
        bound = 10.0 if name == "OnebitAdam" else 10 * 10 / math.sqrt(1 - 0.999**FREEZE)
        assert r["rare"] < (STEPS - FREEZE) * LR * adam_step_bound(0.9, 0.999) * bound
    # without the clip the same row takes steps of lr * scale / sqrt(v): the mechanism is real
    assert all(r["rare"] > 100 * d["rare"] for r, d in zip(paper, default))


def test_clip_to_adam_step_bounds_only_values_beyond_a_multiple_of_adams_largest_step():
    denom = torch.tensor([1.0, 1.0, 1e-6, 2.0])
    m = torch.tensor([0.5, -10.0, 1e-3, -1.0])
    clip_to_adam_step_(m, denom, 0.9, 0.999, bias_correction1=0.5, factor=1.0)
    bound = 0.1 / math.sqrt(0.001) * 0.5  # Kingma & Ba: (1 - b1) / sqrt(1 - b2), times 1 - b1^t
    assert torch.equal(m, torch.tensor([0.5, -bound, bound * 1e-6, -1.0]))
    m = torch.tensor([4.0, 40.0])  # denominators of a variance frozen uncorrected: 1 - b2^T = 0.01
    clip_to_adam_step_(m, torch.ones(2), 0.9, 0.999, bias_correction2=0.01, factor=1.0)
    assert torch.allclose(m, torch.tensor([4.0, 0.1 / math.sqrt(0.001) / 0.1]))
    m = torch.tensor([30.0, -40.0])  # the default margin: 10x Adam's largest step
    clip_to_adam_step_(m, torch.ones(2), 0.9, 0.999)
    assert torch.allclose(m, torch.tensor([30.0, -10 * 0.1 / math.sqrt(0.001)]))
    assert adam_step_bound(0.9, 0.999) == pytest.approx(3.1623, abs=1e-4)
    assert adam_step_bound(0.9, 0.9) == 1.0  # (1 - b1) <= sqrt(1 - b2): Adam's step is at most lr


def test_early_freeze_without_bias_correction_warns_and_the_default_does_not():
    def short_run(**kw):
        p = torch.nn.Parameter(torch.ones(3))
        opt = onebit.OnebitAdam([p], lr=1e-3, freeze_step=120, **kw)
        for _ in range(121):
            p.grad = torch.ones(3)
            opt.step()

    with pytest.warns(UserWarning, match=r"frozen at step 120 without bias correction.*11%.*3\.0x Adam's.*step 693"):
        short_run(bias_correction=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short_run()
