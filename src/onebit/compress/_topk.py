"""Comp-AMS Top-k (Definition 1): keep the ``k`` largest magnitudes, zero the rest."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops import topk_indices
from ._base import Compressor, Payload

__all__ = ["TopKCompressor"]


class TopKCompressor(Compressor):
    """Top-k with ``k = ceil(ratio * n)`` (at least one value of a non-empty chunk).

    Wire: ``k`` fp32 values then their ``k`` int32 indices, ascending. Among equal magnitudes
    the lowest indices are kept (:func:`onebit.ops.topk_indices`).
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"ratio must be a float in (0, 1], got {ratio!r}")
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)

    def k(self, numel: int) -> int:
        """Number of values kept from a chunk of ``numel``."""
        return min(numel, max(1, math.ceil(self.ratio * numel))) if numel else 0

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        k = self.k(numel)
        return ((torch.float32, k), (torch.int32, k))

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        idx = topk_indices(x, self.k(x.numel()))
        return x[idx], idx

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        """As :meth:`Compressor.compress_ef`, in place: ``c - D(C(c))`` is ``c`` with the kept
        values zeroed (each exactly ``c_i - c_i``), so no decompressed copy is made."""
        self._add_input(x, error)
        values, idx = self._compress(error)
        error[idx] = 0.0
        return Payload((values, idx), error.numel())

    def _sum(self, payloads: list[Payload], out: Tensor) -> None:
        """Each payload's values added at their indices into ``out``, zeroed once (the dense sum
        decompressed each payload into a fresh scratch copy of ``out`` and added it). The same sums
        in the same order (a value absent from a payload added nothing to it), but for the sign of
        a zero that every payload sent as ``-0.0``: ``+0.0`` here."""
        flat = out.view(-1).zero_()
        for payload in payloads:
            values, idx = payload.tensors
            flat.index_add_(0, idx, values)

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        values, idx = tensors
        out.zero_()
        out[idx.long()] = values
        return out

    def __repr__(self) -> str:
        return f"TopKCompressor(ratio={self.ratio})"
