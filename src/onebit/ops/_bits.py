"""Bit packing of signs, 8 values per byte.

Layout (the wire format of every 1-bit compressor): value ``8*i + k`` is bit ``k`` of
byte ``i`` (little bit order); bit 1 means the IEEE sign bit is clear (``x >= +0.0``),
bit 0 means it is set (negative values and ``-0.0``). Using the sign bit rather than
``x >= 0`` makes packing agree with ``torch.copysign``, which the fused error-feedback
kernel uses to form the dequantized value.

Three implementations produce the same bytes: a pure-torch reference that runs on any
device, a CPU fast path on numpy's vectorised ``packbits``/``unpackbits`` (5-10x faster
than the reference) with a one-pass numba kernel decoding signs (:mod:`._cpu`), and
one-pass Triton kernels for CUDA tensors (:mod:`._triton`).
``reference_kernels()`` forces the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from . import _cpu, _triton
from ._blocks import Blocks

__all__ = [
    "pack_codes",
    "unpack_codes",
    "packed_numel",
    "pack_bits",
    "unpack_bits",
    "pack_signs",
    "unpack_signs",
    "reference_kernels",
]

_BIT_WEIGHTS: dict[torch.device, Tensor] = {}
_SIGN_TABLES: dict[torch.device, Tensor] = {}
_FORCE_REFERENCE = False


def packed_numel(numel: int) -> int:
    """Bytes needed to hold ``numel`` bits."""
    return (numel + 7) // 8


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Use the pure-torch reference kernels inside the block (tests, benchmarks)."""
    global _FORCE_REFERENCE
    previous, _FORCE_REFERENCE = _FORCE_REFERENCE, True
    try:
        yield
    finally:
        _FORCE_REFERENCE = previous


def _fast_cpu(t: Tensor) -> bool:
    return not _FORCE_REFERENCE and t.device.type == "cpu"


def _numba_ok(*tensors: Tensor) -> bool:
    """The numba kernels of :mod:`._cpu` apply: numba is installed, the reference is not forced,
    and every tensor is a contiguous CPU tensor (the kernels index flat arrays)."""
    return _cpu.numba is not None and all(_fast_cpu(t) and t.is_contiguous() for t in tensors)


def _fast_gpu(t: Tensor) -> bool:
    return not _FORCE_REFERENCE and _triton.available(t)


def _weights(device: torch.device) -> Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS[device] = w
    return w


def _check_out(out: Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.dtype != dtype or out.numel() != numel or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {numel} elements on {device}, "
            f"got {out.dtype} of {out.numel()} elements on {out.device}"
        )
    return out


def pack_bits(bits: Tensor, out: Tensor | None = None) -> Tensor:
    """Pack a 1-D bool tensor into ``ceil(n/8)`` uint8 (little bit order, zero padded)."""
    if bits.dtype != torch.bool:
        raise TypeError(f"bits must be a bool tensor, got dtype={bits.dtype}")
    bits = bits.reshape(-1)
    n = bits.numel()
    nbytes = packed_numel(n)
    out = _check_out(out, nbytes, torch.uint8, bits.device)
    if n == 0:
        return out
    if _fast_cpu(bits):
        out.numpy()[:] = np.packbits(bits.numpy(), bitorder="little")
        return out
    pad = nbytes * 8 - n
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    torch.sum(bits.view(nbytes, 8).to(torch.uint8) * _weights(bits.device), dim=1, dtype=torch.uint8, out=out)
    return out


