"""Birder's unbiased binary randomiser Q (eq. 5): +1 with probability (x + 1) / 2, else -1."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..ops import packed_numel, stochastic_sign_compress_, unpack_signs
from ._base import Compressor, Payload

__all__ = ["StochasticSignCompressor"]


class StochasticSignCompressor(Compressor):
    """``Q(x) = +1`` w.p. ``p = (x + 1) / 2`` else ``-1``; unbiased for ``x`` in ``[-1, 1]``.

    Outside ``[-1, 1]`` the probability is clipped to ``[0, 1]`` (``Q`` returns ``sign(x)``),
    which is where error feedback takes over. Random numbers come from the compressor's
    own ``torch.Generator`` on the input's device, seeded with ``seed`` on first use; its
    state is part of :meth:`state_dict`. Wire: ``ceil(n/8)`` bytes, no scale.
    """

    name = "stochastic_sign"
    alignment = 8
    stochastic = True
    kernels = True

    def __init__(self, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self._generator: torch.Generator | None = None
        self._pending_state: Tensor | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        """The compressor's generator on ``device`` (created and seeded on first use)."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
            if self._pending_state is not None:
                self._generator.set_state(self._pending_state)
                self._pending_state = None
        return self._generator

    def wire_spec(self, numel: int) -> tuple[tuple[torch.dtype, int], ...]:
        return ((torch.uint8, packed_numel(numel)),)

    def _compress(self, x: Tensor) -> tuple[Tensor, ...]:
        # The bits of compress_ef's rule (P(+1) = (x + 1) / 2), on a copy: x may be the caller's.
        return (stochastic_sign_compress_(x.clone(), self._uniform(x)),)

    def _uniform(self, x: Tensor) -> Tensor:
        """One uniform draw in ``[0, 1)`` per value of ``x``, from the compressor's generator."""
        return torch.rand(x.numel(), generator=self.generator(x.device), device=x.device)

    def compress_ef(self, x: Tensor | None, error: Tensor, workspace: Tensor | None = None) -> Payload:
        """As :meth:`Compressor.compress_ef`, in one fused pass after the draws
        (:func:`onebit.ops.stochastic_sign_compress_`)."""
        self._add_input(x, error)
        return Payload((stochastic_sign_compress_(error, self._uniform(error)),), error.numel())

    def _decompress(self, tensors: tuple[Tensor, ...], numel: int, out: Tensor) -> Tensor:
        return unpack_signs(tensors[0], numel, 1.0, out=out)

    def state_dict(self) -> dict[str, Any]:
        if self._generator is not None:
            state = self._generator.get_state()
        else:
            state = self._pending_state
        return {"seed": self.seed, "rng_state": state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._generator = None
        self._pending_state = state["rng_state"]

    def __repr__(self) -> str:
        return f"StochasticSignCompressor(seed={self.seed})"
