"""An optimizer's stages, declared in one place and carried out by the base class.

A :class:`Stage` is what one step of an algorithm sends and how (its
:class:`Wire`) and the state it keeps: its flat buffers, whether it
averages the gradients into a flat buffer of their own, and what entering it changes --
buffers renamed (values kept: 1-bit Adam's variance becomes its frozen preconditioner in
place), created (zeros), dropped, the collectives' errors restarted. An optimizer declares
its stages and the policy that moves between them; the base lays the state out, on a stage
change and when a checkpoint is loaded, and then calls the optimizer's ``_enter(stage)`` for
the math of the change. The policies:

* :class:`OneStage` -- one stage for every step (Birder, Comp-AMS, the controls);
* :class:`TwoStages` -- a warm-up until a :class:`~onebit.optim.FreezeSchedule` watching a
  buffer decides, then the compression stage (1-bit Adam, 1-bit LAMB);
* :class:`RefreshedStages` -- the same, with a refresh of the frozen state every few steps
  after the freeze (1-bit Adam's ``refresh_every``);
* :class:`StepStages` -- the stage of each step a function of its number (0/1 Adam's
  variance refreshes, synchronisations and local steps; an outer loop's inner steps and
  synchronisations fit the same way).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ._freeze import FreezeSchedule

__all__ = ["COMPRESSED_FORMED", "COMPRESSED_GRADIENT", "EXACT_GRADIENT", "LOCAL", "OneStage", "RefreshedStages",
           "Sends", "Stage", "StepStages", "TwoStages", "Wire"]

_log = logging.getLogger("onebit.optim")


class Sends(enum.Enum):
    """The kinds of step, by what they send. ``GRADIENTS``: the gradients' mean (an all-reduce, in
    the :class:`Wire`'s ``dtype``: exact in fp32); ``COMPRESSED_GRADIENTS``: the gradients,
    through the optimizer's compressed collectives; ``FORMED``: what the optimizer's ``_form``
    makes (momentum, an update), through them; ``NOTHING``: a step each rank takes on its own
    (0/1 Adam's local steps), whose ``_apply`` gets no average and reads the local gradients
    itself."""

    GRADIENTS = "gradients"
    COMPRESSED_GRADIENTS = "compressed gradients"
    FORMED = "formed"
    NOTHING = "nothing"


@dataclass(frozen=True)
class Wire:
    """What a stage sends, as an optimizer declares it: ``stage``, its name in
    ``stats["stage"]`` (``"warmup"``: uncompressed, ``"compressed"``, ...), the kind of step
    it ``sends``, and the ``dtype`` the gradients' all-reduce sums in (``Sends.GRADIENTS`` only;
    fp32: their exact mean). Read from the kind: ``formed``, the gradients are not what is sent
    (the optimizer forms it, or sends nothing) -- where the gradients are sent, their average
    exists and ``max_grad_norm`` clips it; where they are not, it never exists and each rank clips
    its own gradients before forming (what ``clip_grad_norm_`` does on one process);
    ``all_reduced``, the gradients' mean by an all-reduce; ``exchanged``, something is sent."""

    stage: str
    sends: Sends
    dtype: torch.dtype = torch.float32
    formed: bool = field(init=False)
    all_reduced: bool = field(init=False)
    exchanged: bool = field(init=False)

    def __post_init__(self) -> None:
        # set once (a frozen dataclass), read as plain attributes by every step
        object.__setattr__(self, "formed", self.sends in (Sends.FORMED, Sends.NOTHING))
        object.__setattr__(self, "all_reduced", self.sends is Sends.GRADIENTS)
        object.__setattr__(self, "exchanged", self.sends is not Sends.NOTHING)


EXACT_GRADIENT = Wire("warmup", Sends.GRADIENTS)
COMPRESSED_GRADIENT = Wire("compressed", Sends.COMPRESSED_GRADIENTS)
COMPRESSED_FORMED = Wire("compressed", Sends.FORMED)
LOCAL = Wire("local", Sends.NOTHING)


@dataclass(frozen=True)
class Stage:
    """One stage: ``wire`` (what its steps send, and how; ``wire.stage`` names it in
    ``stats["stage"]``), ``buffers`` (its flat state, by checkpoint name) and ``averages`` (a flat
    buffer of the averaged gradients, not checkpointed). Entering it from a stage laid out
    otherwise: the buffers named in ``renames`` take their new names (``{old: new}``, values
    kept), the others missing are created as zeros, those it lacks dropped, and with
    ``resets_errors`` the collectives' error-feedback buffers restart at zero (what they carry
    changes meaning)."""

    wire: Wire
    buffers: tuple[str, ...]
    averages: bool = False
    renames: Mapping[str, str] = field(default_factory=dict)
    resets_errors: bool = False

    def laid_out_as(self, other: Stage) -> bool:
        """Whether the two stages keep the same state (no change between them)."""
        return self.buffers == other.buffers and self.averages == other.averages


