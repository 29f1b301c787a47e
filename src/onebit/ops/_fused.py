"""Fused error-feedback sign compression (1-bit Adam's C_w[m + delta], Algorithm 1 lines 7 and 10).

One call does "add error, scale, sign, pack, new error" in three passes over memory:
``error += x`` (the compensated value c lives in the error buffer), one norm reduction
(torch's, on every device, so the scale is the reference's to the bit), and one pass that
packs the signs of c while ``error -= copysign(scale, c)`` leaves exactly ``c - C(c)``
behind. :func:`average_signs` is the chunk owner's "unpack, average, add server error" in
one pass; the server's re-compression is then ``ef_sign_compress_`` on that buffer.
Kernels: numba on CPU (:mod:`._cpu`), Triton on CUDA (:mod:`._triton`), the pure-torch
reference elsewhere or inside :func:`reference_kernels`; all give the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from . import _bits, _cpu, _triton
from ._blocks import Blocks
from ._bits import _numba_ok, pack_bits, pack_codes, pack_signs, packed_numel, unpack_codes, unpack_signs
from ._elementwise import clamp_scaled_, max_ratio, soft_sign_, zero_where_equal_
from ._norms import l2_norm
from ._select import topk_indices

__all__ = ["average_signs", "ef_sign_compress_", "splitmix_uniform", "stochastic_sign_compress_", "warm_up"]

_WARM: set[str] = set()


def _rows(packed: Sequence[Tensor], nbytes: int) -> Tensor:
    """The ranks' packed bytes as one ``(w, stride)`` tensor: a strided view when they are
    evenly spaced slices of one buffer (the received all-to-all slots), else a copy."""
    first = packed[0]
    step = packed[1].data_ptr() - first.data_ptr() if len(packed) > 1 else nbytes
    storage = first.untyped_storage().data_ptr()
    if step >= nbytes and all(
        p.untyped_storage().data_ptr() == storage and p.data_ptr() - first.data_ptr() == r * step
        for r, p in enumerate(packed)
    ):
        return first.as_strided((len(packed), nbytes), (step, 1))
    return torch.stack([p[:nbytes] for p in packed])


def ef_sign_compress_(
    error: Tensor,
    x: Tensor | None,
    *,
    workspace: Tensor | None = None,
    packed_out: Tensor | None = None,
    blocks: Blocks | None = None,
) -> tuple[Tensor, Tensor]:
    """Compress ``c = x + error`` to signs and ``scale = ||c||_2 / sqrt(n)``; set ``error = c - C(c)``.

    ``error`` is a contiguous fp32 buffer updated in place; ``x`` may be ``None`` when the
    caller already added it. ``workspace`` (fp32, same size) avoids an allocation per call.
    With ``blocks``, every block of ``c`` has its own scale, in the same single pass.
    Returns ``(packed_signs, scales)``: a 1-element fp32 tensor on ``error``'s device, or one
    scale per block.
    """
    if error.dtype != torch.float32 or not error.is_contiguous():
        raise ValueError(f"error must be a contiguous float32 buffer, got {error.dtype}")
    if x is not None:
        error.add_(x.reshape(-1))
    c = error.reshape(-1)
    n = c.numel()
    if n == 0:
        return pack_signs(c, out=packed_out), torch.zeros(1, dtype=torch.float32, device=c.device)
    scales = l2_norm(c).mul_(1.0 / math.sqrt(n)).reshape(1) if blocks is None else blocks.l2_scales(c)
    if _numba_ok(c):
        packed = packed_out if packed_out is not None else torch.empty(packed_numel(n), dtype=torch.uint8)
        _cpu.pack_signs_update(c.numpy(), scales.numpy(), _ends(blocks, n), packed.numpy())
        return packed, scales
    if _bits._fast_gpu(c):
        packed = packed_out if packed_out is not None else torch.empty(packed_numel(n), dtype=torch.uint8,
                                                                       device=c.device)
        # the scales stay on the device: no sync
        _triton.pack_signs_update(c, scales, packed, None if blocks is None else blocks.byte_blocks(c.device))
        return packed, scales
    packed = pack_signs(c, out=packed_out)
    if workspace is None:
        workspace = torch.empty_like(c)
    torch.copysign(scales if blocks is None else blocks.per_value(scales), c, out=workspace)
    c.sub_(workspace)
    return packed, scales


def _ends(blocks: Blocks | None, numel: int) -> np.ndarray:
    """The numba kernels' block ends: the blocks', or one block of ``numel`` values."""
    return np.array([numel], dtype=np.int64) if blocks is None else blocks.ends


# SplitMix64 (Steele, Lea and Flood, 2014; Vigna's reference code): output k of seed s mixes
# the state s + (k + 1) * _GAMMA. A counter-based stream: any stretch of it is computed
# directly, on every device, and costs a few integer operations per value where torch.rand's
# Mersenne Twister takes ~5 ns per value on one CPU thread.
_GAMMA, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = (1 << 64) - 1


def _int64(v: int) -> int:
    """The int64 with the bits of the uint64 ``v``: torch has no uint64 arithmetic."""
    return v - (1 << 64) if v >> 63 else v


def _state(seed: int, offset: int) -> int:
    """SplitMix64's state for output ``offset`` of ``seed``, a uint64."""
    return (seed + (offset + 1) * _GAMMA) & _U64


