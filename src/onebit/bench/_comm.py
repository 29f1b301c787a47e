"""Compressed collectives against plain ``all_reduce`` on the same ranks (targets P1, P2)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .. import comm
from ..launch import spawn
from ._model import ModelInput, collective_cost
from ._timing import median_seconds

__all__ = ["CommResult", "bench_comm", "link_check"]


@dataclass(frozen=True)
class CommResult:
    collective: str
    numel: int
    world_size: int
    seconds: float  # median over repeats, max over ranks
    bytes_sent: int  # per rank per call, from the byte meter
    inter_node_bytes: int | None  # bytes the meter labelled inter-node (hierarchical collective only)
    vs_fp32: float  # fp32 all_reduce time / this time
    ideal_seconds: float | None  # the busiest node's egress at the shaped rate (emulated cluster only)
    # Mean seconds per call of each phase of the compressed all-reduce (compress, all_to_all,
    # server, all_gather, decode), averaged over ranks; empty for the other collectives.
    phases: dict[str, float]
    # CPU seconds per call, mean over ranks: every thread of a rank's process, gloo's and the
    # kernel's work on its sockets as the system accounts it (what ranks sharing cores pay).
    cpu_seconds: float


def transformer_starts(numel: int, width: int = 256) -> list[int]:
    """Where the tensors of a GPT-style stack of width ``width`` start in a flat buffer of
    ``numel`` values (per block: attention's in and out projections with their biases, the MLP's
    two with theirs, two layer norms' weights and biases; 12 tensors, 12 width^2 + 13 width
    values), cut at ``numel``: the pieces a per-tensor scale gives one scale each."""
    d = width
    block = (3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d)
    starts, at = [], 0
    while at < numel:
        for size in block:
            if at >= numel:
                break
            starts.append(at)
            at += size
    return starts


def _rank_bench(rank: int, world: int, numel: int, repeat: int, per_node: int | None,
                group: comm.Group = None) -> dict[str, Any]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    out_buf = torch.empty_like(x)
    half = x.half()
    starts = transformer_starts(numel)
    # Every case works in place or into a reused buffer, as an optimizer step does.
    cases = {
        "all_reduce fp32": lambda: comm.all_reduce_mean(x, group),
        "all_reduce fp16": lambda: comm.all_reduce_mean(half, group),
    }
    collectives = {
        "compressed_allreduce sign": comm.CompressedAllReduce("sign", group),
        # the optimizers' default: one scale per tensor piece of each chunk
        "compressed_allreduce sign per-tensor": comm.CompressedAllReduce("sign", group, segments=starts),
        "allgather block_sign": comm.CompressedAllGather("block_sign", group),
        "allgather topk 1%": comm.CompressedAllGather("topk", group, ratio=0.01),
    }
    if per_node is not None and 1 < per_node < world:
        collectives["hierarchical_allreduce sign"] = comm.HierarchicalAllReduce("sign", group,
                                                                                ranks_per_node=per_node)
    for name, op in collectives.items():
        cases[name] = lambda op=op: op(x, out=out_buf)
    # The same exchange in 4 pieces whose phases overlap (comm.run_pipelined): a piece's all-to-all
    # is on the link while the one before is averaged, as the overlapped optimizers' buckets.
    cuts = [numel * i // _PIECES for i in range(_PIECES + 1)]
    pieces = [(comm.CompressedAllReduce("sign", group, segments=[s - lo for s in starts if lo <= s < hi]), lo, hi)
              for lo, hi in zip(cuts, cuts[1:])]
    cases[_PIPELINED] = lambda: comm.run_pipelined([op.stages(x[lo:hi], out_buf[lo:hi]) for op, lo, hi in pieces])
    out = {}
    for name, call in cases.items():
        with comm.measure(phases=True) as meter:
            call()
        comm.barrier(group)
        cpu = time.process_time()
        seconds = median_seconds(lambda: (call(), comm.barrier(group)), repeat, warmup=_WARMUP)
        cpu = (time.process_time() - cpu) / (repeat + _WARMUP)
        phases = {}
        if meter.phases:  # a collective with phases: timed apart, so their device syncs stay out of the median
            with comm.measure(phases=True) as timed:
                for _ in range(repeat):
                    call()
            comm.barrier(group)
            phases = {k: v / repeat for k, v in timed.phases.items()}
        out[name] = (seconds, meter.bytes_sent, meter.by_link.get("inter"), phases, cpu)
    return out


def _this_mpi_rank(numel: int, repeat: int) -> list[dict[str, Any]] | None:
    """Run the cases as this rank of the MPI job; rank 0 gets them with each time the
    maximum over ranks, the other ranks ``None``."""
    rank, world = comm.get_rank("mpi"), comm.get_world_size("mpi")
    mine = _rank_bench(rank, world, numel, repeat, None, "mpi")
    slowest = comm.all_reduce_max(torch.tensor([t for t, *_ in mine.values()], dtype=torch.float64), "mpi")
    cpu = comm.all_reduce_mean(torch.tensor([c for *_, c in mine.values()], dtype=torch.float64), "mpi")
    if rank:
        return None
    return [{name: (float(t), sent, inter, phases, float(c))
             for (name, (_, sent, inter, phases, _)), t, c in zip(mine.items(), slowest, cpu)}]


_WARMUP = 2  # untimed calls before the timed ones (their CPU time is counted with them)
_PIECES = 4
_PIPELINED = f"compressed_allreduce sign per-tensor, {_PIECES} pieces pipelined"
# Which cost-model collective each benchmark case runs.
_KINDS = {
    _PIPELINED: "onebit",
    "all_reduce fp32": "allreduce_fp32",
    "all_reduce fp16": "allreduce_fp16",
    "compressed_allreduce sign": "onebit",
    "compressed_allreduce sign per-tensor": "onebit",
    "hierarchical_allreduce sign": "onebit_hierarchical",
    "allgather block_sign": "allgather_sign",
    "allgather topk 1%": "allgather_topk",
}


def bench_comm(numel: int = 10_500_000, world_size: int = 2, repeat: int = 10, cluster=None,
               backend: str = "torch") -> list[CommResult] | None:
    """Run every collective on ``world_size`` gloo ranks (on ``cluster``'s nodes when given),
    or, with ``backend="mpi"``, over MPI as this rank of an mpirun job (rank 0 gets the
    results, the others ``None``); times include a barrier."""
    placement = per_node = model = None
    if cluster is not None:
        if backend == "mpi":
            raise ValueError("an emulated cluster places spawned ranks; under mpirun the job's own placement applies")
        placement = cluster.placement(world_size)
        per_node = world_size // cluster.spec.nodes
        model = ModelInput(params=numel, world_size=world_size, nodes=cluster.spec.nodes,
                           bandwidth=cluster.spec.bandwidth, topk_ratio=0.01)
    if backend == "mpi":
        per_rank = _this_mpi_rank(numel, repeat)
        if per_rank is None:
            return None
        world_size = comm.get_world_size("mpi")
    else:
        per_rank = spawn(_rank_bench, world_size, numel, repeat, per_node, placement=placement)
    base = max(r["all_reduce fp32"][0] for r in per_rank)
    results = []
    for name in per_rank[0]:
        seconds = max(r[name][0] for r in per_rank)
        _, sent, inter, _, _ = per_rank[0][name]
        ideal = collective_cost(_KINDS[name], model)[1] if model is not None and model.nodes > 1 else None
        phases = {k: sum(r[name][3].get(k, 0.0) for r in per_rank) / len(per_rank) for k in per_rank[0][name][3]}
        cpu = sum(r[name][4] for r in per_rank) / len(per_rank)
        results.append(CommResult(name, numel, world_size, seconds, sent, inter, base / seconds, ideal, phases, cpu))
    return results


def _link_rank(rank: int, world: int, numel: int) -> float:
    x = torch.ones(numel)
    comm.all_reduce_mean(x)  # connect
    comm.barrier()
    start = time.perf_counter()
    comm.all_reduce_mean(x)
    return time.perf_counter() - start


def link_check(cluster, megabytes: int) -> tuple[float, float]:
    """Gbit/s and seconds of a 2-rank fp32 all-reduce between node 0 and node 1 (each sends the whole buffer)."""
    numel = megabytes * 250_000
    placement = [(cluster.node(0), "eth0"), (cluster.node(1), "eth0")]
    seconds = max(spawn(_link_rank, 2, numel, placement=placement))
    return numel * 4 * 8 / seconds / 1e9, seconds
