"""``onebit model``: the cost model's table (``_model.py``) for the user's cluster, one per bandwidth."""

from __future__ import annotations

import argparse
import textwrap

from ._analysis import names_from, text_table
from ._model import ModelInput, predict

__all__ = ["KERNEL_GBPS", "model", "refresh_every"]

# The compression kernels' speed by device, in GB/s of fp32 values through compress, the server's
# average and decode together (1-bit Adam's per step), from `onebit bench kernels` of 10.5M values:
# cpu, one thread of a 2-core Xeon VM (numba: 13.6 + 10.6 + 4.0 ms; benchmarks/results/kernels);
# gpu, Triton on an H100 and an H200 (0.41 and 0.46 ms; benchmarks/results/kernels-h1*-10500000).
KERNEL_GBPS = {"cpu": 4.5, "gpu": 290.0}
MODEL_WIDTH = 80  # the model's output fits a page's code box
_MODEL_COLUMNS = (
    "MB/exch: megabytes out of the busiest node in one exchange (DiLoCo: one synchronisation); "
    "MB/step: the same averaged over every step of the run; step ms: a step that exchanges (compute "
    "+ communication + compression); stage: its speedup over adam's step; fp32: the share of "
    "steps that send fp32 (1-bit Adam and LAMB's warm-up, 0/1 Adam's refreshes; 1-bit Adam's bf16 refreshes "
    "count half); overall: "
    "the speedup over the whole run, counting those and the steps that send nothing (0/1 Adam's local steps, "
    "DiLoCo's inner steps); volume: adam's bytes over this optimizer's, summed over the run and every "
    "link, those inside a node too (birder_hierarchical's fp32 reduce-scatter inside each node).")


def refresh_every(args: argparse.Namespace) -> int | None:
    """``--refresh-every`` as 1-bit Adam takes it (``"never"``: ``None``)."""
    return None if args.refresh_every == "never" else args.refresh_every


def model(args: argparse.Namespace) -> int:
    gbps = args.kernel_gbps or KERNEL_GBPS[args.device]
    for bandwidth in args.bandwidth:
        m = ModelInput(params=args.params, world_size=args.world_size, nodes=args.nodes, bandwidth=bandwidth,
                       latency=args.latency, compute=args.compute_ms / 1e3, kernel_gbps=gbps,
                       warmup_fraction=args.warmup_fraction, refresh_fraction=args.refresh_fraction,
                       refresh_every=refresh_every(args),
                       local_fraction=args.local_fraction, sync_every=args.sync_every, fragments=args.fragments,
                       delay=args.delay, topk_ratio=args.topk_ratio,
                       value_bytes=args.value_bytes)
        print(f"onebit model: {m.params / 1e6:g}M parameters, {m.world_size} ranks on {m.nodes} nodes, "
              f"{bandwidth / 1e9:g} Gbit/s out of each node,")
        print(f"  {m.latency * 1e3:g} ms latency, {args.compute_ms:g} ms of compute per step, compression at "
              f"{gbps:g} GB/s" + ("" if args.kernel_gbps else f" ({args.device})"))
        predictions = predict(m)
        if args.optimizers is not None:
            names = names_from(args.optimizers, tuple(p.optimizer for p in predictions), "--optimizers")
            predictions = [p for p in predictions if p.optimizer in names]
        rows = [["optimizer", "MB/exch", "MB/step", "step ms", "stage", "fp32", "overall", "volume"]]
        rows += [[p.optimizer, f"{p.bytes_per_node / 1e6:.2f}", _amount(p.mean_bytes_per_node / 1e6),
                  f"{p.step_seconds * 1e3:.1f}", f"{p.stage_speedup:.2f}x",
                  f"{p.warmup_fraction:.0%}", f"{p.end_to_end_speedup:.2f}x",
                  _amount(p.volume_reduction) + "x"]
                 for p in predictions]
        print(text_table(rows))
    exchanges: dict[str, list[str]] = {}
    for p in predictions:
        exchanges.setdefault(p.collective, []).append(p.optimizer)
    print("exchanges:")
    for collective, names in exchanges.items():
        print(_wrap(f"{collective}: {', '.join(names)}", indent="  "))
    print(_wrap(_MODEL_COLUMNS))
    return 0


def _amount(value: float) -> str:
    """Three significant digits below 100, whole numbers with thousands separators above."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if value >= 1e-3 else f"{value:.4f}"


def _wrap(text: str, indent: str = "") -> str:
    return textwrap.fill(text, MODEL_WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False)
