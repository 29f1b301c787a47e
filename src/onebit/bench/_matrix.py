"""The convergence matrix: what ``onebit bench convergence`` runs, and how its runs are read.

Every cell of a task (:func:`convergence_cells`) is paired with its counterpart, run from the
same initial weights on the same batches (``_convergence.py``): :func:`aggregate` reports, per
cell, the mean over seeds of the paired gap and its 95% t-interval, and calls a target (C1 in
docs/design.md, :data:`TARGETS`) met only when the interval's upper end is inside it
("missed" when its lower end is outside, "inconclusive" between).

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

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..optim import REGISTRY
from ._analysis import mean_interval
from ._catalogue import BENCHMARKED, COUNTERPARTS

__all__ = ["BEHIND", "CONVERGENCE_TASKS", "DEFAULT_TASKS", "EXTENDED", "FAMILIES", "FREEZE_FRACTIONS", "LEVELS",
           "TARGETS", "VARIANTS", "Cell", "aggregate", "convergence_cells", "markdown_table"]

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
VARIANTS: dict[str, tuple[str, Mapping[str, Any], bool]] = {
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
    return REGISTRY[VARIANTS[name][0]].freeze is not None and name not in FAMILIES


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
                          if (controls or not VARIANTS[n][2])
                          and (optimizers is None or VARIANTS[n][0] in optimizers or n in optimizers))
            if optimizers is not None and not names:  # nothing of this family was asked for
                continue
            for level in levels:
                lr = lrs[LEVELS.index(level)]
                cells.append(Cell(task, family, family, lr))
                for name in names:
                    fractions = freeze_fractions if _two_stage(name) else (None,)
                    cells.extend(Cell(task, family, name, lr, f) for f in fractions)
    return cells


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
            target = None if VARIANTS[name][2] else TARGETS.get(VARIANTS[name][0])
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
    entry, kwargs, is_control = VARIANTS[name]
    if is_control:
        return None
    def aside(kw: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in kw.items() if k != "error_feedback"}

    wanted = {**aside(kwargs), "compressor": "identity"}
    found = next((n for n, (e, kw, control) in VARIANTS.items() if control and e == entry and aside(kw) == wanted),
                 None)
    row = BENCHMARKED[entry]
    if found is None and name == row.matrix and row.control is not None:
        return f"{row.matrix}_{row.control}"
    return found


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
