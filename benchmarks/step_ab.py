"""Step times before and after a change of the library, paired round by round.

Each round is two ``onebit compare`` runs with the same command, one from the source before the
change and one from after, run one after the other alone on the machine. A step time is its
run's median of the optimizer's timed stage (the compressed steps of the 1-bit family); beside it,
the same run's counterpart (LAMB for 1-bit LAMB, DDP AdamW for the others), so that a drift of
the machine between runs shows in both.

Usage, from the repository's root::

    python benchmarks/step_ab.py --before RUN... --after RUN...   # the same number of rounds each
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from onebit.bench._analysis import fmt, ratio_interval, step_time


def _counterpart(name: str) -> str:
    return "lamb" if name == "onebit_lamb" else "ddp_allreduce"


def _load(run: Path) -> tuple[dict[str, float], dict[str, str]]:
    """``{optimizer: step time in s}`` of one compare run, and its provenance."""
    summaries = json.loads((run / "summary.json").read_text())
    times = {name: step_time(summary, []) for name, summary in summaries.items()}
    return times, json.loads((run / "provenance.json").read_text())


def report(before: list[Path], after: list[Path]) -> str:
    if len(before) != len(after):
        raise ValueError(f"--before has {len(before)} runs, --after {len(after)}: one of each per round")
    loaded = {run: _load(run) for run in before + after}
    pairs = [(loaded[b][0], loaded[a][0]) for b, a in zip(before, after)]
    lines = ["| optimizer | against | before, ms/step | after, ms/step | after / before | vs its counterpart, "
             "before → after |", "|---|---|---|---|---|---|"]
    # DDP's own row is the control: a change that does not touch its code, the machine's drift
    names = [n for n in pairs[0][0] if n in pairs[0][1] and n != "local_adam"]
    for name in names:
        other = _counterpart(name)
        mean, low, high = ratio_interval([a[name] / b[name] for b, a in pairs])
        if other == name:
            against = "— (the control)"
        else:
            share = [statistics.median(run[name] / run[other] for run in side) for side in zip(*pairs)]
            against = f"{share[0]:.2f}x → {share[1]:.2f}x"
        lines.append(f"| {name} | {other if other != name else '—'} | "
                     f"{', '.join(fmt(b[name] * 1e3, '.1f') for b, _ in pairs)} | "
                     f"{', '.join(fmt(a[name] * 1e3, '.1f') for _, a in pairs)} | {mean:.2f} [{low:.2f}, {high:.2f}] | "
                     f"{against} |")
    notes = [loaded[run][1] for run in before + after]
    machines = ", ".join(sorted({n["machine"] for n in notes}))
    dates = ", ".join(sorted({n["date"] for n in notes}))
    lines += ["", f"{len(pairs)} rounds; the first before: `{notes[0]['command']}`; {machines}, {dates}. "
              "\"after / before\": the geometric mean of the rounds' ratios with its 95% interval; \"vs its "
              "counterpart\": the median over the rounds of the step's time over its counterpart's in the same run."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", type=Path, required=True, help="compare runs of the source before")
    parser.add_argument("--after", nargs="+", type=Path, required=True, help="the same rounds' runs after")
    args = parser.parse_args(argv)
    try:
        print(report(args.before, args.after))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
