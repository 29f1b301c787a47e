"""A node lost in the middle of a run, on the emulated cluster, with torchrun's elastic restarts.

Each node of the emulated cluster (``onebit.bench._cluster``: network namespaces joined by
shaped links) runs one torchrun agent of one worker, ``examples/elastic_torchrun.py``; node 0's
agent hosts the rendezvous (``--dedicated-store``: a store on a host of its own). Once the run
is under way, a node's agent and its worker (``--victim``, the last node by default) are
killed with SIGKILL -- the node is gone -- at a chosen moment:

* ``between``: after a step between two checkpoints (1-bit Adam);
* ``save``: as the checkpoint after that step is being written (its folder exists, the step
  is not yet complete) (1-bit Adam);
* ``in-flight``: after a step that sent a DiLoCo fragment (streamed DiLoCo: 16 inner steps,
  4 fragments, each exchange in flight 2 steps), while it is in flight.

* ``quorum``, ``quorum-in-flight``: no torchrun and no restart. Each node runs a replica of
  ``examples/diloco_quorum.py`` (DiLoCo on a ``onebit.comm.Quorum`` over the dedicated store;
  ``-in-flight``: streamed, a fragment's exchange in flight), and the survivors go on without the
  killed one; the report gives the stall instead of a restart's phases.

``--rejoin STEP`` starts the lost node's agent again once the survivors pass ``STEP``. The
agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a new store for the workers at each
restart, as the docs say to); ``--shared-worker-store`` gives torchrun's default instead.

Each trial checks what the restart must give -- the survivors finish with exit status 0 (each
worker checks that the replicas are identical, ``check_replicas()``, after loading and at the
end), every step before the kill ran once, the run resumed from the newest checkpoint every
rank completed and ran each step after it exactly once (or the node rejoined), the losses stay
finite -- and times it::

    python benchmarks/node_loss.py --scenario between --trials 5 --out benchmarks/results/node-loss/trials.jsonl
    python benchmarks/node_loss.py --report benchmarks/results/node-loss/trials.jsonl

The report gives, per setting, the trials that passed, the steps redone, the restarts, where
the stall went (detection, torchrun's rendezvous, the workers' start up to their first step,
from a survivor's agent log) and the time lost: from the kill until the survivors are back at
the step the run had reached. Needs root and iproute2 (the emulated cluster); a trial takes
one to two minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from _records import append_row, provenance, provenance_note, read_rows

from onebit.bench._cluster import ClusterSpec, EmulatedCluster, parse_bandwidth

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "elastic_torchrun.py"
SCENARIOS = {
    "between": ["--optimizer", "onebit_adam"],
    "save": ["--optimizer", "onebit_adam"],
    "in-flight": ["--optimizer", "diloco", "--sync-every", "16", "--fragments", "4", "--delay", "2"],
}
CHECKPOINT_EVERY = 10
PORT = 29400
# Live recovery, no restart: each node runs a replica of examples/diloco_quorum.py directly (no
# torchrun), on a onebit.comm.Quorum over the dedicated store
QUORUM_EXAMPLE = EXAMPLE.parent / "diloco_quorum.py"
QUORUM_SCENARIOS = {
    "quorum": ["--sync-every", "16"],
    "quorum-in-flight": ["--sync-every", "16", "--fragments", "4", "--delay", "2"],
}


def _descendants(pid: int) -> list[int]:
    """``pid``'s children, theirs, and so on (by ``pgrep -P``)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in map(int, out) for d in (c, *_descendants(c))]


def _kill_node(agent: subprocess.Popen, known: list[int] = ()) -> None:
    """The node is gone: its agent and every process under it end (SIGKILL), ``known`` (found
    beforehand) first: finding them takes a few pgrep calls, time enough for a save to complete."""
    for pids in (known, [agent.pid, *_descendants(agent.pid)]):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    agent.wait()


