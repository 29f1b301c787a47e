import json
import math
import os
import statistics

import pytest
import torch
from _problem import check_bytes

from onebit.bench._cluster import cluster_unavailable
from onebit.cli import main


@pytest.mark.parametrize("where", ["loopback", "cluster"])
def test_demo_end_to_end_tiny(where, tmp_path, capsys):
    if where == "cluster" and cluster_unavailable():
        pytest.skip(f"no emulated cluster: {cluster_unavailable()}")
    out = tmp_path / "demo"
    argv = ["demo", "--steps", "6", "--freeze-step", "3", "--batch-size", "8", "--out", str(out), "--quiet"]
    assert main(argv + (["--loopback"] if where == "loopback" else [])) == 0
    text = capsys.readouterr().out
    assert "onebit_adam" in text and "reduction" in text and "1-bit Adam's compressed step:" in text
    if where == "loopback":  # no speed-up on loopback: says why, and what the cost model predicts on real links
        assert "on loopback (--loopback)" in text and "no speed-up shows here" in text
        assert "  1 Gbit/s: Adam" in text and "  10 Gbit/s: Adam" in text
    else:
        assert "on an emulated cluster of 2 nodes x 1 rank, 200 Mbit/s per node" in text and "--loopback" in text
        assert "no speed-up shows here" not in text
    for name in ("adam", "onebit_adam"):
        lines = (out / name / "metrics.jsonl").read_text().splitlines()
        recs = [json.loads(line) for line in lines]
        assert [r["step"] for r in recs] == list(range(1, 7))
        assert {"step", "loss", "stage", "bytes_sent", "time"} <= set(recs[0])
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["bytes_sent_per_rank"] == sum(r["bytes_sent"] for r in recs)
    stages = [json.loads(line)["stage"] for line in (out / "onebit_adam" / "metrics.jsonl").read_text().splitlines()]
    assert stages == ["warmup"] * 3 + ["compressed"] * 3
    both = json.loads((out / "summary.json").read_text())
    assert both["onebit_adam"]["freeze_step"] == 3
    assert both["onebit_adam"]["bytes_sent_per_rank"] < both["adam"]["bytes_sent_per_rank"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["demo", "--steps", "0"], "--steps: must be a positive integer, got 0"),
        (["demo", "--freeze-step", "soon"], "--freeze-step: must be 'auto' or an integer >= 0, got 'soon'"),
        (["train", "--refresh-every", "0"], "--refresh-every: must be 'never' or a positive integer, got '0'"),
        (["train", "--optimizer", "sgd"], "invalid choice: 'sgd'"),
        (["bench", "disk"], "invalid choice: 'disk'"),
        (["bench", "kernels", "--tasks", "gpt"], "unrecognized arguments: --tasks gpt"),
        (["bench", "convergence", "--numel", "8"], "unrecognized arguments: --numel 8"),
    ],
)
def test_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("what,own,foreign", [
    ("kernels", ["--numel", "--threads", "--device"], ["--tasks", "--world-sizes", "--nodes"]),
    ("comm", ["--sizes", "--backend", "--nodes"], ["--tasks", "--threads", "--world-sizes"]),
    ("convergence", ["--tasks", "--families", "--seeds", "--report-only"], ["--numel", "--nodes", "--world-sizes"]),
    ("memory", ["--world-sizes", "--optimizers", "--size"], ["--tasks", "--numel", "--nodes"]),
])
def test_each_bench_shows_only_its_own_options(what, own, foreign, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", what, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert all(f in text for f in own) and not any(f in text for f in foreign)


def test_bench_kernels_prints_table(capsys):
    assert main(["bench", "kernels", "--numel", "4099", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    for kernel in ("copy", "pack_signs", "unpack_signs", "ef_sign_compress", "server_average_4", "clamp_scaled",
                   "zero_where_equal"):
        assert kernel in out
    assert "numba" in out and "reference" in out and "of copy bandwidth" in out


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["train", "--bandwidth", "fast"], "--bandwidth: bandwidth must look like '1gbit'"),
        (["train", "--latency", "soon"], "--latency: latency must look like '0.5ms'"),
        (["train", "--nodes", "0"], "--nodes: must be a positive integer, got 0"),
        (["train", "--task", "imagenet"], "invalid choice: 'imagenet'"),
        (["train", "--lr", "-1"], "--lr: must be a positive number, got -1"),
        (["cluster"], "--nodes is required"),
        (["model"], "the following arguments are required: --params"),
        (["model", "--params", "10", "--world-size", "3", "--nodes", "2"], "world_size=3 must be a multiple of nodes=2"),
        (["train", "--backend", "nccl"], "invalid choice: 'nccl'"),
        (["train", "--compressor", "fp8"], "argument --compressor: invalid choice: 'fp8'"),
        (["train", "--backend", "mpi", "--optimizer", "ddp_allreduce"],
         "optimizer 'ddp_allreduce' runs on DDP, which needs backend 'torch', not 'mpi'"),
    ],
)
def test_more_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["train", "--world-size", "3", "--nodes", "2"], "--world-size 3 is not a multiple of --nodes 2"),
        (["train", "--hierarchical"], "--hierarchical needs --nodes"),
        (["compare", "--optimizers", "adam,sgd"], "unknown ['sgd']"),
        (["compare", "--rounds", "2", "--resume"], "--resume cannot continue --rounds 2"),
        # the paper's outer step carries no error: it would run as diloco_fedavg
        (["bench", "convergence", "--families", "adamw", "--optimizers", "diloco_fedavg_no_ef", "--extended"],
         "diloco_fedavg_no_ef would run nothing"),
        (["bench", "convergence", "--families", "adamw", "--optimizers", "diloco_ef"], "diloco_ef would run nothing"),
    ],
)
def test_inconsistent_options(argv, msg):
    with pytest.raises(SystemExit, match=msg.replace("[", r"\[").replace("]", r"\]")):
        main(argv)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("task", ["gpt", "bert", "digits"])
