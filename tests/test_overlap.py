"""The overlapped exchange (overlap=True) of every optimizer that has one, on real gloo ranks.

Oracles: with one bucket the overlapped exchange must give the one-shot exchange's bits
(the same collective on the same values, only started earlier); with several buckets the
warm-up must too on two ranks (an fp32 sum of two values does not depend on where a bucket
starts); replicas stay bit-identical; the bytes are those of one compressed all-reduce per
bucket; gradient accumulation, skipped steps and checkpoints keep their meaning.

Adding an optimizer's overlap is one row of ``OPTIMIZERS``; each test runs every row in one
job of ranks (a job's start costs more than its steps).
"""

import contextlib
import math

import pytest
import torch
from torch import nn

from _harness import run_ranks, run_torchrun
from _oracle import chunks, pieces
from _problem import check_bytes, flag_bytes
from onebit.optim import Birder, CompAMS, OnebitAdam, OnebitAdamNaive, OnebitLamb
from onebit.optim._buckets import bucket_bounds

FREEZE = 3

# name -> (maker, warm-up steps, whether the compressed code has an fp32 scale per tensor piece of each chunk)
OPTIMIZERS = {
    "onebit_adam": (lambda params, **kw: OnebitAdam(params, lr=1e-2, freeze_step=FREEZE, **kw), FREEZE, True),
    "onebit_lamb": (lambda params, **kw: OnebitLamb(params, lr=1e-2, freeze_step=FREEZE, **kw), FREEZE, True),
    "birder": (lambda params, **kw: Birder(params, lr=1e-2, seed=7, **kw), 0, False),
    # line 7's running maximum of b from step 3 on
    "birder_max": (lambda params, **kw: Birder(params, lr=1e-2, seed=7, threshold_step=2, **kw), 0, False),
    "onebit_adam_naive": (lambda params, **kw: OnebitAdamNaive(params, lr=1e-2, **kw), 0, True),
}
# Comp-AMS: an all-gather per bucket, and overlap=True must give overlap=False's bits however
# the buckets fall. name -> (maker, block size, "tensor" for one block per tensor, or None:
# compressor="none", an exact all-reduce per bucket)
GATHERED = {
    "comp_ams_block_sign": (lambda params, **kw: CompAMS(params, lr=1e-2, compressor="block_sign", **kw), 64),
    # blocks longer than the last layers' bucket: it sends nothing, its values go with the next
    "comp_ams_block_sign_1000": (
        lambda params, **kw: CompAMS(params, lr=1e-2, compressor="block_sign", block=1000, **kw), 1000),
    "comp_ams_block_sign_layers": (
        lambda params, **kw: CompAMS(params, lr=1e-2, compressor="block_sign", block="tensor", **kw), "tensor"),
    "comp_ams_none": (lambda params, **kw: CompAMS(params, lr=1e-2, compressor="none", **kw), None),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 3))


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(6, 12, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _digest(model: nn.Module) -> int:
    return int(_flat(model).view(torch.int32).to(torch.int64).sum())


def _opt(model: nn.Module, name: str = "onebit_adam", **kw):
    return {**OPTIMIZERS, **GATHERED}[name][0](model.parameters(), **kw)


def _warm_in_backward(opt) -> bool:
    """The optimizer's warm-up exchange leaves during backward (it has no buckets where it never can)."""
    return opt._buckets is not None and opt._buckets.warmup_in_backward


def _bucket_collectives(opt) -> list:
    """The compressed collectives of the buckets (None where a bucket has none)."""
    return opt._exchange.collectives


def _sign_wire_bytes(numel: int, world: int, starts: list[int] | None) -> int:
    """One compressed all-reduce of ``numel`` values (1-bit Adam, section 6): each rank sends
    ``w - 1`` of its ``w`` chunks (signs packed 8 per byte, plus with ``starts`` an fp32 scale
    for each piece between the tensors' starts) in the all-to-all, and its re-compressed chunk
    to ``w - 1`` peers in the all-gather, all in slots of the largest chunk's size; chunks are
    ``ceil(n / 8w) * 8`` values."""
    slot = max(math.ceil((hi - lo) / 8) + (4 * len(pieces(lo, hi, starts, 8)) if starts is not None else 0)
               for lo, hi in chunks(numel, world, 8))
    return 2 * (world - 1) * slot


def test_buckets_follow_backward_order_and_the_cap():
    sizes = [10, 300, 5, 200, 7, 0, 40]
    offsets, start = [], 0
    for n in sizes:
        offsets.append((start, start + n))
        start += n
    buckets = bucket_bounds(offsets, cap=250)
    # last parameters first; together every parameter exactly once, each bucket a contiguous range
    assert [m for _, _, m in buckets] == [[3, 4, 5, 6], [2], [1], [0]]  # 247, 5, 300 (alone), 10
    for lo, hi, members in buckets:
        assert (lo, hi) == (offsets[members[0]][0], offsets[members[-1]][1])
        assert hi - lo <= 250 or len(members) == 1
    assert bucket_bounds(offsets, cap=10**6) == [(0, start, list(range(len(sizes))))]
    # a weight's bias (the 1-D parameters registered right after it) opens the next bucket with it
    vectors = [False, False, True, False, True, True, True]
    assert [m for _, _, m in bucket_bounds(offsets, 250, vectors)] == [[3, 4, 5, 6], [1, 2], [0]]
    # DDP's rule (the warm-up's buckets): closed after the parameter that takes a bucket to its limit
    assert [m for _, _, m in bucket_bounds(offsets, 250, past=True)] == [[2, 3, 4, 5, 6], [1], [0]]
    assert [m for _, _, m in bucket_bounds(offsets, 250, first=20, past=True)] == [[6], [1, 2, 3, 4, 5], [0]]


def _each(rank, world, fn, names, *args):
    """``fn(rank, world, name, *args)`` for every name of ``names``, in one job of ranks."""
    return {name: fn(rank, world, name, *args) for name in names}


def _for_each(world, fn, *args, names=tuple(OPTIMIZERS)):
    """``{name: [fn's result on each rank]}``."""
    res = run_ranks(_each, world, fn, list(names), *args)
    return {name: [r[name] for r in res] for name in names}


def _lockstep(rank, world, name, cap, steps, kw=None):
    """An overlapped and a one-shot optimizer on identical models and data, stepped in turn."""
    torch.set_num_threads(1)
    a, b = _model(), _model()
    oa, ob = _opt(a, name, overlap=True, bucket_cap_mb=cap, **(kw or {})), _opt(b, name, overlap=False, **(kw or {}))
    out = {"same": [], "digest": [], "bytes": [], "in_backward": [], "buckets": len(oa._exchange.bounds)}
    for step in range(1, steps + 1):
        x = _batch(rank, step)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
        oa.step()
        ob.step()
        out["same"].append(torch.equal(_flat(a), _flat(b)) and all(
            torch.equal(oa.flat.buffers[k], ob.flat.buffers[k]) for k in ob.flat.buffers))
        out["digest"].append(_digest(a))
        out["bytes"].append(oa.stats["bytes_sent"])
        out["in_backward"].append(oa.stats["buckets_in_backward"])
    out["bucket_sizes"] = [hi - lo for lo, hi, _ in oa._exchange.bounds]
    out["bucket_starts"] = [[oa.flat.offsets[i][0] - lo for i in members] for lo, _, members in oa._exchange.bounds]
    out["stage"] = oa.stats["stage"]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_one_bucket_gives_the_one_shot_bits_through_both_stages(world):
    names = OPTIMIZERS if world == 3 else ["onebit_adam"]
    for name, res in _for_each(world, _lockstep, 25.0, FREEZE + 4, names=names).items():
        for r in res:
            assert r["buckets"] == 1 and r["stage"] == "compressed"
            assert all(r["same"]), f"{name}: overlapped and one-shot differ at steps " \
                                   f"{[i + 1 for i, s in enumerate(r['same']) if not s]}"
            assert all(n == 1 for n in r["in_backward"]), f"{name}: the bucket was not launched during backward"


def test_refreshes_overlapped_give_the_one_shot_bits():
    # every other step after the freeze a refresh (bf16, half the warm-up's bytes), launched during
    # backward as the warm-up's
    for r in run_ranks(_lockstep, 2, "onebit_adam", 25.0, FREEZE + 5, {"refresh_every": 2}):
        assert all(r["same"]) and r["stage"] == "compressed"
        assert r["bytes"][0] > r["bytes"][FREEZE + 1] > r["bytes"][FREEZE]  # step FREEZE + 2: a refresh
        assert all(n == 1 for n in r["in_backward"])


def test_the_naive_control_clips_the_average_with_overlap():
    # max_grad_norm clips the averaged gradient there, which step() has in full
    res = run_ranks(_lockstep, 2, "onebit_adam_naive", 25.0, 4, {"max_grad_norm": 0.05})
    assert all(all(r["same"]) for r in res)


def test_several_buckets_keep_replicas_identical_and_send_one_exchange_per_bucket():
    world = 2
    for name, res in _for_each(world, _lockstep, 0.004, FREEZE + 4).items():  # 0.004 MB: 1048 values at most
        _, warmup, per_tensor = OPTIMIZERS[name]
        r0 = res[0]
        assert r0["buckets"] >= 3
        assert all(r["digest"] == r0["digest"] for r in res), f"{name}: replicas differ"
        # warm-up: the exact average on two ranks does not depend on the bucketing
        assert all(r0["same"][:warmup]), name
        assert all(n == r0["buckets"] for n in r0["in_backward"]), f"{name}: buckets not all launched in backward"
        agreement = flag_bytes(world, 6)
        fp32 = sum(2 * (world - 1) * 4 * n // world for n in r0["bucket_sizes"])
        onebit = sum(_sign_wire_bytes(n, world, starts if per_tensor else None)
                     for n, starts in zip(r0["bucket_sizes"], r0["bucket_starts"]))
        want = [fp32 + agreement] * warmup + [onebit + agreement] * (len(r0["bytes"]) - warmup)
        want[0] += check_bytes(world)  # the first exchange's check that the ranks hold states of one step
        assert r0["bytes"] == want, name


def _by_bucket(rank, world, steps):
    """1-bit Adam applying each bucket as it lands, and the same optimizer applying the step at once."""
    torch.set_num_threads(1)
    a, b = _model(), _model()
    oa, ob = _opt(a, overlap=True, bucket_cap_mb=0.004), _opt(b, overlap=True, bucket_cap_mb=0.004)
    ob.applies_by_bucket = False
    same = []
    for step in range(1, steps + 1):
        x = _batch(rank, step)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        same.append(torch.equal(_flat(a).view(torch.int32), _flat(b).view(torch.int32)) and all(
            torch.equal(oa.flat.buffers[k].view(torch.int32), ob.flat.buffers[k].view(torch.int32))
            for k in ob.flat.buffers))
    return same, len(oa._exchange.bounds), oa._exchange.lands_by_bucket, oa.stats["stage"]


def test_each_bucket_applied_as_it_lands_gives_the_whole_steps_bits():
    for same, buckets, lands_by_bucket, stage in run_ranks(_by_bucket, 2, FREEZE + 4):
        assert buckets >= 3 and lands_by_bucket and stage == "compressed"
        assert all(same), f"applied by bucket and at once differ at steps {[i + 1 for i, s in enumerate(same) if not s]}"


def _uneven(rank, world, steps):
    """Rank 1 leaves the last layer's bias out of the graph on even steps: its first bucket
    cannot start during backward there and goes at step(), after the other rank started it."""
    torch.set_num_threads(1)
    model = _model()
    opt = _opt(model, overlap=True, bucket_cap_mb=0.004)
    last = model[4]
    for step in range(1, steps + 1):
        opt.zero_grad()
        h = model[:4](_batch(rank, step))
        y = h @ last.weight.t() + (0 if rank == 1 and step % 2 else last.bias)
        y.pow(2).mean().backward()
        opt.step()
    return _digest(model), opt.stats["stage"]


def test_a_bucket_completed_on_some_ranks_only_still_goes_in_order():
    res = run_ranks(_uneven, 2, FREEZE + 4)
    assert res[0] == res[1] and res[0][1] == "compressed"


def _accumulate(rank, world, steps, use_no_sync, name="onebit_adam"):
    torch.set_num_threads(1)
    a, b = _model(), _model()
    oa, ob = _opt(a, name, overlap=True, bucket_cap_mb=0.004), _opt(b, name, overlap=False)
    same = []
    for step in range(1, steps + 1):
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            with opt.no_sync() if use_no_sync else torch.enable_grad():
                model(_batch(rank, step, 0)).pow(2).mean().backward()
            model(_batch(rank, step, 1)).pow(2).mean().backward()
        oa.step()
        ob.step()
        same.append(torch.equal(_flat(a), _flat(b)))
    return same


def test_gradient_accumulation_exchanges_the_last_micro_batch_only():
    res = run_ranks(_accumulate, 2, FREEZE, True)
    assert all(all(r) for r in res), "accumulated warm-up steps differ from the one-shot exchange"


def test_a_second_backward_without_no_sync_is_refused():
    with pytest.raises(Exception, match="no_sync"):
        run_ranks(_accumulate, 2, 1, False, timeout=60)


def _skip(rank, world, name):
    torch.set_num_threads(1)
    model = _model()
    opt = _opt(model, name, overlap=True, bucket_cap_mb=0.004)
    for step in range(1, FREEZE + 6):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        if step == FREEZE + 2 and rank == 1:
            model[2].weight.grad[0, 0] = float("nan")
        before = [_flat(model)] + [b.clone() for b in opt.flat.buffers.values()]
        opt.step()
        if step == FREEZE + 2:
            after = [_flat(model)] + list(opt.flat.buffers.values())
            kept = all(torch.equal(x, y) for x, y in zip(before, after))
            errors = [c.worker_error.error for c in _bucket_collectives(opt) if c is not None]
            zeroed = all(e is None or not e.any() for e in errors)
    return kept, zeroed, opt.stats["skipped_steps"], _digest(model), bool(torch.isfinite(_flat(model)).all())


def test_a_skipped_compressed_step_leaves_parameters_and_state_and_restarts_the_errors():
    for name, res in _for_each(2, _skip).items():
        for kept, zeroed, skipped, _, finite in res:
            assert (kept, zeroed, skipped, finite) == (True, True, 1, True), name
        assert res[0][3] == res[1][3], f"{name}: replicas differ"


def _resume(rank, world, name, total, cut):
    torch.set_num_threads(1)
    model = _model()
    opt = _opt(model, name, overlap=True, bucket_cap_mb=0.004)
    saved = None
    for step in range(1, total + 1):
        if step == cut + 1:
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    straight = _flat(model)
    model2 = _model()
    model2.load_state_dict(saved[0])
    opt2 = _opt(model2, name, overlap=True, bucket_cap_mb=0.004)
    opt2.load_state_dict(saved[1])
    for step in range(cut + 1, total + 1):
        opt2.zero_grad()
        model2(_batch(rank, step)).pow(2).mean().backward()
        opt2.step()
    return torch.equal(straight, _flat(model2))


def test_checkpoint_in_the_compression_stage_resumes_exactly():
    for name, res in _for_each(2, _resume, FREEZE + 5, FREEZE + 2).items():
        assert all(res), name


_REFUSED = (dict(max_grad_norm=1.0), dict(bucket_cap_mb=0), dict(bucket_cap_mb=True), dict(overlap=1),
            dict(hierarchical=True, ranks_per_node=1))


def _refusals(rank, world, name, cases=_REFUSED):
    model = _model()
    errors = []
    for kw in cases:
        try:
            _opt(model, name, **({"overlap": True} | kw))
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    opt = _opt(model, name, overlap=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(_batch(rank, 1)).pow(2).mean()).backward()
    try:
        scaler.step(opt)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_overlap_refuses_what_it_cannot_honour():
    for name, res in _for_each(2, _refusals).items():
        errors = res[0]
        needles = ["max_grad_norm", "bucket_cap_mb", "bucket_cap_mb", "overlap", "hierarchical", "GradScaler"]
        if name == "onebit_adam_naive":  # its clip is on the average: allowed
            needles.remove("max_grad_norm")
        assert len(errors) == len(needles), (name, errors)
        for needle, msg in zip(needles, errors):
            assert needle in msg, (name, msg)


# The default of the optimizers with an fp32 warm-up (overlap=None: "warmup" on several ranks): the
# warm-up's exact mean leaves during backward in buckets, the compressed stage exchanges in step().
WARM = ("onebit_adam", "onebit_lamb")


def _warm(rank, world, name, case):
    """The default (buckets of 0.0005 MB: 3 on this model) beside ``overlap=False``, stepped in turn from
    the warm-up into the compressed stage, each training loop written as a user would for ``case``."""
    torch.set_num_threads(1)
    a, b = _model(), _model()
    oa, ob = _opt(a, name, bucket_cap_mb=0.0005), _opt(b, name, overlap=False)
    scalers = {opt: torch.amp.GradScaler("cpu", init_scale=16.0) for opt in (oa, ob)} if case == "scaler" else {}
    micro = 2 if case in ("accumulate", "no_sync") else 1
    out = {"same": [], "close": [], "digest": [], "in_backward": [], "warm": [], "buckets": len(oa._exchange.warm_bounds)}
    for step in range(1, FREEZE + 4):
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            for k in range(micro):
                with opt.no_sync() if case == "no_sync" and k < micro - 1 else contextlib.nullcontext():
                    loss = model(_batch(rank, step, k)).pow(2).mean()
                    (scalers[opt].scale(loss) if scalers else loss).backward()
            if case == "clip":  # each rank's own gradients, as the Clipping page says
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if scalers:
                scalers[opt].step(opt)
                scalers[opt].update()
            else:
                opt.step()
        out["same"].append(torch.equal(_flat(a), _flat(b)))
        out["close"].append(torch.allclose(_flat(a), _flat(b), rtol=1e-5, atol=1e-6))
        out["digest"].append(_digest(a))
        out["in_backward"].append(oa.stats["buckets_in_backward"])
        out["warm"].append(_warm_in_backward(oa))
    out["stage"] = oa.stats["stage"]
    return out


@pytest.mark.parametrize("case", ["plain", "no_sync", "accumulate", "clip", "scaler"])
def test_the_warm_up_leaves_during_backward_by_default_with_overlap_false_bits(case):
    # On two ranks an fp32 mean does not depend on the bucketing, and the compressed stage is the
    # one-shot exchange in both: the default must give overlap=False's bits in every loop. Where the
    # gradients changed after their bucket left (a second micro-batch outside no_sync(), a clip,
    # GradScaler's unscale), the step exchanges them again in step(), and so do the steps after it.
    for name, res in _for_each(2, _warm, case, names=WARM).items():
        r0 = res[0]
        assert r0["stage"] == "compressed" and r0["buckets"] >= 3, name
        assert all(r["digest"] == r0["digest"] for r in res), f"{name}: replicas differ"
        assert all(r0["same"]), f"{name}: differs from overlap=False at steps " \
                                f"{[i + 1 for i, s in enumerate(r0['same']) if not s]}"
        kept = case in ("plain", "no_sync")
        assert r0["in_backward"] == ([r0["buckets"]] * FREEZE if kept else [r0["buckets"]] + [0] * (FREEZE - 1)) \
            + [0] * 3, name
        assert r0["warm"] == [kept] * len(r0["warm"]), name


def test_the_warm_up_in_backward_keeps_replicas_identical_on_three_ranks():
    for name, res in _for_each(3, _warm, "plain", names=WARM).items():
        r0 = res[0]
        assert all(r["digest"] == r0["digest"] for r in res), f"{name}: replicas differ"
        assert all(r0["close"]) and r0["warm"][-1], name


def _warm_uneven(rank, world, name):
    """Rank 1 leaves the last layer's bias out of the graph on odd steps (its first bucket then
    waits for step() there; on step 1, beside rank 0's first bucket, the optimizers' first
    exchange), rank 0 alone clips after backward on step 2 (stale on one rank), and both
    all-reduce their loss between backward and step() on the optimizer's own group."""
    torch.set_num_threads(1)
    a, b = _model(), _model()
    oa, ob = _opt(a, name, bucket_cap_mb=0.0005), _opt(b, name, overlap=False)
    same = []
    for step in range(1, FREEZE + 3):
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            last = model[4]
            h = model[:4](_batch(rank, step))
            loss = (h @ last.weight.t() + (0 if rank == 1 and step % 2 else last.bias)).pow(2).mean()
            loss.backward()
            if rank == 0 and step == 2:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            torch.distributed.all_reduce(loss.detach())
            opt.step()
        same.append(torch.equal(_flat(a), _flat(b)))
    return same, _digest(a), _warm_in_backward(oa), oa.stats["stage"]


def test_the_warm_up_in_backward_with_uneven_ranks_and_the_users_collectives():
    for name, res in _for_each(2, _warm_uneven, names=WARM).items():
        assert res[0][1] == res[1][1], f"{name}: replicas differ"
        for same, _, warm, stage in res:
            assert all(same) and not warm and stage == "compressed", (name, same, warm)


def _warm_ddp_and_resume(rank, world, name):
    """A DDP-wrapped model (DDP writes each gradient again after backward) keeps the warm-up in step();
    a checkpoint saved after the accumulation fallback resumes with it."""
    torch.set_num_threads(1)
    ddp = nn.parallel.DistributedDataParallel(_model())
    wrapped = _opt(ddp.module, name)
    model = _model()
    opt = _opt(model, name)
    for micro in range(2):
        model(_batch(rank, 1, micro)).pow(2).mean().backward()
    opt.step()
    again = _opt(_model(), name)
    again.load_state_dict(opt.state_dict())
    return tuple(_warm_in_backward(o) for o in (wrapped, opt, again, _opt(_model(), name)))


def test_the_warm_up_stays_in_step_under_ddp_and_after_a_fallback_resumed():
    for name, res in _for_each(2, _warm_ddp_and_resume, names=WARM).items():
        assert res[0] == (False, False, False, True), name


def test_overlap_values():
    with pytest.raises(ValueError, match="Invalid overlap value: 'backward'"):
        OnebitAdam(_model().parameters(), overlap="backward")
    # one rank: nothing to overlap
    assert not _warm_in_backward(OnebitLamb(_model().parameters()))


def _spans(total: int, bounds: list[int], block: int) -> list[int]:
    """The lengths of the buckets' spans of whole blocks (the oracle: a bucket starting at
    ``lo`` sends from the first multiple of ``block`` at or after it, up to where the bucket
    after it in launch order starts sending)."""
    starts = [min(total, math.ceil(lo / block) * block) for lo in bounds]
    return [end - start for start, end in zip(starts, [total, *starts])]


@pytest.mark.parametrize("world", [2, 3])
def test_comp_ams_block_sign_overlapped_gives_the_one_shot_bits(world):
    steps = 5
    # 1048-value buckets: several of them
    res = _for_each(world, _lockstep, 0.004, steps, names=tuple(GATHERED))
    sizes = [p.numel() for p in _model().parameters()]
    for name, (r0, *others) in res.items():
        assert r0["buckets"] >= 3, name
        assert all(r["digest"] == r0["digest"] for r in others), f"{name}: replicas differ"
        assert all(n == r0["buckets"] for n in r0["in_backward"]), f"{name}: buckets not all launched in backward"
        if name == "comp_ams_none" and world > 2:
            continue  # gloo's sum of three values depends on where a bucket starts
        assert all(r0["same"]), f"{name}: overlapped and one-shot differ at steps " \
                                f"{[i + 1 for i, s in enumerate(r0['same']) if not s]}"
    # bytes: one all-gather per bucket of its whole blocks (signs 8 per byte, an fp32 scale per
    # block), or one fp32 ring all-reduce per bucket
    total = sum(sizes)
    bounds, lo = [], total
    for n in res["comp_ams_block_sign"][0]["bucket_sizes"]:
        lo -= n
        bounds.append(lo)
    agreement = flag_bytes(world, 6)
    for name, (_, block) in GATHERED.items():
        buckets = res[name][0]["bucket_sizes"]
        if block is None:
            sent = sum(2 * (world - 1) * 4 * n // world for n in buckets)
        else:
            spans = sizes if block == "tensor" else _spans(total, bounds, block)
            assert block == "tensor" or spans != buckets, f"{name}: no bucket boundary cut a block"
            sent = (world - 1) * sum(math.ceil(n / 8) + 4 * (1 if block == "tensor" else math.ceil(n / block))
                                     for n in spans if n)
        assert res[name][0]["bytes"] == [sent + agreement + check_bytes(world)] + [sent + agreement] * (steps - 1), name


def _stepped(rank, name, steps, **kw):
    model = _model()
    opt = _opt(model, name, **kw)
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    return opt


def _cross_load(rank, world, name):
    """A checkpoint of the overlapped exchange loads into a one-shot optimizer and back: the
    moments are restored, the errors (non-zero before) restart at zero (another bucketing)."""
    saved = _stepped(rank, name, 2, overlap=True, bucket_cap_mb=0.004)
    one_shot, again = _stepped(rank, name, 1), _stepped(rank, name, 1, overlap=True, bucket_cap_mb=0.004)

    def errors():
        return [c.worker_error.error for c in [one_shot.exchange, *_bucket_collectives(again)] if c is not None]

    had_errors = all(e is not None and e.any() for e in errors())
    one_shot.load_state_dict(saved.state_dict())
    again.load_state_dict(one_shot.state_dict())
    return had_errors and all(e is None or not e.any() for e in errors()) and all(
        torch.equal(x.flat.buffers[k], saved.flat.buffers[k]) for x in (one_shot, again) for k in saved.flat.buffers)


def test_comp_ams_overlapped_skips_resumes_and_accumulates():
    names = tuple(GATHERED)
    for name, res in _for_each(2, _skip, names=names).items():
        for kept, zeroed, count, _, finite in res:
            assert (kept, zeroed, count, finite) == (True, True, 1, True), name
        assert res[0][3] == res[1][3], f"{name}: replicas differ"
    for check, args in ((_resume, (FREEZE + 5, FREEZE + 2)), (_cross_load, ())):
        for name, res in _for_each(2, check, *args, names=names).items():
            assert all(res), (check.__name__, name)
    accumulated = run_ranks(_accumulate, 2, 4, True, "comp_ams_block_sign")
    assert all(all(r) for r in accumulated), "accumulated steps differ from the one-shot exchange"


def test_comp_ams_overlap_refuses_top_k_and_what_it_cannot_honour():
    with pytest.raises(ValueError, match="Invalid compressor value with overlap=True: 'topk'"):
        CompAMS(_model().parameters(), compressor="topk", overlap=True)
    errors = run_ranks(_refusals, 2, "comp_ams_block_sign", (dict(bucket_cap_mb=0), dict(overlap=1)))[0]
    needles = ["bucket_cap_mb", "overlap", "GradScaler"]
    assert len(errors) == len(needles), errors
    for needle, msg in zip(needles, errors):
        assert needle in msg, msg


# A run that ends after a backward whose exchange left during it, without the step() that would
# take it: a warm-up all-reduce or a compressed exchange still in flight at exit, with or without
# destroy_process_group().
_ENDS_AFTER_BACKWARD = """
opt = onebit.OnebitAdam(model.parameters(), lr=3e-3, freeze_step={freeze}, overlap=True, bucket_cap_mb=0.25,
                        timeout=10)
data = byte_windows(rank, world, 7 * 32)
for step in range(7):
    opt.zero_grad()
    batch = data[step * 32:(step + 1) * 32]
    F.cross_entropy(model(batch[:, :CONTEXT]), batch[:, CONTEXT]).backward()
    if step < 6:  # the last backward's exchange is never taken
        opt.step()
assert opt.stats["stage"] == {stage!r}, opt.stats
if {destroy}:
    dist.destroy_process_group()
print("rank", rank, "left its loop", flush=True)
"""


@pytest.mark.parametrize("stage,freeze", [("warmup", 100), ("compressed", 3)])
@pytest.mark.parametrize("destroy", [False, True])
def test_a_run_that_ends_with_an_overlapped_exchange_in_flight_exits_cleanly(tmp_path, stage, freeze, destroy):
    code, out = run_torchrun(tmp_path, _ENDS_AFTER_BACKWARD.format(freeze=freeze, stage=stage, destroy=destroy), 3)
    assert code == 0 and "terminate called" not in out, out[-4000:]
    assert out.count("left its loop") == 3
