"""Birder's unbiased binary randomiser Q (eq. 5): +1 with probability (x + 1) / 2, else -1."""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .._checks import check_entries
from ..ops import packed_numel, stochastic_sign_compress_, unpack_signs
from ._base import Compressor, Payload

__all__ = ["StochasticSignCompressor"]


class StochasticSignCompressor(Compressor):
    """``Q(x) = +1`` w.p. ``p = (x + 1) / 2`` else ``-1``; unbiased for ``x`` in ``[-1, 1]``.

    Outside ``[-1, 1]`` the probability is clipped to ``[0, 1]`` (``Q`` returns ``sign(x)``),
    which is where error feedback takes over. The draws are the SplitMix64 stream of ``seed``
    (:func:`onebit.ops.splitmix_uniform`), each call taking the next ``n``; the count drawn so
    far is part of :meth:`state_dict`. Wire: ``ceil(n/8)`` bytes, no scale.
    """

    name = "stochastic_sign"
    alignment = 8
    stochastic = True
    kernels = True

    def __init__(self, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self.draws = 0

    def _next(self, n: int) -> int:
        """The stream's offset of the next ``n`` draws, which it then counts as drawn."""
        offset, self.draws = self.draws, self.draws + n
        return offset

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((torch.uint8, packed_numel(numel)),)

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        # The bits of compress_ef's rule (P(+1) = (x + 1) / 2), on a copy: x may be the caller's.
        return (stochastic_sign_compress_(x.clone(), seed=self.seed, offset=self._next(x.numel())),)

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        """As :meth:`Compressor.compress_ef`, in one fused pass that draws as it goes (on CPU;
        :func:`onebit.ops.stochastic_sign_compress_`)."""
        self._add_input(x, error)
        return Payload((stochastic_sign_compress_(error, seed=self.seed, offset=self._next(error.numel())),),
                       error.numel())

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        return unpack_signs(tensors[0], numel, 1.0, out=out)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "draws": self.draws}

    def check_state_dict(self, state: Any) -> None:
        # onebit 0.1 saved the generator's state in the place of the draws
        legacy = isinstance(state, Mapping) and "rng_state" in state
        check_entries(state, ("seed",) if legacy else ("seed", "draws"), "StochasticSignCompressor")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed = int(state["seed"])
        if "draws" in state:
            self.draws = int(state["draws"])
            return
        # onebit 0.1 drew from a torch.Generator, whose stream this one does not continue: the
        # draws go on from a position of the seed's stream set by the saved generator state
        # (2**56 positions: apart from any run's draws), the same on every resume of it.
        saved = state["rng_state"]
        self.draws = 0 if saved is None else int.from_bytes(
            hashlib.sha256(saved.numpy().tobytes()).digest()[:7], "little")
        warnings.warn("this checkpoint's stochastic_sign draws come from onebit 0.1's torch.Generator: they go on "
                      f"from position {self.draws} of the SplitMix64 stream of seed {self.seed}, so the resumed run's "
                      "random bits differ from those the saving version would have drawn", stacklevel=2)

    def __repr__(self) -> str:
        return f"StochasticSignCompressor(seed={self.seed})"
