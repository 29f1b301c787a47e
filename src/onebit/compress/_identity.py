"""No compression: the values in a chosen wire dtype (the fp32/fp16/bf16 baselines)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._base import Compressor

__all__ = ["IdentityCompressor"]

_WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class IdentityCompressor(Compressor):
    """Sends the values cast to ``dtype`` ("fp32", "fp16" or "bf16"); exact for fp32."""

    name = "identity"

    def __init__(self, dtype: str | torch.dtype = "fp32") -> None:
        if isinstance(dtype, str):
            if dtype not in _WIRE_DTYPES:
                raise ValueError(f"dtype must be one of {sorted(_WIRE_DTYPES)}, got {dtype!r}")
            dtype = _WIRE_DTYPES[dtype]
        if dtype not in _WIRE_DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_WIRE_DTYPES)}, got {dtype!r}")
        self.dtype = dtype

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((self.dtype, numel),)

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        return (x.to(self.dtype, copy=True),)

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        return out.copy_(tensors[0])

    def __repr__(self) -> str:
        return f"IdentityCompressor(dtype={self.dtype})"
