"""``max_grad_norm`` on real gloo ranks: the averaged gradient clipped exactly as
``clip_grad_norm_`` on one process where the optimizer forms it, each rank's local
gradient where it never exists (1-bit stages, Birder, QAdam)."""

import pytest
import torch

import onebit
from _harness import run_ranks
from _problem import OPTIMIZERS, grads, initial_params, optimizer_class

CLIP = 0.05  # binds on this problem: the gradients' norms are ~0.3-3


def _clip_factor(gs):
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in gs]))
    return torch.clamp(CLIP / (norm + 1e-6), max=1.0)


def _run(rank, world, name, kw, steps, clip_in_optimizer):
    """With ``clip_in_optimizer`` the optimizer clips; otherwise the test feeds gradients already
    clipped as the documentation says: by the average's norm at the steps whose stage sends the
    gradients (their average exists), by the rank's own norm at the others."""
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = optimizer_class(name)(params, max_grad_norm=CLIP if clip_in_optimizer else None, **kw)
    for step in range(1, steps + 1):
        mine = grads([p.detach() for p in params], rank, step)
        if not clip_in_optimizer:
            # (DiLoCo's inner steps are each rank's own: never an average)
            if isinstance(opt, onebit.optim.OnebitOptimizer) and not opt._stages.current.wire.formed:
                every = [grads([p.detach() for p in params], r, step) for r in range(world)]
                factor = _clip_factor([sum(g[i] for g in every) / world for i in range(len(mine))])
            else:
                factor = _clip_factor(mine)
            mine = [g * factor for g in mine]
        for p, g in zip(params, mine):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


# The optimizers that average compressed gradients run uncompressed here, so that their average
# is exact and the test's average equals it.
_EXACT = {"CompAMS": "none", "OnebitAdamNaive": "identity", "ZeroOneAdam": "identity"}


def _compare(rank, world):
    out = {}
    for name, kw in OPTIMIZERS:
        cls = optimizer_class(name)
        kw = dict(kw, compressor=_EXACT[cls.__name__]) if cls.__name__ in _EXACT else kw
        clipped = _run(rank, world, name, kw, 6, True)
        fed = _run(rank, world, name, kw, 6, False)
        out[name] = (clipped, fed)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_clipping_is_what_the_documentation_says(world):
    for name, (clipped, fed) in run_ranks(_compare, world)[0].items():
        for a, b in zip(clipped, fed):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (name, (a - b).abs().max())


def _warmup_vs_torch(rank, world):
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = onebit.OnebitAdam(params, lr=0.05, freeze_step=100, max_grad_norm=CLIP)
    for step in range(1, 6):
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _adamw_on_the_average(world, clip):
    """torch's AdamW on one process, fed the average of the ranks' gradients, clipped by
    ``clip_grad_norm_`` when ``clip`` is given."""
    params = [p.clone().requires_grad_() for p in initial_params()]
    ref = torch.optim.AdamW(params, lr=0.05, weight_decay=0.0)
    for step in range(1, 6):
        every = [grads([p.detach() for p in params], r, step) for r in range(world)]
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in every) / world
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        ref.step()
    return [p.detach() for p in params]


def test_warmup_clip_equals_clip_grad_norm_on_one_process():
    got = run_ranks(_warmup_vs_torch, 3)[0]
    for a, b in zip(got, _adamw_on_the_average(3, CLIP)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # and the clip did bind: unclipped AdamW ends elsewhere
    assert not torch.allclose(_adamw_on_the_average(3, None)[0], got[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), "1", True])
def test_bad_max_grad_norm(bad):
    with pytest.raises(ValueError, match="max_grad_norm"):
        onebit.OnebitAdam([torch.zeros(2, requires_grad=True)], max_grad_norm=bad)
