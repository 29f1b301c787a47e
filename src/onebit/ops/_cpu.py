"""Fused CPU kernels (numba), one pass over memory each; ``None`` where numba is missing.

They compute exactly the floating-point operations of the torch reference, in the same
order, so their results are bit-identical to it: ``c - copysign(scale, c)`` for the
error, and ``((+-s_0) + (+-s_1) + ...) * (1/w)`` for an average of sign payloads.
"""

from __future__ import annotations

import numpy as np

__all__ = ["average_signs", "pack_signs_update"]

try:
    import numba
except ImportError:  # pragma: no cover - numba is a declared dependency; this is the fallback
    numba = None

if numba is not None:

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _pack_signs_update(c, scale, packed):  # pragma: no cover - compiled
        bits = c.view(np.uint32)
        n = c.size
        full = n // 8
        for i in range(full):  # a fixed trip count of 8 lets LLVM unroll and vectorise
            byte = 0
            for k in range(8):
                j = 8 * i + k
                negative = bits[j] >> 31
                byte |= (1 - negative) << k
                c[j] = c[j] - (-scale if negative else scale)
            packed[i] = byte
        if n > 8 * full:
            byte = 0
            for k in range(n - 8 * full):
                j = 8 * full + k
                negative = bits[j] >> 31
                byte |= (1 - negative) << k
                c[j] = c[j] - (-scale if negative else scale)
            packed[full] = byte

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _average_signs(packed, scales, n, out, accumulate):  # pragma: no cover - compiled
        w = packed.shape[0]
        inv = np.float32(1.0 / w)
        # table[r, b, k]: the value bit k of byte b decodes to in rank r's payload.
        table = np.empty((w, 256, 8), dtype=np.float32)
        for r in range(w):
            for b in range(256):
                for k in range(8):
                    table[r, b, k] = scales[r] if (b >> k) & 1 else -scales[r]
        acc = np.empty(8, dtype=np.float32)
        full = n // 8
        for i in range(full):
            row = table[0, packed[0, i]]
            for k in range(8):
                acc[k] = row[k]
            for r in range(1, w):
                row = table[r, packed[r, i]]
                for k in range(8):
                    acc[k] += row[k]
            for k in range(8):
                if accumulate:
                    out[8 * i + k] = out[8 * i + k] + acc[k] * inv
                else:
                    out[8 * i + k] = acc[k] * inv
        for k in range(n - 8 * full):
            t = table[0, packed[0, full], k]
            for r in range(1, w):
                t += table[r, packed[r, full], k]
            if accumulate:
                out[8 * full + k] = out[8 * full + k] + t * inv
            else:
                out[8 * full + k] = t * inv

    def pack_signs_update(c: np.ndarray, scale: np.float32, packed: np.ndarray) -> None:
        """Pack the signs of ``c`` (bit 1 = sign bit clear) and set ``c -= copysign(scale, c)``."""
        _pack_signs_update(c, scale, packed)

    def average_signs(packed: np.ndarray, scales: np.ndarray, n: int, out: np.ndarray, accumulate: bool) -> None:
        """``out (+)= (sum_r +-scales[r]) * (1/w)`` over the rows of ``packed`` (summed in row order)."""
        _average_signs(packed, scales, n, out, accumulate)

else:  # pragma: no cover
    pack_signs_update = None
    average_signs = None
