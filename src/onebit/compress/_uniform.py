"""QAdam's uniform quantizer (Comp-AMS appendix, Algorithm 4): ``Q_b(x) = ||x||_inf Q~_b(x / ||x||_inf)``."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import max_abs, pack_codes, pack_signs, packed_numel, unpack_codes, unpack_signs
from ._base import Compressor, Payload, sub_signed_scale_

__all__ = ["UniformCompressor"]


class UniformCompressor(Compressor):
    """Round ``x / ||x||_inf`` to the nearest of ``2^b - 1`` evenly spaced levels in ``[-1, 1]``
    (``M_b`` of the paper, spacing ``1 / (2^(b-1) - 1)``) and scale back by ``||x||_inf``.

    ``bits=1`` has no zero level (``M_1`` would be empty): it is ``||x||_inf * sign(x)``,
    the paper's 1-bit QAdam. Wire: ``b`` bits per value, packed, plus one fp32 scale.
    """

    name = "uniform"
    alignment = 8
    kernels = True

    def __init__(self, bits: int = 1) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise TypeError(f"bits must be an int, got {bits!r}")
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in [1, 8], got {bits}")
        self.bits = bits

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((torch.uint8, packed_numel(numel * self.bits)), (torch.float32, 1))

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        scale = max_abs(x).reshape(1) if x.numel() else x.new_zeros(1)
        if self.bits == 1:
            return pack_signs(x), scale
        return pack_codes(x, scale, self.bits), scale

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        """As :meth:`Compressor.compress_ef`; with ``bits=1`` in place (``c - copysign(scale, c)``),
        with no decompressed copy of the chunk."""
        if self.bits > 1:
            return super().compress_ef(x, error, workspace)
        self._add_input(x, error)
        packed, scale = self._compress(error)
        sub_signed_scale_(error, scale)
        return Payload((packed, scale), error.numel())

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        packed, scale = tensors
        if self.bits == 1:
            return unpack_signs(packed, numel, scale, out=out)
        return unpack_codes(packed, numel, self.bits, scale, out)

    def __repr__(self) -> str:
        return f"UniformCompressor(bits={self.bits})"
