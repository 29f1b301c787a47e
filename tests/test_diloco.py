"""DiLoCo against Algorithm 1 of arXiv 2311.08105 written plainly here, on real gloo ranks."""

import io

import pytest
import torch

import onebit
from _harness import run_ranks, run_torchrun
from _oracle import SimulatedCompressedAllGather, SimulatedCompressedAllReduce, chunk_topk_compress, sign_compress
from _problem import check_bytes

H = 3  # inner steps per synchronisation
STEPS = 2 * H + 2  # two synchronisations, then two steps into the third interval
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)


def _inner_step(model, inner, rank, step):
    inner.zero_grad()
    x, y = _batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _take_anchor(models, anchor):
    """Every worker's parameters <- the flat ``anchor`` (Algorithm 1: all continue from it)."""
    with torch.no_grad():
        for m in models:
            for p, value in zip(m.parameters(), anchor.split([p.numel() for p in m.parameters()])):
                p.copy_(value.view_as(p))


def _simulated(collective, world, numel, segments):
    cls = SimulatedCompressedAllGather if collective == "allgather" else SimulatedCompressedAllReduce
    return cls(world, numel, segments=segments)


def _forget(exchange):
    """Error feedback off: the errors restart at zero after every synchronisation."""
    exchange.worker_err = [torch.zeros_like(e) for e in exchange.worker_err]
    if hasattr(exchange, "server_err"):
        exchange.server_err = [torch.zeros_like(e) for e in exchange.server_err]


def _average(deltas, exchange, compressor, error_feedback):
    """The ranks' outer gradients averaged: exactly, or through the simulated 1-bit ``exchange``."""
    if compressor == "identity":
        return sum(deltas) / len(deltas)
    delta = exchange(deltas)
    if not error_feedback:
        _forget(exchange)
    return delta


def _nesterov():
    """The paper's outer step on the anchor: b <- mu b + delta, anchor <- anchor - lr (delta + mu b)."""
    momentum = 0.0

    def step(anchor, delta):
        nonlocal momentum
        momentum = OUTER_MOMENTUM * momentum + delta
        return anchor - OUTER_LR * (delta + OUTER_MOMENTUM * momentum)
    return step


def _averaging():
    """SparseLoCo's outer step on the anchor: the plain average of what was sent, outer lr 1."""
    return lambda anchor, delta: anchor - 1.0 * delta


def _oracle(world, compressor, collective, error_feedback, outer=_nesterov, rows=False, decay=1.0):
    """Every worker's parameters after every step: H AdamW steps on its own batches, then
    delta_i = anchor - x_i averaged (exactly; or each rank's 1-bit delta_i with one scale per
    tensor piece -- with ``rows`` per row of each weight -- all-gathered and averaged, each
    rank's carried error first multiplied by ``decay``; or by the two-sided 1-bit all-reduce),
    the outer step (``outer()``'s) on the anchor, x_i <- anchor."""
    models = [_model() for _ in range(world)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    anchor = _flat(models[0]).clone()
    outer_step = outer()
    starts, start = [], 0
    for p in models[0].parameters():
        row = p.shape[1] if rows and p.dim() == 2 else p.numel()  # a Linear weight's rows: its dimension 1
        starts += list(range(start, start + p.numel(), row))
        start += p.numel()
    exchange = _simulated(collective, world, anchor.numel(), starts)
    history = []
    for step in range(1, STEPS + 1):
        for rank in range(world):
            _inner_step(models[rank], inners[rank], rank, step)
            inners[rank].step()
        if step % H == 0:
            exchange.worker_err = [decay * e for e in exchange.worker_err]
            delta = _average([anchor - _flat(m) for m in models], exchange, compressor, error_feedback)
            anchor = outer_step(anchor, delta)
            _take_anchor(models, anchor)
        history.append([_flat(m).clone() for m in models])
    return history


def _ours(rank, world, compressor, collective, error_feedback, scales="tensor"):
    torch.set_num_threads(1)
    model = _model()
    opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, outer_step="nesterov",
                        outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, compressor=compressor,
                        collective=collective, error_feedback=error_feedback, scales=scales)
    history, stages = [], []
    for step in range(1, STEPS + 1):
        _inner_step(model, opt, rank, step)
        opt.step()
        history.append(_flat(model).clone())
        # (the first step sends only the check that the ranks hold states of one step)
        stages.append((opt.stats["stage"], opt.stats["bytes_sent"] > (check_bytes(world) if step == 1 else 0)))
    opt.check_replicas()  # inside an interval: the anchors
    return history, stages


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("compressor,collective,error_feedback", [
    ("identity", "allgather", True), ("sign", "allgather", False), ("sign", "allgather", True),
    ("sign", "allreduce", False), ("sign", "allreduce", True)])