def _store(cluster: EmulatedCluster) -> tuple[str, subprocess.Popen]:
    """The rendezvous store on a host of its own (as torchft runs its lighthouse): a TCPStore
    server in the switch's namespace, at an address of the nodes' network."""
    address = "10.255.0.1"
    subprocess.run(["ip", "-n", cluster.switch, "addr", "add", f"{address}/8", "dev", "br0"], check=True)
    code = (f"import time; from torch.distributed import TCPStore; s = TCPStore({address!r}, {PORT}, is_master=True, "
            "multi_tenant=True); time.sleep(1e6)")
    return address, subprocess.Popen(["ip", "netns", "exec", cluster.switch, sys.executable, "-c", code],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _agent(cluster: EmulatedCluster, k: int, args: list[str], rdzv_conf: str, store: str | None,
           shared_store: bool, log: Path) -> subprocess.Popen:
    """Node ``k``'s torchrun agent, in its namespace; node 0's hosts the rendezvous store unless
    ``store`` (an address) does. ``shared_store``: torchrun's default, its workers reuse one
    store across restarts (without it, each round's rank 0 starts a new one)."""
    nodes = cluster.spec.nodes
    conf = f"{rdzv_conf},is_host={'true' if k == 0 and store is None else 'false'}"
    endpoint = f"{store or cluster.address(0)}:{PORT}"
    cmd = ["ip", "netns", "exec", cluster.node(k), sys.executable, "-m", "torch.distributed.run",
           "--nnodes", f"{nodes - 1}:{nodes}", "--nproc_per_node", "1", "--max-restarts", "3",
           "--monitor-interval", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", "node-loss", "--rdzv-conf", conf, "--local-addr", cluster.address(k), str(EXAMPLE), *args]
    # LOGLEVEL=INFO: the agents log each restart of their worker group, which the trial counts
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOGLEVEL="INFO")
    if not shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a new store for the workers at each round (docs)
    return subprocess.Popen(cmd, cwd=EXAMPLE.parent, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _rows(record: Path) -> list[dict]:
    return read_rows(record) if record.exists() else []


def _complete(checkpoints: Path) -> list[int]:
    """The checkpoint steps every rank completed (``onebit.Checkpoints``' layout)."""
    return sorted(int(p.parent.name.split("-")[1]) for p in checkpoints.glob("step-*/complete.json"))


def trial(scenario: str, nodes: int, bandwidth: str, steps: int, kill_at: int, pause: float, timeout: float,
          rdzv_conf: str, victim: int, dedicated_store: bool = False, shared_store: bool = False,
          rejoin: int | None = None, logs: Path | None = None, deadline_s: float = 600.0) -> dict:
    """One run that loses node ``victim``; what happened, checked and timed."""
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(ClusterSpec(nodes, parse_bandwidth(bandwidth))) as cl:
        work = Path(tmp)
        record, checkpoints = work / "steps.jsonl", work / "checkpoints"
        args = [*SCENARIOS[scenario], "--steps", str(steps), "--checkpoints", str(checkpoints),
                "--checkpoint-every", str(CHECKPOINT_EVERY), "--timeout", str(timeout), "--pause", str(pause),
                "--record", str(record)]
        started: list[subprocess.Popen] = []  # every process of the trial, ended when it ends
        try:
            store = None
            if dedicated_store:
                store, server = _store(cl)
                started.append(server)
            agents = [_agent(cl, 0, args, rdzv_conf, store, shared_store, work / "node0.log")]
            time.sleep(2)  # the store is up before the others connect to it
            agents += [_agent(cl, k, args, rdzv_conf, store, shared_store, work / f"node{k}.log")
                       for k in range(1, nodes)]
            started += agents
            deadline = time.monotonic() + deadline_s  # a trial still running then counts as a hang
            save = checkpoints / f"step-{CHECKPOINT_EVERY * math.ceil(kill_at / CHECKPOINT_EVERY):09d}"

            def ready() -> bool:
                if scenario == "save":
                    return save.is_dir() and not (save / "complete.json").exists()
                rows = _rows(record)
                return bool(rows) and rows[-1]["step"] >= kill_at

            doomed: list[int] = []  # the victim's agent and worker, once the run is under way
            while not ready():
                if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                    raise RuntimeError(f"the run ended or stalled before the kill: {_tail(work)}")
                if not doomed and _rows(record):
                    doomed = [agents[victim].pid, *_descendants(agents[victim].pid)]
                time.sleep(0.002)
            t_kill = time.time()
            _kill_node(agents[victim], doomed)
            # What the kill left, once settled: the survivors cannot complete a save without the
            # victim, but they complete the one in progress if its part (its file, its barrier
            # message) was sent before it died.
            time.sleep(1.0)
            complete_at_kill = _complete(checkpoints)
            in_save = sorted(p.name for p in save.iterdir()) if scenario == "save" else None
            survivors = [a for k, a in enumerate(agents) if k != victim]
            if rejoin is not None:
                while not any(r["step"] >= rejoin and r["world"] == nodes - 1 for r in _rows(record)):
                    if time.monotonic() > deadline or survivors[0].poll() is not None:
                        break
                    time.sleep(0.05)
                survivors.append(_agent(cl, victim, args, rdzv_conf, store, shared_store, work / "node-back.log"))
                started.append(survivors[-1])
            codes = []
            for a in survivors:
                try:
                    codes.append(a.wait(timeout=max(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)  # still running at the deadline: a hang
        finally:
            for proc in started:
                if proc.poll() is None:
                    _kill_node(proc)
        if logs is not None:  # the agents' whole logs, kept
            logs.mkdir(parents=True, exist_ok=True)
            for p in work.glob("*.log"):
                shutil.copy(p, logs / p.name)
        survivor_log = (work / f"node{1 if victim == 0 else 0}.log").read_text()
        rows = _rows(record)
        found = _analyse(scenario, nodes, steps, rows, t_kill, complete_at_kill, in_save, codes,
                         sorted(p.name for p in checkpoints.iterdir()), rejoin)
        found.update(_phases(survivor_log, t_kill, found["first_after"]))
        # a failed trial keeps its logs' ends, to say why
        tails = {} if found["passed"] else {p.name: p.read_text()[-4000:] for p in sorted(work.glob("*.log"))}
        return {**found, "restarts": survivor_log.count("will restart worker group"), "victim": victim,
                "dedicated_store": dedicated_store, "shared_store": shared_store, "logs": tails}


def quorum_trial(scenario: str, nodes: int, bandwidth: str, steps: int, kill_at: int, pause: float, timeout: float,
                 victim: int, rejoin: int | None = None, deadline_s: float = 600.0) -> dict:
    """One run of DiLoCo on a quorum that loses node ``victim`` (and, with ``rejoin``, gets it back):
    what happened, checked and timed from a survivor's record of its steps."""
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(ClusterSpec(nodes, parse_bandwidth(bandwidth))) as cl:
        work = Path(tmp)
        started: list[subprocess.Popen] = []

        def replica(k: int, tag: str) -> subprocess.Popen:
            cmd = ["ip", "netns", "exec", cl.node(k), sys.executable, str(QUORUM_EXAMPLE), "--store", f"{store}:{PORT}",
                   "--replicas", str(nodes), "--replica-id", f"node{k}", "--steps", str(steps), "--pause", str(pause),
                   "--timeout", str(timeout), "--record", str(work / f"node{k}.jsonl"), *QUORUM_SCENARIOS[scenario]]
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            proc = subprocess.Popen(cmd, cwd=QUORUM_EXAMPLE.parent, env=env, stdout=open(work / f"{tag}.log", "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
            started.append(proc)
            return proc

        watched = 1 if victim == 0 else 0  # a survivor's record
        record = work / f"node{watched}.jsonl"
        try:
            store, server = _store(cl)
            started.append(server)
            time.sleep(2)
            procs = [replica(k, f"node{k}") for k in range(nodes)]
            deadline = time.monotonic() + deadline_s
            while not (_rows(record) and _rows(record)[-1]["step"] >= kill_at):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"the run ended or stalled before the kill: {_tail(work)}")
                time.sleep(0.002)
            t_kill = time.time()
            _kill_node(procs[victim])
            survivors = [p for k, p in enumerate(procs) if k != victim]
            if rejoin is not None:
                while not (_rows(record) and _rows(record)[-1]["step"] >= rejoin):
                    if time.monotonic() > deadline or survivors[0].poll() is not None:
                        break
                    time.sleep(0.05)
                t_back = time.time()
                survivors.append(replica(victim, "node-back"))
            codes = []
            for p in survivors:
                try:
                    codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        finally:
            for proc in started:
                if proc.poll() is None:
                    _kill_node(proc)
        rows = _rows(record)
        ends = []  # each finished replica's last line: its loss, its anchors' sum, its stats
        for log in sorted(work.glob("node*.log")):
            lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
            if lines:
                ends.append(json.loads(lines[-1]))
        found = _quorum_analyse(nodes, steps, rows, t_kill, codes, ends, rejoin,
                                None if rejoin is None else t_back)
        tails = {} if found["passed"] else {p.name: p.read_text()[-4000:] for p in sorted(work.glob("*.log"))}
        return {**found, "scenario": scenario, "nodes": nodes, "victim": victim, "quorum": True, "logs": tails}


def _quorum_analyse(nodes, steps, rows, t_kill, codes, ends, rejoin, t_back) -> dict:
    """What a survivor's record says: every step once, the world after the kill (and the
    rejoin), the stall where the survivors went on without the lost node."""
    world = [r["world"] for r in rows]
    gaps = [(b["time"] - a["time"], a, b) for a, b in zip(rows, rows[1:])]
    before = [g for g, a, _ in gaps if a["time"] <= t_kill]
    step_s = statistics.median(before) if before else None
    left = next((i for i, r in enumerate(rows) if r["time"] > t_kill and r["world"] == nodes - 1), None)
    checks = {
        "survivors exit 0 (replicas checked at the end)": all(c == 0 for c in codes),
        "every step ran once, none redone": [r["step"] for r in rows] == list(range(1, steps + 1)),
        "the survivors went on without the node": left is not None,
        "replicas identical at the end": len({e["anchors"] for e in ends}) == 1
                                         and len(ends) == nodes - 1 + (rejoin is not None),
        "losses finite": all(math.isfinite(r["loss"]) for r in rows),
    }
    back = None
    if rejoin is not None:
        back = next((i for i, r in enumerate(rows) if r["time"] > t_back and r["world"] == nodes), None)
        checks["the node rejoined"] = back is not None
    def stall(i):  # the step that took the change in, less a step's usual time
        return None if i is None or step_s is None else rows[i]["time"] - rows[i - 1]["time"] - step_s
    return {
        "steps": steps, "reached": max((r["step"] for r in rows if r["time"] <= t_kill), default=0),
        "left_at": None if left is None else rows[left]["step"], "lost_s": stall(left), "step_s": step_s,
        "rejoined_at": None if back is None else rows[back]["step"], "rejoin_s": stall(back),
        "worlds": sorted(set(world)), "exit_codes": codes, "checks": checks, "passed": all(checks.values()),
        "redone": len(rows) - len({r["step"] for r in rows}),
        "loss_end": rows[-1]["loss"] if rows else None,
    }


_STAMP = re.compile(r"^[IWE](\d{4} \d\d:\d\d:\d\d\.\d{6}) ")


def _phases(log: str, t_kill: float, first_after: float | None) -> dict:
    """Where the stall went, from a survivor's agent log (torchrun's INFO lines carry the local
    time): until its workers failed or it saw the group change (``detect_s``), the rendezvous
    that let them start again (``rendezvous_s``), and from there to the first step
    (``start_s``: the workers' start, the checkpoint's load, a further restart if any)."""
    year = time.localtime(t_kill).tm_year
    events = []
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and ("will restart worker group" in line or "Rendezvous complete" in line):
            t = datetime.strptime(f"{year}{m.group(1)}", "%Y%m%d %H:%M:%S.%f").timestamp()  # local time
            events.append((t, "restart" in line))
    events = [(t, restart) for t, restart in events if t >= t_kill - 1]
    failed = next((t for t, restart in events if restart), None)
    ready = next((t for t, restart in events if not restart and failed is not None and t >= failed), None)
    if ready is None or first_after is None:
        return {"detect_s": None, "rendezvous_s": None, "start_s": None}
    return {"detect_s": failed - t_kill, "rendezvous_s": ready - failed, "start_s": first_after - ready}


def _tail(work: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(work.glob("*.log")))


def _analyse(scenario, nodes, steps, rows, t_kill, complete_at_kill, in_save, codes, left, rejoin) -> dict:
    """What the record says about the restart, and whether it is what the design promises."""
    # The first run is the rows up to the first of a restart (another world or checkpoint, or a
    # step that goes back); a survivor may log a step or two after the kill before a collective
    # finds the peer gone.
    first = next((i for i in range(1, len(rows)) if rows[i]["step"] <= rows[i - 1]["step"]
                  or (rows[i]["world"], rows[i]["resumed_from"]) != (rows[0]["world"], rows[0]["resumed_from"])),
                 len(rows))
    before, after = rows[:first], rows[first:]
    reached = before[-1]["step"] if before else 0
    resumed = after[0]["resumed_from"] if after else None
    expected_resume = complete_at_kill[-1] if complete_at_kill else 0
    worlds = [r["world"] for r in after]
    checks = {
        "survivors exit 0 (replicas checked at resume and end)": all(c == 0 for c in codes),
        "every step before the kill ran once": [r["step"] for r in before] == list(range(1, reached + 1)),
        "resumed from the newest complete checkpoint": resumed == expected_resume,
        "losses finite": all(math.isfinite(r["loss"]) for r in rows),
        "the survivors' world": bool(after) and after[0]["world"] == nodes - 1,
    }
    if rejoin is None:
        checks["each step after it ran once"] = [r["step"] for r in after] == [*range(expected_resume + 1, steps + 1)]
    else:  # a second restart takes the node back in, from the checkpoint before it
        checks["the node rejoined"] = nodes - 1 in worlds and nodes in worlds[worlds.index(nodes - 1):]
    saved = None
    if scenario == "save":  # the save the kill landed in: complete with every rank's file, or cleared
        interrupted = CHECKPOINT_EVERY * math.ceil(reached / CHECKPOINT_EVERY)
        saved = interrupted in complete_at_kill
        files = {f"rank{r}.pt" for r in range(nodes)} | {"complete.json"}
        checks["the save the kill landed in is whole or cleared"] = (
            files <= set(in_save) if saved else f"step-{interrupted:09d}" not in left)
    step_times = [b["time"] - a["time"] for a, b in zip(before, before[1:]) if a["time"] <= t_kill]
    back = next((r["time"] for r in after if r["step"] >= reached and r["world"] == nodes - 1), None)
    return {
        "scenario": scenario, "nodes": nodes, "steps": steps, "reached": reached, "resumed_from": resumed,
        "complete_at_kill": complete_at_kill, "in_save": in_save, "save_completed": saved,
        "worlds": sorted(set(worlds)),
        "exit_codes": codes, "checks": checks, "passed": all(checks.values()),
        "step_s": statistics.median(step_times) if step_times else None,
        "stall_s": after[0]["time"] - t_kill if after else None,
        "first_after": after[0]["time"] if after else None,
        "lost_s": back - t_kill if back else None,
        "redone": reached - expected_resume,
        "loss_before": before[-1]["loss"] if before else None,
        "loss_after": [r["loss"] for r in after[:3]], "loss_end": rows[-1]["loss"] if rows else None,
    }


def measure(args: argparse.Namespace) -> None:
    source = provenance()
    if args.scenario in QUORUM_SCENARIOS:
        for i in range(args.trials):
            row = quorum_trial(args.scenario, args.nodes, args.bandwidth, args.steps, args.kill_at, args.pause,
                               args.timeout, args.nodes - 1 if args.victim is None else args.victim, args.rejoin,
                               args.deadline)
            row.update(bandwidth=args.bandwidth, pause=args.pause, timeout=args.timeout, kill_at=args.kill_at,
                       rejoin=args.rejoin, **source)
            append_row(args.out, row)
            failed = [k for k, ok in row["checks"].items() if not ok]
            print(f"{args.scenario} trial {i + 1}: went on without the node at step {row['left_at']}, lost "
                  f"{row['lost_s'] if row['lost_s'] is not None else float('nan'):.1f} s"
                  + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
        return
    for i in range(args.trials):
        row = trial(args.scenario, args.nodes, args.bandwidth, args.steps, args.kill_at, args.pause, args.timeout,
                    args.rdzv_conf, args.nodes - 1 if args.victim is None else args.victim, args.dedicated_store,
                    args.shared_worker_store, args.rejoin,
                    None if args.logs is None else Path(args.logs) / f"trial{i + 1}", args.deadline)
        row.update(bandwidth=args.bandwidth, pause=args.pause, timeout=args.timeout, kill_at=args.kill_at,
                   rdzv_conf=args.rdzv_conf, rejoin=args.rejoin, **source)
        append_row(args.out, row)
        failed = [k for k, ok in row["checks"].items() if not ok]
        print(f"{args.scenario} trial {i + 1}: reached {row['reached']}, resumed from {row['resumed_from']}, "
              f"stall {row['stall_s'] or float('nan'):.1f} s, lost {row['lost_s'] or float('nan'):.1f} s"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)


def _spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _setting(row: dict) -> str:
    where = "its own host" if row["dedicated_store"] else "node 0's agent"
    workers = "shared (torchrun's default)" if row["shared_store"] else "new each round"
    return f"{row['scenario']} | {row['victim']} | {where} | {workers} | `{row['rdzv_conf']}`"


def quorum_report(rows: list[dict]) -> None:
    print("| scenario | checks passed | steps redone | went on at step | time lost, s | back at step | "
          "its pause, s | loss at the end |")
    print("|---|---:|---|---|---|---|---|---|")
    for setting in dict.fromkeys((r["scenario"], r["victim"], r["rejoin"] is not None) for r in rows):
        some = [r for r in rows if (r["scenario"], r["victim"], r["rejoin"] is not None) == setting]
        cells = []
        for key, digits in (("redone", 0), ("left_at", 0), ("lost_s", 1), ("rejoined_at", 0), ("rejoin_s", 1),
                            ("loss_end", 2)):
            values = [r[key] for r in some if r.get(key) is not None]
            cells.append(_spread(values, digits) if values else "-")
        name = f"{setting[0]}, node {setting[1]} lost" + (" and back" if setting[2] else "")
        print(f"| {name} | {sum(r['passed'] for r in some)} of {len(some)} | " + " | ".join(cells) + " |")
    first = rows[0]
    print(f"\nMedian (min-max) over trials; \"-\": not applicable. {first['nodes']} nodes of one replica at "
          f"{first['bandwidth']} (`examples/diloco_quorum.py`, H = 16; `quorum-in-flight`: 4 fragments, each "
          f"exchange in flight 2 steps), the store on a host of its own, a node killed (SIGKILL) after step "
          f"{first['kill_at']} of {first['steps']} and started again at step {first['rejoin']} (back at step: the "
          f"step that took it in; its pause: that step's, less a step's usual time), a pause of "
          f"{first['pause']:g} s after each step (a step took "
          f"{_spread([r['step_s'] for r in rows if r['step_s']], 2)} s). Time lost: the step that went on without "
          "the node, less a step's usual time (the survivors never stop otherwise).")
    print(f"\n{provenance_note(rows)}")


def report(path: str) -> None:
    rows = read_rows(path)
    if rows and rows[0].get("quorum"):
        quorum_report(rows)
        return
    print("| scenario | node lost | rendezvous on | workers' store | `--rdzv-conf` | trials | all checks passed | "
          "steps redone | restarts | detected, s | rendezvous, s | workers' start, s | time lost, s | "
          "loss: before, after, end |")
    print("|---|---:|---|---|---|---:|---:|---|---|---|---|---|---|---|")
    for setting in dict.fromkeys(_setting(r) for r in rows if r["rejoin"] is None):
        some = [r for r in rows if _setting(r) == setting and r["rejoin"] is None]
        cells = [_spread([r["redone"] for r in some], 0), _spread([r["restarts"] for r in some], 0)]
        for key in ("detect_s", "rendezvous_s", "start_s", "lost_s"):
            values = [r[key] for r in some if r[key] is not None]
            cells.append(_spread(values) if values else "-")
        losses = [(r["loss_before"], r["loss_after"][0], r["loss_end"]) for r in some if r["loss_after"]]
        cells.append(", ".join(f"{statistics.median(v):.2f}" for v in zip(*losses)) if losses else "-")
        print(f"| {setting} | {len(some)} | {sum(r['passed'] for r in some)} | " + " | ".join(cells) + " |")
    first = rows[0]
    print(f"\nMedian (min-max) over trials; \"-\": no trial got that far. {first['nodes']} nodes of one worker at "
          f"{first['bandwidth']}, a node killed (SIGKILL of its agent and worker) after step {first['kill_at']} of "
          f"{first['steps']}, a checkpoint every {CHECKPOINT_EVERY} steps, collectives' timeout "
          f"{first['timeout']:g} s, a pause of {first['pause']:g} s after each step (a step took "
          f"{_spread([r['step_s'] for r in rows], 2)} s "
          "before the kill). Time lost: from the kill until the survivors are back at the step the run had reached. "
          "Loss: the training loss of the last step before the kill, of the first after the restart and of the last "
          "step (medians; ln 256 = 5.55 at the start).")
    saves = [r["save_completed"] for r in rows if r["scenario"] == "save" and r.get("save_completed") is not None]
    if saves:
        print(f"\nThe save the kill landed in: completed by the survivors in {sum(saves)} trial(s) of {len(saves)} "
              "(the victim's file and its part of the barrier had left), never marked complete and cleared by the "
              "next save in the others.")
    for r in (r for r in rows if r["rejoin"] is not None):
        print(f"\nRejoin ({_setting(r).replace(' | ', ', ')}; the node started again once the survivors passed step "
              f"{r['rejoin']}): world sizes after the kill {r['worlds']}, exit codes {r['exit_codes']}; "
              + ("it rejoined." if r["checks"].get("the node rejoined") else "it did not rejoin."))
    print(f"\n{provenance_note(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, *QUORUM_SCENARIOS], default="between")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-at", type=int, default=46, help="the step after which the node dies")
    parser.add_argument("--pause", type=float, default=0.1, help="seconds each step waits (the kill lands in it)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a collective waits for a peer")
    parser.add_argument("--rdzv-conf", default="last_call_timeout=2",
                        help="torchrun's --rdzv-conf on every node (is_host is added)")
    parser.add_argument("--victim", type=int, help="the node that dies (default: the last; node 0 hosts the "
                        "rendezvous unless --dedicated-store)")
    parser.add_argument("--dedicated-store", action="store_true",
                        help="the rendezvous store on a host of its own instead of node 0's agent")
    parser.add_argument("--shared-worker-store", action="store_true",
                        help="torchrun's default: the workers reuse one store across restarts (stale keys)")
    parser.add_argument("--rejoin", type=int, help="start the lost node again once the survivors pass this step")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--deadline", type=float, default=600.0,
                        help="seconds a trial may take; one still running then is ended and fails")
    parser.add_argument("--logs", help="keep each trial's agent logs in this folder")
    parser.add_argument("--out", help="JSON-lines file the trials are appended to")
    parser.add_argument("--report", metavar="FILE", help="print the table of FILE's trials instead")
    args = parser.parse_args()
    if args.report:
        report(args.report)
    elif args.out:
        measure(args)
    else:
        parser.error("give --out (measure) or --report")


if __name__ == "__main__":
    main()
