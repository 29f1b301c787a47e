"""Bit operations: sign packing (8 per byte), fused error-feedback compression kernels, Top-k
selection, and the optimizers' one-pass element-wise updates."""

from ._blocks import Blocks
from ._bits import pack_bits, pack_codes, pack_signs, packed_numel, reference_kernels, unpack_bits, unpack_codes, unpack_signs
from ._elementwise import clamp_scaled_, max_ratio, soft_sign_, zero_where_equal_
from ._fused import average_signs, ef_sign_compress_, splitmix_uniform, stochastic_sign_compress_, warm_up
from ._norms import block_l1_norms, l1_norm, l2_norm, max_abs
from ._select import topk_indices

__all__ = [
    "Blocks",
    "average_signs",
    "block_l1_norms",
    "clamp_scaled_",
    "ef_sign_compress_",
    "l1_norm",
    "l2_norm",
    "max_abs",
    "max_ratio",
    "pack_bits",
    "pack_codes",
    "pack_signs",
    "packed_numel",
    "reference_kernels",
    "soft_sign_",
    "splitmix_uniform",
    "stochastic_sign_compress_",
    "topk_indices",
    "unpack_bits",
    "unpack_codes",
    "unpack_signs",
    "warm_up",
    "zero_where_equal_",
]
