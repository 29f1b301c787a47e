"""Error-feedback buffers (1-bit Adam Algorithm 1 lines 7 and 10, Birder Algorithm 1 lines 9 and 13).

An :class:`ErrorFeedback` holds the error ``e`` of one compression site -- a worker's
``delta^(i)`` or a chunk owner's server error ``delta-bar`` -- and applies
``p = C(x + e)``, ``e <- x + e - D(p)``. The identity ``D(p) + e_new == x + e_old`` holds
in fp32 by construction (``e_new`` is computed as that difference).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .compress import Compressor, Payload

__all__ = ["ErrorFeedback"]

_log = logging.getLogger(__name__)


class ErrorFeedback:
    """The error buffer of one compression site, sized on first use (fp32, flat)."""

    __slots__ = ("name", "error")

    def __init__(self, name: str) -> None:
        self.name = name
        self.error: Tensor | None = None

    def buffer(self, numel: int, device: torch.device) -> Tensor:
        """The error buffer, created as zeros for ``numel`` values on first call."""
        if self.error is None:
            self.error = torch.zeros(numel, dtype=torch.float32, device=device)
        elif self.error.numel() != numel or self.error.device != device:
            raise ValueError(
                f"{self.name} error holds {self.error.numel()} values on {self.error.device}, "
                f"got a chunk of {numel} on {device}"
            )
        return self.error

    def compress(self, compressor: Compressor, x: Tensor) -> Payload:
        """``C(x + e)`` with ``e`` updated in place to the new compression error."""
        return compressor.compress_ef(x, self.buffer(x.numel(), x.device))

    def reset(self) -> None:
        """Forget the error (it is re-created as zeros on next use)."""
        self.error = None

    def state_dict(self) -> dict[str, Any]:
        return {"error": None if self.error is None else self.error.clone()}

    def load_state_dict(self, state: Mapping[str, Any], *, expect_numel: int | None = None) -> None:
        """Restore the error; with ``expect_numel``, a buffer of another size is dropped with a warning.

        A size mismatch happens when a checkpoint is loaded on a different world size
        (chunk boundaries move); a fresh zero error is then the only sound choice.
        """
        error = state["error"]
        if error is not None and expect_numel is not None and error.numel() != expect_numel:
            _log.warning(
                "%s error has %d values but %d are expected (different world size?); re-created as zeros",
                self.name,
                error.numel(),
                expect_numel,
            )
            error = None
        self.error = None if error is None else error.detach().to(torch.float32).clone().reshape(-1)
