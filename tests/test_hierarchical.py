import hashlib
import logging

import pytest
import torch

from _harness import run_ranks
from _oracle import SimulatedCompressedAllReduce, chunks
from onebit import comm, compress


def _inputs(world: int, n: int, step: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(7919 * step + r)) for r in range(world)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _hier_worker(rank, world, n, per_node, steps):
    car = comm.HierarchicalAllReduce("sign", ranks_per_node=per_node)
    flagged = comm.HierarchicalAllReduce("sign", ranks_per_node=per_node, flag_nonfinite=True)
    flat = comm.CompressedAllReduce("sign")
    outs, flat_outs, links, flags = [], [], [], []
    for step in range(steps):
        x = _inputs(world, n, step)[rank]
        with comm.measure() as m:
            outs.append(car(x))
        links.append(dict(m.by_link))
        flat_outs.append(flat(x))
        assert torch.equal(comm.run_stages(flagged.stages(x)), outs[-1])
        flags.append(bool(flagged.nonfinite))
    if rank == world - 1:
        x[0] = float("nan")  # in the first shard, which another node member reduces
    flagged(x)
    flags.append(bool(flagged.nonfinite))
    return {"outs": outs, "flat": flat_outs, "digests": [_digest(y) for y in outs], "links": links,
            "state": car.state_dict(), "flags": flags}


class SimulatedHierarchical:
    """Birder section 4 for nodes x per_node workers: node averages of each shard in fp32,
    then one simulated 1-bit all-reduce (Algorithm 1 of 1-bit Adam) per shard among the nodes."""

    def __init__(self, nodes: int, per_node: int, numel: int, align: int = 8, segments: list[int] | None = None):
        self.nodes, self.per_node = nodes, per_node
        self.shards = chunks(numel, per_node, align * nodes)
        self.inner = [SimulatedCompressedAllReduce(nodes, hi - lo, align=align,
                                                   segments=[s - lo for s in segments or [] if lo < s < hi])
                      for lo, hi in self.shards]

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        out = []
        for (lo, hi), inner in zip(self.shards, self.inner):
            node_avgs = []
            for k in range(self.nodes):
                members = xs[k * self.per_node : (k + 1) * self.per_node]
                total = members[0][lo:hi].clone()
                for x in members[1:]:
                    total += x[lo:hi]
                node_avgs.append(total / self.per_node)
            out.append(inner(node_avgs))
        return torch.cat(out)