def _shift(z: Tensor, s: int) -> Tensor:
    """``z >> s`` of the uint64 bits held in the int64 ``z`` (torch shifts int64 arithmetically)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix_uniform(seed: int, offset: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """``n`` uniform fp32 draws in ``[0, 1)``: outputs ``offset`` to ``offset + n - 1`` (0-based)
    of the SplitMix64 generator seeded ``seed`` (mod 2**64), each its top 24 bits times
    ``2**-24`` (as ``torch.rand``'s fp32, which also has 24 random bits). SplitMix64(0)'s first
    outputs are ``0xe220a8397b1dcdaf`` and ``0x6e789e6aa1b965f4``:

    Examples:
        >>> onebit.ops.splitmix_uniform(0, 0, 2).tolist()
        [0.8833107948303223, 0.4315279722213745]
    """
    for name, value in (("seed", seed), ("offset", offset), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int) or (name != "seed" and value < 0):
            raise ValueError(f"{name} must be {'an int' if name == 'seed' else 'a non-negative int'}, got {value!r}")
    z = torch.arange(n, dtype=torch.int64, device=device) * _int64(_GAMMA) + _int64(_state(seed, offset))  # mod 2**64
    z = (z ^ _shift(z, 30)) * _int64(_MIX1)
    z = (z ^ _shift(z, 27)) * _int64(_MIX2)
    z = z ^ _shift(z, 31)
    return _shift(z, 40).to(torch.float32) * 2.0**-24


def stochastic_sign_compress_(error: Tensor, *, seed: int, offset: int) -> Tensor:
    """Birder's randomiser with error feedback on ``c = error`` (eq. 5): bit ``2u - 1 < c``,
    i.e. ``+1`` with probability ``(c + 1) / 2``, ``u`` the draws :func:`splitmix_uniform`
    ``(seed, offset, c.numel())``; returns the packed bits and sets ``error = c - Q(c)``
    (``Q(c) = +-1``) in place.

    ``error`` is contiguous fp32. On CPU one numba pass, drawing as it goes; elsewhere (and in
    the reference) the draws, then four torch passes and a bool mask.
    """
    n = error.numel()
    if n and _numba_ok(error):
        packed = torch.empty(packed_numel(n), dtype=torch.uint8)
        _cpu.stochastic_signs_update(error.view(-1).numpy(), np.uint64(_state(seed, offset)), packed.numpy())
        return packed
    u = splitmix_uniform(seed, offset, n, error.device)
    packed = pack_bits(u.mul_(2.0).sub_(1.0) < error.view(-1))
    error.view(-1).sub_(unpack_signs(packed, n, 1.0, out=u))
    return packed


def average_signs(
    packed: Sequence[Tensor], scales: Sequence[Tensor], numel: int, out: Tensor, *, accumulate: bool = False,
    blocks: Blocks | None = None,
) -> Tensor:
    """``(sum_r +-scales[r]) * (1 / len(packed))``, decoding each rank's packed signs, summed in
    rank order; written to ``out``, or added to it with ``accumulate``. With ``blocks``, each
    rank's ``scales[r]`` holds one scale per block.

    The multiplication by the fp32 reciprocal (rather than a division) is what every
    kernel computes, so CPU, CUDA and the reference agree to the bit."""
    if blocks is not None:
        blocks.check(numel)
    if numel and _numba_ok(out):
        values = torch.stack([s.reshape(-1)[: 1 if blocks is None else len(blocks)] for s in scales])
        _cpu.average_signs(_rows(packed, packed_numel(numel)).numpy(), values.to(torch.float32).numpy(),
                           _ends(blocks, numel), out.numpy(), accumulate)
        return out
    if numel and _bits._fast_gpu(out):
        rows = _rows(packed, packed_numel(numel))
        if blocks is None:
            _triton.average_signs(rows, torch.cat([s.reshape(1) for s in scales]), numel, out, accumulate)
        else:
            _triton.average_signs(rows, torch.stack([s.reshape(-1) for s in scales]), numel, out, accumulate,
                                  blocks.byte_blocks(out.device))
        return out
    target = torch.empty_like(out) if accumulate else out
    unpack_signs(packed[0], numel, scales[0], out=target, blocks=blocks)
    for p, s in zip(packed[1:], scales[1:]):
        target.add_(unpack_signs(p, numel, s, blocks=blocks))
    target.mul_(1.0 / len(packed))
    return out.add_(target) if accumulate else out


def warm_up(device: torch.device | str) -> None:
    """Compile or load (from numba's on-disk cache; Triton's on CUDA) every fused kernel for
    ``device`` (:mod:`._elementwise`'s too), once per process and device type.

    Run at optimizer construction so that the first compressed step does not stall: a
    kernel's first call loads it (~0.5 s from the cache) or compiles it (~2 s cold), which
    otherwise lands in the middle of training. Each kernel is called with the argument
    types of the real calls -- numba specialises on dtypes and memory layout, so received
    all-to-all slots (strided rows) and stacked payloads (contiguous rows) both run.
    """
    device = torch.device(device)
    if device.type in _WARM:
        return
    c = torch.linspace(-1.0, 1.0, 16, device=device)
    packed, scale = ef_sign_compress_(c.clone(), None)
    slots = torch.zeros(5, 4, dtype=torch.uint8, device=device)  # ranks' 2-byte payloads in 4-byte slots
    slots[:, :2] = packed
    out = torch.zeros(16, device=device)
    for ranks in (2, 5):  # the CPU kernel has its own path for at most 4 ranks
        for rows in (list(slots[:ranks]), [packed.clone() for _ in range(ranks)]):
            average_signs(rows, [scale] * ranks, 16, out, accumulate=False)
            average_signs(rows, [scale] * ranks, 16, out, accumulate=True)
    unpack_signs(packed, 16, scale, out=out)
    unpack_codes(pack_codes(c, scale, 3), 16, 3, scale, out)  # QAdam's b-bit codes
    stochastic_sign_compress_(c.clone(), seed=0, offset=0)  # Birder's randomised sign
    topk_indices(c, 3)  # Comp-AMS's Top-k
    clamp_scaled_(out, c.abs(), 0.5)  # the optimizers' element-wise passes
    zero_where_equal_(out, c, 0.0)
    max_ratio(out, c, torch.zeros((), dtype=torch.float64, device=device))
    soft_sign_(c.clone(), c.abs(), c, out, beta=0.9, eps=1e-8)
    _WARM.add(device.type)
