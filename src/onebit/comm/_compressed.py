"""1-bit Adam's compressed all-reduce (section 6, Figure 3), and what the compressed
collectives share (``_Sized``: first-call sizing, validation, the worker's error feedback)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .. import compress as _compress
from .._checks import check_entries
from ..compress import Compressor
from ..feedback import ErrorFeedback
from ._dist import Stages, all_gather_bytes, all_to_all_bytes, run_stages, to_timedelta
from ._transport import Group, check_world_size, get_rank, get_world_size, resolve_group
from ._meter import phase
from ._nonfinite import nonfinite
from ._wire import read_payload, write_payload

__all__ = ["CompressedAllReduce", "Consume", "chunk_bounds", "chunk_codecs"]

# consume(lo, hi, values): an average's flat values [lo, hi), handed over chunk by chunk (scratch)
Consume = Callable[[int, int, Tensor], None]

_log = logging.getLogger(__name__)


def chunk_bounds(numel: int, world_size: int, alignment: int) -> list[tuple[int, int]]:
    """Split ``numel`` values into ``world_size`` chunks whose length is a multiple of ``alignment``.

    The chunk length is ``ceil(numel / (world_size * alignment)) * alignment``; the last
    chunks are shorter (possibly empty), so padding never enters the arithmetic.
    """
    span = world_size * alignment
    chunk = -(-numel // span) * alignment
    return [(min(j * chunk, numel), min((j + 1) * chunk, numel)) for j in range(world_size)]


def chunk_codecs(compressor: Compressor, bounds: Sequence[tuple[int, int]],
                 segments: Sequence[int] | None) -> list[Compressor]:
    """The compressor of each chunk ``[lo, hi)`` of ``bounds``: ``compressor`` itself, or with
    ``segments`` (the offsets where the input's pieces start -- its tensors in a fused buffer)
    one scale per piece of the chunk (:meth:`Compressor.with_blocks`), each start rounded down
    to the compressor's ``alignment`` so that no block splits a byte of packed signs."""
    if segments is None:
        return [compressor] * len(bounds)
    align = compressor.alignment
    cuts = sorted({s - s % align for s in segments})
    codecs = []
    for lo, hi in bounds:
        inner = [lo, *(c for c in cuts if lo < c < hi), hi]
        lengths = [b - a for a, b in zip(inner, inner[1:])]
        codecs.append(compressor.with_blocks(lengths))
    return codecs


def _check_segments(segments: object, compressor: Compressor) -> tuple[int, ...] | None:
    if segments is None:
        return None
    if not compressor.blockwise:
        raise ValueError(f"segments given for {compressor!r}, which has no per-block scales (blockwise=False)")
    if isinstance(segments, (str, bytes)) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in segments):  # type: ignore[union-attr]
        raise ValueError(f"segments must be a sequence of ints >= 0, got {segments!r}")
    return tuple(segments)  # type: ignore[arg-type]


