"""Fused error-feedback sign compression (1-bit Adam's C_w[m + delta], Algorithm 1 lines 7 and 10).

One call does "add error, scale, sign, pack, new error" in three passes over memory:
``error += x`` (the compensated value c lives in the error buffer), one norm reduction,
and one pass that packs the signs of c while ``error -= copysign(scale, c)`` leaves
exactly ``c - C(c)`` behind.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._bits import pack_signs
from ._norms import l2_norm

__all__ = ["ef_sign_compress_"]


def ef_sign_compress_(
    error: Tensor,
    x: Tensor | None,
    *,
    workspace: Tensor | None = None,
    packed_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Compress ``c = x + error`` to signs and ``scale = ||c||_2 / sqrt(n)``; set ``error = c - C(c)``.

    ``error`` is a contiguous fp32 buffer updated in place; ``x`` may be ``None`` when the
    caller already added it. ``workspace`` (fp32, same size) avoids an allocation per call.
    Returns ``(packed_signs, scale)`` with ``scale`` a 1-element fp32 tensor on ``error``'s device.
    """
    if error.dtype != torch.float32 or not error.is_contiguous():
        raise ValueError(f"error must be a contiguous float32 buffer, got {error.dtype}")
    if x is not None:
        error.add_(x.reshape(-1))
    c = error.reshape(-1)
    n = c.numel()
    if n == 0:
        return pack_signs(c, out=packed_out), torch.zeros(1, dtype=torch.float32, device=c.device)
    scale = l2_norm(c).mul_(1.0 / math.sqrt(n)).reshape(1)
    packed = pack_signs(c, out=packed_out)
    if workspace is None:
        workspace = torch.empty_like(c)
    torch.copysign(scale, c, out=workspace)
    c.sub_(workspace)
    return packed, scale
