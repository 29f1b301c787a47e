"""Birder and SoftSignSGD: against plain Algorithm 1 / appendix B, replicas, hierarchy, resume, training."""

import pytest
import torch

import onebit
from _harness import run_ranks
from _oracle import chunks
from _problem import DIM, flag_bytes, grads, initial_params, run_problem, teacher_student_loss

SIZES = [DIM, 1]


def _errors(opt):
    state = opt.state_dict()["onebit"].get("allreduce")
    return state and (state["worker_error"]["error"], state["server_error"]["error"])


def _train(rank, world, cls_name, steps, kwargs, resume_at=None):
    cls = getattr(onebit, cls_name)
    out = run_problem(lambda params: cls(params, **kwargs), rank, steps, resume_at, record=_errors)
    out["sent"] = [s["bytes_sent"] for s in out["stats"]]
    return out


# ---------------------------------------------------------------- plain oracles from the paper
def _q(x, gen):
    """Eq. (5): +1 with probability (x + 1) / 2 (clipped), drawn as in Birder's documentation."""
    r = torch.rand(x.numel(), generator=gen)
    return torch.where(2 * r - 1 < x, 1.0, -1.0)


def _algorithm1(world, steps, lr, beta, eps, wd, seed, threshold=None):
    """Birder, Algorithm 1, for ``world`` simulated workers and per-chunk servers; the random bits of
    worker/server ``i`` come from a generator seeded ``seed + i * 2**32`` (workers draw per chunk, in
    chunk order, then the owner of chunk ``i`` draws for its server step)."""
    x = torch.cat(initial_params())
    d = x.numel()
    bounds = chunks(d, world, 8)
    gens = [torch.Generator().manual_seed(seed + i * 2**32) for i in range(world)]
    m = [torch.zeros(d) for _ in range(world)]
    bhat = [torch.zeros(d) for _ in range(world)]
    b = [torch.zeros(d) for _ in range(world)]
    e = [torch.zeros(d) for _ in range(world)]
    ebar = [torch.zeros(hi - lo) for lo, hi in bounds]
    for t in range(1, steps + 1):
        u = []
        for i in range(world):
            g = torch.cat(grads(list(torch.split(x, SIZES)), i, t))
            m[i] = beta * m[i] + (1 - beta) * g
            bhat[i] = beta * bhat[i] + (1 - beta) * g.abs()
            b[i] = torch.maximum(b[i], bhat[i]) if threshold is not None and t > threshold else bhat[i]
            c = m[i] / (b[i] + eps) + e[i]
            ui = torch.cat([_q(c[lo:hi], gens[i]) for lo, hi in bounds])
            e[i] = c - ui
            u.append(ui)
        ubar = []
        for j, (lo, hi) in enumerate(bounds):
            s = sum(ui[lo:hi] for ui in u) / world + ebar[j]
            q = _q(s, gens[j])
            ebar[j] = s - q
            ubar.append(q)
        x = x * (1 - lr * wd) - lr * torch.cat(ubar)
    return list(torch.split(x, SIZES)), e, ebar


def _soft_sign_sgd(world, steps, lr, beta, eps, weight_decay):
    """Appendix B, Algorithm 1, on the average of the workers' gradients."""
    x = torch.cat(initial_params())
    m, b = torch.zeros_like(x), torch.zeros_like(x)
    for t in range(1, steps + 1):
        g = sum(torch.cat(grads(list(torch.split(x, SIZES)), i, t)) for i in range(world)) / world
        m = beta * m + (1 - beta) * g
        b = beta * b + (1 - beta) * g.abs()
        x = x * (1 - lr * weight_decay) - lr * m / (b + eps)
    return list(torch.split(x, SIZES))


