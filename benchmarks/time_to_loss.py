"""Time to the counterpart's loss with each optimizer's defaults, on the emulated cluster.

The headline benchmark: how much sooner than the uncompressed optimizer users run (DDP AdamW;
LAMB for 1-bit LAMB) each onebit optimizer reaches that optimizer's final loss, built with its
defaults and a learning rate only, over paired seeds, at each link speed. Two kinds of runs:

* ``--curves``: long ``onebit compare`` runs on an unshaped link, one per optimizer and seed, with
  no ``--freeze-step``, ``--sync-every`` or other option (compare then builds each optimizer with
  its defaults; the report refuses a run that set one). A counterpart's run of a seed sets that
  seed's target: its final loss (the mean of its last 10 steps' training loss). Every step's bits
  are the same whatever the link's speed, so the curve is the cluster's.
* ``--cluster-times``: short ``onebit compare`` runs on the emulated cluster (``--nodes``, with
  the no-communication floor ``local_adam``), whose median step time of each stage (1-bit Adam's
  fp32 warm-up, compressed steps and variance refreshes, 0/1 Adam's variance refreshes, DiLoCo's inner steps and
  synchronisations) prices each step of a curve. A stage costs what it costs whenever it comes,
  so these may set a freeze or an interval by hand to reach each stage in a few steps.

``--on-cluster`` adds long runs made on the cluster itself: the time by their own clock to their
seed's target, beside their steps added up at the short runs' step times. A directory of
``--curves`` or ``--on-cluster`` given as ``DIR:NAME,NAME`` reads only those optimizers of its
comparison (the others made with defaults since changed, their new runs given separately)::

    python benchmarks/time_to_loss.py --curves benchmarks/results/time-to-loss/mlp/* \\
        --cluster-times benchmarks/results/time-to-loss/cluster-mlp-*

For each task, one row per optimizer and learning rate: the seeds that reached the target and the
steps they took, how much sooner than the counterpart at each link (the geometric mean of the
paired seeds' ratios with its 95% t-interval, and the worst seed), the bytes a rank sent until
then against the counterpart's, the share of the steps compressed and the held-out loss at the end.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from pathlib import Path

from _records import (Pick, added_up, compare_runs, compare_sources, parse_pick, picked_runs, picked_sources,
                      refreshes_sent, same_losses)

from onebit.bench._analysis import ratio_interval, steps_to_loss
from onebit.optim import REGISTRY

COUNTERPART = {"onebit_lamb": "lamb"}  # the others': DDP AdamW
_ORDER = ("ddp_allreduce", "onebit_adam", "zero_one_adam", "lamb", "onebit_lamb", "birder", "comp_ams", "diloco")
DDP = "ddp_allreduce"
FLOOR = "local_adam"
# what a step's work depends on, for pricing a curve's steps by a cluster run (the learning rate,
# the freeze and DiLoCo's interval change when a stage comes, not what it costs)
_WORK = ("task", "d_model", "layers", "heads", "context", "hidden", "batch_size", "world_size", "bucket_cap_mb",
         "hierarchical", "fragments", "delay", "collective", "compressor")
# options a run with the defaults leaves unset (1-bit Adam's and LAMB's default freeze is "auto")
_OPTIONS = ("sync_every", "fragments", "delay", "collective", "compressor", "local_step_scaler", "refresh_every",
            "refresh_dtype", "refresh_schedule")


def _defaults(name: str, summary: dict) -> None:
    """Refuse a curve whose optimizer was not built with its defaults (the references take none of
    these options: DDP's and LAMB's runs may record the freeze compare's default gave before)."""
    if name in (DDP, *COUNTERPART.values()):
        return
    config = summary["config"]
    set_by_hand = [f"{k}={config[k]!r}" for k in _OPTIONS if config.get(k) is not None]
    if config["freeze_step"] not in (None, "auto"):
        set_by_hand.append(f"freeze_step={config['freeze_step']!r}")
    # compare passed bias_correction=True to every optimizer that takes it before it passed none
    own = inspect.signature(REGISTRY[name].cls).parameters.get("bias_correction")
    if config.get("bias_correction") is not None and own is not None and config["bias_correction"] != own.default:
        set_by_hand.append(f"bias_correction={config['bias_correction']!r}")
    if set_by_hand:
        raise SystemExit(f"{name} (seed {config['seed']}): not its defaults ({', '.join(set_by_hand)})")


def _link(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:g} Gbit/s" if bandwidth >= 1e9 else f"{bandwidth / 1e6:g} Mbit/s"


def _rank(name: str) -> int:
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)


def _against(name: str) -> str:
    """Whose time to whose loss a run of ``name`` is held to: DDP AdamW's, or its counterpart's."""
    return DDP if name in (DDP, *COUNTERPART.values()) else COUNTERPART.get(name, DDP)


