"""SparseLoCo's compressor (Sarfi et al., arXiv 2508.15706, section 3): the ``k`` largest
magnitudes of every chunk of ``chunk`` values, their values quantized to ``bits`` bits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._base import Compressor

__all__ = ["ChunkTopKCompressor"]

_INDEX_BITS = 12  # an index inside a chunk of at most 4096 values; two indices pack into three bytes


def _pack_indices(idx: Tensor) -> Tensor:
    """12-bit indices, two to three bytes (the count padded to even with a zero)."""
    idx = idx.to(torch.int32)
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_zeros(1)])
    a, b = idx[0::2], idx[1::2]
    return torch.stack([a & 0xFF, (a >> 8) | ((b & 0x0F) << 4), b >> 4], dim=1).reshape(-1).to(torch.uint8)


def _unpack_indices(packed: Tensor, count: int) -> Tensor:
    triples = packed.reshape(-1, 3).to(torch.int64)
    a = triples[:, 0] | ((triples[:, 1] & 0x0F) << 8)
    b = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
    return torch.stack([a, b], dim=1).reshape(-1)[:count]


def _pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Codes of ``bits`` bits (1, 2, 4 or 8), ``8 // bits`` to a byte, the first in the low bits."""
    per = 8 // bits
    codes = codes.to(torch.uint8)
    if codes.numel() % per:
        codes = torch.cat([codes, codes.new_zeros(per - codes.numel() % per)])
    rows = codes.reshape(-1, per)
    packed = rows[:, 0].clone()
    for i in range(1, per):
        packed |= rows[:, i] << (i * bits)
    return packed


def _unpack_codes(packed: Tensor, count: int, bits: int) -> Tensor:
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & mask).reshape(-1)[:count].long()


