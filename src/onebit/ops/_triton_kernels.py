"""The Triton kernels behind :mod:`._triton` (imported on first use: importing Triton costs ~0.3 s)."""

import triton
import triton.language as tl

__all__ = ["average_kernel", "clamp_scaled_kernel", "pack_kernel", "unpack_kernel"]


# With BLOCKED, scales_ptr holds one scale per block and blocks_ptr the block of every packed
# byte (int32); without, scales_ptr holds the one scale.
@triton.jit
def _scale(scale_ptr, blocks_ptr, byte, in_range, BLOCKED: tl.constexpr):
    if BLOCKED:
        return tl.load(scale_ptr + tl.load(blocks_ptr + byte, mask=in_range, other=0))[:, None]
    else:
        return tl.load(scale_ptr)


@triton.jit
def pack_kernel(c_ptr, scale_ptr, blocks_ptr, packed_ptr, n, nbytes, UPDATE: tl.constexpr, BLOCKED: tl.constexpr,
                BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    idx = byte[:, None] * 8 + k[None, :]
    valid = idx < n
    c = tl.load(c_ptr + idx, mask=valid, other=0.0)
    negative = (c.to(tl.int32, bitcast=True) >> 31) & 1
    # Bits are disjoint, so their sum is their OR; padding bits stay zero.
    bits = tl.where(valid, (1 - negative) << k[None, :], 0)
    tl.store(packed_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < nbytes)
    if UPDATE:
        scale = _scale(scale_ptr, blocks_ptr, byte, byte < nbytes, BLOCKED)
        tl.store(c_ptr + idx, c - tl.where(negative == 1, -scale, scale), mask=valid)

@triton.jit
def unpack_kernel(packed_ptr, scale_ptr, blocks_ptr, out_ptr, n, BLOCKED: tl.constexpr, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    idx = byte[:, None] * 8 + k[None, :]
    valid = idx < n
    b = tl.load(packed_ptr + byte, mask=byte * 8 < n, other=0).to(tl.int32)
    scale = _scale(scale_ptr, blocks_ptr, byte, byte * 8 < n, BLOCKED)
    tl.store(out_ptr + idx, tl.where(((b[:, None] >> k[None, :]) & 1) == 1, scale, -scale), mask=valid)

@triton.jit
def average_kernel(packed_ptr, stride, scales_ptr, blocks_ptr, nblocks, out_ptr, n, inv,
                   WORLD: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCKED: tl.constexpr, BLOCK: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    idx = byte[:, None] * 8 + k[None, :]
    valid = idx < n
    in_range = byte * 8 < n
    b = tl.load(packed_ptr + byte, mask=in_range, other=0).to(tl.int32)
    s = _scale(scales_ptr, blocks_ptr, byte, in_range, BLOCKED)
    acc = tl.where(((b[:, None] >> k[None, :]) & 1) == 1, s, -s)
    for r in tl.static_range(1, WORLD):
        b = tl.load(packed_ptr + r * stride + byte, mask=in_range, other=0).to(tl.int32)
        s = _scale(scales_ptr + r * nblocks, blocks_ptr, byte, in_range, BLOCKED)
        acc += tl.where(((b[:, None] >> k[None, :]) & 1) == 1, s, -s)
    result = acc * inv
    if ACCUMULATE:
        result = tl.load(out_ptr + idx, mask=valid, other=0.0) + result
    tl.store(out_ptr + idx, result, mask=valid)

@triton.jit
def clamp_scaled_kernel(x_ptr, bound_ptr, n, scale, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < n
    x = tl.load(x_ptr + idx, mask=valid)
    limit = tl.load(bound_ptr + idx, mask=valid) * scale
    # torch.clamp's order and its NaN: a NaN in x stays NaN
    low = tl.maximum(x, -limit, propagate_nan=tl.PropagateNan.ALL)
    tl.store(x_ptr + idx, tl.minimum(low, limit, propagate_nan=tl.PropagateNan.ALL), mask=valid)
