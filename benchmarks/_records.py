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
