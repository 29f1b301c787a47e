"""The ``onebit`` command: demo, train, bench."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _freeze(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text}")
    return value


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _report(summaries: dict[str, dict], baseline: str = "adam") -> str:
    base_bytes = summaries.get(baseline, {}).get("bytes_sent_per_rank")
    rows = [["optimizer", "final loss", "eval loss", "samples/s warmup", "samples/s compressed",
             "MB sent/rank", "reduction", "freeze step"]]
    for name, s in summaries.items():
        rates = s["samples_per_s"]
        sent = s["bytes_sent_per_rank"]
        rows.append([
            name,
            f"{s['final_loss']:.4f}",
            f"{s['eval_loss']:.4f}",
            _fmt(rates.get("warmup") or rates.get("uncompressed"), ".0f"),
            _fmt(rates.get("compressed"), ".0f"),
            f"{sent / 1e6:.2f}",
            f"{base_bytes / sent:.1f}x" if base_bytes and sent else "-",
            str(s["freeze_step"]) if s["freeze_step"] is not None else "-",
        ])
    return _table(rows)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .bench._plot import plot_losses
    from .bench._train import TrainConfig, train

    out = Path(args.out)
    cfg = TrainConfig(world_size=args.world_size, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, freeze_step=args.freeze_step if args.freeze_step is not None
                      else max(1, args.steps // 5), seed=args.seed)
    print(f"onebit demo: byte-level language model on the Python standard library, "
          f"{cfg.world_size} local gloo ranks, {cfg.steps} steps, batch {cfg.batch_size}/rank")
    summaries = {}
    for name in ("adam", "onebit_adam"):
        summaries[name] = train(replace(cfg, optimizer=name), out / name, progress=not args.quiet)
    print(_report(summaries))
    with open(out / "summary.json", "w") as f:
        json.dump(summaries, f, indent=2)
    runs = {}
    for name in summaries:
        with open(out / name / "metrics.jsonl") as f:
            runs[name] = [json.loads(line) for line in f]
    try:
        png = plot_losses(runs, out / "loss.png", "Adam vs 1-bit Adam")
        print(f"loss plot: {png}")
    except ImportError as exc:
        print(f"no loss plot: {exc}")
    print(f"metrics: {out}/<optimizer>/metrics.jsonl, summaries: {out}/summary.json")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .bench._train import TrainConfig, train

    cfg = TrainConfig(optimizer=args.optimizer, world_size=args.world_size, steps=args.steps,
                      batch_size=args.batch_size, lr=args.lr,
                      freeze_step=args.freeze_step if args.freeze_step is not None else max(1, args.steps // 5),
                      seed=args.seed)
    summary = train(cfg, Path(args.out), progress=not args.quiet)
    print(_report({args.optimizer: summary}, baseline=""))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import bench_comm, bench_kernels

    if args.what == "kernels":
        torch.set_num_threads(args.threads)
        results = bench_kernels(args.numel, args.repeat, args.device)
        rows = [["kernel", "implementation", "ms", "GB/s (fp32 side)", "vs copy"]]
        rows += [[r.kernel, r.implementation, f"{r.seconds * 1e3:.2f}", f"{r.gbytes_per_s:.1f}", f"{r.vs_copy:.2f}x"]
                 for r in results]
    else:
        results = bench_comm(args.numel, args.world_size, args.repeat)
        rows = [["collective", "ms", "bytes sent/rank", "speed vs fp32 all_reduce"]]
        rows += [[r.collective, f"{r.seconds * 1e3:.1f}", str(r.bytes_sent), f"{r.vs_fp32:.2f}x"] for r in results]
    print(f"onebit bench {args.what}: {args.numel} fp32 values, median of {args.repeat}")
    print(_table(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onebit", description="1-bit communication-compressed optimizers.")
    sub = parser.add_subparsers(dest="command", required=True)

    def training_flags(p: argparse.ArgumentParser, steps: int, out: str) -> None:
        p.add_argument("--world-size", type=_positive_int, default=2, help="local gloo ranks (default 2)")
        p.add_argument("--steps", type=_positive_int, default=steps, help=f"training steps (default {steps})")
        p.add_argument("--batch-size", type=_positive_int, default=32, help="samples per rank per step")
        p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
        p.add_argument("--freeze-step", type=_freeze, default=None,
                       help="last warm-up step of 1-bit Adam: an int or 'auto' (default: 20%% of --steps)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", default=out, help=f"output directory (default {out})")
        p.add_argument("--quiet", action="store_true", help="no progress bar")

    demo = sub.add_parser("demo", help="train Adam and 1-bit Adam side by side on local ranks")
    training_flags(demo, 300, "runs/demo")
    demo.set_defaults(func=_cmd_demo)

    from .bench._train import OPTIMIZERS

    train = sub.add_parser("train", help="train one optimizer on local ranks")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="onebit_adam")
    training_flags(train, 300, "runs/train")
    train.set_defaults(func=_cmd_train)

    bench = sub.add_parser("bench", help="microbenchmarks: bit kernels or collectives")
    bench.add_argument("what", choices=("kernels", "comm"))
    bench.add_argument("--numel", type=_positive_int, default=10_500_000, help="fp32 values (default 10.5M)")
    bench.add_argument("--repeat", type=_positive_int, default=10)
    bench.add_argument("--world-size", type=_positive_int, default=2, help="ranks for 'comm' (default 2)")
    bench.add_argument("--threads", type=_positive_int, default=1, help="torch threads for 'kernels' (default 1)")
    bench.add_argument("--device", default="cpu", help="device for 'kernels' (default cpu)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