def test_tasks_train_and_write_outputs(task, tmp_path):
    out = tmp_path / task
    argv = ["train", "--task", task, "--optimizer", "onebit_adam", "--steps", "4", "--freeze-step", "2",
            "--batch-size", "4", "--d-model", "32", "--layers", "1", "--heads", "2", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    recs = _records(out / "onebit_adam" / "metrics.jsonl")
    assert [r["stage"] for r in recs] == ["warmup", "warmup", "compressed", "compressed"]
    summary = json.loads((out / "onebit_adam" / "summary.json").read_text())
    assert summary["config"]["task"] == task and summary["parameters"] > 0 and summary["finite"]


def _straight_and_resumed(tmp_path, name, *options):
    """6 steps of ``onebit train --optimizer name``, straight and split at a checkpoint after
    step 3 then resumed: each run's records."""
    common = ["--optimizer", name, *options, "--batch-size", "4", "--hidden", "32", "--quiet"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--steps", "6", "--out", str(straight), *common]) == 0
    assert main(["train", "--steps", "3", "--out", str(split), "--checkpoint-every", "3", *common]) == 0
    assert main(["train", "--steps", "6", "--out", str(split), "--resume", *common]) == 0
    return _records(straight / name / "metrics.jsonl"), _records(split / name / "metrics.jsonl")


def test_resume_continues_the_same_run(tmp_path):
    a, b = _straight_and_resumed(tmp_path, "onebit_adam", "--freeze-step", "2")
    assert [r["step"] for r in b] == list(range(1, 7))
    # Model, optimizer (phase, frozen variance, errors), schedule and data stream all resume exactly.
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["stage"] for r in b] == ["warmup"] * 2 + ["compressed"] * 4


def test_resume_after_a_death_in_a_save_goes_on_from_the_last_whole_one(tmp_path):
    # rank 0 died saving step 4 after rank 1 had written its file: resumed from step 2, on every rank
    common = ["--optimizer", "zero_one_adam", "--freeze-step", "2", "--batch-size", "4", "--hidden", "32", "--quiet"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--steps", "6", "--out", str(straight), *common]) == 0
    assert main(["train", "--steps", "4", "--out", str(split), "--checkpoint-every", "2", *common]) == 0
    unfinished = split / "zero_one_adam" / "checkpoints" / "step-000000004"
    (unfinished / "complete.json").unlink()
    (unfinished / "rank0.pt").unlink()
    assert main(["train", "--steps", "6", "--out", str(split), "--resume", *common]) == 0
    a, b = _records(straight / "zero_one_adam" / "metrics.jsonl"), _records(split / "zero_one_adam" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 7)) and [r["loss"] for r in a] == [r["loss"] for r in b]


def test_streamed_diloco_trains_and_resumes_from_a_checkpoint_taken_in_flight(tmp_path):
    # step 3 sends a fragment, which lands at step 4: the checkpoint after step 3 holds it in flight
    a, b = _straight_and_resumed(tmp_path, "diloco", "--sync-every", "4", "--fragments", "2", "--delay", "1")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["stage"] for r in a] == ["outer", "local"] * 3
    config = json.loads((tmp_path / "straight" / "diloco" / "summary.json").read_text())["config"]
    assert (config["sync_every"], config["fragments"], config["delay"]) == (4, 2, 1)