def test_matches_the_algorithm_written_plainly(world, compressor, collective, error_feedback):
    oracle = _oracle(world, compressor, collective, error_feedback)
    results = run_ranks(_ours, world, compressor, collective, error_feedback)
    for rank, (history, stages) in enumerate(results):
        # an inner step sends nothing, not even the agreement on skipping it
        assert stages == [("outer", True) if s % H == 0 else ("local", False) for s in range(1, STEPS + 1)]
        for step, (ours, expected) in enumerate(zip(history, oracle), start=1):
            assert torch.allclose(ours, expected[rank], rtol=1e-5, atol=1e-6), (rank, step)
    for step in range(H, STEPS + 1, H):  # after each synchronisation every rank holds the same bits
        assert all(torch.equal(r[0][step - 1], results[0][0][step - 1]) for r in results)
    assert not torch.equal(results[0][0][-1], results[1][0][-1])  # inside an interval they differ


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("collective", ["allgather", "allreduce"])
def test_row_scales_give_every_row_of_a_weight_a_scale_of_its_own(world, collective):
    # scales="row": one scale per slice along a parameter's first dimension (a Linear weight's
    # output rows: 8 of 6 values, whose starts round down to whole bytes of signs, then 3 of 8)
    oracle = _oracle(world, "sign", collective, True, rows=True)
    results = run_ranks(_ours, world, "sign", collective, True, "row")
    for rank, (history, _) in enumerate(results):
        for step, (ours, expected) in enumerate(zip(history, oracle), start=1):
            assert torch.allclose(ours, expected[rank], rtol=1e-5, atol=1e-6), (rank, step)
    assert not torch.allclose(oracle[-1][0], _oracle(world, "sign", collective, True)[-1][0])  # not per tensor


def _defaults(rank, world):
    torch.set_num_threads(1)
    model = _model()
    opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H)
    history = []
    for step in range(1, STEPS + 1):
        _inner_step(model, opt, rank, step)
        opt.step()
        history.append(_flat(model).clone())
    return history


@pytest.mark.parametrize("world", [2, 3])
def test_the_defaults_are_sparselocos_outer_step_with_a_sign_and_a_scale_per_row(world):
    # each rank's error carried and decayed by 0.95 before the next outer gradient is added, its
    # sign with a scale per row all-gathered, and the anchor moved by their plain average
    oracle = _oracle(world, "sign", "allgather", True, outer=_averaging, rows=True, decay=0.95)
    for rank, history in enumerate(run_ranks(_defaults, world)):
        for step, (ours, expected) in enumerate(zip(history, oracle), start=1):
            assert torch.allclose(ours, expected[rank], rtol=1e-5, atol=1e-6), (rank, step)
    for other in (_oracle(world, "sign", "allgather", True, outer=_averaging, rows=True),  # no decay
                  _oracle(world, "sign", "allgather", False, rows=True)):  # the paper's outer step
        assert not torch.allclose(oracle[-1][0], other[-1][0])


# Any torch.optim optimizer as the outer one: Adam on the averaged outer gradients, written out.
OUTER_ADAM = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}


def _adam():
    """Adam on the anchor, the averaged outer gradient its gradient: m, v, bias-corrected."""
    (b1, b2), lr, eps = OUTER_ADAM["betas"], OUTER_ADAM["lr"], OUTER_ADAM["eps"]
    m = v = 0.0
    t = 0

    def step(anchor, delta):
        nonlocal m, v, t
        t += 1
        m = b1 * m + (1 - b1) * delta
        v = b2 * v + (1 - b2) * delta * delta
        return anchor - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return step


def _train(rank, build, steps, resume_at):
    """Each step's parameters of ``build(model)``'s run, and its optimizer; after step
    ``resume_at`` each rank's model and optimizer go through torch.save into new ones."""
    model = _model()
    opt = build(model)
    history = []
    for step in range(1, steps + 1):
        _inner_step(model, opt, rank, step)
        opt.step()
        history.append(_flat(model).clone())
        if step == resume_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model = _model()
            opt = build(model)  # (it broadcasts rank 0's parameters: each rank's own are loaded after)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
    return history, opt


def _adam_outer(rank, world, resume_at):
    torch.set_num_threads(1)

    def build(model):
        return onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, compressor="identity",
                             outer=lambda anchors: torch.optim.Adam(anchors, **OUTER_ADAM))

    history, opt = _train(rank, build, STEPS, resume_at)
    return history, type(opt.outer).__name__, sorted(opt.outer.state_dict()["state"])


