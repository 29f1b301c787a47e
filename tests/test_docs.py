"""The documentation site builds with warnings as errors, and every page and internal link of
the built site resolves (the generated API reference and command reference included)."""

import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs", reason="the docs extra is not installed")
pytest.importorskip("mkdocstrings")


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(found["id"])
        self.links += [found[name] for name in ("href", "src") if found.get(name)]


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(errors="replace"))
    return parser


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_every_page_of_the_nav_is_built(site):
    import yaml

    def pages(nav):
        for item in nav:
            for value in item.values():
                yield from pages(value) if isinstance(value, list) else [value]

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    for page in pages(config["nav"]):
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), page
        assert "<h1" in built.read_text(), page


def test_every_internal_link_and_anchor_resolves(site):
    parsed = {path: _parse(path) for path in site.rglob("*.html")}
    broken = []
    for path, page in parsed.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:")):
                continue
            if not parts.path:
                target = path
            elif parts.path.startswith("/"):  # the 404 page links from the site's root
                target = (site / unquote(parts.path).lstrip("/")).resolve()
            else:
                target = (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {link}")
            elif parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: {link} (no such anchor)")
    assert not broken, "\n".join(broken[:50])


def test_generated_references_are_in_the_site(site):
    cli = (site / "cli" / "index.html").read_text()
    for command in ("onebit demo", "onebit bench convergence", "onebit model"):
        assert command in cli
    api = (site / "api" / "optim" / "index.html").read_text()
    for name in ("OnebitAdam", "OnebitLamb", "ZeroOneAdam", "CompAMS", "Birder", "freeze_step", "clip_update"):
        assert name in api
    assert ":class:" not in api  # the docstrings' Sphinx roles are rendered as code


class _CodeBlocks(HTMLParser):
    """The text of every ``<pre>`` block of a page (code, command output, generated tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[str] = []
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "pre":
            self._depth += 1
            if self._depth == 1:
                self.blocks.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre":
            self._depth -= 1

    def handle_data(self, data: str) -> None:
        if self._depth:
            self.blocks[-1] += data


# The characters a code block shows without scrolling: Material's content column at a laptop's
# 1280-1440 px (both sidebars shown) is 688 px, its code font 13.6 px monospace, 8.18 px a
# character (measured in headless Chromium), less the block's padding.
CODE_BOX = 80


def test_every_code_block_fits_the_page(site):
    wide = []
    for page in sorted(site.rglob("*.html")):
        parser = _CodeBlocks()
        parser.feed(page.read_text(errors="replace"))
        for block in parser.blocks:
            longest = max(block.splitlines() or [""], key=len)
            if len(longest) > CODE_BOX:
                wide.append(f"{page.relative_to(site)}: {len(longest)} columns: {longest[:60]}...")
    assert not wide, "\n".join(wide)


def test_a_benchmarks_text_table_becomes_a_markdown_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_hooks", ROOT / "docs" / "_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    text = ("adam: 609.2 ms/step\n"
            "optimizer    ms/step  MB|rank\n"
            "-----------  -------  -------\n"
            "adam         609.2    1071.1 \n"
            "onebit_adam  130.9    -      \n"
            "1-bit Adam's step: 13.7 ms (8.72x)\n"  # a note right under the rows, not a row
            "\n"
            "`onebit compare ...`; vm (2 cores), 2026-11-25.\n")
    lines = [line for line in hooks.markdown_table(text).splitlines() if line]
    assert lines == [
        "adam: 609.2 ms/step",
        "| optimizer | ms/step | MB\\|rank |", "|---|---|---|",
        "| adam | 609.2 | 1071.1 |", "| onebit_adam | 130.9 | - |",
        "1-bit Adam's step: 13.7 ms (8.72x)",
        "`onebit compare ...`; vm (2 cores), 2026-11-25."]
    # a wide table's key columns come right after the first, in their order
    wide = ("optimizer    gap    vs no-comm floor  vs DDP\n"
            "-----------  -----  ----------------  ------\n"
            "onebit_adam  +0.1%  1.43x             6.70x \n")
    assert [line for line in hooks.markdown_table(wide).splitlines() if line] == [
        "| optimizer | vs no-comm floor | vs DDP | gap |", "|---|---|---|---|",
        "| onebit_adam | 1.43x | 6.70x | +0.1% |"]
