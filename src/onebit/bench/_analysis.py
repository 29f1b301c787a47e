"""What the ``onebit`` command reports, computed from the runs' summaries and metrics: the
comparison table, the demo's verdict, time to a target loss. ``cli.py`` parses and prints."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

from ._model import ModelInput, predict
from ._runs import NO_COMMUNICATION

__all__ = ["compare_rows", "cores_busy", "demo_verdict", "fmt", "mean_interval", "ms", "names_from", "round_rows",
           "step_time", "steps_to_loss", "text_table", "time_to_loss"]

# Student's t at 97.5% by degrees of freedom (two-sided 95% intervals); between entries the
# smaller df's, a slightly wider interval.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         15: 2.131, 20: 2.086, 30: 2.042}


def text_table(rows: list[list[str]]) -> str:
    """``rows`` (the first the header) as aligned plain-text columns under a rule."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def mean_interval(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` (paired differences, say) and the half-width of its 95% t-interval
    (``inf`` for a single value)."""
    mean = statistics.fmean(values)
    n = len(values)
    if n < 2:
        return mean, math.inf
    t = _T975[max(k for k in _T975 if k <= n - 1)]
    return mean, t * statistics.stdev(values) / math.sqrt(n)


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Paired seeds' ratios (one run's time over another's) pooled on the log scale: their
    geometric mean and its 95% t-interval, ``(mean, low, high)``."""
    mean, half = mean_interval([math.log(r) for r in ratios])
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def demo_verdict(summaries: dict[str, dict], *, nodes: int | None, world_size: int, steps: int) -> list[str]:
    """What ``onebit demo`` showed: the measured speed-up of 1-bit Adam over Adam, and without an
    emulated cluster (``nodes`` None: loopback) the cost model's for real links."""
    adam, onebit = summaries["adam"], summaries["onebit_adam"]
    adam_step = adam["step_time_s"]["warmup"]
    compressed = onebit["step_time_s"].get("compressed")
    if compressed is None:  # the automatic freeze comes after a window of the variance's history
        return [f"1-bit Adam did not leave its fp32 warm-up in {steps} steps: its automatic freeze waits for "
                "100 steps of Adam's variance, so this run was Adam's. Run more --steps, "
                "or set --freeze-step N by hand"]
    lines = [
        f"1-bit Adam's compressed step: {compressed * 1e3:.1f} ms vs Adam's {adam_step * 1e3:.1f} ms "
        f"({adam_step / compressed:.2f}x); the whole run {onebit['train_time_s']:.1f} s vs {adam['train_time_s']:.1f} s "
        f"({adam['train_time_s'] / onebit['train_time_s']:.2f}x), sending "
        f"{adam['bytes_sent_per_rank'] / onebit['bytes_sent_per_rank']:.1f}x fewer bytes "
        f"({onebit['eval_loss'] / adam['eval_loss'] - 1:+.1%} held-out loss)"
    ]
    if not nodes:
        compute = max(0.0, adam_step - (adam["comm_time_s"]["warmup"] or 0.0))
        # the warm-up, and the variance refreshes: bf16, half an fp32 step's bytes each
        exact = (steps - onebit["steps"]["compressed"] - onebit["steps"].get("refresh", 0) / 2) / steps
        lines.append("Loopback moves gigabytes per second between processes of one machine: the fp32 all-reduce "
                     "costs about what the compression costs, so no speed-up shows here. The cost model "
                     f"(`onebit model`) for this model, {world_size} nodes, {compute * 1e3:.1f} ms of compute "
                     "per step as measured:")
        for bandwidth in (1e9, 10e9):
            model = ModelInput(params=adam["parameters"], world_size=world_size, nodes=world_size,
                               bandwidth=bandwidth, compute=compute, warmup_fraction=exact,
                               refresh_every=None)  # counted in the measured share
            pred = {p.optimizer: p for p in predict(model)}
            a, o = pred["adam"], pred["onebit_adam"]
            lines.append(f"  {bandwidth / 1e9:g} Gbit/s: Adam {a.step_seconds * 1e3:.1f} ms/step, 1-bit Adam "
                         f"{o.step_seconds * 1e3:.1f} ms ({o.stage_speedup:.2f}x; whole run {o.end_to_end_speedup:.2f}x)")
    return lines


