"""The reports a benchmark writes beside its results: where the run came from (command, machine,
date) and its tables (:func:`report_files`).

A convergence matrix's ``summary.json`` (``onebit bench convergence``) gives ``table.md`` and
``table.txt``; a memory, kernel or collective benchmark's (``onebit bench memory``, ``kernels
--out``, ``comm --out``) and ``onebit compare --rounds``' give ``table.txt``. Regenerating
every committed report from its results (and the documentation's generated blocks) needs a
checkout: ``python benchmarks/report.py`` there.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

from ._analysis import fmt, round_rows, text_table

__all__ = ["comm_tables", "convergence_rows", "is_convergence", "kernel_rows", "memory_rows", "provenance",
           "report_files", "rounds_table"]


def provenance(command: str) -> dict[str, str]:
    """``command``, ``machine`` (host name, cores, CPU model and widest vector instructions) and
    ``date`` of a run made now."""
    return {"command": command, "machine": f"{platform.node()} ({os.cpu_count()} cores{_cpu()})",
            "date": time.strftime("%Y-%m-%d")}


def _cpu() -> str:
    """", <model>, <AVX-512|AVX2|...>" from Linux's /proc/cpuinfo (the timings depend on both), or ""."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    fields = dict(line.split(":", 1) for line in info.splitlines()[:30] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sse4_2", "SSE4.2"))
                if flag in flags), "")
    # Kernels built for a narrower CPU than this one (a run standing in for an older machine):
    # numba's target CPU, torch's dispatch level.
    narrowed = [f"{var}={os.environ[var]}" for var in ("NUMBA_CPU_NAME", "ATEN_CPU_CAPABILITY") if os.environ.get(var)]
    return "".join(f", {part}" for part in (fields.get("model name", ""), isa, " ".join(narrowed)) if part)


def convergence_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """``table.txt``'s rows: every column of :func:`~onebit.bench._matrix.aggregate`'s cells."""
    out = [["task", "lr", "optimizer", "runs", "score (mean)", "paired gap", "95% ±", "worst (seed/perturbation)",
            "runs >10% behind", "target", "verdict", "steps to target"]]
    for r in rows:
        reached = [f for f in r.get("steps_to_target", []) if f is not None]
        worst = "" if "worst_run" not in r else \
            f"{fmt(r['worst_gap'], '+.2f')} ({'/'.join(map(str, r['worst_run']))})" if r["worst_run"] else "-"
        out.append([
            r["task"], f"{r['lr']:g}", r["label"], str(len(r["seeds"])),
            f"{r['score_mean']:.4f}",
            fmt(r.get("gap_mean"), "+.2f"), fmt(r.get("gap_half"), ".2f"), worst, fmt(r.get("behind"), ".0%"),
            fmt(r.get("target"), "g"), r.get("verdict", "counterpart"),
            "" if "steps_to_target" not in r else
            f"{sum(reached) / len(reached):.2f} ({len(reached)}/{len(r['seeds'])})" if reached else "never",
        ])
    return out


def memory_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """``onebit bench memory``'s table: held, footprint and peaks in fp32 model sizes."""
    sharded = any(r.get("shards", 1) > 1 for r in results)  # figures in shard sizes: say so
    rows = [["optimizer", "world size", *(["replicas x shards"] if sharded else []), "stage", "held", "footprint",
             "held - footprint", "peak during steps", "CUDA peak"]]
    rows += [[r["optimizer"], str(r["world_size"]),
              *([f"{r['world_size'] // r['shards']} x {r['shards']}"] if sharded else []), r["stage"],
              f"{r['held']:.3f}", f"{r['footprint']:.3f}", f"{r['held'] - r['footprint']:+.3f}",
              fmt(r["peak"], ".2f"), fmt(r["cuda_peak"], ".2f")] for r in results]
    return rows


def kernel_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    """``onebit bench kernels``' table: each kernel's time and its bandwidth against a copy's."""
    rows = [["kernel", "implementation", "ms", "GB/s (fp32 values)", "vs copy", "traffic GB/s", "of copy bandwidth"]]
    rows += [[r["kernel"], r["implementation"], f"{r['seconds'] * 1e3:.2f}", f"{r['gbytes_per_s']:.1f}",
              f"{r['vs_copy']:.2f}x", f"{r['traffic_gbytes_per_s']:.1f}", f"{r['bandwidth']:.0%}"] for r in results]
    return rows


