"""Comp-AMS Block-Sign (Definition 2): ``sign(x_B) * ||x_B||_1 / d_B`` for each block ``B``."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops import block_l1_norms, l1_norm, pack_signs, packed_numel, unpack_signs
from ._base import _PIECE, Compressor, Payload, sub_signed_scale_

__all__ = ["BlockSignCompressor"]


class BlockSignCompressor(Compressor):
    """Block-Sign with blocks of ``block_size`` consecutive values (the last may be shorter),
    or with explicit ``block_sizes`` (e.g. one block per layer of a fused gradient, the
    paper's choice), which must then add up to the chunk's length.

    Neither given: the whole chunk is one block. Wire: packed signs and one fp32 scale per
    block. Zero maps to ``+scale`` (sign bit decides, as for ``sign``).
    """

    name = "block_sign"
    kernels = True

    def __init__(self, block_size: int | None = None, block_sizes: list[int] | tuple[int, ...] | None = None) -> None:
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
            raise TypeError(f"block_size must be an int or None, got {block_size!r}")
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if block_sizes is not None:
            if block_size is not None:
                raise ValueError("give block_size or block_sizes, not both")
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_sizes):
                raise ValueError(f"block_sizes must be ints >= 1, got {list(block_sizes)!r}")
            block_sizes = tuple(block_sizes)
        self.block_size = block_size
        self.block_sizes = block_sizes
        # Chunks whose length is a multiple of both 8 and the block size never split a byte or a block.
        self.alignment = 8 if block_size is None else 8 * block_size // math.gcd(8, block_size)

    def _lengths(self, numel: int) -> list[int]:
        if numel == 0:
            return []
        if self.block_sizes is not None:
            if sum(self.block_sizes) != numel:
                raise ValueError(f"block_sizes add up to {sum(self.block_sizes)}, the chunk has {numel} values")
            return list(self.block_sizes)
        size = numel if self.block_size is None else self.block_size
        full, rest = divmod(numel, size)
        return [size] * full + ([rest] if rest else [])

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((torch.uint8, packed_numel(numel)), (torch.float32, len(self._lengths(numel))))

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        lengths = self._lengths(x.numel())
        if not lengths:
            return pack_signs(x), x.new_zeros(0)
        size, full = lengths[0], x.numel() // lengths[0]
        if len(lengths) == 1:
            return pack_signs(x), (l1_norm(x) / size).reshape(1)
        if self.block_sizes is not None:
            sums = torch.stack([l1_norm(part) for part in torch.split(x, lengths)])
            return pack_signs(x), sums / torch.tensor(lengths, dtype=torch.float32, device=x.device)
        # Every block's sum is l1_norm's, as when each was taken alone: a run of the blocks cut
        # at block boundaries (a bucket of the overlapped Comp-AMS) gets the same scales.
        means = block_l1_norms(x, size)
        means[:full] /= size
        means[full:] /= lengths[-1]
        return pack_signs(x), means

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        """As :meth:`Compressor.compress_ef`, in place: ``c - D(C(c))`` is ``c - copysign(scale_B, c)``
        in each block ``B``, formed a bounded piece at a time -- no decompressed copy of the chunk."""
        self._add_input(x, error)
        packed, scales = self._compress(error)
        rest, lengths, rest_scales = error, self._lengths(error.numel()), scales
        if self.block_sizes is None and len(lengths) > 1:  # equal blocks (the last maybe shorter): rows
            size, full = lengths[0], error.numel() // lengths[0]
            rows = error[: full * size].view(full, size)
            step = max(1, _PIECE // size)
            for r in range(0, full, step):
                block = rows[r : r + step]
                block.sub_(torch.copysign(scales[r : r + len(block), None], block))
            rest, lengths, rest_scales = error[full * size :], lengths[full:], scales[full:]
        for block, scale in zip(torch.split(rest, lengths), rest_scales):
            sub_signed_scale_(block, scale)
        return Payload((packed, scales), error.numel())

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        packed, scales = tensors
        unpack_signs(packed, numel, 1.0, out=out)
        if self.block_sizes is None:  # equal blocks, the last maybe shorter: a row per block
            size = numel if self.block_size is None else self.block_size
            full = numel // size if numel else 0
            out[: full * size].view(full, size).mul_(scales[:full, None])
            out[full * size :].mul_(scales[full:])
            return out
        return out.mul_(torch.repeat_interleave(scales, torch.tensor(self._lengths(numel), device=out.device)))

    def __repr__(self) -> str:
        if self.block_sizes is not None:
            return f"BlockSignCompressor(block_sizes=<{len(self.block_sizes)} blocks>)"
        return f"BlockSignCompressor(block_size={self.block_size})"
