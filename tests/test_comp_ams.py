"""Comp-AMS and QAdam: against AMSGrad / plain Algorithms 2 and 4, replicas, bytes, resume."""

import math

import pytest
import torch

import onebit
from _harness import run_ranks
from _problem import DIM, flag_bytes, grads, initial_params, run_problem, teacher_student_loss

SIZES = [DIM, 1]


def _train(rank, world, cls_name, steps, kwargs, resume_at=None):
    cls = getattr(onebit, cls_name)
    out = run_problem(lambda params: cls(params, **kwargs), rank, steps, resume_at)
    out["sent"] = [s["bytes_sent"] for s in out["stats"]]
    return out


# ---------------------------------------------------------------- plain oracles from the paper
def _topk(v, ratio):
    k = min(v.numel(), max(1, math.ceil(ratio * v.numel())))
    keep = torch.zeros_like(v)
    idx = v.abs().argsort(descending=True)[:k]
    keep[idx] = v[idx]
    return keep


def _block_sign_per_tensor(v):
    parts = torch.split(v, SIZES)
    return torch.cat([torch.where(torch.signbit(p), -1.0, 1.0) * p.abs().mean() for p in parts])


def _block_sign_64(v):
    """Definition 2 with blocks of 64 consecutive values of the fused gradient (the last shorter)."""
    return torch.cat([torch.where(torch.signbit(p), -1.0, 1.0) * p.abs().mean() for p in torch.split(v, 64)])


def _algorithm2(world, steps, compress, ef, lr, b1, b2, eps):
    x = torch.cat(initial_params())
    m, v, vhat = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    errors = [torch.zeros_like(x) for _ in range(world)]
    for t in range(1, steps + 1):
        sent = []
        for i in range(world):
            g = torch.cat(grads(list(torch.split(x, SIZES)), i, t))
            c = compress(g + errors[i] if ef else g)
            if ef:
                errors[i] = errors[i] + g - c
            sent.append(c)
        gbar = sum(sent) / world
        m = b1 * m + (1 - b1) * gbar
        v = b2 * v + (1 - b2) * gbar**2
        vhat = torch.maximum(v, vhat)
        x = x - lr * m / (vhat.sqrt() + eps)
    return list(torch.split(x, SIZES))


def _uniform(v, bits):
    s = v.abs().max()
    if bits == 1:
        return torch.where(torch.signbit(v), -s, s)
    levels = 2 ** (bits - 1) - 1
    return torch.round(v / s * levels) / levels * s


def _algorithm4(world, steps, bits, lr, b1, b2, eps):
    x = torch.cat(initial_params())
    ms = [torch.zeros_like(x) for _ in range(world)]
    vs = [torch.zeros_like(x) for _ in range(world)]
    errors = [torch.zeros_like(x) for _ in range(world)]
    for t in range(1, steps + 1):
        sent = []
        for i in range(world):
            g = torch.cat(grads(list(torch.split(x, SIZES)), i, t))
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            a = ms[i] / torch.sqrt(vs[i] + eps)
            q = _uniform(a + errors[i], bits)
            errors[i] = errors[i] + a - q
            sent.append(q)
        x = x - lr * sum(sent) / world
    return list(torch.split(x, SIZES))


def _close(got, want, tol=1e-5):
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=tol, atol=tol), (g - w).abs().max()


# ---------------------------------------------------------------- tests
def test_none_equals_amsgrad_on_averaged_gradient():
    kw = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01)
    res = run_ranks(_train, 2, "CompAMS", 8, dict(kw, compressor="none", bias_correction=True))
    params = [p.clone().requires_grad_() for p in initial_params()]
    ref = torch.optim.AdamW(params, amsgrad=True, **kw)
    for step in range(1, 9):
        per_rank = [grads([p.detach() for p in params], r, step) for r in range(2)]
        for i, p in enumerate(params):
            p.grad = (per_rank[0][i] + per_rank[1][i]) / 2
        ref.step()
    _close(res[0]["params"], [p.detach() for p in params])
    assert res[0]["digests"] == res[1]["digests"]


@pytest.mark.parametrize(
    "kwargs,compress,ef",
    [
        (dict(compressor="topk", ratio=0.2), lambda v: _topk(v, 0.2), True),
        (dict(compressor="block_sign", block="tensor", error_feedback=False), _block_sign_per_tensor, False),
        (dict(compressor="block_sign", block="tensor"), _block_sign_per_tensor, True),
        (dict(compressor="block_sign"), _block_sign_64, True),
    ],
    ids=["topk-ef", "block_sign-noef", "block_sign-ef", "block_sign-64-ef"],
)
def test_matches_algorithm_2_with_identical_replicas(kwargs, compress, ef):
    world = 3
    res = run_ranks(_train, world, "CompAMS", 10, dict(kwargs, lr=0.02, betas=(0.9, 0.99)))
    expect = _algorithm2(world, 10, compress, ef, 0.02, 0.9, 0.99, 1e-8)
    for r in res:
        assert r["digests"] == res[0]["digests"]
        _close(r["params"], expect, 1e-4)
    # all-gather of compact payloads: own payload to each of the w - 1 peers
    if kwargs["compressor"] == "topk":
        comp = onebit.compress.get("topk", ratio=0.2)
    elif kwargs.get("block") == "tensor":
        comp = onebit.compress.get("block_sign", block_sizes=SIZES)
    else:
        comp = onebit.compress.get("block_sign", block_size=64)
    assert res[0]["sent"][-1] == (world - 1) * comp.wire_bytes(DIM + 1) + flag_bytes(world)


