import json

import pytest

from onebit.cli import main


def test_demo_end_to_end_tiny(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "6", "--freeze-step", "3", "--batch-size", "8", "--out", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "onebit_adam" in text and "reduction" in text
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
        (["train", "--optimizer", "sgd"], "invalid choice: 'sgd'"),
        (["bench", "disk"], "invalid choice: 'disk'"),
    ],
)
def test_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


def test_bench_kernels_prints_table(capsys):
    assert main(["bench", "kernels", "--numel", "4099", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    for kernel in ("copy", "pack_signs", "unpack_signs", "ef_sign_compress"):
        assert kernel in out