def steps_to_loss(records: list[dict[str, Any]], target: float, window: int = 10) -> int | None:
    """The first step (counted from 1) whose ``window``-step mean loss is at most ``target``."""
    for n in range(window, len(records) + 1):
        if sum(r["loss"] for r in records[n - window : n]) / window <= target:
            return n
    return None


def time_to_loss(records: list[dict[str, Any]], target: float, window: int = 10) -> float | None:
    """Training time (step times after the first) until the ``window``-step mean loss first reaches ``target``."""
    n = steps_to_loss(records, target, window)
    return None if n is None else sum(r["step_time"] for r in records[1:n])


def _timed_stage(summary: dict[str, Any]) -> str | None:
    """The stage whose steps the comparisons time: the last one (1-bit Adam's compressed steps),
    or None where the steps alternate without a last stage (DiLoCo's inner steps and
    synchronisations): then all the steps."""
    steps = summary["step_time_s"]
    return "compressed" if steps.get("compressed") else "warmup" if steps.get("warmup") else None


def step_time(summary: dict[str, Any], records: list[dict[str, Any]]) -> float | None:
    """A run's step time in seconds as the comparisons read it: the median of its timed stage's
    (:func:`_timed_stage`), or the mean of all its steps but the first, the synchronisations
    amortised."""
    stage = _timed_stage(summary)
    if stage is not None:
        return summary["step_time_s"][stage]
    times = [r["step_time"] for r in records[1:]]
    return sum(times) / len(times) if times else None


def cores_busy(summary: dict[str, Any], records: list[dict[str, Any]]) -> float | None:
    """The share of the host's cores a run's ranks kept busy over the steps :func:`step_time`
    reads (each stage's first left out): every rank's CPU time over the elapsed time times the
    cores. Summed over the steps, not per step: ranks that never wait for each other (the
    no-communication floor) each time their own window of a step. Near 1, the step is bound by
    the arithmetic of ranks sharing cores, which no overlap hides. None where the run did not
    record its CPU time or its ranks did not share one host (mpirun)."""
    cores, stage = summary.get("host_cores"), _timed_stage(summary)
    pairs = [(before, r) for before, r in zip(records, records[1:])
             if stage is None or before["stage"] == r["stage"] == stage]
    if not cores or not pairs or any(r.get("cpu_time") is None for _, r in pairs):
        return None
    elapsed = sum(r["time"] - before["time"] for before, r in pairs)
    return summary["config"]["world_size"] * sum(r["cpu_time"] for _, r in pairs) / (elapsed * cores)