def _close(got, want, tol=1e-5):
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=tol, atol=tol), (g - w).abs().max()


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3])
def test_matches_algorithm_1_with_the_same_random_bits(world):
    kw = dict(lr=0.01, beta=0.9, eps=1e-8, weight_decay=0.05, seed=11)
    res = run_ranks(_train, world, "Birder", 12, dict(kw, threshold_step=6))
    params, e, ebar = _algorithm1(world, 12, 0.01, 0.9, 1e-8, 0.05, 11, threshold=6)
    for i, r in enumerate(res):
        assert r["digests"] == res[0]["digests"], "replicas differ"
        _close(r["params"], params)
        # Lines 9 and 13: e = e + m/b - u on every worker, e_bar = e_bar + avg(u) - u_bar on every server.
        worker, server = r["records"][-1]
        _close([worker, server], [e[i], ebar[i]])
        assert r["stats"][-1]["stage"] == "compressed" and r["stats"][-1]["freeze_step"] is None
    # 1 bit per value: the all-to-all and the all-gather each move (w - 1) slots of ceil(chunk / 8) bytes.
    slot = -(-chunks(DIM + 1, world, 8)[0][1] // 8)
    assert res[0]["sent"][0] == 2 * (world - 1) * slot + flag_bytes(world)


def test_soft_sign_sgd_is_appendix_b_on_the_averaged_gradient():
    kw = dict(lr=0.01, beta=0.9, eps=1e-8, weight_decay=0.05)
    res = run_ranks(_train, 3, "SoftSignSGD", 10, kw)
    for r in res:
        assert r["digests"] == res[0]["digests"]
    _close(res[0]["params"], _soft_sign_sgd(3, 10, **kw))
    assert res[0]["stats"][-1]["stage"] == "warmup"


def test_identity_compressor_at_world_1_is_soft_sign_sgd():
    kw = dict(lr=0.01, beta=0.9, eps=1e-8, weight_decay=0.0)
    got = _train(0, 1, "Birder", 10, dict(kw, compressor="identity"))
    _close(got["params"], _soft_sign_sgd(1, 10, **kw))


def test_resume_is_bit_exact_and_seed_reproducible():
    kw = dict(lr=0.01, seed=5)
    straight = _train(0, 1, "Birder", 12, kw)
    assert _train(0, 1, "Birder", 12, kw, resume_at=5)["digests"] == straight["digests"]
    assert _train(0, 1, "Birder", 12, kw)["digests"] == straight["digests"]
    assert _train(0, 1, "Birder", 12, dict(kw, seed=6))["digests"] != straight["digests"]


def test_resume_bit_exact_on_two_ranks():
    kw = dict(lr=0.01, seed=5)
    straight = run_ranks(_train, 2, "Birder", 10, kw)
    resumed = run_ranks(_train, 2, "Birder", 10, kw, 4)
    assert [r["digests"] for r in straight] == [r["digests"] for r in resumed]


def _hier_train(rank, world, steps):
    out = {}
    for mode in (True, False):
        res = run_problem(
            lambda params: onebit.Birder(params, lr=0.05, seed=2, hierarchical=mode, ranks_per_node=2), rank, steps
        )
        out[mode] = res
    return out


def test_hierarchical_birder_on_two_nodes_of_two():
    res = run_ranks(_hier_train, 4, 30)
    for mode in (True, False):
        assert len({r[mode]["digests"][-1] for r in res}) == 1, f"replicas differ (hierarchical={mode})"
        assert all(len(set(r[mode]["digests"])) == 30 for r in res)
    start = torch.cat(initial_params())
    target = torch.linspace(-1, 1, DIM)
    for mode in (True, False):
        w = res[0][mode]["params"][0]
        assert (w - target).norm() < 0.5 * (start[:DIM] - target).norm(), mode
    assert res[0][True]["digests"] != res[0][False]["digests"]


def test_trains_like_soft_sign_sgd_and_adamw():
    """With a decaying learning rate (as in the paper's runs) the +-lr noise of Q fades out."""
    def loss(make):
        return teacher_student_loss(make, 400, linear_decay=True)

    adamw = loss(lambda p: torch.optim.AdamW(p, lr=3e-3))
    soft = loss(lambda p: onebit.SoftSignSGD(p, lr=3e-3))
    bird = loss(lambda p: onebit.Birder(p, lr=3e-3))
    assert bird < 1.05 * soft and bird < 1.05 * adamw, (bird, soft, adamw)


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.ones(2))]
    cases = [
        (onebit.Birder, dict(beta=1.0), ValueError, "Invalid beta value: 1.0"),
        (onebit.Birder, dict(beta="0.9"), TypeError, "Invalid beta value: '0.9'"),
        (onebit.Birder, dict(seed=-1), ValueError, "Invalid seed value: -1"),
        (onebit.Birder, dict(seed=1.0), TypeError, "Invalid seed value: 1.0"),
        (onebit.Birder, dict(threshold_step=-2), ValueError, "Invalid threshold_step value: -2"),
        (onebit.Birder, dict(compressor="sign"), ValueError, "Invalid compressor value: 'sign'"),
        (onebit.Birder, dict(hierarchical="maybe"), ValueError, "hierarchical must be True, False or 'auto'"),
        (onebit.Birder, dict(hierarchical=True), ValueError, "ranks_per_node is required"),
        (onebit.Birder, dict(lr=-1), ValueError, "Invalid learning rate value: -1"),
        (onebit.SoftSignSGD, dict(eps=-1.0), ValueError, "Invalid epsilon value: -1.0"),
        (onebit.SoftSignSGD, dict(weight_decay=-0.1), ValueError, "Invalid weight_decay value: -0.1"),
    ]
    for cls, kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            cls(p, **kwargs)
    for cls in (onebit.Birder, onebit.SoftSignSGD):
        with pytest.raises(ValueError, match="Invalid beta value: 1.5"):
            cls([{"params": p, "beta": 1.5}])
