"""DiLoCo (Douillard et al., arXiv 2311.08105) with its outer gradients sent at 1 bit a value, and
Streaming DiLoCo (arXiv 2501.18512): a wrapper around the user's inner ``torch.optim`` optimizer,
as torchft's ``DiLoCo`` (the class says how).

Its pieces: the fragments, their exchanges and what is in flight (``_fragments.py``,
``_flight.py``), the inner and outer optimizers (``_wrapped.py``), a quorum's protocol
(``_membership.py``), its checkpoints (``_diloco_checkpoint.py``). What it shares with the 1-bit
family -- the agreement on skipping a step, the replica check, the checks at construction, what
every ``state_dict`` holds -- are helpers that take values (``_agreement.py``, ``_setup.py``,
``_checkpoint.py``); it calls :mod:`onebit.comm` itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from .. import comm, compress
from .._checks import check_positive_int
from ._agreement import ReplicaDivergence, require_loaded_alike, require_replicas, start_agreement
from ._ddp import attach_ddp, check_ddp
from ._diloco_checkpoint import DiLoCoCheckpoints
from ._fragments import Schedule, build_fragments, by_size, check_exchange, fragment_of, regroup_fragments
from ._membership import Healed, Membership
from ._setup import check_groups, clip_, closure_loss, common_options, place
from ._wrapped import inner_optimizer, outer_factory, outer_step_options

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["DiLoCo"]


class DiLoCo(DiLoCoCheckpoints, Optimizer):
    """DiLoCo's outer loop around any ``torch.optim`` optimizer, its outer gradients sent at 1 bit
    a value (section 3, Algorithm 1 of arXiv 2311.08105).

    ``params`` is the inner optimizer itself (any ``torch.optim`` optimizer, built on every rank
    over the same parameters), or parameters (or param groups) for ``inner(params, lr=lr)``,
    AdamW by default. ``step()`` is the inner optimizer's step on this rank's own gradients;
    every ``sync_every`` steps the synchronisation follows it: ``delta_i = anchor - x_i`` is
    averaged over the group, compressed (``compressor``, ``collective``), the outer optimizer
    moves the anchor with the average in the place of a gradient, and every rank's parameters
    take the anchor, bit for bit. The outer step is SparseLoCo's by default (arXiv 2508.15706,
    Algorithm 1), DiLoCo's with ``outer_step="nesterov"``. The inner optimizer's state is never
    averaged or reset; its param groups are this optimizer's, so a learning-rate scheduler built
    on either schedules the inner steps. An inner step sends nothing (but the first's check that
    the ranks hold states of one step): a rank with a non-finite gradient skips its own inner
    step, which still counts towards ``sync_every``; a synchronisation is skipped on every rank
    at once. ``fragments`` and ``delay`` make it Streaming DiLoCo (arXiv 2501.18512, section 2).
    The DiLoCo page of the docs compares the outer steps, compressors and intervals, measured.

    Args:
        params: the inner optimizer (e.g. ``torch.optim.AdamW(model.parameters(), lr=1e-3)``),
            or the parameters to build it over.
        lr: the inner learning rate, where ``params`` are parameters (default 1e-3).
        weight_decay: the inner optimizer's, where ``params`` are parameters (None: its default).
        inner: the inner optimizer's class (or a factory ``inner(params, lr=lr)``), where
            ``params`` are parameters (default ``torch.optim.AdamW``).
        sync_every: inner steps per synchronisation (H; the paper: 500).
        outer_step: ``"sparseloco"`` (default: each rank's decayed error accumulator in the place
            of the outer momentum, the plain average of what was sent as the step: ``outer_lr``
            1, ``outer_momentum`` 0, ``error_feedback=True``, ``error_decay`` 0.95) or
            ``"nesterov"`` (the paper's: ``outer_lr`` 0.7, ``outer_momentum`` 0.9, Nesterov,
            no error carried). It sets the defaults of the five options below; those given
            override them. ``"sparseloco"`` refuses an outer momentum and
            ``error_feedback=False`` (either makes it another algorithm: ``"nesterov"`` takes them).
        outer: the outer optimizer: a factory ``outer(anchors)`` of any ``torch.optim`` optimizer
            over the anchors (one fp32 tensor per parameter, shaped like it; its ``.grad`` is the
            averaged outer gradient at a synchronisation, None for a parameter without a gradient
            on any rank since the last one). None (default): ``torch.optim.SGD(anchors,
            lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)``. Built once;
            :attr:`outer` holds it (an LR scheduler may be built on it).
        outer_lr: the default outer optimizer's learning rate (None: the outer step's; 1 with
            ``outer_momentum=0`` and no error carried is periodic averaging). Beside ``outer``,
            these three are refused (they would configure nothing).
        outer_momentum: its momentum (None: the outer step's).
        nesterov: its Nesterov momentum (None: the outer step's; without momentum, none).
        compressor: ``"sign"`` (default: 1 bit per value and a scale per row),
            ``"identity"`` (the exact fp32 mean: with ``outer_step="nesterov"`` DiLoCo as
            published, with SparseLoCo's periodic averaging, nothing left to carry), ``"chunk_topk"``
            (SparseLoCo's: 64 of every 4096 values of each tensor at 2 bits), another name of
            :func:`onebit.compress.available` or a :class:`onebit.compress.Compressor` (e.g.
            ``onebit.compress.get("uniform", bits=8)``, 8-bit pseudo-gradients).
        collective: how the compressed outer gradients are averaged. ``"allgather"`` (default):
            every rank's is all-gathered and their average taken exactly, so each value is
            compressed once; a rank sends ``w - 1`` times its compressed bytes. ``"allreduce"``:
            1-bit Adam's compressed all-reduce, whose chunk owners compress the average again
            before the all-gather: ``2 (w - 1) / w`` times, fewer bytes from 3 ranks on, at the
            cost of the second compression's error (see the DiLoCo page of the docs).
        fragments: synchronise the model in P fragments, each every ``sync_every`` steps,
            fragment p landing at the steps ``k H / P`` with ``k`` congruent to ``p + 1`` modulo P
            (Streaming DiLoCo; 1: the whole model at once). An int P: contiguous fragments of
            about equal size, cut at parameter boundaries in parameter order. A list of P lists
            of parameters: those fragments, every parameter of the inner optimizer in exactly
            one (the paper's strided fragments: every P-th layer in one); each
            contiguous run of a fragment's parameters is exchanged as one piece.
            ``sync_every`` must be a multiple of P.
        delay: inner steps each synchronisation stays in flight (the paper's tau, below
            ``sync_every / fragments``): its outer gradients are formed and sent ``delay``
            steps before the step it lands in, and the network works under those inner steps.
        merge: the weight of the fragment's own parameters when its synchronisation lands after
            ``delay`` local steps (the paper's alpha): ``x <- merge x + (1 - merge) anchor``.
            Default 0.5 with a delay (the paper's), 0 without (where it must be 0: the
            parameters are the ones the outer gradient was formed from).
        error_feedback: carry the compression errors (each rank's, and with the all-reduce the
            chunk owners') from one synchronisation to the next (None: the outer step's; False:
            they restart at zero after each). With the paper's outer step it cost quality in
            most settings measured: the inner steps between have already moved on from what an
            error held, and the outer momentum accelerates it again (the DiLoCo page of the docs).
        error_decay: with ``error_feedback``, each rank's error is multiplied by it before the
            next outer gradient is added (None: the outer step's, 0.95 for SparseLoCo's, 1 --
            kept whole -- otherwise). SparseLoCo's published recipe is ``compressor="chunk_topk",
            scales="tensor"`` with its defaults.
        scales: ``"tensor"`` (one scale per tensor piece, of each chunk with the all-reduce),
            ``"row"`` (one per slice along the first dimension of each 2-D or larger tensor) or
            ``"chunk"`` (one per chunk with the all-reduce, per contiguous piece with the
            all-gather); None (default): ``"row"`` for the sign, ``"tensor"`` for every other
            compressor.
        group: the process group the workers average over (``None``: the default group), or a
            :class:`onebit.comm.Quorum`, whose replicas may die or come during the run: each
            synchronisation is committed by every replica, redone among the survivors where one
            died, and a replica that comes is taken in after one, with a live peer's state.
        **options: ``timeout``, ``broadcast_parameters``, ``on_nonfinite``,
            ``check_replicas_every``, ``max_grad_norm`` (each rank clips its own gradients
            before its inner step) -- see :class:`onebit.optim.CommonOptions`.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> opt = onebit.DiLoCo(inner, sync_every=2)
        >>> for _ in range(4):
        ...     opt.zero_grad()
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     opt.step()
        >>> opt.stats["stage"]
        'outer'
    """

    def __init__(
        self,
        params: Optimizer | Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        *,
        inner: Callable[..., Optimizer] | None = None,
        weight_decay: float | None = None,
        sync_every: int = 500,
        outer_step: str = "sparseloco",
        outer: Callable[[list[Tensor]], Optimizer] | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        nesterov: bool | None = None,
        fragments: int | Iterable[Iterable[Tensor]] = 1,
        delay: int = 0,
        merge: float | None = None,
        compressor: str | compress.Compressor = "sign",
        collective: str = "allgather",
        error_feedback: bool | None = None,
        error_decay: float | None = None,
        scales: str | None = None,
        group: comm.Group = None,
        **options: Unpack[CommonOptions],
    ) -> None:
        self.inner = inner = inner_optimizer(params, lr, inner, weight_decay)
        self.sync_every = check_positive_int("sync_every", sync_every)
        # each parameter's fragment, where the user gave them (None: cut by size once the layout is known)
        given = None if isinstance(fragments, int) else \
            fragment_of(fragments, [p for g in inner.param_groups for p in g["params"]])
        self._schedule = Schedule(self.sync_every, fragments if given is None else given, delay, merge)
        self.fragments, self.delay, self.merge = self._schedule.fragments, delay, self._schedule.merge
        step = outer_step_options(outer_step, outer, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                  nesterov=nesterov, error_feedback=error_feedback, error_decay=error_decay)
        scales = check_exchange(compressor, collective, step["error_feedback"], step["error_decay"], scales)
        self.outer_step, self.compressor, self.collective = outer_step, compressor, collective
        self.error_feedback, self.error_decay = step["error_feedback"], float(step["error_decay"])
        make_outer = outer_factory(outer, step["outer_lr"], step["outer_momentum"], step["nesterov"])
        self._outer_given = outer is not None
        if comm.reforms(group) and options.get("timeout") is None:  # a dead peer is the quorum's to time out
            options["timeout"] = group.timeout
        options = common_options(options, type(self).__name__)
        self.max_grad_norm, self.on_nonfinite = options["max_grad_norm"], options["on_nonfinite"]
        self.check_replicas_every, self.timeout = options["check_replicas_every"], options["timeout"]
        # Its param groups are the inner optimizer's (the same dicts): a scheduler on either moves both
        super().__init__(inner.param_groups, dict(inner.defaults))
        check_groups(self.param_groups, self.defaults, type(self))
        self.process_group = comm.resolve_group(group)
        # A quorum (onebit.comm.Quorum): every synchronisation is committed, re-run among the
        # survivors where a peer died, and the joiners are taken in after one lands.
        self._membership = Membership(self.process_group, "DiLoCo", self.timeout, regroup=self._regroup,
                                      save=self._give_state, load=self._take_state,
                                      step=lambda: self._step_count) if comm.reforms(self.process_group) else None
        self.world_size = comm.get_world_size(self.process_group)
        self.rank = comm.get_rank(self.process_group)
        joining = self._membership is not None and self.process_group.needs_state  # its state comes from a peer
        self._shards, self.flat = place(self.param_groups, self.process_group, self.timeout, type(self).__name__,
                                        max_grad_norm=self.max_grad_norm, broadcast=options["broadcast_parameters"],
                                        replicate=not joining)
        params = self.flat.params  # what is averaged: the parameters, or their FSDP2 shards
        anchors = self.flat.split(self.flat.new("anchor"))
        for anchor, p in zip(anchors, params):
            anchor.copy_(p.detach())  # the parameters every rank starts from (rank 0's, broadcast)
        for p, anchor in zip(self._shards.params, anchors):
            self.state[p] = {"anchor": anchor}  # for inspection
        self.outer = make_outer(anchors)
        self._anchors = anchors
        self._fragment_of = given or by_size(self.flat.offsets, self.fragments)
        self._scales = scales
        self._fragments = self._build_fragments()
        self._step_count = self._skipped = self._bytes_last = self._bytes_total = 0
        self._last_stage: str | None = None
        # Per parameter: a gradient here since its fragment was last sent (on some rank, once the
        # synchronisation's agreement has run)
        self._touched = [False] * len(params)
        self._late_bytes = 0  # sent by the flights' threads, counted when they land
        self._loaded = False  # the state came from load_state_dict
        # The first step checks that the ranks hold states of one step, fresh or loaded (a joiner takes
        # a peer's, and the others check nothing then)
        self._unchecked = not joining
        self._own_parameters: list[int] | None = None  # the fingerprint kept with a state between synchronisations
        self._ddp_checked = False
        check_ddp(self.flat.params, "DiLoCo", self.world_size, construction=True)
        if joining:
            self._membership.follow()

    # ------------------------------------------------------------------ the step
    # torch.amp.GradScaler then hands us ``grad_scale`` and ``found_inf`` as attributes and leaves
    # the skip decision to step(): a synchronisation's must be the same on every rank.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """The inner step; at every ``sync_every``-th step (with fragments, at each fragment's)
        the synchronisation after it: agree, form ``anchor - x``, average, outer step.

        1. **Agree**: at a synchronisation, one small all-reduce of "a gradient here is not
           finite" and of which parameters had a gradient since their fragment's last one; if
           any rank's is not finite, every rank skips the step (it does not count). An inner
           step sends nothing (but the first's check that the ranks hold states of one step): a
           rank with a non-finite gradient skips its own, which counts.
        2. **Inner step** on this rank's own gradients (clipped with ``max_grad_norm``).
        3. **Send** the fragment's outer gradients; with a ``delay`` its exchange stays in flight,
           completed on a thread.
        4. **Land** each synchronisation due at this step: the outer optimizer moves the
           fragment's anchors with the average, the parameters take them (or the merge).
        """
        loss = closure_loss(closure)
        comm.check_world_size(self.process_group, self.world_size, type(self).__name__)
        try:
            self._step()
        except Healed:  # this replica left the quorum and came back with a peer's state: its step is over
            pass
        return loss

    def _step(self) -> None:
        if not self._ddp_checked:  # the model may have been wrapped after the optimizer was built
            check_ddp(self.flat.params, "DiLoCo", self.world_size, construction=False)
            self._ddp_checked = True
        self._shards.bind_grads()
        try:
            with comm.measure() as meter:
                self._check_alike()
                step = self._step_count + 1
                sent = self._schedule.sent_at(step)
                fragment = None if sent is None else self._fragments[sent]
                params = self.flat.params
                present = [t or p.grad is not None for t, p in zip(self._touched, params)]
                scale = getattr(self, "grad_scale", None)

                def agree() -> tuple[bool, list[bool], bool]:
                    nonlocal scale
                    launched = start_agreement(
                        params, present, self._shards.agreement_group if fragment else self._shards.shard_group,
                        self.timeout, step=step, rank=self.rank, on_nonfinite=self.on_nonfinite,
                        everywhere=fragment is not None, scale=scale, found_inf=getattr(self, "found_inf", None))
                    scale = None  # the gradients are unscaled in place: an agreement run again finds them so
                    return launched()

                with comm.span("agree", "step"):  # 1
                    nonfinite, active, _ = self._collective(agree) if fragment else agree()
                if nonfinite:
                    self._skipped += 1
                if not (nonfinite and fragment):  # a synchronisation is skipped everywhere, an inner step here
                    self._step_count, self._last_stage = step, "outer" if fragment else "local"
                    if not nonfinite:
                        with comm.span("local", "step"):  # 2
                            clip_([p.grad for p in params], self.max_grad_norm)
                            self.inner.step()
                        self._touched = [t or a for t, a in zip(self._touched, active)]
                    if fragment is not None:
                        with comm.span("exchange", "step"):  # 3
                            fragment.send(self.flat.buffers["anchor"], params, self.flat.offsets, self._touched,
                                          lands_at=step + self.delay, in_flight=self.delay > 0,
                                          live=self._membership is not None)
                        for i in fragment.members:  # what was touched is agreed now, the rest starts again
                            self._touched[i] = False
                    landed = False
                    for f in self._fragments:  # 4
                        if f.flight is not None and f.flight.lands_at <= step:
                            self._collective(f.flight.join, f.resend)
                            with comm.span("apply", "step"):
                                self._late_bytes += f.land(self.outer, self._anchors, params, self.flat.offsets,
                                                           merge=self.merge, error_feedback=self.error_feedback)
                            landed = True
                    if self.check_replicas_every and step % self.check_replicas_every == 0:
                        self._check_replicas()
                    if landed and self._membership is not None and self.process_group.admit(step):
                        self._membership.follow()
        finally:
            self._shards.release_grads()
            self._bytes_last = meter.bytes_sent + self._late_bytes
            self._bytes_total += self._bytes_last
            self._late_bytes = 0

    # ------------------------------------------------------------------ with a quorum
    def _build_fragments(self) -> list[Any]:
        return build_fragments(self.flat, self._fragment_of, self.compressor, collective=self.collective,
                               error_feedback=self.error_feedback, error_decay=self.error_decay, scales=self._scales,
                               delay=self.delay, group=self.process_group, timeout=self.timeout)

    def _collective(self, first: Callable[[], Any], again: Callable[[], Any] | None = None) -> Any:
        """``first()``; on a quorum, committed on every member (:meth:`Membership.run`)."""
        return first() if self._membership is None else self._membership.run(first, again)

    def _regroup(self) -> None:
        """The collectives over the quorum's new epoch, each going on from the one it replaces."""
        self.world_size, self.rank = self.process_group.size(), self.process_group.rank()
        regroup_fragments(self._fragments, self._build_fragments())

    # ------------------------------------------------------------------ API
    @property
    def stats(self) -> dict[str, Any]:
        """``step``, ``stage`` of the last step (``"local"``: an inner step; ``"outer"``: one that
        sent a synchronisation), ``bytes_sent`` (this rank, last step, with what its flights sent
        since they left), ``bytes_sent_total`` and ``skipped_steps``."""
        first = "local" if self._schedule.sent_at(1) is None else "outer"
        return {"step": self._step_count, "stage": self._last_stage or first, "bytes_sent": self._bytes_last,
                "bytes_sent_total": self._bytes_total, "skipped_steps": self._skipped}

    @contextlib.contextmanager
    def anchored(self) -> Iterator[None]:
        """Inside the block, every parameter holds its anchor: the model all ranks share (DiLoCo's
        global model, each fragment as its last synchronisation left it, without the inner steps
        since); after it, each its own value again. For evaluating or saving the shared model
        where each rank's parameters are its own: inside an interval of inner steps, or with
        fragments at any step. Take no step inside it (the inner step would start from the
        anchors, and its result be overwritten when the block ends).

        Examples:
            >>> model = torch.nn.Linear(4, 2)
            >>> opt = onebit.DiLoCo(model.parameters(), sync_every=8)
            >>> opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
            >>> with opt.anchored():
            ...     shared = model.weight.detach().clone()
            >>> torch.equal(shared, model.weight)  # an inner step since the anchor
            False
        """
        own = [p.detach().clone() for p in self.flat.params]
        with torch.no_grad():
            for p, anchor in zip(self.flat.params, self._anchors):
                p.copy_(anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self.flat.params, own):
                    p.copy_(value)

    @property
    def synchronised(self) -> bool:
        """Whether every rank holds the same parameters now: after a synchronisation of the whole
        model that took them all to the anchor (inside an interval of inner steps, or with
        fragments or a merge, the ranks' parameters differ by design)."""
        return self.fragments == 1 and not self.merge and self._step_count % self.sync_every == 0

    def wait(self) -> None:
        """Wait for the synchronisations still in flight (``delay``) to complete; each still lands
        at its step. Call it before destroying the process group where a run may end between such
        a launch and its landing."""
        for f in self._fragments:
            if f.flight is not None:
                f.flight.join()

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`~onebit.optim.ReplicaDivergence` naming the first parameter that differs
        between ranks: the parameters where :attr:`synchronised`, else the anchors (the parameters
        of the last synchronisation, which every rank shares)."""
        try:
            self._check_replicas()
        except Healed:  # this replica holds a peer's state now: a replica of it
            pass

    def _check_replicas(self) -> None:
        self._check_alike()
        self._collective(lambda: require_replicas(
            self.flat.params, None if self.synchronised else self._anchors, self.process_group, self.timeout,
            step=self._step_count, param_groups=self.param_groups))

    def _check_alike(self) -> None:
        """At the first step (or replica check), fresh or after :meth:`load_state_dict`: raise
        :class:`~onebit.optim.ReplicaDivergence` on every rank unless the ranks hold states of one
        step, each beside the parameters saved with it. Kept until every rank has committed the
        check: on a quorum, a replica whose collective completed where another's failed runs it
        again with the others on the group they re-form."""
        if not self._unchecked:
            return
        try:
            self._collective(lambda: require_loaded_alike(
                self.flat.params, self._own_parameters, self._shards.agreement_group, self.timeout,
                step=self._step_count, loaded=self._loaded, owner=type(self).__name__, param_groups=self.param_groups))
        except ReplicaDivergence:
            self._unchecked = False  # checked: every rank raises alike
            raise
        self._unchecked = False  # (kept where a dead peer's error left it unchecked, without a quorum)

    def attach_ddp(self, model: DistributedDataParallel | None = None) -> list[DistributedDataParallel]:
        """Switch off DDP's all-reduce on ``model`` (default: every DDP module holding these
        parameters): the inner steps are each rank's own (see :func:`onebit.optim.attach`)."""
        return attach_ddp(self.flat.params, "DiLoCo", model)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the anchors and the collectives are sized for the parameters
        given then."""
        if hasattr(self, "flat"):
            raise ValueError("DiLoCo cannot add a param group after construction (its anchors and collectives are "
                             "sized for the parameters it was built with); pass every group to the constructor, "
                             "with lr=0 for groups that start later")
        super().add_param_group(param_group)
