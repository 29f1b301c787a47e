"""What the ``onebit`` commands do, each handed its parsed arguments (``onebit.cli`` only parses
and dispatches): the training runs (demo, train, compare), the benchmarks (kernels, comm,
convergence, memory) and the emulated cluster; the cost model's is ``_model_command.py``."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ._analysis import compare_rows, cores_busy, demo_verdict, fmt, names_from, step_time
from ._analysis import text_table as _table
from ._model_command import refresh_every

__all__ = ["cluster", "comm_bench", "compare", "convergence", "demo", "kernels", "memory", "train_command"]


def _report(summaries: dict[str, dict], baseline: str | None = "adam") -> str:
    base_bytes = summaries.get(baseline, {}).get("bytes_sent_per_rank") if baseline else None
    rows = [["optimizer", "final loss", "eval loss", "samples/s warmup", "samples/s compressed",
             "MB sent/rank", "reduction", "freeze step"]]
    for name, s in summaries.items():
        rates = s["samples_per_s"]
        sent = s["bytes_sent_per_rank"]
        rows.append([
            name,
            f"{s['final_loss']:.4f}",
            f"{s['eval_loss']:.4f}",
            fmt(rates.get("warmup"), ".0f"),
            fmt(rates.get("compressed"), ".0f"),
            f"{sent / 1e6:.2f}",
            f"{base_bytes / sent:.1f}x" if base_bytes and sent else "-",
            str(s["freeze_step"]) if s["freeze_step"] is not None else "-",
        ])
    return _table(rows)


@contextlib.contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[Any]:
    """The emulated cluster asked for by ``--nodes`` (None: loopback), removed on exit."""
    if not getattr(args, "nodes", None):
        yield None
        return
    from ._cluster import ClusterSpec, EmulatedCluster, cluster_unavailable

    spec = ClusterSpec(args.nodes, args.bandwidth, args.latency)
    reason = cluster_unavailable()
    if reason:
        print(f"onebit: no emulated cluster ({reason}); running unshaped on loopback", file=sys.stderr)
        yield None
        return
    with EmulatedCluster(spec) as cluster:
        print(f"emulated cluster {cluster.tag}: {spec.nodes} nodes, {spec.bandwidth / 1e9:g} Gbit/s per node egress, "
              f"{spec.latency * 1e3:g} ms latency")
        if cluster.latency_note:
            print(f"onebit: {cluster.latency_note}", file=sys.stderr)
        yield cluster


def _config(args: argparse.Namespace, optimizer: str):
    from ._train import TrainConfig

    if args.nodes and args.world_size % args.nodes:
        raise SystemExit(f"onebit: --world-size {args.world_size} is not a multiple of --nodes {args.nodes}")
    if args.hierarchical and not args.nodes:
        raise SystemExit("onebit: --hierarchical needs --nodes (ranks per node = world size / nodes)")
    return TrainConfig(
        optimizer=optimizer, task=args.task, world_size=args.world_size, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, schedule=args.schedule, warmup_steps=args.warmup_steps,
        freeze_step=args.freeze_step,
        seed=args.seed, topk_ratio=min(args.topk_ratio, 1.0), qadam_bits=args.qadam_bits, compressor=args.compressor,
        local_step_scaler=args.local_step_scaler, refresh_every=args.refresh_every, refresh_dtype=args.refresh_dtype,
        refresh_schedule=args.refresh_schedule,
        powersgd_rank=args.powersgd_rank,
        hierarchical=args.hierarchical,
        bucket_cap_mb=args.bucket_cap_mb, sync_every=args.sync_every, fragments=args.fragments, delay=args.delay,
        collective=args.collective, context=args.context,
        hidden=args.hidden, d_model=args.d_model, layers=args.layers, heads=args.heads,
        checkpoint_every=args.checkpoint_every, resume=args.resume, backend=getattr(args, "backend", "torch"),
        trace_step=args.trace,
    )


def _train_each(args: argparse.Namespace, names: list[str], out: Path, cluster: Any) -> dict[str, dict]:
    from ._train import train

    summaries = {}
    for name in names:
        summaries[name] = train(_config(args, name), out / name, progress=not args.quiet, cluster=cluster)
        if args.trace and summaries[name] is not None:
            _timeline(out / name)
    return summaries


def _run_all(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    with _cluster(args) as cluster:
        return _train_each(args, names, Path(args.out), cluster)


def _link_use(events: list[dict[str, Any]]) -> list[str]:
    """Per rank whose link was traced: the bytes it sent in the traced step, the window (ms on the
    step's clock) in which it sent their middle 98% (a link also carries the acknowledgements of
    what it receives), and their average rate there -- near the link's own rate, the link was the
    bottleneck in that window; well below it, the link waited."""
    lines = []
    for rank in sorted({e["pid"] for e in events if e["ph"] == "C"}):
        sent = sorted((e["ts"] / 1e3, e["args"]["bytes"]) for e in events if e["pid"] == rank and e["ph"] == "C")
        total = sent[-1][1]
        if not total:
            lines.append(f"rank {rank}: nothing sent")
            continue
        start = next(t for t, b in sent if b >= 0.01 * total)
        end = next(t for t, b in sent if b >= 0.99 * total)
        lines.append(f"rank {rank}: {total / 1e6:.2f} MB, 98% of it between {start:.0f} and {end:.0f} ms "
                     f"({0.98 * total * 8e-3 / max(end - start, 1e-3):.0f} Mbit/s on average)")
    return lines


def _timeline(run: Path) -> None:
    """Draw ``timeline.png`` from the run's ``trace.json``; print what each rank's link carried."""
    from ._plot import plot_trace

    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    for line in _link_use(events):
        print(f"link, {line}")
    try:
        print(f"timeline: {run / 'trace.json'} (ui.perfetto.dev, chrome://tracing), "
              f"{plot_trace(events, run / 'timeline.png')}")
    except ImportError as exc:
        print(f"timeline: {run / 'trace.json'} (ui.perfetto.dev, chrome://tracing); no picture: {exc}")


def _plot(out: Path, names: list[str], title: str) -> None:
    from ._plot import plot_losses

    runs = {}
    for name in names:
        with open(out / name / "metrics.jsonl") as f:
            runs[name] = [json.loads(line) for line in f]
    try:
        print(f"loss plot: {plot_losses(runs, out / 'loss.png', title)}")
    except ImportError as exc:
        print(f"no loss plot: {exc}")


def _demo_link(args: argparse.Namespace) -> str:
    """Where the demo runs: the cluster asked for, else an emulated one where it can be built
    (sets ``args.nodes``), else loopback; returns the sentence that says so."""
    from ._cluster import cluster_unavailable

    if args.nodes:
        return f"on the emulated cluster asked for ({args.nodes} nodes, {args.bandwidth / 1e6:g} Mbit/s per node)"
    if args.loopback:
        return "on loopback (--loopback)"
    reason = cluster_unavailable()
    if reason:
        return f"on loopback: no emulated cluster can be built here ({reason})"
    args.nodes = args.world_size
    return (f"on an emulated cluster of {args.nodes} nodes x 1 rank, {args.bandwidth / 1e6:g} Mbit/s per node "
            "(network namespaces, tc-shaped links): a link on which Adam's fp32 all-reduce takes most of a step. "
            "--bandwidth changes it, --loopback runs without it")


def demo(args: argparse.Namespace) -> int:
    names = ["adam", "onebit_adam"]
    link = _demo_link(args)
    print(f"onebit demo: {args.task} on the Python standard library, {args.world_size} gloo ranks, "
          f"{args.steps} steps, batch {args.batch_size}/rank, {link}")
    summaries = _run_all(args, names)
    print(_report(summaries))
    for line in demo_verdict(summaries, nodes=args.nodes, world_size=args.world_size, steps=args.steps):
        print(line)
    out = Path(args.out)
    with open(out / "summary.json", "w") as f:
        json.dump(summaries, f, indent=2)
    _plot(out, names, "Adam vs 1-bit Adam")
    print(f"metrics: {out}/<optimizer>/metrics.jsonl, summaries: {out}/summary.json")
    return 0


def train_command(args: argparse.Namespace) -> int:
    if args.backend == "mpi":
        from .. import comm

        # Under mpirun the job decides the ranks; --world-size would only repeat it.
        args.world_size = comm.get_world_size("mpi")
    summaries = _run_all(args, [args.optimizer])
    if summaries[args.optimizer] is None:  # an MPI rank other than 0: rank 0 reports
        return 0
    print(_report(summaries, baseline=None))
    print(f"metrics: {args.out}/{args.optimizer}/metrics.jsonl, summary: {args.out}/{args.optimizer}/summary.json")
    return 0


def compare(args: argparse.Namespace) -> int:
    from ._reports import provenance, report_files
    from ._train import OPTIMIZERS

    names = list(dict.fromkeys(names_from(args.optimizers, OPTIMIZERS, "--optimizers")))
    if args.baseline not in names:
        names.insert(0, args.baseline)
    out = Path(args.out)
    if args.rounds == 1:
        _compare_round(args, names, _run_all(args, names), out)
        return 0
    if args.resume:  # a resumed round would pair one session's steps with another's
        raise SystemExit(f"onebit: --resume cannot continue --rounds {args.rounds}: run the rounds again")
    rounds: dict[str, Any] = {"benchmark": "compare-rounds", "baseline": args.baseline,
                              "step_time": {name: [] for name in names},
                              "cores_busy": {name: [] for name in names},
                              "skipped_steps": {name: [] for name in names}}
    with _cluster(args) as cluster:
        for k in range(1, args.rounds + 1):
            # The order alternates, so that over an even number of rounds each optimizer runs as
            # often first as last and a steady drift of the machine's speed weighs on each alike.
            order = names if k % 2 else names[::-1]
            print(f"round {k} of {args.rounds}: {', '.join(order)}")
            summaries = _train_each(args, order, out / f"round{k}", cluster)
            runs = _compare_round(args, names, {name: summaries[name] for name in names}, out / f"round{k}")
            for name in names:
                rounds["step_time"][name].append(step_time(summaries[name], runs[name]))
                rounds["cores_busy"][name].append(cores_busy(summaries[name], runs[name]))
                rounds["skipped_steps"][name].append(summaries[name].get("skipped_steps") or 0)
    rounds["provenance"] = provenance(shlex.join(["onebit", *args.argv]))
    (out / "summary.json").write_text(json.dumps(rounds, indent=1) + "\n")
    text = report_files(rounds)["table.txt"]  # the table, then the command, machine and date
    print(text, end="")
    (out / "table.txt").write_text(text)
    return 0


def _compare_round(args: argparse.Namespace, names: list[str], summaries: dict[str, dict],
                   out: Path) -> dict[str, list[dict[str, Any]]]:
    """One comparison's table, summary, provenance and plot in ``out``; returns its runs' records."""
    from ._model import ModelInput
    from ._reports import provenance

    runs = {}
    for name in summaries:
        with open(out / name / "metrics.jsonl") as f:
            runs[name] = [json.loads(line) for line in f]
    model = None
    if args.nodes:  # the cost model for the emulated cluster (compute: the baseline's, set by compare_rows)
        freeze = summaries[args.baseline]["config"]["freeze_step"]
        warm = freeze / args.steps if isinstance(freeze, int) else 0.15
        model = ModelInput(params=summaries[args.baseline]["parameters"], world_size=args.world_size,
                           nodes=args.nodes, bandwidth=args.bandwidth, latency=args.latency, compute=0.0,
                           warmup_fraction=min(1.0, warm), topk_ratio=min(args.topk_ratio, 1.0),
                           **({} if args.refresh_every is None else {"refresh_every": refresh_every(args)}),
                           **{k: getattr(args, k) for k in ("sync_every", "fragments", "delay")
                              if getattr(args, k) is not None})
    rows, note = compare_rows(summaries, runs, args.baseline, model, hierarchical=args.hierarchical)
    skipped = [f"{name} {s['skipped_steps']}" for name, s in summaries.items() if s.get("skipped_steps")]
    if skipped:  # a skipped step sends 4 bytes and looks fast
        note += "\nsteps skipped for a non-finite gradient (their runs' speed does not count): " + ", ".join(skipped)
    text = _table(rows)
    print(note)
    print(text)
    (out / "table.txt").write_text(note + "\n" + text + "\n")
    with open(out / "summary.json", "w") as f:
        json.dump(summaries, f, indent=2)
    # the command, machine and date of the runs, for the reports made from them
    (out / "provenance.json").write_text(json.dumps(provenance(shlex.join(["onebit", *args.argv])), indent=2) + "\n")
    _plot(out, names, f"{args.task}: " + ", ".join(names))
    return runs


def _write_bench(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """Print the benchmark's tables, with its command, machine and date; with ``--out``, also
    write them and ``summary.json`` there."""
    from ._reports import provenance, report_files

    summary = {**summary, "provenance": provenance(shlex.join(["onebit", *args.argv]))}
    text = report_files(summary)["table.txt"]
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "table.txt").write_text(text)
        print(f"summary: {out}/summary.json, table: {out}/table.txt")


def kernels(args: argparse.Namespace) -> int:
    import torch

    from ._kernels import bench_kernels

    torch.set_num_threads(args.threads)
    results = bench_kernels(args.numel, args.repeat, args.device)
    device = torch.device(args.device)
    gpu = {"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    _write_bench(args, {"benchmark": "kernels", "settings": {
        "numel": args.numel, "repeat": args.repeat, "device": args.device, **gpu, "threads": args.threads,
        "torch": torch.__version__}, "results": [asdict(r) for r in results]})
    return 0


def comm_bench(args: argparse.Namespace) -> int:
    import torch

    from ._comm import bench_comm

    results = []
    with _cluster(args) as cluster:
        for numel in args.numel_list or [args.numel]:
            made = bench_comm(numel, args.world_size, args.repeat, cluster=cluster, backend=args.backend)
            if made is None:  # an MPI rank other than 0: rank 0 reports
                return 0
            results += [asdict(r) for r in made]
    _write_bench(args, {"benchmark": "comm", "settings": {
        "world_size": args.world_size, "repeat": args.repeat, "backend": args.backend, "nodes": args.nodes,
        "bandwidth": args.bandwidth if args.nodes else None, "torch": torch.__version__}, "results": results})
    return 0


def convergence(args: argparse.Namespace) -> int:
    from ._catalogue import BENCHMARKED
    from ._convergence import run_convergence
    from ._matrix import CONVERGENCE_TASKS, FAMILIES, LEVELS, VARIANTS, convergence_cells
    from ._plot import plot_convergence
    from ._reports import provenance, report_files

    out = Path(args.out)
    if args.report_only:
        summary = json.loads((out / "summary.json").read_text())
    else:
        tasks = names_from(args.tasks, CONVERGENCE_TASKS, "--tasks")
        families = names_from(args.families, tuple(FAMILIES), "--families")
        entries = tuple(n for n, b in BENCHMARKED.items() if b.matrix)
        optimizers = None if args.optimizers is None else names_from(args.optimizers, entries + tuple(VARIANTS),
                                                                 "--optimizers")
        levels = LEVELS if args.lr == "both" else (args.lr,)
        if optimizers is not None:
            made = {c.optimizer for c in convergence_cells(tasks, families, extended=args.extended,
                                                           controls=not args.no_controls, optimizers=optimizers)}
            idle = [n for n in optimizers if not any(n in (m, VARIANTS[m][0]) for m in made)]
            if idle:
                raise SystemExit(f"onebit: --optimizers: {', '.join(idle)} would run nothing in --families "
                                 f"{','.join(families)} (a variant equal to the defaults runs as its entry; the "
                                 "others need --extended; --no-controls leaves the controls out)")
        seeds = tuple(range(args.seeds))
        print(f"onebit bench convergence: {len(tasks)} tasks x {len(families)} optimizer families x {len(seeds)} "
              f"seeds x {1 + args.perturb} initial weights, {args.world_size} gloo ranks, {args.steps} steps, "
              f"batch {args.batch_size}/rank")
        summary = run_convergence(out, tasks, families, steps=args.steps, batch=args.batch_size,
                                  world=args.world_size, seeds=seeds, perturbations=args.perturb, levels=levels,
                                  freeze_fractions=tuple(args.freeze), extended=args.extended,
                                  controls=not args.no_controls, optimizers=optimizers, jobs=args.jobs,
                                  schedule=args.schedule, iid=args.iid, progress=not args.quiet,
                                  max_grad_norm=args.max_grad_norm,
                                  provenance=provenance(shlex.join(["onebit", *args.argv])))
    for name, text in report_files(summary).items():
        (out / name).write_text(text)
    print((out / "table.txt").read_text(), end="")
    try:
        print(f"loss plot: {plot_convergence(summary['runs'], out / 'loss.png')}")
    except ImportError as exc:
        print(f"no loss plot: {exc}")
    print(f"summary: {out}/summary.json, tables: {out}/table.txt, {out}/table.md")
    return 0


def memory(args: argparse.Namespace) -> int:
    import torch

    from ._memory import FOOTPRINTS, WIRE_ALLOWANCE, bench_memory

    names = names_from(args.optimizers or ",".join(FOOTPRINTS), tuple(FOOTPRINTS), "--optimizers")
    worlds = args.world_sizes
    print(f"onebit bench memory: nn.Linear({args.size}, {args.size}) on {args.device}, world sizes "
          f"{','.join(map(str, worlds))}, {args.steps} steps (1-bit Adam/LAMB freeze after step 2); "
          + ("figures in fp32 model sizes" if args.shards == 1 else
             f"sharded by FSDP2 over {args.shards} ranks of each node, figures in fp32 shard sizes"))
    results = bench_memory(names, worlds, size=args.size, steps=args.steps, device=args.device, shards=args.shards)
    meta = {"device": args.device, "size": args.size, "steps": args.steps, "shards": args.shards,
            "torch": torch.__version__}
    _write_bench(args, {"meta": meta, "results": [asdict(r) for r in results]})
    over = [r for r in results if r.held > r.footprint + WIRE_ALLOWANCE]
    print(f"held above footprint + {WIRE_ALLOWANCE} (packed wire buffers): "
          + (", ".join(f"{r.optimizer} w={r.world_size} {r.stage}" for r in over) or "none"))
    return 0 if not over else 1


def cluster(args: argparse.Namespace) -> int:
    from ._cluster import cluster_unavailable, existing_namespaces
    from ._comm import link_check

    reason = cluster_unavailable()
    if reason:
        print(f"onebit cluster: cannot build an emulated cluster here: {reason}")
        return 1
    with _cluster(args) as cluster:
        rows = [["node", "namespace", "address", "ranks"]]
        for k in range(args.nodes):
            ranks = range(k * args.ranks_per_node, (k + 1) * args.ranks_per_node)
            rows.append([str(k), cluster.node(k), cluster.address(k), ",".join(map(str, ranks))])
        print(_table(rows))
        if args.nodes > 1:
            gbit, seconds = link_check(cluster, args.check_mb)
            print(f"link check: {args.check_mb} MB between node 0 and node 1 in {seconds * 1e3:.1f} ms "
                  f"= {gbit:.3f} Gbit/s ({100 * gbit * 1e9 / args.bandwidth:.0f}% of the shaped rate)")
        tag = cluster.tag
    left = existing_namespaces(tag)
    print(f"removed namespaces of {tag}: {'ok' if not left else 'LEFT BEHIND: ' + ', '.join(left)}")
    return 0 if not left else 1
