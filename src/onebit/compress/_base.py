"""The compressor contract: one flat chunk in, a :class:`Payload` out, no network."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import ops
from .._checks import check_entries

__all__ = ["Compressor", "Payload", "check_float_tensor", "sub_signed_scale_"]


@dataclass(frozen=True)
class Payload:
    """A compressed chunk.

    ``tensors`` is exactly what goes on the wire, in the order and with the dtypes and
    lengths of :meth:`Compressor.wire_spec`; ``ctx`` stays on the compressing rank (the
    original shape and dtype, so a local round trip restores them).
    """

    tensors: tuple[Tensor, ...]
    numel: int
    ctx: Mapping[str, Any] = field(default_factory=dict)


_PIECE = 1 << 20  # values per piece of scratch where an error is formed in place


def sub_signed_scale_(c: Tensor, scale: Tensor) -> Tensor:
    """``c <- c - copysign(scale, c)`` in place -- the error a sign-times-scale code leaves
    (the sign bit decides, as the packed codes do) -- through scratch of a bounded size."""
    for lo in range(0, c.numel(), _PIECE):
        piece = c[lo : lo + _PIECE]
        piece.sub_(torch.copysign(scale, piece))
    return c


def check_float_tensor(x: object, name: str) -> Tensor:
    """Raise ``TypeError`` unless ``x`` is a floating-point tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype={x.dtype}")
    return x


class Compressor(abc.ABC):
    """Compresses one flat chunk of values.

    Capabilities are declared attributes, so collectives never dispatch on the class:

    * ``alignment`` -- chunk lengths that are a multiple of it pack without straddling
      bytes or blocks; collectives pad their chunking to ``world_size * alignment``.
    * ``stochastic`` -- ``compress`` draws random numbers from the compressor's own
      seeded generator, which :meth:`state_dict` saves.
    * ``kernels`` -- its compression or decoding runs :mod:`onebit.ops`' fused kernels, which
      :meth:`warm_up` loads ahead of the first call.
    * ``blockwise`` -- :meth:`with_blocks` gives the same code with one scale per block of a
      chunk: a collective hands it the pieces of each tensor in the chunk it compresses.

    All arithmetic is fp32; :meth:`decompress` returns fp32 values (restoring the input's
    shape and dtype when the payload's ``ctx`` is present, i.e. on the compressing rank).
    """

    name: ClassVar[str]
    alignment: int = 1
    stochastic: ClassVar[bool] = False
    kernels: ClassVar[bool] = False
    blockwise: ClassVar[bool] = False

    @abc.abstractmethod
    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        """``(dtype, length)`` of each payload tensor for a chunk of ``numel`` values."""

    @abc.abstractmethod
    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        """Compress a flat fp32 tensor to the wire tensors."""

    @abc.abstractmethod
    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        """Write the flat fp32 reconstruction of ``numel`` values into ``out``."""

    def with_blocks(self, block_sizes: Sequence[int]) -> Compressor:
        """This code with one scale per block of ``block_sizes`` (consecutive lengths adding up to a
        chunk's, each a multiple of 8 but the last); only where ``blockwise``."""
        raise TypeError(f"{type(self).__name__} has no per-block scales (blockwise=False)")

    def wire_bytes(self, numel: int) -> int:
        """Bytes a chunk of ``numel`` values occupies on the wire."""
        return sum(torch.empty((), dtype=dt).element_size() * n for dt, n in self.wire_spec(numel))

    def compress(self, x: Tensor) -> Payload:
        """Compress ``x`` (any shape, any float dtype) into a :class:`Payload`."""
        check_float_tensor(x, "x")
        flat = x.detach().reshape(-1).to(torch.float32)
        return Payload(self._compress(flat), flat.numel(), {"shape": tuple(x.shape), "dtype": x.dtype})

    def decompress(self, payload: Payload, out: Tensor | None = None) -> Tensor:
        """Reconstruct the values of ``payload``; ``out`` (flat fp32) avoids an allocation."""
        device = payload.tensors[0].device if payload.tensors else torch.device("cpu")
        if out is None:
            out = torch.empty(payload.numel, dtype=torch.float32, device=device)
        elif out.dtype != torch.float32 or out.numel() != payload.numel:
            raise ValueError(f"out must be a float32 tensor of {payload.numel} elements, got {out.dtype} of {out.numel()}")
        result = self._decompress(payload.tensors, payload.numel, out.reshape(-1))
        if "shape" in payload.ctx:
            result = result.reshape(payload.ctx["shape"]).to(payload.ctx["dtype"])
        return result

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        """Error-feedback compression: ``p = C(x + e)`` and ``e <- x + e - D(p)`` in place.

        ``error`` is a flat fp32 buffer holding ``e``; ``x=None`` means it already holds
        ``x + e``. ``workspace`` is an optional fp32 scratch buffer of the same size.
        """
        self._add_input(x, error)
        payload = Payload(self._compress(error), error.numel())
        if workspace is None:
            workspace = torch.empty_like(error)
        error.sub_(self._decompress(payload.tensors, payload.numel, workspace))
        return payload

    @staticmethod
    def _add_input(x: Tensor | None, error: Tensor) -> None:
        """``error += x`` (the compensated value ``c = x + e`` of :meth:`compress_ef`); nothing for ``x=None``."""
        if x is not None:
            check_float_tensor(x, "x")
            error.add_(x.reshape(-1))

    def warm_up(self, device: torch.device) -> None:
        """Compile or load the fused kernels (numba on CPU, Triton on CUDA) on ``device`` when the
        compressor runs them (``kernels``), so that its first real call does not pay it."""
        if self.kernels:
            ops.warm_up(device)

    def average(self, payloads: list[Payload], out: Tensor, *, accumulate: bool = False) -> Tensor:
        """``(D(p_0) + D(p_1) + ...) / len(payloads)`` -- summed in list order, then divided --
        written to ``out``, or added to it with ``accumulate`` (a server error, say)."""
        target = torch.empty_like(out) if accumulate else out
        self._sum(payloads, target)
        target.div_(len(payloads))
        return out.add_(target) if accumulate else out

    def _sum(self, payloads: list[Payload], out: Tensor) -> None:
        """``D(p_0) + D(p_1) + ...`` in list order, written to ``out`` (:meth:`average`'s sum)."""
        scratch = torch.empty_like(out)
        for i, payload in enumerate(payloads):
            if i == 0:
                self._decompress(payload.tensors, payload.numel, out)
            else:
                out.add_(self._decompress(payload.tensors, payload.numel, scratch))

    def from_wire(self, tensors: tuple[Tensor, ...], numel: int) -> Payload:
        """Rebuild a payload received from the wire (no ``ctx``)."""
        return Payload(tuple(tensors), numel)

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (random generator state for stochastic compressors)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def check_state_dict(self, state: Any) -> None:
        """Refuse (``ValueError``) a state :meth:`load_state_dict` cannot read, before anything is loaded."""
        check_entries(state, (), type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
