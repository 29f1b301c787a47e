"""The fused ops' fast paths against the torch reference, through the public ``onebit.ops``
functions: shared by test_ops.py (numba on CPU) and _triton_check.py (Triton's dispatch)."""

from __future__ import annotations

import torch

from _oracle import SplitMix64
from onebit import ops


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values as their bit patterns (so -0.0 != 0.0 and NaN payloads count)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def check_fused_ops(n: int, world: int, g: torch.Generator, accumulate: bool, where: str = "",
                    blocks: ops.Blocks | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ef_sign_compress_``, ``unpack_signs`` and ``average_signs`` (separate payloads, and the
    same payloads as slots of one received buffer), with one scale or one per block of
    ``blocks``, equal the reference bit for bit; returns ``(x, packed, scale)``."""
    x, e = torch.randn(n, generator=g), torch.randn(n, generator=g)
    fast_e, ref_e = e.clone(), e.clone()
    packed, scale = ops.ef_sign_compress_(fast_e, x, blocks=blocks)
    with ops.reference_kernels():
        ref_packed, ref_scale = ops.ef_sign_compress_(ref_e, x, blocks=blocks)
    assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale), f"ef_sign_compress_ {where}"
    assert torch.equal(bits(fast_e), bits(ref_e)), f"ef_sign_compress_ error {where}"
    with ops.reference_kernels():
        ref_values = ops.unpack_signs(packed, n, scale, blocks=blocks)
    assert torch.equal(bits(ops.unpack_signs(packed, n, scale, blocks=blocks)), bits(ref_values)), \
        f"unpack_signs {where}"
    payloads = [ops.pack_signs(torch.randn(n, generator=g)) for _ in range(world)]
    scales = [torch.rand(1 if blocks is None else len(blocks), generator=g) for _ in range(world)]
    base = torch.randn(n, generator=g)
    slot = ops.packed_numel(n) + 3
    received = torch.zeros(world * slot, dtype=torch.uint8)
    for r, payload in enumerate(payloads):
        received[r * slot : r * slot + payload.numel()] = payload
    views = [received[r * slot : r * slot + ops.packed_numel(n)] for r in range(world)]
    with ops.reference_kernels():
        ref = ops.average_signs(payloads, scales, n, base.clone(), accumulate=accumulate, blocks=blocks)
    for rows in (payloads, views):  # views: read in place, as a strided view
        fast = ops.average_signs(rows, scales, n, base.clone(), accumulate=accumulate, blocks=blocks)
        assert torch.equal(bits(fast), bits(ref)), f"average_signs {where}"
    return x, packed, scale


def random_blocks(n: int, g: torch.Generator) -> ops.Blocks | None:
    """``n`` values cut into blocks of multiples of 8 (the last any length), or ``None`` for ``n = 0``."""
    cuts = sorted({8 * int(k) for k in torch.randint(1, max(2, n // 8 + 1), (3,), generator=g) if 8 * k < n})
    return ops.Blocks([b - a for a, b in zip([0, *cuts], [*cuts, n])]) if n else None


def check_stochastic_sign(n: int, g: torch.Generator, where: str = "") -> None:
    """``stochastic_sign_compress_`` equals the reference bit for bit, and its bits are the
    plain rule ``2u - 1 < c`` with ``error = c - (+-1)``, ``u`` SplitMix64's draws from the
    offset on."""
    c = torch.randn(n, generator=g) * 0.7  # mostly inside [-1, 1], some outside
    c[torch.rand(n, generator=g) < 0.05] = -0.0
    seed, offset = int(torch.randint(0, 2**62, (1,), generator=g)), int(torch.randint(0, 300, (1,), generator=g))
    stream = SplitMix64(seed)
    stream.uniform(offset)
    u = stream.uniform(n)
    fast_e, ref_e = c.clone(), c.clone()
    packed = ops.stochastic_sign_compress_(fast_e, seed=seed, offset=offset)
    with ops.reference_kernels():
        ref_packed = ops.stochastic_sign_compress_(ref_e, seed=seed, offset=offset)
    assert torch.equal(packed, ref_packed), f"stochastic_sign_compress_ {where}"
    assert torch.equal(bits(fast_e), bits(ref_e)), f"stochastic_sign_compress_ error {where}"
    plus = (u * 2 - 1) < c
    assert torch.equal(ops.unpack_bits(packed, n), plus), f"stochastic_sign_compress_ bits {where}"
    assert torch.equal(fast_e, c - torch.where(plus, 1.0, -1.0)), f"stochastic_sign_compress_ error {where}"
    plus = (u * 2 - 1) < c
    assert torch.equal(ops.unpack_bits(packed, n), plus), f"stochastic_sign_compress_ bits {where}"
    assert torch.equal(fast_e, c - torch.where(plus, 1.0, -1.0)), f"stochastic_sign_compress_ error {where}"
