"""The examples' task: next-byte prediction on a file every Python install has, its model, and
the ``--freeze-step`` argument they share."""

from __future__ import annotations

import os

import torch

CONTEXT = 32


def byte_windows(rank: int, world: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` random windows of ``CONTEXT + 1`` bytes from this rank's shard of ``os.py``."""
    with open(os.__file__, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    shard = len(data) // world
    data = data[rank * shard : (rank + 1) * shard]
    gen = torch.Generator().manual_seed(seed + rank)
    start = torch.randint(0, len(data) - CONTEXT - 1, (count,), generator=gen)
    return data[start.unsqueeze(1) + torch.arange(CONTEXT + 1)]


def byte_model() -> torch.nn.Module:
    """The examples' model: an embedding of the ``CONTEXT`` previous bytes, an MLP, the next byte's logits."""
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 16), torch.nn.Flatten(),
        torch.nn.Linear(16 * CONTEXT, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
    )


def freeze_step(text: str) -> int | str:
    """'auto' (the default: the optimizer decides, after step 100 and by step 200) or the last warm-up step."""
    return text if text == "auto" else int(text)