def test_compressor_option_reaches_the_optimizer(tmp_path):
    # identity: the exact exchange (the control), as many bytes as the fp32 warm-up; sign: 1 bit a value
    sent = {}
    for name in ("identity", "sign"):
        out = tmp_path / name
        assert main(["train", "--optimizer", "onebit_adam", "--compressor", name, "--steps", "3", "--freeze-step", "1",
                     "--batch-size", "4", "--hidden", "32", "--out", str(out), "--quiet"]) == 0
        recs = _records(out / "onebit_adam" / "metrics.jsonl")
        assert [r["stage"] for r in recs] == ["warmup", "compressed", "compressed"]
        assert json.loads((out / "onebit_adam" / "summary.json").read_text())["config"]["compressor"] == name
        sent[name] = [r["bytes_sent"] for r in recs]
    # (the first step also sends the check that the ranks hold states of one step)
    assert sent["identity"][2] >= sent["identity"][0] - check_bytes(2) > 16 * sent["sign"][2]


def test_records_carry_what_the_automatic_freeze_waits_on(tmp_path):
    # stats["variance_ratio"] from step D + 1 = 101 on (the bias-corrected criterion's window at beta2 0.999),
    # where a variance never refreshed waits for it (refreshed, the freeze comes at step 100)
    assert main(["train", "--optimizer", "onebit_adam", "--freeze-step", "auto", "--refresh-every", "never",
                 "--steps", "102", "--batch-size", "4", "--hidden", "32", "--out", str(tmp_path), "--quiet"]) == 0
    recs = _records(tmp_path / "onebit_adam" / "metrics.jsonl")
    ratios = [r["variance_ratio"] for r in recs]
    assert ratios[:100] == [None] * 100 and all(isinstance(x, float) and x > 0 for x in ratios[100:])


def test_records_carry_each_steps_cpu_time_and_the_cores_it_shared(tmp_path):
    assert main(["train", "--optimizer", "onebit_adam", "--freeze-step", "2", "--steps", "4", "--batch-size", "4",
                 "--hidden", "32", "--out", str(tmp_path), "--quiet"]) == 0
    out = tmp_path / "onebit_adam"
    recs, summary = _records(out / "metrics.jsonl"), json.loads((out / "summary.json").read_text())
    assert all(isinstance(r["cpu_time"], float) and r["cpu_time"] > 0 for r in recs)
    compressed = [r["cpu_time"] for r in recs if r["stage"] == "compressed"][1:]
    assert summary["cpu_time_s"]["compressed"] == statistics.median(compressed)
    assert summary["host_cores"] == len(os.sched_getaffinity(0))


def test_cores_busy_is_every_ranks_cpu_time_over_the_elapsed_cores_time():
    from onebit.bench._analysis import compare_rows, cores_busy

    def run(cores, stages, times, cpus):
        summary = {"config": {"world_size": 4}, "eval_loss": 1.0, "final_loss": 1.0, "freeze_step": None,
                   "bytes_sent_per_rank": 0, "train_time_s": 1.0, "overlap": {}, "host_cores": cores,
                   "step_time_s": {s: 0.25 for s in stages}, "comm_time_s": {s: 0.0 for s in stages}}
        records = [{"stage": s, "time": t, "cpu_time": c, "loss": 1.0, "step_time": 0.25}
                   for s, t, c in zip(stages, times, cpus)]
        return summary, records

    # 4 ranks each busy 0.1 s of every 0.25 s on 2 cores (0.4 of 0.5 core-seconds), over the
    # compressed steps after its first: the warm-up's and the first compressed step's left out.
    stages = ["warmup"] * 2 + ["compressed"] * 4
    busy = run(2, stages, [0.3, 0.9, 1.5, 1.75, 2.0, 2.25], [0.5, 0.5, 0.5, 0.1, 0.1, 0.1])
    assert cores_busy(*busy) == pytest.approx(0.8)
    # summed over the steps, not per step: a rank that times a short window of a step
    uneven = run(2, ["warmup"] * 4, [0.0, 0.05, 0.5, 0.75], [0.1, 0.1, 0.1, 0.1])
    assert cores_busy(*uneven) == pytest.approx(4 * 0.3 / (0.75 * 2))
    unknown = run(None, stages, [0.3, 0.9, 1.5, 1.75, 2.0, 2.25], [0.1] * 6)
    unrecorded = run(2, stages, [0.3, 0.9, 1.5, 1.75, 2.0, 2.25], [None] * 6)
    assert cores_busy(*unknown) is None and cores_busy(*unrecorded) is None
    cases = {"a": busy, "b": unknown, "c": unrecorded}
    rows, _ = compare_rows({k: v[0] for k, v in cases.items()}, {k: v[1] for k, v in cases.items()}, "a", None)
    column = rows[0].index("cores busy")
    assert [row[column] for row in rows[1:]] == ["80%", "-", "-"]


