"""Loss curves (vs samples and vs wall time) as a PNG; needs the optional matplotlib."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

__all__ = ["ema", "plot_convergence", "plot_losses"]


def ema(values: list[float], alpha: float = 0.05) -> list[float]:
    """Exponential moving average started at the first value, for curves a person reads."""
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the loss plot needs matplotlib: pip install 'onebit[plot]'") from exc
    return plt


def plot_convergence(results: list[dict[str, Any]], path: Path) -> Path:
    """One panel per task and counterpart (at its first learning rate), two a row: every cell's
    training loss (the first seed's, from its unperturbed weights), smoothed, over its faint
    raw curve; freeze steps marked."""
    plt = _pyplot()
    first = (results[0].get("seed", 0), results[0].get("perturbation", 0))  # one run per cell
    results = [r for r in results if (r.get("seed", 0), r.get("perturbation", 0)) == first]
    tasks = list(dict.fromkeys(r["task"] for r in results))
    families = list(dict.fromkeys(r["family"] for r in results))
    panels = [(task, family) for task in tasks for family in families
              if any(r["task"] == task and r["family"] == family for r in results)]
    # two panels a row at most: the figure stays readable at a documentation page's width
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (task, family) in zip(axes.flat, panels):
        cells = [r for r in results if r["task"] == task and r["family"] == family]
        lr = cells[0]["lr"]
        for r in cells:
            if r["lr"] != lr:
                continue
            steps = range(1, len(r["losses"]) + 1)
            (line,) = ax.plot(steps, ema(r["losses"]), lw=1.2, label=r["label"])
            ax.plot(steps, r["losses"], lw=0.5, alpha=0.2, color=line.get_color())
            if r["freeze_step"]:
                ax.axvline(r["freeze_step"], color=line.get_color(), ls=":", lw=0.8)
        finite = [v for r in cells if r["lr"] == lr for v in r["losses"][len(r["losses"]) // 10:]
                  if math.isfinite(v)]
        if finite:
            ax.set_ylim(min(finite) * 0.95, max(finite) * 1.05)
        ax.set_title(f"{task}: {family} family, lr {lr:g}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.supxlabel("step (dotted: freeze)")
    fig.supylabel("training loss (smoothed over raw)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _training_time(records: list[dict[str, Any]]) -> list[float]:
    """Seconds of training up to each step: the steps' own times added up (what the tables print),
    without the logging and evaluation between them; a run without step times, its wall clock."""
    if any(r.get("step_time") is None for r in records):
        return [r["time"] for r in records]
    return list(itertools.accumulate(r["step_time"] for r in records))


def plot_losses(runs: dict[str, list[dict[str, Any]]], path: Path, title: str = "") -> Path:
    """Write ``path``: training loss against samples and against training time (each run smoothed
    by :func:`ema` over its faint raw curve, the freeze step dotted), and the bytes each rank
    sent per step; raises ImportError naming the extra if matplotlib is missing."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, records in runs.items():
        loss = [r["loss"] for r in records]
        smooth = ema(loss)
        freeze = next((i for i, r in enumerate(records) if r["stage"] == "compressed"), 0)
        for ax, x in ((axes[0], [r["samples"] for r in records]), (axes[1], _training_time(records))):
            (line,) = ax.plot(x, smooth, lw=1.6, label=name)
            ax.plot(x, loss, lw=0.6, alpha=0.25, color=line.get_color())
            if freeze:  # the last warm-up step: where the compression stage starts
                ax.axvline(x[freeze - 1], color=line.get_color(), ls=":", lw=1.0)
        axes[2].plot([r["step"] for r in records], [max(r["bytes_sent"], 1) for r in records],
                     lw=1.4, color=line.get_color(), label=name)
    axes[0].set_xlabel("samples")
    axes[1].set_xlabel("training time (s): the steps' times added up, as the table prints them")
    axes[2].set_xlabel("step")
    for ax in axes[:2]:
        ax.set_ylabel("training loss (line: smoothed; faint: each step)")
        ax.set_title("dotted line: the last fp32 step (the freeze)", fontsize=9)
    axes[2].set_ylabel("bytes sent per rank per step")
    axes[2].set_yscale("log")
    finite = [v for records in runs.values() for v in ema([r["loss"] for r in records])[len(records) // 20:]
              if math.isfinite(v)]
    if finite:
        for ax in axes[:2]:
            ax.set_ylim(min(finite) * 0.97, max(finite) * 1.03)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_LANES = ("step", "backward", "compute", "wire", "link")


def _rates(sent: list[tuple[float, int]], window: float = 5.0) -> list[tuple[float, float]]:
    """``(ms, bytes sent so far)`` samples -> ``(ms, Mbit/s)`` over consecutive ``window``-ms bins
    (a shaped link's token bucket lets bursts out faster than its rate over a millisecond)."""
    if len(sent) < 2:
        return []
    curve, (t, b) = [], sent[0]
    for t1, b1 in sent[1:]:
        if t1 - t >= window or (t1, b1) == sent[-1]:
            curve.append((t, (b1 - b) * 8e-3 / (t1 - t) if t1 > t else 0.0))
            t, b = t1, b1
    return [*curve, (t, curve[-1][1])]  # the last bin drawn to its end (a "post" step)


def plot_trace(events: list[dict[str, Any]], path: Path) -> Path:
    """Write ``path``: a traced step (:func:`onebit.comm.trace`, Chrome's event format) as one row
    per rank and lane -- the optimizer's steps, the buckets ready and launched during backward,
    the compressed collectives' arithmetic and their collectives in flight -- each span coloured
    by what it is and labelled with its bucket; a bucket's gradients ready are ticks. A traced
    link is drawn as its rate over 5 ms, every rank's on one scale."""
    plt = _pyplot()
    rows = sorted({(e["pid"], e["tid"]) for e in events}, key=lambda r: (r[0], _LANES.index(r[1])
                                                                           if r[1] in _LANES else len(_LANES)))
    names = sorted({e["name"] for e in events if e["ph"] == "X"})
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    rates = {(rank, lane): _rates(sorted((e["ts"] / 1e3, e["args"]["bytes"]) for e in events
                                         if (e["pid"], e["tid"], e["ph"]) == (rank, lane, "C")))
             for rank, lane in rows}
    peak = max((r for curve in rates.values() for _, r in curve), default=0.0) or 1.0
    fig, ax = plt.subplots(figsize=(14, 0.5 + 0.45 * len(rows)))
    end = max((e["ts"] + e.get("dur", 0.0)) / 1e3 for e in events)
    for y, (rank, lane) in enumerate(rows):
        spans = sorted((e for e in events if (e["pid"], e["tid"]) == (rank, lane) and e["ph"] != "C"),
                       key=lambda e: -e.get("dur", 0))
        curve = rates[rank, lane]
        if curve:  # the link's rate, every rank's peak at the row's top
            ax.fill_between([t for t, _ in curve], y + 0.4, [y + 0.4 - 0.8 * r / peak for _, r in curve],
                            step="post", color="tab:gray", linewidth=0)
        for k, e in enumerate(spans):  # the longest first: a span inside another drawn over it, thinner
            start = e["ts"] / 1e3
            bucket = e["args"].get("bucket")
            if e["ph"] != "X":
                ax.plot([start, start], [y - 0.4, y + 0.4], color="black", lw=1.0)
                continue
            width = e["dur"] / 1e3
            depth = sum(o["ph"] == "X" and o["ts"] <= e["ts"] and o["ts"] + o["dur"] >= e["ts"] + e["dur"]
                        for o in spans[:k])
            height = 0.7 * 0.6**depth
            ax.broken_barh([(start, width)], (y - height / 2, height), facecolors=colours[e["name"]],
                           edgecolor="white", linewidth=0.3)
            label = e["name"] if bucket is None else f"{e['name']} {bucket}"
            inner = any(o is not e and o["ph"] == "X" and e["ts"] <= o["ts"]
                        and o["ts"] + o["dur"] <= e["ts"] + e["dur"] for o in spans)
            if width > end / 60:  # a span holding others is labelled at its top left, the others in their middle
                ax.text(start if inner else start + width / 2, y - height / 2 + 0.02 if inner else y, label,
                        ha="left" if inner else "center", va="top" if inner else "center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {rank} {lane}" + (f" (0-{peak:.0f} Mbit/s)" if lane == "link" else "")
                        for rank, lane in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("ms from the start of the traced step (ticks: a bucket's gradients ready)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
