"""DeepSpeed 0.19.6's OneBitAdam / OneBitLamb / ZeroOneAdam on the tasks of ``onebit bench convergence``.

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

from onebit.bench._convergence import FAMILIES, ConvergenceTask, measure_training  # noqa: E402
from onebit.optim import REGISTRY  # noqa: E402

apply_cpu_patches()
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
task = ConvergenceTask(args.task, rank, world)
family = {"OneBitAdam": "adamw", "OneBitLamb": "lamb", "ZeroOneAdam": "adamw"}
freeze = max(1, round(args.freeze_fraction * args.steps))

for name in args.optimizers.split(","):
    for lr in FAMILIES[family[name]][0]:
        torch.manual_seed(args.seed)
        model = task.model()
        # 0/1 Adam: the schedule onebit's matrix gives it (REGISTRY["zero_one_adam"].freeze)
        stages = REGISTRY["zero_one_adam"].freeze(freeze) if name == "ZeroOneAdam" else {"freeze_step": freeze}
        params = {"lr": lr, **stages, "cuda_aware": False, "comm_backend_name": "compressed"}
        cfg = {"train_micro_batch_size_per_gpu": args.batch_size, "optimizer": {"type": name, "params": params},
               "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        run = measure_training(task, model, lambda loss, step: (engine.backward(loss), engine.step()),
                               steps=args.steps, batch=args.batch_size, seed=args.seed, rank=rank,
                               forward=engine)
        if rank == 0:
            row = {"task": args.task, "optimizer": f"deepspeed_{name}", "lr": lr, "freeze_step": freeze,
                   **{k: run[k] for k in ("final_loss", "heldout_loss", "first_nonfinite_step")}}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        dist.barrier()
