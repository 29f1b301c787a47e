"""The state of a 1-bit-family optimizer (:class:`FlatStateOptimizer`, the class under
:class:`~onebit.optim._base.OnebitOptimizer`): the parameters placed (or their FSDP2 shards) and
checked, the flat buffers laid out as each stage declares them (``_stages.py``, ``_flat.py``),
the counters ``stats`` reports, and the checkpoints. The step that moves this state, and the
exchange it drives, are the class above's (``_base.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .. import comm
from .._checks import check_entries
from ._buckets import Buckets
from ._checkpoint import check_buffers, onebit_entry, own_state, saved_entry
from ._contract import Algorithm
from ._ddp import check_ddp
from ._exchange import Exchange
from ._setup import check_groups, common_options, place
from ._stages import Stage

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["FlatStateOptimizer"]


class FlatStateOptimizer(Algorithm):
    """What a 1-bit-family optimizer holds and how it is saved: process group, flat state laid out
    per stage, counters, checkpoints. :class:`~onebit.optim._base.OnebitOptimizer` adds the step and
    the exchange (built by its ``_drive``, which sets ``_exchange`` and, with the overlap,
    ``_buckets``); every optimizer subclasses that one."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        group: comm.Group,
        **options: Unpack[CommonOptions],
    ) -> None:
        options = common_options(options, type(self).__name__)
        self.max_grad_norm = options["max_grad_norm"]
        self.on_nonfinite = options["on_nonfinite"]
        self.check_replicas_every = options["check_replicas_every"]
        super().__init__(params, defaults)
        check_groups(self.param_groups, defaults, type(self))
        self.process_group = comm.resolve_group(group)
        self.timeout = options["timeout"]
        self.world_size = comm.get_world_size(self.process_group)
        self.rank = comm.get_rank(self.process_group)
        self._shards, self.flat = place(self.param_groups, self.process_group, self.timeout, type(self).__name__,
                                        max_grad_norm=self.max_grad_norm, broadcast=options["broadcast_parameters"])
        self._step_count = 0
        self._active: list[bool] = [True] * len(self.flat.params)
        self._skipped = 0
        self._bytes_total = 0
        self._bytes_last = 0
        self._last_stage: str | None = None
        self._ddp_checked = False
        self._loaded = False  # the state came from load_state_dict
        self._unchecked = True  # the first exchange checks that the ranks hold states of one step (fresh or loaded)
        self._own_parameters: list[int] | None = None  # the fingerprint kept with a state between synchronisations
        self._exchange: Exchange | None = None
        self._buckets: Buckets | None = None  # the overlap's hooks
        self._landing_now: Tensor | comm.Consume | None = None  # this step's, once asked
        self._grad: Tensor | None = None  # the averaged gradients, in a stage that averages them
        self._lay_out(self._stages.current)
        self._ddp_wrapped = check_ddp(self.flat.params, type(self).__name__, self.world_size, construction=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the fused flat state and the collectives are sized for the
        parameters given then, and every rank must add the same ones at the same step."""
        if hasattr(self, "flat"):
            raise ValueError(
                f"{type(self).__name__} cannot add a param group after construction (its flat state and "
                "collectives are sized for the parameters it was built with); pass every group to the "
                "constructor, with lr=0 for groups that start later"
            )
        super().add_param_group(param_group)

    @property
    def synchronised(self) -> bool:
        """Whether the replicas are meant to be bit-identical now (False only inside an interval
        of 0/1 Adam's local steps, where the parameters of the last synchronisation are kept in the
        flat buffer ``anchor``)."""
        return True

    @property
    def freeze(self) -> Any:
        """What ends the warm-up: a :class:`onebit.optim.FreezeSchedule`, 0/1 Adam's
        :class:`onebit.optim.ZeroOneSchedule`, or None without one."""
        return self._stages.schedule

    def _lay_out(self, stage: Stage) -> None:
        """The flat state of ``stage``: its renamed buffers keep their values, the others missing
        start at zero, those it lacks go; the averaged gradients' buffer where it averages them."""
        buffers = self.flat.buffers
        for old, new in stage.renames.items():
            if old in buffers and new not in buffers:
                self.flat.rename(old, new)
        for name in stage.buffers:
            if name not in buffers:
                self.flat.new(name)
        for name in [n for n in buffers if n not in stage.buffers]:
            del buffers[name]
        if not stage.averages:
            self._grad = None
        elif self._grad is None:
            self._grad = self.flat.zeros()
        self._link_state()

    def _link_state(self) -> None:
        """Point ``self.state[p][name]`` at the flat buffers' views (for inspection)."""
        views = {name: self.flat.views(name) for name in self.flat.buffers}
        for i, p in enumerate(self._shards.params):
            self.state[p] = {name: v[i] for name, v in views.items()}

    @property
    def stats(self) -> dict[str, Any]:
        """``step``, ``stage`` (of the last step), ``bytes_sent`` (this rank, last step),
        ``bytes_sent_total``, ``freeze_step`` (last warm-up step, once known),
        ``variance_ratio`` (with ``freeze_step="auto"``, the criterion's last
        ``||v_t||_1 / ||v_{t-D}||_1``: the warm-up ends once it is within ``freeze_threshold``
        of 1; None before ``D`` steps or without the criterion) and ``skipped_steps``; with
        ``overlap=True``, and with the warm-up's exchange during backward (the default of 1-bit
        Adam and 1-bit LAMB; 0 in their compression stage), also ``overlap``, the fraction of the
        last step's exchange that ran alongside backward, and ``buckets_in_backward``, the
        buckets launched there."""
        return {
            "step": self._step_count,
            "stage": self._last_stage or self._stages.current.wire.stage,
            "bytes_sent": self._bytes_last,
            "bytes_sent_total": self._bytes_total,
            "freeze_step": self._stages.frozen_at,
            "variance_ratio": self._stages.variance_ratio,
            "skipped_steps": self._skipped,
            **({} if self._buckets is None else self._buckets.stats()),
        }

    def wait(self) -> None:
        """Nothing of this optimizer's exchange stays in flight after ``step()``: returns at once
        (as :meth:`onebit.DiLoCo.wait`, which waits for a streamed synchronisation, so that one
        training loop serves every onebit optimizer)."""

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Param groups plus everything needed to resume bit-exactly (loads with ``weights_only=True``)."""
        sd = super().state_dict()
        sd["state"] = {}  # the per-parameter views are saved once, as the flat buffers below
        sd["onebit"] = {
            **saved_entry(world_size=self.world_size, rank=self.rank, step=self._step_count,
                          bytes_sent_total=self._bytes_total, buffers=self.flat.buffers, params=self.flat.params,
                          synchronised=self.synchronised),
            **self._stages.state_dict(),
            **self._extra_state(),
            **({} if self._buckets is None else self._buckets.state_dict()),
            **self._exchange.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state saved by another rank or on another world size
        restarts the per-rank error buffers and random state (with a warning)."""
        name = type(self).__name__
        extra = onebit_entry(state_dict, name, required=(*self._stages.required, *self._extra_required))
        onebit_entry(state_dict, name, required=self._exchange.required(extra))  # as it was bucketed then
        for key, keys in self._stages.inside.items():
            check_entries(extra[key], keys, f"{name} {key}")
        self._check_extra_state(extra)
        flat = extra["flat"]
        saved = [s for s in self._stages.stages if set(s.buffers) == set(flat)]
        # Checked before anything changes: a state refused leaves the optimizer as it was
        check_buffers(flat, saved[0].buffers if saved else self.flat.buffers, self.flat.numel)
        # Worker/server errors (and Birder's random state) belong to the rank that saved them.
        own = own_state(extra, self.world_size, self.rank, owner=name,
                        restarts="per-rank error-feedback buffers re-created as zeros, random state reseeded for "
                                 "this rank")
        self._exchange.check_state_dict(extra, own)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        # The saved stage's layout, its state's views linked again (loading the groups dropped
        # them); the buffers' names matched one stage's, or were refused above
        self._lay_out(saved[0])
        for key, buf in flat.items():
            self.flat.buffers[key].copy_(buf)
        self._step_count = int(extra["step"])
        self._bytes_total = int(extra["bytes_sent_total"])
        self._loaded = self._unchecked = True  # checked at the next exchange, with the parameters saved beside it
        self._own_parameters = extra.get("own_parameters")
        self._stages.load_state_dict(extra)
        if self._stages.current.averages != (self._grad is not None):  # stages alike but for that
            self._lay_out(self._stages.current)
        self._load_extra_state(extra, own)
        self._exchange.load_state_dict(extra, own)
        if self._buckets is not None:
            self._buckets.load_state_dict(extra)
            self._buckets.plan(self._stages.current.wire.all_reduced)

