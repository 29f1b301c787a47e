"""``onebit bench convergence``: every optimizer against its uncompressed counterpart on real
tasks, over paired seeds.

Each task runs in one spawned job of ``world`` gloo ranks that trains every cell of the
matrix for every seed in turn. Within a seed every cell of a task starts from the same
initial weights and sees the same batches per rank, so a compressed run and its counterpart
are paired (the matrix, its counterparts and how its runs are read: ``_matrix.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import comm
from ..launch import spawn
from ..optim import REGISTRY, ReplicaDivergence, make_optimizer
from ._matrix import CONVERGENCE_TASKS, DEFAULT_TASKS, FAMILIES, VARIANTS, Cell, _defaults, aggregate, convergence_cells
from ._tasks import ByteCorpus, ByteMLP, ByteTransformer, DigitsCNN, digits_split

__all__ = ["ConvergenceTask", "build_optimizer", "measure_training", "perturb_", "run_arguments", "run_convergence"]


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
    """A model, this rank's training batches and the shared held-out score of one task.

    The byte tasks hold out every tenth 4 KB block of their text and shard the rest by
    contiguous slices (each rank its own files or topics: non-identical data), or with
    ``iid`` by blocks in a random order; ``digits`` is shuffled before it is sharded.
    """

    def __init__(self, name: str, rank: int, world: int, iid: bool = False) -> None:
        if name not in CONVERGENCE_TASKS:
            raise ValueError(f"unknown task {name!r}; available: {', '.join(CONVERGENCE_TASKS)}")
        self.name = name
        if name == "digits":
            self.train_xy, self.heldout_xy = digits_split(rank, world)
        else:
            text = "python" if name in ("gpt", "frozen_unused") else "english"
            self.corpus = ByteCorpus(text=text, split="blocks")
            self.corpus.shard(rank, world, iid=iid)
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

    @property
    def scores(self) -> tuple[str, ...]:
        """The names :meth:`evaluate` returns."""
        return ("heldout_loss", "heldout_error") if self.name == "digits" else ("heldout_loss",)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """``heldout_loss``: the mean of 8 held-out batches of 256 (the same for every run);
        ``digits``: the loss and ``heldout_error`` (%) on the whole held-out set."""
        if self.name == "digits":
            x, y = self.heldout_xy
            out = model(x)
            return {"heldout_loss": nn.functional.cross_entropy(out, y).item(),
                    "heldout_error": 100.0 * (out.argmax(1) != y).float().mean().item()}
        gen = torch.Generator().manual_seed(12345)
        return {"heldout_loss": sum(self.loss(model, 256, gen, heldout=True).item() for _ in range(8)) / 8}


# ------------------------------------------------------------------------------------ runs
def _given(cell: Cell, steps: int, seed: int, max_grad_norm: float | None) -> dict[str, Any]:
    """The arguments ``cell`` gives its registry entry beyond the entry's own: ``lr``, the freeze
    step where the cell fixes one, ``max_grad_norm`` and the variant's."""
    entry, extra, _ = VARIANTS[cell.optimizer]
    spec = REGISTRY[entry]
    fixed = {} if cell.freeze_fraction is None or spec.freeze is None else \
        spec.freeze(max(1, round(cell.freeze_fraction * steps)))
    return {"lr": cell.lr, "max_grad_norm": max_grad_norm, **fixed, **({"seed": seed} if spec.seeded else {}), **extra}


def build_optimizer(cell: Cell, params: list[nn.Parameter], steps: int, seed: int,
                    max_grad_norm: float | None = None) -> torch.optim.Optimizer:
    """The optimizer of ``cell`` with its default arguments (only ``lr``, the freeze step where
    the cell fixes one and, when given, ``max_grad_norm`` set)."""
    return make_optimizer(VARIANTS[cell.optimizer][0], params, **_given(cell, steps, seed, max_grad_norm))


def _refused(cell: Cell, steps: int, max_grad_norm: float | None) -> str | None:
    """Why the optimizer of ``cell`` refuses its arguments in this run, or None: overlap=True
    with ``max_grad_norm``, a streamed DiLoCo whose fragments do not divide the cell's H, ...
    (built here over a few parameters, without a process group)."""
    try:
        build_optimizer(cell, [nn.Parameter(torch.zeros(8)) for _ in range(8)], steps, 0, max_grad_norm)
    except ValueError as exc:
        return str(exc)
    return None


