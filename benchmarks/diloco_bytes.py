"""Bytes a DiLoCo synchronisation sends, by exchange and number of workers, on real gloo ranks.

Each setting builds the convergence benchmark's byte-level GPT on every rank, takes one inner
step and its synchronisation (``sync_every=1``), and records what each rank's meter counted
for that step (the outer gradients' exchange, plus the agreement on skipping it): the bytes
are the library's own count, the same on any link, so loopback ranks measure them::

    python benchmarks/diloco_bytes.py --workers 4,8,16 --out benchmarks/results/diloco-bytes/bytes.jsonl
    python benchmarks/diloco_bytes.py --report benchmarks/results/diloco-bytes/bytes.jsonl

The report gives each setting's bytes per worker and synchronisation (the busiest rank's),
its ratio to fp32 DiLoCo's all-reduce at the same number of workers, and how it grows from the
fewest workers measured to the most.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _records import append_row, provenance, provenance_note, read_rows

import onebit
from onebit.bench._tasks import ByteTransformer

# name -> DiLoCo arguments beyond sync_every=1 (the outer step sends what its compressor sends:
# only the compressor, the collective and the scales change the bytes)
TENSOR = {"scales": "tensor"}  # one scale per tensor piece
SPARSELOCO = {"outer_step": "sparseloco", **TENSOR}
SETTINGS = {
    "fp32 (all-reduce)": {"compressor": "identity"},
    "1-bit all-gather, a scale per row (default)": {},
    "1-bit all-reduce, a scale per row": {"collective": "allreduce"},
    "1-bit all-gather": {"outer_step": "nesterov", **TENSOR},
    "1-bit all-reduce": {"outer_step": "nesterov", "collective": "allreduce", **TENSOR},
    "SparseLoCo, Top-k 2-bit all-gather": {**SPARSELOCO, "compressor": "chunk_topk"},
    "SparseLoCo, Top-k 2-bit all-reduce": {**SPARSELOCO, "compressor": "chunk_topk", "collective": "allreduce"},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return ByteTransformer(16, d_model=64, layers=2, heads=4, causal=True)  # the convergence matrix's gpt


def _synchronise(rank: int, world: int, kwargs: dict) -> tuple[int, int, int]:
    model = _model()
    opt = onebit.DiLoCo(model.parameters(), lr=1e-3, sync_every=1, **kwargs)
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(rank))
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
    opt.step()
    return opt.stats["bytes_sent"], opt.stats["skipped_steps"], sum(p.numel() for p in model.parameters())


def measure(workers: list[int], out: str) -> None:
    source = provenance()
    for world in workers:
        for name, kwargs in SETTINGS.items():
            results = onebit.launch.spawn(_synchronise, world, kwargs, timeout=600.0)
            sent = [b for b, _, _ in results]
            row = {"setting": name, "kwargs": kwargs, "workers": world, "params": results[0][2],
                   "bytes_max": max(sent), "bytes_mean": statistics.mean(sent),
                   "skipped_steps": sum(s for _, s, _ in results), **source}
            append_row(out, row)
            print(f"{world:>3} workers  {name:<38} {max(sent):>10,} bytes a worker")


def report(path: str) -> None:
    rows = read_rows(path)
    if any(r["skipped_steps"] for r in rows):
        raise SystemExit("a measured synchronisation was skipped: its bytes do not count")
    workers = sorted({r["workers"] for r in rows})
    by = {(r["setting"], r["workers"]): r for r in rows}
    fp32 = {w: by[("fp32 (all-reduce)", w)]["bytes_max"] for w in workers}
    print(f"Bytes a worker sends per synchronisation (the busiest rank), the byte-level GPT "
          f"({rows[0]['params']:,} parameters):\n")
    print("| exchange | " + " | ".join(f"{w} workers" for w in workers) + f" | {workers[-1]} vs {workers[0]} workers |")
    print("|---|" + "---:|" * (len(workers) + 1))
    for name in SETTINGS:
        cells = [f"{by[(name, w)]['bytes_max']:,} ({fp32[w] / by[(name, w)]['bytes_max']:.0f}x fewer)"
                 if name != "fp32 (all-reduce)" else f"{by[(name, w)]['bytes_max']:,}" for w in workers]
        growth = by[(name, workers[-1])]["bytes_max"] / by[(name, workers[0])]["bytes_max"]
        print(f"| {name} | " + " | ".join(cells) + f" | {growth:.2f}x |")
    print(f"\n{provenance_note(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="4,8,16", help="comma-separated numbers of gloo ranks")
    parser.add_argument("--out", help="JSON-lines file the rows are appended to")
    parser.add_argument("--report", metavar="FILE", help="print the table of FILE's rows instead")
    args = parser.parse_args()
    if args.report:
        report(args.report)
    elif args.out:
        measure([int(w) for w in args.workers.split(",")], args.out)
    else:
        parser.error("give --out (measure) or --report")


if __name__ == "__main__":
    main()
