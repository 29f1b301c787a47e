"""``onebit bench convergence``: every optimizer against its uncompressed counterpart on real tasks.

Each task runs in one spawned job of ``world`` gloo ranks that trains every cell of the
matrix in turn (same seed, same initial weights, same batches per rank). Each rank reads
its own contiguous shard of the training data. A cell is (task, learning rate, optimizer,
freeze point); its compressed optimizers are compared with their counterparts at the same
learning rate:

==================  =====================================================================
counterpart         compressed
==================  =====================================================================
AdamW               1-bit Adam, freeze at 10/20/40% of the steps, with the one-shot and the
                    overlapped exchange (``overlap=True`` in 0.5 MB buckets); 0/1 Adam, its
                    variance frozen at 10/20/40%, local steps after (the registry's setting)
LAMB                1-bit LAMB, freeze at 10/20/40%, one-shot and overlapped
AMSGrad             Comp-AMS Top-k 1% and Block-Sign, each with and without error feedback;
                    Block-Sign with one block per layer (the paper's layout)
SoftSignSGD         Birder, one-shot and overlapped
==================  =====================================================================

The counterparts are the same optimizers with an exact fp32 exchange (1-bit Adam/LAMB that
never freeze, Comp-AMS with ``compressor="none"``): the gap measures compression alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import comm
from ..launch import spawn
from ..optim import REGISTRY, ReplicaDivergence, make_optimizer
from ._tasks import ByteCorpus, ByteMLP, ByteTransformer, DigitsCNN, digits_split

__all__ = ["CONVERGENCE_TASKS", "FAMILIES", "Cell", "convergence_cells", "markdown_table", "measure_training",
           "read_deepspeed", "run_convergence"]

CONVERGENCE_TASKS = ("byte_mlp", "gpt", "bert", "digits", "sparse_embed", "frozen_unused")
FREEZE_FRACTIONS = (0.1, 0.2, 0.4)

# counterpart -> (its two learning rates, the compressed optimizers compared with it)
FAMILIES: dict[str, tuple[tuple[float, float], tuple[str, ...]]] = {
    "adamw": ((1e-3, 3e-3), ("onebit_adam", "onebit_adam_overlap", "zero_one_adam")),
    "lamb": ((3e-3, 1e-2), ("onebit_lamb", "onebit_lamb_overlap")),
    "amsgrad": ((1e-3, 3e-3), ("comp_ams_topk", "comp_ams_topk_no_ef", "comp_ams_block_sign",
                               "comp_ams_block_sign_overlap", "comp_ams_block_sign_no_ef",
                               "comp_ams_block_sign_layers")),
    "softsign_sgd": ((1e-3, 3e-3), ("birder", "birder_overlap")),
}
_TWO_STAGE = ("onebit_adam", "onebit_adam_overlap", "onebit_lamb", "onebit_lamb_overlap", "zero_one_adam")
# the cells of benchmarks/deepspeed_convergence.py: DeepSpeed's name -> (family, onebit's optimizer)
_DEEPSPEED = {"deepspeed_OneBitAdam": ("adamw", "onebit_adam"), "deepspeed_OneBitLamb": ("lamb", "onebit_lamb"),
              "deepspeed_ZeroOneAdam": ("adamw", "zero_one_adam")}
_NEVER = 10**9  # a freeze step no run reaches: the two-stage optimizers' exact warm-up throughout
# 0.5 MB buckets: every task's model is split into several, each compressed on its own
_OVERLAP = {"overlap": True, "bucket_cap_mb": 0.5}
# the matrix's optimizers -> (registry name, arguments beyond the defaults)
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("onebit_adam", {"freeze_step": _NEVER}),
    "onebit_adam": ("onebit_adam", {}),
    "onebit_adam_overlap": ("onebit_adam", _OVERLAP),
    "zero_one_adam": ("zero_one_adam", {}),
    "lamb": ("onebit_lamb", {"freeze_step": _NEVER}),
    "onebit_lamb": ("onebit_lamb", {}),
    "onebit_lamb_overlap": ("onebit_lamb", _OVERLAP),
    "amsgrad": ("comp_ams", {"compressor": "none"}),
    "comp_ams_topk": ("comp_ams", {}),
    "comp_ams_topk_no_ef": ("comp_ams", {"error_feedback": False}),
    "comp_ams_block_sign": ("comp_ams_block_sign", {}),
    "comp_ams_block_sign_overlap": ("comp_ams_block_sign", _OVERLAP),
    "comp_ams_block_sign_no_ef": ("comp_ams_block_sign", {"error_feedback": False}),
    # the paper's layout, one block per layer: the evidence for the default block size
    "comp_ams_block_sign_layers": ("comp_ams_block_sign", {"block": "tensor"}),
    "softsign_sgd": ("softsign_sgd", {}),
    "birder": ("birder", {}),
    "birder_overlap": ("birder", _OVERLAP),
}


@dataclass(frozen=True)
class Cell:
    """One run of the matrix."""

    task: str
    family: str
    optimizer: str
    lr: float
    freeze_fraction: float | None = None  # two-stage optimizers only

    @property
    def label(self) -> str:
        return self.optimizer if self.freeze_fraction is None else f"{self.optimizer}@{self.freeze_fraction:.0%}"


def convergence_cells(tasks: tuple[str, ...], families: tuple[str, ...]) -> list[Cell]:
    """The matrix: for each task, family and learning rate, the counterpart then its compressed peers."""
    cells = []
    for task in tasks:
        for family in families:
            lrs, compressed = FAMILIES[family]
            for lr in lrs:
                cells.append(Cell(task, family, family, lr))
                for name in compressed:
                    fractions = FREEZE_FRACTIONS if name in _TWO_STAGE else (None,)
                    cells.extend(Cell(task, family, name, lr, f) for f in fractions)
    return cells


# ------------------------------------------------------------------------------------ tasks
class SparseEmbeddingLM(nn.Module):
    """Next byte from the byte *bigrams* before it: an ``Embedding(65536, 16)`` of which English
    text looks up about 3% of the rows, most of those rarely -- the embedding tables of
    recommenders and large-vocabulary models in miniature."""

    def __init__(self, context: int = 4, embed: int = 16, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(256 * 256, embed)
        self.net = nn.Sequential(nn.Linear(context * embed, hidden), nn.GELU(), nn.Linear(hidden, 256))

    def forward(self, x: Tensor) -> Tensor:
        bigrams = x[:, :-1] * 256 + x[:, 1:]
        return self.net(self.embed(bigrams).flatten(1))


class FrozenUnusedMLP(nn.Module):
    """A byte MLP with a frozen (``requires_grad=False``) embedding, two alternative hidden
    blocks of which each batch uses one (picked at random per rank and step, so a block has
    no gradient on some ranks, or on all of them, at some steps), and a head that is never
    used -- what fine-tuning with frozen layers, mixture-of-experts routing and auxiliary
    heads leave in ``model.parameters()``."""

    def __init__(self, context: int = 8, embed: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, embed)
        self.embed.weight.requires_grad_(False)
        self.inp = nn.Linear(context * embed, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.GELU(), nn.Linear(hidden, hidden)) for _ in range(2))
        self.head = nn.Linear(hidden, 256)
        self.unused_head = nn.Linear(hidden, 16)

    def forward(self, x: Tensor, branch: int = 0) -> Tensor:
        h = self.inp(self.embed(x).flatten(1))
        return self.head(nn.functional.gelu(self.blocks[branch](h)))


class ConvergenceTask:
    """A model, this rank's training batches and the shared held-out loss of one task."""

    def __init__(self, name: str, rank: int, world: int) -> None:
        if name not in CONVERGENCE_TASKS:
            raise ValueError(f"unknown task {name!r}; available: {', '.join(CONVERGENCE_TASKS)}")
        self.name = name
        if name == "digits":
            self.train_xy, self.heldout_xy = digits_split(rank, world)
        else:
            text = "python" if name in ("gpt", "frozen_unused") else "english"
            self.corpus = ByteCorpus(text=text)
            self.corpus.shard(rank, world)
        self.context = {"byte_mlp": 4, "gpt": 16, "bert": 16, "sparse_embed": 5, "frozen_unused": 8}.get(name, 0)

    def model(self) -> nn.Module:
        if self.name == "byte_mlp":  # the 271k-parameter model of the issue that found the divergences
            return ByteMLP(context=4, embed=32, hidden=512, hidden2=256)
        if self.name in ("gpt", "bert"):
            return ByteTransformer(self.context, d_model=64, layers=2, heads=4, causal=self.name == "gpt")
        if self.name == "digits":
            return DigitsCNN(width=16)
        if self.name == "sparse_embed":
            return SparseEmbeddingLM()
        return FrozenUnusedMLP(context=self.context)

    def loss(self, model: nn.Module, size: int, gen: torch.Generator, heldout: bool = False) -> Tensor:
        if self.name == "digits":
            x, y = self.heldout_xy if heldout else self.train_xy
            idx = torch.randint(0, len(y), (size,), generator=gen)
            return nn.functional.cross_entropy(model(x[idx]), y[idx])
        if self.name == "bert":
            w = self.corpus.windows(self.context, size, gen, heldout)
            chosen = torch.rand(w.shape, generator=gen) < 0.15
            x = torch.where(chosen, torch.full_like(w, 256), w)  # [MASK]
            out = model(x)
            return nn.functional.cross_entropy(out[chosen], w[chosen])
        if self.name == "gpt":
            w = self.corpus.windows(self.context + 1, size, gen, heldout)
            out = model(w[:, :-1])
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), w[:, 1:].reshape(-1))
        x, y = self.corpus.batch(self.context, size, gen, heldout)
        if self.name == "frozen_unused":
            branch = int(torch.randint(0, 2, (), generator=gen))
            return nn.functional.cross_entropy(model(x, branch), y)
        return nn.functional.cross_entropy(model(x), y)


