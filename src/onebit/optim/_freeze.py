"""When to end the warm-up (1-bit Adam section 3.3 / 7.1, docs/design.md, "The automatic freeze"), and
0/1 Adam's schedule of variance refreshes and synchronisations (:class:`ZeroOneSchedule`), with the
sums of its interval of local steps so far (:class:`Interval`).

The criterion is the paper's (section 7.1): the variance is stable once
``||v_t||_1 / ||v_{t-D}||_1 >= threshold`` (0.96, ``D = 1 / (1 - beta2)``). The paper
applies it after the learning-rate warm-up, when ``v`` shrinks towards a plateau. Early in
training the raw ``v`` instead *grows* from zero (its EMA filling), so the ratio is far above
1 without ``v`` being stable; we therefore require the ratio inside
``[threshold, 1 / threshold]``.

On the raw EMA the ratio can only approach 1 once the EMA has filled, thousands of steps at
``beta2 = 0.999``: a run of a few hundred steps would never leave the warm-up. Where the
frozen variance is bias-corrected (1-bit Adam's default), or its scale does not set the step
(1-bit LAMB's trust ratios), the criterion reads the bias-corrected ``v_t / (1 - beta2^t)``
instead, an estimate of ``E[g^2]`` from the first step on, over ``D = 0.1 / (1 - beta2)``
steps (100 at 0.999). 1-bit Adam's threshold there is 0.85: the estimate the compression stage
will divide by has moved less than 15% over the last ``D`` steps. That estimate is an average since step 1
and goes on sinking slowly for the whole of a run at a constant learning rate (0.89 at step
500 and 0.95 at 1,000 on the 12.9M GPT of the benchmarks), so 0.96 over 100 steps is never met
on a practical run; 0.85 is met there between steps 395 and 460, where a freeze by hand ended
ahead of never freezing, and not at step 204, where a freeze stalled
(``benchmarks/results/frozen-preconditioner/REPORT.md``). 1-bit LAMB keeps 0.96: with 0.85 its
compressed stage fell further behind LAMB on a large, sparsely used embedding
(``benchmarks/results/convergence-auto-1000/``).

The freeze is never before ``min_step`` (e.g. the learning-rate warm-up length) nor before
``D + 1`` steps of history exist, and at the latest at ``max_step`` (1-bit Adam with its default
variance refreshes: after one window, 100 steps, since a refreshed variance need not wait; 1-bit
LAMB: after four, 400 steps). ``v`` is computed from
the all-reduced gradient, so it is bit-identical on every rank and every rank takes the
decision on the same step without another collective.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .._checks import check_entries, check_positive, check_positive_int

__all__ = ["FreezeSchedule", "Interval", "ZeroOneSchedule", "freeze_schedule", "warn_early_freeze"]

_RAW_THRESHOLD = 0.96  # the paper's, over 1 / (1 - beta2) steps of the raw EMA
_CORRECTED_THRESHOLD = 0.85  # 1-bit Adam's, over 0.1 / (1 - beta2) steps of the bias-corrected variance


class FreezeSchedule:
    """Decides the last warm-up step: fixed (an int) or ``"auto"`` (the variance-norm criterion,
    on the variance bias-corrected with ``corrected_beta2`` when given: ``v_t / (1 - beta2^t)``).
    ``max_windows``: without a ``max_step``, freeze after that many windows at the latest (never
    before ``min_step``; None: no bound)."""

    def __init__(
        self,
        freeze_step: int | str,
        *,
        threshold: float,
        window: int,
        min_step: int,
        max_step: int | None,
        corrected_beta2: float | None = None,
        max_windows: int | None = None,
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
        if max_step is None and max_windows is not None:
            max_step = max(min_step, max_windows * window)
        self.freeze_step = freeze_step
        self.threshold = threshold
        self.window = window
        self.min_step = min_step
        self.max_step = max_step
        self.corrected_beta2 = corrected_beta2
        self.history: deque[float] = deque(maxlen=window + 1)

    @property
    def auto(self) -> bool:
        return self.freeze_step == "auto"

    @property
    def ratio(self) -> float | None:
        """The automatic criterion's last ``||v_t||_1 / ||v_{t-D}||_1`` (None: no ``"auto"``, or
        fewer than ``D + 1`` steps of history): the freeze comes when it is inside
        ``[threshold, 1 / threshold]``."""
        if not self.auto or len(self.history) <= self.window or self.history[0] <= 0:
            return None
        return self.history[-1] / self.history[0]

    def should_freeze(self, step: int, variance_l1: float | None) -> bool:
        """Called after warm-up step ``step``: True when the compression stage starts next step."""
        if not self.auto:
            return step >= self.freeze_step
        b2 = self.corrected_beta2
        self.history.append(float(variance_l1) / (1.0 if b2 is None else 1.0 - b2**step))
        if self.max_step is not None and step >= self.max_step:
            return True
        ratio = self.ratio
        if step < self.min_step or ratio is None:
            return False
        return self.threshold <= ratio <= 1.0 / self.threshold

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=self.window + 1)


class ZeroOneSchedule:
    """The steps of 0/1 Adam's two policies, as DeepSpeed 0.19.6 counts them.

    * ``T_v`` (variance refreshes), up to ``var_freeze_step``: every step while the interval
      ``I`` is 1, then the steps ``t`` with ``(t + offset) % I == 0``; ``I`` doubles after every
      ``var_update_scaler`` refreshes (the paper's kappa), up to ``max_refresh_interval`` (not in
      the paper or DeepSpeed; ``None``, the default here: no bound; :class:`~onebit.ZeroOneAdam`'s
      own default is 8). After ``var_freeze_step`` the variance is frozen.
    * ``T_u`` (synchronisations): every step up to ``var_freeze_step``; after it, the steps with
      ``(t + offset) % H == 0`` where ``H`` starts at 1 and doubles every ``local_step_scaler``
      steps, at most ``local_step_clipper`` (the paper's H).

    ``refresh_weight``: how much of the variance a refresh replaces. ``"refresh"`` (Algorithm
    1's and DeepSpeed's): one step's, ``v <- beta2 v + (1 - beta2) g^2``, bias-corrected by
    ``1 - beta2^k`` with ``k`` the refreshes so far; ``"steps"``: as if each step since the
    last refresh had seen ``g`` (a *span* of ``s`` steps, ``v <- beta2^s v + (1 - beta2^s)
    g^2``), bias-corrected by ``1 - beta2^t`` with ``t`` the last refresh's step
    (:class:`~onebit.ZeroOneAdam`'s default).

    ``offset`` is 1 in DeepSpeed, whose step counter includes its first ``step()``, which
    only allocates state; onebit counts from the first step that updates (``offset=0``).

    Examples:
        >>> s = onebit.optim.ZeroOneSchedule(var_freeze_step=40, var_update_scaler=4,
        ...                                  local_step_scaler=8, local_step_clipper=4)
        >>> [t for t in range(1, 41) if s.refreshes(t)]
        [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28, 32, 40]
        >>> [s.interval(t) for t in (40, 48, 49, 57, 90)]
        [1, 1, 2, 4, 4]
        >>> capped = onebit.optim.ZeroOneSchedule(20, 4, 8, 4, max_refresh_interval=2)
        >>> [t for t in range(1, 21) if capped.refreshes(t)]
        [1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    """

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                 local_step_clipper: int, *, max_refresh_interval: int | None = None,
                 refresh_weight: Literal["refresh", "steps"] = "refresh", offset: int = 0) -> None:
        if refresh_weight not in ("steps", "refresh"):
            raise ValueError(f"Invalid refresh_weight value: {refresh_weight!r} (expected 'steps' or 'refresh')")
        self.refresh_weight = refresh_weight
        self.var_freeze_step = check_positive_int("var_freeze_step", var_freeze_step)
        self.var_update_scaler = check_positive_int("var_update_scaler", var_update_scaler)
        self.local_step_scaler = check_positive_int("local_step_scaler", local_step_scaler)
        self.local_step_clipper = check_positive_int("local_step_clipper", local_step_clipper)
        self.max_refresh_interval = None if max_refresh_interval is None else check_positive_int(
            "max_refresh_interval", max_refresh_interval)
        self.offset = offset
        # The refresh steps, one block of var_update_scaler per interval (a few hundred without a
        # bound on the interval; var_freeze_step / max_refresh_interval with one).
        self._refresh_steps: list[int] = []
        interval, count, counter = 1, 0, 1 + offset
        while True:
            counter = -(-counter // interval) * interval
            if counter - offset > self.var_freeze_step:
                break
            self._refresh_steps.append(counter - offset)
            counter += 1
            count += 1
            if count == self.var_update_scaler:
                interval, count = 2 * interval, 0
                if self.max_refresh_interval is not None:
                    interval = min(interval, self.max_refresh_interval)

    def refreshes(self, step: int) -> bool:
        """Whether the variance is refreshed at ``step`` (``T_v``)."""
        i = bisect.bisect_left(self._refresh_steps, step)
        return i < len(self._refresh_steps) and self._refresh_steps[i] == step

    def refreshes_through(self, step: int) -> int:
        """How many refreshes steps ``1 .. step`` hold (the variance's bias-correction exponent
        with each refresh weighing one step, Algorithm 1's)."""
        return bisect.bisect_right(self._refresh_steps, step)

    def last_refresh(self, step: int) -> int:
        """The last refresh step up to ``step`` (0 before the first)."""
        i = bisect.bisect_right(self._refresh_steps, step)
        return self._refresh_steps[i - 1] if i else 0

    def span(self, step: int) -> int:
        """The steps whose gradients the refresh at ``step`` stands for (1 with ``"refresh"``)."""
        return step - self.last_refresh(step - 1) if self.refresh_weight == "steps" else 1

    def variance_age(self, step: int) -> int:
        """``k`` of the variance's bias correction ``1 - beta2^k`` at ``step``."""
        return self.last_refresh(step) if self.refresh_weight == "steps" else self.refreshes_through(step)

    def interval(self, step: int) -> int:
        """The local-step interval ``H`` in force at ``step``."""
        if step <= self.var_freeze_step:
            return 1
        doublings = (step - self.var_freeze_step - 1) // self.local_step_scaler
        if doublings >= self.local_step_clipper.bit_length():
            return self.local_step_clipper
        return min(self.local_step_clipper, 1 << doublings)

    def synchronises(self, step: int) -> bool:
        """Whether ``step`` ends with a 1-bit synchronisation (``T_u``)."""
        return (step + self.offset) % self.interval(step) == 0


class Interval:
    """0/1 Adam's interval of local steps so far (the steps since the last ``T_u`` step), per
    parameter: ``lr_sums``, its learning rates summed; ``weight_sums``, its ``lr / bc1`` summed;
    ``touched``, whether it took a step. The same on every rank: the ranks' parameters differ
    inside an interval, never its sums. (The momentum it accumulated is the optimizer's flat
    buffer ``accum``.)"""

    __slots__ = ("lr_sums", "weight_sums", "touched")
    _KEYS = ("lr_sums", "weight_sums", "touched")

    def __init__(self, n: int) -> None:
        self.lr_sums: list[float] = [0.0] * n
        self.weight_sums: list[float] = [0.0] * n
        self.touched: list[bool] = [False] * n

    def add(self, lrs: Sequence[float], weights: Sequence[float], active: Sequence[bool]) -> None:
        """A step's ``lrs`` and ``weights`` into the sums of the parameters it steps (``active``)."""
        for i, lr in enumerate(lrs):
            if active[i]:
                self.lr_sums[i] += lr
                self.weight_sums[i] += weights[i]
                self.touched[i] = True

    def state_dict(self) -> dict[str, list[Any]]:
        return {"lr_sums": list(self.lr_sums), "weight_sums": list(self.weight_sums), "touched": list(self.touched)}

    @classmethod
    def check_state(cls, state: Mapping[str, Any]) -> None:
        """Refuse (``ValueError``) a saved interval lacking one of its entries."""
        check_entries(state, cls._KEYS, "ZeroOneAdam interval")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.lr_sums = [float(x) for x in state["lr_sums"]]
        self.weight_sums = [float(x) for x in state["weight_sums"]]
        self.touched = [bool(x) for x in state["touched"]]


def freeze_schedule(freeze_step: int | str, beta2: float, *, threshold: float | None, window: int | None,
                    min_step: int, max_step: int | None, corrected: bool,
                    max_windows: int | None = None) -> FreezeSchedule:
    """:class:`FreezeSchedule` with the threshold and window ``D`` unless given: 0.85 and
    ``round(0.1 / (1 - beta2))`` when the criterion reads the bias-corrected variance
    (``corrected``), else the paper's 0.96 and ``round(1 / (1 - beta2))``."""
    if threshold is None:
        threshold = _CORRECTED_THRESHOLD if corrected else _RAW_THRESHOLD
    if window is None:
        window = max(1, round((0.1 if corrected else 1.0) / (1.0 - beta2)))
    return FreezeSchedule(freeze_step, threshold=threshold, window=window, min_step=min_step, max_step=max_step,
                          corrected_beta2=beta2 if corrected else None, max_windows=max_windows)


def warn_early_freeze(owner: str, frozen_at: int, beta2: float) -> None:
    """Warn when the variance is frozen without bias correction while ``1 - beta2^T`` is small.

    The raw EMA then holds only that fraction of the gradient's second moment, so every
    compressed step is ``1 / sqrt(1 - beta2^T)`` times larger than Adam's (3x at T = 120,
    beta2 = 0.999) for the rest of training -- the divergence found by the convergence
    benchmark on short runs.
    """
    filled = 1.0 - beta2**frozen_at
    if filled < 0.5:
        warnings.warn(
            f"{owner}: variance frozen at step {frozen_at} without bias correction, "
            f"when its EMA holds only {filled:.0%} of the second moment (1 - beta2^T); compressed steps will "
            f"be {1 / math.sqrt(filled):.1f}x Adam's. Use bias_correction=True (the default) or freeze after "
            f"step {math.ceil(math.log(0.5) / math.log(beta2))}.",
            stacklevel=7,  # warn_early_freeze, _enter, _advance, step, two torch.optim wrappers
        )
