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


@pytest.fixture(autouse=True)
def _scripts_importable(monkeypatch):
    """A benchmark script imports its folder's helpers (``_records``), as run by ``python benchmarks/X.py``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


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
    run = [{"loss": loss, "time": 60.0 * step, "stage": "local"} for step, loss in enumerate(losses, 1)]
    summary = {"config": config, "cluster": {"bandwidth": 1e8}, "skipped_steps": 0, "machine": "vm"}
    # the short cluster run of the same setting on the same machine: 56 s a step, its first 6 losses the run's
    short = {"config": config, "machine": "vm", "step_time_s": {"local": 56.0}}
    timed = [(1e8, "diloco", short, [{"loss": loss} for loss in losses[:6] + [9.0] * 2], 0.5)]
    text = measured(("diloco", summary, run), timed, 2.0)
    assert text == ("diloco (H = 16, 4 fragments, delay 3, all-gather), seed 0, run on the cluster at 100 Mbit/s: "
                    "reached DDP AdamW's loss at step 15 after **15.0 min** by its own clock; its steps at the short "
                    "cluster run's step times add up to 14.0 min (**1.071x** that); its losses are the short run's "
                    "for 6 of 8 steps.")
    assert "did not reach" in measured(("diloco", summary, run), timed, 0.5)
    elsewhere = [(1e8, "diloco", {**short, "machine": "pc"}, [], 0.5)]  # timed on another machine only
    with pytest.raises(SystemExit, match="timed by 0 short cluster runs on its machine"):
        measured(("diloco", summary, run), elsewhere, 2.0)
    with pytest.raises(SystemExit, match="skipped steps"):
        measured(("diloco", {**summary, "skipped_steps": 1}, run), timed, 2.0)


def _compare_dir(path: Path, machine: str, runs: dict[str, tuple[dict, list[float]]]) -> Path:
    """An ``onebit compare`` result: each run's summary and per-step losses (one stage, "s")."""
    path.mkdir()
    (path / "provenance.json").write_text(json.dumps({"command": f"onebit compare {path.name}", "machine": machine,
                                                      "date": "2026-11-27"}))
    (path / "summary.json").write_text(json.dumps({name: summary for name, (summary, _) in runs.items()}))
    for name, (_, losses) in runs.items():
        (path / name).mkdir()
        (path / name / "metrics.jsonl").write_text(
            "".join(json.dumps({"loss": loss, "stage": "s", "time": float(i)}) + "\n" for i, loss in enumerate(losses)))
    return path


def test_the_time_to_loss_pairs_each_setting_with_ddp_and_the_others_over_shared_seeds(tmp_path):
    time_report = runpy.run_path(str(ROOT / "benchmarks" / "diloco_report.py"))["time_report"]
    diloco = {"sync_every": 16, "fragments": 0, "delay": 0, "collective": None}
    adam = {"freeze_step": 5}

    def curve(seed: int, config: dict, before: int, **summary) -> tuple[dict, list[float]]:
        # loss 2 for ``before`` steps, then 0.5: the 10-step mean reaches 1.0 at step before + 7
        return {"config": {**config, "seed": seed}, "final_loss": 1.0, **summary}, [2.0] * before + [0.5] * 40

    loss_dirs = [_compare_dir(tmp_path / f"{name}{seed}", "vm", {name: curve(seed, config, before, **extra)})
                 for name, config, extra, befores in (
                     ("ddp_allreduce", {}, {}, (3, 13)),  # 10 and 20 steps
                     ("onebit_adam", adam, {"freeze_step": 5}, (3, 8)),  # 10 and 15
                     ("diloco", diloco, {}, (13, 23)))  # 20 and 30
                 for seed, before in enumerate(befores)]

    def timing(machine: str) -> Path:  # 4, 3 and 1 s a step; seed 0 for 8 steps, DDP's losses
        timed = {name: ({"config": {**config, "seed": 0}, "cluster": {"bandwidth": 1e8}, "skipped_steps": 0,
                         "step_time_s": {"s": seconds, "warmup": seconds}, "freeze_step": 5}, [2.0] * 3 + [0.5] * 5)
                 for name, config, seconds in (("local_adam", {}, 1.0), ("ddp_allreduce", {}, 4.0),
                                               ("onebit_adam", adam, 3.0), ("diloco", diloco, 1.0))}
        return _compare_dir(tmp_path / f"cluster-{machine}", machine, timed)

    text = time_report(loss_dirs, [timing("vm")])
    # seconds to the target: DDP 40 / 80, 1-bit Adam 30 / 45, DiLoCo 20 / 30
    assert "| 100 Mbit/s | diloco | H = 16, all-gather | 1 | 30 | 0.5 min | 0.5 min | 2.7x |" in text
    assert ("onebit_adam (freeze_step=5: compressed from step 6) at 100 Mbit/s against DDP AdamW, 2 paired "
            "seeds: **1.54x faster**") in text  # sqrt(4/3 * 16/9)
    # listed after 1-bit Adam, DiLoCo is the sooner: it comes first, 1.5x in both seeds
    assert ("diloco (H = 16, all-gather) at 100 Mbit/s against onebit_adam (freeze_step=5: compressed from step 6), "
            "2 paired seeds: **1.50x faster**") in text
    assert text.count("paired seeds") == 3  # DiLoCo and 1-bit Adam against DDP, and against each other
    assert "ddp_allreduce at 100 Mbit/s (every step, fp32) against every step, fp32: 8 of 8" in text
    elsewhere = time_report(loss_dirs, [timing("pc")])  # another machine: its bits are not compared
    assert "none checked (no long run of their seed on their machine)" in elsewhere

    seed2 = {"config": {**diloco, "seed": 2}, "cluster": {"bandwidth": 1e8}, "skipped_steps": 0, "final_loss": 1.0}
    on_cluster = _compare_dir(tmp_path / "diloco-on-cluster", "vm", {"diloco": (seed2, [1.0] * 20)})
    with pytest.raises(SystemExit, match="none of seed 2"):
        time_report(loss_dirs + [on_cluster], [timing("vm2")])


