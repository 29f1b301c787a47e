"""What an algorithm of the 1-bit family writes: one contract in three phases, which
:class:`~onebit.optim._base.OnebitOptimizer`'s ``step()`` runs in order:

1. ``_form(i, lo, hi, grad, live, group, step, scratch, out, agreed)``: what goes on the wire
   for the flat values ``[lo, hi)`` of parameter ``i``, from its gradient and the state as it
   was; the state is not touched where the step is not yet ``agreed`` (a bucket formed during
   backward, before the ranks agreed that the step is taken). Only stages whose
   :class:`~onebit.optim._stages.Wire` is ``formed`` have one; the others send the gradients.
2. The exchange: the exact fp32 mean, or the collectives made by the ``collective`` factory
   handed to :meth:`~onebit.optim._base.OnebitOptimizer._drive`.
3. ``_landing(wire)``: where the average lands -- a flat buffer, or a callable that takes it
   chunk by chunk -- and ``_apply(wire, average, members=None)``: the step, where the state
   moves (of parameters ``members`` alone, as each bucket lands, where the optimizer
   ``applies_by_bucket``).

The stages are declared (``_stages``, ``_stages.py``): each stage's wire and flat buffers
(``_flat.py``), and the policy that moves between them; the base lays the state out at a
stage change and calls ``_enter(stage)`` for the math of it. The math of each algorithm is a
set of plain functions in its file, with the paper's equation numbers; the class validates
arguments, owns the state and calls them. A checkpoint saves what the subclass adds
(``_extra_state``) beside the flat buffers, stages and collectives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from .. import comm
from ._stages import OneStage, Stage, StepStages, TwoStages, Wire

__all__ = ["Algorithm"]


class Algorithm(Optimizer):
    """The declarations and methods a 1-bit-family optimizer writes; it subclasses
    :class:`~onebit.optim._base.OnebitOptimizer`, whose step calls the phases (and whose state, in
    :class:`~onebit.optim._state.FlatStateOptimizer`, the stages' and the checkpoints' hooks)."""

    _stages: OneStage | TwoStages | StepStages  # set by the subclass before OnebitOptimizer.__init__ runs

    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """Write into ``out`` the values ``[lo, hi)`` (flat offsets, inside parameter ``i``) of what
        this rank sends at step ``step``. ``grad``: that block of the parameter's gradient in
        logical order (None where it has none here); ``live``: the parameter takes its gradient
        this step, else its state enters as it is; ``group``: its param group; ``scratch``: two
        rows of ``hi - lo`` fp32 values. ``out`` is ``scratch[0]``, or (the one-shot exchange)
        the block of the landing buffer itself, which may be the state the average replaces:
        write it last, element by element. ``agreed``: every rank agreed to take this step (the
        one-shot exchange, launched in ``step()``); the state may then move here, once, where
        ``_apply`` would only repeat the work -- otherwise (a bucket formed during backward) it
        must stay as it is."""
        raise NotImplementedError

    def _landing(self, wire: Wire) -> Tensor | comm.Consume:
        """Where this step's average lands: a flat fp32 buffer of the model's size, or
        ``consume(lo, hi, values)``, handed it chunk by chunk. Asked once per step, right before
        the buffer is first written."""
        raise NotImplementedError

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        """The step, on the landed ``average`` (None where it was consumed chunk by chunk, or where
        the wire is not ``exchanged``). ``members``: where :attr:`~onebit.optim._base.OnebitOptimizer.applies_by_bucket`, the step of
        these parameters alone, ``average`` landed for them (and perhaps not yet elsewhere), as
        each bucket lands; every parameter's part, in any order, is the step of all (None)."""
        raise NotImplementedError

    def _enter(self, stage: Stage) -> None:
        """The math of entering ``stage``, its buffers already laid out (e.g. the variance made the
        frozen preconditioner); called once, right after the step that ended the previous stage."""

    # The entries of _extra_state() that _load_extra_state() cannot do without: a state lacking one
    # is refused before anything is loaded (the others are read where present, as from older states)
    _extra_required: tuple[str, ...] = ()

    def _extra_state(self) -> dict[str, Any]:
        """What the subclass checkpoints beyond the flat buffers, stages and collectives."""
        return {}

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        """Restore :meth:`_extra_state`; ``own_state`` is False when the state was saved by another
        rank or on another world size (the per-rank buffers then restart)."""

    def _check_extra_state(self, state: Mapping[str, Any]) -> None:
        """Refuse (``ValueError``) a state this optimizer cannot resume from, before anything is
        loaded: saved with arguments that shape the exchange or its schedule differently."""