def run_arguments(cell: Cell, steps: int, seed: int, max_grad_norm: float | None = None) -> dict[str, Any]:
    """Every argument the optimizer of ``cell`` was built with that a JSON file can hold (its
    class's defaults as they are today, the registry entry's, the cell's): what a run records, so
    that its label keeps its meaning when a default changes."""
    arguments = {**_defaults(VARIANTS[cell.optimizer][0]), **_given(cell, steps, seed, max_grad_norm)}
    return {k: v for k, v in arguments.items() if v is None or isinstance(v, (bool, int, float, str))}


def perturb_(model: nn.Module, k: int) -> None:
    """Move every parameter value one ulp up or down (``k`` seeds which): the same initial
    weights but for the last bit, standing in for another machine's rounding (``k=0``: none)."""
    if k == 0:
        return
    gen = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for p in model.parameters():
            toward = torch.where(torch.rand(p.shape, generator=gen) < 0.5, math.inf, -math.inf)
            p.copy_(torch.nextafter(p, toward.to(p.dtype)))


def cosine(steps: int) -> Callable[[int], float]:
    """The learning-rate factor after ``k`` of ``steps`` steps: ``(1 + cos(pi k / steps)) / 2``."""
    return lambda k: 0.5 * (1.0 + math.cos(math.pi * min(k, steps) / steps))