def test_the_curves_say_when_each_run_reached_its_seeds_first_run_and_read_only_the_runs_picked(tmp_path):
    script = runpy.run_path(str(ROOT / "benchmarks" / "diloco_report.py"))
    curves, pick = script["curves_report"], script["parse_pick"]

    def run(seed: int, before: int, final: float, **config) -> tuple[dict, list[float]]:
        # loss 2 for ``before`` steps, then 0.5 to step 50: a 10-step mean of at most 1.0 from step before + 7,
        # of at most 0.6 from step before + 10
        return ({"config": {"seed": seed, **config}, "final_loss": final, "eval_loss": 1.5, "skipped_steps": 0},
                [2.0] * before + [0.5] * (50 - before))

    ddp = [_compare_dir(tmp_path / f"ddp{seed}", "vm", {"ddp_allreduce": run(seed, 5, final)})
           for seed, final in ((0, 1.0), (1, 0.6))]
    both = _compare_dir(tmp_path / "both", "vm", {"birder": run(1, 20, 0.5), "comp_ams": run(1, 50, 2.0)})
    exact = _compare_dir(tmp_path / "exact", "vm", {"birder": run(0, 44, 0.5, compressor="identity")})
    text = curves([pick(str(d)) for d in ddp] + [pick(f"{both}:birder"), pick(str(exact))], [25, 50], reach=True)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| optimizer | setting | seed | held-out | skipped | reached | 1–25 | 26–50 |")
    assert rows[1].startswith("| ddp_allreduce | every step, fp32 | 0 | 1.500 | 0 | — (the target) |")
    assert rows[2].startswith("| ddp_allreduce | every step, fp32 | 1 | 1.500 | 0 | — (the target) |")
    # seed 1's target, 0.6: ten steps of 0.5 (seed 0's, 1.0, would be reached at step 27)
    assert rows[3].startswith("| birder | compressed steps | 1 | 1.500 | 0 | step 30 of 50 |")
    assert rows[4].startswith("| birder | every step, fp32, compressor identity | 0 | 1.500 | 0 | not in 50 steps |")
    assert len(rows) == 5 and "Left out: comp_ams of" in text  # the run not picked
    assert "reached" not in curves([pick(str(ddp[0]))], [25, 50])


