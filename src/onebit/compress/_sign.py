"""1-bit Adam's compressor: signs plus one scale ``||x||_2 / sqrt(n)`` per chunk (section 4.3),
or per block of the chunk (the pieces of each tensor, as DeepSpeed's per-tensor compression)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..ops import average_signs, ef_sign_compress_, l2_norm, pack_signs, packed_numel, unpack_signs
from ._base import Compressor, Payload

__all__ = ["SignCompressor"]


class SignCompressor(Compressor):
    """``C(x) = (||x||_2 / sqrt(n)) * sign(x)``: the compressed chunk has the same l2 norm as ``x``.

    With ``block_sizes`` (lengths adding up to the chunk's, each a multiple of 8 but the
    last), every block has its own scale ``||x_B||_2 / sqrt(n_B)`` and keeps its own l2 norm:
    a collective cutting a fused buffer at its tensors' starts gives each tensor the scale of
    its own values (:meth:`with_blocks`), where one scale per chunk would give a layer of
    small values the magnitude of its larger neighbours.

    Wire: ``ceil(n/8)`` bytes of packed signs and one fp32 scale per block (one without
    ``block_sizes``). Zero maps to ``+scale`` (the IEEE sign bit decides, so ``-0.0`` maps to
    ``-scale``).

    Args:
        block_sizes: the blocks' lengths (``None``: the chunk is one block).

    Examples:
        >>> sign = onebit.compress.SignCompressor(block_sizes=[8, 2])
        >>> x = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 0.03, -0.04])
        >>> sign.decompress(sign.compress(x))
        tensor([ 1.0000, -1.0000,  1.0000, -1.0000,  1.0000, -1.0000,  1.0000, -1.0000,
                 0.0354, -0.0354])
    """

    name = "sign"
    alignment = 8
    kernels = True
    blockwise = True

    def __init__(self, block_sizes: Sequence[int] | None = None) -> None:
        if block_sizes is not None:
            block_sizes = tuple(block_sizes)
            if not block_sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                          for b in block_sizes):
                raise ValueError(f"block_sizes must be ints >= 1, got {list(block_sizes)!r}")
            if any(b % 8 for b in block_sizes[:-1]):
                raise ValueError(f"block_sizes must be multiples of 8 but the last, got {list(block_sizes)!r}")
        self.block_sizes = block_sizes
        ends = list(itertools.accumulate(block_sizes or ()))
        self._block_bounds = list(zip([0, *ends[:-1]], ends))

    def with_blocks(self, block_sizes: Sequence[int]) -> SignCompressor:
        """This compressor with one scale per block of ``block_sizes`` (see the class docstring)."""
        return SignCompressor(block_sizes if len(block_sizes) > 1 else None)

    def _blocks(self, numel: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each block of a chunk of ``numel`` values."""
        if self.block_sizes is None:
            return [(0, numel)]
        if self._block_bounds[-1][1] != numel:
            raise ValueError(f"block_sizes add up to {self._block_bounds[-1][1]}, the chunk has {numel} values")
        return self._block_bounds

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((torch.uint8, packed_numel(numel)), (torch.float32, len(self._blocks(numel))))

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        scales = [l2_norm(x[a:b]).mul_(1.0 / math.sqrt(b - a)) if b > a else x.new_zeros(())
                  for a, b in self._blocks(x.numel())]
        return pack_signs(x), torch.stack(scales).reshape(-1)

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        packed, scales = tensors
        if self.block_sizes is None:
            return unpack_signs(packed, numel, scales, out=out)
        for k, (a, b) in enumerate(self._blocks(numel)):
            unpack_signs(packed[a // 8 : packed_numel(b)], b - a, scales[k : k + 1], out=out[a:b])
        return out

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        if self.block_sizes is None:
            packed, scale = ef_sign_compress_(error, x, workspace=workspace)
            return Payload((packed, scale), error.numel())
        self._add_input(x, error)
        packed = torch.empty(packed_numel(error.numel()), dtype=torch.uint8, device=error.device)
        scales = torch.empty(len(self.block_sizes), dtype=torch.float32, device=error.device)
        for k, (a, b) in enumerate(self._blocks(error.numel())):
            scales[k : k + 1] = ef_sign_compress_(error[a:b], None, packed_out=packed[a // 8 : packed_numel(b)])[1]
        return Payload((packed, scales), error.numel())

    def average(self, payloads: list[Payload], out: Tensor, *, accumulate: bool = False) -> Tensor:
        numel = payloads[0].numel
        for k, (a, b) in enumerate(self._blocks(numel)):
            average_signs([p.tensors[0][a // 8 : packed_numel(b)] for p in payloads],
                          [p.tensors[1][k : k + 1] for p in payloads], b - a, out[a:b], accumulate=accumulate)
        return out

    def __repr__(self) -> str:
        if self.block_sizes is None:
            return "SignCompressor()"
        return f"SignCompressor(block_sizes=<{len(self.block_sizes)} blocks>)"