# ------------------------------------------------------------------------------------ runs
def build_optimizer(cell: Cell, params: list[nn.Parameter], steps: int, seed: int,
                    max_grad_norm: float | None = None) -> torch.optim.Optimizer:
    """The optimizer of ``cell`` with its default arguments (only ``lr``, the freeze step and,
    when given, ``max_grad_norm`` set)."""
    name, lr = cell.optimizer, cell.lr
    freeze = _NEVER if cell.freeze_fraction is None else max(1, round(cell.freeze_fraction * steps))
    entry, extra = _VARIANTS[name]
    spec = REGISTRY[entry]
    kw = {"lr": lr, "max_grad_norm": max_grad_norm, **(spec.freeze(freeze) if spec.freeze is not None else {}),
          **({"seed": seed} if spec.seeded else {}), **extra}
    return make_optimizer(entry, params, **kw)


def measure_training(task: ConvergenceTask, model: nn.Module, update: Callable[[Tensor, int], object], *,
                     steps: int, batch: int, seed: int, rank: int, forward: nn.Module | None = None) -> dict[str, Any]:
    """Train ``steps`` steps on this rank's batches and measure what the matrix reports.

    ``update(loss, step)`` runs backward and the optimizer step; ``forward`` (default
    ``model``) computes the training loss (DeepSpeed's engine, say). Training stops at the
    first non-finite loss, averaged over the default group's ranks -- a 4-byte all-reduce
    outside any optimizer's meter, so that every rank stops at the same step. Returns the
    per-step losses, ``first_nonfinite_step``, ``final_loss`` (mean of the last 10% of the
    steps) and ``heldout_loss`` (8 batches of 256, the same for every run).
    """
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    losses: list[float] = []
    nonfinite = None
    for step in range(1, steps + 1):
        loss = task.loss(forward or model, batch, gen)
        update(loss, step)
        losses.append(comm.all_reduce_mean(loss.detach().reshape(1)).item())
        if not math.isfinite(losses[-1]):
            nonfinite = step
            break
    heldout = float("nan")
    if nonfinite is None:
        with torch.no_grad():
            eval_gen = torch.Generator().manual_seed(12345)
            heldout = sum(task.loss(model, 256, eval_gen, heldout=True).item() for _ in range(8)) / 8
    tail = losses[-max(1, steps // 10):]
    return {"losses": losses, "first_nonfinite_step": nonfinite, "heldout_loss": heldout,
            "final_loss": sum(tail) / len(tail) if nonfinite is None else float("nan")}


def _train_cell(task: ConvergenceTask, cell: Cell, steps: int, batch: int, seed: int, rank: int,
                max_grad_norm: float | None) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = task.model()
    opt = build_optimizer(cell, list(model.parameters()), steps, seed, max_grad_norm)

    def update(loss: Tensor, step: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    run = measure_training(task, model, update, steps=steps, batch=batch, seed=seed, rank=rank)
    try:
        opt.check_replicas()
        replicas = "identical"
    except ReplicaDivergence as exc:
        replicas = str(exc)
    stats = opt.stats
    return {
        **asdict(cell),
        "label": cell.label,
        "final_loss": run["final_loss"],
        "heldout_loss": run["heldout_loss"],
        "first_nonfinite_step": run["first_nonfinite_step"],
        "skipped_steps": stats["skipped_steps"],
        "replicas": replicas,
        "bytes_sent_per_rank": stats["bytes_sent_total"],
        "freeze_step": stats["freeze_step"],
        "losses": run["losses"],
    }


def _task_main(rank: int, world: int, name: str, cells: list[Cell], steps: int, batch: int, seed: int,
               progress: bool, max_grad_norm: float | None) -> list[dict[str, Any]]:
    task = ConvergenceTask(name, rank, world)
    results = []
    for i, cell in enumerate(cells):
        results.append(_train_cell(task, cell, steps, batch, seed, rank, max_grad_norm))
        if progress and rank == 0:
            r = results[-1]
            print(f"  [{name} {i + 1}/{len(cells)}] {cell.label} lr={cell.lr:g}: held-out {r['heldout_loss']:.4f}"
                  + (f", non-finite at step {r['first_nonfinite_step']}" if r["first_nonfinite_step"] else ""),
                  flush=True)
    return results


def _gaps(results: list[dict[str, Any]]) -> None:
    """Add each cell's held-out gap (%) to its counterpart at the same task and learning rate."""
    base = {(r["task"], r["family"], r["lr"]): r for r in results if r["optimizer"] == r["family"]}
    for r in results:
        ref = base.get((r["task"], r["family"], r["lr"]))
        ok = ref is not None and math.isfinite(ref["heldout_loss"]) and math.isfinite(r["heldout_loss"])
        r["gap_pct"] = 100.0 * (r["heldout_loss"] / ref["heldout_loss"] - 1.0) if ok else None


def run_convergence(out: Path, tasks: tuple[str, ...] = CONVERGENCE_TASKS,
                    families: tuple[str, ...] = tuple(FAMILIES), steps: int = 300, batch: int = 32,
                    world: int = 3, seed: int = 0, progress: bool = True,
                    max_grad_norm: float | None = None) -> list[dict[str, Any]]:
    """Run the matrix (every optimizer with ``max_grad_norm`` when given); write ``summary.json``
    (every cell, with its loss curve) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for name in tasks:
        # overlap=True refuses max_grad_norm (the local clip needs every gradient before the first bucket leaves)
        cells = [c for c in convergence_cells((name,), families)
                 if max_grad_norm is None or not c.optimizer.endswith("_overlap")]
        if progress:
            print(f"task {name}: {len(cells)} runs of {steps} steps on {world} ranks", flush=True)
        results += spawn(_task_main, world, name, cells, steps, batch, seed, progress, max_grad_norm,
                         timeout=None)[0]
    _gaps(results)
    summary = {"steps": steps, "batch_per_rank": batch, "world_size": world, "seed": seed,
               "max_grad_norm": max_grad_norm, "cells": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return results


def read_deepspeed(path: Path) -> list[dict[str, Any]]:
    """DeepSpeed's cells from ``benchmarks/deepspeed_convergence.py`` (one JSON object per line), if present."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def markdown_table(results: list[dict[str, Any]], deepspeed: list[dict[str, Any]] = ()) -> str:
    """One row per task and learning-rate choice (each family's first or second learning rate,
    see :data:`FAMILIES`): each counterpart's held-out loss and each compressed optimizer's gap
    to it (``NaN@step`` where the loss went non-finite); DeepSpeed's cells, where run, after
    onebit's at the same freeze."""
    rows = [dict(r) for r in results]
    rows += [dict(d, family=_DEEPSPEED[d["optimizer"]][0], freeze_fraction=0.2) for d in deepspeed]
    _gaps(rows)
    run_by_deepspeed = {_DEEPSPEED[d["optimizer"]][1]: d["optimizer"] for d in deepspeed}
    columns: list[tuple[str, str, float | None]] = []
    for family in dict.fromkeys(r["family"] for r in results):
        columns.append((family, family, None))
        for name in FAMILIES[family][1]:
            for f in FREEZE_FRACTIONS if name in _TWO_STAGE else (None,):
                columns.append((family, name, f))
            if name in run_by_deepspeed:
                columns.append((family, run_by_deepspeed[name], 0.2))

    def fmt(task: str, lr: float, name: str, f: float | None) -> str:
        cell = next((r for r in rows if (r["task"], r["lr"], r["optimizer"], r.get("freeze_fraction"))
                     == (task, lr, name, f)), None)
        if cell is None:
            return ""
        if cell.get("first_nonfinite_step"):
            return f"**NaN@{cell['first_nonfinite_step']}**"
        if cell["gap_pct"] is None or name == cell["family"]:
            return f"{cell['heldout_loss']:.3f}"
        return f"{cell['gap_pct']:+.1f}%"

    header = ["task", "lr"] + [name if f is None else f"{name}@{f:.0%}" for _, name, f in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task in dict.fromkeys(r["task"] for r in results):
        for k, level in enumerate(("low", "high")):
            cells = [fmt(task, FAMILIES[family][0][k], name, f) for family, name, f in columns]
            lines.append(f"| {task} | {level} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
