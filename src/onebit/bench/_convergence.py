"""``onebit bench convergence``: every optimizer against its uncompressed counterpart on real
tasks, over paired seeds.

Each task runs in one spawned job of ``world`` gloo ranks that trains every cell of the
matrix for every seed in turn. Within a seed every cell of a task starts from the same
initial weights and sees the same batches per rank, so a compressed run and its counterpart
are paired: the matrix reports, per cell, the mean over seeds of the paired gap and its 95%
t-interval, and calls a target (C1 in docs/design.md, :data:`TARGETS`) met only when the interval's
upper end is inside it ("missed" when its lower end is outside, "inconclusive" between).

=============  ==============================================================================
counterpart    compared with it
=============  ==============================================================================
AdamW          1-bit Adam and 0/1 Adam, each with its identity-compressor control
LAMB           1-bit LAMB and its identity-compressor control
AMSGrad        Comp-AMS Top-k 1% and Block-Sign
SoftSignSGD    Birder and its identity-compressor control
=============  ==============================================================================

The counterparts are the same code with an exact fp32 exchange (1-bit Adam/LAMB that never
freeze, Comp-AMS with ``compressor="none"``; SoftSignSGD normalises the averaged gradient).
A control is the compressed optimizer with ``compressor="identity"``: its gap to the
counterpart is what the algorithm's frozen or normalised parts cost (1-bit Adam's frozen
variance and step clip, 0/1 Adam's variance schedule, 1-bit LAMB's frozen variance and trust
ratios, Birder's per-rank normalisation), and the compressed optimizer's gap to the control is
what the bits cost.
``extended=True`` adds the overlapped exchanges, the runs without error feedback and
Block-Sign with one block per layer.

Scores: held-out loss on a split drawn from the training text (every tenth 4 KB block), as
a % gap; ``digits`` by its error rate on the whole held-out set, as a gap in points (its
loss is a few images' worth of overfitting noise). ``steps_to_target``: the fraction of the
steps after which a run's training loss (mean over a tenth of the run) first reaches its
counterpart's final loss, where the final loss sits close to the text's entropy.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import comm
from ..launch import spawn
from ..optim import REGISTRY, ReplicaDivergence, make_optimizer
from ._analysis import mean_interval
from ._catalogue import BENCHMARKED, COUNTERPARTS
from ._tasks import ByteCorpus, ByteMLP, ByteTransformer, DigitsCNN, digits_split

__all__ = ["BEHIND", "CONVERGENCE_TASKS", "DEFAULT_TASKS", "EXTENDED", "FAMILIES", "TARGETS", "Cell", "aggregate",
           "convergence_cells", "markdown_table", "measure_training", "perturb_", "run_convergence"]

CONVERGENCE_TASKS = ("byte_mlp", "gpt", "bert", "digits", "sparse_embed", "frozen_unused")
# byte_mlp and bert are left out of the default run (40 minutes on 2 cores for 4 seeds): bert's
# gaps were all within 3 points of gpt's on one seed, and byte_mlp is frozen_unused without
# its frozen, unused and sometimes-used parameters.
DEFAULT_TASKS = ("gpt", "digits", "sparse_embed", "frozen_unused")
FREEZE_FRACTIONS = (0.1, 0.2, 0.4)
LEVELS = ("low", "high")



def _defaults(name: str) -> dict[str, Any]:
    """The arguments registry entry ``name`` builds its class with: the class's defaults (as they
    are today) and the entry's own."""
    spec = REGISTRY[name]
    return {**{k: p.default for k, p in inspect.signature(spec.cls).parameters.items()
               if p.default is not inspect.Parameter.empty}, **spec.kwargs}


def _compared(name: str, extended: bool) -> tuple[str, ...]:
    """The matrix's names of registry entry ``name``: its controls and itself, or its extended
    variants -- except a variant that would run as the entry itself or as one before it (its
    arguments, over the class's defaults, the same)."""
    row = BENCHMARKED[name]
    if row.matrix is None:
        return ()
    defaults = _defaults(name)
    seen = [defaults]
    names = []
    for suffix, v in row.variants.items():
        effective = {**defaults, **v.kwargs}
        if effective in seen:
            continue
        seen.append(effective)
        if v.extended == extended and (extended or v.control):
            names.append(f"{row.matrix}_{suffix}")
    return tuple(names) if extended else (*names, row.matrix)


# From the lab's table: counterpart -> (its low and high learning rates, what is compared with it by default)
FAMILIES: dict[str, tuple[tuple[float, float], tuple[str, ...]]] = {
    family: (c.lrs, tuple(n for name, b in BENCHMARKED.items() if b.counterpart == family
                          for n in _compared(name, False)))
    for family, c in COUNTERPARTS.items()}