def _target(counterpart: str, config: dict) -> tuple:
    """The key of ``counterpart``'s run whose final loss is the target of a run with ``config``: the
    same task and seed (and learning rate, for a counterpart other than DDP AdamW)."""
    return config["task"], counterpart, None if counterpart == DDP else config["lr"], config["seed"]


def _curve(name: str, config: dict) -> tuple:
    """What tells one curve from another: its optimizer, task, learning rate and seed."""
    return name, config["task"], config["lr"], config["seed"]


def _timing(link: float, name: str, config: dict) -> tuple:
    """The key of the cluster run at ``link`` whose steps do the work of ``name``'s with ``config``
    (1-bit Adam's: and what its refreshes send, fp32 in the runs from before ``refresh_dtype``)."""
    sends = (refreshes_sent(config),) if name == "onebit_adam" else ()
    return link, name, tuple(config.get(k) for k in _WORK) + sends


def _ratio_text(ratios: dict[int, float | None], minutes: list[float]) -> str:
    """Paired seeds' ratios: geometric mean, 95% interval, worst seed (or the seeds that never got
    there), after the mean time to the loss in minutes."""
    missed = [seed for seed, r in ratios.items() if r is None]
    if missed:
        return f"not reached (seed{'s' if len(missed) > 1 else ''} {', '.join(map(str, missed))} of {len(ratios)})"
    took = f"{statistics.fmean(minutes):,.1f} min: "
    if len(ratios) == 1:
        (seed, r), = ratios.items()
        return took + f"{r:.2f}x (seed {seed} only)"
    mean, low, high = ratio_interval(list(ratios.values()))
    worst = min(ratios, key=ratios.get)
    return took + f"**{mean:.2f}x** [{low:.2f}, {high:.2f}]; worst seed {worst} {ratios[worst]:.2f}x"


def report(curve_dirs: list[Pick], cluster_dirs: list[Path], on_cluster_dirs: list[Pick]) -> str:
    curves = [(n, s, r) for pick in curve_dirs for n, (s, r) in picked_runs(pick).items()]
    timed: dict[tuple, dict] = {}  # (link, name, work) -> the cluster run's summary
    for d in cluster_dirs:
        runs = compare_runs(d)
        if FLOOR not in runs:
            raise SystemExit(f"{d}: no {FLOOR} run, the no-communication floor of the comparison")
        for name, (summary, _) in runs.items():
            if name == FLOOR:  # each comparison's own, not a curve's price
                continue
            if summary.get("skipped_steps"):
                raise SystemExit(f"{d}: {name} skipped steps: its speed does not count")
            key = _timing(summary["cluster"]["bandwidth"], name, summary["config"])
            if key in timed:
                raise SystemExit(f"{d}: {name} at {_link(key[0])} timed twice, give one")
            timed[key] = summary
    links = sorted({key[0] for key in timed})
    targets: dict[tuple, tuple[float, list[dict], dict]] = {}  # (task, counterpart, lr, seed) -> its final loss
    for name, summary, records in curves:
        _defaults(name, summary)
        if name in (DDP, *COUNTERPART.values()):
            c = summary["config"]
            key = _target(name, c)
            if key in targets:
                raise SystemExit(f"two {name} runs of seed {c['seed']} on {c['task']}: its final loss is the target")
            targets[key] = (summary["final_loss"], records, summary)

    def price(link: float, name: str, summary: dict, records: list[dict]) -> float | None:
        cluster = timed.get(_timing(link, name, summary["config"]))
        return None if cluster is None else added_up(f"{name} at {_link(link)}", cluster, records)

    out = []
    for task in dict.fromkeys(s["config"]["task"] for _, s, _ in curves):
        rows: dict[tuple[str, float], list[tuple]] = {}
        for name, summary, records in curves:
            if summary["config"]["task"] == task and name != FLOOR:
                rows.setdefault((name, summary["config"]["lr"]), []).append((summary, records))
        head = "| optimizer | lr | against | " + " | ".join(f"{_link(link)}: sooner" for link in links)
        lines = [head + " | reached (steps) | bytes to the loss | compressed | held-out at end |",
                 "|---|---|---|" + "---|" * len(links) + "---|---|---|---|"]
        for (name, lr), runs in sorted(rows.items(), key=lambda row: (_rank(row[0][0]), -row[0][1])):
            against = _against(name)
            ratios: dict[float, dict[int, float | None]] = {link: {} for link in links}
            minutes: dict[float, list[float]] = {link: [] for link in links}
            reached, sent, mine_sent, compressed, heldout = [], [], [], [], []
            for summary, records in sorted(runs, key=lambda r: r[0]["config"]["seed"]):
                seed = summary["config"]["seed"]
                goal = targets.get(_target(against, summary["config"]))
                if goal is None:
                    raise SystemExit(f"{name} on {task}, seed {seed}: no {against} run of that seed sets its target")
                loss, theirs, their_summary = goal
                n = steps_to_loss(records, loss)
                m = steps_to_loss(theirs, loss)
                reached.append(f"{n:,}" if n else "—")
                if name != "diloco":  # its steps are all local, its synchronisations 1-bit
                    compressed.append(sum(r["stage"] == "compressed" for r in records) / len(records))
                heldout.append(summary["eval_loss"])
                if n:
                    mine_sent.append(sum(r["bytes_sent"] for r in records[:n]))
                    sent.append(sum(r["bytes_sent"] for r in theirs[:m]))
                for link in links:
                    mine = price(link, name, summary, records[:n]) if n else None
                    base = price(link, against, their_summary, theirs[:m])
                    if base is None:
                        raise SystemExit(f"{against} on {task} at {_link(link)}: no cluster run times it")
                    if n and mine is None:
                        raise SystemExit(f"{name} on {task} at {_link(link)}: no cluster run times it")
                    ratios[link][seed] = base / mine if n else None
                    if n:
                        minutes[link].append(mine / 60)
            fewer = (f"{statistics.fmean(sent) / statistics.fmean(mine_sent):.1f}x fewer"
                     if mine_sent and len(mine_sent) == len(runs) and name != against else "—")
            share = f"{100 * statistics.fmean(compressed):.0f}%" if compressed else "—"
            lines.append(f"| {name} | {lr:g} | {against} | "
                         + " | ".join(f"{statistics.fmean(minutes[link]):,.1f} min (the reference)" if name == against
                                      else _ratio_text(ratios[link], minutes[link]) for link in links)
                         + f" | {len(mine_sent)}/{len(runs)} ({', '.join(reached)}) | {fewer} | {share} "
                         f"| {statistics.fmean(heldout):.3f} ({len(records):,} steps) |")
        out.append(f"**{task}**\n\n" + "\n".join(lines))
    same = {_curve(n, s["config"]): r for n, s, r in curves}
    measured = [_measured(name, summary, records, timed, targets, same.get(_curve(name, summary["config"])))
                for pick in on_cluster_dirs for name, (summary, records) in picked_runs(pick).items() if name != FLOOR]
    goals = [f"{against} on {task}" + (f" (lr {lr:g})" if lr else "")
             for task, against, lr in dict.fromkeys(key[:3] for key in targets)]
    return ("\n\n".join(out) + "\n\n" + "".join(f"- {m}\n" for m in measured) + ("\n" if measured else "")
            + f"Targets: each seed's final loss of {', '.join(goals)} "
            "(the mean of its last 10 steps' training loss); a run reaches it when the mean of 10 consecutive "
            "steps is at most that, and each link's time to it adds up each step at its stage's step time on the "
            f"cluster. Curves: {picked_sources(curve_dirs)} Cluster times: {compare_sources(cluster_dirs)}"
            + (f" On the cluster itself: {picked_sources(on_cluster_dirs)}" if on_cluster_dirs else "") + "\n")


