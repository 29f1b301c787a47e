"""Fused GPU kernels (Triton), one pass over memory each; used for CUDA tensors when Triton is installed.

Same wire layout and the same floating-point operations, in the same order, as the torch
reference (and the numba CPU kernels), so results are bit-identical to it:

* ``pack_signs``: bit ``k`` of byte ``i`` is set when the IEEE sign bit of value ``8i+k`` is clear.
* ``pack_signs_update``: the same bytes, and ``c -= copysign(scale, c)`` (1-bit Adam's new error).
* ``unpack_signs``: byte bits to ``+-scale`` (exact: a sign flip, no arithmetic).
* ``average_signs``: ``((+-s_0) + (+-s_1) + ...) * (1/w)`` summed in rank order, optionally
  added to ``out``.
* ``clamp_scaled``: ``x <- clamp(x, -b * s, b * s)`` (1-bit Adam's update bound), NaN kept.

Kernels are compiled with ``enable_fp_fusion=False`` so that ``out + acc * inv`` is never
contracted to an FMA the reference does not perform. Scales are read from device memory (no
host synchronisation): one per payload, or one per block of a payload, looked up through the
block of each packed byte. With ``TRITON_INTERPRET=1``
Triton runs these kernels on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
from torch import Tensor

__all__ = ["available", "average_signs", "clamp_scaled", "pack_signs", "pack_signs_update", "unpack_signs"]

_BLOCK_BYTES = 512  # 4096 values per program


def available(t: Tensor) -> bool:
    """True when ``t`` lives where these kernels run (a CUDA device, with Triton installed)."""
    return t.device.type == "cuda" and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels() -> ModuleType:
    """The kernel module, imported (and Triton with it) when a CUDA tensor or a test first needs it."""
    return importlib.import_module("._triton_kernels", __package__)


def _grid(nbytes: int) -> tuple[int]:
    return (max(1, -(-nbytes // _BLOCK_BYTES)),)


def pack_signs(c: Tensor, packed: Tensor) -> None:
    """``packed`` (uint8, ``ceil(n/8)``) := the sign bits of the contiguous fp32 ``c``."""
    _kernels().pack_kernel[_grid(packed.numel())](c, c, packed, packed, c.numel(), packed.numel(), UPDATE=False,
                                                  BLOCKED=False, BLOCK=_BLOCK_BYTES)


def pack_signs_update(c: Tensor, scales: Tensor, packed: Tensor, blocks: Tensor | None = None) -> None:
    """Pack the signs of ``c`` and set ``c -= copysign(scale, c)``: ``scales`` is one fp32 scale,
    or one per block with ``blocks`` (int32, the block of each packed byte)."""
    _kernels().pack_kernel[_grid(packed.numel())](c, scales, scales if blocks is None else blocks, packed, c.numel(),
                                                  packed.numel(), UPDATE=True, BLOCKED=blocks is not None,
                                                  BLOCK=_BLOCK_BYTES, enable_fp_fusion=False)


def unpack_signs(packed: Tensor, numel: int, scales: Tensor, out: Tensor, blocks: Tensor | None = None) -> None:
    """``out[:numel]`` (fp32) := ``+scale`` where the bit is set, ``-scale`` elsewhere (per block
    with ``blocks``, as :func:`pack_signs_update`)."""
    _kernels().unpack_kernel[_grid(-(-numel // 8))](packed, scales, scales if blocks is None else blocks, out, numel,
                                                    BLOCKED=blocks is not None, BLOCK=_BLOCK_BYTES)


def average_signs(rows: Tensor, scales: Tensor, numel: int, out: Tensor, accumulate: bool,
                  blocks: Tensor | None = None) -> None:
    """``out (+)= (sum_r +-scales[r]) * (1/w)`` over the ``(w, stride)`` uint8 ``rows``, in row order;
    ``scales`` is ``(w,)``, or ``(w, blocks)`` with ``blocks`` (as :func:`pack_signs_update`)."""
    world = rows.shape[0]
    inv = float(torch.tensor(1.0 / world, dtype=torch.float32))
    # The world size is a compile-time constant: one kernel per job's world, its loop unrolled.
    _kernels().average_kernel[_grid(-(-numel // 8))](rows, rows.stride(0), scales,
                                                     scales if blocks is None else blocks,
                                                     scales.shape[-1] if blocks is not None else 1, out, numel, inv,
                                                     WORLD=world, ACCUMULATE=accumulate, BLOCKED=blocks is not None,
                                                     BLOCK=_BLOCK_BYTES, enable_fp_fusion=False)


def clamp_scaled(x: Tensor, bound: Tensor, scale: float) -> None:
    """``x <- clamp(x, -bound * scale, bound * scale)`` in place, flat fp32, the product in fp32."""
    numel = x.numel()
    _kernels().clamp_scaled_kernel[(max(1, -(-numel // (8 * _BLOCK_BYTES))),)](x, bound, numel, scale,
                                                                             BLOCK=8 * _BLOCK_BYTES)
