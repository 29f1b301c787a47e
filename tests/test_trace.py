"""``onebit.comm.trace``: the timeline of a traced step on real gloo ranks, and ``onebit train --trace``."""

import json

import pytest
import torch

import onebit
from _harness import run_ranks
from onebit import comm
from onebit.cli import main


def _traced_step(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, overlap=True, bucket_cap_mb=0.01)
    gen = torch.Generator().manual_seed(rank)
    untraced = []
    for step in range(1, 5):
        opt.zero_grad()
        x = torch.randn(8, 64, generator=gen)
        if step < 4:
            model(x).square().mean().backward()
            opt.step()
            untraced.append(comm._trace.traced())
            continue
        with comm.trace(rank, link="lo") as timeline:  # the ranks talk over loopback
            model(x).square().mean().backward()
            opt.step()
            with pytest.raises(RuntimeError, match="already"):
                with comm.trace(rank):
                    pass
    return timeline.to_json(), len(opt._exchange.bounds), untraced, opt.stats["bytes_sent"]


def test_a_traced_step_shows_each_bucket_ready_launched_and_exchanged():
    for rank, (trace, buckets, untraced, sent) in enumerate(run_ranks(_traced_step, 2)):
        assert untraced == [None, None, None] and buckets >= 3
        events = json.loads(json.dumps(trace))["traceEvents"]  # plain JSON
        assert {e["pid"] for e in events} == {rank}

        def named(name, lane):
            return [e for e in events if e["name"] == name and e["tid"] == lane]

        # Backward: every bucket's gradients ready, then its launch, in bucket order.
        ready, launch = named("ready", "backward"), named("launch", "backward")
        assert [e["args"]["bucket"] for e in ready] == [e["args"]["bucket"] for e in launch] == list(range(buckets))
        assert all(r["ts"] <= lnch["ts"] for r, lnch in zip(ready, launch))
        # The wire: a bucket's all-gather leaves right after the next bucket's all-to-all, all during
        # backward but the last bucket's, which leaves in step() right behind the agreement.
        step_lane = [e["name"] for e in sorted((e for e in events if e["tid"] == "step"), key=lambda e: e["ts"])]
        assert step_lane == ["flush", "agree", "gather", "exchange"] + ["apply"] * buckets
        flush = named("flush", "step")[0]["ts"]
        wire = sorted((e for e in events if e["tid"] == "wire"), key=lambda e: e["ts"])
        order = [(e["name"], e["args"].get("bucket")) for e in wire]
        expected = [("all_to_all", 0)]
        for b in range(1, buckets):
            expected += [("all_to_all", b), ("all_gather", b - 1)]
        expected += [("all_reduce(max)", None), ("all_gather", buckets - 1)]  # the step's agreement, then the last
        assert order == expected
        assert all(e["ts"] < flush for e in wire[:-2]) and wire[-2]["ts"] >= flush
        for phase in ("compress", "server", "decode"):
            assert [e["args"]["bucket"] for e in named(phase, "compute")] == list(range(buckets)), phase
        # 1-bit Adam steps each bucket's parameters as the bucket lands: after its decode, before the next one's.
        decode, apply = named("decode", "compute"), named("apply", "step")
        assert [e["args"]["bucket"] for e in apply] == list(range(buckets))
        assert all(d["ts"] + d["dur"] <= a["ts"] for d, a in zip(decode, apply))
        assert all(a["ts"] + a["dur"] <= d["ts"] for a, d in zip(apply, decode[1:]))
        # The link: bytes that left through loopback (both ranks'), from 0, never decreasing, at least
        # what this rank's exchange sent; sampled from the block's start to its end.
        link = sorted((e for e in events if e["tid"] == "link"), key=lambda e: e["ts"])
        assert {e["ph"] for e in link} == {"C"} and len(link) >= 2
        sent_so_far = [e["args"]["bytes"] for e in link]
        assert sent_so_far[0] == 0 and sent_so_far == sorted(sent_so_far) and sent_so_far[-1] >= sent > 0
        spans = [e for e in events if e["ph"] == "X"]
        assert link[-1]["ts"] >= max(e["ts"] + e["dur"] for e in spans) - 1e3  # µs


def test_trace_arguments_are_checked():
    with pytest.raises(ValueError, match="link 'no-such-nic' is not a network interface"):
        with comm.trace(0, link="no-such-nic"):
            pass
    for bad in (0, -1.0, float("inf"), "1ms", True):
        with pytest.raises(ValueError, match=f"interval must be a finite positive number of seconds, got {bad!r}"):
            with comm.trace(0, link="lo", interval=bad):
                pass
    assert comm._trace.traced() is None  # a refused trace leaves none recording


def test_train_records_every_rank_on_one_clock(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "runs"
    assert main(["train", "--optimizer", "onebit_adam_overlap", "--steps", "5", "--freeze-step", "2", "--trace",
                 "4", "--quiet", "--context", "8", "--hidden", "64", "--out", str(out)]) == 0
    run = out / "onebit_adam_overlap"
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    for rank in (0, 1):
        names = {e["name"] for e in events if e["pid"] == rank}
        assert {"forward", "backward", "step()", "all_to_all", "all_gather", "compress", "ready", "link"} <= names
    assert min(e["ts"] for e in events) >= 0 and (run / "timeline.png").stat().st_size > 0
    assert "timeline:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--steps", "3", "--trace", "4", "--out", str(out)])
