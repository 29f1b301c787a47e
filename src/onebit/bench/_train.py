"""One data-parallel training run on local gloo ranks, recorded step by step."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import comm
from ..launch import spawn
from ..optim import CompAMS, OnebitAdam, OnebitAdamNaive, OnebitLamb, QAdam
from ._tasks import ByteCorpus, ByteMLP

__all__ = ["OPTIMIZERS", "TrainConfig", "train"]

OPTIMIZERS = (
    "adam",
    "onebit_adam",
    "onebit_adam_naive",
    "lamb",
    "onebit_lamb",
    "amsgrad",
    "comp_ams",
    "comp_ams_block_sign",
    "qadam",
)


@dataclass(frozen=True)
class TrainConfig:
    optimizer: str = "onebit_adam"
    world_size: int = 2
    steps: int = 300
    batch_size: int = 32  # per rank
    lr: float = 1e-3
    freeze_step: int | str = 60
    seed: int = 0
    context: int = 16
    hidden: int = 512
    eval_batches: int = 8
    # Short runs freeze long before v is stationary; bias correction keeps the frozen v unbiased.
    bias_correction: bool = True


class _AllReduceAdam(torch.optim.Adam):
    """Data-parallel Adam: one fp32 all-reduce of all gradients (a single DDP-style bucket)."""

    def step(self, closure=None):  # type: ignore[override]
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_mean(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return super().step(closure)


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        for p in model.parameters():
            comm.broadcast(p.data, 0)
        return _AllReduceAdam(model.parameters(), lr=cfg.lr)
    if cfg.optimizer == "onebit_adam":
        return OnebitAdam(
            model.parameters(), lr=cfg.lr, freeze_step=cfg.freeze_step, bias_correction=cfg.bias_correction
        )
    if cfg.optimizer == "onebit_adam_naive":
        return OnebitAdamNaive(model.parameters(), lr=cfg.lr, bias_correction=cfg.bias_correction)
    if cfg.optimizer in ("lamb", "onebit_lamb"):
        # "lamb" is 1-bit LAMB that never leaves its warm-up: exact LAMB on all-reduced gradients.
        freeze = cfg.freeze_step if cfg.optimizer == "onebit_lamb" else cfg.steps + 1
        return OnebitLamb(model.parameters(), lr=cfg.lr, freeze_step=freeze)
    if cfg.optimizer in ("amsgrad", "comp_ams", "comp_ams_block_sign"):
        compressor = {"amsgrad": "none", "comp_ams": "topk", "comp_ams_block_sign": "block_sign"}[cfg.optimizer]
        return CompAMS(model.parameters(), lr=cfg.lr, compressor=compressor, bias_correction=cfg.bias_correction)
    if cfg.optimizer == "qadam":
        return QAdam(model.parameters(), lr=cfg.lr, bits=1)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; available: {', '.join(OPTIMIZERS)}")


def _rank_main(rank: int, world: int, cfg: TrainConfig, progress: bool) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    corpus = ByteCorpus()
    model = ByteMLP(context=cfg.context, hidden=cfg.hidden)
    opt = _optimizer(cfg, model)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    loss_fn = nn.CrossEntropyLoss()
    records = []
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=cfg.optimizer, unit="step", leave=False)
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        x, y = corpus.batch(cfg.context, cfg.batch_size, gen)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with comm.measure() as meter:
            opt.step()
        stats = getattr(opt, "stats", {"stage": "uncompressed"})
        # The logged loss is the average over ranks (a tiny extra all-reduce, outside the meter).
        mean_loss = comm.all_reduce_mean(loss.detach().reshape(1)).item()
        records.append(
            {
                "step": step,
                "loss": mean_loss,
                "stage": stats["stage"],
                "bytes_sent": meter.bytes_sent,
                "time": time.perf_counter() - start,
                "step_time": time.perf_counter() - t0,
                "samples": step * cfg.batch_size * world,
            }
        )
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}", stage=stats["stage"])
    if bar is not None:
        bar.close()
    with torch.no_grad():
        eval_gen = torch.Generator().manual_seed(12345)
        losses = [loss_fn(model(xb), yb).item() for xb, yb in
                  (corpus.batch(cfg.context, 256, eval_gen, heldout=True) for _ in range(cfg.eval_batches))]
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"records": records, "eval_loss": sum(losses) / len(losses), "checksum": checksum,
            "freeze_step": getattr(opt, "stats", {}).get("freeze_step")}


def _stage_rate(records: list[dict[str, Any]], stage: str, per_step_samples: int) -> float | None:
    times = [r["step_time"] for r in records if r["stage"] == stage][1:]  # the first step pays set-up
    return per_step_samples / (sum(times) / len(times)) if times else None


def train(cfg: TrainConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    """Run ``cfg`` on local ranks; write ``metrics.jsonl`` and ``summary.json`` into ``out``."""
    results = spawn(_rank_main, cfg.world_size, cfg, progress)
    if len({r["checksum"] for r in results}) != 1:
        raise RuntimeError(f"replicas diverged: parameter checksums {[r['checksum'] for r in results]}")
    records = results[0]["records"]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    per_step = cfg.batch_size * cfg.world_size
    bytes_total = sum(r["bytes_sent"] for r in records)
    summary = {
        "config": asdict(cfg),
        "final_loss": sum(r["loss"] for r in records[-10:]) / min(10, len(records)),
        "eval_loss": results[0]["eval_loss"],
        "freeze_step": results[0]["freeze_step"],
        "bytes_sent_per_rank": bytes_total,
        "samples_per_s": {
            stage: _stage_rate(records, stage, per_step)
            for stage in sorted({r["stage"] for r in records})
        },
        "wall_time_s": records[-1]["time"],
    }
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    return summary
