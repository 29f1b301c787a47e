"""0/1 Adam: a plain n-worker Algorithm 1 (refreshes, 1-bit synchronisation, local steps), replicas
identical at every synchronisation and only there, checkpoints inside an interval, arguments."""

import io
import math

import pytest
import torch

import onebit
from _harness import run_ranks
from _oracle import SimulatedCompressedAllReduce
from _problem import digest, run_problem
from _problem import grads as _grads
from _problem import initial_params as _params

# refreshes 1, 2, 4, 6, 8; the variance frozen after step 10; then intervals of 1, 2 (from step
# 15), 4 (from step 19, capped there): syncs at 11, 12, 13, 14, 16, 18, 20, 24, 28
SCHEDULE = dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=4, local_step_clipper=4)
STEPS = 28


def _train(rank, world, steps, kw, resume_at=None):
    return run_problem(lambda params: onebit.ZeroOneAdam(params, **kw), rank, steps, resume_at)


# ---------------------------------------------------------------- the schedules, written out
def _refresh_steps(freeze, kappa, cap=None):
    """T_v: every step while the interval is 1; the interval doubles after every kappa refreshes
    (never beyond `cap`), and a refresh falls on the next multiple of it."""
    steps, interval, t = [], 1, 1
    while True:
        t = math.ceil(t / interval) * interval
        if t > freeze:
            return steps
        steps.append(t)
        t += 1
        if len(steps) % kappa == 0:
            interval = interval * 2 if cap is None else min(cap, interval * 2)