class ChunkTopKCompressor(Compressor):
    """Chunk-wise Top-k with quantized values, SparseLoCo's ``Q(TopK(e))``.

    Each block (a tensor's values, :meth:`with_blocks`; without blocks the whole input) is cut
    into chunks of ``chunk`` consecutive values (the last may be shorter); each chunk keeps its
    ``k`` largest magnitudes (all of a chunk shorter than ``k``). The values a block keeps are
    quantized together to ``bits`` bits by SparseLoCo's statistical quantizer: centred on their
    mean, ``2^bits`` bins of width ``range_in_sigmas * std / 2^bits``, each bin decoded as the
    mean of the values that fell in it (so the two-bit code of a value keeps its sign and the
    typical size of its side).

    The reference cuts a matrix into 64 x 64 tiles; here a chunk is a run of the flattened
    tensor (a compressor sees flat values): the same count per chunk, in rows instead of tiles.

    Wire: the kept indices (12 bits each, inside their chunk), their codes (``bits`` each,
    packed) and ``1 + 2^bits`` fp32 per block (the mean and the bins' values). With the
    defaults, 64 of every 4096 values (1.56%) at 14 bits: 0.22 bits per value, 146x fewer
    bytes than fp32.

    Args:
        k: values kept per chunk (SparseLoCo: 1-3% of a chunk).
        chunk: values per chunk, at most 4096 (SparseLoCo's 64 x 64 tiles).
        bits: bits per kept value: 1, 2 (SparseLoCo's), 4 or 8.
        range_in_sigmas: the quantizer's range around the mean, in standard deviations of the
            kept values (6: the reference's).
        block_sizes: the blocks' lengths (``None``: the input is one block).

    Examples:
        >>> c = onebit.compress.ChunkTopKCompressor(k=2, chunk=4, bits=8)
        >>> x = torch.tensor([0.1, -3.0, 0.2, 2.0, 4.0, 0.0, -0.1, -5.0])
        >>> c.decompress(c.compress(x))  # 2 of every 4, in 256 bins
        tensor([ 0., -3.,  0.,  2.,  4.,  0.,  0., -5.])
        >>> n = 2**20  # the defaults' bytes against fp32's
        >>> round(4 * n / onebit.compress.get("chunk_topk").wire_bytes(n))
        146
    """

    name = "chunk_topk"
    blockwise = True

    def __init__(self, k: int = 64, chunk: int = 4096, bits: int = 2, range_in_sigmas: float = 6.0,
                 block_sizes: Sequence[int] | None = None) -> None:
        for name, value, hi in (("k", k, None), ("chunk", chunk, 1 << _INDEX_BITS)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Invalid {name} value: {value!r} (expected an int)")
            if value < 1 or (hi is not None and value > hi):
                raise ValueError(f"Invalid {name} value: {value} (expected an int in [1, {hi or 'inf'}])")
        if isinstance(bits, bool) or bits not in (1, 2, 4, 8):
            raise ValueError(f"Invalid bits value: {bits!r} (expected 1, 2, 4 or 8)")
        if isinstance(range_in_sigmas, bool) or not isinstance(range_in_sigmas, (int, float)) \
                or not 0 < range_in_sigmas < math.inf:
            raise ValueError(f"Invalid range_in_sigmas value: {range_in_sigmas!r} (expected a positive number)")
        self.k, self.chunk, self.bits, self.range_in_sigmas = k, chunk, bits, float(range_in_sigmas)
        if block_sizes is not None:
            block_sizes = tuple(block_sizes)
            if not block_sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                          for b in block_sizes):
                raise ValueError(f"Invalid block_sizes value: {list(block_sizes)!r} (expected ints >= 0)")
        self.block_sizes = block_sizes

    def with_blocks(self, block_sizes: Sequence[int]) -> ChunkTopKCompressor:
        """This compressor with the chunks and the quantizer's statistics of each block its own."""
        return ChunkTopKCompressor(self.k, self.chunk, self.bits, self.range_in_sigmas,
                                   block_sizes if len(block_sizes) > 1 else None)

    def _blocks(self, numel: int) -> tuple[int, ...]:
        if self.block_sizes is None:
            return (numel,)
        if sum(self.block_sizes) != numel:
            raise ValueError(f"block_sizes add up to {sum(self.block_sizes)}, the chunk has {numel} values")
        return self.block_sizes

    def kept(self, numel: int) -> int:
        """Values kept of a block of ``numel``."""
        full, tail = divmod(numel, self.chunk)
        return full * min(self.k, self.chunk) + min(self.k, tail)

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        blocks = self._blocks(numel)
        kept = sum(self.kept(n) for n in blocks)
        return ((torch.uint8, 3 * math.ceil(kept / 2)), (torch.uint8, math.ceil(kept * self.bits / 8)),
                (torch.float32, len(blocks) * (1 + (1 << self.bits))))

    def _select(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each chunk's kept positions inside it, and their positions in ``x``, chunk after chunk."""
        full, tail = divmod(x.numel(), self.chunk)
        inside, where = [], []
        if full:
            k = min(self.k, self.chunk)
            idx = torch.topk(x[: full * self.chunk].view(full, self.chunk).abs(), k, dim=1, sorted=False).indices
            inside.append(idx.reshape(-1))
            where.append((idx + torch.arange(full, device=x.device).unsqueeze(1) * self.chunk).reshape(-1))
        if tail:
            idx = torch.topk(x[full * self.chunk:].abs(), min(self.k, tail), sorted=False).indices
            inside.append(idx)
            where.append(idx + full * self.chunk)
        if not inside:
            empty = torch.zeros(0, dtype=torch.int64, device=x.device)
            return empty, empty
        return torch.cat(inside), torch.cat(where)

    def _quantize(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """The codes of ``values`` and ``[mean, bin values...]`` (the reference's quantizer)."""
        bins = 1 << self.bits
        stats = values.new_zeros(1 + bins)
        if not values.numel():
            return torch.zeros(0, dtype=torch.int64, device=values.device), stats
        shift = values.mean()
        centred = values - shift
        std = centred.norm() / math.sqrt(centred.numel() - 1) if centred.numel() > 1 else centred.new_zeros(())
        scale = self.range_in_sigmas * std / bins
        if not bool(torch.isfinite(scale)) or float(scale) == 0.0:
            scale = torch.ones_like(scale)
        codes = torch.round(centred / scale + bins // 2).clamp_(0, bins - 1).long()
        sums = values.new_zeros(bins).scatter_add_(0, codes, centred)
        counts = values.new_zeros(bins).scatter_add_(0, codes, torch.ones_like(centred))
        stats[0] = shift
        stats[1:] = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
        return codes, stats

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        indices, codes, stats = [], [], []
        lo = 0
        for n in self._blocks(x.numel()):
            block = x[lo:lo + n]
            inside, where = self._select(block)
            c, s = self._quantize(block[where])
            indices.append(inside)
            codes.append(c)
            stats.append(s)
            lo += n
        return (_pack_indices(torch.cat(indices)), _pack_codes(torch.cat(codes), self.bits), torch.cat(stats))

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        packed_idx, packed_codes, stats = tensors
        blocks = self._blocks(numel)
        total = sum(self.kept(n) for n in blocks)
        inside = _unpack_indices(packed_idx, total)
        codes = _unpack_codes(packed_codes, total, self.bits)
        stats = stats.reshape(len(blocks), -1)
        out.zero_()
        lo = at = 0
        for b, n in enumerate(blocks):
            kept = self.kept(n)
            full, tail = divmod(n, self.chunk)
            per = min(self.k, self.chunk)
            # each kept value's chunk: full chunks of ``per`` values each, then the tail's
            chunk_of = torch.arange(full, device=out.device).repeat_interleave(per)
            if tail:
                chunk_of = torch.cat([chunk_of, chunk_of.new_full((min(self.k, tail),), full)])
            values = stats[b, 1:][codes[at:at + kept]] + stats[b, 0]
            out[lo + chunk_of * self.chunk + inside[at:at + kept]] = values
            lo += n
            at += kept
        return out

    def __repr__(self) -> str:
        blocks = "" if self.block_sizes is None else f", blocks={len(self.block_sizes)}"
        return (f"ChunkTopKCompressor(k={self.k}, chunk={self.chunk}, bits={self.bits}, "
                f"range_in_sigmas={self.range_in_sigmas}{blocks})")
