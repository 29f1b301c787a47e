import hashlib
import logging
import time

import pytest
import torch

from _harness import run_ranks
from _oracle import SimulatedCompressedAllGather, SimulatedCompressedAllReduce, chunks
import onebit
from onebit import comm, compress


def _inputs(world: int, n: int, step: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + r)) for r in range(world)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _allreduce_worker(rank, world, n, steps):
    car = comm.CompressedAllReduce("sign")
    outs, meters = [], []
    for step in range(steps):
        x = _inputs(world, n, step)[rank]
        before = x.clone()
        with comm.measure() as m:
            y = car(x)
        assert torch.equal(x, before), "input was modified"
        outs.append(y)
        meters.append(m.bytes_sent)
    dense = torch.randn(n)
    with comm.measure() as plain:
        comm.all_reduce_mean(dense)
    return {"outs": outs, "digests": [_digest(y) for y in outs], "bytes": meters, "plain": plain.bytes_sent,
            "chunk": car.chunk, "state": car.state_dict()}


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_allreduce_matches_oracle_and_is_identical(world):
    n, steps = 1_000_003, 3
    res = run_ranks(_allreduce_worker, world, n, steps)
    oracle = SimulatedCompressedAllReduce(world, n)
    for step in range(steps):
        expect = oracle(_inputs(world, n, step))
        assert len({r["digests"][step] for r in res}) == 1, "ranks disagree"
        got = res[0]["outs"][step]
        # The oracle's scales are computed in fp64: agreement to fp32 rounding.
        assert torch.allclose(got, expect, rtol=1e-5, atol=0), (got - expect).abs().max()
    for r, out in enumerate(res):
        assert out["chunk"] == chunks(n, world, 8)[r]
        assert out["bytes"][0] * 28 <= out["plain"], (out["bytes"][0], out["plain"])
        # exact volume: (w-1) slots out in the all-to-all and (w-1) copies of the own slot in the all-gather
        slot = compress.get("sign").wire_bytes(chunks(n, world, 8)[0][1])
        assert out["bytes"][0] == 2 * (world - 1) * slot
        assert torch.allclose(out["state"]["worker_error"]["error"], oracle.worker_err[r], atol=1e-5)
        lo, hi = out["chunk"]
        assert torch.allclose(out["state"]["server_error"]["error"], oracle.server_err[r], atol=1e-5)


def _segmented_worker(rank, world, n, segments, steps, kind):
    car = getattr(comm, kind)("sign", segments=segments)
    outs = []
    for step in range(steps):
        x = _inputs(world, n, step)[rank]
        x[:2_000] *= 1000.0  # a "layer" three orders of magnitude above the rest of its chunk
        with comm.measure() as m:
            outs.append(car(x))
    return {"outs": outs, "bytes": m.bytes_sent, "state": car.state_dict()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["CompressedAllReduce", "CompressedAllGather"])