@pytest.mark.parametrize("world", [2, 3])
def test_any_torch_optim_optimizer_is_the_outer_one(world):
    oracle = _oracle(world, "identity", "allgather", False, outer=_adam)
    plain = run_ranks(_adam_outer, world, None)
    resumed = run_ranks(_adam_outer, world, H + 1)  # saved inside the second interval, its Adam state in it
    for rank, ((history, kind, state), (again, _, _)) in enumerate(zip(plain, resumed)):
        assert kind == "Adam" and state == [0, 1, 2, 3]
        for step, (ours, expected) in enumerate(zip(history, oracle), start=1):
            assert torch.allclose(ours, expected[rank], rtol=1e-5, atol=1e-6), (rank, step)
        assert all(torch.equal(a, b) for a, b in zip(history, again))  # the resume changes no bit


# SparseLoCo (arXiv 2508.15706, Algorithm 1): each rank's error-feedback accumulator decayed by
# BETA in the place of the outer momentum, e <- BETA e + delta, sent C(e), e <- e - C(e), and the
# anchor moved by the plain average of what was sent (outer learning rate 1, no momentum).
BETA = 0.9
SPARSE = {"k": 2, "chunk": 8, "bits": 2, "range_in_sigmas": 6.0}  # 2 of every 8 values, at 2 bits
SPARSE_STEPS = 4 * H + 2


def _sparse_compress(which):
    """C of one tensor's accumulator, written plainly: chunk-wise Top-k at 2 bits, or 1-bit signs."""
    if which == "chunk_topk":
        return lambda e: chunk_topk_compress(e, SPARSE["k"], SPARSE["chunk"], SPARSE["bits"], SPARSE["range_in_sigmas"])
    return sign_compress