class OneStage:
    """One stage for every step (no warm-up)."""

    frozen_at = None
    schedule = None  # no warm-up to end
    variance_ratio = None
    required: tuple[str, ...] = ()  # the state_dict entries its load reads
    inside: Mapping[str, tuple[str, ...]] = {}  # and those it reads inside them

    def __init__(self, stage: Stage) -> None:
        self.current = stage
        self.stages = (stage,)

    def advance(self, step: int, buffers: Mapping[str, Tensor]) -> None:
        """After step ``step``: nothing changes."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class TwoStages:
    """``warmup`` until ``schedule`` decides, from the buffer named ``watch`` (the variance:
    its l1 norm for the automatic criterion), then ``compressed`` from the next step on;
    ``frozen_at`` is the last warm-up step (None before), ``updated_at`` the last step whose
    gradients entered the frozen state (the freeze; :class:`RefreshedStages`: or the last refresh).
    ``owner`` names the optimizer in the log."""

    required = ("freeze", "frozen_at")
    inside = {"freeze": ("history",)}

    def __init__(self, owner: str, warmup: Stage, compressed: Stage, schedule: FreezeSchedule, *,
                 watch: str) -> None:
        self.owner, self.watch = owner, watch
        self.stages = (warmup, compressed)
        self.schedule = schedule
        self.frozen_at: int | None = None
        self.updated_at: int | None = None
        self.current = warmup

    @property
    def variance_ratio(self) -> float | None:
        """The automatic freeze criterion's last ratio (:attr:`FreezeSchedule.ratio`)."""
        return self.schedule.ratio

    def advance(self, step: int, buffers: Mapping[str, Tensor]) -> None:
        """After step ``step``: a warm-up step feeds the criterion ``||v||_1``; the warm-up ends
        here when it says so."""
        if self.frozen_at is not None:
            return
        l1 = float(buffers[self.watch].sum()) if self.schedule.auto else None  # v >= 0: its sum is its l1 norm
        if self.schedule.should_freeze(step, l1):
            self.frozen_at = self.updated_at = step
            self.current = self.stages[1]
            _log.info("%s: warm-up ended at step %d; compression stage starts", self.owner, step)

    def state_dict(self) -> dict[str, Any]:
        return {"frozen_at": self.frozen_at, "updated_at": self.updated_at, "freeze": self.schedule.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.schedule.load_state_dict(state["freeze"])
        self.frozen_at = state["frozen_at"]
        self.updated_at = state.get("updated_at", self.frozen_at)  # (saved before refreshes: the freeze)
        self.current = self.stages[self.frozen_at is not None]


class RefreshedStages(TwoStages):
    """:class:`TwoStages`, then after the freeze the ``refresh`` stage every ``every`` steps after
    the last update of the frozen state (the freeze, or the last refresh: ``updated_at``, saved,
    so that a state saved without refreshes, or with another interval, refreshes next from its own
    last update) and the compressed stage at the others."""

    def __init__(self, owner: str, warmup: Stage, compressed: Stage, refresh: Stage, schedule: FreezeSchedule, *,
                 watch: str, every: int) -> None:
        super().__init__(owner, warmup, compressed, schedule, watch=watch)
        self.stages = (warmup, compressed, refresh)
        self.every = every

    def _next(self, step: int) -> Stage:
        """The stage of the step after ``step``."""
        if self.frozen_at is None:
            return self.stages[0]
        return self.stages[2 if step + 1 - self.updated_at >= self.every else 1]

    def advance(self, step: int, buffers: Mapping[str, Tensor]) -> None:
        if self.frozen_at is None:
            super().advance(step, buffers)
        elif self.current is self.stages[2]:
            self.updated_at = step
        self.current = self._next(step)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.current = self._next(int(state["step"]))


class StepStages:
    """The stage of step ``t`` is ``stage_of(schedule, t)``, from a ``schedule`` of step numbers
    (0/1 Adam's :class:`~onebit.optim.ZeroOneSchedule`); ``freeze_step``: the last step of the
    stages before the freeze, for ``stats["freeze_step"]`` (None: none)."""

    variance_ratio = None  # a fixed schedule: no freeze criterion
    required: tuple[str, ...] = ()  # the step alone, which every state_dict has
    inside: Mapping[str, tuple[str, ...]] = {}

    def __init__(self, stages: tuple[Stage, ...], stage_of: Callable[[Any, int], Stage], schedule: Any, *,
                 freeze_step: int | None = None) -> None:
        self.stages, self.stage_of, self.schedule, self.freeze_step = stages, stage_of, schedule, freeze_step
        self.done = 0
        self.current = stage_of(schedule, 1)

    @property
    def frozen_at(self) -> int | None:
        return self.freeze_step if self.freeze_step is not None and self.done >= self.freeze_step else None

    def advance(self, step: int, buffers: Mapping[str, Tensor]) -> None:
        """After step ``step``: the next stage is ``stage_of(schedule, step + 1)``."""
        self.done, self.current = step, self.stage_of(self.schedule, step + 1)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.done = int(state["step"])
        self.current = self.stage_of(self.schedule, self.done + 1)