def test_segmented_scales_match_oracle(world, kind):
    # starts off the byte grid (rounded down to 8) and, for the all-reduce, a piece inside every chunk
    n, steps = 10_007, 3
    segments = [0, 2_000, 2_013, n // 3 + 5, 5_004, 9_999]
    res = run_ranks(_segmented_worker, world, n, segments, steps, kind)
    simulated = SimulatedCompressedAllReduce if kind == "CompressedAllReduce" else SimulatedCompressedAllGather
    oracle, plain = simulated(world, n, segments=segments), simulated(world, n)
    for step in range(steps):
        xs = _inputs(world, n, step)
        for x in xs:
            x[:2_000] *= 1000.0
        expect, coarse = oracle(xs), plain(xs)
        got = [r["outs"][step] for r in res]
        assert all(torch.equal(g, got[0]) for g in got), "ranks disagree"
        # the all-gather's average cancels values of ~1e3 (the all-reduce compresses it again): an atol
        atol = 1e-6 * expect.abs().max() if kind == "CompressedAllGather" else 0
        assert torch.allclose(got[0], expect, rtol=1e-5, atol=atol), (got[0] - expect).abs().max()
        # the small values after the large layer keep their own magnitude instead of its
        truth, small = torch.stack(xs).mean(0), slice(2_008, n // 3)
        assert (got[0] - truth)[small].norm() < 0.01 * (coarse - truth)[small].norm()
    for r, out in enumerate(res):
        assert torch.allclose(out["state"]["worker_error"]["error"], oracle.worker_err[r], rtol=1e-5, atol=1e-3)
        if kind == "CompressedAllGather":  # 4 bytes per piece, the whole tensor to each of the w - 1 others
            assert out["bytes"] == (world - 1) * (compress.get("sign").wire_bytes(n) + 4 * (len(oracle.pieces) - 1))
            continue
        # 4 bytes per piece: the slot of the chunk with the most pieces, 2 (w - 1) of them
        slot = max(compress.get("sign").wire_bytes(hi - lo) + 4 * (len(p) - 1)
                   for (lo, hi), p in zip(oracle.bounds, oracle.pieces))
        assert out["bytes"] == 2 * (world - 1) * slot


def test_segments_need_a_compressor_with_scales():
    with pytest.raises(ValueError, match="segments given for IdentityCompressor"):
        comm.CompressedAllReduce("identity", segments=[0, 10])
    with pytest.raises(ValueError, match="segments must be a sequence of ints >= 0"):
        comm.CompressedAllReduce("sign", segments=[0, -1])
    with pytest.raises(ValueError, match="segments given for TopKCompressor"):
        comm.CompressedAllGather("topk", segments=[0, 10])


def _small_sizes_worker(rank, world):
    results = {}
    for n in (0, 1, 5, 8, 9, 23, 24, 25, 100):
        car = comm.CompressedAllReduce("sign")
        results[n] = [car(_inputs(world, n, s)[rank]) for s in range(2)]
    return results


def test_odd_and_tiny_sizes_world_3():
    world = 3
    res = run_ranks(_small_sizes_worker, world)
    for n in res[0]:
        oracle = SimulatedCompressedAllReduce(world, n)
        for s in range(2):
            expect = oracle(_inputs(world, n, s))
            for r in range(world):
                assert torch.equal(res[r][n][s], res[0][n][s])
            assert torch.allclose(res[0][n][s], expect, rtol=1e-5), (n, s)


def _stages_worker(rank, world):
    n = 10_001
    plain = [comm.CompressedAllReduce("sign") for _ in range(2)]
    flagged = [comm.CompressedAllReduce("sign", flag_nonfinite=True) for _ in range(2)]
    same, flags, sent = [], [], []
    for step in range(3):
        xs = [_inputs(world, n, 10 * step + k)[rank] for k in range(2)]
        if step == 1 and rank == 1:
            xs[1][0] = float("inf")  # in chunk 0, which rank 0 owns: not the rank that overflowed
        expect = [c(x) for c, x in zip(plain, xs)]
        with comm.measure() as m:
            a, b = (c.stages(x) for c, x in zip(flagged, xs))
            next(a), next(b), next(a), next(b)  # the two exchanges' stages interleaved
            got = [comm.run_stages(a), comm.run_stages(b)]
        same.append([_digest(g) == _digest(e) for g, e in zip(got, expect)])
        flags.append([bool(c.nonfinite) for c in flagged])
        sent.append(m.bytes_sent)
        if step == 1:  # the caller restarts the errors that took in the Inf
            plain[1].reset()
            flagged[1].reset()
    return {"same": same, "flags": flags, "bytes": sent, "unflagged": plain[0].nonfinite}


def test_stages_interleave_and_carry_the_nonfinite_flag_world_3():
    """Two exchanges run stage by stage, interleaved, give the bits of two plain calls; with
    ``flag_nonfinite`` every rank learns that one rank's input held an Inf -- though the Inf
    sat in a chunk another rank owns -- for one byte more per slot and no extra collective."""
    world = 3
    res = run_ranks(_stages_worker, world)
    slot = compress.get("sign").wire_bytes(chunks(10_001, world, 8)[0][1]) + 1
    for r in res:
        assert r["same"] == [[True, True]] * 3
        assert r["flags"] == [[False, False], [False, True], [False, False]]
        assert r["bytes"] == [2 * 2 * (world - 1) * slot] * 3
        assert r["unflagged"] is None


def _half_mean_worker(rank, world, dtype):
    x = _inputs(world, 1_001, 3)[rank]
    with comm.measure() as m:
        got = comm.run_stages(comm.all_reduce_mean_stages(x.clone(), None, None, dtype=dtype))
    return _digest(got), got, m.bytes_sent


@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_reduce_mean_summed_in_bf16(world):
    """``dtype=torch.bfloat16``: each rank's x / world rounded to bf16 and summed in it, half the
    bytes of fp32's ring, the same bits on every rank; on 2 ranks the plain sum of the two
    rounded values rounded once; on one rank the input itself, nothing rounded."""
    xs = _inputs(world, 1_001, 3)
    exact = sum(xs) / world
    if world == 1:
        _, got, sent = _half_mean_worker(0, 1, torch.bfloat16)
        assert torch.equal(got, exact) and sent == 0
        return
    res = run_ranks(_half_mean_worker, world, torch.bfloat16)
    assert all(r[0] == res[0][0] for r in res)
    got = res[0][1]
    assert got.dtype == torch.float32 and not torch.equal(got, exact)
    assert (got - exact).abs().max() <= 2**-7 * max(x.abs().max() for x in xs)  # bf16's rounding, a few times
    if world == 2:
        assert torch.equal(got, ((xs[0] / 2).bfloat16() + (xs[1] / 2).bfloat16()).float())
    assert res[0][2] == 2 * (world - 1) * 2 * 1_001 // world


def _pipelined_worker(rank, world):
    sizes = (10_001, 64, 3_000)
    plain = [comm.CompressedAllReduce("sign") for _ in sizes]
    piped = [comm.CompressedAllReduce("sign") for _ in sizes]
    same = []
    for step in range(2):
        xs = [_inputs(world, n, 10 * step + k)[rank] for k, n in enumerate(sizes)]
        expect = [c(x) for c, x in zip(plain, xs)]
        exact = xs[1].clone()
        with comm.trace(rank) as timeline:
            got = comm.run_pipelined([*(c.stages(x) for c, x in zip(piped, xs)),
                                      comm.all_reduce_mean_stages(exact, None, None)])
        same.append([_digest(g) == _digest(e) for g, e in zip(got, expect)])
        same[-1].append(torch.allclose(got[3], sum(_inputs(world, 64, 10 * step + 1)) / world))
    wire = sorted((e for e in timeline.to_json()["traceEvents"] if e["tid"] == "wire"), key=lambda e: e["ts"])
    return same, [e["name"] for e in wire]


def test_pipelined_exchanges_overlap_their_phases_and_keep_the_bits():
    """``run_pipelined``: each exchange's all-to-all leaves before the previous one's all-gather
    (the link holds the next piece while one is averaged), in the same order on every rank, and
    every exchange gives the bits of a plain call; a one-stage exchange (an exact all-reduce) fits."""
    world = 2
    for same, order in run_ranks(_pipelined_worker, world):
        assert same == [[True] * 4] * 2
        assert order == ["all_to_all", "all_to_all", "all_gather", "all_to_all", "all_gather", "all_reduce",
                         "all_gather"]


def test_the_pipeline_keeps_each_exchange_a_phase_behind_the_next():
    """``comm.Pipeline``, the one scheduler of exchanges in flight (the optimizers' buckets, the
    DDP hooks', ``run_pipelined``): a launch starts the exchange and the second phase of the
    lagging ones before it; ``catch_up`` the last one's; the others wait for ``completed``,
    which moves each a phase, in launch order, round after round, yielding each as it ends (the
    caller's work on it before the next phases leave); ``finish`` returns the results in launch
    order; ``drop`` abandons what is left."""
    events = []

    def exchange(name, phases):
        for k in range(phases):
            events.append(f"{name}{k}")
            yield None  # (a collective's Pending, which drop() would wait for)
        return name

    pipe = comm.Pipeline()
    pipe.launch(exchange("a", 4), bucket=0)
    pipe.launch(exchange("x", 2), bucket=1, lags=False)  # an exact mean: its wait only in finish()
    pipe.launch(exchange("b", 3), bucket=2)
    assert events == ["a0", "x0", "a1", "b0"]
    pipe.catch_up()
    assert events[-1] == "b1" and len(pipe) == 3
    landed = []
    for bucket, result in pipe.completed():
        landed.append((bucket, result))
    assert events == ["a0", "x0", "a1", "b0", "b1", "a2", "x1", "b2", "a3"]
    assert landed == [(1, "x"), (2, "b"), (0, "a")] and len(pipe) == 0
    pipe.launch(exchange("c", 3))
    pipe.drop()
    assert events[-1] == "c0" and len(pipe) == 0
    pipe.launch(exchange("d", 3))
    pipe.launch(exchange("e", 1), lags=False)
    assert pipe.finish() == ["d", "e"] and events[-3:] == ["e0", "d1", "d2"] and len(pipe) == 0


def _gather_worker(rank, world, name, kwargs, ef):
    exch = comm.CompressedAllGather(name, error_feedback=ef, **kwargs)
    outs = []
    for step in range(3):
        with comm.measure() as m:
            outs.append(exch(_inputs(world, 1001, step)[rank]))
    return outs, m.bytes_sent


@pytest.mark.parametrize("world", [2, 3])
def test_compressed_allgather_is_exact_average_of_compressed(world):
    for name, kwargs, ef in [("topk", {"ratio": 0.05}, True), ("block_sign", {"block_size": 100}, False)]:
        res = run_ranks(_gather_worker, world, name, kwargs, ef)
        c = compress.get(name, **kwargs)
        errors = [torch.zeros(1001) for _ in range(world)]
        for step in range(3):
            xs = _inputs(world, 1001, step)
            decoded = []
            for r in range(world):
                v = xs[r] + errors[r] if ef else xs[r]
                d = c.decompress(c.compress(v))
                if ef:
                    errors[r] = v - d
                decoded.append(d)
            expect = sum(decoded) / world
            for r in range(world):
                assert torch.equal(res[r][0][step], res[0][0][step])
            assert torch.allclose(res[0][0][step], expect, atol=1e-6)
        assert res[0][1] == (world - 1) * c.wire_bytes(1001)


def _stall_worker(rank, world):
    car = comm.CompressedAllReduce("sign", timeout=2.0)
    if rank == 1:
        time.sleep(8)  # never joins: the others must time out, not hang
        return "slept"
    start = time.monotonic()
    try:
        car(torch.ones(64))
    except comm.CollectiveError as exc:
        return str(exc), time.monotonic() - start
    return "no error", 0.0


def test_stalled_peer_times_out_with_named_error():
    res = run_ranks(_stall_worker, 3, timeout=60)
    for r in (0, 2):
        msg, elapsed = res[r]
        assert "all_to_all on group default" in msg and "timed out (timeout 2s)" in msg, msg
        assert elapsed < 6


def test_world_size_one_without_process_group_still_compresses():
    x = torch.randn(50)
    car = comm.CompressedAllReduce("sign")
    oracle = SimulatedCompressedAllReduce(1, 50)
    with comm.measure() as m:
        for _ in range(3):
            assert torch.allclose(car(x), oracle([x]), rtol=1e-5)
    assert m.bytes_sent == 0
    assert comm.get_world_size() == 1 and not comm.is_distributed()


def test_state_dict_round_trip_resumes_exactly():
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    a = comm.CompressedAllReduce("sign")
    for x in xs[:3]:
        a(x)
    b = comm.CompressedAllReduce("sign")
    b.load_state_dict(a.state_dict())
    for x in xs[3:]:
        assert torch.equal(a(x), b(x))


def test_state_from_other_world_size_warns_and_resets(caplog):
    a = comm.CompressedAllReduce("sign")
    a(torch.randn(40))
    state = a.state_dict()
    state["world_size"] = 4
    b = comm.CompressedAllReduce("sign")
    with caplog.at_level(logging.WARNING):
        b.load_state_dict(state)
    assert "saved on world size 4, loaded on 1" in caplog.text
    assert b.worker_error.error is None and b.server_error.error is None


def test_out_and_dtypes():
    x = torch.randn(33, dtype=torch.float16)
    car = comm.CompressedAllReduce("identity")
    y = car(x)
    assert y.dtype == torch.float16 and torch.equal(y, x)
    out = torch.empty(33)
    assert car(x, out=out) is out and torch.equal(out, x.float())


def test_bad_input_messages():
    car = comm.CompressedAllReduce("sign")
    with pytest.raises(TypeError, match="tensor must be a floating-point tensor, got dtype=torch.int64"):
        car(torch.arange(8))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, got list"):
        car([1.0])
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        car(torch.randn(4, 4).t())
    car(torch.randn(16))
    with pytest.raises(ValueError, match="tensor has 17 elements but this CompressedAllReduce was sized for 16"):
        car(torch.randn(17))
    with pytest.raises(ValueError, match="tensor is on meta but this CompressedAllReduce works on cpu"):
        car(torch.empty(16, device="meta"))
    with pytest.raises(ValueError, match="out must have 16 elements on cpu, got 3"):
        car(torch.randn(16), out=torch.empty(3))
    with pytest.raises(ValueError, match="unknown compressor 'bogus'"):
        comm.CompressedAllReduce("bogus")
    with pytest.raises(ValueError, match="timeout must be positive, got -1"):
        comm.CompressedAllReduce("sign", timeout=-1)
    with pytest.raises(TypeError, match="error_feedback must be a bool, got 'yes'"):
        comm.CompressedAllGather("topk", error_feedback="yes")
    with pytest.raises(TypeError, match="group must be a process group, an MPIGroup or one of .* got 3"):
        comm.CompressedAllReduce("sign", 3)
    with pytest.raises(ValueError, match=r"group must be .* one of \('torch', 'mpi'\), got 'nccl'"):
        onebit.OnebitAdam([torch.nn.Parameter(torch.ones(3))], group="nccl")
