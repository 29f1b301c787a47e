"""The examples under ``examples/``, each run for real by ``torchrun`` on 2 gloo ranks.

Each prints one JSON line on rank 0: the final loss, ``opt.stats`` and the comm hook DDP's
logging data names (``local_gradient_hook``: DDP sent nothing, the optimizer exchanged).
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from onebit.bench._cluster import cluster_unavailable

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _torchrun(script, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"loss"')][-1]
    return json.loads(line)


def _check(result, steps, hook="local_gradient_hook"):
    stats = result["stats"]
    assert stats["step"] == steps and stats["skipped_steps"] == 0
    assert stats["stage"] == "compressed" and 0 < stats["bytes_sent"] < 100_000
    assert math.isfinite(result["loss"]) and result["loss"] < math.log(256)  # learnt something
    assert result["ddp_hook"] == hook


def test_plain_torchrun_with_and_without_ddp_and_accumulation():
    plain = _torchrun("plain_torchrun.py", "--steps", "30", "--freeze-step", "10", "--accumulate", "2")
    wrapped = _torchrun("plain_torchrun.py", "--steps", "30", "--freeze-step", "10", "--accumulate", "2", "--ddp")
    _check(plain, 30, hook=None)
    _check(wrapped, 30)
    # The same bits and bytes; only the unwrapped run overlaps its warm-up with backward (DDP writes
    # every gradient again after backward), so only it reports the overlap.
    overlap = ("overlap", "buckets_in_backward")
    assert plain["stats"]["buckets_in_backward"] == 0 and not any(k in wrapped["stats"] for k in overlap)
    assert wrapped["loss"] == plain["loss"]
    assert wrapped["stats"] == {k: v for k, v in plain["stats"].items() if k not in overlap}


def test_hugging_face_trainer(tmp_path):
    pytest.importorskip("transformers")
    _check(_torchrun("hf_trainer.py", "--steps", "20", "--freeze-step", "8", "--out", str(tmp_path)), 20)


def test_accelerate():
    pytest.importorskip("accelerate")
    _check(_torchrun("accelerate_train.py", "--steps", "20", "--freeze-step", "8"), 20)


def test_lightning():
    pytest.importorskip("lightning")
    _check(_torchrun("lightning_train.py", "--steps", "20", "--freeze-step", "8"), 20)


def test_diloco_torchrun_sends_only_at_synchronisations():
    result = _torchrun("diloco_torchrun.py", "--steps", "32", "--sync-every", "8")
    stats = result["stats"]
    assert stats["step"] == 32 and stats["skipped_steps"] == 0 and stats["stage"] == "outer"
    assert 0 < stats["bytes_sent"] < 100_000  # a 1-bit exchange of the 0.2M-parameter model
    assert math.isfinite(result["loss"]) and result["loss"] < math.log(256)


def test_diloco_torchrun_streamed():
    result = _torchrun("diloco_torchrun.py", "--steps", "32", "--sync-every", "8", "--fragments", "2", "--delay", "1")
    stats = result["stats"]
    # a fragment sent at step 31 lands at step 32, an inner step: its all-gather left at step 31, under it
    assert stats["step"] == 32 and stats["stage"] == "local" and stats["bytes_sent"] == 0
    assert 0 < stats["bytes_sent_total"] < 32 // 4 * 100_000
    assert math.isfinite(result["loss"]) and result["loss"] < math.log(256)


def test_switching_pages_plain_script_exits_cleanly(tmp_path):
    # The page's script as a user copies it: 1-bit Adam with its defaults, compressed from step 101
    # on (its last step, 300, a refresh), then destroy_process_group() with the optimizer still
    # referenced. A gloo worker that released its last collective during interpreter finalization
    # aborted the process ("terminate called without an active exception") in most runs on a loaded
    # 2-core machine (an idle one may pass without the fix: the race needs the worker to be slow to
    # release).
    page = (EXAMPLES.parent / "docs" / "switching.md").read_text()
    section = page.split("\n## A plain script under torchrun\n")[1].split("\n## ")[0]
    blocks = section.split("```python\n")[1:]
    assert len(blocks) == 1, "the section holds one Python script"
    script = tmp_path / "train.py"
    script.write_text(blocks[0].split("```")[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    for _ in range(3):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert "'stage': 'refresh'" in proc.stdout and "'freeze_step': 100" in proc.stdout
        assert "'skipped_steps': 0" in proc.stdout


def _agent(port, tmp_path, name, *args):
    """One torchrun agent of an elastic job on this machine (a node of its own), in a session of its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc_per_node", "1",
           "--max-restarts", "3", "--monitor-interval", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "elastic-test",
           "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1", str(EXAMPLES / "elastic_torchrun.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return subprocess.Popen(cmd, cwd=EXAMPLES, env=env, stdout=open(tmp_path / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.parametrize("optimizer", ["onebit_adam", pytest.param("diloco", marks=pytest.mark.slow)])
def test_elastic_torchrun_goes_on_without_a_lost_node(tmp_path, optimizer):
    # Two agents (two nodes of one machine); the second dies with its worker after step 45 of 100,
    # checkpoints every 10 steps: the first goes on alone from the last complete checkpoint.
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    record = tmp_path / "steps.jsonl"
    args = ("--optimizer", optimizer, "--steps", "100", "--checkpoints", str(tmp_path / "checkpoints"),
            "--timeout", "10", "--pause", "0.05", "--record", str(record))
    first = _agent(port, tmp_path, "first", *args)
    time.sleep(1)  # the first hosts the rendezvous store
    second = _agent(port, tmp_path, "second", *args)

    def steps():
        return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []

    deadline = time.monotonic() + 180
    while len(steps()) < 45 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.2)
    killed_after = steps()[-1]["step"]
    for pid in subprocess.run(["pgrep", "-P", str(second.pid)], capture_output=True, text=True).stdout.split():
        os.kill(int(pid), signal.SIGKILL)  # its worker, then the agent: the node is gone
    second.kill()
    assert first.wait(timeout=240) == 0, (tmp_path / "first.log").read_text()[-5000:]
    rows = steps()
    before = [r for r in rows if r["world"] == 2]
    after = [r for r in rows if r["world"] == 1]
    assert [r["step"] for r in before] == list(range(1, len(before) + 1)) and before[-1]["step"] >= killed_after
    resumed = after[0]["resumed_from"]
    assert resumed == 10 * (killed_after // 10) or resumed == 10 * (before[-1]["step"] // 10)  # the last complete one
    assert [r["step"] for r in after] == list(range(resumed + 1, 101))  # nothing lost, each step once after it
    assert all(math.isfinite(r["loss"]) for r in rows) and after[-1]["loss"] < math.log(256)


@pytest.mark.parametrize("back", ["after", "at-once"])
def test_diloco_quorum_goes_on_without_a_lost_replica_and_takes_it_back(tmp_path, back):
    # examples/diloco_quorum.py as the page runs it: three replicas on a store of their own; the
    # last is killed after step 30 of 320 and started again once the others went on without it
    # ("after"), or at once ("at-once": it may come before they notice the loss, and is then taken
    # into the group they re-form): they never stop, every replica ends with the same anchors, and
    # the survivors' records hold every step once.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def replica(name, log):
        cmd = [sys.executable, str(EXAMPLES / "diloco_quorum.py"), "--store", f"127.0.0.1:{store.port}",
               "--replicas", "3", "--replica-id", name, "--steps", "320", "--sync-every", "16", "--pause", "0.05",
               "--timeout", "20", "--record", str(tmp_path / f"{name}.jsonl")]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        return subprocess.Popen(cmd, cwd=EXAMPLES, env=env, stdout=open(tmp_path / log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def written(path, key):  # the rows written so far, a row still being written left out
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        return [json.loads(line)[key] for line in lines]

    procs = [replica(name, f"{name}.log") for name in ("a", "b", "c")]
    record = tmp_path / "a.jsonl"
    deadline = time.monotonic() + 180
    while len(written(record, "step")) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    procs[2].kill()
    procs[2].wait()
    while back == "after" and 2 not in written(record, "world") and time.monotonic() < deadline:
        time.sleep(0.05)
    procs[2] = replica("c", "c-back.log")
    codes = [p.wait(timeout=240) for p in procs]
    logs = {name: (tmp_path / name).read_text() for name in ("a.log", "b.log", "c-back.log")}
    assert codes == [0, 0, 0], {k: v[-3000:] for k, v in logs.items()}
    ends = [json.loads([line for line in log.splitlines() if line.startswith("{")][-1]) for log in logs.values()]
    assert len({e["anchors"] for e in ends}) == 1 and all(e["stats"]["step"] == 320 for e in ends)
    for name in ("a", "b"):
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 321))  # nothing redone, nothing skipped
        worlds = [r["world"] for r in rows]
        assert (2 in worlds or back == "at-once") and worlds[-1] == 3 and all(math.isfinite(r["loss"]) for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(cluster_unavailable() is not None, reason=f"{cluster_unavailable()}")
@pytest.mark.parametrize("scenario", ["between", "save", "in-flight", "quorum", "quorum-in-flight"])
def test_a_node_lost_on_the_emulated_cluster_and_back(tmp_path, scenario):
    # benchmarks/node_loss.py: 4 namespaces, one torchrun agent each (with a quorum: one replica
    # each, no torchrun); the last is killed after step 46 (or in the save after it), the 3 others
    # go on, and the node started again at step 60 (with a quorum: 50) joins.
    out = tmp_path / "trial.jsonl"
    rejoin = "50" if scenario.startswith("quorum") else "60"
    cmd = [sys.executable, str(EXAMPLES.parent / "benchmarks" / "node_loss.py"), "--scenario", scenario,
           "--steps", "160" if rejoin == "60" else "200", "--rejoin", rejoin, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    row = json.loads(out.read_text())
    assert row["passed"] and row["worlds"] == [3, 4], (row["checks"], row["logs"])
