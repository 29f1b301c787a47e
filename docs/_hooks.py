"""MkDocs hooks: the reference of the ``onebit`` command, generated from its argparse parser
(``onebit.cli.build_parser``) where a page says ``<!-- onebit-cli-reference -->``; and the
benchmarks' plots (``benchmarks/results/**/*.png``), served at their paths in the repository."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

MARKER = "<!-- onebit-cli-reference -->"


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


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from onebit.cli import build_parser

    os.environ["COLUMNS"] = "88"  # argparse wraps its help to the terminal's width: the same on every machine
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
