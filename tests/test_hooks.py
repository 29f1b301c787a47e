"""DDP communication hooks on real gloo ranks: exactness, training quality, pickling and resume."""

import hashlib
import io
import itertools
import pickle

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _harness import run_ranks
from onebit import comm
from onebit.hooks import BirderState, ErrorFeedbackState, birder_hook, error_feedback_hook


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    )


def _teacher() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _make_state(kind):
    if kind == "identity":
        return ErrorFeedbackState(compressor="identity"), error_feedback_hook
    if kind == "sign":
        return ErrorFeedbackState(), error_feedback_hook
    if kind == "birder":
        return BirderState(seed=4), birder_hook
    return None, None


def _make_opt(kind, params, lr):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.0 if kind == "birder" else 0.9)


def _ddp(kind, model):
    # A small bucket cap gives one bucket per layer: bucket boundaries are exercised.
    ddp = DDP(model, bucket_cap_mb=0.01)
    state, hook = _make_state(kind)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp, state


def _train(rank, world, kind, opt_kind, lr, steps, restart_at=None, via="pickle"):
    model, teacher = _model(), _teacher()
    ddp, state = _ddp(kind, model)
    opt = _make_opt(opt_kind, ddp.parameters(), lr)
    gen = torch.Generator().manual_seed(100 + rank)
    digests = []
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        for g in opt.param_groups:
            g["lr"] = lr * (1 - step / steps)
        loss = torch.nn.functional.mse_loss(ddp(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
        digests.append(_digest(model))
        if step + 1 == restart_at:
            if via == "pickle":
                restored_state = pickle.loads(pickle.dumps(state))
            elif via == "fresh":
                restored_state = _make_state(kind)[0]
            else:
                buf = io.BytesIO()
                torch.save(state.state_dict(), buf)
                buf.seek(0)
                restored_state = _make_state(kind)[0]
                restored_state.load_state_dict(torch.load(buf, weights_only=True))
            saved_opt = opt.state_dict()
            model = _model()
            model.load_state_dict(ddp.module.state_dict())
            ddp = DDP(model, bucket_cap_mb=0.01)
            ddp.register_comm_hook(restored_state, _make_state(kind)[1])
            state = restored_state
            opt = _make_opt(opt_kind, ddp.parameters(), lr)
            opt.load_state_dict(saved_opt)
    xe = torch.randn(2048, 16, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        held_out = float(torch.nn.functional.mse_loss(model(xe), teacher(xe)))
    buckets = None if state is None else sorted((i, b["numel"]) for i, b in state.state_dict()["buckets"].items())
    return {"digests": digests, "loss": held_out, "iter": None if state is None else state.iter, "buckets": buckets}


def test_identity_hook_equals_plain_ddp_exactly():
    plain = run_ranks(_train, 2, None, "sgd", 0.05, 6)
    hooked = run_ranks(_train, 2, "identity", "sgd", 0.05, 6)
    assert plain[0]["digests"] == plain[1]["digests"]
    assert [r["digests"] for r in hooked] == [r["digests"] for r in plain]
    assert hooked[0]["iter"] == 6


def _schedule_worker(rank, world):
    """Per kind and iteration: each hook call's (index, is_last, future done on return), the
    ops that went on the wire, and whether each bucket's result equals that bucket exchanged
    alone and blocking (a plain all-reduce, then one CompressedAllReduce per bucket index)."""
    out = {}
    for kind in ("sign", "birder"):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 32)] + [torch.nn.Linear(32, 32) for _ in range(3)] + [torch.nn.Linear(32, 1)]
        ddp = DDP(torch.nn.Sequential(*layers), bucket_cap_mb=0.002)
        state, hook = _make_state(kind)
        calls = []

        def spy(state, bucket):
            grad_in = bucket.buffer().clone()
            fut = hook(state, bucket)
            starts = [0, *itertools.accumulate(g.numel() for g in bucket.gradients()[:-1])]
            calls[-1].append([bucket.index(), bucket.is_last(), fut.done(), grad_in, fut, starts])
            return fut

        ddp.register_comm_hook(state, spy)
        gen = torch.Generator().manual_seed(rank)
        ops = []
        for _ in range(4):
            calls.append([])
            with comm.measure() as m:
                ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            ops.append(sorted(m.by_op))
            for call in calls[-1]:
                call[4] = call[4].value().clone()  # DDP reuses the bucket's buffer next iteration
        same = None
        if kind == "sign":
            alone: dict[int, comm.CompressedAllReduce] = {}
            # one scale per tensor piece of each chunk (the default scales="tensor")
            same = [torch.equal(got, comm.all_reduce_mean(grad_in) if it < 2 else
                                alone.setdefault(index, comm.CompressedAllReduce("sign", segments=starts))(grad_in))
                    for it, iteration in enumerate(calls) for index, _, _, grad_in, got, starts in iteration]
        out[kind] = {"calls": [[tuple(c[:3]) for c in it] for it in calls], "ops": ops, "same": same,
                     "tensors": max(len(c[5]) for it in calls for c in it)}
    return out


def test_hooks_return_before_their_exchange_ends_and_give_the_blocking_bits():
    """Every bucket but the last returns a future still pending (its exchange overlaps the rest
    of backward); no collective beyond the exchanges themselves (no per-bucket flag agreement);
    and each bucket's result is bit-identical to exchanging it alone, blocking."""
    for r in run_ranks(_schedule_worker, 3):
        for kind, res in r.items():
            rebuilt = res["calls"][1:]
            assert all(len(it) >= 3 for it in rebuilt), res["calls"]
            for it in res["calls"]:
                assert [index for index, _, _ in it] == list(range(len(it)))
                assert [done for _, _, done in it] == [last for _, last, _ in it], (kind, it)
            assert res["ops"] == [["all_reduce"]] * 2 + [["all_gather", "all_to_all"]] * 2, kind
        assert all(r["sign"]["same"]), r["sign"]["same"]
        assert r["sign"]["tensors"] > 1  # a bucket of several tensors: one scale each


def test_one_bit_hooks_train_near_the_ddp_loss():
    steps = 300
    ddp_sgd = run_ranks(_train, 2, None, "sgd", 0.05, steps)
    sign = run_ranks(_train, 2, "sign", "sgd", 0.05, steps)
    ddp_adamw = run_ranks(_train, 2, None, "adamw", 3e-3, steps)
    birder = run_ranks(_train, 2, "birder", "birder", 3e-3, steps)
    for res in (sign, birder):
        assert res[0]["digests"] == res[1]["digests"], "replicas differ"
    assert sign[0]["loss"] < 1.3 * ddp_sgd[0]["loss"], (sign[0]["loss"], ddp_sgd[0]["loss"])
    assert birder[0]["loss"] < 1.3 * ddp_adamw[0]["loss"], (birder[0]["loss"], ddp_adamw[0]["loss"])


def _abort(rank, world, kind, explicit):
    """Backward raises part-way at step 3, after the later buckets' exchanges started; DDP cannot
    go on, so a new instance takes the state: the same live one (``explicit``: restored from its
    own state_dict first, as the warning says it does)."""
    opt_kind, lr = ("birder", 3e-3) if kind == "birder" else ("sgd", 0.05)
    model, teacher = _model(), _teacher()
    ddp, state = _ddp(kind, model)
    opt = _make_opt(opt_kind, model.parameters(), lr)
    gen = torch.Generator().manual_seed(100 + rank)
    digests, left = [], None
    for step in range(8):
        x = torch.randn(32, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), teacher(x).detach())
        opt.zero_grad()
        if step != 3:
            loss.backward()
            opt.step()
            digests.append(_digest(model))
            continue
        handle = model[0].weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("abort")))
        with pytest.raises(RuntimeError, match="abort"):
            loss.backward()
        handle.remove()
        left = len(state._flights)
        opt.zero_grad()
        if explicit:
            state.load_state_dict(state.state_dict())
        ddp = DDP(model, bucket_cap_mb=0.01)
        ddp.register_comm_hook(state, _make_state(kind)[1])
    # The same live state on yet another DDP instance, without a restore: its first iteration
    # has DDP's initial bucket layout, which the live buckets were not built for.
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, _make_state(kind)[1])
    try:
        ddp(torch.randn(32, 16, generator=gen)).sum().backward()
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"digests": digests, "left": left, "iter": state.iter, "error": error}