def _sparseloco_oracle(world, which, beta=BETA):
    models = [_model() for _ in range(world)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    anchor = _flat(models[0]).clone()
    sizes = [p.numel() for p in models[0].parameters()]
    compress = _sparse_compress(which)
    errors = [torch.zeros_like(anchor) for _ in range(world)]
    history = []
    for step in range(1, SPARSE_STEPS + 1):
        for rank in range(world):
            _inner_step(models[rank], inners[rank], rank, step)
            inners[rank].step()
        if step % H == 0:
            sent = []
            for rank in range(world):
                errors[rank] = beta * errors[rank] + (anchor - _flat(models[rank]))
                # every parameter its own chunks and quantizer (scales="tensor")
                sent.append(torch.cat([compress(part) for part in errors[rank].split(sizes)]))
                errors[rank] = errors[rank] - sent[rank]
            anchor = anchor - 1.0 * (sum(sent) / world)
            _take_anchor(models, anchor)
        history.append([_flat(m).clone() for m in models])
    return history


def _sparseloco(rank, world, which, resume_at):
    torch.set_num_threads(1)
    compressor = onebit.compress.get("chunk_topk", **SPARSE) if which == "chunk_topk" else which

    def build(model):
        return onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, outer_lr=1.0,
                             outer_momentum=0.0, compressor=compressor, error_feedback=True, error_decay=BETA,
                             scales="tensor")

    history, opt = _train(rank, build, SPARSE_STEPS, resume_at)
    return history, opt.stats["bytes_sent_total"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("which", ["chunk_topk", "sign"])
def test_sparseloco_matches_its_algorithm_written_plainly(world, which):
    oracle = _sparseloco_oracle(world, which)
    plain = run_ranks(_sparseloco, world, which, None)
    resumed = run_ranks(_sparseloco, world, which, 2 * H + 1)  # saved with an error carried, mid-interval
    for rank, ((history, sent), (again, _)) in enumerate(zip(plain, resumed)):
        for step, (ours, expected) in enumerate(zip(history, oracle), start=1):
            assert torch.allclose(ours, expected[rank], rtol=1e-5, atol=1e-6), (which, rank, step)
        assert all(torch.equal(a, b) for a, b in zip(history, again))  # the resume changes no bit
        assert sent > 0
    # the decay matters: without it (beta = 1) the same run ends elsewhere
    assert not torch.allclose(plain[0][0][-1], _sparseloco_oracle(world, which, beta=1.0)[-1][0])


# Streaming DiLoCo: two fragments, each synchronised every SH steps, staggered by SH / 2, each
# exchange sent TAU steps before it lands; on arrival x <- ALPHA x + (1 - ALPHA) anchor.
SH, TAU, ALPHA = 6, 2, 0.5
S_STEPS = 2 * SH + 2
STARTS = [0, 48, 56, 80, 83]  # of the model's four parameters in the flat values
CONTIGUOUS = [[0], [1, 2, 3]]  # the first layer's weight (48 values, the nearest cut to half of 83), then the rest
GIVEN = [[1, 2], [0, 3]]  # the first bias and second weight; the first weight and second bias (two pieces)


def _pieces(members):
    """(lo, hi, each parameter's start from lo) of each run of consecutive parameters in ``members``:
    what one collective sends."""
    runs = []
    for i in sorted(members):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [(STARTS[r[0]], STARTS[r[-1] + 1], [STARTS[i] - STARTS[r[0]] for i in r]) for r in runs]


def _streamed_oracle(world, compressor, collective, error_feedback, fragments=CONTIGUOUS):
    """Algorithm 2 of arXiv 2501.18512 (torchft's schedule): fragment p (parameters
    ``fragments[p]``) lands at the steps k SH / 2 with k = p + 1 modulo 2, its outer gradients
    formed TAU steps before, each run of consecutive parameters compressed on its own."""
    models = [_model() for _ in range(world)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    anchor = _flat(models[0]).clone()
    momentum = torch.zeros_like(anchor)
    pieces = [_pieces(members) for members in fragments]
    exchanges = [[_simulated(collective, world, hi - lo, starts) for lo, hi, starts in f] for f in pieces]
    period, in_flight, history = SH // 2, {}, []
    for step in range(1, S_STEPS + 1):
        for rank in range(world):
            _inner_step(models[rank], inners[rank], rank, step)
            inners[rank].step()
        if (step + TAU) % period == 0:
            p = ((step + TAU) // period - 1) % 2
            in_flight[step + TAU] = p, [[anchor[lo:hi] - _flat(m)[lo:hi] for m in models] for lo, hi, _ in pieces[p]]
        if step in in_flight:
            p, sent = in_flight.pop(step)
            for (lo, hi, _), deltas, exchange in zip(pieces[p], sent, exchanges[p]):
                delta = _average(deltas, exchange, compressor, error_feedback)
                momentum[lo:hi] = OUTER_MOMENTUM * momentum[lo:hi] + delta
                anchor[lo:hi] = anchor[lo:hi] - OUTER_LR * (delta + OUTER_MOMENTUM * momentum[lo:hi])
            for m in models:
                merged = ALPHA * _flat(m) + (1 - ALPHA) * anchor
                with torch.no_grad():
                    for i, q in enumerate(m.parameters()):
                        if i in fragments[p]:
                            q.copy_(merged[STARTS[i] : STARTS[i + 1]].view_as(q))
        history.append(([_flat(m).clone() for m in models], anchor.clone()))
    return history


def _given(model, fragments):
    """``fragments`` of parameter indices as lists of ``model``'s parameters (None: the int 2)."""
    params = list(model.parameters())
    return 2 if fragments is None else [[params[i] for i in members] for members in fragments]


def _streamed(rank, world, compressor, collective, error_feedback, fragments=None):
    torch.set_num_threads(1)
    model = _model()
    opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=SH, outer_step="nesterov",
                        outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, fragments=_given(model, fragments),
                        delay=TAU, compressor=compressor, collective=collective, error_feedback=error_feedback,
                        scales="tensor")
    history, shared, sent = [], [], []
    for step in range(1, S_STEPS + 1):
        _inner_step(model, opt, rank, step)
        opt.step()
        if step == 5 and rank == 0:  # in flight since step 4: rank 0 alone completes it to save (no hang)
            assert opt.state_dict()["onebit"]["arrivals"][0]["lands_at"] == 6
        history.append(_flat(model).clone())
        with opt.anchored():
            shared.append(_flat(model).clone())
        assert torch.equal(_flat(model), history[-1])  # its own values again after the block
        sent.append(opt.stats["bytes_sent"])
        opt.check_replicas()  # the anchors: the same bits on every rank after every step
    opt.wait()
    return history, shared, sent, opt.merge


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("compressor,collective,error_feedback", [
    ("identity", "allgather", False), ("sign", "allgather", False), ("sign", "allgather", True),
    ("sign", "allreduce", True)])
def test_streamed_fragments_match_the_algorithm_written_plainly(world, compressor, collective, error_feedback):
    oracle = _streamed_oracle(world, compressor, collective, error_feedback)
    results = run_ranks(_streamed, world, compressor, collective, error_feedback)
    for rank, (history, shared, sent, merge) in enumerate(results):
        assert merge == ALPHA  # the paper's, by default with a delay
        for step, (ours, anchored, (expected, anchor)) in enumerate(zip(history, shared, oracle), start=1):
            assert torch.allclose(ours, expected[rank], rtol=1e-5, atol=1e-6), (rank, step)
            # anchored(): the model every rank shares, each fragment as its last landing left it
            assert torch.allclose(anchored, anchor, rtol=1e-5, atol=1e-6)
            assert torch.equal(anchored, results[0][1][step - 1])
        # launched TAU steps before each landing (steps 1, 4, 7, ...), and only then: the bytes of
        # that step (the all-reduce's second phase leaves in the next step's step())
        assert all(sent[s - 1] > 0 for s in range(1, S_STEPS + 1, SH // 2))
    assert not torch.equal(results[0][0][-1], results[1][0][-1])  # merged with local steps: they differ


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("compressor,collective,error_feedback", [
    ("identity", "allgather", False), ("sign", "allgather", True), ("sign", "allreduce", True)])
def test_fragments_given_as_parameters_match_the_algorithm_written_plainly(world, compressor, collective,
                                                                          error_feedback):
    # fragment 1 in two pieces around fragment 0's: each piece a collective of its own
    oracle = _streamed_oracle(world, compressor, collective, error_feedback, GIVEN)
    contiguous = _streamed_oracle(world, compressor, collective, error_feedback)
    assert not torch.allclose(oracle[-1][1], contiguous[-1][1])  # a different schedule of the same model
    results = run_ranks(_streamed, world, compressor, collective, error_feedback, GIVEN)
    for rank, (history, shared, _, _) in enumerate(results):
        for step, (ours, anchored, (expected, anchor)) in enumerate(zip(history, shared, oracle), start=1):
            assert torch.allclose(ours, expected[rank], rtol=1e-5, atol=1e-6), (rank, step)
            assert torch.allclose(anchored, anchor, rtol=1e-5, atol=1e-6)
            assert torch.equal(anchored, results[0][1][step - 1])


def _streamed_resumed(rank, world, fragments=None, recipe=None):
    torch.set_num_threads(1)

    def build():
        model = _model()
        return model, onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=SH,
                                    fragments=_given(model, fragments), delay=TAU, error_feedback=True,
                                    **(recipe or {}))

    model, opt = build()
    for step in range(1, S_STEPS + 1):
        _inner_step(model, opt, rank, step)
        if step == 5 and rank == 0:  # an inner step inside the flight sent at step 4: rank 0 skips it alone
            next(model.parameters()).grad[0, 0] = float("inf")
        opt.step()
        if step == 8:  # sent at step 7, in flight
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    straight, skipped = _flat(model).clone(), opt.stats["skipped_steps"]
    opt.wait()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for step in range(9, S_STEPS + 1):
        _inner_step(model, opt, rank, step)
        opt.step()
    opt.wait()
    return straight, _flat(model), skipped, saved["opt"]["onebit"]["arrivals"][0]["lands_at"]


@pytest.mark.parametrize("fragments,recipe", [
    (None, None), (GIVEN, None),
    # SparseLoCo's: the decayed accumulator, chunk-wise Top-k, averaging
    (None, {"compressor": onebit.compress.get("chunk_topk", **SPARSE), "error_decay": BETA, "outer_lr": 1.0,
            "outer_momentum": 0.0})])
def test_streamed_skips_alone_and_resumes_inside_a_flight_bit_for_bit(fragments, recipe):
    for rank, (straight, resumed, skipped, lands_at) in enumerate(run_ranks(_streamed_resumed, 2, fragments, recipe)):
        assert skipped == (rank == 0)
        assert lands_at == 9  # sent at step 7, saved in flight
        assert torch.equal(straight, resumed)


def _eight_bit(rank, world):
    torch.set_num_threads(1)
    runs = []
    for compressor in ("identity", onebit.compress.get("uniform", bits=8)):
        model = _model()
        opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, compressor=compressor)
        for step in range(1, 2 * H + 1):
            _inner_step(model, opt, rank, step)
            opt.step()
        opt.check_replicas()  # synchronised: the parameters themselves
        runs.append((_flat(model), opt.stats["bytes_sent_total"]))
    return runs


def test_any_registered_compressor_sends_the_outer_gradients():
    (exact, exact_bytes), (eight, eight_bytes) = run_ranks(_eight_bit, 2)[0]
    assert eight_bytes < exact_bytes / 2  # a byte a value against four, plus scales and padding (a small model)
    assert torch.allclose(eight, exact, atol=2e-3) and not torch.equal(eight, exact)


def _resumed(rank, world):
    torch.set_num_threads(1)

    def build():
        model = _model()
        return model, onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H)

    model, opt = build()
    steps = []
    for step in range(1, STEPS + 1):
        _inner_step(model, opt, rank, step)
        if (step, rank) in ((2, 1), (H, 0)):  # an inner step: rank 1 alone skips it; a synchronisation: every rank
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()
        steps.append(opt.stats["step"])
        if step == H + 2:  # inside the second interval: the inner state, anchor, momentum, errors
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    straight, skipped = _flat(model).clone(), opt.stats["skipped_steps"]
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    scheduled = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)  # on DiLoCo: schedules the inner steps
    for step in range(H + 3, STEPS + 1):
        _inner_step(model, opt, rank, step)
        opt.step()
        scheduled.step()
    return straight, _flat(model), skipped, steps, opt.inner.param_groups is opt.param_groups


