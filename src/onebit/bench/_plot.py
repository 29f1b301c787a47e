"""Loss curves (vs samples and vs wall time) as a PNG; needs the optional matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_losses"]


def plot_losses(runs: dict[str, list[dict[str, Any]]], path: Path, title: str = "") -> Path:
    """Write ``path`` with one line per run; raises ImportError naming the extra if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the loss plot needs matplotlib: pip install 'onebit[plot]'") from exc
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs.items():
        loss = [r["loss"] for r in records]
        axes[0].plot([r["samples"] for r in records], loss, label=name)
        axes[1].plot([r["time"] for r in records], loss, label=name)
    axes[0].set_xlabel("samples")
    axes[1].set_xlabel("wall time (s)")
    for ax in axes:
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