@pytest.mark.parametrize("kind", ["sign", "birder"])
def test_a_backward_that_raised_part_way_is_dropped_and_the_state_restored(kind):
    auto = run_ranks(_abort, 2, kind, False)
    explicit = run_ranks(_abort, 2, kind, True)
    assert auto[0]["left"] >= 1, "no exchange was in flight when backward raised"
    assert auto[0]["digests"] == auto[1]["digests"], "replicas differ"
    assert auto[0]["digests"] == explicit[0]["digests"]
    assert auto[0]["iter"] == 7
    assert "state.load_state_dict(state.state_dict())" in auto[0]["error"]


@pytest.mark.parametrize("kind,via", [("sign", "pickle"), ("birder", "state_dict")])
def test_restored_state_resumes_on_a_new_ddp_instance(kind, via):
    """The new DDP's first (pre-rebuild) iteration is exact; the saved errors and moments then take over."""
    opt_kind = "birder" if kind == "birder" else "sgd"
    lr = 3e-3 if kind == "birder" else 0.05
    steps, restart = 40, 20
    straight = run_ranks(_train, 2, kind, opt_kind, lr, steps)
    resumed = run_ranks(_train, 2, kind, opt_kind, lr, steps, restart, via)
    fresh = run_ranks(_train, 2, kind, opt_kind, lr, steps, restart, "fresh")
    assert resumed[0]["digests"] == resumed[1]["digests"], "replicas differ"
    assert resumed[0]["digests"][:restart] == straight[0]["digests"][:restart]
    assert resumed[0]["digests"][-1] != fresh[0]["digests"][-1]
    assert resumed[0]["buckets"] == straight[0]["buckets"] and len(straight[0]["buckets"]) == 2
    assert resumed[0]["iter"] == steps
    assert resumed[0]["loss"] == pytest.approx(straight[0]["loss"], rel=0.1)


