"""1-bit Adam's compressor: signs plus one scale ``||x||_2 / sqrt(n)`` per chunk (section 4.3)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..ops import average_signs, ef_sign_compress_, l2_norm, pack_signs, packed_numel, unpack_signs
from ._base import Compressor, Payload

__all__ = ["SignCompressor"]


class SignCompressor(Compressor):
    """``C(x) = (||x||_2 / sqrt(n)) * sign(x)``: the compressed chunk has the same l2 norm as ``x``.

    Wire: ``ceil(n/8)`` bytes of packed signs and one fp32 scale. Zero maps to ``+scale``
    (the IEEE sign bit decides, so ``-0.0`` maps to ``-scale``).
    """

    name = "sign"
    alignment = 8
    kernels = True

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((torch.uint8, packed_numel(numel)), (torch.float32, 1))

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        n = x.numel()
        scale = l2_norm(x).mul_(1.0 / math.sqrt(n)) if n else x.new_zeros(())
        return pack_signs(x), scale.reshape(1)

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        packed, scale = tensors
        return unpack_signs(packed, numel, scale, out=out)

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        packed, scale = ef_sign_compress_(error, x, workspace=workspace)
        return Payload((packed, scale), error.numel())

    def average(self, payloads: list[Payload], out: Tensor, *, accumulate: bool = False) -> Tensor:
        packed = [p.tensors[0] for p in payloads]
        scales = [p.tensors[1] for p in payloads]
        return average_signs(packed, scales, payloads[0].numel, out, accumulate=accumulate)
