"""MkDocs hooks: the reference of the ``onebit`` command, generated from its argparse parser
(``onebit.cli.build_parser``) where a page says ``<!-- onebit-cli-reference -->``; the
benchmarks' plain-text tables (a ``text`` block holding only ``--8<-- ".../table.txt"``) shown
as Markdown tables, which a page of any width can show; and the benchmarks' plots
(``benchmarks/results/**/*.png``), served at their paths in the repository."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

MARKER = "<!-- onebit-cli-reference -->"
TEXT_TABLE = re.compile(r'```text\n--8<-- "(?P<path>[^"]+/table\.txt)"\n```')


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands only there
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _sections(parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{parser.prog}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for child in _subparsers(parser).values():
        out += _sections(child, level + 1)
    return out


# The columns a reader comes for, moved next to the first: a wide table (``onebit compare``'s has
# 17 columns) then shows them on a laptop's page without scrolling.
KEY_COLUMNS = ("vs DDP", "vs no-comm floor", "to baseline loss")


def markdown_table(text: str) -> str:
    """A benchmark's ``table.txt`` (:func:`onebit.bench._analysis.text_table`'s columns under a
    rule of dashes, and notes before and after) as a Markdown table, each note a paragraph, with
    the :data:`KEY_COLUMNS` it has right after its first column."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        rule = lines[i + 1] if i + 1 < len(lines) else ""
        if lines[i].strip() and rule.strip() and set(rule) <= {"-", " "}:
            starts = [m.start() for m in re.finditer(r"-+", rule)]
            spans = list(zip(starts, [*starts[1:], None]))
            heads = [lines[i][a:b].strip() for a, b in spans]
            key = [j for j in range(1, len(spans)) if heads[j] in KEY_COLUMNS]
            bounds = [spans[j] for j in [0, *key, *(j for j in range(1, len(spans)) if j not in key)]]

            def cells(line: str) -> str:
                return "| " + " | ".join(line[a:b].strip().replace("|", "\\|") for a, b in bounds) + " |"

            def row(line: str) -> bool:  # a row's cells start where the rule's columns do (a note's words do not)
                return bool(line.strip()) and all(a >= len(line) or line[a - 1] == " " for a in starts[1:])

            out += [cells(lines[i]), "|" + "---|" * len(starts)]
            i += 2
            while i < len(lines) and row(lines[i]):
                out.append(cells(lines[i]))
                i += 1
            out.append("")
        else:
            out += [lines[i], ""]
            i += 1
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    root = Path(config["config_file_path"]).parent
    markdown = TEXT_TABLE.sub(lambda m: markdown_table((root / m["path"]).read_text()), markdown)
    if MARKER not in markdown:
        return markdown
    from onebit.cli import build_parser

    os.environ["COLUMNS"] = "80"  # argparse wraps its help to the terminal's width: the same on every machine
    parser = build_parser()
    reference = []
    for child in _subparsers(parser).values():
        reference += _sections(child, 2)
    return markdown.replace(MARKER, "\n".join(reference))


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["config_file_path"]).parent
    for png in sorted((root / "benchmarks" / "results").rglob("*.png")):
        files.append(File(str(png.relative_to(root)), str(root), config["site_dir"], config["use_directory_urls"]))
    return files