def test_pickle_drops_the_process_group():
    state = ErrorFeedbackState(start_iter=3)
    state.process_group = object()  # a stand-in that pickle could not handle
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None and restored.start_iter == 3 and restored.iter == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="start_iter must be >= 2, got 1"):
        ErrorFeedbackState(start_iter=1)
    with pytest.raises(TypeError, match="start_iter must be an int"):
        BirderState(start_iter=2.0)
    with pytest.raises(ValueError, match="unknown compressor"):
        ErrorFeedbackState(compressor="two_bit")
    with pytest.raises(ValueError, match="Invalid beta value: 1.0"):
        BirderState(beta=1.0)
    with pytest.raises(ValueError, match="Invalid epsilon value: 0"):
        BirderState(eps=0)
    with pytest.raises(ValueError, match="hierarchical must be"):
        BirderState(hierarchical="no")
    with pytest.raises(ValueError, match="Invalid scales value: 'layer'"):
        ErrorFeedbackState(scales="layer")


def _layout_change_worker(rank, world):
    model, teacher = _model(), _teacher()
    ddp, state = _ddp("sign", model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        torch.nn.functional.mse_loss(ddp(x), teacher(x).detach()).backward()
    restored = pickle.loads(pickle.dumps(state))
    other = DDP(_model(), bucket_cap_mb=25)  # one bucket instead of two
    other.register_comm_hook(restored, error_feedback_hook)
    torch.nn.functional.mse_loss(other(x), teacher(x).detach()).backward()  # pre-rebuild: exact
    try:
        torch.nn.functional.mse_loss(other(x), teacher(x).detach()).backward()
    except Exception as exc:  # DDP may wrap the hook's error
        return str(exc)
    return "no error"


def test_checkpoint_from_another_bucket_layout_raises():
    for message in run_ranks(_layout_change_worker, 2):
        assert "bucket layout differs from the checkpoint" in message, message


def _overflow_worker(rank, world, kind, bad_step):
    model, teacher = _model(), _teacher()
    ddp, state = _ddp(kind, model)
    opt = _make_opt("birder" if kind == "birder" else "sgd", ddp.parameters(), 0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    gen = torch.Generator().manual_seed(rank)
    digests = []
    for step in range(1, 6):
        x = torch.randn(16, 16, generator=gen)
        if step == bad_step and rank == 1:
            x[0, 0] = float("inf")  # this rank's gradients become non-finite
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(ddp(x), teacher(x).detach())).backward()
        scaler.step(opt)
        scaler.update()
        digests.append(_digest(model))
    saved = state.state_dict()["buckets"]
    tensors = [t for b in saved.values() for t in (b["allreduce"]["worker_error"]["error"],
                                                   b["allreduce"]["server_error"]["error"], *b["buffers"].values())]
    return digests, all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)


