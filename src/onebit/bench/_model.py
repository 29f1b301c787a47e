"""An alpha-beta cost model of each optimizer's per-step communication (``onebit model``).

The network is the emulated cluster's: ``nodes`` nodes of ``ranks_per_node`` ranks, each
node's egress a link of ``bandwidth`` bits/s and ``latency`` seconds per message; traffic
inside a node is free. A collective's time is ``alpha * messages + node_egress_bytes * 8 /
bandwidth``, where ``node_egress_bytes`` is what the busiest node must send:

* ring all-reduce of S bytes (gloo, NCCL; ``S`` = 4n, or 2n with ``value_bytes=2``): the ring crosses each node boundary once and
  every link carries ``2 (w - 1) / w * S``; ``2 (w - 1)`` messages.
* 1-bit compressed all-reduce (1-bit Adam section 6): an all-to-all in which each rank
  sends its ``w - R`` off-node slots of ``S / w`` bytes (``S`` = n/8 + scales), then a ring
  all-gather of the re-compressed slot: ``R (w - R) S / w + (w - 1) S / w``.
* hierarchical (Birder section 4): the same among the ``K`` nodes on each rank's shard
  ``S / R``; the intra-node phases are free: ``R ((K - 1) + (K - 1)) S / (R K)``.
* all-gather exchange (Comp-AMS): a ring all-gather of each rank's payload P: ``(w - 1) P``.

Compressed steps also pay the kernels: the fused error-feedback compression touches the
fp32 tensor ~3 times (``--kernel-gbps``, measured by ``onebit bench kernels``).
End-to-end speedup with a fraction ``f`` of uncompressed steps (the warm-up, or 0/1 Adam's
variance refreshes) and a fraction ``l`` of local steps that send nothing (0/1 Adam, whose
skipped rounds count as zero bytes and zero communication time; DiLoCo, whose ``H - 1`` inner
steps of every ``H = sync_every`` send nothing and whose synchronisation waits for its exchange;
streamed in ``P = fragments``, a synchronisation of 1 / P of the model every ``H / P`` steps,
each waiting only for what of its exchange ``delay`` steps of compute did not hide),
as in the papers:
``1 / (f + l / s_0 + (1 - f - l) / s)`` for compression-stage speedup ``s`` and ``s_0`` the
speedup of a step with no communication.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ._catalogue import BENCHMARKED

__all__ = ["COLLECTIVES", "ModelInput", "Prediction", "collective_cost", "predict", "rank_bytes"]


@dataclass(frozen=True)
class ModelInput:
    params: int
    world_size: int
    nodes: int
    bandwidth: float  # bits/s per node egress
    latency: float = 0.0  # seconds per message
    compute: float = 0.0  # seconds of forward + backward + update per step
    kernel_gbps: float = 4.5  # GB/s of the compression kernels (one CPU thread; `onebit model --device`)
    warmup_fraction: float = 0.15  # 1-bit Adam / LAMB steps before the freeze
    refresh_every: int | None = 8  # 1-bit Adam's bf16 variance refreshes after the freeze (its default; None: none)
    # 0/1 Adam's variance refreshes (fp32 all-reduce), which stop at its variance freeze: one step in 8
    # (its default max_refresh_interval) of the ~47% of the run before the freeze that leaves
    # local_fraction's 0.5 of local steps at H = 16 after it (the schedule without the bound: ~0.002)
    refresh_fraction: float = 0.06
    local_fraction: float = 0.5  # 0/1 Adam's local steps (the paper: up to 54% fewer rounds than 1-bit Adam)
    sync_every: int = 500  # DiLoCo's inner steps per synchronisation (H; the paper's and onebit.DiLoCo's default)
    fragments: int = 1  # DiLoCo's streamed fragments (P): a synchronisation every H / P steps, of 1 / P of the model
    delay: int = 0  # DiLoCo's steps a synchronisation stays in flight, hiding up to delay * compute of it
    topk_ratio: float = 0.01
    value_bytes: int = 4  # of the uncompressed gradient: 4 (fp32) or 2 (fp16 training, as the papers)

    def __post_init__(self) -> None:
        for name in ("params", "world_size", "nodes", "sync_every", "fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.sync_every % self.fragments:
            raise ValueError(f"sync_every={self.sync_every} must be a multiple of fragments={self.fragments}")
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) \
                or not 0 <= self.delay < self.sync_every // self.fragments:
            raise ValueError(f"delay must be an int in [0, sync_every / fragments), got {self.delay!r}")
        if self.world_size % self.nodes:
            raise ValueError(f"world_size={self.world_size} must be a multiple of nodes={self.nodes}")
        for name in ("bandwidth", "kernel_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("latency", "compute"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.value_bytes not in (2, 4):
            raise ValueError(f"value_bytes must be 2 or 4, got {self.value_bytes!r}")
        for name in ("warmup_fraction", "refresh_fraction", "local_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.refresh_every is not None and (isinstance(self.refresh_every, bool)
                                               or not isinstance(self.refresh_every, int) or self.refresh_every < 1):
            raise ValueError(f"refresh_every must be None or a positive int, got {self.refresh_every!r}")
        if self.refresh_fraction + self.local_fraction > 1:
            raise ValueError(f"refresh_fraction + local_fraction must be <= 1, got "
                             f"{self.refresh_fraction!r} + {self.local_fraction!r}")


@dataclass(frozen=True)
class Prediction:
    optimizer: str
    collective: str
    bytes_per_node: float  # busiest node's egress per compressed-stage step (DiLoCo: per synchronisation, its peak)
    mean_bytes_per_node: float  # busiest node's egress per step, averaged over the run
    comm_seconds: float
    step_seconds: float  # compressed-stage step (or the only stage)
    stage_speedup: float  # vs Adam's fp32 ring all-reduce step
    warmup_fraction: float  # of uncompressed steps (0/1 Adam: its refreshes)
    end_to_end_speedup: float
    volume_reduction: float  # bytes a rank sends over the whole run: Adam's / this optimizer's


def _ring_allreduce(m: ModelInput, nbytes: float) -> tuple[float, float]:
    w = m.world_size
    if w == 1:
        return 0.0, 0.0
    egress = 2 * (w - 1) / w * nbytes if m.nodes > 1 else 0.0
    return egress, 2 * (w - 1) * m.latency + egress * 8 / m.bandwidth


def _onebit_allreduce(m: ModelInput, hierarchical: bool) -> tuple[float, float]:
    w, k = m.world_size, m.nodes
    r = w // k
    packed = m.params / 8 + 4 * w  # signs plus one fp32 scale per chunk
    if k == 1:
        return 0.0, 0.0
    if hierarchical:
        egress = 2 * (k - 1) * packed / k
        messages = 2 * (k - 1)
    else:
        egress = r * (w - r) * packed / w + (w - 1) * packed / w
        messages = 2 * (w - 1)
    return egress, messages * m.latency + egress * 8 / m.bandwidth


def _allgather(m: ModelInput, payload: float) -> tuple[float, float]:
    w = m.world_size
    if m.nodes == 1:
        return 0.0, 0.0
    egress = (w - 1) * payload
    return egress, (w - 1) * m.latency + egress * 8 / m.bandwidth


COLLECTIVES = ("allreduce_full", "allreduce_fp32", "allreduce_fp16", "allreduce_8bit", "onebit", "onebit_hierarchical",
               "allgather_topk", "allgather_sign")


def collective_cost(kind: str, m: ModelInput) -> tuple[float, float]:
    """``(busiest node's egress bytes, seconds)`` of one collective of ``kind`` over ``m.params`` values."""
    n = m.params
    if kind == "allreduce_full":
        return _ring_allreduce(m, m.value_bytes * n)
    if kind == "allreduce_fp32":
        return _ring_allreduce(m, 4 * n)
    if kind == "allreduce_fp16":
        return _ring_allreduce(m, 2 * n)
    if kind == "allreduce_8bit":
        return _ring_allreduce(m, n)
    if kind in ("onebit", "onebit_hierarchical"):
        return _onebit_allreduce(m, kind == "onebit_hierarchical")
    if kind == "allgather_topk":
        return _allgather(m, 8 * math.ceil(m.topk_ratio * n))  # fp32 values + int32 indices
    if kind == "allgather_sign":
        return _allgather(m, n / 8 + 4)
    raise ValueError(f"unknown collective {kind!r}; available: {', '.join(COLLECTIVES)}")


def rank_bytes(kind: str, m: ModelInput) -> float:
    """Bytes one rank puts on the wire (any link) in one collective of ``kind`` -- what the byte
    meter counts and what the papers call communication volume."""
    n, w = m.params, m.world_size
    ring = 2 * (w - 1) / w
    packed = n / 8 + 4 * w
    if kind == "allreduce_full":
        return ring * m.value_bytes * n
    if kind == "allreduce_fp32":
        return ring * 4 * n
    if kind == "allreduce_fp16":
        return ring * 2 * n
    if kind == "allreduce_8bit":
        return ring * n
    if kind == "onebit":
        return ring * packed
    if kind == "onebit_hierarchical":
        r = w // m.nodes
        return (r - 1) / r * 4 * n + 2 * (m.nodes - 1) / m.nodes * packed / r + (r - 1) * packed / r
    if kind == "allgather_topk":
        return (w - 1) * 8 * math.ceil(m.topk_ratio * n)
    if kind == "allgather_sign":
        return (w - 1) * (n / 8 + 4)
    raise ValueError(f"unknown collective {kind!r}; available: {', '.join(COLLECTIVES)}")


def predict(m: ModelInput) -> list[Prediction]:
    """Per-step predictions for each optimizer, against Adam on a ring all-reduce of the full gradient."""
    kernels = 3 * 4 * m.params / (m.kernel_gbps * 1e9)
    full = f"ring all-reduce fp{8 * m.value_bytes}"
    # name (as `onebit train --optimizer`), collective, cost-model kind, kernel time, uncompressed and
    # local-step fractions (None: DiLoCo's, from its synchronisations): the uncompressed references,
    # then the registry's rows
    # 1-bit Adam's refreshes all-reduce the gradients in bf16: 2 / value_bytes of an uncompressed step's
    # bytes, counted as that share of one (the rest of the step as a compressed one's)
    refreshed = m.warmup_fraction + ((1.0 - m.warmup_fraction) / m.refresh_every * 2 / m.value_bytes
                                     if m.refresh_every else 0.0)
    exact = {None: (0.0, 0.0), "warmup": (m.warmup_fraction, 0.0), "warmup_refreshed": (refreshed, 0.0),
             "refresh": (m.refresh_fraction, m.local_fraction), "sync": (0.0, None)}
    rows = [(name, full, "allreduce_full", 0.0, 0.0, 0.0)
            for name in ("adam", "lamb", "amsgrad", "softsign_sgd", "ddp_allreduce")]
    rows.append(("ddp_fp16", "ring all-reduce fp16", "allreduce_fp16", 0.0, 0.0, 0.0))
    # DiLoCo as others ship it: prime's int8 and torchft's fp8 pseudo-gradients, one byte a value
    rows.append(("diloco_8bit", "ring all-reduce int8/fp8", "allreduce_8bit", 0.0, 0.0, None))
    rows += [(name, c.label, c.collective, c.kernels * kernels, *exact[c.exact])
             for row in BENCHMARKED.values() for name, c in row.costs.items()]
    # DiLoCo's synchronisations: 1 / P of the model each (streamed), every H / P steps, the other
    # steps local; each waits only for what its delay's inner steps did not hide
    fragment = dataclasses.replace(m, params=math.ceil(m.params / m.fragments))
    base_egress, base_seconds = collective_cost("allreduce_full", m)
    base_step = m.compute + base_seconds
    base_volume = rank_bytes("allreduce_full", m)
    out = []
    for name, collective, kind, kernel, warm, local in rows:
        size = m if local is not None else fragment
        egress, seconds = collective_cost(kind, size)
        if local is None:
            seconds = max(0.0, seconds - m.delay * m.compute)
            kernel, local = kernel / m.fragments, 1 - m.fragments / m.sync_every
        step = m.compute + seconds + kernel
        s = base_step / step if step > 0 else 1.0
        mean_step = warm * base_step + local * m.compute + (1.0 - warm - local) * step
        end_to_end = base_step / mean_step if mean_step > 0 else 1.0
        sent = warm + (1.0 - warm - local) * rank_bytes(kind, size) / base_volume if base_volume else 0.0
        volume = 1.0 / sent if sent > 0 else 1.0
        mean_egress = warm * base_egress + (1.0 - warm - local) * egress
        out.append(Prediction(name, collective, egress, mean_egress, seconds, step, s, warm, end_to_end, volume))
    return out