def test_world_1_is_algorithm_3_and_resume_is_exact():
    kw = dict(compressor="topk", ratio=0.1, lr=0.02)
    straight = _train(0, 1, "CompAMS", 12, kw)
    _close(straight["params"], _algorithm2(1, 12, lambda v: _topk(v, 0.1), True, 0.02, 0.9, 0.999, 1e-8), 1e-4)
    assert _train(0, 1, "CompAMS", 12, kw, resume_at=5)["digests"] == straight["digests"]


def test_wire_volume_relative_to_fp32_allreduce():
    d = 1_000_000
    fp32_ring = 2 * (2 - 1) * 4 * d // 2  # per rank, world size 2
    topk = onebit.compress.get("topk", ratio=0.01).wire_bytes(d)
    block = onebit.compress.get("block_sign").wire_bytes(d)
    assert fp32_ring / topk == pytest.approx(50, rel=0.01)
    assert fp32_ring / block == pytest.approx(32, rel=0.01)


def _mlp(steps, **kw):
    return teacher_student_loss(lambda params: onebit.CompAMS(params, lr=3e-3, **kw), steps)


def test_error_feedback_fixes_top_k_bias():
    """Paper Figure 1 in miniature: one worker, Top-k 1%, with and without error feedback."""
    full = _mlp(400, compressor="none")
    with_ef = _mlp(400, compressor="topk", ratio=0.01)
    without = _mlp(400, compressor="topk", ratio=0.01, error_feedback=False)
    assert with_ef < 1.5 * full, (with_ef, full)
    assert without > 1.5 * with_ef, (without, with_ef)


@pytest.mark.parametrize("bits", [1, 3])
def test_qadam_matches_algorithm_4(bits):
    res = run_ranks(_train, 2, "QAdam", 8, dict(lr=0.01, bits=bits, betas=(0.9, 0.99)))
    assert res[0]["digests"] == res[1]["digests"]
    _close(res[0]["params"], _algorithm4(2, 8, bits, 0.01, 0.9, 0.99, 1e-8), 1e-4)


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.ones(2))]
    cases = [
        (onebit.CompAMS, dict(compressor="qsgd"), ValueError, "Invalid compressor value: 'qsgd'"),
        (onebit.CompAMS, dict(ratio=0.0), ValueError, r"ratio must be in \(0, 1\], got 0.0"),
        (onebit.CompAMS, dict(ratio=2), ValueError, r"ratio must be in \(0, 1\], got 2"),
        (onebit.CompAMS, dict(block=0), ValueError, "Invalid block value: 0"),
        (onebit.CompAMS, dict(block="layer"), ValueError, "Invalid block value: 'layer'"),
        (onebit.CompAMS, dict(error_feedback=1), TypeError, "Invalid error_feedback value: 1"),
        (onebit.CompAMS, dict(lr=-1), ValueError, "Invalid learning rate value: -1"),
        (onebit.CompAMS, dict(betas=(0.9, 1.0)), ValueError, "Invalid beta parameter at index 1: 1.0"),
        (onebit.QAdam, dict(bits=0), ValueError, r"bits must be in \[1, 8\], got 0"),
        (onebit.QAdam, dict(eps=-1.0), ValueError, "Invalid epsilon value: -1.0"),
    ]
    for cls, kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            cls(p, **kwargs)
    for cls in (onebit.CompAMS, onebit.QAdam, onebit.OnebitLamb, onebit.OnebitAdam):
        with pytest.raises(ValueError, match="Invalid learning rate value: -1.0"):
            cls([{"params": p, "lr": -1.0}])
        with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):
            cls([{"params": p, "betas": (0.9, 1.5)}])


@pytest.mark.parametrize("block", ["tensor", 64])
def test_block_sign_with_a_zero_size_parameter(block):
    w, empty = torch.ones(10, requires_grad=True), torch.zeros(0, requires_grad=True)
    opt = onebit.CompAMS([w, empty], lr=0.1, compressor="block_sign", block=block)
    for _ in range(3):
        w.grad, empty.grad = torch.linspace(-1, 1, 10), torch.zeros(0)
        opt.step()
    assert torch.isfinite(w).all() and not torch.equal(w, torch.ones(10))