@pytest.mark.parametrize("kind", ["sign", "birder"])
def test_overflow_on_one_rank_skips_everywhere_and_keeps_errors_finite(kind):
    res = run_ranks(_overflow_worker, 2, kind, 4)
    for digests, finite in res:
        assert digests == res[0][0], "replicas differ"
        assert digests[3] == digests[2], "the overflow step changed the parameters"
        assert digests[4] != digests[3] and finite


def _low_precision_worker(rank, world, kind, dtype):
    model, teacher = _model().to(dtype), _teacher().to(dtype)
    ddp, _ = _ddp(kind, model)
    opt = _make_opt(kind, ddp.parameters(), 0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x = torch.randn(32, 16, generator=gen).to(dtype)
        loss = torch.nn.functional.mse_loss(ddp(x), teacher(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _digest(model), [p.dtype for p in model.parameters()], all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("kind", ["sign", "birder"])
def test_hooks_on_bf16_buckets(kind):
    """bf16 models: DDP's buckets are bf16; the hooks compress them and hand back bf16, and
    the replicas stay bit-identical (compression starts at iteration 2 of the 6)."""
    res = run_ranks(_low_precision_worker, 2, kind, torch.bfloat16)
    assert res[0][0] == res[1][0]
    assert all(d == torch.bfloat16 for d in res[0][1]) and res[0][2]


def _loss_scale_worker(rank, world, init_scale):
    model, teacher = _model(), _teacher()
    ddp = DDP(model, bucket_cap_mb=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=init_scale is not None)
    ddp.register_comm_hook(BirderState(seed=4, grad_scaler=scaler), birder_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):  # iterations 0-1 exchange exactly, 2-4 compress
        x = torch.randn(16, 16, generator=gen)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(ddp(x), teacher(x).detach())).backward()
        scaler.step(opt)
        scaler.update()
    return _digest(model)


def test_birder_hook_step_does_not_depend_on_the_loss_scale():
    """With its GradScaler, the hook's step is Birder's +-lr whatever the loss scale: a run at
    scale 2**16 ends bit-identical to one without loss scaling (powers of two are exact)."""
    unscaled = run_ranks(_loss_scale_worker, 2, None)
    scaled = run_ranks(_loss_scale_worker, 2, 2.0**16)
    assert scaled == unscaled and scaled[0] == scaled[1]


def test_birder_state_rejects_a_grad_scaler_of_another_type():
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler or None, got float"):
        BirderState(grad_scaler=2.0**16)
