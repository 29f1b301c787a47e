"""0/1 Adam against AdamW and 1-bit Adam on the convergence benchmark's tasks, with paired seeds,
and where its cost comes from.

Every cell trains the task's model from the same weights on the same per-rank batches (those of
``onebit bench convergence``) for ``--steps`` steps on ``--world`` gloo ranks, once per seed:

=========================  ==================================================================
cell                       what it isolates
=========================  ==================================================================
``adamw``                  the counterpart (1-bit Adam that never freezes: exact AdamW)
``onebit_adam``            1-bit Adam, frozen at ``--freeze`` of the run
``zero_one_adam_exact``    0/1 Adam's variance schedule alone: ``compressor="identity"``, no
                           local steps (``local_step_clipper=1``)
``zero_one_adam_no_local`` + the bits: 1-bit synchronisation from the first non-refresh step
``zero_one_adam``          + local steps: the registry's setting, the interval doubling every
                           ``T/4`` steps after the freeze at ``T`` (up to 16)
=========================  ==================================================================

``--report`` prints, from the results file, each cell's held-out loss, its gap to AdamW as the
mean over seeds of the paired gap with a 95% t-interval, the bytes each rank sent and the
exchange rounds (steps that sent more than the step's agreement)::

    OMP_NUM_THREADS=1 python benchmarks/zero_one_adam.py --tasks gpt,byte_mlp --seeds 0,1,2 \\
        --out benchmarks/results/zero-one-adam/results.jsonl
    python benchmarks/zero_one_adam.py --report --out benchmarks/results/zero-one-adam/results.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from onebit.bench._analysis import mean_interval
from onebit.bench._convergence import ConvergenceTask, measure_training
from onebit.bench._matrix import VARIANTS
from onebit.launch import spawn

from _records import append_row, provenance, provenance_note, read_rows
from onebit.optim import REGISTRY, make_optimizer

# cell -> (registry name, arguments beyond its freeze): the convergence matrix's, and the two ablations
CELLS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": VARIANTS["adamw"],
    "onebit_adam": VARIANTS["onebit_adam"],
    "zero_one_adam_exact": ("zero_one_adam", {"compressor": "identity", "local_step_clipper": 1}),
    "zero_one_adam_no_local": ("zero_one_adam", {"local_step_clipper": 1}),
    "zero_one_adam": VARIANTS["zero_one_adam"],
}


def _cell(rank: int, world: int, task_name: str, cell: str, seed: int, steps: int, batch: int, lr: float,
          freeze: float, cosine: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    task = ConvergenceTask(task_name, rank, world)
    torch.manual_seed(seed)
    model = task.model()
    entry, extra = CELLS[cell]
    t = max(1, round(freeze * steps))
    opt = make_optimizer(entry, list(model.parameters()), lr=lr, **{**REGISTRY[entry].freeze(t), **extra})
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if cosine else None
    rounds = 0

    def update(loss: torch.Tensor, step: int) -> None:
        nonlocal rounds
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rounds += opt.stats["stage"] != "local"
        if schedule is not None:
            schedule.step()

    run = measure_training(task, model, update, steps=steps, batch=batch, seed=seed, rank=rank)
    opt.check_replicas()  # every run ends on a synchronised step, or compares the anchors
    return {"task": task_name, "cell": cell, "seed": seed, "lr": lr, "steps": steps, "world_size": world,
            "freeze_step": t, "cosine": cosine, "heldout_loss": run["heldout_loss"], "final_loss": run["final_loss"],
            "first_nonfinite_step": run["first_nonfinite_step"], "skipped_steps": opt.stats["skipped_steps"],
            "bytes_sent_per_rank": opt.stats["bytes_sent_total"], "exchange_rounds": rounds,
            "losses": run["losses"]}


def report(rows: list[dict[str, Any]]) -> str:
    """Per task and cell: held-out loss (mean), paired gap to AdamW (mean +- 95%), bytes, rounds."""
    def key(r: dict[str, Any]) -> tuple[str, int, bool]:
        return r["task"], r["steps"], r.get("cosine", False)

    base = {(*key(r), r["seed"]): r for r in rows if r["cell"] == "adamw"}
    lines = ["| task | steps | cell | seeds | held-out loss | gap to AdamW, mean ± 95% | MB sent per rank "
             "| exchange rounds |", "|---|---|---|---|---|---|---|---|"]
    for run in dict.fromkeys(key(r) for r in rows):
        task, steps, cosine = run
        for cell in CELLS:
            mine = [r for r in rows if key(r) == run and r["cell"] == cell and (*run, r["seed"]) in base]
            if not mine:
                continue
            gaps = [100 * (r["heldout_loss"] / base[(*run, r["seed"])]["heldout_loss"] - 1) for r in mine]
            mean, half = mean_interval(gaps)
            gap = "—" if cell == "adamw" else f"{mean:+.1f}% ± {half:.1f}"
            lines.append(f"| `{task}` | {steps}{', cosine' if cosine else ''} | {cell} | {len(mine)} "
                         f"| {statistics.fmean(r['heldout_loss'] for r in mine):.4f} "
                         f"| {gap} | {statistics.fmean(r['bytes_sent_per_rank'] for r in mine) / 1e6:.1f} "
                         f"| {statistics.fmean(r['exchange_rounds'] for r in mine):.0f} |")
    return "\n".join(lines) + "\n\n" + provenance_note(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="gpt,byte_mlp")
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--freeze", type=float, default=0.2, help="freeze point, a fraction of --steps")
    p.add_argument("--cosine", action="store_true", help="decay the learning rate to 0 on a cosine")
    p.add_argument("--out", required=True)
    p.add_argument("--report", action="store_true", help="print the table of --out and exit")
    args = p.parse_args()
    out = Path(args.out)
    if not args.report:
        out.parent.mkdir(parents=True, exist_ok=True)
        for seed in (int(s) for s in args.seeds.split(",")):
            for task in args.tasks.split(","):
                for cell in args.cells.split(","):
                    row = spawn(_cell, args.world, task, cell, seed, args.steps, args.batch_size, args.lr,
                                args.freeze, args.cosine, timeout=None)[0]
                    print(f"{task} seed {seed} {cell}: held-out {row['heldout_loss']:.4f}, "
                          f"{row['bytes_sent_per_rank'] / 1e6:.1f} MB, {row['exchange_rounds']} rounds", flush=True)
                    append_row(out, {**row, **provenance("OMP_NUM_THREADS=1 python")})
    print(report(read_rows(out)))


if __name__ == "__main__":
    main()
