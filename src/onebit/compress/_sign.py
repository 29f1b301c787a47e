"""1-bit Adam's compressor: signs plus one scale ``||x||_2 / sqrt(n)`` per chunk (section 4.3),
or per block of the chunk (the pieces of each tensor, as DeepSpeed's per-tensor compression)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..ops import Blocks, average_signs, ef_sign_compress_, l2_norm, pack_signs, packed_numel, unpack_signs
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
        self._blocks = None if block_sizes is None else Blocks(block_sizes)  # validates them
        self.block_sizes = None if block_sizes is None else self._blocks.sizes

    def with_blocks(self, block_sizes: Sequence[int]) -> SignCompressor:
        """This compressor with one scale per block of ``block_sizes`` (see the class docstring)."""
        return SignCompressor(block_sizes if len(block_sizes) > 1 else None)

    def _check(self, numel: int) -> None:
        if self._blocks is not None:
            self._blocks.check(numel)

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        self._check(numel)
        return ((torch.uint8, packed_numel(numel)), (torch.float32, 1 if self._blocks is None else len(self._blocks)))

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        if self._blocks is None:
            scales = l2_norm(x).mul_(1.0 / math.sqrt(x.numel())) if x.numel() else x.new_zeros(())
        else:
            scales = self._blocks.l2_scales(x.float())
        return pack_signs(x), scales.reshape(-1)

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        packed, scales = tensors
        return unpack_signs(packed, numel, scales, out=out, blocks=self._blocks)

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        self._check(error.numel())
        packed, scales = ef_sign_compress_(error, x, workspace=workspace, blocks=self._blocks)
        return Payload((packed, scales), error.numel())

    def average(self, payloads: list[Payload], out: Tensor, *, accumulate: bool = False) -> Tensor:
        numel = payloads[0].numel
        return average_signs([p.tensors[0] for p in payloads], [p.tensors[1] for p in payloads], numel, out,
                             accumulate=accumulate, blocks=self._blocks)

    def __repr__(self) -> str:
        if self.block_sizes is None:
            return "SignCompressor()"
        return f"SignCompressor(block_sizes=<{len(self.block_sizes)} blocks>)"
