"""Fused CPU kernels (numba), one pass over memory each; ``None`` where numba is missing.

They compute exactly the floating-point operations of the torch reference, in the same
order, so their results are bit-identical to it:

* the error ``c - copysign(scale, c)`` of a sign code;
* ``((+-s_0) + (+-s_1) + ...) * (1/w)`` for an average of sign payloads;
* ``+-scale`` (a copy, no arithmetic) for a decoded payload;
* the bit ``(u * 2) - 1 < c`` and the error ``c - (+-1)`` of Birder's randomised sign, its
  draws ``u`` SplitMix64's, integers only;
* QAdam's ``b``-bit codes ``round(x / s * L) + L`` (half to even) and their values
  ``((code - L) / L) * s``;
* ``min(max(x, -b * s), b * s)`` (``torch.clamp`` with the limits ``b * s`` and their
  negation), ``masked_fill_(ref == value, 0)`` and the largest fp32 quotient ``a / b`` over
  ``b > 0`` (NaN propagating, as ``torch.max``), the optimizers' element-wise passes;
* the indices of the ``k`` largest magnitudes (Top-k), integers only;
* Birder's moments and direction ``m = beta m + (1 - beta) g``, ``b = beta b + (1 - beta) |g|``,
  ``m / (b + eps)``: ``mul_`` then ``add_(alpha=...)``, whose product and sum torch rounds once
  (a fused multiply-add) or twice depending on the CPU, probed once; the kernel follows
  (``fused``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["average_signs", "clamp_scaled_", "max_ratio", "pack_codes", "pack_signs_update", "soft_sign_",
           "stochastic_signs_update", "topk_indices", "unpack_codes", "unpack_signs", "zero_where_equal_"]

try:
    import numba
except ImportError:  # pragma: no cover - numba is a declared dependency; this is the fallback
    numba = None

if numba is not None:
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def _fma32(typingctx, a, b, c):  # pragma: no cover - compiled
        """``a * b + c`` rounded once (LLVM's ``llvm.fma.f32``)."""
        def codegen(context, builder, signature, args):
            return builder.fma(*args)

        return types.float32(types.float32, types.float32, types.float32), codegen

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _pack_range(c, scale, packed):  # pragma: no cover - compiled
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
    def _average_range(packed, scales, sums, n, out, accumulate):  # pragma: no cover - compiled
        w = packed.shape[0]
        inv = np.float32(1.0 / w)
        head = min(w, 8)
        # spread[b] moves bit k of byte b to bit 8k: OR-ing spread[byte of rank r] << r over the
        # ranks gives, in byte k of one 64-bit word, the sign pattern p of value k.
        spread = np.zeros(256, dtype=np.uint64)
        for b in range(256):
            for k in range(8):
                if (b >> k) & 1:
                    spread[b] |= np.uint64(1) << np.uint64(8 * k)
        for i in range((n + 7) // 8):
            word = np.uint64(0)
            for r in range(head):
                word |= spread[packed[r, i]] << np.uint64(r)
            for k in range(min(8, n - 8 * i)):
                t = sums[(word >> np.uint64(8 * k)) & np.uint64(255)]
                for r in range(head, w):  # ranks beyond 8 keep adding one by one, in order
                    t += scales[r] if (packed[r, i] >> k) & 1 else -scales[r]
                j = 8 * i + k
                if accumulate:
                    out[j] = out[j] + t * inv
                else:
                    out[j] = t * inv

    @numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
    def _few_sum(w, k, b0, b1, b2, b3, s0, s1, s2, s3):  # pragma: no cover - compiled
        t = s0 if (b0 >> k) & 1 else -s0
        if w > 1:
            t = t + (s1 if (b1 >> k) & 1 else -s1)
        if w > 2:
            t = t + (s2 if (b2 >> k) & 1 else -s2)
        if w > 3:
            t = t + (s3 if (b3 >> k) & 1 else -s3)
        return t

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _few_range(packed, scales, n, out, accumulate):  # pragma: no cover - compiled
        # At most 4 ranks, each one's row and scale a local: ((+-s_0) + (+-s_1) + ...) * (1/w) is
        # added in rank order for every value with no table lookup, 8 values of a byte at a time
        # (a fixed trip count: unrolled and vectorised; 2.9x the lookups' speed on a 2-core Xeon).
        w = packed.shape[0]
        inv = np.float32(1.0 / w)
        p0, p1, p2, p3 = packed[0], packed[min(1, w - 1)], packed[min(2, w - 1)], packed[min(3, w - 1)]
        s0, s1, s2, s3 = scales[0], scales[min(1, w - 1)], scales[min(2, w - 1)], scales[min(3, w - 1)]
        # accumulate chooses between two loops, not inside one, and the last byte's values go
        # through a function of their own: either, in the same function, kept LLVM from
        # vectorising the loop on an AVX2 EPYC (about 10-20x slower).
        full = n // 8
        if accumulate:
            for i in range(full):
                b0, b1, b2, b3 = p0[i], p1[i], p2[i], p3[i]
                for k in range(8):
                    out[8 * i + k] = out[8 * i + k] + _few_sum(w, k, b0, b1, b2, b3, s0, s1, s2, s3) * inv
        else:
            for i in range(full):
                b0, b1, b2, b3 = p0[i], p1[i], p2[i], p3[i]
                for k in range(8):
                    out[8 * i + k] = _few_sum(w, k, b0, b1, b2, b3, s0, s1, s2, s3) * inv
        if n > 8 * full:
            _few_tail(w, p0[full], p1[full], p2[full], p3[full], s0, s1, s2, s3, inv, out[8 * full : n], accumulate)

    @numba.njit(cache=True, nogil=True, boundscheck=False, inline="never")
    def _few_tail(w, b0, b1, b2, b3, s0, s1, s2, s3, inv, out, accumulate):  # pragma: no cover - compiled
        for k in range(out.size):  # the last byte's values, fewer than 8
            t = _few_sum(w, k, b0, b1, b2, b3, s0, s1, s2, s3) * inv
            out[k] = out[k] + t if accumulate else t

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _unpack_range(packed, scale, out):  # pragma: no cover - compiled
        n = out.size
        full = n // 8
        negative = -scale
        for i in range(full):  # a fixed trip count of 8: unrolled, and stores without a branch
            byte = packed[i]
            for k in range(8):
                out[8 * i + k] = scale if (byte >> k) & 1 else negative
        for k in range(n - 8 * full):
            out[8 * full + k] = scale if (packed[full] >> k) & 1 else negative

    # The blocked kernels: each block (one scale, or one row of scales) through the one-range
    # kernel above on its own slices, whose loops start at 0 and vectorise as for one block.
    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _pack_signs_update(c, scales, ends, packed):  # pragma: no cover - compiled
        start = 0
        for b in range(ends.size):  # every block but the last ends on a byte
            end = ends[b]
            _pack_range(c[start:end], scales[b], packed[start // 8 : (end + 7) // 8])
            start = end

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _unpack_signs(packed, scales, ends, out):  # pragma: no cover - compiled
        start = 0
        for b in range(ends.size):
            end = ends[b]
            _unpack_range(packed[start // 8 : (end + 7) // 8], scales[b], out[start:end])
            start = end

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _average_blocks(packed, scales, sums, ends, out, accumulate):  # pragma: no cover - compiled
        if ends.size == 1:  # the rows as given (a slice of them indexes ~25% slower)
            if packed.shape[0] <= 4:
                _few_range(packed, scales[:, 0], ends[0], out, accumulate)
            else:
                _average_range(packed, scales[:, 0], sums[0], ends[0], out, accumulate)
            return
        start = 0
        for b in range(ends.size):
            end = ends[b]
            rows = packed[:, start // 8 : (end + 7) // 8]
            if packed.shape[0] <= 4:
                _few_range(rows, scales[:, b], end - start, out[start:end], accumulate)
            else:
                _average_range(rows, scales[:, b], sums[b], end - start, out[start:end], accumulate)
            start = end

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _random_plus(c, j, start):  # pragma: no cover - compiled
        # Draw j: SplitMix64's output for the state start + j * gamma (from j alone, so the loop
        # vectorises), its top 24 bits an fp32 u in [0, 1); then the torch form's fp32
        # operations: (u * 2) - 1 < c.
        z = start + np.uint64(j) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        u = np.float32(z >> np.uint64(40)) * np.float32(2.0**-24)
        return u * np.float32(2.0) - np.float32(1.0) < c[j]

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _stochastic_signs_update(c, start, packed):  # pragma: no cover - compiled
        one = np.float32(1.0)
        n = c.size
        full = n // 8
        for i in range(full):  # a fixed trip count of 8, as in _pack_range
            byte = 0
            for k in range(8):
                j = 8 * i + k
                plus = _random_plus(c, j, start)
                byte |= plus << k
                c[j] = c[j] - (one if plus else -one)
            packed[i] = byte
        if n > 8 * full:
            byte = 0
            for k in range(n - 8 * full):
                j = 8 * full + k
                plus = _random_plus(c, j, start)
                byte |= plus << k
                c[j] = c[j] - (one if plus else -one)
            packed[full] = byte

    # error_model="numpy": a division by zero gives IEEE's inf/NaN, as torch's, with no check
    # per value that would keep the loop from vectorising
    @numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
    def _soft_sign(m, b, g, out, beta, alpha, eps, fused):  # pragma: no cover - compiled
        for i in range(g.size):
            gi = g[i]
            if fused:
                mi = _fma32(gi, alpha, m[i] * beta)
                bi = _fma32(abs(gi), alpha, b[i] * beta)
            else:
                mi = m[i] * beta + gi * alpha
                bi = b[i] * beta + abs(gi) * alpha
            m[i] = mi
            b[i] = bi
            out[i] = mi / (bi + eps)

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _clamp_scaled(x, bound, scale):  # pragma: no cover - compiled
        for i in range(x.size):
            limit = bound[i] * scale
            v = x[i]
            if v < -limit:  # torch.clamp's order: the lower limit first, then the upper one
                v = -limit
            if v > limit:
                v = limit
            x[i] = v

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _zero_where_equal(x, ref, value):  # pragma: no cover - compiled
        for i in range(x.size):
            if ref[i] == value:
                x[i] = 0.0

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _max_ratio(num, den):  # pragma: no cover - compiled
        largest = np.float32(-np.inf)
        seen = False
        for i in range(num.size):
            if den[i] > 0:
                seen = True
                q = num[i] / den[i]
                if q > largest or q != q:  # a NaN stays: nothing compares greater than it
                    largest = q
        return largest, seen

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _pack_codes(x, divisor, levels, bits, packed):  # pragma: no cover - compiled
        packed[:] = 0
        level = np.float32(levels)
        for i in range(x.size):
            code = np.int64(np.round(x[i] / divisor * level) + level)
            for k in range(bits):  # bit k of value i's code is bit i * bits + k of the stream
                at = i * bits + k
                packed[at >> 3] |= np.uint8(((code >> k) & 1) << (at & 7))

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _unpack_codes(packed, levels, bits, scale, out):  # pragma: no cover - compiled
        level = np.float32(levels)
        for i in range(out.size):
            code = 0
            for k in range(bits):
                at = i * bits + k
                code |= ((packed[at >> 3] >> (at & 7)) & 1) << k
            out[i] = (np.float32(code) - level) / level * scale

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def _topk_indices(x, k, out):  # pragma: no cover - compiled
        # A radix select on the magnitudes' bit patterns (sign bit cleared), which order like the
        # magnitudes (a NaN's above inf): a histogram of their high 16 bits finds the bin of the
        # k-th largest, one more pass keeps the bins above it and lists the bin's values, whose
        # low 15 bits settle the threshold; the lowest indices win its ties.
        keys = x.view(np.uint32)
        mask = np.uint32(0x7FFFFFFF)
        high = np.zeros(1 << 16, dtype=np.int64)
        for i in range(keys.size):
            high[(keys[i] & mask) >> 15] += 1
        above = 0
        top = (1 << 16) - 1
        while above + high[top] < k:
            above += high[top]
            top -= 1
        kept = np.empty(above, dtype=np.int32)
        bin_ = np.empty(high[top], dtype=np.int32)
        a = 0
        b = 0
        for i in range(keys.size):
            h = (keys[i] & mask) >> 15
            if h > top:
                kept[a] = i
                a += 1
            elif h == top:
                bin_[b] = i
                b += 1
        low = np.zeros(1 << 15, dtype=np.int64)
        for i in bin_:
            low[keys[i] & 0x7FFF] += 1
        t = (1 << 15) - 1
        while above + low[t] < k:
            above += low[t]
            t -= 1
        ties = k - above
        j = 0  # merge the two ascending lists: the kept bins and the bin's values from the threshold
        a = 0
        for i in bin_:
            key = keys[i] & 0x7FFF
            if key > t or (key == t and ties > 0):
                if key == t:
                    ties -= 1
                while a < kept.size and kept[a] < i:
                    out[j] = kept[a]
                    j += 1
                    a += 1
                out[j] = i
                j += 1
        out[j:] = kept[a:]

    def pack_signs_update(c: np.ndarray, scales: np.ndarray, ends: np.ndarray, packed: np.ndarray) -> None:
        """Pack the signs of ``c`` (bit 1 = sign bit clear) and set ``c -= copysign(scale, c)``,
        ``scales[b]`` for the values of block ``b`` (blocks end at ``ends``, the last at ``c.size``)."""
        _pack_signs_update(c, scales, ends, packed)

    def average_signs(packed: np.ndarray, scales: np.ndarray, ends: np.ndarray, out: np.ndarray,
                      accumulate: bool) -> None:
        """``out (+)= (sum_r +-scales[r, b]) * (1/w)`` over the rows of ``packed`` (summed in row
        order), ``b`` the block (ending at ``ends``) of each value.

        Beyond 4 ranks, ``sums[b, p] = (+-s_0) + (+-s_1) + ...`` over the first 8 ranks, bit ``r``
        of ``p`` choosing the sign of ``s_r``, added in rank order: the reference's exact sequence
        of fp32 additions, looked up per value; up to 4, the same additions value by value."""
        w = packed.shape[0]
        head = min(w, 8) if w > 4 else 0
        patterns = np.arange(1 << head)
        sums = np.where(patterns & 1, scales[0, :, None], -scales[0, :, None]).astype(np.float32)
        for r in range(1, head):
            sums = sums + np.where((patterns >> r) & 1, scales[r, :, None], -scales[r, :, None]).astype(np.float32)
        _average_blocks(packed, scales, sums, ends, out, accumulate)

    def unpack_signs(packed: np.ndarray, scales: np.ndarray, ends: np.ndarray, out: np.ndarray) -> None:
        """``out[j] = +scale`` where bit ``j`` of ``packed`` is set, else ``-scale`` (``scales[b]``
        in block ``b``, ending at ``ends``)."""
        _unpack_signs(packed, scales, ends, out)

    def stochastic_signs_update(c: np.ndarray, start: np.uint64, packed: np.ndarray) -> None:
        """Pack the bits ``2 u - 1 < c`` and set ``c -= +-1`` accordingly, ``u_j`` the top 24 bits
        of SplitMix64's output for the state ``start + j * gamma``, times ``2**-24``."""
        _stochastic_signs_update(c, start, packed)

    def topk_indices(x: np.ndarray, k: int, out: np.ndarray) -> None:
        """``out`` (``k`` int32, ascending): the indices of the ``k`` largest ``|x|`` (fp32; a NaN
        above inf), the lowest indices first among equal magnitudes; ``1 <= k <= x.size``."""
        _topk_indices(x, k, out)

    def soft_sign_(m: np.ndarray, b: np.ndarray, g: np.ndarray, out: np.ndarray, beta: np.float32,
                   alpha: np.float32, eps: np.float32, fused: bool) -> None:
        """``m = m * beta + g * alpha``, ``b = b * beta + |g| * alpha`` (each product ``g * alpha``
        and its sum rounded once where ``fused``), then ``out = m / (b + eps)``, in place."""
        _soft_sign(m, b, g, out, beta, alpha, eps, fused)

    def clamp_scaled_(x: np.ndarray, bound: np.ndarray, scale: np.float32) -> None:
        """``x = clamp(x, -bound * scale, bound * scale)`` in place (fp32 products)."""
        _clamp_scaled(x, bound, scale)

    def zero_where_equal_(x: np.ndarray, ref: np.ndarray, value: np.float32) -> None:
        """``x[i] = 0`` where ``ref[i] == value``, in place."""
        _zero_where_equal(x, ref, value)

    def pack_codes(x: np.ndarray, divisor: np.float32, levels: int, bits: int, packed: np.ndarray) -> None:
        """Pack ``round(x / divisor * levels) + levels`` in ``bits`` bits per value (little bit order)."""
        _pack_codes(x, divisor, levels, bits, packed)

    def unpack_codes(packed: np.ndarray, levels: int, bits: int, scale: np.float32, out: np.ndarray) -> None:
        """``out[i] = ((code_i - levels) / levels) * scale`` from :func:`pack_codes`' stream."""
        _unpack_codes(packed, levels, bits, scale, out)

    def max_ratio(num: np.ndarray, den: np.ndarray) -> tuple[float, bool]:
        """``(max(num[i] / den[i]) over den[i] > 0, whether any den[i] > 0)``, fp32 quotients."""
        largest, seen = _max_ratio(num, den)
        return float(largest), bool(seen)

else:  # pragma: no cover
    clamp_scaled_ = None
    max_ratio = None
    pack_codes = None
    soft_sign_ = None
    unpack_codes = None
    stochastic_signs_update = None
    topk_indices = None
    zero_where_equal_ = None
    pack_signs_update = None
    average_signs = None
    unpack_signs = None
