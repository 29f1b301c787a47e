"""The Triton kernels against the torch reference on random inputs of odd sizes.

Run as a script: with ``TRITON_INTERPRET=1`` on CPU tensors (test_gpu.py does this in a
subprocess, since the variable must be set before Triton compiles anything), or with
``--device cuda`` on a GPU. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import argparse

import torch

from onebit import ops
from onebit.ops import _triton
from _fused_check import bits, check_fused_ops, random_blocks

SIZES = [1, 7, 8, 9, 63, 1001, 4096, 4103, 12_345]


def check(device: str) -> int:
    checked = 0
    for n in SIZES:
        g = torch.Generator().manual_seed(n)
        c = torch.randn(n, generator=g)
        c[:: max(1, n // 5)] = -0.0  # the sign bit, not the value, decides
        if n > 3:
            c[1], c[2] = float("inf"), float("-inf")
        c = c.to(device)
        scale = torch.rand(1, generator=g).to(device)
        with ops.reference_kernels():
            ref_packed = ops.pack_signs(c)
            ref_unpacked = ops.unpack_signs(ref_packed, n, scale)
        packed = torch.empty_like(ref_packed)
        _triton.pack_signs(c, packed)
        assert torch.equal(packed, ref_packed), f"pack_signs n={n}"

        ref_c = c.clone()
        ref_c.sub_(torch.copysign(scale, ref_c))
        fused_c, fused_packed = c.clone(), torch.empty_like(ref_packed)
        _triton.pack_signs_update(fused_c, scale, fused_packed)
        assert torch.equal(fused_packed, ref_packed), f"pack_signs_update bytes n={n}"
        assert torch.equal(bits(fused_c), bits(ref_c)), f"pack_signs_update error n={n}"

        out = torch.empty(n, device=device)
        _triton.unpack_signs(ref_packed, n, scale, out)
        assert torch.equal(bits(out), bits(ref_unpacked)), f"unpack_signs n={n}"

        for world in (1, 2, 3, 5):
            rows = [ops.pack_signs(torch.randn(n, generator=g).to(device)) for _ in range(world)]
            scales = [torch.rand(1, generator=g).to(device) for _ in range(world)]
            base = torch.randn(n, generator=g).to(device)
            for accumulate in (False, True):
                with ops.reference_kernels():
                    ref = ops.average_signs(rows, scales, n, base.clone(), accumulate=accumulate)
                fused = base.clone()
                _triton.average_signs(torch.stack(rows), torch.cat(scales), n, fused, accumulate)
                assert torch.equal(bits(fused), bits(ref)), f"average_signs n={n} world={world} acc={accumulate}"
                checked += 1
        # 1-bit Adam's update bound, a NaN kept where torch.clamp keeps it (any NaN's bits)
        x, bound = torch.randn(n, generator=g) * 3, torch.rand(n, generator=g)
        x[:: max(1, n // 3)] = float("nan")
        x, bound = x.to(device), bound.to(device)
        with ops.reference_kernels():
            ref = ops.clamp_scaled_(x.clone(), bound, 0.7)
        fused = x.clone()
        _triton.clamp_scaled(fused, bound, 0.7)
        nan = ref.isnan()
        assert torch.equal(fused.isnan(), nan) and torch.equal(bits(fused[~nan]), bits(ref[~nan])), \
            f"clamp_scaled n={n}"
        checked += 1
        # Slots of one received buffer (the all-to-all layout): a strided view, no copy.
        slot = ref_packed.numel() + 5
        buffer = torch.randint(0, 256, (3 * slot,), dtype=torch.uint8, generator=g).to(device)
        views = [buffer[r * slot : r * slot + ref_packed.numel()] for r in range(3)]
        scales = [torch.rand(1, generator=g).to(device) for _ in range(3)]
        with ops.reference_kernels():
            ref = ops.average_signs(views, scales, n, torch.empty(n, device=device))
        fused = torch.empty(n, device=device)
        _triton.average_signs(buffer.view(3, slot), torch.cat(scales), n, fused, False)
        assert torch.equal(bits(fused), bits(ref)), f"average_signs strided n={n}"
        checked += 4
    return checked


def check_dispatch() -> int:
    """The public ops, routed to the Triton kernels as for CUDA tensors (here: CPU tensors in
    the interpreter), against the reference: the glue around the kernels (allocation,
    strided receive slots, scales gathered on the device)."""
    from onebit.ops import _bits, _cpu

    _triton.available = lambda t: True
    _bits._fast_cpu = lambda t: False
    _cpu.pack_signs_update = _cpu.average_signs = None
    checked = 0
    for n in SIZES:
        x, packed, scale = check_fused_ops(n, 3, torch.Generator().manual_seed(n), True, f"n={n}")
        g = torch.Generator().manual_seed(n)
        check_fused_ops(n, 3, g, True, f"n={n} blocks", blocks=random_blocks(n, g))
        with ops.reference_kernels():
            ref_unpacked = ops.unpack_signs(packed, n, scale)
            ref_signs = ops.pack_signs(x.bfloat16())
        assert torch.equal(bits(ops.unpack_signs(packed, n, scale)), bits(ref_unpacked)), f"unpack n={n}"
        assert torch.equal(ops.pack_signs(x.bfloat16()), ref_signs), f"pack_signs bf16 n={n}"
        checked += 8  # compress, average (payloads and slots), unpack, pack; the first three per block
    return checked


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"triton kernels bit-identical to the reference: {check(args.device)} cases on {args.device}")
    if args.device == "cpu":
        print(f"dispatch through the public ops bit-identical: {check_dispatch()} cases")


if __name__ == "__main__":
    main()
