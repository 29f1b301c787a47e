"""The fused flat state: one fp32 buffer per state name, laid out like the parameters.

One slot per parameter, parameters in group order (so each param group is one contiguous
segment); ``self.state[p]`` holds views into the buffers. The whole model's momentum is then
one tensor for one collective, and a bucket of the overlapped exchange is one range of it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["FlatState", "starts_inside"]


class FlatState:
    """Named flat fp32 buffers laid out like the parameters, with per-parameter views."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.offsets: list[tuple[int, int]] = []
        start = 0
        for p in params:
            self.offsets.append((start, start + p.numel()))
            start += p.numel()
        self.numel = start
        self.device = params[0].device
        self.buffers: dict[str, Tensor] = {}

    def new(self, name: str) -> Tensor:
        """A zeroed flat buffer registered under ``name``."""
        self.buffers[name] = self.zeros()
        return self.buffers[name]

    def zeros(self) -> Tensor:
        """A zeroed flat fp32 buffer of the parameters' size, not registered (scratch)."""
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def views(self, name: str) -> list[Tensor]:
        """Per-parameter views (shaped like the parameters) of buffer ``name``."""
        return self.split(self.buffers[name])

    def split(self, flat: Tensor, indices: Iterable[int] | None = None) -> list[Tensor] | dict[int, Tensor]:
        """Per-parameter views (shaped like the parameters) of a flat buffer laid out like them; of
        parameters ``indices`` only, by index (None: a list of all)."""
        if indices is not None:
            return {i: flat[self.offsets[i][0] : self.offsets[i][1]].view(self.params[i].shape) for i in indices}
        return [flat[lo:hi].view(p.shape) for p, (lo, hi) in zip(self.params, self.offsets)]

    def rows(self) -> list[tuple[int, int]]:
        """The flat ranges of every parameter's slices along its first dimension (an embedding's
        rows, a ``Linear`` weight's output rows, a convolution's filters): each in logical order
        is contiguous here. A parameter of fewer than 2 dimensions is one range."""
        out = []
        for p, (lo, hi) in zip(self.params, self.offsets):
            n = p.shape[0] if p.dim() >= 2 and p.numel() else 1
            size = (hi - lo) // n
            out.extend((lo + k * size, lo + (k + 1) * size) for k in range(n))
        return out

    def rename(self, old: str, new: str) -> None:
        """Register buffer ``old`` under the name ``new`` (its values unchanged)."""
        self.buffers[new] = self.buffers.pop(old)

    def gather_grads(self, out: Tensor, indices: Iterable[int] | None = None, base: int = 0) -> None:
        """Copy every gradient (cast to fp32) into ``out``, zeros where a grad is None; or only
        those of parameters ``indices``, into ``out`` starting at flat offset ``base``."""
        for i in range(len(self.params)) if indices is None else indices:
            p, (lo, hi) = self.params[i], self.offsets[i]
            if p.grad is None:
                out[lo - base : hi - base].zero_()
            else:
                out[lo - base : hi - base].copy_(p.grad.reshape(-1))


def starts_inside(offsets: Iterable[tuple[int, int]], start: int, end: int) -> list[int]:
    """Where the parameters (or rows, :meth:`FlatState.rows`) at ``offsets`` that start inside
    ``(start, end)`` start, relative to ``start``: the segments of a collective over the flat
    values ``[start, end)`` that gives each parameter's (row's) piece a scale of its own."""
    return [lo - start for lo, _ in offsets if start < lo < end]
