"""Comp-AMS on ``gpt`` after 300 steps: AMSGrad's preconditioner ``sqrt(v_hat)`` and the step it
allows, ``|m| / sqrt(v_hat)``, with and without error feedback, for Top-k 1% and Block-Sign.

Where the convergence matrix shows a gap, this says whether it is a matter of step size (a
preconditioner inflated by the compressed gradients) or of direction. One JSON object per
optimizer is appended to ``--out``; ``--report FILE`` prints the table::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 3 benchmarks/comp_ams_trace.py \\
        --out benchmarks/results/convergence-comp-ams-gpt/trace.jsonl
    python benchmarks/comp_ams_trace.py --report benchmarks/results/convergence-comp-ams-gpt/trace.jsonl
"""

from __future__ import annotations

import argparse
import sys

import torch
from _records import append_row, provenance, read_rows

RUNS = (("amsgrad", "comp_ams", {"compressor": "none"}), ("block_sign", "comp_ams_block_sign", {}),
        ("block_sign_no_ef", "comp_ams_block_sign", {"error_feedback": False}), ("topk", "comp_ams", {}),
        ("topk_no_ef", "comp_ams", {"error_feedback": False}))

parser = argparse.ArgumentParser()
parser.add_argument("--report", metavar="FILE")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out")
args = parser.parse_args()

if args.report:
    rows = read_rows(args.report)
    print("| run | held-out loss | median sqrt(v_hat) | median step abs(m)/sqrt(v_hat) | mean step |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['heldout_loss']:.4f} | {r['median_sqrt_vhat']:.3g} | {r['median_step']:.3g} "
              f"| {r['mean_step']:.3g} |")
    print(f"\ngpt, lr 3e-3, {rows[0]['steps']} steps, 3 gloo ranks, seed {rows[0]['seed']}; `{rows[0]['command']}`; "
          f"{rows[0]['machine']}, {rows[0]['date']}.")
    sys.exit(0)

import torch.distributed as dist  # noqa: E402

from onebit.bench._convergence import ConvergenceTask, measure_training  # noqa: E402
from onebit.optim import make_optimizer  # noqa: E402

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
task = ConvergenceTask("gpt", rank, world)
for name, entry, kw in RUNS:
    torch.manual_seed(args.seed)
    model = task.model()
    opt = make_optimizer(entry, list(model.parameters()), lr=3e-3, **kw)

    def update(loss: torch.Tensor, step: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    run = measure_training(task, model, update, steps=args.steps, batch=32, seed=args.seed, rank=rank)
    root = opt.flat.buffers["max_exp_avg_sq"].sqrt()
    step = opt.flat.buffers["exp_avg"].abs() / (root + 1e-8)
    if rank == 0 and args.out:
        row = {"name": name, "heldout_loss": run["heldout_loss"], "median_sqrt_vhat": root.median().item(),
               "median_step": step.median().item(), "mean_step": step.mean().item(), "steps": args.steps,
               "seed": args.seed, **provenance("torchrun --nproc_per_node 3")}
        append_row(args.out, row)
