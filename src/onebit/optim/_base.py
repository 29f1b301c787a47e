"""The base of every onebit optimizer of the 1-bit family: the step around the contract an algorithm
fills in (``_contract.py``). ``step()`` runs the contract's phases in order, handing what is formed
to the exchange (``_exchange.py``: one-shot, or bucketed and overlapped with backward,
``_buckets.py``) and applying what lands, after the ranks agreed on skipping; it clips, advances
the stages and checks the replicas. The state it moves -- the flat buffers each stage declares,
the counters, the checkpoints -- is the class below's (``_state.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from .. import comm
from ._agreement import require_loaded_alike, require_replicas, start_agreement
from ._buckets import Buckets
from ._ddp import attach_ddp, check_ddp
from ._exchange import Exchange, allreduce_factory
from ._setup import clip_, clip_coef, closure_loss
from ._stages import Wire
from ._state import FlatStateOptimizer

__all__ = ["OnebitOptimizer"]

# Values per block of what a step forms: the passes over a block (the moments' EMA, then its add
# into the exchange's buffer) find it in the core's cache (256 KB per fp32 buffer) instead of
# memory: a third less time than 1M-value blocks for a formed bucket on CPU, the same bits.
_FORM_BLOCK = 1 << 16


class OnebitOptimizer(FlatStateOptimizer):
    """Base of the onebit optimizers (a ``torch.optim.Optimizer``): process group, flat state, the
    step protocol, checkpoints.

    Options every optimizer takes (keyword-only, :class:`onebit.optim.CommonOptions`):
    ``timeout`` (per collective, seconds; default 300), ``broadcast_parameters`` (rank 0's
    parameters to all at construction; default True), ``on_nonfinite`` (``"skip"``: a
    non-finite gradient on any rank makes every rank skip the step, counted in
    ``stats["skipped_steps"]``; ``"raise"``: ``FloatingPointError`` on every rank),
    ``check_replicas_every`` (K > 0: :meth:`check_replicas` after every K-th step) and
    ``max_grad_norm``.

    ``max_grad_norm`` (gradient clipping, DeepSpeed's ``gradient_clipping``) clips the averaged
    gradient as ``torch.nn.utils.clip_grad_norm_`` on one process would, where the optimizer
    forms it -- the warm-up of 1-bit Adam (and its refreshes) and 1-bit LAMB, SoftSignSGD,
    Comp-AMS, OnebitAdamNaive, 0/1 Adam up to ``var_freeze_step`` -- and each rank's own
    gradient, in place in ``p.grad``, where it never exists: the compression stages of 1-bit
    Adam, 1-bit LAMB and 0/1 Adam, Birder, QAdam (the Clipping page of the docs).

    FSDP2 parameters (HSDP: shard inside each node with ``fully_shard(module,
    mesh=mesh["shard"])``, and pass ``group=mesh["replicate"].get_group()`` of the 2-D mesh): the
    optimizer runs on each rank's local shards and exchanges them with the ranks holding the
    same shard on the other nodes; what is a function of a whole parameter (1-bit LAMB's norms)
    is reduced over the ranks sharing it (the Integrations page of the docs).

    Missing gradients, one rule for every optimizer: a parameter whose ``.grad`` is ``None``
    on every rank (frozen, or unused this step) is not updated -- no step, no weight decay,
    its moments untouched -- as in ``torch.optim``. A parameter with a gradient on some ranks
    only counts as a zero gradient on the others (the average DDP would form). Which
    parameters have a gradient somewhere travels with the non-finite agreement (one flag
    per parameter in its all-reduce), so every rank takes the same decision.
    """

    # Declared capability: _apply(..., members) steps some parameters alone, bit for bit as the
    # step of all steps them; each bucket is then applied as it lands, under the buckets after it.
    applies_by_bucket: bool = False

    def _drive(self, collective: Callable[[int, int], Any] | None, *, overlap: bool | str | None = False,
               bucket_cap_mb: float = 25.0, alignment: int = 1, key: str = "allreduce") -> None:
        """Build the exchange (the end of a subclass's constructor): ``collective(start,
        end)`` makes the compressed collective of the flat values ``[start, end)``
        (:class:`~onebit.optim._exchange.Exchange`). With ``overlap``, ``max_grad_norm`` is refused
        where a stage forms what it sends: the local clip needs every gradient before the first
        bucket leaves. ``overlap="warmup"``: only the exact exchange leaves during backward; ``None``
        (the default of the optimizers with an fp32 warm-up) is ``"warmup"`` where that can help --
        several ranks, parameters that are not FSDP2 shards nor held by a DDP model -- and ``False``
        elsewhere."""
        if overlap is None:
            helps = self.world_size > 1 and not self._shards.sharded and not self._ddp_wrapped
            overlap = "warmup" if helps else False
        if overlap and self._shards.sharded:
            raise ValueError(f"Invalid overlap value with FSDP2-sharded parameters: {overlap!r} (FSDP overlaps its "
                             "reduce-scatter with backward itself; the exchange between replicas runs in step()); "
                             "use overlap=False")
        if overlap is True and self.max_grad_norm is not None and any(s.wire.formed for s in self._stages.stages):
            raise ValueError(f"Invalid max_grad_norm value with overlap=True: {self.max_grad_norm!r} (the "
                             f"{type(self).__name__} step clips each rank's gradient over all parameters, which the "
                             "first bucket's exchange cannot wait for); use overlap=False to clip")
        warm_group = comm.duplicate(self.process_group, self.timeout) if overlap == "warmup" else None
        name = type(self).__name__
        self._exchange = Exchange(self.flat, self.process_group, self.timeout, collective, overlap=overlap,
                                  bucket_cap_mb=bucket_cap_mb, alignment=alignment, key=key, owner=name,
                                  warm_group=warm_group)
        if overlap:
            bounds = self._exchange.bounds if overlap is True else self._exchange.warm_bounds
            self._buckets = Buckets(self.flat.params, bounds, self._bucket_ready, warmup=overlap == "warmup",
                                    owner=name)
            self._buckets.plan(self._stages.current.wire.all_reduced)
        if self._ddp_wrapped:
            self._stop_warmup_in_backward_for_ddp()

    def _allreduce(self, compressor: Any, *, hierarchical: bool | str, ranks_per_node: int | None, overlap: bool,
                   scales: str = "chunk", group: comm.Group = None) -> Callable[[int, int], Any]:
        """The compressed all-reduce's factory for :meth:`_drive` (:func:`~onebit.optim._exchange.allreduce_factory`
        on these parameters and timeout, over ``group``: the optimizer's by default)."""
        return allreduce_factory(self.flat.offsets, self.process_group if group is None else group, self.timeout,
                                 compressor, hierarchical=hierarchical, ranks_per_node=ranks_per_node, overlap=overlap,
                                 scales=scales)

    @property
    def _collectives(self) -> list[Any]:
        """The exchange's compressed collectives, one per bucket (None where a bucket has none)."""
        return self._exchange.collectives

    # ------------------------------------------------------------------ what a step sends (the contract: _contract.py)
    def _write(self, wire: Wire, step: int, out: Tensor, base: int, members: Sequence[int], live: Sequence[bool],
               agreed: bool, add: bool) -> None:
        """What parameters ``members`` send at ``step``, written (``add``: added) into ``out`` from
        flat offset ``base`` on: their gradients (zeros where missing), or :meth:`_form` block by
        block, in the parameters' logical order."""
        flat = self.flat
        if not wire.formed and not add:
            flat.gather_grads(out, members, base=base)
            return
        scratch = torch.empty(2, min(_FORM_BLOCK, out.numel()), dtype=torch.float32, device=out.device)
        groups = [g for g in self.param_groups for _ in g["params"]]  # read now: LR schedulers change them
        for i in members:
            p, (first, last) = flat.params[i], flat.offsets[i]
            g = p.grad.reshape(-1) if p.grad is not None else None  # logical order (a copy if channels_last)
            for at in range(first, last, _FORM_BLOCK):
                to = min(at + _FORM_BLOCK, last)
                grad = None if g is None else g[at - first : to - first]
                target = out[at - base : to - base]
                if not wire.formed:  # the gradients, added
                    if grad is not None:
                        target.add_(grad)
                    continue
                rows = scratch[:, : to - at]
                self._form(i, at, to, grad, live[i], groups[i], step, rows, rows[0] if add else target, agreed)
                if add:
                    target.add_(rows[0])

    # ------------------------------------------------------------------ stages
    def _advance(self) -> None:
        """After a step: the next step's stage. Entering one laid out otherwise: its state as it
        declares it (:class:`~onebit.optim._stages.Stage`), then the optimizer's :meth:`_enter`."""
        before = self._stages.current
        self._stages.advance(self._step_count, self.flat.buffers)
        stage = self._stages.current
        if stage is not before and not stage.laid_out_as(before):
            self._lay_out(stage)
            if stage.resets_errors:
                self._exchange.reset()
            self._enter(stage)

    # ------------------------------------------------------------------ helpers
    def attach_ddp(self, model: DistributedDataParallel | None = None) -> list[DistributedDataParallel]:
        """Switch off DDP's all-reduce on ``model`` (default: every DDP module holding these
        parameters) with :func:`onebit.optim.local_gradient_hook`; see :func:`onebit.optim.attach`."""
        found = attach_ddp(self.flat.params, type(self).__name__, model)
        if found:
            self._stop_warmup_in_backward_for_ddp()
        return found

    def _stop_warmup_in_backward_for_ddp(self) -> None:
        # DDP writes every gradient again at the end of backward, after the warm-up's buckets have
        # left with it: each step would find them stale and exchange again in step().
        if self._buckets is not None:
            self._buckets.stop_warmup_in_backward("a DistributedDataParallel model holds the parameters")

    def _hyper(self, key: str) -> list[Any]:
        """Per-parameter value of a param-group option, read afresh (LR schedulers change it)."""
        return [g[key] for g in self.param_groups for _ in g["params"]]

    def _local_grads(self) -> list[Tensor | None]:
        """This rank's own gradients (``None`` where it has none), read where they lie."""
        return [p.grad for p in self.flat.params]

    def _clip_grad_(self, grad: Tensor) -> Tensor:
        """With ``max_grad_norm``: ``clip_grad_norm_`` on the flat averaged gradient (zeros where
        a parameter has no gradient), on the device."""
        if self.max_grad_norm is not None:
            grad.mul_(clip_coef(self.max_grad_norm, torch.linalg.vector_norm(grad)))
        return grad

    # ------------------------------------------------------------------ API
    # torch.amp.GradScaler then hands us ``grad_scale`` (gradients still scaled, or None) and
    # ``found_inf`` as attributes and leaves the skip decision to step(): it must be the same
    # decision on every rank, which a rank-local GradScaler cannot make.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One optimizer step (the closure, if given, is evaluated with grad enabled first).

        1. **Flush**: form and launch, in order, the buckets backward did not (``overlap=True``,
           and the warm-up's by default).
        2. **Agree**: one small all-reduce of "a gradient here is not finite" and "parameter
           ``i`` has a gradient here" (the last bucket's all-gather leaves behind it). If any
           rank has a non-finite gradient (or its GradScaler
           found one), every rank skips the step and leaves all state untouched
           (``stats["skipped_steps"]`` counts them), or raises ``FloatingPointError`` with
           ``on_nonfinite="raise"``.
        3. **Clip** (``max_grad_norm``): each rank's own gradients, where the stage never forms
           their average.
        4. **Exchange**: form what the stage's wire sends and launch it (where backward did not)
           -- the exact mean, the compressed collective, or nothing -- and wait for it to land;
           clipped where it is the gradients'.
        5. **Apply**: the algorithm's step on it, the only place the state moves. An optimizer that
           :attr:`applies_by_bucket` steps each bucket's parameters as the bucket lands.
        6. **Advance**: the next step's stage (its state laid out where it changes), and whether
           its buckets leave during backward.
        """
        loss = closure_loss(closure)
        comm.check_world_size(self.process_group, self.world_size, type(self).__name__)
        if not self._ddp_checked:  # the model may have been wrapped after the optimizer was built
            check_ddp(self.flat.params, type(self).__name__, self.world_size, construction=False)
            self._ddp_checked = True
        self._shards.bind_grads()
        buckets, exchange, in_backward = self._buckets, self._exchange, 0
        try:
            with comm.measure() as meter:
                if self._unchecked:  # the first exchange (in backward only with overlap=True)
                    self._check_alike()
                if buckets is not None:
                    with comm.span("flush", "step"):  # 1
                        buckets.flush(scaled=getattr(self, "grad_scale", None) is not None
                                      or getattr(self, "found_inf", None) is not None)
                wire = self._stages.current.wire
                with comm.span("agree", "step"):  # 2
                    present = [p.grad is not None for p in self.flat.params]  # per parameter: a gradient here
                    agreement = start_agreement(
                        self.flat.params, present, self._shards.agreement_group, self.timeout,
                        step=self._step_count + 1, rank=self.rank, on_nonfinite=self.on_nonfinite,
                        scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                        stale=buckets is not None and buckets.stale)
                    # The last bucket's all-gather leaves behind the agreement: on a busy link the
                    # agreement then waits for the bytes before it only, and the buckets before the
                    # last can be applied while that all-gather is on the wire.
                    with comm.span("gather", "step"):
                        exchange.gather()
                    nonfinite, self._active, stale = agreement()
                if nonfinite:
                    self._skipped += 1
                    exchange.abandon()
                else:
                    self._step_count += 1
                    self._last_stage = wire.stage
                    if wire.formed and self.max_grad_norm is not None:  # 3
                        clip_([p.grad for p in self.flat.params], self.max_grad_norm)
                    by_bucket = self._by_bucket(wire)
                    average = None
                    if wire.exchanged:
                        with comm.span("exchange", "step"):  # 4, and 5 as each bucket lands
                            average = self._exchanged(wire, stale, by_bucket)
                    if not by_bucket:
                        with comm.span("apply", "step"):  # 5
                            self._apply(wire, average)
                    self._advance()  # 6
                    if self.check_replicas_every and self._step_count % self.check_replicas_every == 0:
                        self.check_replicas()
        finally:
            self._shards.release_grads()
            self._landing_now = None
            if buckets is not None:
                in_backward = buckets.done()
                buckets.plan(self._stages.current.wire.all_reduced)
        sent = meter.bytes_sent + in_backward
        self._bytes_last = sent
        self._bytes_total += sent
        return loss

    def _exchanged(self, wire: Wire, stale: bool, by_bucket: bool) -> Tensor | None:
        """Step 4: launch what backward did not, wait for every bucket to land (``by_bucket``:
        and apply each as it does); returns the average, clipped where it is the gradients'
        (None where it was handed out chunk by chunk). ``stale``: some rank's warm-up buckets
        sent during backward are stale (the step's agreement): they are dropped, the exchange
        runs here again, and in ``step()`` from now on."""
        exchange = self._exchange
        warm = exchange.warm_in_flight
        if warm and stale:
            exchange.drop_warm()
            self._buckets.stop_warmup_in_backward("the gradients changed after their bucket left: accumulation "
                                                  "outside no_sync(), GradScaler, a clip or another change of "
                                                  "p.grad before step()")
            warm = False
        if not warm and (self._buckets is None or self._buckets.warmup):  # the one-shot exchange
            for b in range(len(exchange.bounds)):
                with comm.labelled(bucket=b):
                    self._launch_bucket(b, self._active, agreed=True)
        landing = self._landing_of_step()
        for members in exchange.completed(landing, warm=warm):
            if by_bucket:
                with comm.span("apply", "step"):
                    self._apply(wire, landing, members)
        if not isinstance(landing, Tensor):
            return None
        return landing if wire.formed else self._clip_grad_(landing)

    def _by_bucket(self, wire: Wire) -> bool:
        """Whether this step applies each bucket as it lands: a declared capability, for a wire
        exchanged in this step whose average is not clipped as a whole (``max_grad_norm`` on the
        averaged gradients)."""
        return (self.applies_by_bucket and self._exchange.lands_by_bucket and wire.exchanged
                and (wire.formed or self.max_grad_norm is None))

    def _bucket_ready(self, b: int) -> None:
        """The overlap's one entry (:class:`~onebit.optim._buckets.Buckets`): backward produced
        bucket ``b``'s gradients (or ``step()`` flushes it); its values for the next step are
        formed and launched, before the ranks agreed to take the step."""
        if self._unchecked and not self._buckets.warmup:  # the first exchange: of states the ranks must hold alike
            self._check_alike()
        wire, step = self._stages.current.wire, self._step_count + 1
        if self._buckets.warmup:  # the warm-up's gradients, into where their mean lands
            lo, hi, members = self._exchange.warm_bounds[b]
            values = self._landing_of_step()[lo:hi]
            self._write(wire, step, values, lo, members, [True] * len(self.flat.params), False, False)
            self._exchange.mean(b, values, wire.dtype, warm=True)
        elif wire.exchanged:
            live = [p.requires_grad or p.grad is not None for p in self.flat.params]
            if not self._launch_bucket(b, live, agreed=False):
                self._exchange.gather()  # (all before b: the second phases a launch of b would have started)

    def _launch_bucket(self, b: int, live: Sequence[bool], *, agreed: bool) -> bool:
        """Form bucket ``b``'s values for the step and launch their exchange; whether it sent
        anything. ``live[i]``: parameter ``i`` takes a gradient this step (one-shot: some rank
        has one; during backward: it is trainable or has one here); the others' state enters as
        it is. ``agreed``: launched in ``step()``, once every rank agreed to take it."""
        wire, exchange = self._stages.current.wire, self._exchange
        step = self._step_count if agreed else self._step_count + 1
        lo, hi, members = exchange.bounds[b]
        start, end = exchange.spans[b]
        collective = None if wire.all_reduced else exchange.collectives[b]
        # Added into the collective's worker error where what is formed must stay out of the
        # landing buffer (a bucket formed during backward, before the ranks agreed to step) or
        # where the average is handed out chunk by chunk; otherwise formed in place where the
        # average lands and exchanged there, as the one-shot step does: a pass fewer over the
        # model, since the collective's fused compression reads x and e together.
        if collective is not None and collective.reduces_added_input and (
                not agreed or not isinstance(self._landing_of_step(), Tensor)):
            self._write(wire, step, exchange.input_buffer(b), lo, members, live, agreed, True)
            exchange.added(b)
            return True
        landing = self._landing_of_step()
        self._write(wire, step, landing[lo:hi], lo, members, live, agreed, False)
        if wire.all_reduced:
            exchange.mean(b, landing[lo:hi], wire.dtype)
        elif collective is None:  # no whole block in this bucket: its values go with the next one
            return False
        else:
            exchange.compressed(b, landing[start:end])
        return True

    def _landing_of_step(self) -> Tensor | comm.Consume:
        """Where this step's average lands (:meth:`_landing`), asked once per step, right before it
        is first written."""
        if self._landing_now is None:
            self._landing_now = self._landing(self._stages.current.wire)
        return self._landing_now

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation with an exchange during backward (``overlap=True``, or the warm-up's
        by default): backward passes inside the block only accumulate; the next one outside it
        starts the exchange (as ``DistributedDataParallel.no_sync``). Where the exchange happens in
        ``step()`` anyway, the block changes nothing."""
        return self._buckets.no_sync() if self._buckets is not None else contextlib.nullcontext()

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`~onebit.optim.ReplicaDivergence` naming the first parameter that differs between ranks.

        Cheap: each parameter's bits, read as integers, are summed on its device, and the
        sums (8 bytes per parameter) are all-gathered -- any single-value difference shows.
        Inside an interval of local steps (not :attr:`synchronised`) the ranks' parameters differ
        by design, and the anchors (the parameters of the last synchronisation) are compared.
        """
        if self._unchecked:
            self._check_alike()
        require_replicas(self.flat.params, None if self.synchronised else self.flat.views("anchor"), self.process_group,
                         self.timeout, step=self._step_count, param_groups=self.param_groups)

    def _check_alike(self) -> None:
        """At the first exchange, step or replica check of this optimizer, fresh or after
        :meth:`load_state_dict`: raise :class:`~onebit.optim.ReplicaDivergence` on every rank unless
        the ranks hold states of one step, each beside the parameters saved with it
        (:func:`onebit.optim._agreement.require_loaded_alike`). During backward only with
        ``overlap=True``, whose buckets leave there on the user's group anyway: the warm-up's leave
        on a group of their own and complete in ``step()``, so the check waits for ``step()``
        rather than block a rank in backward while another is in a collective of the user's."""
        saved, self._own_parameters, self._unchecked = self._own_parameters, None, False
        require_loaded_alike(self.flat.params, saved, self._shards.agreement_group, self.timeout,
                             step=self._step_count, loaded=self._loaded, owner=type(self).__name__,
                             param_groups=self.param_groups)