def _check_input(tensor: object, name: str = "tensor") -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype={tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got a tensor with strides {tensor.stride()}")
    return tensor


class _Sized:
    """Shared first-call sizing and validation of the compressed collectives."""

    compressor: Compressor
    group: Group
    # Capability: input_buffer() and stages(None, ...), the exchange without a model-sized input.
    reduces_added_input: bool = False
    # Capability: its error is this rank's alone whatever the group (an all-gather's): it carries
    # over to the same exchange on another group (see carry()).
    own_error: bool = False
    # The error buffers' entries of state_dict()
    _error_keys: tuple[str, ...] = ("worker_error",)

    def __init__(
        self,
        compressor: str | Compressor,
        group: Group,
        timeout: float | timedelta | None,
        compressor_kwargs: dict[str, Any],
    ) -> None:
        self.compressor = _compress.get(compressor, **compressor_kwargs)
        self.group = resolve_group(group)
        self.timeout = to_timedelta(timeout)
        self.worker_error = ErrorFeedback("worker")
        self._numel: int | None = None
        self._device: torch.device | None = None
        self._world_size = get_world_size(self.group)
        self._rank = get_rank(self.group)

    def _prepare(self, tensor: object, out: Tensor | None) -> Tensor:
        tensor = _check_input(tensor)
        check_world_size(self.group, self._world_size, type(self).__name__)
        if self._numel is None:
            self._numel, self._device = tensor.numel(), tensor.device
            self._size(tensor.numel(), tensor.device)
        elif tensor.numel() != self._numel:
            raise ValueError(
                f"tensor has {tensor.numel()} elements but this {type(self).__name__} was sized "
                f"for {self._numel} on its first call"
            )
        elif tensor.device != self._device:
            raise ValueError(f"tensor is on {tensor.device} but this {type(self).__name__} works on {self._device}")
        if out is not None:
            _check_input(out, "out")
            if out.numel() != tensor.numel() or out.device != tensor.device:
                raise ValueError(
                    f"out must have {tensor.numel()} elements on {tensor.device}, got {out.numel()} on {out.device}"
                )
        return tensor

    def _size(self, numel: int, device: torch.device) -> None:
        raise NotImplementedError

    @property
    def numel(self) -> int | None:
        """The values per call this collective was sized for on its first (``None`` before it)."""
        return self._numel

    def warm_up(self, device: torch.device | str) -> None:
        """Load the compressor's kernels for ``device`` now (see :meth:`Compressor.warm_up`)."""
        self.compressor.warm_up(torch.device(device))

    @staticmethod
    def _output(out: Tensor | None, flat: Tensor) -> Tensor:
        """Where to write the fp32 result: ``out`` itself when it is fp32, else a new buffer."""
        if out is not None and out.dtype == torch.float32:
            return out.view(-1)
        return torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)

    @staticmethod
    def _finish(result: Tensor, tensor: Tensor, out: Tensor | None) -> Tensor:
        if out is None:
            return result.view(tensor.shape).to(tensor.dtype)
        if out.data_ptr() != result.data_ptr():
            out.view(-1).copy_(result)
        return out

    def _base_state(self) -> dict[str, Any]:
        return {
            "world_size": self._world_size,
            "numel": self._numel,
            "compressor": self.compressor.state_dict(),
            "worker_error": self.worker_error.state_dict(),
        }

    def reset(self) -> None:
        """Forget all error-feedback state (errors restart at zero)."""
        self.worker_error.reset()

    def decay_error(self, factor: float) -> None:
        """``e <- factor * e``: this rank's error before its next input is added (SparseLoCo's
        decayed accumulator ``e <- beta e + x``, arXiv 2508.15706 Algorithm 1)."""
        if self.worker_error.error is not None:
            self.worker_error.error.mul_(factor)

    def carry(self, other: _Sized) -> None:
        """Go on from ``other``, the same exchange over the group before this one's (a quorum
        re-formed): its compressor's state, and this rank's error where it is its own
        (``own_error``); an error that belongs to the old group's chunks restarts at zero."""
        self.compressor.load_state_dict(other.compressor.state_dict())
        if self.own_error:
            self.worker_error.load_state_dict(other.worker_error.state_dict())

    def check_state_dict(self, state: Any) -> None:
        """Refuse (``ValueError``) a :meth:`state_dict` lacking an entry :meth:`load_state_dict`
        reads, before anything is loaded (an optimizer checks every collective's first)."""
        owner = type(self).__name__
        check_entries(state, ("world_size", "compressor", *self._error_keys), owner)
        self.compressor.check_state_dict(state["compressor"])
        if state["world_size"] == self._world_size:  # else the errors restart, unread
            for key in self._error_keys:
                check_entries(state[key], ("error",), f"{owner} {key}")

    def _load_base_state(self, state: Mapping[str, Any]) -> bool:
        """Restore the common part; False (errors left as zeros, warning logged) on another world size."""
        self.compressor.load_state_dict(state["compressor"])
        if state["world_size"] != self._world_size:
            _log.warning(
                "%s state saved on world size %d, loaded on %d: error-feedback buffers re-created as zeros",
                type(self).__name__,
                state["world_size"],
                self._world_size,
            )
            self.reset()
            return False
        self.worker_error.load_state_dict(state["worker_error"])
        return True


