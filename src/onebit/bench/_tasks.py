"""Training tasks on real data present on every machine: the Python standard library's source."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["ByteCorpus", "ByteMLP"]


class ByteCorpus:
    """The bytes of the standard library's ``.py`` files (sorted, capped), split train/held-out."""

    def __init__(self, max_bytes: int = 4_000_000, holdout: float = 0.1) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks, total = [], 0
        for path in sorted(root.rglob("*.py")):
            if "test" in path.parts or "site-packages" in path.parts:
                continue
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if total == 0:
            raise RuntimeError(f"no Python sources found under {root}")
        data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
        split = int(len(data) * (1 - holdout))
        self.train, self.heldout = data[:split], data[split:]

    def batch(self, context: int, size: int, generator: torch.Generator, heldout: bool = False) -> tuple[Tensor, Tensor]:
        """``size`` random windows: ``context`` bytes in, the next byte as target."""
        data = self.heldout if heldout else self.train
        start = torch.randint(0, len(data) - context - 1, (size,), generator=generator)
        idx = start.unsqueeze(1) + torch.arange(context + 1)
        windows = data[idx]
        return windows[:, :context], windows[:, context]


class ByteMLP(nn.Module):
    """Next-byte predictor: embed ``context`` bytes, two hidden layers, 256 logits."""

    def __init__(self, context: int = 16, embed: int = 32, hidden: int = 512) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(256, embed)
        self.net = nn.Sequential(
            nn.Linear(context * embed, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 256),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.embed(x).flatten(1))