# with extended=True: the variants the table marks extended (overlapped exchanges, runs
# without error feedback, Top-k keeping 5% and 25%, Block-Sign with one block per layer)
EXTENDED: dict[str, tuple[str, ...]] = {
    family: tuple(n for name, b in BENCHMARKED.items() if b.counterpart == family for n in _compared(name, True))
    for family in COUNTERPARTS}
# the matrix's optimizers -> (registry name, arguments beyond the defaults, a control)
_VARIANTS: dict[str, tuple[str, Mapping[str, Any], bool]] = {
    **{family: (c.entry, c.kwargs, False) for family, c in COUNTERPARTS.items()},
    **{f"{b.matrix}_{suffix}": (name, v.kwargs, v.control) for name, b in BENCHMARKED.items() if b.matrix
       for suffix, v in b.variants.items()},
    **{b.matrix: (name, {}, False) for name, b in BENCHMARKED.items() if b.matrix},
}
# C1 (docs/design.md, "Targets"): the largest mean paired gap (% of held-out loss; points of digits' error rate)
# each registry entry may show against its counterpart, from the lab's table
TARGETS = {name: b.target for name, b in BENCHMARKED.items() if b.target is not None}
# C1: no run (seed, or its last-bit perturbation) more than this far behind its counterpart
# (% of held-out loss; points of digits' error rate)
BEHIND = 10.0


@dataclass(frozen=True)
class Cell:
    """One optimizer setting of the matrix, run once per seed."""

    task: str
    family: str
    optimizer: str
    lr: float
    freeze_fraction: float | None = None  # two-stage optimizers: None is their default schedule

    @property
    def label(self) -> str:
        return self.optimizer if self.freeze_fraction is None else f"{self.optimizer}@{100 * self.freeze_fraction:.4g}%"


def _two_stage(name: str) -> bool:
    return REGISTRY[_VARIANTS[name][0]].freeze is not None and name not in FAMILIES


def convergence_cells(tasks: tuple[str, ...], families: tuple[str, ...], *, levels: tuple[str, ...] = ("high",),
                      freeze_fractions: tuple[float | None, ...] = (None,), extended: bool = False,
                      controls: bool = True, optimizers: tuple[str, ...] | None = None) -> list[Cell]:
    """The matrix: for each task, family and learning rate (``levels`` of the family's two), the
    counterpart then what is compared with it (without the identity controls unless ``controls``;
    when ``optimizers`` is given, only those: registry entries with their variants, or the
    matrix's names of single variants), the two-stage
    optimizers at each freeze fraction (``None``: their default schedule, ``freeze_step="auto"``,
    0/1 Adam's own, DiLoCo's ``sync_every``)."""
    cells = []
    for task in tasks:
        for family in families:
            lrs, compared = FAMILIES[family]
            names = tuple(n for n in compared + (EXTENDED[family] if extended else ())
                          if (controls or not _VARIANTS[n][2])
                          and (optimizers is None or _VARIANTS[n][0] in optimizers or n in optimizers))
            if optimizers is not None and not names:  # nothing of this family was asked for
                continue
            for level in levels:
                lr = lrs[LEVELS.index(level)]
                cells.append(Cell(task, family, family, lr))
                for name in names:
                    fractions = freeze_fractions if _two_stage(name) else (None,)
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
    entry, extra, _ = _VARIANTS[cell.optimizer]
    spec = REGISTRY[entry]
    fixed = {} if cell.freeze_fraction is None or spec.freeze is None else \
        spec.freeze(max(1, round(cell.freeze_fraction * steps)))
    return {"lr": cell.lr, "max_grad_norm": max_grad_norm, **fixed, **({"seed": seed} if spec.seeded else {}), **extra}


def build_optimizer(cell: Cell, params: list[nn.Parameter], steps: int, seed: int,
                    max_grad_norm: float | None = None) -> torch.optim.Optimizer:
    """The optimizer of ``cell`` with its default arguments (only ``lr``, the freeze step where
    the cell fixes one and, when given, ``max_grad_norm`` set)."""
    return make_optimizer(_VARIANTS[cell.optimizer][0], params, **_given(cell, steps, seed, max_grad_norm))


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
    arguments = {**_defaults(_VARIANTS[cell.optimizer][0]), **_given(cell, steps, seed, max_grad_norm)}
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


# ------------------------------------------------------------------------------------ analysis
def _score(run: dict[str, Any]) -> tuple[str, float]:
    """The metric a run is ranked by: digits' held-out error rate, else the held-out loss."""
    return ("heldout_error", run["heldout_error"]) if "heldout_error" in run else ("heldout_loss", run["heldout_loss"])