def comm_tables(results: list[dict[str, Any]], backend: str, repeat: int) -> str:
    """``onebit bench comm``'s tables, one (and one of phases) per size."""
    out = []
    for numel in dict.fromkeys(r["numel"] for r in results):
        mine = [r for r in results if r["numel"] == numel]
        cpu = all("cpu_seconds" in r for r in mine)  # recorded since 2026-11-26
        rows = [["collective", "ms", *(["CPU ms/rank"] if cpu else []), "bytes sent/rank", "inter-node bytes/rank",
                 "vs fp32 all_reduce", "wire-limited ideal ms", "vs ideal"]]
        rows += [[r["collective"], f"{r['seconds'] * 1e3:.1f}", *([f"{r['cpu_seconds'] * 1e3:.1f}"] if cpu else []),
                  str(r["bytes_sent"]), fmt(r["inter_node_bytes"], "d"), f"{r['vs_fp32']:.2f}x",
                  fmt(None if r["ideal_seconds"] is None else r["ideal_seconds"] * 1e3, ".1f"),
                  f"{r['seconds'] / r['ideal_seconds']:.2f}x" if r["ideal_seconds"] else "-"] for r in mine]
        out.append(f"onebit bench comm: {numel} fp32 values, {mine[0]['world_size']} ranks ({backend}), "
                   f"median of {repeat}\n" + text_table(rows))
        timed = [r for r in mine if r["phases"]]
        if timed:
            names = list(timed[0]["phases"])
            rows = [["collective (ms per phase, mean over calls and ranks)", *names, "sum"]]
            rows += [[r["collective"], *(f"{r['phases'].get(k, 0.0) * 1e3:.1f}" for k in names),
                      f"{sum(r['phases'].values()) * 1e3:.1f}"] for r in timed]
            out.append(text_table(rows))
    return "\n\n".join(out)


def rounds_table(summary: dict[str, Any]) -> str:
    """``onebit compare --rounds``' table (:func:`round_rows`) under a line that says how it was
    measured, and the rounds in which an optimizer skipped steps (a skipped step sends 4 bytes
    and looks fast: :func:`round_rows` leaves those rounds out)."""
    count = len(summary["step_time"][summary["baseline"]])
    lines = [f"onebit compare: {count} rounds, the optimizers in alternating order; each one's step "
             f"time against {summary['baseline']}'s in the same round", text_table(round_rows(summary))]
    skipped = [f"{name} round {k + 1}: {n}" for name, counts in summary["skipped_steps"].items()
               for k, n in enumerate(counts) if n]
    if skipped:
        lines.append("steps skipped for a non-finite gradient (those rounds are left out of the figures): " +
                     ", ".join(skipped))
    return "\n".join(lines)


def _provenance(summary: dict[str, Any]) -> str:
    p = summary.get("provenance")
    if not p:
        raise ValueError("summary.json has no 'provenance' (command, machine, date)")
    return f"`{p['command']}`; {p['machine']}, {p['date']}."


def is_convergence(summary: dict[str, Any]) -> bool:
    return "runs" in summary and "aggregate" in summary


def report_files(summary: dict[str, Any]) -> dict[str, str]:
    """The reports a benchmark's ``summary.json`` gives (file name: content, each table followed
    by the result's command, machine and date); ``{}`` for one run's summary (``onebit compare``,
    ``train``), whose table is what the run printed."""
    if is_convergence(summary):
        from ._matrix import aggregate, markdown_table

        rows = aggregate(summary["runs"])
        tables = {"table.md": markdown_table(rows), "table.txt": text_table(convergence_rows(rows))}
    elif "meta" in summary and "results" in summary:
        tables = {"table.txt": text_table(memory_rows(summary["results"]))}
    elif summary.get("benchmark") == "kernels":
        meta = summary["settings"]
        device = meta.get("device_name", meta["device"])
        tables = {"table.txt": f"onebit bench kernels: {meta['numel']} fp32 values on {device}, median of "
                               f"{meta['repeat']}\n" + text_table(kernel_rows(summary["results"]))}
    elif summary.get("benchmark") == "comm":
        meta = summary["settings"]
        tables = {"table.txt": comm_tables(summary["results"], meta["backend"], meta["repeat"])}
    elif summary.get("benchmark") == "compare-rounds":
        tables = {"table.txt": rounds_table(summary)}
    else:
        return {}
    note = _provenance(summary)
    return {name: f"{table}\n\n{note}\n" for name, table in tables.items()}
