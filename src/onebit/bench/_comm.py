"""Compressed collectives against plain ``all_reduce`` on the same ranks (targets P1, P2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..launch import spawn
from ._timing import median_seconds

__all__ = ["CommResult", "bench_comm"]


@dataclass(frozen=True)
class CommResult:
    collective: str
    numel: int
    world_size: int
    seconds: float  # median over repeats, max over ranks
    bytes_sent: int  # per rank per call, from the byte meter
    vs_fp32: float  # fp32 all_reduce time / this time
    ideal_seconds: float | None  # bytes_sent / bandwidth, when a bandwidth is given


def _rank_bench(rank: int, world: int, numel: int, repeat: int) -> dict[str, tuple[float, int]]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    out_buf = torch.empty_like(x)
    half = x.half()
    # Every case works in place or into a reused buffer, as an optimizer step does.
    cases = {
        "all_reduce fp32": lambda: comm.all_reduce_mean(x),
        "all_reduce fp16": lambda: comm.all_reduce_mean(half),
    }
    for name, op in {
        "compressed_allreduce sign": comm.CompressedAllReduce("sign"),
        "allgather block_sign": comm.CompressedAllGather("block_sign"),
        "allgather topk 1%": comm.CompressedAllGather("topk", ratio=0.01),
    }.items():
        cases[name] = lambda op=op: op(x, out=out_buf)
    out = {}
    for name, call in cases.items():
        with comm.measure() as meter:
            call()
        dist.barrier()
        seconds = median_seconds(lambda: (call(), dist.barrier()), repeat)
        out[name] = (seconds, meter.bytes_sent)
    return out


def bench_comm(
    numel: int = 10_500_000, world_size: int = 2, repeat: int = 10, bandwidth_bits: float | None = None
) -> list[CommResult]:
    """Run every collective on ``world_size`` local gloo ranks; times include a barrier."""
    per_rank = spawn(_rank_bench, world_size, numel, repeat)
    base = max(r["all_reduce fp32"][0] for r in per_rank)
    results = []
    for name in per_rank[0]:
        seconds = max(r[name][0] for r in per_rank)
        sent = per_rank[0][name][1]
        ideal = sent * 8 / bandwidth_bits if bandwidth_bits else None
        results.append(CommResult(name, numel, world_size, seconds, sent, base / seconds, ideal))
    return results
