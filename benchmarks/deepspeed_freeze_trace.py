"""The first compressed steps of 1-bit Adam, step by step, in DeepSpeed 0.19.6 and in onebit.

Why ``from_deepspeed_config``'s 1-bit Adam with ``clip_update=None`` diverged on ``digits``
(DeepSpeed's own setting: ``bias_correction=False``, clipping at 1.0): both sides train the
same model on the same batches; each step records the largest parameter change of each
tensor, the training loss, and (at the freeze) how many values have a variance of exactly
zero. One JSON object per run is appended to ``--out``; ``--report FILE`` prints the table::

    OMP_NUM_THREADS=1 "$HOME/ds-venv/bin/torchrun" --standalone --nproc_per_node 3 \\
        benchmarks/deepspeed_freeze_trace.py --side deepspeed --seed 0 --out trace.jsonl
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 3 \\
        benchmarks/deepspeed_freeze_trace.py --side onebit --seed 0 --clip-update none --out trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from _deepspeed_sides import SIDES, build, start
from _records import append_row, provenance, read_rows

parser = argparse.ArgumentParser()
parser.add_argument("--report", metavar="FILE", help="print the table of FILE's runs and exit")
parser.add_argument("--side", choices=SIDES)
parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "deepspeed_configs", "onebit_adam.json"))
parser.add_argument("--task", default="digits")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--steps", type=int, default=90)
parser.add_argument("--clip-update", default="10", help="onebit side: clip_update ('none': no clip)")
parser.add_argument("--out")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()


def report(rows: list[dict]) -> str:
    lines = ["| side | clip_update | seed | values with v = 0 / 0 < sqrt(v) < 1e-6 at the freeze "
             "| largest step, warm-up (last 20) | largest step, first 10 compressed | largest loss after the freeze |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["side"], str(r["clip_update"]), r["seed"])):
        lines.append(f"| {r['side']} | {r['clip_update']} | {r['seed']} | {r['zero_variance']} / {r['tiny_variance']} "
                     f"| {r['warmup_step_max']:.3g} | {r['compressed_step_max']:.3g} | {r['loss_max_after']:.3g} |")
    first = rows[0]
    lines.append(f"\n{first['task']}, {first['world_size']} gloo ranks, freeze after step {first['freeze_step']}; "
                 f"{first['machine']}, {first['date']}.")
    return "\n".join(lines)


if args.report:
    print(report(read_rows(args.report)))
    sys.exit(0)
if args.side is None or args.out is None:
    parser.error("--side and --out are required (or --report)")
config = json.loads(Path(args.config).read_text())
freeze = config["optimizer"]["params"]["freeze_step"]
clip = None if args.clip_update.lower() == "none" else float(args.clip_update)

dist = start(args.side)

from onebit.bench._convergence import ConvergenceTask  # noqa: E402

rank, world = dist.get_rank(), dist.get_world_size()
task = ConvergenceTask(args.task, rank, world)
torch.manual_seed(args.seed)
model = task.model()
params = list(model.parameters())
opt, forward, update = build(args.side, config, model, **({} if args.side == "deepspeed" else {"clip_update": clip}))

gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
steps, losses, zero_variance, tiny_variance = [], [], None, None
for step in range(1, args.steps + 1):
    before = [p.detach().clone() for p in params]
    loss = task.loss(forward, 32, gen)
    update(loss)
    steps.append(max((p.detach() - b).abs().max().item() for p, b in zip(params, before)))
    losses.append(loss.item())
    if step == freeze:  # DeepSpeed keeps exp_avg_sq; onebit holds sqrt(v) + eps as frozen_denom
        eps = config["optimizer"]["params"]["eps"]
        roots = torch.cat([(opt.state[p]["exp_avg_sq"].sqrt() if args.side == "deepspeed"
                            else opt.state[p]["frozen_denom"] - eps).reshape(-1) for p in params])
        zero_variance, tiny_variance = int((roots == 0).sum()), int(((roots > 0) & (roots < 1e-6)).sum())
if rank == 0:
    row = {"side": args.side, "clip_update": clip if args.side == "onebit" else "—", "task": args.task,
           "seed": args.seed, "world_size": world, "freeze_step": freeze, "zero_variance": zero_variance,
           "tiny_variance": tiny_variance,
           "warmup_step_max": max(steps[freeze - 20 : freeze]), "compressed_step_max": max(steps[freeze : freeze + 10]),
           "loss_max_after": max(losses[freeze:]), "steps": steps, "losses": losses,
           **provenance("torchrun --nproc_per_node 3")}
    append_row(args.out, row)