def compare_rows(summaries: dict[str, dict], runs: dict[str, list[dict[str, Any]]], baseline: str,
                 model: ModelInput | None, *, hierarchical: bool = False) -> tuple[list[list[str]], str]:
    """The table of ``onebit compare`` (a header row, then one row per optimizer) and a note on
    the baseline: each run's loss, step times, speed-ups against the baseline, DDP and the
    no-communication floor, the share of the host's cores its ranks kept busy, time to the
    baseline's final loss, bytes, and with ``model`` (the emulated cluster's parameters) the
    cost model's prediction. ``runs``: each optimizer's ``metrics.jsonl`` records; the model's
    ``compute`` is taken from the baseline's step."""
    base = summaries[baseline]
    base_step = base["step_time_s"].get("warmup") or next(iter(base["step_time_s"].values()))
    base_comm = base["comm_time_s"].get("warmup") or 0.0
    compute = max(0.0, base_step - base_comm)
    note = f"{baseline}: {base_step * 1e3:.1f} ms/step" + (
        f", of which {base_comm * 1e3:.1f} ms ({100 * base_comm / base_step:.0f}%) in its collectives" if base_comm
        else " (its exchange, if any, runs inside backward: no share of the step is timed as communication)")

    def prediction(name: str) -> Any:
        """The cost model's row for ``name``, with 0/1 Adam's refresh and local-step shares as run."""
        if model is None:
            return None
        stages = [r["stage"] for r in runs[name]] or [""]
        shares = {k: sum(s == stage for s in stages) / len(stages) for k, stage in
                  (("refresh_fraction", "variance"), ("local_fraction", "local"))}
        key = name
        if name == "birder" and hierarchical:
            key = "birder_hierarchical"
        elif name == "diloco" and summaries[name]["config"].get("collective") == "allreduce":
            key = "diloco_allreduce"
        return next((p for p in predict(replace(model, compute=compute, **shares)) if p.optimizer == key), None)

    # What users run (DDP's overlapped fp32 all-reduce) and the compute floor (no communication),
    # when they ran in the same comparison: each optimizer's step (:func:`step_time`) against them.
    def step_of(name: str) -> float | None:
        return step_time(summaries[name], runs[name]) if name in summaries else None

    ddp, floor = step_of("ddp_allreduce"), step_of(NO_COMMUNICATION)
    rows = [["optimizer", "eval loss", "gap", "ms/step warmup", "ms/step compressed", "stage speedup",
             "vs DDP", "vs no-comm floor", "cores busy", "overlap", "end-to-end", "to baseline loss", "MB/rank",
             "reduction", "freeze", "model: stage", "model: end-to-end"]]
    target = summaries[baseline]["final_loss"]
    for name, s in summaries.items():
        reach = time_to_loss(runs[name], target)
        steps = s["step_time_s"]
        stage_time = step_of(name)
        pred = prediction(name)
        sent = s["bytes_sent_per_rank"]
        overlap = s.get("overlap", {})
        rows.append([
            name,
            f"{s['eval_loss']:.4f}",
            f"{100 * (s['eval_loss'] / base['eval_loss'] - 1):+.1f}%",
            ms(steps.get("warmup")),
            ms(steps.get("compressed")),
            f"{base_step / stage_time:.2f}x",
            f"{ddp / stage_time:.2f}x" if ddp else "-",
            f"{stage_time / floor:.2f}x" if floor else "-",
            fmt(cores_busy(s, runs[name]), ".0%"),
            fmt(overlap.get("compressed", overlap.get("warmup")), ".0%"),
            f"{base['train_time_s'] / s['train_time_s']:.2f}x" if s["train_time_s"] else "-",
            f"{base['train_time_s'] / reach:.2f}x" if reach else "never",
            f"{sent / 1e6:.1f}",
            f"{base['bytes_sent_per_rank'] / sent:.1f}x" if sent else "-",
            str(s["freeze_step"]) if s["freeze_step"] is not None else "-",
            f"{pred.stage_speedup:.2f}x" if pred else "-",
            f"{pred.end_to_end_speedup:.2f}x" if pred else "-",
        ])
    return rows, note


def round_rows(rounds: dict[str, Any]) -> list[list[str]]:
    """The table of ``onebit compare --rounds``: each optimizer's step time (:func:`step_time`,
    median over the rounds) and its ratio to the baseline's step *of the same round* -- the
    median, the range, and the geometric mean with its 95% t-interval over the rounds (a ratio
    above 1: slower than the baseline). A round counts only where both runs have a step time
    and neither skipped a step (a skipped step sends 4 bytes and looks fast). ``rounds``: the
    ``summary.json`` that command writes (``baseline``; per optimizer, each round's
    ``step_time``, ``cores_busy`` and ``skipped_steps``)."""
    baseline = rounds["baseline"]
    rows = [["optimizer", "rounds", "ms/step (median)", "x baseline (median)", "range",
             "geometric mean, 95% interval", "cores busy (median)"]]
    for name, times in rounds["step_time"].items():
        counted = [k for k, (t, b) in enumerate(zip(times, rounds["step_time"][baseline]))
                   if t is not None and b is not None
                   and not rounds["skipped_steps"][name][k] and not rounds["skipped_steps"][baseline][k]]
        if not counted:
            rows.append([name, "0", "-", "-", "-", "-", "-"])
            continue
        ratios = [times[k] / rounds["step_time"][baseline][k] for k in counted]
        mean, half = mean_interval([math.log(r) for r in ratios])
        interval = f"{math.exp(mean):.3f}x [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]"
        busy = [rounds["cores_busy"][name][k] for k in counted if rounds["cores_busy"][name][k] is not None]
        rows.append([name, str(len(counted)), ms(statistics.median(times[k] for k in counted)),
                     f"{statistics.median(ratios):.3f}x", f"{min(ratios):.3f}-{max(ratios):.3f}x", interval,
                     fmt(statistics.median(busy) if busy else None, ".0%")])
    return rows


def names_from(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """The names of a comma-separated ``flag`` value, each one of ``known`` (else the command exits saying so)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"onebit: {flag}: unknown {unknown or names}; available: {', '.join(known)}")
    return names
