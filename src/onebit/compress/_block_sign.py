"""Comp-AMS Block-Sign (Definition 2): ``sign(x_B) * ||x_B||_1 / d_B`` for each block ``B``."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops import l1_norm, pack_signs, packed_numel, unpack_signs
from ._base import Compressor

__all__ = ["BlockSignCompressor"]


class BlockSignCompressor(Compressor):
    """Block-Sign with blocks of ``block_size`` consecutive values (the last may be shorter).

    ``block_size=None`` makes the whole chunk one block. Wire: packed signs and one fp32
    scale per block. Zero maps to ``+scale`` (sign bit decides, as for ``sign``).
    """

    name = "block_sign"

    def __init__(self, block_size: int | None = None) -> None:
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
            raise TypeError(f"block_size must be an int or None, got {block_size!r}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        # Chunks whose length is a multiple of both 8 and the block size never split a byte or a block.
        self.alignment = 8 if block_size is None else 8 * block_size // math.gcd(8, block_size)

    def _num_blocks(self, numel: int) -> int:
        if numel == 0:
            return 0
        return 1 if self.block_size is None else -(-numel // self.block_size)

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((torch.uint8, packed_numel(numel)), (torch.float32, self._num_blocks(numel)))

    def _block_lengths(self, numel: int, device: torch.device) -> Tensor:
        nb = self._num_blocks(numel)
        size = numel if self.block_size is None else self.block_size
        lengths = torch.full((nb,), float(size), device=device)
        if nb:
            lengths[-1] = numel - (nb - 1) * size
        return lengths

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        n = x.numel()
        nb = self._num_blocks(n)
        if nb == 0:
            return pack_signs(x), x.new_zeros(0)
        size = n if self.block_size is None else self.block_size
        full = n // size
        sums = x.new_empty(nb)
        if full == 1:
            sums[0] = l1_norm(x[:size])
        elif full:
            torch.linalg.vector_norm(x[: full * size].view(full, size), ord=1, dim=1, out=sums[:full])
        if n % size:
            sums[full] = l1_norm(x[full * size :])
        return pack_signs(x), sums / self._block_lengths(n, x.device)

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        packed, scales = tensors
        unpack_signs(packed, numel, 1.0, out=out)
        if numel == 0:
            return out
        size = numel if self.block_size is None else self.block_size
        full = numel // size
        if full:
            out[: full * size].view(full, size).mul_(scales[:full].unsqueeze(1))
        if numel % size:
            out[full * size :].mul_(scales[full])
        return out

    def __repr__(self) -> str:
        return f"BlockSignCompressor(block_size={self.block_size})"
