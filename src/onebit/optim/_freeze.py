"""When to end the warm-up (1-bit Adam section 3.3 / 7.1, DESIGN "freeze_step='auto'").

The criterion is the paper's (section 7.1): the variance is stable once
``||v_t||_1 / ||v_{t-D}||_1 >= threshold`` (default 0.96, ``D = 1 / (1 - beta2)``). The
paper applies it after the learning-rate warm-up, when ``v`` shrinks towards a plateau.
Early in training ``v`` instead *grows* from zero (by design without bias correction), so
the ratio is far above 1 without ``v`` being stable; we therefore require the ratio inside
``[threshold, 1 / threshold]`` -- less than a 4% change either way over ``D`` steps. The
freeze is never before ``min_step`` (e.g. the learning-rate warm-up length) nor before
``D + 1`` steps of history exist, and at the latest at ``max_step``. ``v`` is computed from
the all-reduced gradient, so it is bit-identical on every rank and every rank takes the
decision on the same step without another collective.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..ops import zero_where_equal_
from ._base import check_positive

__all__ = ["FreezeSchedule", "TwoStage"]

_log = logging.getLogger("onebit.optim")


class FreezeSchedule:
    """Decides the last warm-up step: fixed (an int) or ``"auto"`` (the variance-norm criterion)."""

    def __init__(
        self,
        freeze_step: int | str,
        *,
        threshold: float,
        window: int,
        min_step: int,
        max_step: int | None,
    ) -> None:
        if freeze_step != "auto" and (isinstance(freeze_step, bool) or not isinstance(freeze_step, int)):
            raise TypeError(f"Invalid freeze_step value: {freeze_step!r} (expected an int >= 0 or 'auto')")
        if isinstance(freeze_step, int) and freeze_step < 0:
            raise ValueError(f"Invalid freeze_step value: {freeze_step}")
        threshold = check_positive("freeze_threshold", threshold)
        if threshold > 1.0:
            raise ValueError(f"Invalid freeze_threshold value: {threshold} (must be in (0, 1])")
        for name, value in (("freeze_window", window), ("min_freeze_step", min_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "freeze_window" else 0):
                raise ValueError(f"Invalid {name} value: {value!r}")
        if max_step is not None and (isinstance(max_step, bool) or not isinstance(max_step, int) or max_step < min_step):
            raise ValueError(f"Invalid max_freeze_step value: {max_step!r} (must be an int >= min_freeze_step)")
        self.freeze_step = freeze_step
        self.threshold = threshold
        self.window = window
        self.min_step = min_step
        self.max_step = max_step
        self.history: deque[float] = deque(maxlen=window + 1)

    @property
    def auto(self) -> bool:
        return self.freeze_step == "auto"

    def should_freeze(self, step: int, variance_l1: float | None) -> bool:
        """Called after warm-up step ``step``: True when the compression stage starts next step."""
        if not self.auto:
            return step >= self.freeze_step
        self.history.append(float(variance_l1))
        if self.max_step is not None and step >= self.max_step:
            return True
        if step < self.min_step or len(self.history) <= self.window:
            return False
        past = self.history[0]
        if past <= 0:
            return False
        ratio = self.history[-1] / past
        return self.threshold <= ratio <= 1.0 / self.threshold

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=self.window + 1)


class TwoStage:
    """Warm-up → compression bookkeeping shared by 1-bit Adam and 1-bit LAMB (a mixin for
    :class:`onebit.optim.OnebitOptimizer` subclasses, which provide ``_step_count``)."""

    freeze: FreezeSchedule
    _frozen_at: int | None
    _step_count: int
    _has_unused: bool
    _grad: Tensor | None
    _new_grad_buffer: Any
    allreduce: Any

    def _init_two_stage(
        self,
        freeze_step: int | str,
        beta2: float,
        *,
        threshold: float,
        window: int | None,
        min_step: int,
        max_step: int | None,
    ) -> None:
        self.freeze = FreezeSchedule(
            freeze_step,
            threshold=threshold,
            window=round(1.0 / (1.0 - beta2)) if window is None else window,
            min_step=min_step,
            max_step=max_step,
        )
        self._frozen_at = None
        self._has_unused = False

    def _stage(self) -> str:
        return "warmup" if self._frozen_at is None else "compressed"

    def _freeze_step_stat(self) -> int | None:
        return self._frozen_at

    def _after_warmup_step(self, variance: Tensor) -> None:
        """Feed the criterion ``||v||_1``; on the decision, record the step and call ``_on_freeze``."""
        l1 = float(variance.sum()) if self.freeze.auto else None  # v >= 0: its sum is its l1 norm
        if self.freeze.should_freeze(self._step_count, l1):
            self._frozen_at = self._step_count
            _log.info("%s: warm-up ended at step %d; compression stage starts", type(self).__name__, self._frozen_at)
            self._on_freeze()
            self._grad = None  # the compression stage reads each rank's own gradients where they lie

    def _on_freeze(self) -> None:
        raise NotImplementedError

    def _warn_early_freeze(self) -> None:
        """Warn when the variance is frozen without bias correction while ``1 - beta2^T`` is small.

        The raw EMA then holds only that fraction of the gradient's second moment, so every
        compressed step is ``1 / sqrt(1 - beta2^T)`` times larger than Adam's (3x at T = 120,
        beta2 = 0.999) for the rest of training -- the divergence found by the convergence
        benchmark on short runs.
        """
        beta2 = max(b for _, b in self._hyper("betas"))  # type: ignore[attr-defined]
        filled = 1.0 - beta2**self._frozen_at
        if filled < 0.5:
            warnings.warn(
                f"{type(self).__name__}: variance frozen at step {self._frozen_at} without bias correction, "
                f"when its EMA holds only {filled:.0%} of the second moment (1 - beta2^T); compressed steps will "
                f"be {1 / math.sqrt(filled):.1f}x Adam's. Use bias_correction=True (the default) or freeze after "
                f"step {math.ceil(math.log(0.5) / math.log(beta2))}.",
                stacklevel=4,
            )

    def _unused_marker(self) -> tuple[Tensor, float]:
        """``(buffer, value)``: the values where the flat frozen-state ``buffer`` equals ``value``
        had a zero frozen variance (no gradient through the warm-up)."""
        raise NotImplementedError

    def _note_unused(self) -> None:
        """Record whether any value is unused (see :meth:`_unused_marker`; no mask is kept: it
        is re-derived from the frozen state when needed, at no memory cost between steps)."""
        buffer, value = self._unused_marker()
        count = int((buffer == value).sum())
        self._has_unused = count > 0
        if count:
            _log.info("%s: %d values had a zero gradient through the warm-up; their momentum is held at zero",
                      type(self).__name__, count)

    def _exchange_momentum(self, m: Tensor) -> None:
        """The compressed all-reduce of the fused momentum, in place, then the zero-variance mask.

        1-bit compression gives every value a magnitude; where ``v_frozen == 0`` (the value
        never had a gradient in the warm-up: an embedding row never looked up, a frozen
        tensor) the step would be ``lr * scale / eps``. DeepSpeed asks users for an
        ``exp_avg_mask``; ``v == 0`` is that mask, derived instead of asked for.
        """
        self.allreduce(m, out=m)
        self._mask_unused(m)

    def _mask_unused(self, m: Tensor) -> None:
        """Zero the momentum where the frozen variance is zero (see :meth:`_exchange_momentum`)."""
        if self._has_unused:
            zero_where_equal_(m, *self._unused_marker())

    def _two_stage_state(self) -> dict[str, Any]:
        return {"frozen_at": self._frozen_at, "freeze": self.freeze.state_dict()}

    def _load_two_stage_state(self, state: Mapping[str, Any]) -> None:
        self.freeze.load_state_dict(state["freeze"])
        self._frozen_at = state["frozen_at"]
        if self._frozen_at is None:  # the warm-up averages the gradients in a flat buffer
            self._grad = self._grad if self._grad is not None else self._new_grad_buffer()
        else:
            self._grad = None
            self._note_unused()
