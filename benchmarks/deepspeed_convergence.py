"""DeepSpeed 0.19.6's OneBitAdam / OneBitLamb on the tasks of ``onebit bench convergence``.

Same model, initial weights, per-rank data shards, batches and held-out batches as onebit's
matrix (``onebit.bench._convergence``), so the two are comparable cell by cell. Run it in
a separate environment that has DeepSpeed 0.19.6 (see ../shared/reference/deepspeed-cpu)
and onebit installed without its dependencies::

    "$HOME/ds-venv/bin/pip" install --no-deps -e .
    OMP_NUM_THREADS=1 "$HOME/ds-venv/bin/torchrun" --standalone --nproc_per_node 3 \\
        benchmarks/deepspeed_convergence.py --task byte_mlp --out benchmarks/results/convergence/deepspeed.json

DeepSpeed's first ``step()`` only initialises its buffers, so its runs make one update fewer.
Results are appended to ``--out`` (one JSON object per line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--task", default="byte_mlp")
parser.add_argument("--optimizers", default="OneBitAdam,OneBitLamb")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--freeze-fraction", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference", "deepspeed-cpu"))
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from ds_cpu import apply_cpu_patches  # noqa: E402

from onebit.bench._convergence import FAMILIES, ConvergenceTask  # noqa: E402

apply_cpu_patches()
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
task = ConvergenceTask(args.task, rank, world)
family = {"OneBitAdam": "adamw", "OneBitLamb": "lamb"}
freeze = max(1, round(args.freeze_fraction * args.steps))

for name in args.optimizers.split(","):
    for lr in FAMILIES[family[name]][0]:
        torch.manual_seed(args.seed)
        model = task.model()
        params = {"lr": lr, "freeze_step": freeze, "cuda_aware": False, "comm_backend_name": "compressed"}
        cfg = {"train_micro_batch_size_per_gpu": args.batch_size, "optimizer": {"type": name, "params": params},
               "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
        losses, nonfinite = [], None
        for step in range(1, args.steps + 1):
            loss = task.loss(engine, args.batch_size, gen)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if not math.isfinite(losses[-1]):
                nonfinite = step
                break
        heldout = float("nan")
        if nonfinite is None:
            with torch.no_grad():
                eval_gen = torch.Generator().manual_seed(12345)
                heldout = sum(task.loss(engine.module, 256, eval_gen, heldout=True).item() for _ in range(8)) / 8
        tail = losses[-max(1, args.steps // 10):]
        if rank == 0:
            row = {"task": args.task, "optimizer": f"deepspeed_{name}", "lr": lr, "freeze_step": freeze,
                   "final_loss": sum(tail) / len(tail) if nonfinite is None else float("nan"),
                   "heldout_loss": heldout, "first_nonfinite_step": nonfinite}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        dist.barrier()
