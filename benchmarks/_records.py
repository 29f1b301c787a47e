"""The benchmark scripts' results files: one JSON object per run, appended, read back by ``--report``,
each carrying the command, machine and date it came from."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from onebit.bench._reports import provenance as _provenance


def provenance(launcher: str = "python") -> dict[str, str]:
    """``command`` (``launcher`` and this script's arguments), ``machine`` and ``date`` of this run."""
    return _provenance(f"{launcher} {' '.join(sys.argv)}")


def provenance_note(rows: list[dict[str, Any]]) -> str:
    """One line for a report's foot: how many runs, the first one's command, the machines and dates."""
    machines = ", ".join(sorted({r["machine"] for r in rows}))
    dates = sorted({r["date"] for r in rows})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return f"{len(rows)} runs, each with its command in the results file (the first: `{rows[0]['command']}`); {machines}, {when}."


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append ``row`` to the JSON-lines file ``path`` (its folder created if missing)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of the JSON-lines file ``path``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def refreshes_sent(config: dict[str, Any]) -> str:
    """What a run's 1-bit Adam refreshes summed the gradients in, from its config: ``"bf16"`` (the
    default, ``refresh_dtype`` None) or ``"fp32"``; runs from before the option refreshed in fp32."""
    return config.get("refresh_dtype", "fp32") or "bf16"


def compare_sources(dirs: list[Path]) -> str:
    """The commands of the ``onebit compare`` runs in ``dirs``, and the machines and dates they ran on."""
    sources = [json.loads((d / "provenance.json").read_text()) for d in dirs]
    machines = ", ".join(dict.fromkeys(s["machine"] for s in sources))
    dates = sorted({s["date"] for s in sources})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return "; ".join(f"`{s['command']}`" for s in sources) + f"; {machines}, {when}."


def compare_runs(d: Path) -> dict[str, tuple[dict, list[dict]]]:
    """Each optimizer of the ``onebit compare`` run in ``d``: its summary, with the ``machine`` it
    ran on, and per-step records."""
    summaries = json.loads((d / "summary.json").read_text())
    machine = json.loads((d / "provenance.json").read_text())["machine"]
    return {n: ({**s, "machine": machine}, [json.loads(r) for r in (d / n / "metrics.jsonl").read_text().splitlines()])
            for n, s in summaries.items()}


def added_up(what: str, cluster: dict, records: list[dict]) -> float:
    """Seconds the steps of ``records`` take at the cluster run's step time of each one's stage."""
    missing = {r["stage"] for r in records} - set(cluster["step_time_s"])
    if missing:
        raise SystemExit(f"{what}: no step time of its {sorted(missing)} steps")
    return sum(cluster["step_time_s"][r["stage"]] for r in records)


def same_losses(records: list[dict], others: list[dict]) -> int:
    """How many first steps of two runs logged the same loss, bit for bit."""
    return next((i for i, (x, y) in enumerate(zip(records, others)) if x["loss"] != y["loss"]),
                min(len(records), len(others)))


Pick = tuple[Path, tuple[str, ...] | None]  # a comparison's directory, and the optimizers read (None: all)


def parse_pick(arg: str) -> Pick:
    """``DIR`` or ``DIR:NAME,NAME`` (a directory's own colons stay in it: names hold no ``/``)."""
    path, colon, names = arg.rpartition(":")
    if not colon or "/" in names:
        return Path(arg), None
    return Path(path), tuple(names.split(","))


def picked_runs(pick: Pick) -> dict[str, tuple[dict, list[dict]]]:
    """:func:`compare_runs` of the pick's directory, only the optimizers it names."""
    d, names = pick
    runs = compare_runs(d)
    if names is None:
        return runs
    if unknown := set(names) - set(runs):
        raise SystemExit(f"{d}: no {sorted(unknown)} run (it has {', '.join(runs)})")
    return {n: runs[n] for n in names}


def picked_sources(picks: list[Pick]) -> str:
    """The picks' commands, and the runs of theirs left out."""
    # the comparison's names from its summary (compare_runs would read every run's records again)
    left = [f"{', '.join(n for n in json.loads((d / 'summary.json').read_text()) if n not in names)} of `{d}`"
            for d, names in picks if names is not None]
    return compare_sources([d for d, _ in picks]) + (f" Left out: {'; '.join(left)}." if left else "")