def test_round_rows_give_each_rounds_ratio_to_the_baseline_of_that_round():
    from onebit.bench._analysis import round_rows
    from onebit.bench._reports import rounds_table

    rounds = {"baseline": "floor",
              "step_time": {"floor": [0.100, 0.120, 0.110], "x": [0.110, 0.144, 0.110], "y": [None, 0.132, 0.121],
                            "z": [0.1, 0.1, None]},
              "cores_busy": {"floor": [0.9, 0.8, None], "x": [None, None, None], "y": [0.5, 0.6, 0.7],
                             "z": [None, None, None]},
              "skipped_steps": {"floor": [0, 0, 0], "x": [0, 2, 0], "y": [0, 0, 0], "z": [1, 1, 0]}}
    rows = round_rows(rounds)
    assert rows[1][1:] == ["3", "110.0", "1.000x", "1.000-1.000x", "1.000x [1.000, 1.000]", "85%"]
    # x against the floor of the same round (1.1 and 1.0 -- not against the floor's median), its
    # round 2 left out: a skipped step sends 4 bytes and looks fast
    logs = [math.log(1.1), math.log(1.0)]
    half = 12.706 * statistics.stdev(logs) / math.sqrt(2)  # Student's t, 1 degree of freedom
    mean = statistics.fmean(logs)
    assert rows[2][1:] == ["2", "110.0", "1.050x", "1.000-1.100x",
                           f"{math.exp(mean):.3f}x [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]", "-"]
    # y has no step time in round 1: rounds 2 and 3, each 1.1x
    assert rows[3][1:] == ["2", "126.5", "1.100x", "1.100-1.100x", "1.100x [1.100, 1.100]", "65%"]
    assert rows[4][1:] == ["0", "-", "-", "-", "-", "-"]
    text = rounds_table(rounds)
    assert text.startswith("onebit compare: 3 rounds")
    assert text.endswith("left out of the figures): x round 2: 2, z round 1: 1, z round 2: 1")