def test_the_time_to_the_counterparts_loss_prices_each_stage_and_refuses_what_is_not_the_defaults(tmp_path):
    script = runpy.run_path(str(ROOT / "benchmarks" / "time_to_loss.py"))

    def report(curves, clusters, on_cluster):
        return script["report"]([script["parse_pick"](str(c)) for c in curves], clusters, on_cluster)

    base = {"task": "mlp", "lr": 1e-3, "freeze_step": None}

    def run(path: Path, name: str, seed: int, stages: list[str], losses: list[float], sent: int, **config) -> Path:
        summary = {"config": {**base, **config, "seed": seed}, "final_loss": 1.0, "eval_loss": 1.5,
                   "skipped_steps": 0, "cluster": config.pop("cluster", None)}
        path.mkdir()
        (path / "provenance.json").write_text(json.dumps({"command": f"onebit compare {path.name}", "machine": "vm",
                                                          "date": "2026-11-28"}))
        (path / "summary.json").write_text(json.dumps({name: summary}))
        (path / name).mkdir()
        (path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"loss": loss, "stage": stage, "bytes_sent": sent, "time": float(i)}) + "\n"
            for i, (stage, loss) in enumerate(zip(stages, losses))))
        return path

    # DDP's losses reach its final 1.0 (a 10-step mean) at step 15 (seed 0) and 20 (seed 1), 1-bit
    # Adam's at 10 and 15, its first 2 steps fp32
    curves = [run(tmp_path / f"ddp{seed}", "ddp_allreduce", seed, ["warmup"] * 43, [2.0] * before + [0.5] * 40, 4)
              for seed, before in ((0, 8), (1, 13))]
    curves += [run(tmp_path / f"adam{seed}", "onebit_adam", seed, ["warmup"] * 2 + ["compressed"] * 41,
                   [2.0] * before + [0.5] * 40, 1) for seed, before in ((0, 3), (1, 8))]
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    (cluster / "provenance.json").write_text(json.dumps({"command": "onebit compare --nodes 4", "machine": "vm",
                                                         "date": "2026-11-28"}))
    times = {"local_adam": {"warmup": 0.5}, "ddp_allreduce": {"warmup": 4.0},
             "onebit_adam": {"warmup": 4.0, "compressed": 1.0}}
    (cluster / "summary.json").write_text(json.dumps({
        name: {"config": {**base, "seed": 0, "freeze_step": 2}, "cluster": {"bandwidth": 1e8}, "skipped_steps": 0,
               "step_time_s": steps} for name, steps in times.items()}))
    for name in times:
        (cluster / name).mkdir()
        (cluster / name / "metrics.jsonl").write_text("")
    text = report(curves, [cluster], [])
    # DDP 60 s and 80 s; 1-bit Adam 2 x 4 + 8 x 1 = 16 s and 2 x 4 + 13 = 21 s: 3.75x and 3.81x
    ratio, half = math.sqrt(60 / 16 * 80 / 21), 12.706 * abs(math.log(60 / 16) - math.log(80 / 21)) / 2
    assert "| ddp_allreduce | 0.001 | ddp_allreduce | 1.2 min (the reference) | 2/2 (15, 20) |" in text
    assert (f"| onebit_adam | 0.001 | ddp_allreduce | 0.3 min: **{ratio:.2f}x** [{ratio * math.exp(-half):.2f}, "
            f"{ratio * math.exp(half):.2f}]; worst seed 0 3.75x | 2/2 (10, 15) | 5.6x fewer | 95% |") in text
    # a comparison's run of other defaults left out by name: birder, which no cluster run prices
    both = tmp_path / "both"
    shutil.copytree(curves[3], both)
    summaries = json.loads((both / "summary.json").read_text())
    (both / "summary.json").write_text(json.dumps({**summaries, "birder": summaries["onebit_adam"]}))
    shutil.copytree(both / "onebit_adam", both / "birder")
    with pytest.raises(SystemExit, match="birder on mlp at 100 Mbit/s: no cluster run times it"):
        report(curves[:3] + [both], [cluster], [])
    picked = report(curves[:3] + [f"{both}:onebit_adam"], [cluster], [])
    assert picked.split("Curves:")[0] == text.split("Curves:")[0]
    assert f"Left out: birder of `{both}`." in picked
    hand = run(tmp_path / "adam-by-hand", "onebit_adam", 2, ["warmup"], [1.0], 1, freeze_step=400)
    with pytest.raises(SystemExit, match=r"onebit_adam \(seed 2\): not its defaults \(freeze_step=400\)"):
        report(curves + [hand], [cluster], [])