class CompressedAllReduce(_Sized):
    """The average of ``tensor`` over the group, exchanged compressed in three phases.

    1. Pad the chunking to ``world_size * alignment``; compress chunk ``j`` of
       ``tensor + worker_error`` (worker error feedback, Algorithm 1 line 7) and send it to
       rank ``j`` (all-to-all).
    2. Each rank averages the chunks it owns, adds its server error, re-compresses
       (Algorithm 1 line 10).
    3. All-gather the re-compressed chunks; every rank decompresses the same bytes, so the
       result is bit-identical on all ranks.

    The object owns the worker error (size of ``tensor``) and the server error (size of
    this rank's chunk), sized on the first call; ``tensor`` is not modified. Without an
    initialised process group it behaves as world size 1 (it still compresses).

    Args:
        compressor: a compressor name of :func:`onebit.compress.get` (``"sign"``: 1 bit per
            value and one scale per chunk) or a :class:`onebit.compress.Compressor`.
        group: process group (``None``: default), an :class:`MPIGroup` or a backend name.
        segments: the offsets in ``tensor`` where its pieces start (e.g. each parameter's, in a
            fused buffer), each rounded down to the compressor's alignment: every piece of a
            chunk gets its own scale, as in a per-tensor exchange, for 4 bytes more per piece
            (only for a ``blockwise`` compressor, such as ``"sign"``). ``None``: one scale per chunk.
        timeout: per-collective timeout (seconds or a ``timedelta``; ``None``: 300 s); a
            peer that does not arrive raises :class:`CollectiveError`.
        flag_nonfinite: every wire slot carries one more byte, set when its sender's input
            held a NaN/Inf, and the owners pass the flags on in the all-gather; after each
            exchange :attr:`nonfinite` (a 0-dim bool tensor on the input's device: no host
            read) says whether any rank's input did -- the same on every rank, with no
            collective of its own. Some compressors' codes (Birder's ``+-1``) cannot carry a
            NaN themselves.
        **compressor_kwargs: passed to :func:`onebit.compress.get`.

    Examples:
        >>> car = onebit.comm.CompressedAllReduce("sign")
        >>> x = torch.tensor([0.5, -1.0, 2.0, -0.25, 1.0, 3.0, -2.0, 0.75])
        >>> car(x)  # world size 1: signs and one scale, ||x|| / sqrt(n), per chunk
        tensor([ 1.5762, -1.5762,  1.5762, -1.5762,  1.5762,  1.5762, -1.5762,  1.5762])
    """

    # Byte-meter label, and the bytes the wire slots are sized for (at least): the
    # hierarchical collective runs one instance per shard between nodes, and all shards'
    # slots must be the same size for the node's all-gather.
    _link = "flat"
    _min_slot = 0
    reduces_added_input = True
    _error_keys = ("worker_error", "server_error")

    def __init__(
        self,
        compressor: str | Compressor = "sign",
        group: Group = None,
        *,
        segments: Sequence[int] | None = None,
        timeout: float | timedelta | None = None,
        flag_nonfinite: bool = False,
        **compressor_kwargs: Any,
    ) -> None:
        super().__init__(compressor, group, timeout, compressor_kwargs)
        self.segments = _check_segments(segments, self.compressor)
        if not isinstance(flag_nonfinite, bool):
            raise TypeError(f"flag_nonfinite must be a bool, got {flag_nonfinite!r}")
        self.flag_nonfinite = flag_nonfinite
        self.nonfinite: Tensor | None = None
        self.server_error = ErrorFeedback("server")

    def _size(self, numel: int, device: torch.device) -> None:
        self._bounds = chunk_bounds(numel, self._world_size, self.compressor.alignment)
        self._codecs = chunk_codecs(self.compressor, self._bounds, self.segments)
        payload = max(c.wire_bytes(hi - lo) for c, (lo, hi) in zip(self._codecs, self._bounds))
        self._slot = max(payload, self._min_slot) + self.flag_nonfinite  # the flag: the slot's last byte
        self._send = torch.zeros(self._world_size * self._slot, dtype=torch.uint8, device=device)
        self._gather_slot = torch.zeros(self._slot, dtype=torch.uint8, device=device)

    @property
    def chunk(self) -> tuple[int, int]:
        """``[start, end)`` of the chunk this rank owns (after the first call)."""
        return self._bounds[self._rank]

    def __call__(self, tensor: Tensor, out: Tensor | None = None) -> Tensor:
        """Compressed average of ``tensor`` over the group; written to ``out`` when given."""
        return run_stages(self.stages(tensor, out))

    def stages(self, tensor: Tensor | None, out: Tensor | None = None) -> Stages:
        """``self(tensor, out)`` as three stages, for a caller that overlaps them with other work.

        Each ``next()`` waits for the collective the previous stage left in flight, computes,
        and yields the next one's :class:`Pending`: compress and all-to-all; average,
        re-compress and all-gather; decode (the generator then returns the result, see
        :func:`run_stages`). Several exchanges may interleave their stages, in the same order
        on every rank: that order is the order of their collectives. ``tensor`` and ``out``
        must stay untouched until the last stage.

        Without a model-sized input or output (the optimizers' overlapped buckets):
        ``tensor=None`` exchanges what the caller added into :meth:`input_buffer` (the worker
        error ``e``, which then holds ``x + e``) and returns the gathered bytes, which the
        caller decodes with :meth:`land` where it decides then. The same bytes and arithmetic
        as ``self(x)``.
        """
        if tensor is None:
            flat, error = None, self._added_input()
        else:
            tensor = self._prepare(tensor, out)
            flat = tensor.detach().reshape(-1)
            error = self.worker_error.buffer(flat.numel(), flat.device)
        gathered = yield from self._stages(flat, error)
        self._read_flags(gathered)
        if flat is None:
            return gathered
        result = self._output(out, flat)
        self._decode(gathered, result)
        return self._finish(result, tensor, out)

    def land(self, gathered: Tensor, target: Tensor | Consume) -> None:
        """Decode what ``stages(None)`` gathered into ``target``: a flat fp32 tensor, or
        ``consume(lo, hi, values)``, which takes the average one chunk ``[lo, hi)`` at a time, in
        chunk order (``values`` is scratch, valid during the call only)."""
        if isinstance(target, Tensor):
            self._decode(gathered, target.view(-1))
        else:
            self._hand_out(gathered, target)

    def input_buffer(self, numel: int, device: torch.device | str) -> Tensor:
        """The worker error ``e`` (flat fp32, ``numel`` values), for a caller that adds its input
        ``x`` to it in place and then exchanges it with ``stages(None, ...)`` -- no model-sized
        input buffer."""
        buffer = self.worker_error.buffer(numel, torch.device(device))
        self._prepare(buffer, None)
        return buffer

    def _added_input(self) -> Tensor:
        error = self.worker_error.error
        if error is None:
            raise RuntimeError("nothing was added to the worker error: call input_buffer() first")
        return error

    def _stages(self, flat: Tensor | None, error: Tensor) -> Stages:
        """Phases 1-2 and the all-gather of phase 3 in stages; returns every chunk's re-compressed
        bytes, in rank order (``flat=None``: ``error`` already holds ``x + e``)."""
        slot = self._slot
        with phase("compress"):
            for j, (lo, hi) in enumerate(self._bounds):
                payload = self._codecs[j].compress_ef(None if flat is None else flat[lo:hi], error[lo:hi])
                write_payload(payload, self._send[j * slot : (j + 1) * slot])
            if self.flag_nonfinite:
                # What is left of a NaN/Inf input (or of a code overflowing to Inf) is not finite.
                self._send.view(-1, slot)[:, -1] = nonfinite([error], error.device)
        inflight = all_to_all_bytes(self._send, self.group, self.timeout, self._link, async_op=True)
        yield inflight
        with phase("all_to_all"):
            received = inflight.wait()
        with phase("server"):
            lo, hi = self.chunk
            comp = self._codecs[self._rank]
            payloads = [read_payload(comp, received[i * slot : (i + 1) * slot], hi - lo)
                        for i in range(self._world_size)]
            # Average straight into the server error buffer: it then holds avg + error, the value to compress.
            server_error = self.server_error.buffer(hi - lo, received.device)
            comp.average(payloads, server_error, accumulate=True)
            write_payload(comp.compress_ef(None, server_error), self._gather_slot)
            if self.flag_nonfinite:
                self._gather_slot[-1] = received.view(-1, slot)[:, -1].amax()
        inflight = all_gather_bytes(self._gather_slot, self.group, self.timeout, self._link, async_op=True)
        yield inflight
        with phase("all_gather"):
            return inflight.wait()

    def _hand_out(self, gathered: Tensor, consume: Consume) -> None:
        """Decode the gathered chunks one at a time into scratch, each handed to ``consume``."""
        scratch = torch.empty(max(hi - lo for lo, hi in self._bounds), dtype=torch.float32, device=gathered.device)
        for j, (lo, hi) in enumerate(self._bounds):
            consume(lo, hi, self._decode_chunk(gathered, j, scratch[: hi - lo]))

    def _read_flags(self, gathered: Tensor) -> None:
        """:attr:`nonfinite` from the flag bytes of the gathered slots (any rank's input)."""
        if self.flag_nonfinite:
            self.nonfinite = gathered.view(-1, self._slot)[:, -1].amax() > 0

    def _decode(self, gathered: Tensor, result: Tensor) -> None:
        """Decompress the gathered chunks into the flat fp32 ``result``."""
        with phase("decode"):
            for j, (lo, hi) in enumerate(self._bounds):
                self._decode_chunk(gathered, j, result[lo:hi])

    def _decode_chunk(self, gathered: Tensor, j: int, out: Tensor) -> Tensor:
        lo, hi = self._bounds[j]
        payload = read_payload(self._codecs[j], gathered[j * self._slot : (j + 1) * self._slot], hi - lo)
        return self._codecs[j].decompress(payload, out=out)

    def state_dict(self) -> dict[str, Any]:
        """Worker and server errors, compressor state, and the sizes they belong to."""
        return {**self._base_state(), "server_error": self.server_error.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; on another world size the errors restart at zero (warning)."""
        if self._load_base_state(state):
            self.server_error.load_state_dict(state["server_error"])

    def reset(self) -> None:
        super().reset()
        self.server_error.reset()