def test_compare_rounds_alternate_the_order_and_keep_each_round(tmp_path, capsys):
    from onebit.bench._analysis import step_time
    from onebit.bench._reports import report_files

    out = tmp_path / "rounds"
    assert main(["compare", "--optimizers", "local_adam,onebit_adam", "--baseline", "local_adam", "--rounds", "2",
                 "--steps", "4", "--freeze-step", "2", "--batch-size", "4", "--hidden", "32", "--out", str(out),
                 "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "round 1 of 2: local_adam, onebit_adam" in text and "round 2 of 2: onebit_adam, local_adam" in text
    for k, (first, last) in ((1, ("local_adam", "onebit_adam")), (2, ("onebit_adam", "local_adam"))):
        done = {name: (out / f"round{k}" / name / "summary.json").stat().st_mtime_ns for name in (first, last)}
        assert done[first] < done[last]  # trained in that order, not only printed so
    summary = json.loads((out / "summary.json").read_text())
    for k in (1, 2):
        kept = json.loads((out / f"round{k}" / "summary.json").read_text())
        for name in ("local_adam", "onebit_adam"):
            records = _records(out / f"round{k}" / name / "metrics.jsonl")
            assert summary["step_time"][name][k - 1] == step_time(kept[name], records)
        assert (out / f"round{k}" / "table.txt").exists()
    # the table is a report: regenerated from the summary, as benchmarks/report.py checks
    assert (out / "table.txt").read_text() == report_files(summary)["table.txt"]
    assert "geometric mean, 95% interval" in text and summary["provenance"]["command"].startswith("onebit compare")


def test_train_config_names_a_bad_compressor():
    from onebit.bench._train import TrainConfig

    with pytest.raises(ValueError, match="compressor must be one of .*identity.*; got 'fp8'"):
        TrainConfig(compressor="fp8")


@pytest.mark.parametrize("name,per_value", [("ddp_allreduce", 4), ("ddp_fp16", 2)])
def test_ddp_peers_count_their_bytes(name, per_value, tmp_path):
    out = tmp_path / name
    assert main(["train", "--optimizer", name, "--steps", "3", "--batch-size", "4", "--hidden", "32",
                 "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / name / "summary.json").read_text())
    recs = _records(out / name / "metrics.jsonl")
    # Ring all-reduce on 2 ranks: each rank sends the whole buffer once.
    assert recs[0]["bytes_sent"] == per_value * summary["parameters"]


def test_compare_writes_table_plot_and_summaries(tmp_path, capsys):
    out = tmp_path / "cmp"
    names = "onebit_adam,birder_overlap,ddp_powersgd,ddp_birder"
    assert main(["compare", "--optimizers", names, "--steps", "4", "--freeze-step", "2", "--batch-size", "4",
                 "--hidden", "32", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    table = (out / "table.txt").read_text()
    for name in ["adam", *names.split(",")]:
        assert name in table and (out / name / "metrics.jsonl").exists()
    assert "stage speedup" in text and "end-to-end" in text
    assert set(json.loads((out / "summary.json").read_text())) == {"adam", *names.split(",")}
    assert (out / "loss.png").exists()


def test_compare_without_a_freeze_builds_each_optimizer_with_its_defaults(tmp_path, capsys):
    out = tmp_path / "cmp"
    names = "onebit_adam,zero_one_adam,diloco"
    assert main(["compare", "--optimizers", names, "--baseline", "onebit_adam", "--steps", "5", "--batch-size", "4",
                 "--hidden", "32", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert all(s["config"]["freeze_step"] is None for s in summary.values())
    stages = {name: {r["stage"] for r in _records(out / name / "metrics.jsonl")} for name in names.split(",")}
    # 1-bit Adam's "auto" does not freeze in 5 steps; 0/1 Adam refreshes its variance on every one of
    # its first 16 steps (var_update_scaler); DiLoCo synchronises after 500 (a freeze set by hand
    # would have compressed, stopped the refreshes and synchronised on these steps)
    assert stages == {"onebit_adam": {"warmup"}, "zero_one_adam": {"variance"}, "diloco": {"local"}}
    assert summary["diloco"]["bytes_sent_per_rank"] == check_bytes(2)  # the first step's check alone
    # "auto" is the same for every optimizer: its own (0/1 Adam and DiLoCo have no automatic freeze)
    auto = tmp_path / "auto"
    assert main(["compare", "--optimizers", names, "--baseline", "onebit_adam", "--steps", "5", "--batch-size", "4",
                 "--hidden", "32", "--freeze-step", "auto", "--out", str(auto), "--quiet"]) == 0
    for name in names.split(","):
        steps = [[(r["loss"], r["stage"], r["bytes_sent"]) for r in _records(d / name / "metrics.jsonl")]
                 for d in (auto, out)]
        assert steps[0] == steps[1], name
    demo = tmp_path / "demo"
    assert main(["demo", "--steps", "4", "--batch-size", "4", "--hidden", "32", "--loopback", "--out", str(demo),
                 "--quiet"]) == 0
    assert "1-bit Adam did not leave its fp32 warm-up in 4 steps" in capsys.readouterr().out


def test_compare_runs_0_1_adams_refreshes_bounded_or_as_the_paper(tmp_path):
    losses = {}
    for schedule in (None, "bounded", "paper"):
        out = tmp_path / str(schedule)
        flags = [] if schedule is None else ["--refresh-schedule", schedule]
        assert main(["compare", "--optimizers", "zero_one_adam", "--baseline", "zero_one_adam", "--steps", "20",
                     "--batch-size", "4", "--hidden", "32", "--out", str(out), "--quiet", *flags]) == 0
        records = _records(out / "zero_one_adam" / "metrics.jsonl")
        losses[schedule] = [r["loss"] for r in records]
        # refreshes on steps 1-16, then every 2nd (either schedule: they part at step 248)
        assert [r["step"] for r in records if r["stage"] == "variance"] == [*range(1, 17), 18, 20]
    # a refresh after a gap of 2 (step 18) weighs 2 steps with the default, 1 as the paper
    assert losses[None] == losses["bounded"]
    assert losses["paper"][:18] == losses[None][:18] and losses["paper"][18:] != losses[None][18:]


@pytest.mark.parametrize("every,refreshes", [(None, [11]), ("2", [5, 7, 9, 11]), ("never", [])])
def test_train_refreshes_1bit_adams_variance_as_asked(tmp_path, every, refreshes):
    # frozen at step 3: the default refreshes every 8th step after it, 2 every other one, never not at all
    out = tmp_path / "run"
    flags = [] if every is None else ["--refresh-every", every]
    assert main(["train", "--steps", "12", "--batch-size", "4", "--hidden", "32", "--freeze-step", "3", "--quiet",
                 "--out", str(out), *flags]) == 0
    stages = [r["stage"] for r in _records(out / "onebit_adam" / "metrics.jsonl")]
    assert [t for t, stage in enumerate(stages, 1) if stage == "refresh"] == refreshes
    assert stages[:3] == ["warmup"] * 3 and stages.count("compressed") == 9 - len(refreshes)
    summary = json.loads((out / "onebit_adam" / "summary.json").read_text())
    assert summary["steps"] == {s: stages.count(s) for s in set(stages)}


def test_model_reads_sizes_as_people_write_them(capsys):
    for size in ("125M", "1.25e8", "125000000"):
        assert main(["model", "--params", size, "--optimizers", "adam"]) == 0
        assert "125M parameters" in capsys.readouterr().out
    for bad in ("1.5", "0", "lots", "inf"):
        with pytest.raises(SystemExit):
            main(["model", "--params", bad])
        assert f"got {bad!r}" in capsys.readouterr().err


def test_model_prints_every_optimizer(capsys):
    assert main(["model", "--params", "8400000", "--bandwidth", "1gbit,200mbit", "--compute-ms", "50"]) == 0
    text = capsys.readouterr().out
    assert text.count("onebit model:") == 2
    for name in ("adam", "onebit_adam", "onebit_lamb", "birder_hierarchical", "comp_ams", "qadam", "ddp_fp16",
                 "diloco", "diloco_fp32", "diloco_8bit"):
        assert f"\n{name} " in text
    assert all(len(line) <= 80 for line in text.splitlines())  # it fits a terminal, and the docs' code box
    assert main(["model", "--params", "1000", "--optimizers", "adam,diloco"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[4:6]]
    assert rows == ["adam", "diloco"]


def test_version_and_help_without_a_command(capsys):
    import onebit

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"onebit {onebit.__version__}\n"
    for argv, usage in (([], "usage: onebit [-h]"), (["bench"], "usage: onebit bench [-h]")):
        assert main(argv) == 0
        assert capsys.readouterr().out.startswith(usage)


def test_truncated_checkpoint_gives_a_clear_error(tmp_path):
    from onebit.launch import RankFailure

    common = ["--optimizer", "birder", "--batch-size", "4", "--hidden", "32", "--quiet", "--out", str(tmp_path)]
    assert main(["train", "--steps", "2", "--checkpoint-every", "2", *common]) == 0
    ckpt = tmp_path / "birder" / "checkpoints" / "step-000000002" / "rank1.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(RankFailure, match="rank1.pt cannot be read"):
        main(["train", "--steps", "4", "--resume", *common])


def test_bench_comm_reports_each_collectives_time_bytes_and_cpu(tmp_path, capsys):
    out = tmp_path / "comm"
    assert main(["bench", "comm", "--numel", "4099", "--repeat", "2", "--world-size", "2", "--out", str(out)]) == 0
    results = json.loads((out / "summary.json").read_text())["results"]
    assert {r["collective"] for r in results} >= {"all_reduce fp32", "compressed_allreduce sign"}
    # the CPU time each call took a rank (mean over the ranks), beside its wall time
    assert all(r["cpu_seconds"] > 0 for r in results)
    header = (out / "table.txt").read_text().splitlines()[1]
    assert header.split()[:4] == ["collective", "ms", "CPU", "ms/rank"] and "CPU ms/rank" in capsys.readouterr().out


def test_bench_convergence_pairs_seeds_and_reports_intervals(tmp_path, capsys):
    out = tmp_path / "conv"
    argv = ["bench", "convergence", "--tasks", "digits", "--families", "adamw", "--optimizers", "onebit_adam,diloco",
            "--steps", "5", "--seeds", "2", "--perturb", "1", "--freeze", "default,0.2", "--batch-size", "4",
            "--world-size", "2", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["provenance"]["command"] == "onebit " + " ".join(argv)
    assert set(summary["provenance"]) == {"command", "machine", "date"}
    runs = summary["runs"]
    # the defaults as shipped (no freeze step set), then a freeze at 20% of the steps
    labels = ["adamw"] + [label for name in ("onebit_adam_identity", "onebit_adam", "diloco_identity", "diloco")
                          for label in (name, f"{name}@20%")]
    assert [r["label"] for r in runs] == labels * 4
    assert [(r["seed"], r["perturbation"]) for r in runs[::9]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # each run records the arguments it was built with, defaults included: its label's meaning of the day
    assert runs[8]["arguments"] == {**runs[8]["arguments"], "lr": 0.003, "sync_every": 1, "compressor": "sign",
                                    "collective": "allgather", "outer_step": "sparseloco", "error_feedback": None}
    assert runs[5]["arguments"]["compressor"] == "identity" and runs[0]["arguments"]["freeze_step"] == 10 ** 9
    # "auto" does not freeze in 5 steps; 20% of them is step 1
    assert [r["freeze_step"] for r in runs[:5]] == [None, None, 1, None, 1]
    assert all(r["replicas"] == "identical" and r["first_nonfinite_step"] is None for r in runs)
    # digits is scored by its error rate on the whole held-out set, a gap in points, paired by
    # seed and perturbation
    row = next(a for a in summary["aggregate"] if a["label"] == "onebit_adam@20%")
    key = ("seed", "perturbation")
    base = {tuple(r[k] for k in key): r["heldout_error"] for r in runs if r["label"] == "adamw"}
    mine = {tuple(r[k] for k in key): r["heldout_error"] for r in runs if r["label"] == "onebit_adam@20%"}
    gaps = [mine[run] - base[run] for run in mine]
    assert row["metric"] == "heldout_error" and row["gaps"] == pytest.approx(gaps)
    assert row["runs"] == [list(run) for run in mine]
    assert row["gap_mean"] == pytest.approx(sum(gaps) / 4)
    worst = max(range(4), key=gaps.__getitem__)
    assert row["worst_gap"] == pytest.approx(gaps[worst]) and row["worst_run"] == list(list(mine)[worst])
    assert row["behind"] == pytest.approx(sum(g > 10.0 for g in gaps) / 4)
    assert row["target"] == 3.0 and row["verdict"] in ("met", "missed", "inconclusive")
    control = next(a for a in summary["aggregate"] if a["label"] == "onebit_adam_identity@20%")
    assert control["verdict"] == "control"
    # "auto" did not freeze in 5 steps: fp32 throughout, no verdict on the bits
    auto = next(a for a in summary["aggregate"] if a["label"] == "onebit_adam")
    assert auto["uncompressed"] == 4 and auto["verdict"] == "uncompressed" and row["uncompressed"] == 0
    # the bits' own cost: the paired gap to the identity control at the same schedule
    control_runs = {tuple(r[k] for k in key): r["heldout_error"] for r in runs
                    if r["label"] == "onebit_adam_identity@20%"}
    assert row["control_gaps"] == pytest.approx([mine[run] - control_runs[run] for run in mine])
    # DiLoCo as shipped synchronises every 500 steps: never in 5, no verdict on the bits; every
    # step at 20% of them
    silent, synced = (next(a for a in summary["aggregate"] if a["label"] == label) for label in ("diloco", "diloco@20%"))
    assert silent["verdict"] == "no exchange" and silent["silent"] == 4 and synced["silent"] == 0
    assert all(r["bytes_sent_per_rank"] > 0 for r in runs if r["label"] == "diloco@20%")
    (out / "table.md").unlink()
    assert main(["bench", "convergence", "--out", str(out), "--report-only"]) == 0
    table = (out / "table.md").read_text().splitlines()
    assert table[-1] == f"`onebit {' '.join(argv)}`; {summary['provenance']['machine']}, {summary['provenance']['date']}."
    assert table[0] == "**adamw, lr 0.003**" and table[2] == "| optimizer | digits |"
    line = next(t for t in table if t.startswith("| onebit_adam@20% |"))
    assert line.startswith(f"| onebit_adam@20% | {row['gap_mean']:+.1f} pt ± {row['gap_half']:.1f}")
    seed, perturbation = row["worst_run"]
    assert line.endswith(f"(worst {row['worst_gap']:+.1f}, seed {seed}{' perturbed' if perturbation else ''}); "
                         f"{row['control_gap_mean']:+.1f} pt ± {row['control_gap_half']:.1f} against its identity "
                         "control |")


def test_bench_convergence_runs_tasks_side_by_side(tmp_path):
    out = tmp_path / "conv"
    argv = ["bench", "convergence", "--tasks", "digits,frozen_unused", "--families", "adamw",
            "--optimizers", "onebit_adam,zero_one_adam", "--no-controls",
            "--steps", "3", "--seeds", "1", "--batch-size", "4", "--world-size", "2", "--jobs", "2",
            "--out", str(out), "--quiet"]
    assert main(argv) == 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [(r["task"], r["label"]) for r in runs] == [
        (task, label) for task in ("digits", "frozen_unused") for label in ("adamw", "onebit_adam", "zero_one_adam")]
    assert all(r["replicas"] == "identical" and r["first_nonfinite_step"] is None for r in runs)


def test_convergence_cells_leave_out_the_identity_controls_on_request():
    from onebit.bench._matrix import convergence_cells

    def labels(**kw):
        return [c.label for c in convergence_cells(("gpt",), ("adamw", "softsign_sgd"), **kw)]

    assert labels() == ["adamw", "onebit_adam_identity", "onebit_adam", "zero_one_adam_identity", "zero_one_adam",
                        "diloco_identity", "diloco", "softsign_sgd", "birder_identity", "birder"]
    assert labels(controls=False) == ["adamw", "onebit_adam", "zero_one_adam", "diloco", "softsign_sgd", "birder"]
    assert labels(optimizers=("diloco",), extended=True) == [
        "adamw", "diloco_identity", "diloco", "diloco_nesterov", "diloco_ef", "diloco_allreduce",
        "diloco_allreduce_ef", "diloco_streamed", "diloco_rows", "diloco_fedavg", "diloco_fedavg_identity",
        "diloco_fedavg_ef", "diloco_sparseloco", "diloco_sparseloco_sign", "diloco_sparseloco_allreduce",
        "diloco_sparseloco_sign_allreduce", "diloco_sparseloco_sign_rows", "diloco_sparseloco_sign_allreduce_rows",
        "diloco_sparseloco_sign_rows_lr125", "diloco_sparseloco_sign_rows_lr15", "diloco_sparseloco_sign_rows_lr2"]
    # (no_ef and fedavg_no_ef are the paper's outer step's defaults, nesterov and fedavg: not run twice)
    # no softsign_sgd alone
    assert labels(optimizers=("diloco_fedavg",), extended=True) == ["adamw", "diloco_fedavg"]


def test_a_seed_far_behind_misses_the_target_whatever_the_mean():
    from onebit.bench._matrix import _verdict

    assert _verdict(1.0, 1.0, 3.0, 0, worst=9.9) == "met"
    assert _verdict(1.0, 1.0, 3.0, 0, worst=10.5) == "missed"
    assert _verdict(2.5, 1.0, 3.0, 0, worst=4.0) == "inconclusive"
    assert _verdict(1.0, 1.0, 3.0, 1, worst=1.0) == "non-finite"


def test_perturbation_moves_every_weight_by_one_ulp():
    from onebit.bench._convergence import perturb_

    model = torch.nn.Linear(64, 64)
    before = [p.detach().clone() for p in model.parameters()]
    perturb_(model, 0)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    perturb_(model, 3)
    for p, b in zip(model.parameters(), before):
        up, down = torch.nextafter(b, torch.tensor(float("inf"))), torch.nextafter(b, torch.tensor(float("-inf")))
        assert bool(((p == up) | (p == down)).all()) and bool((p == up).any()) and bool((p == down).any())


def test_bench_memory_writes_the_table_and_summary(tmp_path, capsys):
    out = tmp_path / "memory"
    argv = ["bench", "memory", "--world-sizes", "2", "--optimizers", "adamw,onebit_adam", "--size", "96",
            "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "summary.json").read_text())["results"]
    assert [(r["optimizer"], r["stage"]) for r in results] == [("adamw", "compressed"), ("onebit_adam", "warmup"),
                                                                ("onebit_adam", "compressed")]
    assert results[0]["held"] == pytest.approx(2.0, abs=0.01)  # AdamW's m and v (plus 4-byte step counters)
    assert results[2]["footprint"] == 3.5 and results[2]["held"] <= 3.6
    assert "held above footprint + 0.1 (packed wire buffers): none" in capsys.readouterr().out


def test_bench_memory_of_hsdp_counts_shard_sizes(tmp_path, capsys):
    """With the model sharded by FSDP2 over 2 ranks of each of 2 nodes, 1-bit Adam and 1-bit LAMB
    hold their footprint at 2 replicas in *shard* sizes: half of the unsharded figures."""
    out = tmp_path / "memory"
    argv = ["bench", "memory", "--world-sizes", "4", "--shards", "2", "--optimizers", "onebit_adam,onebit_lamb",
            "--size", "96", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "summary.json").read_text())["results"]
    compressed = {r["optimizer"]: r for r in results if r["stage"] == "compressed"}
    assert compressed["onebit_adam"]["footprint"] == 3.5 and compressed["onebit_lamb"]["footprint"] == 5.5
    for r in compressed.values():
        assert r["shards"] == 2 and r["footprint"] - 0.01 <= r["held"] <= r["footprint"] + 0.1, r
    text = capsys.readouterr().out
    assert "sharded by FSDP2 over 2 ranks of each node" in text and "2 x 2" in text


def test_bench_convergence_leaves_out_cells_their_optimizer_refuses(tmp_path, capsys):
    out = tmp_path / "conv"
    argv = ["bench", "convergence", "--tasks", "digits", "--families", "adamw", "--optimizers",
            "diloco_streamed,onebit_adam_overlap", "--extended", "--freeze", "0.5", "--max-grad-norm", "1.0",
            "--steps", "6", "--seeds", "1", "--batch-size", "4", "--world-size", "2", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    # H = 3 steps cannot be cut in 4 fragments; the overlapped exchange cannot clip: each said, not run
    assert "diloco_streamed@50% left out: Invalid fragments value: 4 (sync_every=3 must be a multiple" in printed
    assert "onebit_adam_overlap@50% left out: Invalid max_grad_norm value with overlap=True: 1.0" in printed
    assert [r["label"] for r in json.loads((out / "summary.json").read_text())["runs"]] == ["adamw"]
