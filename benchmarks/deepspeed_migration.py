"""One DeepSpeed config, trained by DeepSpeed 0.19.6 and by ``onebit.from_deepspeed_config``.

The task, model, initial weights, per-rank shards and batches are those of ``onebit bench
convergence``; DeepSpeed's engine clips (``gradient_clipping``) and all-reduces in its
warm-up, onebit's optimizer does both itself. Run each side with its own environment::

    OMP_NUM_THREADS=1 "$HOME/ds-venv/bin/torchrun" --standalone --nproc_per_node 3 \\
        benchmarks/deepspeed_migration.py --side deepspeed --config benchmarks/deepspeed_configs/onebit_adam.json \\
        --task byte_mlp --out benchmarks/results/deepspeed-migration/results.jsonl
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 3 \\
        benchmarks/deepspeed_migration.py --side onebit --config ... (same flags)

DeepSpeed's first ``step()`` only initialises its buffers, so its runs make one update fewer;
``--skip-first-step`` makes onebit's run do the same, for a step-by-step comparison (0/1 Adam's
schedule then counts the skipped step too, as DeepSpeed's counter does: ``offset=1``).
One JSON object per run is printed and appended to ``--out``; ``--report FILE`` prints, per
config, task and set of overrides, onebit's held-out score against DeepSpeed's on the same seeds
(``digits``: the error rate, a gap in points; the other tasks: the loss, a gap in %): the mean
paired gap with its 95% interval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from _deepspeed_sides import SIDES, build, start
from _records import append_row, provenance, provenance_note, read_rows

parser = argparse.ArgumentParser()
parser.add_argument("--report", metavar="FILE", help="print the paired comparison of FILE's runs and exit")
parser.add_argument("--side", choices=SIDES)
parser.add_argument("--config",
                    help="a DeepSpeed JSON config with a OneBitAdam/OneBitLamb/ZeroOneAdam block")
parser.add_argument("--task", default="byte_mlp")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--freeze-step", type=int, default=None, help="override the config's freeze_step")
parser.add_argument("--lr", type=float, default=None, help="override the config's learning rate")
parser.add_argument("--override", action="append", default=[], metavar="NAME=JSON",
                    help="onebit side: a constructor override, e.g. clip_update=null (repeatable)")
parser.add_argument("--skip-first-step", action="store_true",
                    help="onebit side: no update at step 1, as DeepSpeed's first step() (which only allocates)")
parser.add_argument("--out")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()


def report(rows: list[dict]) -> str:
    from onebit.bench._analysis import mean_interval

    def setting(r: dict) -> tuple:  # what both sides ran: the config, task, length, freeze and learning rate
        return r["config"], r["task"], r["steps"], r["freeze_step"], r.get("lr")

    theirs = {(setting(r), r.get("seed", 0)): r for r in rows if r["side"] == "deepspeed"}
    # the result first (paired gap, worst seed): the columns a narrow page shows without scrolling
    lines = ["| config | task | steps, freeze, lr | onebit overrides | paired gap, mean ± 95% | worst seed | seeds "
             "| DeepSpeed held-out | onebit held-out | per seed |", "|---|---|---|---|---|---|---|---|---|---|"]
    groups = dict.fromkeys((setting(r), json.dumps(r["overrides"])) for r in rows if r["side"] == "onebit")
    for key, overrides in groups:
        mine = [r for r in rows if r["side"] == "onebit" and (setting(r), json.dumps(r["overrides"])) == (key, overrides)
                and (key, r.get("seed", 0)) in theirs]
        if not mine:
            continue
        # digits is scored by its held-out error rate (a gap in points), the others by held-out loss (in %)
        error = all("heldout_error" in r for r in mine)
        metric = "heldout_error" if error else "heldout_loss"
        pairs = [(theirs[(key, r.get("seed", 0))][metric], r[metric]) for r in mine]
        gaps = [b - a if error else 100 * (b / a - 1) for a, b in pairs]
        mean, half = mean_interval(gaps)
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        config, task, steps, freeze, lr = key
        unit, digits, score = (" pt", 2, lambda v: f"{v:.2f}% error") if error else ("%", 1, lambda v: f"{v:.4f}")
        lines.append(f"| {config} | `{task}` | {steps}, {freeze}, {'config' if lr is None else f'{lr:g}'} "
                     f"| {overrides if overrides != '{}' else '—'} "
                     f"| {mean:+.{digits}f}{unit} ± {half:.{digits}f} "
                     f"| {gaps[worst]:+.{digits}f} (seed {mine[worst].get('seed', 0)}) "
                     f"| {len(pairs)} | {score(sum(a for a, _ in pairs) / len(pairs))} "
                     f"| {score(sum(b for _, b in pairs) / len(pairs))} "
                     f"| {', '.join(f'{g:+.{digits}f}' for g in gaps)} |")
    return "\n".join(lines) + "\n\n" + provenance_note(rows)


if args.report:
    print(report(read_rows(args.report)))
    sys.exit(0)
if args.side is None or args.config is None or args.out is None:
    parser.error("--side, --config and --out are required (or --report)")
config = json.loads(Path(args.config).read_text())
if args.freeze_step is not None:
    config["optimizer"]["params"]["freeze_step"] = args.freeze_step
if args.lr is not None:
    config["optimizer"]["params"]["lr"] = args.lr
overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.override)}
batch = config["train_micro_batch_size_per_gpu"]

dist = start(args.side)

import onebit  # noqa: E402  (both sides: the task comes from onebit's benchmark)
from onebit.bench._convergence import ConvergenceTask, measure_training  # noqa: E402

rank, world = dist.get_rank(), dist.get_world_size()
task = ConvergenceTask(args.task, rank, world)
torch.manual_seed(args.seed)
model = task.model()
opt, forward, backward_and_step = build(args.side, config, model, **overrides)
if args.skip_first_step and isinstance(opt, onebit.ZeroOneAdam):
    s = opt.schedule  # DeepSpeed's refresh and synchronisation steps, counted from its no-op step
    opt._stages.schedule = onebit.optim.ZeroOneSchedule(s.var_freeze_step, s.var_update_scaler,
                                                        s.local_step_scaler, s.local_step_clipper,
                                                        max_refresh_interval=s.max_refresh_interval,
                                                        refresh_weight=s.refresh_weight, offset=1)


def update(loss: torch.Tensor, step: int) -> None:
    backward_and_step(loss, take_step=not (step == 1 and args.skip_first_step))


run = measure_training(task, model, update, steps=args.steps, batch=batch, seed=args.seed, rank=rank,
                       forward=forward)
if rank == 0:
    row = {"side": args.side, "config": Path(args.config).name, "optimizer": config["optimizer"]["type"],
           "task": args.task, "steps": args.steps, "world_size": world, "lr": config["optimizer"]["params"]["lr"],
           "freeze_step": config["optimizer"]["params"].get("freeze_step",
                                                             config["optimizer"]["params"].get("var_freeze_step")),
           "seed": args.seed, "skip_first_step": args.skip_first_step, "overrides": overrides,
           **run, **provenance(f"torchrun --standalone --nproc_per_node {world}")}
    print(json.dumps(row), flush=True)
    append_row(args.out, row)
