"""What DeepSpeed 0.19.6's OneBitAdam and OneBitLamb hold, measured as ``onebit bench memory``
measures onebit's optimizers: ``nn.Linear(2048, 2048)``, 4 steps through a freeze after step
2, bytes of the tensors the optimizer object keeps (``onebit.bench._memory.held_bytes``,
walking DeepSpeed's classes) and the peak resident memory during the steps, in fp32 model
sizes. Run in the DeepSpeed environment, once per world size::

    OMP_NUM_THREADS=1 "$HOME/ds-venv/bin/torchrun" --standalone --nproc_per_node W \\
        benchmarks/deepspeed_memory.py --out benchmarks/results/memory/deepspeed.jsonl

One JSON line per optimizer (the largest figure over ranks) is appended to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference", "deepspeed-cpu"))
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from ds_cpu import apply_cpu_patches  # noqa: E402

from onebit.bench._memory import _reset_peak, _resident, held_bytes  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--size", type=int, default=2048)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", required=True)
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
apply_cpu_patches()
deepspeed.init_distributed(dist_backend="gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()


def train(kind: str, size: int, measure: bool) -> dict[str, float]:
    model = nn.Linear(size, size)
    x = torch.randn(8, size, generator=torch.Generator().manual_seed(rank))
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
              "optimizer": {"type": kind, "params": {"lr": 1e-3, "freeze_step": 2, "cuda_aware": False,
                                                      "comm_backend_name": "compressed"}}}
    base = _resident()[0]
    peak_ok = _reset_peak()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    model_bytes = 4 * (size * size + size)
    held = {"warmup": 0.0, "compressed": 0.0}
    for step in range(1, args.steps + 1):
        engine.backward(engine(x).square().mean())
        engine.step()
        stage = "warmup" if step <= 2 else "compressed"
        held[stage] = max(held[stage], held_bytes(engine.optimizer, ("deepspeed.", "torch.optim")) / model_bytes)
    peak = (_resident()[1] - base) / model_bytes if peak_ok and measure else None
    del engine, model
    gc.collect()
    return {**held, "peak": peak}


rows = []
for kind in ("OneBitAdam", "OneBitLamb"):
    train(kind, 8, measure=False)  # load code before measuring
    figures = train(kind, args.size, measure=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, figures)
    worst = {k: max(f[k] for f in everyone if f[k] is not None) for k in figures if figures[k] is not None}
    rows.append({"optimizer": kind, "world_size": world, **worst})
if rank == 0:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")