def _measured(name: str, summary: dict, records: list[dict], timed: dict, targets: dict,
              curve: list[dict] | None) -> str:
    """A long run on the cluster: its own clock to its seed's target, beside its steps added up,
    and how many of its first steps' losses are its curve's (the premise: a link does not change
    a step's bits)."""
    _defaults(name, summary)
    c, link = summary["config"], summary["cluster"]["bandwidth"]
    who = f"{name}, {c['task']}, seed {c['seed']}, on the cluster at {_link(link)}"
    if summary.get("skipped_steps"):
        raise SystemExit(f"{who}: skipped steps: its speed does not count")
    other = _against(name)
    goal = targets.get(_target(other, c))
    if goal is None:
        raise SystemExit(f"{who}: no {other} curve of that seed sets its target")
    n = steps_to_loss(records, goal[0])
    if n is None:
        return f"{who}: did not reach {other}'s loss in {len(records):,} steps."
    cluster = timed.get(_timing(link, name, c))
    if cluster is None:
        raise SystemExit(f"{who}: no short cluster run times it")
    added = added_up(who, cluster, records[:n])
    clock = records[n - 1]["time"]
    equal = "no curve of its seed" if curve is None else \
        f"its losses are its curve's for {same_losses(records, curve):,} of {len(records):,} steps"
    return (f"{who}: {other}'s loss at step {n:,}, after {clock / 60:.2f} min by its own clock; its steps at the "
            f"short runs' step times add up to {added / 60:.2f} min ({clock / added:.3f}x that); {equal}.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", nargs="+", type=parse_pick, required=True, metavar="DIR[:NAME,...]")
    parser.add_argument("--cluster-times", nargs="+", type=Path, required=True, metavar="DIR")
    parser.add_argument("--on-cluster", nargs="+", type=parse_pick, default=[], metavar="DIR[:NAME,...]")
    args = parser.parse_args()
    print(report(args.curves, args.cluster_times, args.on_cluster), end="")
