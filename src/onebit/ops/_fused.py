"""Fused error-feedback sign compression (1-bit Adam's C_w[m + delta], Algorithm 1 lines 7 and 10).

One call does "add error, scale, sign, pack, new error" in three passes over memory:
``error += x`` (the compensated value c lives in the error buffer), one norm reduction,
and one pass that packs the signs of c while ``error -= copysign(scale, c)`` leaves
exactly ``c - C(c)`` behind (a numba kernel on CPU; torch ops elsewhere, same results).
:func:`average_signs` is the chunk owner's "unpack, average" in one pass.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from collections.abc import Sequence

import numpy as np

from . import _bits, _cpu
from ._bits import pack_signs, packed_numel, unpack_signs
from ._norms import l2_norm

__all__ = ["average_signs", "ef_sign_compress_"]


def _numba_ok(t: Tensor) -> bool:
    return _cpu.pack_signs_update is not None and not _bits._FORCE_REFERENCE and t.device.type == "cpu"


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
    if _numba_ok(c):
        packed = packed_out if packed_out is not None else torch.empty(packed_numel(n), dtype=torch.uint8)
        _cpu.pack_signs_update(c.numpy(), np.float32(scale.item()), packed.numpy())
        return packed, scale
    packed = pack_signs(c, out=packed_out)
    if workspace is None:
        workspace = torch.empty_like(c)
    torch.copysign(scale, c, out=workspace)
    c.sub_(workspace)
    return packed, scale


def average_signs(
    packed: Sequence[Tensor], scales: Sequence[Tensor], numel: int, out: Tensor, *, accumulate: bool = False
) -> Tensor:
    """``(sum_r +-scales[r]) / len(packed)``, decoding each rank's packed signs, summed in order;
    written to ``out``, or added to it with ``accumulate``."""
    if numel and _numba_ok(out):
        rows = np.stack([p.numpy()[: packed_numel(numel)] for p in packed])
        values = np.array([float(s.reshape(-1)[0]) for s in scales], dtype=np.float32)
        _cpu.average_signs(rows, values, numel, out.numpy(), accumulate)
        return out
    target = torch.empty_like(out) if accumulate else out
    unpack_signs(packed[0], numel, scales[0], out=target)
    for p, s in zip(packed[1:], scales[1:]):
        target.add_(unpack_signs(p, numel, s))
    target.div_(len(packed))
    return out.add_(target) if accumulate else out
