"""DiLoCo's checkpoints (:class:`DiLoCoCheckpoints`, a base of :class:`~onebit.optim._diloco.DiLoCo`):
what its ``state_dict`` holds -- the anchors, the inner and outer optimizers' states, the
synchronisations in flight, the collectives' errors -- the checks on loading one, and the state a
quorum hands a replica it takes in. The helpers every onebit ``state_dict`` shares are
``_checkpoint.py``'s; the fragments' own, ``_fragments.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ._checkpoint import own_state, saved_entry
from ._fragments import check_fragments_state, check_state, fragments_state, load_fragments
from ._wrapped import check_outer_state, load_flat_momentum

__all__ = ["DiLoCoCheckpoints"]

_log = logging.getLogger("onebit.optim")


class DiLoCoCheckpoints:
    """:meth:`state_dict` and :meth:`load_state_dict` of :class:`~onebit.optim._diloco.DiLoCo`,
    which holds what they save (its anchors in ``flat``, ``inner``, ``outer``, the fragments and
    its counters), and the state a quorum's replicas hand each other (``_give_state``,
    ``_take_state``)."""

    def state_dict(self) -> dict[str, Any]:
        """The anchors, the inner and outer optimizers' states, the synchronisations in flight
        (waited for, their averages saved) and the collectives' errors: everything needed to
        resume bit-exactly (loads with ``weights_only=True``)."""
        sd = super().state_dict()
        sd["state"] = {}  # the anchors are saved once, as the flat buffer below
        sd["onebit"] = {
            **saved_entry(world_size=self.world_size, rank=self.rank, step=self._step_count,
                          bytes_sent_total=self._bytes_total, buffers={"anchor": self.flat.buffers["anchor"]},
                          params=self.flat.params, synchronised=self.synchronised),
            "inner": self.inner.state_dict(), "outer": self.outer.state_dict(), "touched": list(self._touched),
            "streaming": [self.fragments, self.delay], "fragment_of": self._fragment_of, "collective": self.collective,
            "scales": self._scales,
            "error_feedback": [self.error_feedback, self.error_decay],
            **fragments_state(self._fragments),
        }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (also onebit 0.x's, whose outer momentum was a flat buffer);
        a state saved by another rank or on another world size restarts the errors (with a warning)."""
        self._load(state_dict, warn=True)

    def _load(self, state_dict: Mapping[str, Any], *, warn: bool) -> None:
        extra = check_state(state_dict, self.flat, fragments=self.fragments, delay=self.delay,
                            fragment_of=self._fragment_of, collective=self.collective, exact=self._fragments[0].exact,
                            error_feedback=self.error_feedback, error_decay=self.error_decay, scales=self._scales)
        if "outer" in extra:
            check_outer_state(self.outer_step, self._outer_given, extra["outer"])
        quorum = self._membership is not None
        own = own_state(extra, self.world_size, self.rank, owner="DiLoCo", restarts="the compression errors restart "
                        "at zero", warn=warn and not quorum)
        check_fragments_state(self._fragments, extra, own)
        self.wait()  # an exchange still in flight writes into the collectives' errors: done first
        self.flat.buffers["anchor"].copy_(extra["flat"]["anchor"])
        self.inner.load_state_dict(extra["inner"])
        self.param_groups = self.inner.param_groups  # one list again: loading made the inner's anew
        if "outer" in extra:
            self.outer.load_state_dict(extra["outer"])
        else:
            load_flat_momentum(self.outer, self._anchors, self.flat.split(extra["flat"]["outer_momentum"]))
        self._step_count, self._bytes_total = int(extra["step"]), int(extra["bytes_sent_total"])
        self._touched = [bool(t) for t in extra["touched"]]
        self._loaded = self._unchecked = True  # checked at the next step, with the parameters saved beside it
        self._own_parameters = extra.get("own_parameters")
        if not own and warn and quorum:  # a quorum's checkpoint: one replica's state, as a newcomer's
            _log.info("DiLoCo: rank %d of %d took the state of rank %d of %d; its compression errors restart at zero",
                      self.rank, self.world_size, int(extra.get("rank", self.rank)), extra["world_size"])
        load_fragments(self._fragments, extra, own, self.flat.device)

    def _give_state(self) -> dict[str, Any]:
        """What a replica taken into the quorum receives: the state dict and the parameters."""
        return {"state": self.state_dict(), "params": [p.detach() for p in self.flat.params]}

    def _take_state(self, healed: Mapping[str, Any]) -> None:
        """A live peer's :meth:`_give_state`, in the place of this replica's."""
        for f in self._fragments:  # what this replica had in flight is the state it gives up
            f.flight = f.retry = None
        self._load(healed["state"], warn=False)
        self._unchecked = False  # the parameters are the source's, below, and the others load nothing: no check
        with torch.no_grad():
            for p, value in zip(self.flat.params, healed["params"]):
                p.copy_(value)
