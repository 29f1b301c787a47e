"""Blocks of a flat buffer, each compressed with its own scale (one per tensor piece).

A :class:`Blocks` is handed to :func:`~onebit.ops.ef_sign_compress_`,
:func:`~onebit.ops.unpack_signs` and :func:`~onebit.ops.average_signs` so that a chunk of many
tensors is compressed in one kernel call, not one call per tensor (which costs a dozen torch
calls per piece: ~0.1 ms on CPU, ~0.4 ms of kernel launches on CUDA, per piece and phase).
It keeps, per device, what the kernels index with: the blocks' ends (numba), the block of
every packed byte (Triton), each block's length (the torch reference) and the plan of
:meth:`Blocks.l2_scales`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["Blocks"]

_ROW = 4096  # the rows of _norms.l2_norm: fp32-accurate norms, combined in fp64


@dataclass(frozen=True)
class _NormPlan:
    rows: int  # full rows of _ROW values
    whole: Tensor  # rows that lie inside one block
    split: Tensor  # rows (< rows) a block starts inside
    tail: int  # values after the full rows (0: none)
    piece_row: Tensor  # for each piece of a split row (or of the tail), its row among split + tail
    piece_lo: Tensor  # its first and one-past-last offsets in that row
    piece_hi: Tensor
    order: Tensor  # whole rows then pieces -> their order in the buffer
    per_block: Tensor  # units (whole rows and pieces) per block
    inv_sqrt: Tensor  # fp32 1/sqrt(block length)


class Blocks:
    """Consecutive blocks of ``sizes`` values (each a multiple of 8 but the last, so that every
    block starts on a packed byte); each gets the scale ``||x_B||_2 / sqrt(n_B)``.

    Examples:
        >>> blocks = onebit.ops.Blocks([8, 3])
        >>> blocks.l2_scales(torch.tensor([3.0] * 8 + [0.5, -0.5, 0.5]))
        tensor([3.0000, 0.5000])
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        sizes = tuple(sizes)
        if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
            raise ValueError(f"block_sizes must be ints >= 1, got {list(sizes)!r}")
        if any(b % 8 for b in sizes[:-1]):
            raise ValueError(f"block_sizes must be multiples of 8 but the last, got {list(sizes)!r}")
        self.sizes = sizes
        self.numel = sum(sizes)
        self.ends = np.fromiter(itertools.accumulate(sizes), dtype=np.int64, count=len(sizes))
        self._cache: dict[tuple[str, torch.device], object] = {}

    def __len__(self) -> int:
        return len(self.sizes)

    def check(self, numel: int) -> None:
        if numel != self.numel:
            raise ValueError(f"block_sizes add up to {self.numel}, the chunk has {numel} values")

    def _cached(self, what: str, device: torch.device, make) -> object:
        key = (what, device)
        if key not in self._cache:
            self._cache[key] = make(device)
        return self._cache[key]

    def per_value(self, scales: Tensor) -> Tensor:
        """``scales`` (one per block) repeated over each block's values: the reference's form."""
        lengths = self._cached("lengths", scales.device,
                               lambda d: torch.tensor(self.sizes, dtype=torch.int64, device=d))
        return torch.repeat_interleave(scales.reshape(-1), lengths, output_size=self.numel)

    def byte_blocks(self, device: torch.device) -> Tensor:
        """int32: the block of each packed byte (the Triton kernels' scale index)."""
        def make(d: torch.device) -> Tensor:
            nbytes = np.diff(np.concatenate([[0], (self.ends + 7) // 8]))
            return torch.from_numpy(np.repeat(np.arange(len(self), dtype=np.int32), nbytes)).to(d)
        return self._cached("bytes", device, make)  # type: ignore[return-value]

    def l2_scales(self, x: Tensor) -> Tensor:
        """``||x_B||_2 / sqrt(n_B)`` of every block of the flat fp32 ``x``, fp32, on ``x``'s device,
        without a host sync or a call per block. As :func:`~onebit.ops.l2_norm` does for a whole
        buffer, 4096-value rows are reduced in fp32 and combined in fp64; a row that a block
        starts inside is split into pieces whose sums of squares come from an fp64 running sum."""
        self.check(x.numel())
        plan: _NormPlan = self._cached("norms", x.device, self._plan)  # type: ignore[assignment]
        x = x.reshape(-1)
        units = []
        if plan.rows:
            rows = torch.linalg.vector_norm(x[: plan.rows * _ROW].view(plan.rows, _ROW), dim=1, dtype=torch.float32)
            units.append(rows[plan.whole].double().square())
        if plan.piece_row.numel():
            running = torch.empty(plan.split.numel() + (1 if plan.tail else 0), _ROW + 1, dtype=torch.float64,
                                  device=x.device)
            running[:, 0] = 0.0
            if plan.split.numel():
                running[: plan.split.numel(), 1:] = x[: plan.rows * _ROW].view(plan.rows, _ROW)[plan.split]
            if plan.tail:
                running[-1, 1 : plan.tail + 1] = x[plan.rows * _ROW :]
            running[:, 1:].square_().cumsum_(1)  # the tail's padding is never read
            units.append(running[plan.piece_row, plan.piece_hi] - running[plan.piece_row, plan.piece_lo])
        ordered = torch.cat(units)[plan.order]
        sums = torch.segment_reduce(ordered, "sum", lengths=plan.per_block, unsafe=True)  # no sync: our own lengths
        return sums.sqrt_().to(torch.float32).mul_(plan.inv_sqrt)

    def _plan(self, device: torch.device) -> _NormPlan:
        n, rows = self.numel, self.numel // _ROW
        starts = np.concatenate([[0], self.ends[:-1]])
        inside = sorted({int(s) // _ROW for s in starts[1:] if s % _ROW and int(s) // _ROW < rows})
        split_rows = list(inside) + ([rows] if n % _ROW else [])

        def block_of(at: int) -> int:
            return int(np.searchsorted(self.ends, at, side="right"))

        # (start in the buffer, block): the whole rows, then the pieces, as l2_scales concatenates them
        whole = [r for r in range(rows) if r not in set(inside)]
        units = [(r * _ROW, block_of(r * _ROW)) for r in whole]
        piece_row, piece_lo, piece_hi = [], [], []
        for k, r in enumerate(split_rows):
            lo, hi = r * _ROW, min((r + 1) * _ROW, n)
            cuts = [lo, *[int(s) for s in starts if lo < s < hi], hi]
            for a, b in zip(cuts, cuts[1:]):
                units.append((a, block_of(a)))
                piece_row.append(k)
                piece_lo.append(a - lo)
                piece_hi.append(b - lo)
        order = sorted(range(len(units)), key=lambda i: units[i][0])
        per_block = np.bincount([units[i][1] for i in order], minlength=len(self))

        def t(values: list[int] | np.ndarray) -> Tensor:
            return torch.as_tensor(np.asarray(values, dtype=np.int64), device=device)

        return _NormPlan(rows, t(whole), t(inside), n - rows * _ROW if n % _ROW else 0, t(piece_row),
                         t(piece_lo), t(piece_hi), t(order), t(per_block),
                         torch.tensor([1.0 / math.sqrt(b) for b in self.sizes], dtype=torch.float32, device=device))