def unpack_bits(packed: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a bool tensor."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got dtype={packed.dtype}")
    if numel < 0 or packed_numel(numel) > packed.numel():
        raise ValueError(f"numel={numel} does not fit in {packed.numel()} packed bytes")
    packed = packed.reshape(-1)
    if numel == 0:
        return torch.empty(0, dtype=torch.bool, device=packed.device)
    if _fast_cpu(packed):
        bits = np.unpackbits(packed.numpy(), count=numel, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    nbytes = packed_numel(numel)
    expanded = packed[:nbytes].unsqueeze(1).bitwise_and(_weights(packed.device)).ne(0)
    return expanded.reshape(-1)[:numel]


def _sign_bits_clear(x: Tensor) -> Tensor:
    """Bool tensor: True where the IEEE sign bit of ``x`` is clear."""
    if _fast_cpu(x):
        return torch.from_numpy(np.signbit(x.numpy())).logical_not_()
    return torch.signbit(x).logical_not_()


def pack_signs(x: Tensor, out: Tensor | None = None) -> Tensor:
    """Pack the signs of a float tensor (bit 1 = sign bit clear) into uint8."""
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype={x.dtype}")
    x = x.reshape(-1)
    if _fast_cpu(x) and x.dtype in (torch.float32, torch.float64) and x.numel():
        nbytes = packed_numel(x.numel())
        out = _check_out(out, nbytes, torch.uint8, x.device)
        # Pack the *set* sign bits and invert the bytes: one vectorised pass instead of two.
        packed = np.packbits(np.signbit(x.numpy()), bitorder="little")
        np.invert(packed, out=out.numpy())
        tail = x.numel() % 8
        if tail:
            out[-1] &= (1 << tail) - 1
        return out
    if _fast_gpu(x) and x.numel():
        out = _check_out(out, packed_numel(x.numel()), torch.uint8, x.device)
        _triton.pack_signs(x.float().contiguous(), out)  # a widening cast keeps every sign bit
        return out
    return pack_bits(_sign_bits_clear(x.float() if x.dtype not in (torch.float32, torch.float64) else x), out=out)


def _sign_table(device: torch.device) -> Tensor:
    """``(256, 8)`` fp32: row ``b`` holds the eight +-1 values that byte ``b`` encodes."""
    table = _SIGN_TABLES.get(device)
    if table is None:
        byte = torch.arange(256, device=device).unsqueeze(1)
        table = (byte.bitwise_and(_weights(device).long()).ne(0).float() * 2 - 1).contiguous()
        _SIGN_TABLES[device] = table
    return table


def unpack_signs(packed: Tensor, numel: int, scale: float | Tensor = 1.0, out: Tensor | None = None, *,
                 blocks: Blocks | None = None) -> Tensor:
    """Decode :func:`pack_signs` output to ``+scale``/``-scale`` float32 values.

    ``scale`` may be a Python float or a 0-d/1-element tensor (kept on device: no sync on
    CUDA), or with ``blocks`` a tensor of one scale per block. On CPU a numba kernel writes
    ``+-scale`` in one pass (without numba: a lookup in a 256x8 table pre-multiplied by
    ``scale``); the reference expands bits and computes ``(2 b - 1) * scale``. All give the
    same bits.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got dtype={packed.dtype}")
    if numel < 0 or packed_numel(numel) > packed.numel():
        raise ValueError(f"numel={numel} does not fit in {packed.numel()} packed bytes")
    if blocks is not None:
        blocks.check(numel)
    packed = packed.reshape(-1)
    out = _check_out(out, numel, torch.float32, packed.device)
    if numel == 0:
        return out
    if not isinstance(scale, Tensor):
        scale = torch.tensor(float(scale), dtype=torch.float32, device=packed.device)
    scale = scale.reshape(() if blocks is None else -1).to(torch.float32)
    if _fast_gpu(packed):
        _triton.unpack_signs(packed, numel, scale, out, None if blocks is None else blocks.byte_blocks(out.device))
        return out
    if _numba_ok(packed, out):
        ends = np.array([numel], dtype=np.int64) if blocks is None else blocks.ends
        _cpu.unpack_signs(packed.numpy(), scale.reshape(-1).numpy(), ends, out.numpy())
        return out
    if _FORCE_REFERENCE or blocks is not None:
        bits = unpack_bits(packed, numel)
        torch.mul(bits.to(torch.float32), 2.0, out=out)
        return out.sub_(1.0).mul_(scale if blocks is None else blocks.per_value(scale))
    table = _sign_table(packed.device) * scale
    full = numel // 8
    if full:
        torch.index_select(table, 0, packed[:full].to(torch.int32), out=out[: full * 8].view(full, 8))
    if numel > full * 8:
        out[full * 8 :] = table[packed[full].long(), : numel - full * 8]
    return out


def pack_codes(x: Tensor, scale: Tensor, bits: int) -> Tensor:
    """QAdam's ``b``-bit codes of flat fp32 ``x``: ``round(x / scale * L) + L`` (half to even;
    ``L = 2^(b-1) - 1``; ``scale`` a 1-element tensor, 1 used where it is 0), ``bits`` bits per
    value, value ``i``'s bit ``k`` at bit ``i * bits + k`` of the stream (:func:`pack_bits`' order).
    Returns ``ceil(n * bits / 8)`` bytes. On CPU one numba pass; the reference expands the
    codes into a bool tensor of ``n * bits`` values."""
    levels = (1 << (bits - 1)) - 1
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    if _numba_ok(x):
        packed = torch.empty(packed_numel(x.numel() * bits), dtype=torch.uint8)
        _cpu.pack_codes(x.view(-1).numpy(), np.float32(safe.item()), levels, bits, packed.numpy())
        return packed
    codes = torch.round(x / safe * levels).add_(levels).to(torch.uint8)
    shifts = torch.arange(bits, dtype=torch.uint8, device=x.device)
    return pack_bits(codes.reshape(-1).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).bool().reshape(-1))


def unpack_codes(packed: Tensor, numel: int, bits: int, scale: Tensor, out: Tensor) -> Tensor:
    """The values ``((code - L) / L) * scale`` of :func:`pack_codes`' ``numel`` codes, into flat fp32 ``out``."""
    levels = (1 << (bits - 1)) - 1
    if _numba_ok(packed, out):
        _cpu.unpack_codes(packed.numpy(), levels, bits, np.float32(scale.reshape(-1)[0].item()), out.numpy())
        return out
    stream = unpack_bits(packed, numel * bits).view(numel, bits).to(torch.int32)
    weights = torch.tensor([1 << k for k in range(bits)], dtype=torch.int32, device=packed.device)
    return out.copy_((stream * weights).sum(1)).sub_(levels).div_(levels).mul_(scale)
