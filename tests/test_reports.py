"""``benchmarks/report.py``: the committed reports are what their results give, and the
script finds and rewrites a stale one; the statistics a report script computes itself."""

import json
import math
import runpy
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    """``python benchmarks/report.py ARGV`` (the checkout's script, run in this process)."""
    return runpy.run_path(str(ROOT / "benchmarks" / "report.py"))["main"](argv)


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_committed_reports_match_their_results(in_root, capsys):
    assert main(["--check"]) == 0, capsys.readouterr().out


def _repo(tmp_path: Path, results: tuple[str, ...] = ("convergence-long", "hsdp")) -> Path:
    """A copy of the repository's benchmark scripts and some of its results (by default a
    convergence matrix and a script's reports)."""
    shutil.copytree(ROOT / "benchmarks", tmp_path / "benchmarks",
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    (tmp_path / "benchmarks" / "results").mkdir()
    for name in results:
        shutil.copytree(ROOT / "benchmarks" / "results" / name, tmp_path / "benchmarks" / "results" / name)
    return tmp_path


def test_a_stale_report_is_found_and_rewritten(tmp_path, monkeypatch, capsys):
    root = _repo(tmp_path)
    monkeypatch.chdir(root)
    results = root / "benchmarks" / "results"
    table = results / "convergence-long" / "table.md"
    report = results / "hsdp" / "REPORT.md"
    good_table, good_report = table.read_text(), report.read_text()
    table.write_text(good_table.replace("-1.7%", "-2.7%"))  # a figure edited by hand
    lines = good_report.split("\n")
    report.write_text("\n".join(lines[:3] + lines[4:]))  # a row lost
    doc = root / "docs" / "page.md"
    doc.parent.mkdir()
    command = "python benchmarks/hsdp_convergence.py --report benchmarks/results/hsdp/convergence.jsonl"
    doc.write_text(f"Prose stays.\n\n<!-- report: {command} -->\nold\n<!-- /report -->\n\nMore prose.\n")

    assert main(["--check", "--docs", "docs"]) == 1
    out = capsys.readouterr().out
    for path in ("convergence-long/table.md", "hsdp/REPORT.md", "docs/page.md"):
        assert path in out
    assert "-2.7%" in table.read_text()  # --check writes nothing

    assert main(["--docs", "docs"]) == 0
    assert table.read_text() == good_table and report.read_text() == good_report
    text = doc.read_text()
    expected = (ROOT / "benchmarks" / "results" / "hsdp" / "CONVERGENCE.md").read_text()
    assert text.startswith("Prose stays.\n\n") and text.endswith("\n\nMore prose.\n")
    assert expected.strip() in text and "old" not in text
    assert main(["--check", "--docs", "docs"]) == 0


def test_a_result_without_provenance_is_refused(tmp_path, monkeypatch, capsys):
    root = _repo(tmp_path)
    monkeypatch.chdir(root)
    path = root / "benchmarks" / "results" / "convergence-long" / "summary.json"
    summary = json.loads(path.read_text())
    del summary["provenance"]
    path.write_text(json.dumps(summary))
    with pytest.raises(SystemExit):
        main(["--check", "--docs"])
    assert "summary.json has no 'provenance' (command, machine, date)" in capsys.readouterr().err


@pytest.mark.parametrize("block,message", [
    ("<!-- report: rm -rf benchmarks -->\n<!-- /report -->", "a report block runs a benchmark script's report"),
    ("<!-- report: python benchmarks/hsdp_step.py --report x.jsonl -->\nrow", "has no <!-- /report --> line"),
])
def test_bad_blocks_are_refused(block, message, tmp_path, monkeypatch, capsys):
    root = _repo(tmp_path, results=())
    monkeypatch.chdir(root)
    (root / "page.md").write_text(block + "\n")
    with pytest.raises(SystemExit):
        main(["--check", "--docs", "page.md"])
    assert message in capsys.readouterr().err


def test_the_time_to_loss_pools_paired_seeds_by_their_ratios():
    pooled = runpy.run_path(str(ROOT / "benchmarks" / "diloco_report.py"))["_pooled"]
    # log ratios ln 4 + ln 2 * (0, -1, 1): mean ln 4, standard deviation ln 2, t(2) = 4.303
    half = 4.303 * math.log(2) / math.sqrt(3)
    text = pooled(1e8, "diloco (H = 16)", "DDP AdamW", {0: 4.0, 1: 2.0, 2: 8.0})
    assert text.startswith("diloco (H = 16) at 100 Mbit/s against DDP AdamW, 3 paired seeds: **4.00x faster**")
    assert f"[{4 * math.exp(-half):.2f}, {4 * math.exp(half):.2f}]; worst seed 1, 2.00x" in text
    assert "not pooled (seed 1: a run did not reach" in pooled(1e8, "diloco (H = 16)", "DDP AdamW", {0: 4.0, 1: None})


def test_a_run_on_the_cluster_itself_is_timed_by_its_own_clock():
    measured = runpy.run_path(str(ROOT / "benchmarks" / "diloco_report.py"))["_measured"]
    config = {"seed": 0, "sync_every": 16, "fragments": 4, "delay": 3, "collective": None}
    losses = [3.0] * 10 + [1.0] * 10  # the 10-step mean first reaches 2.0 at step 15
    run = [{"loss": loss, "time": 60.0 * step} for step, loss in enumerate(losses, 1)]
    summary = {"config": config, "cluster": {"bandwidth": 1e8}, "skipped_steps": 0, "machine": "vm"}
    twin = [{"loss": loss} for loss in losses[:12] + [9.0] * 8]  # the unshaped run: 12 equal steps
    setting = "H = 16, 4 fragments, delay 3, all-gather"
    text = measured(("diloco", summary, run), [("diloco", {"config": config, "machine": "vm"}, twin)], 2.0,
                    {(1e8, "diloco", setting, 0): 840.0})
    assert text == (f"diloco ({setting}), seed 0, run on the cluster at 100 Mbit/s: reached DDP AdamW's loss at "
                    "step 15 after **15.0 min** by its own clock (the table adds up 14.0 min for it from the short "
                    "cluster runs' step times); losses identical to the unshaped run's for 12 of 20 steps.")
    elsewhere = measured(("diloco", summary, run), [("diloco", {"config": config, "machine": "pc"}, twin)], 2.0, {})
    assert "(the table adds up — for it" in elsewhere and "no run of it on an unshaped link on that machine" in elsewhere
    assert "did not reach" in measured(("diloco", summary, run), [], 0.5, {})
    with pytest.raises(SystemExit, match="skipped steps"):
        measured(("diloco", {**summary, "skipped_steps": 1}, run), [], 2.0, {})