def test_two_nodes_of_two_match_the_oracle_and_send_fewer_inter_node_bytes():
    world, per_node, n, steps = 4, 2, 100_003, 3
    res = run_ranks(_hier_worker, world, n, per_node, steps)
    oracle = SimulatedHierarchical(world // per_node, per_node, n)
    for step in range(steps):
        assert len({r["digests"][step] for r in res}) == 1, "ranks disagree"
        expect = oracle(_inputs(world, n, step))
        assert torch.allclose(res[0]["outs"][step], expect, rtol=1e-5, atol=1e-7)
    sign = compress.get("sign")
    inner_chunk = chunks(chunks(n, per_node, 16)[0][1], 2, 8)[0][1]
    flat_chunk = chunks(n, world, 8)[0][1]
    for r in res:
        links = r["links"][0]
        assert set(links) == {"intra", "inter"}
        assert links["inter"] == 2 * (2 - 1) * sign.wire_bytes(inner_chunk)
        # Flat scheme: each rank's all-to-all and all-gather reach the (world - per_node) ranks on the other node.
        flat_inter = 2 * (world - per_node) * sign.wire_bytes(flat_chunk)
        assert links["inter"] * 1.9 < flat_inter, (links["inter"], flat_inter)
        # flag_nonfinite, staged: the same bits; a NaN on the last rank reaches every rank's flag
        assert r["flags"] == [False] * steps + [True]


def _segmented_worker(rank, world, n, per_node, segments, steps):
    car = comm.HierarchicalAllReduce("sign", ranks_per_node=per_node, segments=segments)
    outs = []
    for step in range(steps):
        x = _inputs(world, n, step)[rank]
        x[:1_000] *= 1000.0
        outs.append(car(x))
    return outs


def test_segmented_scales_match_the_oracle_on_every_shard():
    world, per_node, n, steps = 4, 2, 10_003, 3
    segments = [0, 1_000, 1_003, 2_600, 5_010, 7_777]  # pieces in both shards, off the byte grid
    res = run_ranks(_segmented_worker, world, n, per_node, segments, steps)
    oracle = SimulatedHierarchical(world // per_node, per_node, n, segments=segments)
    for step in range(steps):
        xs = _inputs(world, n, step)
        for x in xs:
            x[:1_000] *= 1000.0
        expect = oracle(xs)
        assert all(torch.equal(r[step], res[0][step]) for r in res), "ranks disagree"
        assert torch.allclose(res[0][step], expect, rtol=1e-5, atol=1e-7), (res[0][step] - expect).abs().max()


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_per_node_equals_the_flat_scheme(world):
    res = run_ranks(_hier_worker, world, 10_001, 1, 3)
    for r in res:
        for hier, flat in zip(r["outs"], r["flat"]):
            assert torch.equal(hier, flat)
        assert "intra" not in r["links"][0]
        assert r["flags"] == [False] * 3 + [True]


def test_one_node_sends_nothing_between_nodes_and_averages():
    world, n = 3, 9_999
    res = run_ranks(_hier_worker, world, n, world, 2)
    assert len({r["digests"][1] for r in res}) == 1
    for r in res:
        assert set(r["links"][0]) == {"intra"}
        assert r["flags"] == [False] * 2 + [True]
    # One quantisation of the exact average per shard: sign * rms of each shard.
    exact = torch.stack(_inputs(world, n, 0)).mean(0)
    got = res[0]["outs"][0]
    for lo, hi in chunks(n, world, 8):
        assert torch.equal(torch.signbit(got[lo:hi]), torch.signbit(exact[lo:hi]))


def test_layout_change_warns_and_resets(caplog):
    car = comm.HierarchicalAllReduce("sign", ranks_per_node=1)
    car(torch.randn(100))
    state = car.state_dict()
    state = {**state, "ranks_per_node": 2}
    with caplog.at_level(logging.WARNING):
        car.load_state_dict(state)
    assert "re-created as zeros" in caplog.text
    assert car.state_dict()["inter"]["worker_error"]["error"] is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="ranks_per_node=0"):
        comm.HierarchicalAllReduce("sign", ranks_per_node=0)
    with pytest.raises(TypeError, match="ranks_per_node"):
        comm.HierarchicalAllReduce("sign", ranks_per_node="2")
    with pytest.raises(ValueError, match="hierarchical must be"):
        comm.compressed_allreduce("sign", hierarchical="yes")


def _optimizers_worker(rank, world, per_node):
    from _problem import run_problem

    from onebit.optim import REGISTRY, make_optimizer

    out = {}
    for name in _WARMED_UP:
        for mode in (True, False):
            kw = dict(REGISTRY[name].test_kwargs, hierarchical=mode, ranks_per_node=per_node)
            res = run_problem(lambda p: make_optimizer(name, p, **kw), rank, 8)
            out[name, mode] = (res["digests"], [s["stage"] for s in res["stats"]])
    return out


# The registry's optimizers with an exact warm-up (or 0/1 Adam's refreshes) that take hierarchical=
_WARMED_UP = ("onebit_adam", "onebit_lamb", "zero_one_adam")


def test_optimizers_with_a_warm_up_accept_the_hierarchical_exchange():
    from onebit.optim import REGISTRY

    assert set(_WARMED_UP) == {n for n, s in REGISTRY.items() if s.hierarchical and s.freeze is not None}
    res = run_ranks(_optimizers_worker, 4, 2)
    for key in res[0]:
        assert len({tuple(r[key][0]) for r in res}) == 1, f"replicas differ for {key}"
        assert res[0][key][1][-1] == "compressed"
    # Same exact steps, different compressed exchange.
    for name, exact in (("onebit_adam", 2), ("zero_one_adam", 2)):
        assert res[0][name, True][0][:exact] == res[0][name, False][0][:exact]
        assert res[0][name, True][0][-1] != res[0][name, False][0][-1]
    # One rank per node: exactly the flat exchange.
    flat = run_ranks(_optimizers_worker, 2, 1)
    for r in flat:
        for name in _WARMED_UP:
            assert r[name, True] == r[name, False]
