"""The ``onebit`` command: demo, train, compare, bench, cluster, model. This module parses and
dispatches; what each command does is in :mod:`onebit.bench._commands` (``onebit model``:
:mod:`onebit.bench._model_command`)."""

from __future__ import annotations

import argparse
import math
import sys

from . import __version__
from .bench import _commands as commands
from .bench import _model_command

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
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9}


def _count(text: str) -> int:
    """A positive count as people write model sizes: ``8400000``, ``1e8``, ``125M``, ``1.3B``, ``350k``."""
    body, suffix = (text[:-1], text[-1].lower()) if text and text[-1].lower() in _COUNT_SUFFIX else (text, "")
    try:
        value = float(body) * _COUNT_SUFFIX[suffix]
        if not math.isfinite(value):
            raise ValueError(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive count such as 8400000, 1e8, 125M or 1.3B, got "
                                         f"{text!r}") from None
    # a suffix rounds (1.1B is 1100000000.0000002 in floating point); a bare number must be whole
    if round(value) < 1 or (not suffix and value != round(value)):
        raise argparse.ArgumentTypeError(f"must be a positive whole count, got {text!r}")
    return round(value)


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


def _word_or_int(word: str, minimum: int, what: str):
    """An argparse type: ``word`` itself, or an int of at least ``minimum`` (``what``, in the error)."""
    number = _int_at_least(minimum, what)

    def parse(text: str) -> int | str:
        if text == word:
            return text
        try:
            return number(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {word!r} or {what}, got {text!r}") from None

    return parse


_refresh = _word_or_int("never", 1, "a positive integer")
_freeze = _word_or_int("auto", 0, "an integer >= 0")


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


# ---------------------------------------------------------------------- cluster


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
    from .compress import available

    p.add_argument("--task", choices=TASKS, default="mlp", help="mlp (default), gpt, bert or digits")
    p.add_argument("--world-size", type=_positive_int, default=2, help="total ranks (default 2)")
    p.add_argument("--steps", type=_positive_int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--batch-size", type=_positive_int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--schedule", choices=SCHEDULES, default="constant", help="after --warmup-steps")
    p.add_argument("--warmup-steps", type=_nonneg_int, default=0, help="linear learning-rate warm-up")
    p.add_argument("--freeze-step", type=_freeze, default=None,
                   help="last warm-up step of 1-bit Adam/LAMB (0/1 Adam: its variance freeze; DiLoCo: its "
                        "--sync-every): an int, or 'auto' (the default: each optimizer's own, as a user gets it)")
    p.add_argument("--topk-ratio", type=_positive_float, default=0.01, help="Comp-AMS top-k fraction")
    p.add_argument("--qadam-bits", type=_positive_int, default=1, help="QAdam's bits per value")
    p.add_argument("--compressor", choices=available(), default=None, metavar="NAME",
                   help=f"what 1-bit Adam/LAMB, 0/1 Adam, Birder and DiLoCo send: {', '.join(available())} (default: "
                        "their own; identity: the exact exchange, the control that tells the compression's cost from "
                        "the algorithm's)")
    p.add_argument("--refresh-dtype", choices=("bf16", "fp32"), default=None,
                   help="1-bit Adam: what its refreshes sum the gradients in (default: its own, bf16)")
    p.add_argument("--refresh-every", type=_refresh, default=None,
                   help="1-bit Adam: refresh the frozen variance every K steps after the freeze, with the gradients' "
                        "average, or 'never' (default: its own, every 8)")
    p.add_argument("--refresh-schedule", choices=("bounded", "paper"), default=None,
                   help="0/1 Adam: its variance refreshes at least every 8th step, each weighing the steps since "
                        "the last (bounded, its default), or the paper's and DeepSpeed's (doubling without bound)")
    p.add_argument("--local-step-scaler", type=_positive_int, default=None,
                   help="0/1 Adam: steps per doubling of the local-step interval (default: a quarter of "
                        "--freeze-step where one is given, else 0/1 Adam's own; larger than --steps: no local "
                        "steps)")
    p.add_argument("--powersgd-rank", type=_positive_int, default=1, help="ddp_powersgd's matrix rank")
    p.add_argument("--sync-every", type=_positive_int, default=None,
                   help="diloco: inner steps per synchronisation (default 500)")
    p.add_argument("--fragments", type=_positive_int, default=None,
                   help="diloco: synchronise the model in this many fragments, staggered (default 1)")
    p.add_argument("--delay", type=_nonneg_int, default=None,
                   help="diloco: inner steps each synchronisation stays in flight (default 0)")
    p.add_argument("--collective", choices=("allgather", "allreduce"), default=None,
                   help="diloco: the 1-bit outer gradients all-gathered (default) or through the compressed all-reduce")
    p.add_argument("--bucket-cap-mb", type=_positive_float, default=None,
                   help="bucket size of the *_overlap optimizers and of DDP, MB of fp32 values (default 25)")
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
    p.add_argument("--trace", type=_positive_int, default=None, metavar="STEP",
                   help="record step STEP on every rank: when each bucket's gradients were ready and each phase "
                        "of its exchange ran (trace.json for ui.perfetto.dev, timeline.png)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _cluster_flags(p, bandwidth)


# ---------------------------------------------------------------------- parser
class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _help(parser: argparse.ArgumentParser):
    def show(args: argparse.Namespace) -> int:
        parser.print_help()
        return 0
    return show


def build_parser() -> argparse.ArgumentParser:
    from .bench._train import OPTIMIZERS

    parser = argparse.ArgumentParser(prog="onebit", description="1-bit communication-compressed optimizers.")
    parser.add_argument("--version", action="version", version=f"onebit {__version__}")
    sub = parser.add_subparsers(dest="command")
    parser.set_defaults(func=_help(parser))  # a bare `onebit`: what it can do, not an error

    demo = sub.add_parser("demo", help="train Adam and 1-bit Adam side by side")
    _training_flags(demo, 300, "runs/demo", bandwidth="200mbit")
    demo.add_argument("--loopback", action="store_true",
                      help="run on loopback even where an emulated cluster can be built")
    demo.set_defaults(func=commands.demo)

    train = sub.add_parser("train", help="train one optimizer on one task")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="onebit_adam", metavar="NAME",
                       help=f"one of {', '.join(OPTIMIZERS)} (default onebit_adam)")
    _training_flags(train, 300, "runs/train")
    train.add_argument("--backend", choices=("torch", "mpi"), default="torch",
                       help="torch: spawn --world-size local gloo ranks (default); mpi: run as one rank of an "
                            "mpirun job (mpirun -np N onebit train --backend mpi ...)")
    train.set_defaults(func=commands.train_command)

    compare = sub.add_parser("compare", help="several optimizers on the same task and seed: one table, one plot")
    compare.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                         help="comma-separated names (default: all of them)")
    compare.add_argument("--baseline", choices=OPTIMIZERS, default="adam", metavar="NAME",
                         help="what speedups are relative to: one of --optimizers (default adam)")
    compare.add_argument("--rounds", type=_positive_int, default=1, metavar="K",
                         help="run the optimizers K times, in alternating order (an even K runs each as often "
                              "first as last), and give each one's step time against the baseline's of the same "
                              "round: median, range and 95%% interval, leaving out rounds with skipped steps "
                              "(default 1: one run each)")
    _training_flags(compare, 300, "runs/compare")
    compare.set_defaults(func=commands.compare)

    bench = sub.add_parser("bench", help="benchmarks: bit kernels, collectives, the convergence matrix, memory")
    what = bench.add_subparsers(dest="what", metavar="{kernels,comm,convergence,memory}")
    bench.set_defaults(func=_help(bench))

    kernels = what.add_parser("kernels", help="the bit kernels' throughput against a plain copy")
    kernels.add_argument("--numel", type=_positive_int, default=10_500_000, help="fp32 values (default 10.5M)")
    kernels.add_argument("--repeat", type=_positive_int, default=10, help="timed calls; the median is shown")
    kernels.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    kernels.add_argument("--device", default="cpu", help="device (default cpu)")
    kernels.add_argument("--out", default=None, help="also write summary.json and table.txt into this directory")
    kernels.set_defaults(func=commands.kernels)

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
    comms.set_defaults(func=commands.comm_bench)

    conv = what.add_parser("convergence", help="every optimizer against its uncompressed counterpart, paired seeds")
    conv.add_argument("--tasks", default="gpt,digits,sparse_embed,frozen_unused",
                      help="comma-separated tasks (default: gpt,digits,sparse_embed,frozen_unused; "
                           "also byte_mlp, bert)")
    conv.add_argument("--families", default="adamw,lamb,amsgrad,softsign_sgd",
                      help="comma-separated counterparts, each with its compressed optimizers (default: all)")
    conv.add_argument("--optimizers", default=None,
                      help="comma-separated registry names (each with its variants) or the matrix's names of "
                           "single variants: only these beside each family's counterpart (default: all of the "
                           "families')")
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
    conv.set_defaults(func=commands.convergence)

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
    mem.set_defaults(func=commands.memory)

    cluster = sub.add_parser("cluster", help="build an emulated cluster, check its links, remove it")
    cluster.add_argument("--ranks-per-node", type=_positive_int, default=1)
    cluster.add_argument("--check-mb", type=_positive_int, default=25, help="MB sent for the link check")
    _cluster_flags(cluster)
    cluster.set_defaults(func=commands.cluster)

    model = sub.add_parser("model", help="alpha-beta cost model of each optimizer's communication",
                           formatter_class=_DefaultsShown)
    model.add_argument("--params", type=_count, required=True,
                       help="parameters of the model (8400000, 1e8, 125M, 1.3B)")
    model.add_argument("--world-size", type=_positive_int, default=4, help="ranks in all")
    model.add_argument("--nodes", type=_positive_int, default=4, help="machines the ranks are spread over")
    model.add_argument("--bandwidth", type=lambda t: [_bandwidth(x) for x in t.split(",")], default="1gbit",
                       help="each node's outgoing link, e.g. 100mbit or 10gbit; comma-separated for a sweep")
    model.add_argument("--latency", type=_latency, default="0ms", help="per message")
    model.add_argument("--compute-ms", type=float, default=0.0, help="forward+backward+update time per step")
    model.add_argument("--device", choices=tuple(_model_command.KERNEL_GBPS), default="cpu",
                       help="where the compression runs: its kernels' measured speed ("
                            + ", ".join(f"{k} {v:g} GB/s" for k, v in _model_command.KERNEL_GBPS.items()) + ")")
    model.add_argument("--kernel-gbps", type=_positive_float, default=None,
                       help="the compression kernels' GB/s of fp32 values, instead of --device's")
    model.add_argument("--warmup-fraction", type=float, default=0.15, help="1-bit Adam/LAMB warm-up share")
    model.add_argument("--refresh-every", type=_refresh, default=8,
                       help="1-bit Adam: a bf16 refresh every K steps after the warm-up, or 'never' (default 8)")
    model.add_argument("--refresh-fraction", type=float, default=0.06,
                       help="0/1 Adam: share of steps that refresh the variance (fp32; default: one in 8 of the "
                            "steps before its variance freeze, which leaves --local-fraction after it; its "
                            "schedule without the bound: ~0.002)")
    model.add_argument("--local-fraction", type=float, default=0.5,
                       help="0/1 Adam: share of local steps, which send nothing")
    model.add_argument("--sync-every", type=_positive_int, default=500,
                       help="DiLoCo: inner steps per synchronisation (H)")
    model.add_argument("--fragments", type=_positive_int, default=1,
                       help="DiLoCo: fragments synchronised in turn (P; streaming)")
    model.add_argument("--delay", type=_nonneg_int, default=0,
                       help="DiLoCo: steps each synchronisation stays in flight (hides delay x compute)")
    model.add_argument("--optimizers", default=None,
                       help="comma-separated rows to print (default: every optimizer)")
    model.add_argument("--topk-ratio", type=_positive_float, default=0.01, help="Comp-AMS Top-k: share of values sent")
    model.add_argument("--value-bytes", type=int, choices=(2, 4), default=4,
                       help="bytes per uncompressed gradient value: 4 (fp32) or 2 (fp16 training, the papers')")
    model.set_defaults(func=_model_command.model)
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
