"""Bit operations: sign packing (8 per byte) and fused error-feedback compression kernels."""

from ._bits import pack_bits, pack_signs, packed_numel, reference_kernels, unpack_bits, unpack_signs
from ._fused import average_signs, ef_sign_compress_, warm_up
from ._norms import l1_norm, l2_norm, max_abs

__all__ = [
    "average_signs",
    "ef_sign_compress_",
    "l1_norm",
    "l2_norm",
    "max_abs",
    "pack_bits",
    "pack_signs",
    "packed_numel",
    "reference_kernels",
    "unpack_bits",
    "unpack_signs",
    "warm_up",
]