def _synchronises(t, freeze, scaler, clipper):
    """T_u: every step up to the freeze; then steps that are multiples of H, which doubles every
    `scaler` steps up to `clipper`."""
    if t <= freeze:
        return True
    h = min(clipper, 2 ** ((t - freeze - 1) // scaler))
    return t % h == 0


def _zero_one_adam(world, steps, lr, b1, b2, eps, wd, schedule, bias_correction, clip, per_tensor=False,
                   cap=None, by_steps=False):
    """Algorithm 1 of 0/1 Adam with n simulated workers, one process, plain loops: each worker its
    own x and m between synchronisations, u its step-weighted momentum sum, one x everywhere after.
    Before the freeze a synchronisation sends the gradients (DeepSpeed's form); the errors of the
    1-bit exchange restart at the freeze. `per_tensor`: one scale per tensor piece of a chunk.
    onebit's refreshes: `cap` bounds their interval; `by_steps`: v takes g^2 as if every step since
    the last refresh had seen it, and is bias-corrected by the last refresh's step, not their count."""
    freeze = schedule["var_freeze_step"]
    refreshes = _refresh_steps(freeze, schedule["var_update_scaler"], cap)
    sizes = [p.numel() for p in _params()]
    x0 = torch.cat(_params())
    xs = [x0.clone() for _ in range(world)]
    anchor = x0.clone()
    ms = [torch.zeros_like(x0) for _ in range(world)]
    us = [torch.zeros_like(x0) for _ in range(world)]
    v = torch.zeros_like(x0)
    segments = [0, sizes[0]] if per_tensor else None
    car = SimulatedCompressedAllReduce(world, x0.numel(), segments=segments)
    weight_sum = lr_sum = 0.0
    k = 0
    frozen = None
    for t in range(1, steps + 1):
        gs = [torch.cat(_grads(list(torch.split(xs[r], sizes)), r, t)) for r in range(world)]
        bc1 = 1 - b1**t if bias_correction else 1.0
        if t in refreshes:  # the exact average refreshes v and m; x takes an Adam step
            g = sum(gs) / world
            decay = b2 ** (t - k) if by_steps else b2
            k = t if by_steps else k + 1
            ms = [b1 * ms[0] + (1 - b1) * g] * world
            v = decay * v + (1 - decay) * g * g
            d = (v / (1 - b2**k if bias_correction else 1.0)).sqrt() + eps
            xs = [anchor * (1 - lr * wd) - lr / bc1 * ms[0] / d] * world
            anchor = xs[0]
        else:
            d = frozen if frozen is not None else (v / (1 - b2**k if bias_correction else 1.0)).sqrt() + eps
            bc2 = 1.0 if bias_correction else 1 - b2**k

            def protect(m):
                m = torch.where(v == 0, 0.0, m)  # never refreshed: no step (it would be divided by eps)
                if clip is None:
                    return m
                bound = clip * max(1.0, (1 - b1) / math.sqrt(1 - b2)) * bc1 / math.sqrt(bc2) * d
                return torch.maximum(torch.minimum(m, bound), -bound)

            half = [b1 * ms[r] + (1 - b1) * gs[r] for r in range(world)]
            weight_sum += lr / bc1
            lr_sum += lr
            if t <= freeze or _synchronises(t, freeze, schedule["local_step_scaler"], schedule["local_step_clipper"]):
                us = [us[r] + lr / bc1 * half[r] for r in range(world)]
                if t <= freeze:  # the gradients' 1-bit average enters m
                    m = protect(b1 * ms[0] + (1 - b1) * car(gs))
                else:  # the interval's weighted average momentum replaces it
                    m = protect(car([u / weight_sum for u in us]))
                xs = [anchor * (1 - lr_sum * wd) - weight_sum * m / d] * world
                anchor = xs[0]
                ms = [m] * world
                us = [torch.zeros_like(x0) for _ in range(world)]
                weight_sum = lr_sum = 0.0
            else:  # a local step, on this worker's own momentum
                ms = [protect(h) for h in half]
                us = [us[r] + lr / bc1 * ms[r] for r in range(world)]
                xs = [anchor * (1 - lr_sum * wd) - us[r] / d for r in range(world)]
        if t == freeze:
            frozen = (v / (1 - b2**k if bias_correction else 1.0)).sqrt() + eps
            car = SimulatedCompressedAllReduce(world, x0.numel(), segments=segments)
    return [list(torch.split(x, sizes)) for x in xs]


# ---------------------------------------------------------------- tests
# onebit's form (bias correction, weight decay, a clip tight enough to bind, refreshes at least
# every 2nd step weighted by their span); the same without bias correction (the clip's bound then
# reads the variance's exponent); DeepSpeed's
_ONEBIT = dict(clip_update=0.3, weight_decay=0.05, max_refresh_interval=2)
_FORMS = {"onebit": _ONEBIT, "uncorrected": dict(_ONEBIT, bias_correction=False),
          "deepspeed": dict(bias_correction=False, clip_update=None, weight_decay=0.0, scales="chunk",
                            max_refresh_interval=None, refresh_weight="refresh")}


@pytest.mark.parametrize("world,form", [(2, "deepspeed"), (3, "onebit"), (2, "uncorrected")])
def test_matches_algorithm_1_with_local_steps(world, form):
    kw = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8)
    ours = _FORMS[form]
    defaults = form != "deepspeed"
    res = run_ranks(_train, world, STEPS, dict(kw, **SCHEDULE, **ours))
    expect = _zero_one_adam(world, STEPS, 0.02, 0.9, 0.99, 1e-8, ours["weight_decay"], SCHEDULE,
                            bias_correction=ours.get("bias_correction", True), clip=ours["clip_update"],
                            per_tensor=defaults, cap=ours["max_refresh_interval"], by_steps=defaults)
    for r, want in zip(res, expect):
        for got, w in zip(r["params"], want):
            assert torch.allclose(got, w, rtol=1e-4, atol=1e-6), (got - w).abs().max()
    stages = [s["stage"] for s in res[0]["stats"]]
    refresh = {1, 2, 4, 6, 8, 10} if defaults else {1, 2, 4, 6, 8}
    sync = {3, 5, 7, 9, 10, 11, 12, 13, 14, 16, 18, 20, 24, 28} - refresh
    assert stages == ["variance" if t in refresh else "compressed" if t in sync else "local"
                      for t in range(1, STEPS + 1)]
    assert res[0]["stats"][-1]["freeze_step"] == 10
    # identical after every refresh and synchronisation, different after (some) local steps
    for t in range(STEPS):
        if stages[t] != "local":
            assert all(r["digests"][t] == res[0]["digests"][t] for r in res), t
    assert any(r["digests"][t] != res[0]["digests"][t] for r in res for t in range(STEPS) if stages[t] == "local")
    # a local step sends only the step's agreement; a refresh the fp32 gradients
    sent = {s["stage"]: s["bytes_sent"] for s in res[0]["stats"]}
    assert sent["local"] < sent["compressed"] < sent["variance"]


def _replicas(rank, world, tamper):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = onebit.ZeroOneAdam(model.parameters(), lr=0.01, **SCHEDULE, check_replicas_every=1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, 20):
        if tamper and step == 19 and rank == 1:  # inside an interval: only the anchor is shared
            opt.state[model.weight]["anchor"][0, 0] += 1.0
        opt.zero_grad()
        model(torch.randn(8, 6, generator=gen)).square().mean().backward()
        try:
            opt.step()
        except onebit.ReplicaDivergence as exc:
            return step, opt.stats["stage"], str(exc)
    return None


def _reload(rank, world):
    model = torch.nn.Linear(4, 2)
    opt = onebit.ZeroOneAdam(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    other = onebit.ZeroOneAdam(model.parameters(), lr=1e-3, max_refresh_interval=None, refresh_weight="refresh")
    with pytest.warns(UserWarning, match="saved with refreshes .*'refresh_weight': 'steps'"):
        other.load_state_dict(state)
    return True


def test_a_state_of_another_refresh_schedule_loads_with_a_warning():
    assert all(run_ranks(_reload, 2))


def test_check_replicas_compares_anchors_between_synchronisations():
    assert run_ranks(_replicas, 2, False) == [None, None]  # local steps at 15, 17, 19 pass
    step, stage, message = run_ranks(_replicas, 2, True)[0]
    assert (step, stage) == (19, "local") and "anchors" in message


def _resume_inside_interval(rank, world, weights_from_elsewhere):
    """Save after local step 19, reload into fresh objects; the model's weights replaced by
    zeros (as loading another rank's) when asked: the optimizer restores this rank's own."""
    kw = dict(lr=0.02, weight_decay=0.01, **SCHEDULE)
    params = [p.clone().requires_grad_() for p in _params()]
    opt = onebit.ZeroOneAdam(params, **kw)
    digests = []
    for step in range(1, STEPS + 1):
        for p, g in zip(params, _grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
        digests.append(digest(params))
        if step == 19:
            assert opt.stats["stage"] == "local"
            buf = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buf)
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            params = [(torch.zeros_like(p) if weights_from_elsewhere else p.clone()).requires_grad_()
                      for p in ckpt["params"]]
            opt = onebit.ZeroOneAdam(params, **kw, broadcast_parameters=False)
            opt.load_state_dict(ckpt["opt"])
            assert digest(params) == digests[-1]
    return digests


@pytest.mark.parametrize("weights_from_elsewhere", [False, True])
def test_resume_inside_an_interval_is_bit_exact_on_every_rank(weights_from_elsewhere):
    straight = run_ranks(_train, 2, STEPS, dict(lr=0.02, weight_decay=0.01, **SCHEDULE))
    resumed = run_ranks(_resume_inside_interval, 2, weights_from_elsewhere)
    for a, b in zip(straight, resumed):
        assert a["digests"] == b
    assert straight[0]["digests"][18] != straight[1]["digests"][18]  # step 19 is local: ranks differ


def _rank0_everywhere(rank, world):
    """Saved after local step 19 on rank 0 alone (the DDP habit), its state and parameters loaded on
    every rank: each rank beside the parameters saved with its state, so it trains on."""
    kw = dict(lr=0.02, weight_decay=0.01, **SCHEDULE)
    params = [p.clone().requires_grad_() for p in _params()]
    opt = onebit.ZeroOneAdam(params, **kw)
    digests = []
    for step in range(1, STEPS + 1):
        if step == 20:
            saved = [None] * world
            torch.distributed.all_gather_object(saved, {"opt": opt.state_dict(), "params": params})
            params = [p.detach().clone().requires_grad_() for p in saved[0]["params"]]
            opt = onebit.ZeroOneAdam(params, **kw, broadcast_parameters=False)
            opt.load_state_dict(saved[0]["opt"])
        for p, g in zip(params, _grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
        digests.append((opt.stats["stage"], digest(params)))
    return digests


def test_rank0s_state_and_parameters_loaded_on_every_rank_inside_an_interval_train_on():
    res = run_ranks(_rank0_everywhere, 2)
    assert res[0][18][0] == "local"  # saved inside an interval
    synced = [t for t in range(19, STEPS) if res[0][t][0] != "local"]
    assert synced and all(res[0][t] == res[1][t] for t in synced)


def _missing(rank, world):
    """A frozen tensor, one unused everywhere, one with a gradient on rank 0 only, through local steps."""
    torch.manual_seed(0)
    w, frozen, unused, partial = (torch.nn.Parameter(torch.randn(5)) for _ in range(4))
    frozen.requires_grad_(False)
    before = [t.detach().clone() for t in (frozen, unused)]
    opt = onebit.ZeroOneAdam([w, frozen, unused, partial], lr=0.05, weight_decay=0.1, **SCHEDULE)
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(5, generator=gen)
        loss = (w * x).sum().square() + ((partial * x).sum().square() if rank == 0 else 0.0)
        loss.backward()
        opt.step()
        out.append((opt.stats["stage"], digest([w, partial])))
    return out, all(torch.equal(a, b) for a, b in zip(before, (frozen, unused)))


def test_missing_and_partial_gradients_through_local_steps():
    res = run_ranks(_missing, 3)
    assert all(untouched for _, untouched in res)
    for t, (stage, d) in enumerate(res[0][0]):
        if stage != "local":
            assert all(r[0][t][1] == d for r in res), t


def _overlap(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = onebit.ZeroOneAdam(model.parameters(), lr=0.01, overlap=True, bucket_cap_mb=0.001, **SCHEDULE,
                             check_replicas_every=1)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, opt.stats


def test_overlapped_exchange_with_local_steps():
    res = run_ranks(_overlap, 2)
    losses, stats = res[0]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    assert stats["stage"] == "compressed" and stats["skipped_steps"] == 0


def test_schedule_matches_its_definition():
    s = onebit.optim.ZeroOneSchedule(1000, 3, 7, 16)
    assert [t for t in range(1, 1001) if s.refreshes(t)] == _refresh_steps(1000, 3)
    assert all(s.synchronises(t) == _synchronises(t, 1000, 7, 16) for t in range(1, 1300))
    assert s.refreshes_through(1000) == len(_refresh_steps(1000, 3))
    assert s.interval(10**12) == 16
    capped = onebit.optim.ZeroOneSchedule(1000, 3, 7, 16, max_refresh_interval=8)
    assert [t for t in range(1, 1001) if capped.refreshes(t)] == _refresh_steps(1000, 3, 8)
    assert capped.last_refresh(1000) == 1000 and capped.last_refresh(999) == 992 and capped.last_refresh(0) == 0


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(var_freeze_step=0), ValueError, "var_freeze_step"),
    (dict(var_update_scaler=1.5), TypeError, "var_update_scaler"),
    (dict(local_step_scaler=True), TypeError, "local_step_scaler"),
    (dict(local_step_clipper=-2), ValueError, "local_step_clipper"),
    (dict(max_refresh_interval=0), ValueError, "max_refresh_interval"),
    (dict(refresh_weight="step"), ValueError, "refresh_weight"),
    (dict(clip_update=0.0), ValueError, "clip_update"),
    (dict(bias_correction=1), TypeError, "bias_correction"),
    (dict(betas=(1.0, 0.999)), ValueError, "beta"),
])
def test_argument_errors_name_the_argument(kwargs, error, words):
    with pytest.raises(error, match=words):
        onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def _rare(rank, world, stages):
    """``rare`` has a gradient only at steps that refresh nothing (1-bit and local steps): no
    refresh ever sees it, so its variance stays zero and it must not move -- a step there would
    be divided by eps."""
    torch.manual_seed(0)
    w, rare = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    before = rare.detach().clone()
    opt = onebit.ZeroOneAdam([w, rare], lr=0.05, **SCHEDULE)
    gen = torch.Generator().manual_seed(rank)
    still = True
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        x = torch.randn(5, generator=gen)
        loss = (w * x).sum().square() + ((rare * x).sum().square() if stages[step - 1] != "variance" else 0.0)
        loss.backward()
        opt.step()
        still &= torch.equal(rare.detach(), before)  # after every step, local ones included
    return still, bool(torch.isfinite(w).all())


def test_values_no_refresh_has_seen_do_not_move_in_local_or_1bit_steps():
    stages = ["variance" if t in {1, 2, 4, 6, 8} else "other" for t in range(1, STEPS + 1)]
    assert run_ranks(_rare, 2, stages) == [(True, True), (True, True)]