def test_skips_and_resumes_inside_an_interval_bit_for_bit():
    for rank, (straight, resumed, skipped, steps, shared) in enumerate(run_ranks(_resumed, 2)):
        assert torch.equal(straight, resumed)
        # a NaN on rank 1 at step 2, an inner step: rank 1 alone skipped it, and it counts (no
        # collective between synchronisations); on rank 0 at step 3, the synchronisation: every rank
        # skipped it, which then came a step later
        assert skipped == 1 + rank
        assert steps[:4] == [1, 2, 2, 3]
        assert shared


def test_a_checkpoint_loads_only_into_the_same_streaming_schedule():
    model = _model()
    opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, fragments=2, delay=1)
    _inner_step(model, opt, 0, 1)
    opt.step()  # sends fragment 0: in flight
    state = opt.state_dict()
    opt.wait()
    other = onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4)
    with pytest.raises(ValueError, match="saved with fragments=2, delay=1; this optimizer has fragments=1, delay=0"):
        other.load_state_dict(state)
    # nor into the other collective (their error state differs), before anything is loaded
    state = onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4).state_dict()
    other = onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, collective="allreduce")
    before = other.state_dict()
    with pytest.raises(ValueError, match="saved with collective='allgather'; this optimizer has collective='allred"):
        other.load_state_dict(state)
    assert other.state_dict()["onebit"]["collective"] == before["onebit"]["collective"] == "allreduce"
    state = other.state_dict()
    del state["onebit"]["collective"]  # a checkpoint from before the option: the all-reduce's
    with pytest.raises(ValueError, match="saved with collective='allreduce'; this optimizer has collective='allg"):
        onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4).load_state_dict(state)
    other.load_state_dict(state)
    exact = onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, compressor="identity")
    exact.load_state_dict(state)  # the exact exchange holds no error state: either loads
    # nor with other error feedback (errors carried, or decayed, mean another algorithm)
    state = onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, outer_step="nesterov").state_dict()
    for other in ({}, {"outer_step": "nesterov", "error_feedback": True}):
        with pytest.raises(ValueError, match="saved with error_feedback=False, error_decay=1.0; this optimizer has "
                                             "error_feedback=True.*outer_step='nesterov' carries none by default"):
            onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, **other).load_state_dict(state)
    del state["onebit"]["error_feedback"]  # a checkpoint from before the record: whatever it is built with,
    onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, outer_step="nesterov",
                  error_feedback=True).load_state_dict(state)
    # but not SparseLoCo's outer step beside the outer momentum it would load
    with pytest.raises(ValueError, match="saved with outer_momentum=0.9; this optimizer's outer step is SparseLoCo's"):
        onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4).load_state_dict(state)
    # nor with other scales (another code); a checkpoint from before the record: whatever it is built with
    state = onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4).state_dict()
    with pytest.raises(ValueError, match="saved with scales='row'; this optimizer has scales='tensor'"):
        onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, scales="tensor").load_state_dict(state)
    del state["onebit"]["scales"]
    onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, scales="tensor").load_state_dict(state)
    # fragments given as parameters: only into the same ones, however they were given
    def built(fragments):
        return onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, fragments=fragments, delay=1)

    state = built(_given(model, GIVEN)).state_dict()
    with pytest.raises(ValueError, match=r"saved with its parameters in the fragments \[1, 0, 0, 1\]; this "
                                         r"optimizer has them in \[0, 1, 1, 1\]"):
        built(2).load_state_dict(state)
    built(iter(iter(f) for f in _given(model, [[2, 1], [3, 0]]))).load_state_dict(state)  # listed in another order
    built(2).load_state_dict(built(_given(model, CONTIGUOUS)).state_dict())  # the fragments 2 cuts by size
    del state["onebit"]["fragment_of"]  # a checkpoint from before the option: its fragments cut by size
    with pytest.raises(ValueError, match=r"saved with its parameters in the fragments \[0, 1, 1, 1\]; this "):
        built(_given(model, GIVEN)).load_state_dict(state)
    built(2).load_state_dict(state)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"inner": "adamw"}, TypeError, "also inner="),
    ({"params": [torch.zeros(2, requires_grad=True)], "inner": "adamw"}, TypeError, "Invalid inner value: 'adamw'"),
    ({"params": [torch.zeros(2, requires_grad=True)], "lr": -1.0}, ValueError, "Invalid lr value: -1.0"),
    ({"sync_every": 0}, ValueError, "Invalid sync_every value: 0"),
    ({"outer_lr": -1.0}, ValueError, "Invalid outer_lr value: -1.0"),
    ({"outer_momentum": 1.0}, ValueError, "Invalid outer_momentum value: 1.0"),
    ({"compressor": "int8"}, ValueError, "Invalid compressor value: 'int8' \\(expected one of block_sign, "),
    ({"error_feedback": 1}, TypeError, "Invalid error_feedback value: 1"),
    ({"outer_step": "nesterov", "error_decay": 0.95}, ValueError,
     "Invalid error_decay value: 0.95 \\(expected a number in \\(0, 1\\], and 1 without error_feedback=True"),
    ({"outer_step": "paper"}, ValueError,
     "Invalid outer_step value: 'paper' \\(expected 'sparseloco' or 'nesterov'\\)"),
    # SparseLoCo's outer step is its error accumulator: a momentum, or no error carried, is another algorithm
    ({"outer_momentum": 0.9}, ValueError,
     "Invalid outer_momentum value with outer_step='sparseloco': 0.9 \\(its momentum is each rank's decayed error"),
    ({"error_feedback": False}, ValueError, "Invalid error_feedback value with outer_step='sparseloco': False"),
    ({"nesterov": True}, ValueError, "Invalid nesterov value with outer_step='sparseloco': True"),
    ({"outer_step": ["nesterov"]}, ValueError, "Invalid outer_step value: \\['nesterov'\\]"),
    ({"error_feedback": True, "error_decay": 1.5}, ValueError, "Invalid error_decay value: 1.5"),
    ({"error_feedback": True, "error_decay": 0}, ValueError, "Invalid error_decay value: 0"),
    ({"collective": "ring"}, ValueError, "Invalid collective value: 'ring' \\(expected 'allgather' or 'allreduce'\\)"),
    ({"scales": "rows"}, ValueError, "Invalid scales value: 'rows' \\(expected 'tensor', 'chunk' or 'row'\\)"),
    ({"scales": "row", "compressor": "block_sign"}, ValueError,
     "Invalid scales value for compressor 'block_sign': 'row' \\(it has no per-block scales"),
    ({"overlap": True}, TypeError, "unexpected keyword argument 'overlap'"),
    ({"outer": lambda a: torch.optim.SGD(a, lr=1.0), "outer_lr": 0.5}, TypeError, "given outer= and also outer_lr="),
    ({"outer": "sgd"}, TypeError, "Invalid outer value: 'sgd' \\(expected a factory of a torch.optim.Optimizer"),
    ({"outer": lambda a: a}, TypeError, "Invalid outer value: it made a list, not a torch.optim.Optimizer"),
    ({"nesterov": 1}, TypeError, "Invalid nesterov value: 1"),
    ({"fragments": 0}, ValueError, "Invalid fragments value: 0"),
    ({"fragments": 2, "sync_every": 5}, ValueError, "Invalid fragments value: 2 \\(sync_every=5 must be a"),
    ({"fragments": 5, "sync_every": 5}, ValueError, "Invalid fragments value: 5 \\(more than the 4 parameters"),
    ({"fragments": 2, "sync_every": 8, "delay": 4}, ValueError, "Invalid delay value: 4 \\(expected an int in \\[0, 4"),
    ({"delay": -1}, ValueError, "Invalid delay value: -1"),
    ({"merge": 0.5}, ValueError, "Invalid merge value: 0.5 \\(expected a number in \\[0, 1\\), and 0 with delay=0"),
    ({"sync_every": 4, "delay": 1, "merge": 1.0}, ValueError, "Invalid merge value: 1.0"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    model = _model()
    kwargs = {"params": torch.optim.AdamW(model.parameters()), **kwargs}
    with pytest.raises(error, match=match):
        onebit.DiLoCo(**kwargs)
    with pytest.raises(TypeError, match="exchanges itself"):
        onebit.DiLoCo(onebit.OnebitAdam(model.parameters()))


@pytest.mark.parametrize("fragments,error,match", [
    ([[0, 1], [2]], ValueError, r"parameters \[3\] of the inner optimizer are in no fragment"),
    ([[0, 1], [1, 2, 3]], ValueError, "parameter 1 is in fragments 0 and 1"),
    ([[0, 1, 1], [2, 3]], ValueError, "parameter 1 is listed twice in fragment 0"),
    ([], ValueError, r"Invalid fragments value: \[\] \(expected an int, or lists of parameters"),
    ([[0, 1, 2, 3], []], ValueError, "fragment 1 is empty"),
    ([[0, 1], [2, 3, "other"]], ValueError, r"fragment 1 holds a tensor of shape \(2,\) that is not a parameter"),
    ([[0, 1], [2, 3, "seven"]], TypeError, "fragment 1 holds a str"),
    ([0, 1], TypeError, "fragment 0 is a Parameter"),
    ("ab", TypeError, "Invalid fragments value: a str \\(expected an int, or lists of parameters"),
    (2.0, TypeError, "Invalid fragments value: a float \\(expected an int, or lists of parameters"),
    ([[0], [1], [2, 3]], ValueError, "Invalid fragments value: 3 lists \\(sync_every=4 must be a multiple of it"),
])
def test_fragments_given_as_parameters_are_checked(fragments, error, match):
    model = _model()
    params, stray = list(model.parameters()), torch.zeros(2, requires_grad=True)
    named = {"other": stray, "seven": "seven"}

    def given(x):
        return params[x] if isinstance(x, int) else named[x]

    if isinstance(fragments, list):
        fragments = [given(f) if isinstance(f, int) else [given(i) for i in f] for f in fragments]
    with pytest.raises(error, match=match):
        onebit.DiLoCo(torch.optim.AdamW(model.parameters()), sync_every=4, fragments=fragments)


# A run that ends between a streamed synchronisation's launch and its landing, without opt.wait():
# the last rank optionally dies right after its last step (its peers' exchange then fails).
_ENDS_IN_FLIGHT = """
opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every=8, fragments=2, delay=2, timeout=10)
data = byte_windows(rank, world, 15 * 32)
for step in range(15):  # fragment 0 launched after step 13, landing at 16: in flight at the end
    opt.zero_grad()
    F.cross_entropy(model(data[step * 32:(step + 1) * 32, :CONTEXT]), data[step * 32:(step + 1) * 32, CONTEXT]).backward()
    opt.step()
if {dies} and rank == world - 1:
    os._exit(0)
dist.destroy_process_group()
print("rank", rank, "left its loop", flush=True)
"""


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dies", [False, True])
def test_a_run_that_ends_with_a_synchronisation_in_flight_completes_it_at_exit(tmp_path, world, dies):
    code, out = run_torchrun(tmp_path, _ENDS_IN_FLIGHT.format(dies=dies), world)
    assert code == 0 and "terminate called" not in out, out[-4000:]
    survivors = world - 1 if dies else world
    assert out.count("left its loop") == survivors
    completed = out.count("DiLoCo: the exchange in flight to step 16 was completed at exit and never landed")
    failed = out.count("DiLoCo: the exchange in flight to step 16 failed while the process exited")
    # Without a peer dying, it completes on every rank. With one, it completes if the dead rank's
    # thread had done its part, else it fails within its timeout (10 s): each survivor says which.
    assert (completed, failed) == (world, 0) if not dies else completed + failed == survivors
    assert out.count("call opt.wait() before the end of the run") == survivors


def _loads(rank, world, which):
    """Inside an interval of inner steps, each rank saves its model and optimizer; a new run loads
    the optimizer state beside ``which`` model: the rank's own, rank 0's (the DDP habit) or the
    one ``anchored()`` gives (every rank's the same); or rank 0's model with rank 0's state on
    every rank ("rank0-both": the DDP habit of saving on rank 0 alone, every rank rank 0's copy)."""
    torch.set_num_threads(1)
    model = _model()
    opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H)
    for step in range(1, H + 2):
        _inner_step(model, opt, rank, step)
        opt.step()
    with opt.anchored():
        anchored = {k: v.clone() for k, v in model.state_dict().items()}
    models = [None] * world
    torch.distributed.all_gather_object(models, model.state_dict())
    states = [None] * world
    torch.distributed.all_gather_object(states, opt.state_dict())
    model = _model()
    opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H)
    model.load_state_dict({"own": models[rank], "rank0": models[0], "anchored": anchored,
                           "rank0-both": models[0]}[which])
    opt.load_state_dict(states[0 if which == "rank0-both" else rank])
    _inner_step(model, opt, rank, H + 2)
    try:
        opt.step()
    except onebit.optim.ReplicaDivergence as exc:
        return str(exc)
    opt.check_replicas()
    return None


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("which", ["own", "rank0", "anchored", "rank0-both"])
def test_a_rank_that_resumes_beside_parameters_not_its_own_is_stopped_on_every_rank(world, which):
    messages = run_ranks(_loads, world, which)
    if which in ("own", "rank0-both"):  # each rank beside the parameters saved with the state it loaded
        assert messages == [None] * world
        return
    ranks = list(range(1, world)) if which == "rank0" else list(range(world))
    for rank, message in enumerate(messages):  # every rank stops, each saying where its own differ
        assert message.startswith(f"the parameters of ranks {ranks} are not those saved with the DiLoCo state "
                                  f"each loaded, at step {H + 1}")
        assert "each rank must load the model state saved beside the optimizer state it loads" in message
        assert ("here, parameter 0 (shape (8, 6)) first" in message) == (rank in ranks)
