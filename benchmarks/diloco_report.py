"""DiLoCo's convergence evidence by synchronisation interval H, from convergence-matrix runs.

Reads the ``summary.json`` of ``onebit bench convergence`` runs of DiLoCo (the same task,
steps, seeds and workers; runs of one setting may come from several files) and prints, for
each H and outer setting, the held-out loss's paired gap to DDP AdamW (the matrix's
``adamw``) and to DiLoCo with the exact fp32 exchange and the paper's outer step
(``diloco_identity``), each as a mean with its 95% t-interval over the seeds and the worst
seed, and the bytes a rank sent against DDP AdamW's::

    python benchmarks/diloco_report.py --report benchmarks/results/diloco-convergence/summary.json \\
        benchmarks/results/diloco-convergence-fedavg-no-ef/summary.json

Runs record their arguments, and each is named by them; a rerun that records them replaces an
older run of the same setting and seed (the same losses, and today's bytes). Runs from before they did record only
their matrix labels, whose meaning follows the defaults of their day: ``SETTINGS`` names each
label as run on 2026-11-26 before that change, while ``error_feedback`` defaulted to True
(``diloco`` and ``diloco_fedavg`` carried the errors) and every 1-bit exchange was the
compressed all-reduce; such runs of another day are refused.

``--cluster`` reads ``onebit compare`` runs on the emulated cluster instead (each directory one
comparison, with the no-communication floor ``local_adam`` measured in it) and prints each
optimizer's mean step time against that floor, and against DDP's where a comparison at the same
link timed it (each against its own run's floor)::

    python benchmarks/diloco_report.py --cluster benchmarks/results/diloco-cluster-*

``--time-to-loss`` puts the two together for the time to DDP AdamW's final loss on the emulated
cluster: the loss curves of long ``onebit compare`` runs on an unshaped link (DDP's among them;
the bits of every step do not depend on the link's speed, which the report checks against the
cluster runs' losses), and the step times of the short runs on the cluster, each stage's own
(1-bit Adam's fp32 warm-up and compressed steps, DiLoCo's inner steps and synchronisations)::

    python benchmarks/diloco_report.py --time-to-loss benchmarks/results/diloco-loss-* \
        --cluster-times benchmarks/results/diloco-cluster-100mbit-ddp benchmarks/results/diloco-cluster-100mbit

(each curve timed by the one cluster run of its optimizer and setting at each link). A long run
made on the cluster itself (its ``summary.json`` names the cluster) is not a curve: the time its
own clock took to the target is printed beside its steps added up at the step times of the short
cluster run of its setting and link on the same machine.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
from pathlib import Path

from _records import (Pick, added_up, compare_runs, compare_sources, parse_pick, picked_runs, picked_sources,
                      refreshes_sent, same_losses)

from onebit import DiLoCo
from onebit.bench._analysis import mean_interval, ratio_interval, step_time, steps_to_loss
from onebit.bench._matrix import _gap, _run
from onebit.optim._fragments import default_scales
from onebit.optim._wrapped import OUTER_STEPS

# label as run on SETTINGS_DATE, by a run without its arguments -> (outer step, exchange)
SETTINGS_DATE = "2026-11-26"
SETTINGS = {
    "diloco_identity": ("paper's", "fp32"),
    "diloco": ("paper's", "1-bit all-reduce, error feedback"),
    "diloco_no_ef": ("paper's", "1-bit all-reduce"),
    "diloco_fedavg_identity": ("averaging", "fp32"),
    "diloco_fedavg": ("averaging", "1-bit all-reduce, error feedback"),
    "diloco_fedavg_no_ef": ("averaging", "1-bit all-reduce"),
}
OUTER = {(0.7, 0.9): "paper's", (1.0, 0.0): "averaging"}
SPARSELOCO = "SparseLoCo's"  # averaging, each rank's error carried with a decay in the place of momentum
EXACT = ("paper's", "fp32")  # what "vs fp32 DiLoCo" compares with
COLLECTIVES = {"allgather": "all-gather", "allreduce": "all-reduce"}
CODES = {"sign": "1-bit", "chunk_topk": "Top-k 2-bit", "block_sign": "Block-Sign"}
# A run that left sync_every unset (None) took DiLoCo's default: today's, 500 since DiLoCo's first runs
DEFAULT_H = inspect.signature(DiLoCo).parameters["sync_every"].default


def setting(run: dict, date: str) -> tuple[str, str] | None:
    """``(outer step, exchange)`` of a DiLoCo run (None for another optimizer's)."""
    a = run.get("arguments")
    if a is None:
        if run["optimizer"] in SETTINGS and date != SETTINGS_DATE:
            raise SystemExit(f"a {run['optimizer']} run of {date} without its arguments: SETTINGS names the "
                             f"labels of {SETTINGS_DATE}")
        return SETTINGS.get(run["optimizer"])
    if "sync_every" not in a:
        return None
    a = _resolved(a)
    outer = OUTER.get((a["outer_lr"], a["outer_momentum"]), f"lr {a['outer_lr']}, momentum {a['outer_momentum']}")
    decay = a.get("error_decay", 1.0)  # runs from before the option kept their errors whole
    if a["compressor"] == "identity":
        return outer, "fp32"
    if a["outer_momentum"] == 0.0 and a["error_feedback"] and decay != 1:  # SparseLoCo's, at any outer lr
        outer = SPARSELOCO if a["outer_lr"] == 1.0 else f"{SPARSELOCO}, outer lr {a['outer_lr']}"
        feedback = "" if decay == 0.95 else f", error decay {decay}"
    else:
        feedback = ", error feedback" + (f" decayed by {decay}" if decay != 1 else "") if a["error_feedback"] else ""
    exchange = f"{CODES.get(a['compressor'], a['compressor'])} {COLLECTIVES[a['collective']]}"
    exchange += {"row": ", a scale per row", "chunk": ", a scale per chunk"}.get(a.get("scales", "tensor"), "")
    streamed = f", {a['fragments']} fragments, delay {a['delay']}" if a["fragments"] > 1 else ""
    return outer, exchange + feedback + streamed


def _resolved(a: dict) -> dict:
    """A DiLoCo run's arguments with those left to its outer step (None) made its outer step's,
    and its scales its compressor's (runs from before ``outer_step`` name every value)."""
    step = OUTER_STEPS[a.get("outer_step", "nesterov")]
    a = {**a, **{k: v for k, v in step.items() if a.get(k) is None}}
    if a.get("scales", "tensor") is None:
        a["scales"] = default_scales(a["compressor"])
    return a


def report(paths: list[Path]) -> str:
    """The table of the runs in ``paths``; one per task, each under its name, where they hold several."""
    summaries = [json.loads(p.read_text()) for p in paths]
    for key in ("steps", "world_size", "batch_per_rank"):
        if len({s[key] for s in summaries}) != 1:
            raise SystemExit(f"the runs differ in {key}: {sorted({s[key] for s in summaries})}")
    tasks = list(dict.fromkeys(r["task"] for s in summaries for r in s["runs"]))
    if len(tasks) == 1:
        return _table(summaries, tasks[0])
    return "\n".join(f"`{task}`:\n\n{_table(summaries, task)}" for task in tasks)


def _table(summaries: list[dict], task: str) -> str:
    total = summaries[0]["steps"]
    runs = [(r, s["provenance"]["date"]) for s in summaries for r in s["runs"] if r["task"] == task]
    if len({r["lr"] for r, _ in runs}) != 1:
        raise SystemExit(f"the {task} runs are of several learning rates: report one at a time")

    adamw = {_run(r): r for r, _ in runs if r["label"] == "adamw"}
    by: dict[tuple[int, tuple[str, str]], dict] = {}
    for r, date in runs:
        named = setting(r, date)
        if named is None or r["freeze_fraction"] is None:  # DiLoCo's H, as run
            continue
        cell = by.setdefault((round(r["freeze_fraction"] * total), named), {})
        seen = cell.get(_run(r))
        if seen is not None and ("arguments" in seen) == ("arguments" in r):
            raise SystemExit(f"two runs of {named} at {r['label']}, seed {r['seed']}: give each once")
        if seen is None or "arguments" in r:  # a rerun recording its arguments replaces an older run
            cell[_run(r)] = r

    def gap(mine: dict, theirs: dict) -> str:
        pairs = [k for k in mine if k in theirs]
        if not pairs:
            return "—"
        gaps = [_gap(mine[k], theirs[k]) for k in pairs]  # % of held-out loss; None where not finite
        if None in gaps:
            return f"non-finite ({gaps.count(None)}/{len(gaps)})"
        mean, half = mean_interval(gaps)
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        unit = " points" if task == "digits" else "%"  # digits: of its error rate
        return f"{mean:+.1f}{unit} ± {half:.1f} (worst {gaps[worst]:+.1f}, seed {pairs[worst][0]})"

    ddp_bytes = statistics.fmean(r["bytes_sent_per_rank"] for r in adamw.values())
    lines = ["| H | outer step | exchange | held-out loss | vs DDP AdamW | vs fp32 DiLoCo | fewer bytes than DDP |",
             "|---|---|---|---|---|---|---|"]
    outers = [*OUTER.values()]
    for h, (outer, exchange) in sorted(by, key=lambda k: (k[0], outers.index(k[1][0]) if k[1][0] in outers
                                                           else len(outers), k[1][0], k[1][1] != "fp32", k[1][1])):
        mine, exact = by[h, (outer, exchange)], by.get((h, EXACT), {})
        loss = statistics.fmean(r["heldout_loss"] for r in mine.values())
        sent = statistics.fmean(r["bytes_sent_per_rank"] for r in mine.values())
        lines.append(f"| {h} | {outer} | {exchange} | {loss:.3f} | {gap(mine, adamw)} "
                     f"| {'—' if (outer, exchange) == EXACT else gap(mine, exact)} | {ddp_bytes / sent:,.0f}x |")
    first = summaries[0]
    provenance = "; ".join(f"`{s['provenance']['command']}`" for s in summaries)
    dates: dict[str, dict[str, None]] = {}  # each machine's run dates, in the summaries' order
    for s in summaries:
        dates.setdefault(s["provenance"]["machine"], {})[s["provenance"]["date"]] = None
    where = "; ".join(f"{machine}, {' and '.join(days)}" for machine, days in dates.items())
    ddp_loss = statistics.fmean(r["heldout_loss"] for r in adamw.values())
    return ("\n".join(lines) + f"\n\nDDP AdamW: held-out loss {ddp_loss:.3f}, "
            f"{len(adamw)} seeds; {first['world_size']} workers, {total} steps of batch {first['batch_per_rank']} "
            f"per worker. {provenance}; {where}.\n")


def _setting(name: str, config: dict) -> str:
    if name == "diloco":
        streamed = f", {config['fragments']} fragments, delay {config['delay']}" if config["fragments"] else ""
        # no "collective": a run from before the option (the compressed all-reduce, the default then);
        # None: today's default, the all-gather
        collective = COLLECTIVES[config.get("collective", "allreduce") or "allgather"]
        return f"H = {config['sync_every'] or DEFAULT_H}{streamed}, {collective}"
    # compressor identity: Birder and Comp-AMS exchange fp32 every step (the label then says the compressor)
    sends = "" if config.get("compressor") == "identity" else "compressed steps"
    return {"onebit_adam": "compressed steps", "birder": sends, "comp_ams": sends, "local_adam": "no communication",
            "zero_one_adam": "compressed steps, fp32 variance refreshes"}.get(name, "")


def _refreshes(name: str, records: list[dict]) -> str:
    """0/1 Adam's refreshes as run: how many, and how far apart the last two (its schedule, which
    the run's config does not record)."""
    steps = [r["step"] for r in records if r["stage"] == "variance"]
    if name != "zero_one_adam" or len(steps) < 2:
        return ""
    if len(steps) == len(records):
        return ": every step"
    return f": {len(steps)}, the last two {steps[-1] - steps[-2]} steps apart"


def cluster_report(dirs: list[Path]) -> str:
    rows, ddp = [], {}
    for d in dirs:
        summaries = json.loads((d / "summary.json").read_text())
        if "local_adam" not in summaries:
            raise SystemExit(f"{d}: no local_adam run, the no-communication floor of the comparison")
        steps = {n: 1e3 * step_time(s, records) for n, (s, records) in compare_runs(d).items()}
        link = summaries["local_adam"]["cluster"]["bandwidth"]
        for name, ms in steps.items():
            if summaries[name].get("skipped_steps"):
                raise SystemExit(f"{d}: {name} skipped steps: its speed does not count")
            ratio = ms / steps["local_adam"]
            if name == "ddp_allreduce":
                ddp[link] = ratio
            elif name != "local_adam":
                rows.append((link, name, _setting(name, summaries[name]["config"]), ms, steps["local_adam"], ratio))
    lines = ["| link | optimizer | setting | ms/step | its run's floor | × floor | faster than DDP |",
             "|---|---|---|---|---|---|---|"]
    for link, name, setting, ms, floor, ratio in sorted(rows, key=lambda r: (-r[0], r[1], r[2])):
        against = f"{ddp[link] / ratio:.1f}x" if link in ddp else "—"
        lines.append(f"| {link / 1e6:g} Mbit/s | {name} | {setting} | {ms:,.0f} | {floor:,.0f} | {ratio:.2f} "
                     f"| {against} |")
    for link, ratio in sorted(ddp.items(), reverse=True):
        lines.append(f"| {link / 1e6:g} Mbit/s | ddp_allreduce | every step, fp32 | | | {ratio:.2f} | 1.0x |")
    return "\n".join(lines) + f"\n\n{compare_sources(dirs)}\n"


def _curve_setting(name: str, summary: dict) -> str:
    config = summary["config"]
    # what the run changed from the defaults of the time-to-loss runs (absent from runs before the option)
    extra = "".join(f", {key} {config[key]}" for key, default in (("compressor", None), ("schedule", "constant"),
                                                                   ("refresh_every", None))
                    if config.get(key, default) != default)
    if name == "onebit_adam":
        asked, took = config["freeze_step"], summary["freeze_step"]
        asked = "auto" if asked is None else asked  # None: the optimizer's own, "auto"
        if "refresh" in summary.get("step_time_s", ()):
            sends = refreshes_sent(config)
            extra = (f", variance refreshed in {sends}" + extra if config.get("refresh_every") is None
                     else f"{extra} in {sends}")
        return (f"freeze_step={asked}: " + ("never froze" if took is None else f"compressed from step {took + 1}")
                + extra)
    if name == "zero_one_adam" and set(summary.get("steps", ())) == {"variance"}:  # refreshed at every step
        return "fp32 variance refreshes" + extra
    return (_setting(name, config) or "every step, fp32") + extra


def curves_report(picks: list[Pick], windows: list[int], width: int = 25, reach: bool = False) -> str:
    """Each run's held-out loss, skipped steps and mean training loss over the ``width`` steps up
    to each step of ``windows``: where a run leaves another's curve. ``reach``: also the first step
    whose 10-step mean training loss is at most the final loss (the mean of its last 10 steps) of
    the first run of its seed given, as the time-to-loss runs' target."""
    # the result first: the columns a narrow page shows without scrolling
    lines = ["| optimizer | setting | seed | held-out | skipped | " + ("reached | " if reach else "")
             + " | ".join(f"{w - width + 1}–{w}" for w in windows) + " |",
             "|---|---|---|---|---|" + "---|" * (len(windows) + reach)]
    targets: dict[int, float] = {}  # each seed's: its first run's final loss
    for pick in picks:
        for name, (summary, records) in picked_runs(pick).items():
            if windows[-1] > len(records):
                raise SystemExit(f"{pick[0]}: {name} ran {len(records)} steps, fewer than {windows[-1]}")
            means = [statistics.fmean(r["loss"] for r in records[w - width: w]) for w in windows]
            setting = _curve_setting(name, summary) + _refreshes(name, records)
            seed = summary["config"]["seed"]
            reached = ""
            if reach and seed not in targets:
                targets[seed] = summary["final_loss"]
                reached = "— (the target) | "
            elif reach:
                at = steps_to_loss(records, targets[seed])
                reached = f"not in {len(records):,} steps | " if at is None else f"step {at:,} of {len(records):,} | "
            cells = [f"{m:.3f}" for m in means]
            lines.append(f"| {name} | {setting} | {seed} | {summary['eval_loss']:.3f} "
                         f"| {summary['skipped_steps'] or 0} | {reached}{' | '.join(cells)} |")
    return "\n".join(lines) + f"\n\n{picked_sources(picks)}\n"


# what must agree between a loss run and the cluster run timing it (the step's work), and DiLoCo's schedule
_TIMED_AS = ("task", "d_model", "layers", "heads", "context", "batch_size", "world_size", "bucket_cap_mb",
             "hierarchical")
_DILOCO = ("sync_every", "fragments", "delay")


def _work(name: str, config: dict) -> tuple:
    """What a step of ``name`` with ``config`` does, for matching a loss run with its cluster run."""
    if name != "diloco":
        return tuple(config.get(k) for k in _TIMED_AS)
    # as _setting reads it: no "collective" is a run from before the option (the all-reduce)
    collective = config.get("collective", "allreduce") or "allgather"
    return (*(config.get(k) for k in _TIMED_AS + _DILOCO), collective)


def time_report(loss_dirs: list[Path], cluster_dirs: list[Path]) -> str:
    curves = [(n, summary, records) for d in loss_dirs for n, (summary, records) in compare_runs(d).items()]
    # a long run on the emulated cluster itself: its own clock, set beside the sum of the short runs' step times
    on_cluster = [c for c in curves if c[1].get("cluster")]
    curves = [c for c in curves if not c[1].get("cluster")]
    targets: dict[int, float] = {}  # each seed's DDP AdamW final loss: that seed's runs' target
    for name, summary, _ in curves:
        if name == "ddp_allreduce":
            seed = summary["config"]["seed"]
            if seed in targets:
                raise SystemExit(f"two ddp_allreduce runs of seed {seed}: its final loss is the target, give one")
            targets[seed] = summary["final_loss"]
    untargeted = sorted({s["config"]["seed"] for _, s, _ in curves + on_cluster} - set(targets))
    if untargeted:
        raise SystemExit(f"--time-to-loss needs a ddp_allreduce run of every seed (its final loss is the target): "
                         f"none of seed {untargeted[0]}")
    # the setting's first appearance, then the seed
    order = list(dict.fromkeys((n, _curve_setting(n, s)) for n, s, _ in curves))
    curves.sort(key=lambda c: (order.index((c[0], _curve_setting(c[0], c[1]))), c[1]["config"]["seed"]))
    timed = []  # (link, name, summary, records, the floor's seconds a step)
    for d in cluster_dirs:
        runs = compare_runs(d)
        if "local_adam" not in runs:
            raise SystemExit(f"{d}: no local_adam run, the no-communication floor of the comparison")
        for name, (summary, records) in runs.items():
            if summary.get("skipped_steps"):
                raise SystemExit(f"{d}: {name} skipped steps: its speed does not count")
            timed.append((summary["cluster"]["bandwidth"], name, summary, records,
                          runs["local_adam"][0]["step_time_s"]["warmup"]))
    lines = ["| link | optimizer | setting | seed | steps to DDP's loss | time to DDP's loss | its floor "
             "| faster than DDP |", "|---|---|---|---|---|---|---|---|"]
    same, pooled = [], []
    for link in sorted({t[0] for t in timed}, reverse=True):
        rows = []
        for name, summary, records in curves:
            match = _timing(timed, link, name, summary)
            if len(match) > 1:
                raise SystemExit(f"{name} at {link / 1e6:g} Mbit/s: timed by {len(match)} cluster runs, give one")
            if not match:
                continue
            _, _, cluster, cluster_records, floor = match[0]
            seed = summary["config"]["seed"]
            # the premise, checked where the cluster ran the same seed on the same machine (another
            # CPU rounds differently: its bits are its own whatever the link)
            if cluster["config"]["seed"] == seed and cluster["machine"] == summary["machine"]:
                same.append(f"{name} at {link / 1e6:g} Mbit/s ({_curve_setting(name, cluster)}) against "
                            f"{_curve_setting(name, summary)}: {same_losses(cluster_records, records)} of "
                            f"{len(cluster_records)}")
            n = steps_to_loss(records, targets[seed])
            took = None if n is None else added_up(f"{name} at {link / 1e6:g} Mbit/s", cluster, records[:n])
            rows.append((name, summary, records, n, took, floor, seed))
        took_by: dict[tuple[str, str], dict[int, float | None]] = {}  # each setting's seeds' times
        for name, summary, _, _, took, _, seed in rows:
            seeds = took_by.setdefault((name, _curve_setting(name, summary)), {})
            if seed in seeds:
                raise SystemExit(f"two {name} runs ({_curve_setting(name, summary)}) of seed {seed}: give one")
            seeds[seed] = took
        ddp_took = {seed: took for name, *_, took, _, seed in rows if name == "ddp_allreduce"}
        for name, summary, records, n, took, floor, seed in rows:
            steps = f"{n:,}" if n is not None else f"not in {len(records):,} (final {summary['final_loss']:.3f})"
            took_text = "—" if took is None else f"{took / 60:,.1f} min"
            floor_text = "—" if n is None else f"{n * floor / 60:,.1f} min"
            ratio = ddp_took[seed] / took if took and ddp_took.get(seed) else None
            lines.append(f"| {link / 1e6:g} Mbit/s | {name} | {_curve_setting(name, summary)} | {seed} | {steps} "
                         f"| {took_text} | {floor_text} | {'—' if ratio is None else f'{ratio:.1f}x'} |")
        # each setting against DDP AdamW and against every setting after it, over the seeds both ran
        others = [key for key in took_by if key[0] != "ddp_allreduce"]
        for i, (name, setting) in enumerate(others):
            mine = took_by[name, setting]
            later = [(f"{n} ({s})", took_by[n, s]) for n, s in others[i + 1:]]
            for against, theirs in [("DDP AdamW", ddp_took), *later]:
                shared = [seed for seed in mine if seed in theirs]
                if len(shared) > 1:
                    ratios = {seed: theirs[seed] / mine[seed] if mine[seed] and theirs[seed] else None
                              for seed in shared}
                    who = f"{name} ({setting})"
                    if against != "DDP AdamW" and None not in ratios.values() and math.prod(ratios.values()) < 1:
                        who, against, ratios = against, who, {seed: 1 / r for seed, r in ratios.items()}  # sooner first
                    pooled.append(_pooled(link, who, against, ratios))
    measured = [_measured(c, timed, targets[c[1]["config"]["seed"]]) for c in on_cluster]
    table = "\n".join(lines) + "\n\n" if len(lines) > 2 else ""  # no curve timed: the runs on the cluster alone
    return (table + "".join(f"{p}\n\n" for p in pooled + measured)
            + f"Each seed's target: the final loss of DDP AdamW of that seed (the mean of its last 10 steps' "
            f"training loss; {', '.join(f'seed {k}: {v:.4f}' for k, v in sorted(targets.items()))}); a run reaches "
            f"it when the mean of 10 consecutive steps is at most that. A pooled interval is the seeds' spread in "
            f"the steps each needed: every seed's steps are timed by the same cluster runs. Losses identical to the "
            f"long run's, step for step, in the cluster runs (of the seed they ran, on the same machine): "
            f"{'; '.join(same) or 'none checked (no long run of their seed on their machine)'}. "
            f"{compare_sources(loss_dirs + cluster_dirs)}\n")


def _timing(timed: list[tuple], link: float, name: str, summary: dict) -> list[tuple]:
    """The cluster runs of ``timed`` at ``link`` whose steps do the work of ``name``'s run ``summary``."""
    return [t for t in timed if t[0] == link and t[1] == name
            and _work(name, t[2]["config"]) == _work(name, summary["config"])]


def _measured(run: tuple[str, dict, list[dict]], timed: list[tuple], target: float) -> str:
    """When a long run on the emulated cluster reached its seed's target by its own clock, beside
    its steps added up at the step times of the short cluster run of the same setting, link and
    machine, and how many of that short run's losses are the long run's."""
    name, summary, records = run
    setting, seed, link = _curve_setting(name, summary), summary["config"]["seed"], summary["cluster"]["bandwidth"]
    who = f"{name} ({setting}), seed {seed}, run on the cluster at {link / 1e6:g} Mbit/s"
    head = who + ": "
    if summary.get("skipped_steps"):
        raise SystemExit(head + "skipped steps: its speed does not count")
    n = steps_to_loss(records, target)
    if n is None:
        return head + f"did not reach DDP AdamW's loss in {len(records):,} steps."
    short = [t for t in _timing(timed, link, name, summary) if t[2]["machine"] == summary["machine"]]
    if len(short) != 1:
        raise SystemExit(head + f"timed by {len(short)} short cluster runs on its machine, give one")
    _, _, cluster, cluster_records, _ = short[0]
    added = added_up(who, cluster, records[:n])
    equal = (f"; its losses are the short run's for {same_losses(cluster_records, records)} of "
             f"{len(cluster_records)} steps" if cluster["config"]["seed"] == seed else "")
    return (head + f"reached DDP AdamW's loss at step {n:,} after **{records[n - 1]['time'] / 60:.1f} min** by its "
            f"own clock; its steps at the short cluster run's step times add up to {added / 60:.1f} min "
            f"(**{records[n - 1]['time'] / added:.3f}x** that){equal}.")


def _pooled(link: float, who: str, against: str, ratios: dict[int, float | None]) -> str:
    """How much sooner than ``against`` the runs of ``who`` reached each seed's target, over the
    paired seeds: the geometric mean of the ratios with its 95% t-interval, and the worst seed."""
    head = f"{who} at {link / 1e6:g} Mbit/s against {against}, {len(ratios)} paired seeds: "
    unreached = [seed for seed, r in ratios.items() if r is None]
    if unreached:
        return head + f"not pooled (seed {unreached[0]}: a run did not reach DDP AdamW's loss)."
    mean, low, high = ratio_interval(list(ratios.values()))
    worst = min(ratios, key=ratios.get)
    return (head + f"**{mean:.2f}x faster** (geometric mean, 95% interval "
            f"[{low:.2f}, {high:.2f}]; worst seed {worst}, {ratios[worst]:.2f}x; "
            f"{', '.join(f'seed {k} {r:.2f}x' for k, r in ratios.items())}).")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--report", nargs="+", type=Path, metavar="SUMMARY")
    what.add_argument("--cluster", nargs="+", type=Path, metavar="DIR")
    what.add_argument("--time-to-loss", nargs="+", type=Path, metavar="DIR")
    what.add_argument("--curves", nargs="+", type=parse_pick, metavar="DIR[:NAME,...]")
    parser.add_argument("--windows", default=[200, 400, 600, 800, 1024], type=lambda t: [int(w) for w in t.split(",")],
                        help="--curves: the last step of each window of 25 (default 200,400,600,800,1024)")
    parser.add_argument("--reach", action="store_true",
                        help="--curves: the step each run reached the final loss of its seed's first run")
    parser.add_argument("--cluster-times", nargs="+", type=Path, metavar="DIR", default=[])
    args = parser.parse_args()
    if args.reach and not args.curves:
        parser.error("--reach goes with --curves")
    if args.time_to_loss:
        if not args.cluster_times:
            parser.error("--time-to-loss needs --cluster-times")
        print(time_report(args.time_to_loss, args.cluster_times), end="")
    elif args.curves:
        print(curves_report(args.curves, args.windows, reach=args.reach), end="")
    else:
        print(report(args.report) if args.report else cluster_report(args.cluster), end="")
