"""The ``onebit`` command: demo, train, compare, bench, cluster, model."""

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

from .bench._analysis import compare_rows, demo_verdict, fmt, text_table as _table

__all__ = ["build_parser", "main"]


# ---------------------------------------------------------------------- argument types
def _int_at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "an integer >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1), got {text}")
    return value


def _freeze(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _nonneg_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}") from None


def _bandwidth(text: str) -> float:
    from .bench._cluster import parse_bandwidth

    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _latency(text: str) -> float:
    from .bench._cluster import parse_latency

    try:
        return parse_latency(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---------------------------------------------------------------------- output
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


# ---------------------------------------------------------------------- cluster
@contextlib.contextmanager
def _cluster(args: argparse.Namespace) -> Iterator[Any]:
    """The emulated cluster asked for by ``--nodes`` (None: loopback), removed on exit."""
    if not getattr(args, "nodes", None):
        yield None
        return
    from .bench._cluster import ClusterSpec, EmulatedCluster, cluster_unavailable

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


def _cluster_flags(p: argparse.ArgumentParser, bandwidth: str = "1gbit") -> None:
    g = p.add_argument_group("emulated cluster (needs root and iproute2)")
    g.add_argument("--nodes", type=_positive_int, default=None,
                   help="spread the ranks evenly over K network namespaces with shaped links")
    g.add_argument("--bandwidth", type=_bandwidth, default=_bandwidth(bandwidth),
                   help=f"each node's egress rate (default {bandwidth})")
    g.add_argument("--latency", type=_latency, default=0.0, help="added delay per packet (default 0)")


# ---------------------------------------------------------------------- training
def _training_flags(p: argparse.ArgumentParser, steps: int, out: str, bandwidth: str = "1gbit") -> None:
    from .bench._train import SCHEDULES, TASKS

    p.add_argument("--task", choices=TASKS, default="mlp", help="mlp (default), gpt, bert or digits")
    p.add_argument("--world-size", type=_positive_int, default=2, help="total ranks (default 2)")
    p.add_argument("--steps", type=_positive_int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--schedule", choices=SCHEDULES, default="constant", help="after --warmup-steps")
    p.add_argument("--warmup-steps", type=_nonneg_int, default=0, help="linear learning-rate warm-up")
    p.add_argument("--freeze-step", type=_freeze, default=None,
                   help="last warm-up step of 1-bit Adam/LAMB: an int or 'auto' (default: 20%% of --steps)")
    p.add_argument("--topk-ratio", type=_positive_float, default=0.01, help="Comp-AMS top-k fraction")
    p.add_argument("--qadam-bits", type=_positive_int, default=1, help="QAdam's bits per value")
    p.add_argument("--local-step-scaler", type=_positive_int, default=None,
                   help="0/1 Adam: steps per doubling of the local-step interval (default: a quarter of "
                        "--freeze-step; larger than --steps: no local steps)")
    p.add_argument("--powersgd-rank", type=_positive_int, default=1, help="ddp_powersgd's matrix rank")
    p.add_argument("--hierarchical", action="store_true",
                   help="1-bit exchanges use the Hierarchical-1-bit-All-Reduce (ranks per node from --nodes)")
    p.add_argument("--context", type=_positive_int, default=16, help="bytes of context (mlp, gpt, bert)")
    p.add_argument("--hidden", type=_positive_int, default=512, help="mlp hidden width")
    p.add_argument("--d-model", type=_positive_int, default=128, help="gpt/bert width")
    p.add_argument("--layers", type=_positive_int, default=2, help="gpt/bert blocks")
    p.add_argument("--heads", type=_positive_int, default=4, help="gpt/bert attention heads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help=f"output directory (default {out})")
    p.add_argument("--checkpoint-every", type=_nonneg_int, default=0, help="save every K steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _cluster_flags(p, bandwidth)


def _config(args: argparse.Namespace, optimizer: str):
    from .bench._train import TrainConfig

    if args.nodes and args.world_size % args.nodes:
        raise SystemExit(f"onebit: --world-size {args.world_size} is not a multiple of --nodes {args.nodes}")
    if args.hierarchical and not args.nodes:
        raise SystemExit("onebit: --hierarchical needs --nodes (ranks per node = world size / nodes)")
    return TrainConfig(
        optimizer=optimizer, task=args.task, world_size=args.world_size, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, schedule=args.schedule, warmup_steps=args.warmup_steps,
        freeze_step=args.freeze_step if args.freeze_step is not None else max(1, args.steps // 5),
        seed=args.seed, topk_ratio=min(args.topk_ratio, 1.0), qadam_bits=args.qadam_bits,
        local_step_scaler=args.local_step_scaler, powersgd_rank=args.powersgd_rank, hierarchical=args.hierarchical,
        context=args.context,
        hidden=args.hidden, d_model=args.d_model, layers=args.layers, heads=args.heads,
        checkpoint_every=args.checkpoint_every, resume=args.resume, backend=getattr(args, "backend", "torch"),
    )


def _run_all(args: argparse.Namespace, names: list[str]) -> dict[str, dict]:
    from .bench._train import train

    out = Path(args.out)
    summaries = {}
    with _cluster(args) as cluster:
        for name in names:
            summaries[name] = train(_config(args, name), out / name, progress=not args.quiet, cluster=cluster)
    return summaries


def _plot(out: Path, names: list[str], title: str) -> None:
    from .bench._plot import plot_losses

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
    from .bench._cluster import cluster_unavailable

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


def _cmd_demo(args: argparse.Namespace) -> int:
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


def _cmd_train(args: argparse.Namespace) -> int:
    if args.backend == "mpi":
        from . import comm

        # Under mpirun the job decides the ranks; --world-size would only repeat it.
        args.world_size = comm.get_world_size("mpi")
    summaries = _run_all(args, [args.optimizer])
    if summaries[args.optimizer] is None:  # an MPI rank other than 0: rank 0 reports
        return 0
    print(_report(summaries, baseline=None))
    print(f"metrics: {args.out}/{args.optimizer}/metrics.jsonl, summary: {args.out}/{args.optimizer}/summary.json")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .bench._model import ModelInput
    from .bench._train import OPTIMIZERS

    names = list(_names(args.optimizers, OPTIMIZERS, "--optimizers"))
    if args.baseline not in names:
        names.insert(0, args.baseline)
    summaries = _run_all(args, names)
    out = Path(args.out)
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
                           warmup_fraction=min(1.0, warm), topk_ratio=min(args.topk_ratio, 1.0))
    rows, note = compare_rows(summaries, runs, args.baseline, model, hierarchical=args.hierarchical)
    text = _table(rows)
    print(note)
    print(text)
    (out / "table.txt").write_text(note + "\n" + text + "\n")
    with open(out / "summary.json", "w") as f:
        json.dump(summaries, f, indent=2)
    _plot(out, names, f"{args.task}: " + ", ".join(names))
    return 0


def _write_bench(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """Print the benchmark's tables, with its command, machine and date; with ``--out``, also
    write them and ``summary.json`` there."""
    from .bench._reports import provenance, report_files

    summary = {**summary, "provenance": provenance(shlex.join(["onebit", *args.argv]))}
    text = report_files(summary)["table.txt"]
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "table.txt").write_text(text)
        print(f"summary: {out}/summary.json, table: {out}/table.txt")


def _bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from .bench import bench_kernels

    torch.set_num_threads(args.threads)
    results = bench_kernels(args.numel, args.repeat, args.device)
    device = torch.device(args.device)
    gpu = {"device_name": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    _write_bench(args, {"benchmark": "kernels", "settings": {
        "numel": args.numel, "repeat": args.repeat, "device": args.device, **gpu, "threads": args.threads,
        "torch": torch.__version__}, "results": [asdict(r) for r in results]})
    return 0


def _bench_comm(args: argparse.Namespace) -> int:
    import torch

    from .bench import bench_comm

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


def _names(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"onebit: {flag}: unknown {unknown or names}; available: {', '.join(known)}")
    return names


def _bench_convergence(args: argparse.Namespace) -> int:
    from .bench._convergence import CONVERGENCE_TASKS, FAMILIES, LEVELS, run_convergence
    from .bench._plot import plot_convergence
    from .bench._reports import provenance, report_files

    out = Path(args.out)
    if args.report_only:
        summary = json.loads((out / "summary.json").read_text())
    else:
        tasks = _names(args.tasks, CONVERGENCE_TASKS, "--tasks")
        families = _names(args.families, tuple(FAMILIES), "--families")
        levels = LEVELS if args.lr == "both" else (args.lr,)
        seeds = tuple(range(args.seeds))
        print(f"onebit bench convergence: {len(tasks)} tasks x {len(families)} optimizer families x {len(seeds)} "
              f"seeds x {1 + args.perturb} initial weights, {args.world_size} gloo ranks, {args.steps} steps, "
              f"batch {args.batch_size}/rank")
        summary = run_convergence(out, tasks, families, steps=args.steps, batch=args.batch_size,
                                  world=args.world_size, seeds=seeds, perturbations=args.perturb, levels=levels,
                                  freeze_fractions=tuple(args.freeze), extended=args.extended,
                                  controls=not args.no_controls, jobs=args.jobs,
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


def _bench_memory(args: argparse.Namespace) -> int:
    import torch

    from .bench._memory import FOOTPRINTS, WIRE_ALLOWANCE, bench_memory

    names = _names(args.optimizers or ",".join(FOOTPRINTS), tuple(FOOTPRINTS), "--optimizers")
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


def _cmd_cluster(args: argparse.Namespace) -> int:
    from .bench._cluster import cluster_unavailable, existing_namespaces
    from .bench._comm import link_check

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


def _cmd_model(args: argparse.Namespace) -> int:
    from .bench._model import ModelInput, predict

    for bandwidth in args.bandwidth:
        m = ModelInput(params=args.params, world_size=args.world_size, nodes=args.nodes, bandwidth=bandwidth,
                       latency=args.latency, compute=args.compute_ms / 1e3, kernel_gbps=args.kernel_gbps,
                       warmup_fraction=args.warmup_fraction, refresh_fraction=args.refresh_fraction,
                       local_fraction=args.local_fraction, topk_ratio=args.topk_ratio, value_bytes=args.value_bytes)
        print(f"onebit model: {m.params} parameters, {m.world_size} ranks on {m.nodes} nodes, "
              f"{bandwidth / 1e9:g} Gbit/s, {m.latency * 1e3:g} ms latency, compute {args.compute_ms:g} ms/step")
        rows = [["optimizer", "collective", "MB out of the busiest node", "comm ms", "step ms", "stage speedup",
                 "uncompressed", "end-to-end", "volume reduction"]]
        rows += [[p.optimizer, p.collective, f"{p.bytes_per_node / 1e6:.2f}", f"{p.comm_seconds * 1e3:.1f}",
                  f"{p.step_seconds * 1e3:.1f}", f"{p.stage_speedup:.2f}x", f"{p.warmup_fraction:.0%}",
                  f"{p.end_to_end_speedup:.2f}x", f"{p.volume_reduction:.1f}x"] for p in predict(m)]
        print(_table(rows))
    return 0


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from .bench._train import OPTIMIZERS

    parser = argparse.ArgumentParser(prog="onebit", description="1-bit communication-compressed optimizers.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train Adam and 1-bit Adam side by side")
    _training_flags(demo, 300, "runs/demo", bandwidth="200mbit")
    demo.add_argument("--loopback", action="store_true",
                      help="run on loopback even where an emulated cluster can be built")
    demo.set_defaults(func=_cmd_demo)

    train = sub.add_parser("train", help="train one optimizer on one task")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="onebit_adam")
    _training_flags(train, 300, "runs/train")
    train.add_argument("--backend", choices=("torch", "mpi"), default="torch",
                       help="torch: spawn --world-size local gloo ranks (default); mpi: run as one rank of an "
                            "mpirun job (mpirun -np N onebit train --backend mpi ...)")
    train.set_defaults(func=_cmd_train)

    compare = sub.add_parser("compare", help="several optimizers on the same task and seed: one table, one plot")
    compare.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                         help="comma-separated names (default: all of them)")
    compare.add_argument("--baseline", choices=OPTIMIZERS, default="adam", help="what speedups are relative to")
    _training_flags(compare, 300, "runs/compare")
    compare.set_defaults(func=_cmd_compare)

    bench = sub.add_parser("bench", help="benchmarks: bit kernels, collectives, the convergence matrix, memory")
    what = bench.add_subparsers(dest="what", required=True, metavar="{kernels,comm,convergence,memory}")

    kernels = what.add_parser("kernels", help="the bit kernels' throughput against a plain copy")
    kernels.add_argument("--numel", type=_positive_int, default=10_500_000, help="fp32 values (default 10.5M)")
    kernels.add_argument("--repeat", type=_positive_int, default=10, help="timed calls; the median is shown")
    kernels.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    kernels.add_argument("--device", default="cpu", help="device (default cpu)")
    kernels.add_argument("--out", default=None, help="also write summary.json and table.txt into this directory")
    kernels.set_defaults(func=_bench_kernels)

    comms = what.add_parser("comm", help="the compressed collectives against the fp32 all-reduce")
    comms.add_argument("--numel", type=_positive_int, default=10_500_000, help="fp32 values (default 10.5M)")
    comms.add_argument("--sizes", dest="numel_list", type=lambda t: [_positive_int(x) for x in t.split(",")],
                       default=None, help="comma-separated sizes (instead of --numel)")
    comms.add_argument("--repeat", type=_positive_int, default=10, help="timed calls; the median is shown")
    comms.add_argument("--world-size", type=_positive_int, default=2, help="ranks (default 2)")
    comms.add_argument("--backend", choices=("torch", "mpi"), default="torch",
                       help="over spawned gloo ranks (default) or, under mpirun, over MPI")
    comms.add_argument("--out", default=None, help="also write summary.json and table.txt into this directory")
    _cluster_flags(comms)
    comms.set_defaults(func=_bench_comm)

    conv = what.add_parser("convergence", help="every optimizer against its uncompressed counterpart, paired seeds")
    conv.add_argument("--tasks", default="gpt,digits,sparse_embed,frozen_unused",
                      help="comma-separated tasks (default: gpt,digits,sparse_embed,frozen_unused; "
                           "also byte_mlp, bert)")
    conv.add_argument("--families", default="adamw,lamb,amsgrad,softsign_sgd",
                      help="comma-separated counterparts, each with its compressed optimizers (default: all)")
    conv.add_argument("--seeds", type=_positive_int, default=4, help="paired seeds 0..N-1 per cell (default 4)")
    conv.add_argument("--world-size", type=_positive_int, default=3, help="gloo ranks (default 3)")
    conv.add_argument("--lr", choices=("low", "high", "both"), default="high",
                      help="each family's low or high learning rate, or both (default high)")
    conv.add_argument("--freeze", type=lambda t: [None if x == "default" else _fraction(x) for x in t.split(",")],
                      default=[None],
                      help="comma-separated schedules of the two-stage optimizers: 'default' (theirs as shipped: "
                           "freeze_step='auto', 0/1 Adam's own) or a freeze point as a fraction of the steps "
                           "(default: default)")
    conv.add_argument("--perturb", type=_nonneg_int, default=0, metavar="K",
                      help="also run every seed from K last-bit changes of its initial weights, standing in for "
                           "another machine's rounding (default 0)")
    conv.add_argument("--extended", action="store_true",
                      help="add the overlapped exchanges, no-error-feedback runs, Top-k keeping 5%% and 25%% and "
                           "per-layer Block-Sign")
    conv.add_argument("--jobs", type=_positive_int, default=1,
                      help="tasks trained at a time, each on --world-size processes of one thread (default 1)")
    conv.add_argument("--no-controls", action="store_true",
                      help="leave out the identity controls (each compressed optimizer with its compressor "
                           "replaced by the exact exchange)")
    conv.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                      help="learning rate: constant, or a cosine decay to zero (default constant)")
    conv.add_argument("--iid", action="store_true",
                      help="shard the byte tasks' text by random 4 KB blocks instead of contiguous slices")
    conv.add_argument("--steps", type=_positive_int, default=300, help="steps per run (default 300)")
    conv.add_argument("--batch-size", type=_positive_int, default=32, help="samples per rank per step (default 32)")
    conv.add_argument("--max-grad-norm", type=_positive_float, default=None,
                      help="gradient clipping for every optimizer (default: none)")
    conv.add_argument("--out", default="runs/convergence", help="output directory (default runs/convergence)")
    conv.add_argument("--quiet", action="store_true", help="no per-run progress lines")
    conv.add_argument("--report-only", action="store_true",
                      help="re-render the tables and plot from --out's summary.json without training")
    conv.set_defaults(func=_bench_convergence)

    mem = what.add_parser("memory", help="what each optimizer holds, against its algorithm's footprint")
    mem.add_argument("--world-sizes", type=lambda t: [_positive_int(x) for x in t.split(",")], default=[1, 2, 3, 4],
                     help="comma-separated world sizes of gloo ranks (default 1,2,3,4)")
    mem.add_argument("--optimizers", default=None, help="comma-separated names (default: all, with AdamW)")
    mem.add_argument("--size", type=_positive_int, default=2048, help="the model: nn.Linear(size, size)")
    mem.add_argument("--shards", type=_positive_int, default=1,
                     help="shard the model with FSDP2 over this many ranks of each node (HSDP; figures in "
                          "shard sizes; default 1: no sharding)")
    mem.add_argument("--steps", type=_positive_int, default=4, help="steps (default 4; the freeze after step 2)")
    mem.add_argument("--device", default="cpu", help="device (default cpu)")
    mem.add_argument("--out", default="runs/memory", help="output directory (default runs/memory)")
    mem.set_defaults(func=_bench_memory)

    cluster = sub.add_parser("cluster", help="build an emulated cluster, check its links, remove it")
    cluster.add_argument("--ranks-per-node", type=_positive_int, default=1)
    cluster.add_argument("--check-mb", type=_positive_int, default=25, help="MB sent for the link check")
    _cluster_flags(cluster)
    cluster.set_defaults(func=_cmd_cluster)

    model = sub.add_parser("model", help="alpha-beta cost model of each optimizer's communication")
    model.add_argument("--params", type=_positive_int, required=True, help="parameters of the model")
    model.add_argument("--world-size", type=_positive_int, default=4)
    model.add_argument("--nodes", type=_positive_int, default=4)
    model.add_argument("--bandwidth", type=lambda t: [_bandwidth(x) for x in t.split(",")], default=[1e9],
                       help="node egress rate(s), comma-separated for a sweep (default 1gbit)")
    model.add_argument("--latency", type=_latency, default=0.0)
    model.add_argument("--compute-ms", type=float, default=0.0, help="forward+backward+update time per step")
    model.add_argument("--kernel-gbps", type=_positive_float, default=5.0, help="compression kernel GB/s")
    model.add_argument("--warmup-fraction", type=float, default=0.15, help="1-bit Adam/LAMB warm-up share")
    model.add_argument("--refresh-fraction", type=float, default=0.01,
                       help="0/1 Adam: share of steps that refresh the variance (fp32)")
    model.add_argument("--local-fraction", type=float, default=0.5,
                       help="0/1 Adam: share of local steps, which send nothing")
    model.add_argument("--topk-ratio", type=_positive_float, default=0.01)
    model.add_argument("--value-bytes", type=int, choices=(2, 4), default=4,
                       help="bytes per uncompressed gradient value: 4 (fp32) or 2 (fp16 training, the papers')")
    model.set_defaults(func=_cmd_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the command a result records
    if args.command == "cluster" and not args.nodes:
        parser.error("onebit cluster: --nodes is required")
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