def _gap(run: dict[str, Any], base: dict[str, Any]) -> float | None:
    """``run``'s paired gap to ``base``: points of error rate, or % of held-out loss."""
    metric, mine = _score(run)
    theirs = base[metric]
    if not (math.isfinite(mine) and math.isfinite(theirs)):
        return None
    return mine - theirs if metric == "heldout_error" else 100.0 * (mine / theirs - 1.0)


def _steps_to(losses: list[float], target: float) -> float | None:
    """The fraction of the run after which the trailing mean (a tenth of the run) of
    ``losses`` first reaches ``target``; None if it never does."""
    window = max(1, len(losses) // 10)
    total = sum(losses[:window])
    for k in range(window, len(losses) + 1):
        if k > window:
            total += losses[k - 1] - losses[k - 1 - window]
        if total / window <= target:
            return k / len(losses)
    return None


def aggregate(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell (task, optimizer, learning rate, freeze) over its runs (seeds, and their
    last-bit perturbations): the paired gaps to the counterpart, their mean and 95% half-width,
    the worst run and the share of runs more than :data:`BEHIND` behind, the runs that never
    compressed (as many bytes sent as the counterpart), the C1 verdict,
    non-finite runs, the steps to the counterpart's final loss, and each run's score with their
    finite mean."""
    key = ("task", "family", "lr")
    base = {(*(r[k] for k in key), _run(r)): r for r in results if r["optimizer"] == r["family"]}
    by_cell = {(*(r[k] for k in key), r["optimizer"], r["freeze_fraction"], _run(r)): r for r in results}
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        cells.setdefault((r["task"], r["family"], r["optimizer"], r["lr"], r["freeze_fraction"]), []).append(r)
    rows = []
    for (task, family, name, lr, freeze), runs in cells.items():
        pairs = [(r, base.get((task, family, lr, _run(r)))) for r in runs]
        pairs = [(r, b) for r, b in pairs if b is not None]
        metric = _score(runs[0])[0]
        row: dict[str, Any] = {"task": task, "family": family, "optimizer": name, "lr": lr,
                               "freeze_fraction": freeze, "label": runs[0]["label"], "metric": metric,
                               "seeds": [r["seed"] for r in runs], "runs": [list(_run(r)) for r in runs],
                               "score": [_score(r)[1] for r in runs],
                               "score_mean": _finite_mean([_score(r)[1] for r in runs]),
                               "nonfinite": sum(r["first_nonfinite_step"] is not None for r in runs),
                               "freeze_steps": [r.get("freeze_step") for r in runs]}
        if name != family:
            gaps = [_gap(r, b) for r, b in pairs]
            finite = [g for g in gaps if g is not None]
            mean, half = mean_interval(finite) if finite else (None, None)
            target = None if _VARIANTS[name][2] else TARGETS.get(_VARIANTS[name][0])
            worst = max(range(len(gaps)), key=lambda k: math.inf if gaps[k] is None else gaps[k]) if gaps else None
            reached = [_steps_to(r["losses"], b["final_loss"]) if r["first_nonfinite_step"] is None else None
                       for r, b in pairs]
            # a run that sent as many bytes as its counterpart never compressed (a two-stage
            # optimizer whose freeze did not come within the run): its gap is no evidence for the
            # bits (the identity controls send fp32 by design)
            fp32 = 0 if target is None else sum(r["bytes_sent_per_rank"] >= b["bytes_sent_per_rank"] for r, b in pairs)
            # nor one that never exchanged at all, every step a local one (DiLoCo whose sync_every
            # is longer than the run)
            silent = sum(set(r.get("stage_steps", ())) == {"local"} for r, _ in pairs)
            row.update(gaps=gaps, gap_mean=mean, gap_half=half, target=target, uncompressed=fp32, silent=silent,
                       worst_gap=None if worst is None else gaps[worst],
                       worst_run=None if worst is None else list(_run(pairs[worst][0])),
                       behind=sum(g is None or g > BEHIND for g in gaps) / len(gaps) if gaps else None,
                       verdict="no exchange" if gaps and silent == len(gaps) else
                       "uncompressed" if gaps and fp32 == len(gaps) else
                       _verdict(mean, half, target, row["nonfinite"], None if worst is None else gaps[worst]),
                       steps_to_target=reached)
            # what the compression alone costs: the paired gap to its identity control at the same schedule
            control_name = _control_of(name)
            control = [(r, by_cell.get((task, family, lr, control_name, freeze, _run(r)))) for r in runs]
            control_gaps = [_gap(r, c) for r, c in control if c is not None]
            if control_gaps:
                finite = [g for g in control_gaps if g is not None]
                mean, half = mean_interval(finite) if finite else (None, None)
                row.update(control_gaps=control_gaps, control_gap_mean=mean, control_gap_half=half)
        if "ratio_at_min" in runs[0]:
            row["ratio_at_min"] = sum(r.get("ratio_at_min", 0.0) for r in runs) / len(runs)
            row["ratio_at_max"] = sum(r.get("ratio_at_max", 0.0) for r in runs) / len(runs)
        rows.append(row)
    return rows


def _control_of(name: str) -> str | None:
    """The matrix's identity control of ``name``: the same registry entry and arguments with the
    identity compressor (error feedback, which the exact exchange has no use for, aside)."""
    entry, kwargs, is_control = _VARIANTS[name]
    if is_control:
        return None
    wanted = {**{k: v for k, v in kwargs.items() if k != "error_feedback"}, "compressor": "identity"}
    return next((n for n, (e, kw, control) in _VARIANTS.items() if control and e == entry and dict(kw) == wanted),
                None)


def _run(r: dict[str, Any]) -> tuple[int, int]:
    """The run's seed and last-bit perturbation (0 in summaries from before perturbations)."""
    return r["seed"], r.get("perturbation", 0)


def _finite_mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def _verdict(mean: float | None, half: float | None, target: float | None, nonfinite: int,
             worst: float | None = None) -> str:
    """C1: "met" when the interval's upper end is inside the target and no run is more than
    :data:`BEHIND` behind; "missed" when its lower end is outside or a run is that far behind."""
    if nonfinite:
        return "non-finite"
    if target is None or mean is None:
        return "control"
    if worst is not None and worst > BEHIND:
        return "missed"
    if mean + half <= target:
        return "met"
    return "missed" if mean - half > target else "inconclusive"


def _cell_text(row: dict[str, Any]) -> str:
    if row["optimizer"] == row["family"]:
        mean = row["score_mean"]
        return f"{mean:.2f}%" if row["metric"] == "heldout_error" else f"{mean:.3f}"
    if row["gap_mean"] is None:
        return f"non-finite ({row['nonfinite']}/{len(row['seeds'])})"
    unit = " pt" if row["metric"] == "heldout_error" else "%"
    half = "" if math.isinf(row["gap_half"]) else f" ± {row['gap_half']:.1f}"
    mark = {"met": " ✓", "missed": " ✗", "inconclusive": " ?", "non-finite": " NaN"}.get(row["verdict"], "")
    worst = "non-finite" if row.get("worst_gap") is None and "worst_gap" in row else \
        f"{row['worst_gap']:+.1f}" if "worst_gap" in row else ""
    if worst and row.get("worst_run") and row["verdict"] not in ("uncompressed", "no exchange"):
        seed, perturbation = row["worst_run"]
        worst += f", seed {seed}" + (" perturbed" if perturbation else "")
    fp32 = row.get("uncompressed", 0)
    never = "" if not fp32 else "; never compressed" if fp32 == len(row["gaps"]) else \
        f"; {fp32}/{len(row['gaps'])} never compressed"
    silent = row.get("silent", 0)
    never += "" if not silent else "; never synchronised" if silent == len(row["gaps"]) else \
        f"; {silent}/{len(row['gaps'])} never synchronised"
    control = ""
    if row.get("control_gap_mean") is not None:  # what the compression alone costs
        control_half = "" if math.isinf(row["control_gap_half"]) else f" ± {row['control_gap_half']:.1f}"
        control = f"; {row['control_gap_mean']:+.1f}{unit}{control_half} against its identity control"
    return f"{row['gap_mean']:+.1f}{unit}{half}{mark}" + (f" (worst {worst}{never})" if worst else "") + control


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One table per family and learning rate: a row per optimizer, a column per task; the
    counterpart's mean score, then each optimizer's mean paired gap ± the 95% half-width
    (✓ met, ? inconclusive, ✗ missed against its C1 target; none: a control) and its worst run
    (its seed, "perturbed" when it started from the last-bit-changed weights)."""
    tables = []
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    for family, lr in dict.fromkeys((r["family"], r["lr"]) for r in rows):
        mine = [r for r in rows if (r["family"], r["lr"]) == (family, lr)]
        lines = [f"**{family}, lr {lr:g}**", "", "| optimizer | " + " | ".join(tasks) + " |",
                 "|---|" + "---|" * len(tasks)]
        for label in dict.fromkeys(r["label"] for r in mine):
            by_task = {r["task"]: r for r in mine if r["label"] == label}
            lines.append(f"| {label} | " + " | ".join(_cell_text(by_task[t]) if t in by_task else "" for t in tasks)
                         + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)
