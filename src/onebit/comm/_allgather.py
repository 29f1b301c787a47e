"""The all-gather exchange of Comp-AMS (Algorithm 2): every rank's compressed tensor, averaged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from ..compress import Compressor
from ._compressed import _check_segments, _Sized, chunk_codecs
from ._dist import Stages, all_gather_bytes, run_stages
from ._transport import Group
from ._wire import read_payload, write_payload

__all__ = ["CompressedAllGather"]


class CompressedAllGather(_Sized):
    """Exact average of every rank's compressed tensor (Comp-AMS Algorithm 2, lines 5-11).

    Each rank compresses ``tensor`` (plus its error when ``error_feedback``), all-gathers the
    compact payloads (values+indices for Top-k, packed signs+scales for Block-Sign) and
    averages the decompressed tensors in rank order -- the same bytes and the same order
    on every rank, so the result is bit-identical everywhere. The all-gather volume grows
    with world size: each rank receives ``w - 1`` payloads.

    Args:
        compressor: ``"topk"``, ``"block_sign"`` (or any name of :func:`onebit.compress.get`)
            or a :class:`onebit.compress.Compressor`.
        group: process group (``None``: default), an :class:`MPIGroup` or a backend name.
        error_feedback: add each rank's compression error to its next input.
        segments: the offsets in ``tensor`` where its pieces start, each rounded down to the
            compressor's alignment: every piece gets its own scale (only for a ``blockwise``
            compressor, such as ``"sign"``; see :class:`CompressedAllReduce`). ``None``: the
            compressor's own blocks.
        timeout: per-collective timeout (``None``: 300 s).
        **compressor_kwargs: passed to :func:`onebit.compress.get` (``ratio=``, ``block=``).

    Examples:
        >>> gather = onebit.comm.CompressedAllGather("topk", ratio=0.25)
        >>> gather(torch.tensor([0.1, -4.0, 0.2, 0.3, 3.0, 0.0, -0.1, 0.5]))
        tensor([ 0., -4.,  0.,  0.,  3.,  0.,  0.,  0.])
    """

    own_error = True  # each rank compresses its whole tensor: its error is its own in any group

    def __init__(
        self,
        compressor: str | Compressor = "topk",
        group: Group = None,
        *,
        error_feedback: bool = True,
        segments: Sequence[int] | None = None,
        timeout: float | timedelta | None = None,
        **compressor_kwargs: Any,
    ) -> None:
        super().__init__(compressor, group, timeout, compressor_kwargs)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.segments = _check_segments(segments, self.compressor)

    def _size(self, numel: int, device: torch.device) -> None:
        self._codec = chunk_codecs(self.compressor, [(0, numel)], self.segments)[0]
        self._slot_bytes = torch.zeros(self._codec.wire_bytes(numel), dtype=torch.uint8, device=device)

    def __call__(self, tensor: Tensor, out: Tensor | None = None) -> Tensor:
        """Average over the group of every rank's ``C(tensor [+ error])``."""
        return run_stages(self.stages(tensor, out))

    def stages(self, tensor: Tensor, out: Tensor | None = None) -> Stages:
        """``self(tensor, out)`` in two stages, for a caller that overlaps the all-gather with
        other work (the overlapped Comp-AMS starts a bucket's during backward): compress and
        all-gather, whose :class:`Pending` is yielded; then average (see :func:`run_stages`).
        ``tensor`` and ``out`` must stay untouched until the last stage."""
        tensor = self._prepare(tensor, out)
        flat = tensor.detach().reshape(-1)
        comp, n = self._codec, flat.numel()
        if self.error_feedback:
            payload = self.worker_error.compress(comp, flat)
        else:
            payload = comp.compress(flat)
        write_payload(payload, self._slot_bytes)
        inflight = all_gather_bytes(self._slot_bytes, self.group, self.timeout, async_op=True)
        yield inflight
        gathered = inflight.wait()
        slot = self._slot_bytes.numel()
        payloads = [read_payload(comp, gathered[i * slot : (i + 1) * slot], n) for i in range(self._world_size)]
        acc = comp.average(payloads, self._output(out, flat))
        return self._finish(acc, tensor, out)

    def state_dict(self) -> dict[str, Any]:
        return self._base_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_base_state(state)
