"""HSDP on an emulated cluster of 2 nodes x 2 ranks: the step with onebit's 1-bit exchange between
nodes against FSDP2's own HSDP (fp32 all-reduce between nodes), and the floor without it.

The runs of each bandwidth (``--variants``), the same model, batches and FSDP2 sharding inside
each node:

- ``floor``: ``fully_shard`` on the node's mesh and ``torch.optim.AdamW``; nothing crosses the
  nodes (the replicas drift apart: a time, not a training run).
- ``fsdp2_hsdp``: ``fully_shard`` on the 2-D mesh (HSDP) and ``torch.optim.AdamW``: what users run.
- ``onebit_adam``: ``fully_shard`` on the node's mesh and ``onebit.OnebitAdam(group=mesh["replicate"]
  .get_group())``, frozen after step 1, so every timed step is a compressed one.
- ``onebit_lamb``: the same with ``onebit.OnebitLamb`` (its layer-wise norms reduced inside the node).

Per step: the median wall time over the timed steps, and the bytes leaving node 0 (its
interface's transmit counter, ``/proc/net/dev``) -- intra-node traffic never crosses it. A
figure counts only if the run took every step (``skipped_steps == 0``) and its loss is finite::

    sudo python benchmarks/hsdp_step.py --bandwidth 1gbit,100mbit --out benchmarks/results/hsdp/step.jsonl
    python benchmarks/hsdp_step.py --report benchmarks/results/hsdp/step.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _records import append_row, provenance, read_rows
from torch import nn

VARIANTS = ("floor", "fsdp2_hsdp", "onebit_adam", "onebit_lamb")


def _tx_bytes(interface: str = "eth0") -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            return int(fields.split()[8])
    return 0


def _rank(rank: int, world: int, variant: str, size: int, layers: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import onebit
    from onebit.bench._memory import WIRE_ALLOWANCE, held_bytes
    from onebit.optim import REGISTRY

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(size, size), nn.Tanh())])
    shard_on = mesh if variant == "fsdp2_hsdp" else mesh["shard"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=shard_on)
    fully_shard(model, mesh=shard_on)
    onebit_variant = variant.startswith("onebit_")
    if onebit_variant:
        opt = onebit.optim.make_optimizer(variant, model.parameters(), lr=1e-4, freeze_step=1,
                                          group=mesh["replicate"].get_group())
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    times, losses, tx = [], [], 0
    for step in range(warmup + steps):
        x = torch.randn(32, size, generator=gen)
        if step == warmup:
            dist.barrier()
            tx = _tx_bytes()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    dist.barrier()
    sent = _tx_bytes() - tx
    # the optimizer's state and wire buffers on this rank, against its footprint of its shard
    held = held_bytes(opt) if onebit_variant else None
    shard = 4 * sum(p.to_local().numel() for p in model.parameters())
    return {"step_s": statistics.median(times[warmup:]), "node_tx_bytes_per_step": sent / steps,
            "held_bytes": held, "shard_bytes": shard,
            "state_target_bytes": (REGISTRY[variant].footprint(2) + WIRE_ALLOWANCE) * shard if onebit_variant else None,
            "finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
            "skipped_steps": opt.stats["skipped_steps"] if onebit_variant else 0,
            "params": sum(p.numel() for p in model.parameters())}


def report(rows: list[dict]) -> str:
    lines = ["| bandwidth between nodes | run | step (ms) | vs FSDP2 HSDP | vs floor | bytes leaving a node per step "
             "| skipped steps |", "|---|---|---|---|---|---|---|"]
    for bw in dict.fromkeys(r["bandwidth"] for r in rows):
        runs = {r["variant"]: r for r in rows if r["bandwidth"] == bw}
        for variant in VARIANTS:
            r = runs.get(variant)
            if r is None:
                continue
            counts = r["finite"] and r["skipped_steps"] == 0
            lines.append(
                f"| {bw} | {variant} | {1e3 * r['step_s']:.1f} | {runs['fsdp2_hsdp']['step_s'] / r['step_s']:.2f}x "
                f"| {runs['floor']['step_s'] / r['step_s']:.2f}x | {r['node_tx_bytes_per_step'] / 1e6:.2f} MB "
                f"| {r['skipped_steps']}{'' if counts else ' (does not count)'} |")
    for variant in VARIANTS:
        held = [r for r in rows if r["variant"] == variant and r.get("held_bytes")]
        if held:
            r = held[0]
            met = "met" if r["held_bytes"] <= r["state_target_bytes"] else "missed"
            lines.append(f"\nOptimizer state on a rank ({variant}): {r['held_bytes'] / 1e6:.2f} MB for a shard of "
                         f"{r['shard_bytes'] / 1e6:.2f} MB of fp32 parameters ({r['held_bytes'] / r['shard_bytes']:.2f} "
                         f"shard sizes); target, its footprint at 2 replicas plus the wire buffers: "
                         f"{r['state_target_bytes'] / 1e6:.2f} MB ({met}).")
    first = rows[0]
    lines.append(f"\n{first['params'] / 1e6:.1f}M parameters ({first['layers']} x Linear({first['size']}, "
                 f"{first['size']})), batch 32 per rank, 2 nodes x 2 gloo ranks, median of {first['steps']} steps; "
                 f"`{first['command']}`; {first['machine']}, {first['date']}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", metavar="FILE", help="print the table of FILE's runs and exit")
    parser.add_argument("--bandwidth", default="1gbit,100mbit", help="comma-separated egress rates per node")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after 3 untimed)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated runs (default: all)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.report:
        print(report(read_rows(args.report)))
        return
    if not args.out:
        parser.error("--out is required (or --report)")
    from onebit.bench._cluster import ClusterSpec, EmulatedCluster, parse_bandwidth
    from onebit.launch import spawn

    for bw in args.bandwidth.split(","):
        with EmulatedCluster(ClusterSpec(2, parse_bandwidth(bw))) as cluster:
            for variant in args.variants.split(","):
                res = spawn(_rank, 4, variant, args.size, args.layers, args.steps, 3, placement=cluster.placement(4),
                            timeout=600)
                row = {"bandwidth": bw, "variant": variant, "size": args.size, "layers": args.layers,
                       "steps": args.steps, **res[0], "step_s": max(r["step_s"] for r in res), **provenance()}
                print(json.dumps({k: row[k] for k in ("bandwidth", "variant", "step_s", "node_tx_bytes_per_step",
                                                      "skipped_steps")}), flush=True)
                append_row(args.out, row)


if __name__ == "__main__":
    main()