def measure_training(task: ConvergenceTask, model: nn.Module, update: Callable[[Tensor, int], object], *,
                     steps: int, batch: int, seed: int, rank: int, forward: nn.Module | None = None,
                     shared: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> dict[str, Any]:
    """Train ``steps`` steps on this rank's batches and measure what the matrix reports.

    ``update(loss, step)`` runs backward and the optimizer step; ``forward`` (default
    ``model``) computes the training loss (DeepSpeed's engine, say); the held-out scores are
    taken inside ``shared()`` where given: a context in which ``model`` is the model every rank
    shares (DiLoCo's :meth:`~onebit.DiLoCo.anchored`). Training stops at the
    first non-finite loss, averaged over the default group's ranks -- a 4-byte all-reduce
    outside any optimizer's meter, so that every rank stops at the same step. Returns the
    per-step losses, ``first_nonfinite_step``, ``final_loss`` (mean of the last 10% of the
    steps) and :meth:`ConvergenceTask.evaluate`'s scores (NaN after a non-finite loss).
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
    if nonfinite is None:
        with shared() if shared is not None else contextlib.nullcontext():
            scores = task.evaluate(model)
    else:
        scores = dict.fromkeys(task.scores, float("nan"))
    tail = losses[-max(1, steps // 10):]
    return {"losses": losses, "first_nonfinite_step": nonfinite, **scores,
            "final_loss": sum(tail) / len(tail) if nonfinite is None else float("nan")}


def _train_cell(task: ConvergenceTask, cell: Cell, steps: int, batch: int, seed: int, perturbation: int, rank: int,
                max_grad_norm: float | None, schedule: str) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = task.model()
    perturb_(model, perturbation)
    opt = build_optimizer(cell, list(model.parameters()), steps, seed, max_grad_norm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine(steps)) if schedule == "cosine" else None
    ratios: list[list[float]] = []  # 1-bit LAMB's per-layer scaling ratios, every 10 steps
    stage_steps: dict[str, int] = {}  # the steps each stage took ("local": nothing exchanged)

    def update(loss: Tensor, step: int) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        stage = opt.stats["stage"]
        stage_steps[stage] = stage_steps.get(stage, 0) + 1
        if sched is not None:
            sched.step()
        if hasattr(opt, "ratio") and step % 10 == 0:
            ratios.append(opt.ratio.tolist())

    run = measure_training(task, model, update, steps=steps, batch=batch, seed=seed, rank=rank,
                           shared=getattr(opt, "anchored", None))
    opt.wait()  # an exchange still in flight (streamed DiLoCo) completes before the group goes
    try:
        opt.check_replicas()
        replicas = "identical"
    except ReplicaDivergence as exc:
        replicas = str(exc)
    stats = opt.stats
    extra = {}
    if ratios and stats.get("freeze_step") is not None:
        low, high = opt.options["factor_min"], opt.options["factor_max"]
        extra = {"ratio_trace": ratios, "ratio_at_min": sum(r <= low for r in ratios[-1]) / len(ratios[-1]),
                 "ratio_at_max": sum(r >= high for r in ratios[-1]) / len(ratios[-1])}
    return {
        **asdict(cell),
        "label": cell.label,
        "arguments": run_arguments(cell, steps, seed, max_grad_norm),
        "seed": seed,
        "perturbation": perturbation,
        **{k: v for k, v in run.items() if k != "losses"},
        "skipped_steps": stats["skipped_steps"],
        "replicas": replicas,
        "bytes_sent_per_rank": stats["bytes_sent_total"],
        "freeze_step": stats.get("freeze_step"),  # (DiLoCo has none)
        "stage_steps": stage_steps,
        **extra,
        "losses": run["losses"],
    }


def _task_main(rank: int, world: int, name: str, cells: list[Cell], steps: int, batch: int, seeds: tuple[int, ...],
               perturbations: int, progress: bool, max_grad_norm: float | None, schedule: str,
               iid: bool) -> list[dict[str, Any]]:
    task = ConvergenceTask(name, rank, world, iid=iid)
    results = []
    for seed, k in ((seed, k) for seed in seeds for k in range(perturbations + 1)):
        for i, cell in enumerate(cells):
            results.append(_train_cell(task, cell, steps, batch, seed, k, rank, max_grad_norm, schedule))
            if progress and rank == 0:
                r = results[-1]
                print(f"  [{name} seed {seed}{f' perturbation {k}' if k else ''} {i + 1}/{len(cells)}] "
                      f"{cell.label} lr={cell.lr:g}: "
                      f"held-out {r['heldout_loss']:.4f}"
                      + (f", non-finite at step {r['first_nonfinite_step']}" if r["first_nonfinite_step"] else ""),
                      flush=True)
    return results


def run_convergence(out: Path, tasks: tuple[str, ...] = DEFAULT_TASKS,
                    families: tuple[str, ...] = tuple(FAMILIES), *, steps: int = 300, batch: int = 32,
                    world: int = 3, seeds: tuple[int, ...] = (0, 1, 2, 3), perturbations: int = 0,
                    levels: tuple[str, ...] = ("high",), freeze_fractions: tuple[float | None, ...] = (None,),
                    extended: bool = False, controls: bool = True, optimizers: tuple[str, ...] | None = None,
                    jobs: int = 1,
                    schedule: str = "constant", iid: bool = False, progress: bool = True,
                    max_grad_norm: float | None = None,
                    provenance: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the matrix (every optimizer with ``max_grad_norm`` when given; ``schedule``
    ``"constant"`` or ``"cosine"`` to zero; ``iid`` shards; each seed also from ``perturbations``
    last-bit changes of its initial weights, :func:`perturb_`; ``jobs`` tasks at a time, each
    on ``world`` processes); write and return the summary
    (the settings, ``provenance``: the command, machine and date, :func:`aggregate`'s rows,
    and every run with its loss curve) as ``summary.json`` in ``out``."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    out.mkdir(parents=True, exist_ok=True)

    def task_job(name: str) -> list[dict[str, Any]]:
        cells = []
        for c in convergence_cells((name,), families, levels=levels, freeze_fractions=freeze_fractions,
                                   extended=extended, controls=controls, optimizers=optimizers):
            why = _refused(c, steps, max_grad_norm)
            if why is None:
                cells.append(c)
            else:
                print(f"task {name}: {c.label} left out: {why}", flush=True)
        if progress:
            print(f"task {name}: {len(cells)} cells x {len(seeds)} seeds of {steps} steps on {world} ranks",
                  flush=True)
        return spawn(_task_main, world, name, cells, steps, batch, tuple(seeds), perturbations, progress,
                     max_grad_norm, schedule, iid, timeout=None)[0]

    # each task's job is its own gloo group: several run side by side on a machine with the cores
    with ThreadPoolExecutor(jobs) as pool:
        results = [run for runs in pool.map(task_job, tasks) for run in runs]
    summary = {"steps": steps, "batch_per_rank": batch, "world_size": world, "seeds": list(seeds),
               "perturbations": perturbations,
               "schedule": schedule, "shards": "iid" if iid else "contiguous", "max_grad_norm": max_grad_norm,
               "provenance": provenance, "aggregate": aggregate(results), "runs": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
