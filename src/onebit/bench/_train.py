"""One data-parallel training run on local gloo ranks (or an emulated cluster), recorded step by step."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import comm, compress
from .._checkpoints import Checkpoints
from ..launch import spawn
from ._runs import NO_COMMUNICATION, OPTIMIZERS, REFRESH_DTYPES, build_run
from ._tasks import TASKS, Task, TaskSpec

__all__ = ["OPTIMIZERS", "SCHEDULES", "TASKS", "TrainConfig", "train"]

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class TrainConfig(TaskSpec):
    """A training run: the task and its sizes (:class:`TaskSpec`), the optimizer and its options."""

    optimizer: str = "onebit_adam"
    world_size: int = 2
    steps: int = 300
    batch_size: int = 32  # per rank
    lr: float = 1e-3
    schedule: str = "constant"  # after the learning-rate warm-up
    warmup_steps: int = 0  # learning-rate warm-up (linear from 0)
    # the two-stage optimizers' freeze (0/1 Adam's variance freeze, DiLoCo's sync_every); None: each one's own
    freeze_step: int | str | None = None
    seed: int = 0
    eval_batches: int = 8
    # the Adam family's bias correction (None: each optimizer's own: on for 1-bit Adam and 0/1 Adam,
    # off for Comp-AMS, as its paper's AMSGrad)
    bias_correction: bool | None = None
    topk_ratio: float = 0.01
    qadam_bits: int = 1
    compressor: str | None = None  # what the optimizers that take one send (None: each one's own)
    local_step_scaler: int | None = None  # 0/1 Adam's (None: a quarter of freeze_step, or its own)
    refresh_every: int | str | None = None  # 1-bit Adam's variance refreshes: every K steps, "never" (None: its own)
    refresh_dtype: str | None = None  # what they sum the gradients in: "bf16", "fp32" (None: its own, bf16)
    # 0/1 Adam's refreshes: "bounded" (every 8th step at least, weighing the steps since the last) or
    # "paper" (doubling without bound, one step's weight each); None: its own, bounded
    refresh_schedule: str | None = None
    powersgd_rank: int = 1
    hierarchical: bool = False
    # the overlapped exchange's (and DDP's) bucket size, MB of fp32 values (None: the default, 25)
    bucket_cap_mb: float | None = None
    sync_every: int | None = None  # DiLoCo's inner steps per synchronisation (None: its default, 500)
    fragments: int | None = None  # DiLoCo's streamed fragments (None: its default, 1)
    delay: int | None = None  # DiLoCo's steps each synchronisation stays in flight (None: its default, 0)
    collective: str | None = None  # DiLoCo's 1-bit exchange, "allgather" or "allreduce" (None: its default)
    # "torch": spawned gloo ranks; "mpi": this process is one rank of an mpirun job
    backend: str = "torch"
    # checkpoints
    checkpoint_every: int = 0
    resume: bool = False
    # record a timeline of this step on every rank (trace.json)
    trace_step: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if self.compressor is not None and self.compressor not in compress.available():
            raise ValueError(f"compressor must be one of {', '.join(compress.available())}; got {self.compressor!r}")
        if self.backend not in comm.BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(comm.BACKENDS)}; got {self.backend!r}")
        if self.backend == "mpi" and self.optimizer.startswith("ddp_"):
            raise ValueError(f"optimizer {self.optimizer!r} runs on DDP, which needs backend 'torch', not 'mpi'")
        for name in ("world_size", "steps", "batch_size", "context", "hidden", "d_model", "layers", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("warmup_steps", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.trace_step is not None and (isinstance(self.trace_step, bool) or not isinstance(self.trace_step, int)
                                            or not 1 <= self.trace_step <= self.steps):
            raise ValueError(f"trace_step must be a step of the run (1 to {self.steps}), got {self.trace_step!r}")
        if self.refresh_schedule not in (None, "bounded", "paper"):
            raise ValueError(f"refresh_schedule must be 'bounded' or 'paper'; got {self.refresh_schedule!r}")
        if self.refresh_dtype not in (None, *REFRESH_DTYPES):
            raise ValueError(f"refresh_dtype must be one of {', '.join(REFRESH_DTYPES)}; got {self.refresh_dtype!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier of ``cfg.lr`` at ``step`` (0-based): linear warm-up, then the schedule down to 0."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    if cfg.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _rank_main(rank: int, world: int, cfg: TrainConfig, out: Path, per_node: int | None,
               progress: bool) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    task = Task(cfg)
    model = task.model()
    run = build_run(cfg.optimizer, model, cfg, per_node)
    opt = run.optimizer
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    records: list[dict[str, Any]] = []
    first = 1
    # The ranks resume from one save, the newest every rank completed: a rank that died in the
    # middle of a save leaves the one before it whole.
    checkpoints = Checkpoints(out / "checkpoints", group="mpi" if cfg.backend == "mpi" else None)
    if cfg.resume and (found := checkpoints.load()) is not None:
        step, state = found
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        gen.set_state(state["generator"])
        if run.hook_state is not None and hasattr(run.hook_state, "load_state_dict"):
            run.hook_state.load_state_dict(state["hook"])
        records, first = state["records"], step + 1
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=first - 1, desc=cfg.optimizer, unit="step", leave=False)
    start = time.perf_counter() - (records[-1]["time"] if records else 0.0)
    timeline = None
    link = _traced_link(rank) if cfg.trace_step is not None else None
    for step in range(first, cfg.steps + 1):
        t0, cpu0 = time.perf_counter(), time.process_time()
        with comm.trace(rank, link=link) if step == cfg.trace_step else contextlib.nullcontext() as traced:
            x, y = task.batch(cfg.batch_size, gen)
            with comm.span("forward", "step"):
                loss = task.loss(run.module, x, y)
            opt.zero_grad(set_to_none=True)
            # DDP exchanges during backward, onebit's optimizers inside step: meter both.
            with comm.measure() as meter:
                with comm.span("backward", "step"):
                    loss.backward()
                with comm.span("step()", "step"):
                    opt.step()
        timeline = traced.to_json() if traced is not None else timeline
        schedule.step()
        step_time = time.perf_counter() - t0
        # Every thread of this process (gloo's, the exchange's): what the step took of the cores.
        cpu_time = time.process_time() - cpu0
        # The logged loss and CPU time are averages over ranks (tiny extra all-reduces, outside
        # the meter and the timing).
        mean_loss = comm.all_reduce_mean(loss.detach().reshape(1), cfg.backend).item()
        mean_cpu = comm.all_reduce_mean(torch.tensor([cpu_time], dtype=torch.float64), cfg.backend).item()
        records.append({
            "step": step,
            "loss": mean_loss,
            "stage": run.stage(),
            "bytes_sent": meter.bytes_sent,
            "time": time.perf_counter() - start,
            "step_time": step_time,
            "cpu_time": mean_cpu,
            "comm_time": meter.seconds,
            # Fraction of the exchange that ran alongside backward (the overlapped optimizers only).
            "overlap": run.overlap(),
            "variance_ratio": run.variance_ratio(),
            "samples": step * cfg.batch_size * world,
            "lr": schedule.get_last_lr()[0],
        })
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}", stage=records[-1]["stage"])
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            _save_checkpoint(checkpoints, step, model, opt, schedule, gen, run, records)
    if bar is not None:
        bar.close()
    with torch.no_grad():
        eval_gen = torch.Generator().manual_seed(12345)
        losses = [task.loss(model, *task.batch(256, eval_gen, heldout=True)).item() for _ in range(cfg.eval_batches)]
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # Inside an interval of local steps (0/1 Adam) the replicas differ by design: their anchors,
    # the parameters of the last synchronisation, must not.
    in_interval = not getattr(opt, "synchronised", True)
    if in_interval:
        opt.check_replicas()
    if hasattr(opt, "wait"):  # onebit's: an exchange still in flight completes before the group goes
        opt.wait()
    return {"records": records, "eval_loss": sum(losses) / len(losses), "digest": digest.hexdigest(),
            "in_interval": in_interval, "finite": finite, "trace": timeline,
            # steps every rank skipped for a non-finite gradient (None: an optimizer that never skips)
            "skipped_steps": getattr(opt, "stats", {}).get("skipped_steps"),
            "freeze_step": run.freeze_step(), "parameters": sum(p.numel() for p in model.parameters())}


def _save_checkpoint(checkpoints: Checkpoints, step, model, opt, schedule, gen, run, records) -> None:
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": schedule.state_dict(),
             "generator": gen.get_state(), "records": records}
    if run.hook_state is not None and hasattr(run.hook_state, "state_dict"):
        state["hook"] = run.hook_state.state_dict()
    checkpoints.save(step, **state)


def _stage_median(records: list[dict[str, Any]], stage: str, key: str) -> float | None:
    """Median of ``key`` over the steps of ``stage``, without its first step (which pays set-up);
    steps without it (recorded before it was, and resumed) left out."""
    values = [v for v in [r.get(key) for r in records if r["stage"] == stage][1:] if v is not None]
    return statistics.median(values) if values else None


def _this_mpi_rank(cfg: TrainConfig, out: Path, progress: bool, cluster) -> list[dict[str, Any]] | None:
    """Train as one rank of the running MPI job; rank 0 gets its result (after every rank's
    parameter digest was compared), the others ``None``."""
    if cluster is not None:
        raise ValueError("an emulated cluster places spawned ranks; under mpirun the job's own placement applies")
    rank, world = comm.get_rank("mpi"), comm.get_world_size("mpi")
    if world != cfg.world_size:
        raise ValueError(f"world_size={cfg.world_size} but the MPI job has {world} ranks")
    result = _rank_main(rank, world, cfg, out, None, progress)
    # 60 bits of each rank's digest are plenty to tell replicas apart.
    table = comm.all_gather_object_sizes([int(result["digest"][:15], 16)], "mpi")
    if not result["in_interval"] and not bool((table == table[0]).all()):
        raise RuntimeError(f"replicas differ at the end: parameter digests {[f'{int(d):015x}' for d in table[:, 0]]}")
    return [result] if rank == 0 else None


def train(cfg: TrainConfig, out: Path, progress: bool = True, cluster=None) -> dict[str, Any] | None:
    """Run ``cfg`` on local ranks (inside ``cluster``'s nodes when given), or as this process's
    rank of an mpirun job (``cfg.backend == "mpi"``); write ``metrics.jsonl`` and
    ``summary.json`` into ``out`` (rank 0 only, under MPI; the other ranks return ``None``)."""
    out.mkdir(parents=True, exist_ok=True)
    if cfg.backend == "mpi":
        results = _this_mpi_rank(cfg, out, progress, cluster)
        if results is None:
            return None
    else:
        placement = cluster.placement(cfg.world_size) if cluster is not None else None
        per_node = cfg.world_size // cluster.spec.nodes if cluster is not None else None
        # No overall deadline: a training run takes as long as it takes; a dead or stalled rank
        # still fails the run (spawn notices exits, the collectives time out).
        results = spawn(_rank_main, cfg.world_size, cfg, out, per_node, progress, timeout=None, placement=placement)
    synchronised = cfg.optimizer != NO_COMMUNICATION and not results[0]["in_interval"]
    if synchronised and len({r["digest"] for r in results}) != 1:
        raise RuntimeError(f"replicas differ at the end: parameter digests {[r['digest'][:12] for r in results]}")
    records = results[0]["records"]
    traces = [r["trace"] for r in results if r["trace"] is not None]
    if traces:  # every rank's events on one clock (perf_counter is the host's monotonic clock)
        origin = min(t["otherData"]["start"] for t in traces)
        events = [{**e, "ts": round(e["ts"] + (t["otherData"]["start"] - origin) * 1e6, 1)}
                  for t in traces for e in t["traceEvents"]]
        (out / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    with open(out / "metrics.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    per_step = cfg.batch_size * cfg.world_size
    stages = sorted({r["stage"] for r in records})
    step_times = {stage: _stage_median(records, stage, "step_time") for stage in stages}
    summary = {
        "config": asdict(cfg),
        "parameters": results[0]["parameters"],
        "cluster": None if cluster is None else {**asdict(cluster.spec), "latency_note": cluster.latency_note},
        "finite": results[0]["finite"],
        "skipped_steps": results[0]["skipped_steps"],
        "final_loss": sum(r["loss"] for r in records[-10:]) / min(10, len(records)),
        "eval_loss": results[0]["eval_loss"],
        "freeze_step": results[0]["freeze_step"],
        "bytes_sent_per_rank": sum(r["bytes_sent"] for r in records),
        "steps": {stage: sum(r["stage"] == stage for r in records) for stage in stages},
        "step_time_s": step_times,
        "samples_per_s": {stage: t and per_step / t for stage, t in step_times.items()},
        # Time waiting in onebit's collectives (DDP's own all-reduce runs inside backward, not timed here).
        "comm_time_s": {stage: _stage_median(records, stage, "comm_time") for stage in stages},
        # CPU time of a step, mean over ranks (every thread of a rank's process).
        "cpu_time_s": {stage: _stage_median(records, stage, "cpu_time") for stage in stages},
        # The cores the ranks shared (all spawned on this host); None under mpirun, placed by the job.
        "host_cores": None if cfg.backend == "mpi" else len(os.sched_getaffinity(0)),
        "overlap": {stage: _stage_median(records, stage, "overlap")
                    for stage in stages if any(r["overlap"] is not None for r in records if r["stage"] == stage)},
        "wall_time_s": records[-1]["time"],
        # Sum of step times without the first (connection set-up): what speedups compare.
        "train_time_s": sum(r["step_time"] for r in records[1:]),
    }
    with open(out / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _traced_link(rank: int) -> str | None:
    """The interface the ranks talk over (the launcher's or an emulated node's
    ``GLOO_SOCKET_IFNAME``, the first of a list), for the trace's link row; None, said, where this
    process cannot read its counters."""
    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if not name:
        return None
    try:
        comm.link_bytes(name)
    except (RuntimeError, ValueError) as exc:
        if rank == 0:
            print(f"trace: no link row ({exc})")
        return None
    return name
