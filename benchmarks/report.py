"""Regenerate every benchmark report from the results it reads (run from the repository's root).

A report is never edited by hand. Three kinds exist, all found by walking the results
directory and the documentation:

* a convergence matrix's ``summary.json`` (``onebit bench convergence``) gives ``table.md``
  and ``table.txt`` beside it (and ``loss.png`` when writing);
* a memory, kernel or collective benchmark's ``summary.json`` (``onebit bench memory``,
  ``kernels --out``, ``comm --out``), or that of ``onebit compare --rounds``, gives ``table.txt``;
* a generated block of a Markdown file: the lines between ``<!-- report: COMMAND -->`` and
  ``<!-- /report -->`` are what ``COMMAND`` prints -- a benchmark script's ``--report`` over
  its JSON-lines results, ``python benchmarks/SCRIPT.py --report FILE``, or the cost model,
  ``onebit model ...`` -- run from the repository's root. Prose around the blocks is the
  author's; the figures are the data's.

Each JSON result carries the command, machine and date it came from, and the reports print them.

Usage::

    python benchmarks/report.py            # rewrite the stale reports, redraw the loss plots
    python benchmarks/report.py --check    # exit 1 if one is stale (the test suite runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

from onebit.bench._reports import is_convergence, report_files
from onebit.cli import main as cli_main

BLOCK_START = "<!-- report: "
BLOCK_END = "<!-- /report -->"


def _run(command: str, root: Path) -> str:
    """What ``command`` prints, run from ``root`` in this process: a benchmark script's
    ``--report`` (``python benchmarks/SCRIPT.py ...``, which only reads JSON) as it is, or an
    ``onebit`` command that computes without running ranks (``onebit model ...``) as a code block."""
    argv = shlex.split(command)
    script = root / argv[1] if len(argv) > 1 and argv[0] == "python" and argv[1].startswith("benchmarks/") else None
    if script is None and argv[:2] != ["onebit", "model"]:
        raise ValueError("a report block runs a benchmark script's report (python benchmarks/...) or "
                         f"onebit model, got {command!r}")
    saved = sys.argv, sys.path[:], Path.cwd()
    out = io.StringIO()
    try:
        os.chdir(root)
        with contextlib.redirect_stdout(out):
            if script is None:
                code = cli_main(argv[1:])
            else:
                sys.argv, sys.path[:0] = argv[1:], [str(script.parent)]
                runpy.run_path(str(script), run_name="__main__")
                code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])
    if code:
        raise RuntimeError(f"{command!r} exited with {code}")
    text = out.getvalue().rstrip("\n")
    return text if script is not None else f"```text\n{text}\n```"


def _blocks(text: str, root: Path) -> str:
    """``text`` with every generated block's lines replaced by what its command prints now."""
    out: list[str] = []
    lines = iter(text.split("\n"))
    for line in lines:
        out.append(line)
        if not line.startswith(BLOCK_START):
            continue
        command = line[len(BLOCK_START):].removesuffix("-->").strip()
        for rest in lines:
            if rest == BLOCK_END:
                break
        else:
            raise ValueError(f"report block {command!r} has no {BLOCK_END} line")
        out += [_run(command, root), BLOCK_END]
    return "\n".join(out)


def _markdown(root: Path, results: Path, docs: list[Path]) -> Iterator[Path]:
    for where in [results, *docs]:
        where = root / where
        if where.is_file():
            yield where
        elif where.is_dir():
            yield from sorted(where.rglob("*.md"))


def expected_reports(root: Path, results: Path, docs: list[Path]) -> dict[Path, str]:
    """Every report under ``results`` and in the Markdown of ``docs`` (paths relative to the
    repository's ``root``), with the content its results give."""
    expected: dict[Path, str] = {}
    for summary_path in sorted((root / results).rglob("summary.json")):
        made = report_files(json.loads(summary_path.read_text()))
        expected.update({summary_path.parent / name: text for name, text in made.items()})
    for path in _markdown(root, results, docs):
        text = path.read_text()
        if BLOCK_START in text:
            expected[path] = _blocks(text, root)
    return expected


def stale_reports(expected: dict[Path, str]) -> list[Path]:
    """The reports whose file differs from what their results give."""
    return [p for p, text in expected.items() if not p.exists() or p.read_text() != text]


def plot_convergence_summaries(root: Path, results: Path) -> list[Path]:
    """Redraw every convergence matrix's ``loss.png`` (needs matplotlib)."""
    from onebit.bench._plot import plot_convergence

    drawn = []
    for summary_path in sorted((root / results).rglob("summary.json")):
        summary = json.loads(summary_path.read_text())
        if is_convergence(summary):
            drawn.append(plot_convergence(summary["runs"], summary_path.parent / "loss.png"))
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/results", help="the results directory (from the root)")
    parser.add_argument("--docs", nargs="*", default=["docs", "benchmarks/README.md", "README.md"],
                        help="Markdown files or directories whose generated blocks are checked too")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a report is stale")
    args = parser.parse_args(argv)
    root = Path.cwd()
    results = Path(args.results)
    if not (root / results).is_dir():
        parser.error(f"--results {args.results!r}: no such directory under {root} (run from the repository's root)")
    try:
        expected = expected_reports(root, results, [Path(p) for p in args.docs])
    except ValueError as exc:
        parser.error(str(exc))
    stale = stale_reports(expected)
    if args.check:
        for path in stale:
            print(f"stale: {path.relative_to(root)}")
        print(f"{len(expected)} reports, {len(stale)} stale" + (": run python benchmarks/report.py" if stale else ""))
        return 1 if stale else 0
    for path in stale:
        path.write_text(expected[path])
        print(f"wrote {path.relative_to(root)}")
    try:
        plots = plot_convergence_summaries(root, results)
        print(f"{len(plots)} loss plots redrawn")
    except ImportError as exc:
        print(f"no loss plots: {exc}")
    print(f"{len(expected)} reports, {len(stale)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
