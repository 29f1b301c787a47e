"""HSDP against the unsharded optimizer, on the convergence benchmark's tasks, with paired seeds.

Four gloo ranks, each with its own shard of the task's data (``ConvergenceTask(task, rank, 4)``),
the same batches in both runs of a seed:

- ``unsharded``: the optimizer on the whole model, exchanging over the 4 ranks;
- ``hsdp``: the model sharded by FSDP2 inside each "node" of 2 ranks (``fully_shard`` on the
  node's mesh), the optimizer exchanging each shard with its replica on the other node.

The two see the same global batch; they differ in what is compressed (each node's mean
gradient's shard between 2 replicas, against every rank's whole momentum between 4). One JSON
object per run is appended to ``--out``; ``--report FILE`` prints the mean paired gap of the
held-out loss with its 95% interval::

    python benchmarks/hsdp_convergence.py --tasks gpt,frozen_unused --seeds 4 \\
        --out benchmarks/results/hsdp/convergence.jsonl
    python benchmarks/hsdp_convergence.py --report benchmarks/results/hsdp/convergence.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch
from _records import append_row, provenance, read_rows


def _rank(rank: int, world: int, task_name: str, optimizer: str, layout: str, seed: int, steps: int,
          lr: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from onebit.bench._convergence import ConvergenceTask, measure_training
    from onebit.optim import REGISTRY, make_optimizer

    task = ConvergenceTask(task_name, rank, world)
    torch.manual_seed(seed)
    model = task.model()
    kw = {"lr": lr, **REGISTRY[optimizer].freeze(max(1, steps // 5))}
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        kw["group"] = mesh["replicate"].get_group()
    opt = make_optimizer(optimizer, list(model.parameters()), **kw)

    def update(loss: torch.Tensor, step: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    run = measure_training(task, model, update, steps=steps, batch=32, seed=seed, rank=rank)
    return {"heldout_loss": run["heldout_loss"], "final_loss": run["final_loss"],
            "first_nonfinite_step": run["first_nonfinite_step"], "skipped_steps": opt.stats["skipped_steps"]}


def report(rows: list[dict]) -> str:
    from onebit.bench._analysis import mean_interval

    lines = ["| optimizer | task | seeds | unsharded held-out | HSDP held-out | paired gap, mean ± 95% | per seed |",
             "|---|---|---|---|---|---|---|"]
    for optimizer, task in dict.fromkeys((r["optimizer"], r["task"]) for r in rows):
        runs = {(r["layout"], r["seed"]): r for r in rows if (r["optimizer"], r["task"]) == (optimizer, task)}
        seeds = sorted(s for layout, s in runs if layout == "hsdp" and ("unsharded", s) in runs)
        pairs = [(runs["unsharded", s]["heldout_loss"], runs["hsdp", s]["heldout_loss"]) for s in seeds]
        gaps = [100 * (b / a - 1) for a, b in pairs]
        mean, half = mean_interval(gaps)
        lines.append(f"| {optimizer} | `{task}` | {len(pairs)} | {sum(a for a, _ in pairs) / len(pairs):.4f} "
                     f"| {sum(b for _, b in pairs) / len(pairs):.4f} | {mean:+.1f}% ± {half:.1f} "
                     f"| {', '.join(f'{g:+.1f}' for g in gaps)} |")
    first = rows[0]
    lines.append(f"\n4 gloo ranks (HSDP: 2 nodes x 2), {first['steps']} steps, lr {first['lr']:g}, freeze after "
                 f"{first['steps'] // 5} steps; `{first['command']}`; {first['machine']}, {first['date']}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", metavar="FILE", help="print the paired comparison of FILE's runs and exit")
    parser.add_argument("--tasks", default="gpt,frozen_unused")
    parser.add_argument("--optimizer", default="onebit_adam")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.report:
        print(report(read_rows(args.report)))
        return
    if not args.out:
        parser.error("--out is required (or --report)")
    from onebit.launch import spawn

    for task in args.tasks.split(","):
        for seed in range(args.seeds):
            for layout in ("unsharded", "hsdp"):
                res = spawn(_rank, 4, task, args.optimizer, layout, seed, args.steps, args.lr, timeout=1200)[0]
                row = {"optimizer": args.optimizer, "task": task, "layout": layout, "seed": seed, "steps": args.steps,
                       "lr": args.lr, **res, **provenance()}
                print(json.dumps({k: row[k] for k in ("task", "layout", "seed", "heldout_loss", "skipped_steps")}),
                      flush=True)
                append_row(args.out, row)


if __name__ == "__main__":
    main()
