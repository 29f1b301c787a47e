"""DDP communication hooks built on onebit's compressors and compressed all-reduce."""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with the
# real ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
import itertools
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from ..comm import Stages
from ..compress import Compressor, StochasticSignCompressor, get
from .._checks import check_beta, check_positive, check_scales, check_seed
from ..optim import soft_sign_direction

__all__ = ["BirderState", "ErrorFeedbackState", "birder_hook", "error_feedback_hook"]

_log = logging.getLogger(__name__)


class _Flight:
    """One bucket in flight: the future DDP waits on, its gradients, its compressed collective and
    buffers (None: the exact mean); its exchange is the state's :class:`onebit.comm.Pipeline`'s."""

    __slots__ = ("future", "grad", "entry")

    def __init__(self, grad: Tensor, entry: dict[str, Any] | None) -> None:
        self.grad, self.entry = grad, entry
        self.future: torch.futures.Future[Tensor] = torch.futures.Future()


class _HookState:
    """Shared bookkeeping: iteration count, per-bucket collectives keyed by bucket index, the
    exchanges in flight, pickling.

    Per-bucket state is keyed by ``bucket.index()``. DDP builds its buckets in reverse
    parameter order, then rebuilds them once from the order gradients became ready in the
    first iteration, so an index names the same parameters only from iteration 1 on;
    compression therefore starts at ``start_iter >= 2`` (as PowerSGD requires with error
    feedback), and iterations before it use an exact fp32 all-reduce.

    The hooks do not block. DDP calls them in bucket-index order while backward computes
    earlier layers; each call starts its bucket's exchange (compresses it and leaves its
    first collective in flight) and returns a pending future. The last bucket's call runs
    every exchange to its end, stage by stage across buckets (one bucket's all-gather is in
    flight while the next is averaged), and completes the futures. Nothing waits during
    backward: a wait there for an earlier bucket's collective would stall the layers still
    to compute whenever the wire is slower than they are. All collectives are issued from
    the backward thread, in an order that is the same on every rank, never from a
    communication thread's callback (where ranks could issue two buckets' collectives in
    different orders).

    Non-finite gradients (an fp16 overflow, say) are flagged in the compressed exchange's own
    payload (``flag_nonfinite``), so no bucket waits for an agreement of its own: the skipped
    step's one mechanism, the optimizers' too (:mod:`onebit.comm._nonfinite`). The last
    call reads, once per iteration, which buckets any rank flagged: those come back as NaN on
    every rank, so every rank's GradScaler skips the step, and restart their errors (and
    Birder's moments) at zero on every rank -- some took in the values before any rank could
    know. Before ``start_iter`` the exact all-reduce carries the NaN/Inf itself.

    On a new DDP instance a live state must be restored first,
    ``state.load_state_dict(state.state_dict())`` (a bucket of another size raises saying
    so): the new instance's first iteration has DDP's initial bucket layout. After a
    backward that raised part-way (DDP cannot go on; the job builds a new instance) the
    state does that itself, dropping the exchanges left in flight, with a warning.
    """

    __slots__ = ("process_group", "start_iter", "iter", "hierarchical", "ranks_per_node", "timeout", "_buckets",
                 "_saved", "_restore_iters", "_flights", "_pipeline")
    _unpickled: tuple[str, ...] = ("process_group",)  # objects of the live job, None after unpickling

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        start_iter: int,
        hierarchical: bool | str,
        ranks_per_node: int | None,
        timeout: float | timedelta | None,
    ) -> None:
        if isinstance(start_iter, bool) or not isinstance(start_iter, int):
            raise TypeError(f"start_iter must be an int, got {start_iter!r}")
        if start_iter < 2:
            raise ValueError(
                f"start_iter must be >= 2, got {start_iter}: DDP rebuilds its buckets after the first "
                "iteration, and state kept per bucket index must not start before that"
            )
        if hierarchical not in (True, False, "auto"):
            raise ValueError(f"hierarchical must be True, False or 'auto', got {hierarchical!r}")
        if comm.backend_of(process_group) != "torch":
            # DDP itself (bucketing, the backward-pass futures) runs on torch.distributed.
            raise ValueError(f"process_group must be a torch.distributed process group, got {process_group!r}")
        self.process_group = process_group
        self.start_iter = start_iter
        self.iter = 0
        self.hierarchical = hierarchical
        self.ranks_per_node = ranks_per_node
        self.timeout = comm.to_timedelta(timeout)
        self._buckets: dict[int, dict[str, Any]] = {}
        self._saved: dict[int, dict[str, Any]] = {}
        self._restore_iters = 0
        self._flights: list[_Flight] = []
        self._pipeline = comm.Pipeline()

    # ------------------------------------------------------------------ per bucket
    def _compressor(self, index: int) -> str | Compressor:
        raise NotImplementedError

    def _segments(self, bucket: dist.GradBucket) -> list[int] | None:
        """Where the bucket's tensors start in its buffer, when its chunks get one scale per
        tensor piece; ``None``: one scale per chunk."""
        return None

    def _bucket(self, index: int, grad: Tensor, segments: list[int] | None = None) -> dict[str, Any] | None:
        """The bucket's collective and buffers, created on first use or restored from a checkpoint.

        ``None`` means "exchange this bucket exactly": a restored state is waiting for the new
        DDP instance to rebuild its buckets (its first iteration uses DDP's initial layout,
        which generally differs from the rebuilt one the state was saved with).
        """
        entry = self._buckets.get(index)
        if entry is not None:
            if entry["allreduce"].numel not in (None, grad.numel()):
                raise ValueError(
                    f"bucket {index} has {grad.numel()} values but this state's was built with "
                    f"{entry['allreduce'].numel}: the state was used by another DDP instance (or the bucket "
                    "layout changed); to register it on a new one, restore it first: "
                    "state.load_state_dict(state.state_dict())"
                )
            return entry
        saved = self._saved.get(index)
        if self._saved and (saved is None or saved["numel"] != grad.numel()):
            if self._restore_iters >= 1:
                have = "no saved state" if saved is None else f"{saved['numel']} values when saved"
                raise ValueError(
                    f"bucket {index} has {grad.numel()} values but {have}: the DDP bucket layout "
                    "differs from the checkpoint's (bucket_cap_mb or the model changed)"
                )
            return None
        allreduce = comm.compressed_allreduce(
            self._compressor(index),
            self.process_group,
            hierarchical=self.hierarchical,
            ranks_per_node=self.ranks_per_node,
            timeout=self.timeout,
            flag_nonfinite=True,
            segments=segments,
        )
        entry = self._buckets[index] = {"allreduce": allreduce, **self._new_buffers(grad)}
        if saved is not None:
            del self._saved[index]
            allreduce.load_state_dict(saved["allreduce"])
            for name, value in saved["buffers"].items():
                entry[name].copy_(value)
        return entry

    def _new_buffers(self, grad: Tensor) -> dict[str, Tensor]:
        return {}

    def _entry(self, bucket: dist.GradBucket) -> dict[str, Any] | None:
        """The bucket's compressed collective and buffers; ``None`` before ``start_iter`` (exact)."""
        if bucket.index() == 0 and self._flights:
            # The previous backward stopped part-way (an exception), leaving exchanges behind.
            # DDP cannot go on after that, so this is a new DDP instance, whose first iteration
            # has DDP's initial bucket layout: take the buckets back as from a checkpoint.
            _log.warning("dropping %d bucket exchanges of an unfinished backward pass; the buckets' state "
                         "is restored as from a checkpoint", len(self._flights))
            self.load_state_dict(self.state_dict())
        if self.iter < self.start_iter:
            return None
        return self._bucket(bucket.index(), bucket.buffer(), self._segments(bucket))

    def _mean(self, grad: Tensor) -> Stages:
        """The exact fp32 average of ``grad``, in place, as stages."""
        return comm.all_reduce_mean_stages(grad, self.process_group, self.timeout)

    def _schedule(self, bucket: dist.GradBucket, entry: dict[str, Any] | None,
                  stages: Stages) -> torch.futures.Future[Tensor]:
        """Start ``bucket``'s exchange and return the future of its gradients (the last bucket
        finishes them all)."""
        flight = _Flight(bucket.buffer(), entry)
        self._flights.append(flight)
        # Nothing waits during backward: every bucket's later phases run in the last one's
        # call, a phase of each in bucket order, round after round (the pipeline's finish())
        self._pipeline.launch(stages, lags=False)
        if bucket.is_last():
            self._finish_iteration()
            self.iter += 1
            if self._saved:
                self._restore_iters += 1
        return flight.future

    def _finish_iteration(self) -> None:
        """Run every exchange to its end (stage by stage across buckets), restart the buckets
        that came back non-finite, and complete the futures."""
        flights, self._flights = self._flights, []
        self._pipeline.finish()
        compressed = [f for f in flights if f.entry is not None]
        if compressed:
            flags = torch.stack([f.entry["allreduce"].nonfinite for f in compressed]).tolist()  # the one read
            for f, nonfinite in zip(compressed, flags):
                if nonfinite:
                    f.grad.fill_(float("nan"))
                    f.entry["allreduce"].reset()
                    for name, buffer in f.entry.items():
                        if name != "allreduce":
                            buffer.zero_()
        for f in flights:
            f.future.set_result(f.grad)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Iteration count and every bucket's errors, random state and buffers (plain tensors and dicts)."""
        buckets = dict(self._saved)
        for index, entry in self._buckets.items():
            collective = entry["allreduce"].state_dict()
            buffers = {k: v.clone() for k, v in entry.items() if k != "allreduce"}
            buckets[index] = {"index": index, "numel": collective["numel"], "allreduce": collective, "buffers": buffers}
        return {"iter": self.iter, "buckets": buckets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (into a state registered on a new DDP instance).

        Buckets are restored when the hook first meets them with their saved size; the new
        DDP instance's first iteration, before it rebuilds its buckets, is exchanged exactly
        (fp32 all-reduce; Birder: the soft sign of the average), and the saved errors and
        moments take over from the next iteration. A layout that still differs then raises.
        """
        self.iter = int(state["iter"])
        self._buckets = {}
        self._saved = dict(state["buckets"])
        self._restore_iters = 0
        self._flights, self._pipeline = [], comm.Pipeline()

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, which cannot be pickled (as ``PowerSGDState``), and the
        other live objects in ``_unpickled``."""
        _log.warning("the process group is not pickled; the unpickled state uses the default group")
        slots = [s for cls in type(self).__mro__ for s in getattr(cls, "__slots__", ())]
        skip = self._unpickled + ("_buckets", "_saved", "_restore_iters", "_flights", "_pipeline")
        options = {s: getattr(self, s) for s in slots if s not in skip}
        return {**options, "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot in self._unpickled:
            setattr(self, slot, None)
        for slot, value in state.items():
            if slot != "state":
                setattr(self, slot, value)
        self.load_state_dict(state["state"])


class ErrorFeedbackState(_HookState):
    """State of :func:`error_feedback_hook`.

    Args:
        process_group: the DDP model's group (``None``: default).
        compressor: name or instance of the compressor (``"sign"``: 1 bit per value with
            ``||x||_2 / sqrt(n)`` scales; ``"identity"`` sends fp32 and equals plain DDP).
        start_iter: first compressed iteration (>= 2, see the class notes).
        scales: ``"tensor"``: a compressor with scales (``"sign"``) gives each parameter's
            piece of a chunk of the bucket its own, as the optimizers do; ``"chunk"``: one per
            chunk (the hooks of onebit 0.1.0).
        hierarchical: Birder's Hierarchical-1-bit-All-Reduce, as
            :func:`onebit.comm.compressed_allreduce` (``True``, ``False`` or ``"auto"``).
        ranks_per_node: ranks on each node, for the hierarchical exchange (``None``: detected).
        timeout: per-collective timeout.
        **compressor_kwargs: passed to :func:`onebit.compress.get`.

    Examples:
        With a DDP model (``torch.distributed`` initialised), and any optimizer::

            ddp = DistributedDataParallel(model)
            ddp.register_comm_hook(onebit.hooks.ErrorFeedbackState(compressor="sign"),
                                   onebit.hooks.error_feedback_hook)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    """

    __slots__ = ("compressor", "compressor_kwargs", "scales")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        compressor: str = "sign",
        start_iter: int = 2,
        *,
        scales: str = "tensor",
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        timeout: float | timedelta | None = None,
        **compressor_kwargs: Any,
    ) -> None:
        super().__init__(process_group, start_iter, hierarchical, ranks_per_node, timeout)
        get(compressor, **compressor_kwargs)  # validate now, not in the middle of a backward pass
        self.compressor = compressor
        self.compressor_kwargs = compressor_kwargs
        self.scales = check_scales(scales)

    def _compressor(self, index: int) -> str | Compressor:
        return get(self.compressor, **self.compressor_kwargs)

    def _segments(self, bucket: dist.GradBucket) -> list[int] | None:
        if self.scales == "chunk" or not get(self.compressor, **self.compressor_kwargs).blockwise:
            return None
        return [0, *itertools.accumulate(g.numel() for g in bucket.gradients()[:-1])]


def error_feedback_hook(state: ErrorFeedbackState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """signSGD with two-sided error feedback (DoubleSqueeze-style) on each DDP bucket.

    Every worker sends ``C(g + e)`` and keeps ``e <- g + e - C(g + e)``; the owner of each
    chunk averages, adds its server error, re-compresses; everyone decodes the same
    all-gathered bytes (:class:`onebit.comm.CompressedAllReduce`), so replicas stay
    identical. The result replaces the bucket's gradients: use any optimizer on top. The
    exchange overlaps the rest of the backward pass (see the state's class notes).
    """
    entry = state._entry(bucket)
    grad = bucket.buffer()
    stages = state._mean(grad) if entry is None else entry["allreduce"].stages(grad, out=grad)
    return state._schedule(bucket, entry, stages)


class BirderState(_HookState):
    """State of :func:`birder_hook`: per-bucket ``m``, ``b``, errors and random generators.

    Rank ``r``'s quantiser for bucket ``i`` draws from a generator seeded
    ``seed + r * 2**32 + i * 2**48``; ``beta``/``eps`` as :class:`onebit.Birder`.

    ``grad_scaler``: the ``torch.amp.GradScaler`` of a mixed-precision loop. The hook then
    unscales the bucket before it enters ``m`` and ``b`` and multiplies its ``+-1`` output
    by the scale, so that ``scaler.unscale_`` / ``scaler.step`` hand the optimizer exactly
    ``u_bar``: without it the step would shrink by the loss scale (65536x by default). It is
    not pickled with the state (pass it again after loading).

    Args:
        process_group: the DDP model's group (``None``: default).
        beta: the EMA rate of ``m`` and ``b``.
        eps: added to ``b`` in ``m / (b + eps)``.
        seed: seed of the quantisers' generators.
        start_iter: first compressed iteration (>= 2: DDP rebuilds its buckets after the
            first; before it the gradient is averaged exactly).
        hierarchical: Birder's Hierarchical-1-bit-All-Reduce (``True``, ``False`` or ``"auto"``).
        ranks_per_node: ranks on each node, for the hierarchical exchange (``None``: detected).
        timeout: per-collective timeout.
        grad_scaler: the loop's ``torch.amp.GradScaler``, if any (above).

    Examples:
        With a DDP model (``torch.distributed`` initialised); SGD without momentum makes the
        step Birder's, ``x <- x (1 - lr wd) - lr u_bar``::

            ddp = DistributedDataParallel(model)
            ddp.register_comm_hook(onebit.hooks.BirderState(seed=0),
                                   onebit.hooks.birder_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, weight_decay=0.05)
    """

    __slots__ = ("beta", "eps", "seed", "rank", "grad_scaler", "_loss_scale")
    _unpickled = ("process_group", "grad_scaler")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        beta: float = 0.95,
        eps: float = 1e-8,
        seed: int = 0,
        start_iter: int = 2,
        *,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        timeout: float | timedelta | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(process_group, start_iter, hierarchical, ranks_per_node, timeout)
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        self._loss_scale = 1.0
        self.beta = check_beta(beta)
        self.eps = check_positive("epsilon", eps)
        self.seed = check_seed(seed)
        self.rank = comm.get_rank(process_group)

    def _compressor(self, index: int) -> Compressor:
        return StochasticSignCompressor(self.seed + self.rank * 2**32 + index * 2**48)

    def _new_buffers(self, grad: Tensor) -> dict[str, Tensor]:
        zeros = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        return {"exp_avg": zeros, "exp_avg_abs": zeros.clone()}


def birder_hook(state: BirderState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Birder (Algorithm 1) in DDP: the bucket's gradients are replaced by the 1-bit update ``u_bar``.

    Per bucket, every rank updates ``m`` and ``b`` from its local gradient, the update
    ``m / (b + eps)`` goes through the error-compensated stochastic 1-bit all-reduce, and
    ``u_bar`` (``+-1`` per value) is returned in place of the gradient. Pair it with
    ``torch.optim.SGD(params, lr, weight_decay=wd)`` (no momentum): ``x <- x (1 - lr wd) -
    lr u_bar`` is Birder's step with decoupled weight decay. Before ``start_iter`` the
    gradient is averaged exactly and ``g / (|g| + eps)`` (Birder's update from zero
    moments, a soft sign) is returned. The exchange overlaps the rest of the backward pass.
    """
    if bucket.index() == 0:  # the loss scale, read once per iteration: out of the moments, back onto the output
        scaler = state.grad_scaler
        state._loss_scale = 1.0 if scaler is None or not scaler.is_enabled() else scaler.get_scale()
    entry = state._entry(bucket)
    return state._schedule(bucket, entry, _birder_stages(state, entry, bucket.buffer(), state._loss_scale))


def _birder_stages(state: BirderState, entry: dict[str, Any] | None, grad: Tensor, scale: float) -> Stages:
    """The bucket's ``u_bar`` (times the loss ``scale``) into ``grad``, as stages; the moments
    take in the gradient in the first one, inside the hook call."""
    if entry is None:
        yield from state._mean(grad)
        return grad.div_(grad.abs().add_(state.eps * scale)).mul_(scale)
    update = soft_sign_direction(
        [(0, grad.numel())],
        grads=[grad.float().div_(scale)],
        active=[True],
        exp_avg=entry["exp_avg"],
        exp_avg_abs=entry["exp_avg_abs"],
        max_exp_avg_abs=None,
        use_max=False,
        betas=[state.beta],
        eps=state.eps,
        out=torch.empty(grad.numel(), dtype=torch.float32, device=grad.device),
    )
    yield from entry["allreduce"].stages(update, out=update)
    return grad.copy_(update.mul_(scale))
