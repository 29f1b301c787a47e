"""1-bit Adam (Tang et al., 2021): Adam warm-up, then frozen variance and 1-bit momentum.

The math (plain functions on flat fp32 state, parameter ``i`` at ``offsets[i]``; ``active[i]``
says whether it has a gradient on some rank -- the others keep their value and moments):
:func:`adam` is eq. (1), the warm-up (and the naive control's every step); the momentum a
rank sends in the compression stage is ``beta1 m + (1 - beta1) g`` (Algorithm 1 line 6,
:func:`~onebit.optim._functional.ema_`); :func:`onebit_adam` is lines 11-13 on its
error-compensated 1-bit average; :func:`refresh_preconditioner` is a refresh of the frozen
variance (``refresh_every``, not in the paper: 0/1 Adam's variance refreshes, weighted by the
steps since the last one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import comm
from .._checks import (
    check_adam_args,
    check_bool,
    check_optional_positive,
    check_overlap,
    check_positive_int,
    check_wire_dtype,
)
from ._base import OnebitOptimizer
from ._stages import COMPRESSED_FORMED, EXACT_GRADIENT, RefreshedStages, Sends, Stage, TwoStages, Wire
from ._freeze import freeze_schedule, warn_early_freeze
from ._functional import (adam_denominator, adam_denominators, apply_update_, clip_to_adam_step_, count_unused, ema_,
                          mask_unused_)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["OnebitAdam", "adam", "onebit_adam", "refresh_preconditioner"]


def adam(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor] | Mapping[int, Tensor],
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    eps: float,
    bias_correction: bool,
    indices: Iterable[int] | None = None,
) -> None:
    """Adam, eq. (1), with decoupled weight decay (``torch.optim.AdamW``) on the averaged
    gradients ``grads`` (contiguous fp32 views, scratch once used: each denominator is formed
    in its gradient's place; ``grads[i]`` is read for the active parameters only). With
    ``bias_correction`` the momentum is divided by ``1 - beta1^t`` and the variance by
    ``1 - beta2^t``. ``indices``: only those parameters (None: all)."""
    for i in range(len(params)) if indices is None else indices:
        if not active[i]:
            continue
        p, (lo, hi) = params[i], offsets[i]
        beta1, beta2 = betas[i]
        g = grads[i]
        exp_avg[lo:hi].view(p.shape).lerp_(g, 1.0 - beta1)
        exp_avg_sq[lo:hi].view(p.shape).mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bc1 = 1.0 - beta1**step if bias_correction else 1.0
        bc2 = 1.0 - beta2**step if bias_correction else 1.0
        denom = adam_denominator(exp_avg_sq[lo:hi], eps=eps, bias_correction2=bc2, out=g.view(-1))
        apply_update_(p, exp_avg[lo:hi], denom, lr=lrs[i], weight_decay=weight_decays[i], step_size=lrs[i] / bc1)


def onebit_adam(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    active: Sequence[bool],
    exp_avg: Tensor,
    frozen_denom: Tensor,
    step: int,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    bias_correction: bool,
    clip_update: float | None = 10.0,
    frozen_at: int = 0,
    indices: Iterable[int] | None = None,
) -> None:
    """Algorithm 1 lines 11-13: ``x <- x - lr m / frozen_denom`` with ``m`` (``exp_avg``) the
    averaged momentum, first clipped to ``clip_update`` times Adam's largest step
    (:func:`clip_to_adam_step_`; None: no clip). ``frozen_denom`` is the preconditioner
    ``sqrt(v_T / bias_correction2) + eps`` of the variance frozen at step ``frozen_at``
    (:func:`adam_denominator`); with ``bias_correction`` the momentum is divided by ``1 - beta1^t``.
    ``indices``: only those parameters (None: all)."""
    for i in range(len(params)) if indices is None else indices:
        if not active[i]:
            continue
        p, (lo, hi) = params[i], offsets[i]
        beta1, beta2 = betas[i]
        bc1 = 1.0 - beta1**step if bias_correction else 1.0
        denom = frozen_denom[lo:hi]
        if clip_update is not None:
            bc2 = 1.0 if bias_correction else 1.0 - beta2**frozen_at
            clip_to_adam_step_(exp_avg[lo:hi], denom, beta1, beta2, bc1, bc2, clip_update)
        apply_update_(p, exp_avg[lo:hi], denom, lr=lrs[i], weight_decay=weight_decays[i], step_size=lrs[i] / bc1)


def refresh_preconditioner(
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor] | Mapping[int, Tensor],
    active: Sequence[bool],
    exp_avg: Tensor,
    frozen_denom: Tensor,
    step: int,
    since: int,
    betas: Sequence[tuple[float, float]],
    eps: float,
    bias_correction: bool,
    indices: Iterable[int] | None = None,
) -> None:
    """A refresh of the frozen state at ``step`` from the gradients' exact average ``g``
    (``grads[i]``, read for the active parameters only): ``m <- beta1 m + (1 - beta1) g``, and
    the variance behind ``frozen_denom`` takes ``g^2`` as if each of the ``step - since`` steps
    since it was last updated (the freeze, or the last refresh) had seen it --
    ``v <- beta2^k v + (1 - beta2^k) g^2`` with ``k = step - since`` -- so that it keeps Adam's
    memory of about ``1 / (1 - beta2)`` steps however rarely it is refreshed (0/1 Adam's
    refreshes add one ``g^2`` with weight ``1 - beta2`` each: their variance mostly remembers
    the early ones). With ``bias_correction`` ``frozen_denom`` is ``sqrt(v_hat) + eps``, ``v_hat =
    v / (1 - beta2^t)``, and the update is made on ``v_hat``; without, on ``v``. The step itself is
    then :func:`onebit_adam`'s, on the exact ``m``. ``indices``: only those parameters (None: all)."""
    for i in range(len(offsets)) if indices is None else indices:
        if not active[i]:
            continue
        lo, hi = offsets[i]
        beta1, beta2 = betas[i]
        g = grads[i].reshape(-1)
        exp_avg[lo:hi].lerp_(g, 1.0 - beta1)
        decay = beta2 ** (step - since)
        keep, take = decay, 1.0 - decay
        if bias_correction:  # on v_hat: v_t / (1 - beta2^t) from v_since / (1 - beta2^since)
            keep, take = keep * (1.0 - beta2**since) / (1.0 - beta2**step), take / (1.0 - beta2**step)
        d = frozen_denom[lo:hi]
        d.sub_(eps).square_().mul_(keep).addcmul_(g, g, value=take).sqrt_().add_(eps)


# "auto"'s latest freeze with refreshes, in windows of its criterion (on the bias-corrected variance,
# 100 steps at beta2 = 0.999): one, the first step the criterion could look back a window, so that with
# refreshes the freeze comes there. Frozen at step 100 of 1,024 and refreshed every 8 in bf16, the 12.9M
# GPT ended as far ahead of never freezing as frozen at 200 with fp32 refreshes
# (benchmarks/results/time-to-loss/gpt); frozen at 204 for good it stalled. The criterion itself fired
# after 395-457 steps there, the fp32 steps of its wait most of the run's time at 100 Mbit/s.
_REFRESHED_WINDOWS = 1
# Adam's moments, and the gradients' average: the warm-up (and the naive control's every step,
# _onebit_adam_naive.py)
_ADAM = ("exp_avg", "exp_avg_sq")
# The compression stage: the variance becomes the frozen preconditioner in place (Algorithm 1 line 2)
_FROZEN = Stage(COMPRESSED_FORMED, ("exp_avg", "frozen_denom"), renames={"exp_avg_sq": "frozen_denom"})


class _AdamFamily(OnebitOptimizer):
    """Argument checks and eq. (1) shared by the Adam variants."""

    def _init_adam(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *, lr: float,
                   betas: tuple[float, float], eps: float, weight_decay: float, bias_correction: bool,
                   group: comm.Group, options: CommonOptions) -> None:
        self.bias_correction = check_bool("bias_correction", bias_correction)
        self.eps = float(eps)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}, group=group,
                         **options)

    @property
    def allreduce(self) -> Any:
        """The compressed all-reduce (with ``overlap=True``, the first bucket's)."""
        return self._collectives[0]

    def _adam(self, average: Tensor, indices: Sequence[int] | None = None) -> None:
        """Eq. (1) on the averaged gradients, of parameters ``indices`` (None: all)."""
        b = self.flat.buffers
        adam(self.flat.params, self.flat.offsets, grads=self.flat.split(average, indices), active=self._active,
             indices=indices,
             exp_avg=b["exp_avg"], exp_avg_sq=b["exp_avg_sq"], step=self._step_count, lrs=self._hyper("lr"),
             betas=self._hyper("betas"), weight_decays=self._hyper("weight_decay"), eps=self.eps,
             bias_correction=self.bias_correction)


class OnebitAdam(_AdamFamily):
    """1-bit Adam (Algorithm 1 of Tang et al., 2021).

    * Warm-up (steps ``1 .. freeze_step``): gradients are averaged with a full-precision
      all-reduce and exact Adam, eq. (1), runs. With ``bias_correction=True`` (the default)
      this is ``torch.optim.AdamW`` (decoupled weight decay: ``x <- x - lr * wd * x``) and the
      variance is frozen bias-corrected. ``False`` is the paper's BERT setting (and
      DeepSpeed's): safe only when the freeze comes after ``1 - beta2^T`` is near 1 (thousands
      of steps); frozen earlier, the raw variance is too small and every compressed step too
      large, so freezing with ``1 - beta2^T < 0.5`` warns.
    * Compression (after the freeze): the variance is frozen as a preconditioner; each
      rank updates its momentum with its local gradient (line 6); the momentum of all
      parameters, one fused flat buffer, is exchanged by :class:`onebit.comm.CompressedAllReduce`
      with worker and server error feedback (1-bit signs + one scale per chunk), replacing the
      momentum on every rank; then ``x <- x - lr * m / (sqrt(v_frozen) + eps)`` (lines 11-13).
      Values whose variance is exactly zero at the freeze (no gradient during the whole
      warm-up, e.g. unused embedding rows) keep a zero momentum -- DeepSpeed's
      ``exp_avg_mask``, derived instead of asked for. At the freeze the variance buffer becomes
      the preconditioner ``sqrt(v_T / (1 - beta2^T)) + eps`` itself (``state[p]["frozen_denom"]``
      from then on): the compression stage holds ``m``, that, and the collective's worker and
      server errors -- 3 + 1/w model sizes.
    * Refreshes (``refresh_every``, not in the paper; every 8th step after the freeze by
      default): the step all-reduces the gradients (in bf16 by default, ``refresh_dtype``) and
      refreshes ``m`` and the frozen variance from their average
      (:func:`onebit.optim.refresh_preconditioner`), so that the preconditioner follows the
      gradients after an early freeze; ``stats["stage"]`` is ``"refresh"``.
      ``refresh_every=None``: Algorithm 1.

    Args:
        params: parameters or param groups (options ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate, as ``torch.optim.AdamW``'s (read every step, so LR schedulers work).
        betas: Adam's ``(beta1, beta2)``.
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: decoupled weight decay (``x <- x - lr * wd * x``), as ``torch.optim.AdamW``'s.
        freeze_step: last warm-up step (an int), or ``"auto"`` for the paper's variance
            stability criterion (see :class:`onebit.optim.FreezeSchedule`).
        bias_correction: Adam's bias correction (see above).
        group: process group (``None``: default; no process group: world size 1), an
            :class:`onebit.comm.MPIGroup`, or a backend name (``"mpi"``: mpi4py's ``COMM_WORLD``).
        freeze_threshold: the auto criterion's band ``[threshold, 1 / threshold]`` (``None``: 0.85 on the
            bias-corrected variance, the paper's 0.96 on the raw one, without bias correction).
        freeze_window: the auto criterion's window ``D`` (``None``: ``round(0.1 / (1 - beta2))``
            on the bias-corrected variance, 100 steps at 0.999; ``round(1 / (1 - beta2))`` on the
            raw one, without bias correction).
        min_freeze_step: "auto" never freezes before this step (set it to the LR warm-up).
        max_freeze_step: "auto" freezes at this step at the latest (``None``: with refreshes,
            after one of its windows -- step 100 with the defaults, before the criterion could
            fire, so that the freeze comes there -- or at ``min_freeze_step`` if later; without
            refreshes, no limit).
        compressor: compressor of the momentum exchange (``"sign"``; ``"identity"`` gives the
            paper's "1-bit Adam (32-bits)" ablation).
        scales: ``"tensor"``: a compressor with scales (``"sign"``) gives each parameter's
            piece of a rank's chunk its own, as DeepSpeed's per-tensor exchange (4 bytes more per
            piece); ``"chunk"``: one per rank's chunk of the fused buffer, which gives a layer of
            small values the magnitude of its larger neighbours.
        clip_update: clip each value's compressed step to this many times Adam's own largest
            step, ``lr (1 - beta1) / sqrt(1 - beta2)`` (:func:`onebit.optim.clip_to_adam_step_`;
            not in the paper; ``None``: no clip). Without it, values whose frozen variance is
            tiny take steps of ``lr * scale / sqrt(v)`` from the 1-bit exchange.
        refresh_every: after the freeze, every ``refresh_every``-th step refreshes the frozen
            variance (not in the paper; ``None``: frozen for good, Algorithm 1): that step
            all-reduces the gradients (in ``refresh_dtype``), and the variance takes their
            square as if every step since its last update had seen it
            (:func:`onebit.optim.refresh_preconditioner`), so that the preconditioner follows the
            gradients' scale where it moves after the freeze; the other steps are 1-bit. A variance
            frozen for good stalls a run frozen early at a constant learning rate; refreshed, the
            freeze can come early, so ``"auto"`` freezes by ``max_freeze_step``'s default at the latest.
        refresh_dtype: what a refresh's all-reduce sums the gradients in: ``torch.bfloat16`` (the
            default) sends half the bytes of the warm-up's fp32 all-reduce; the average it gives
            differs from the exact one by bf16's rounding (about 0.4% of a value), far less than the
            noise of a variance estimate, and enters ``m`` for that one step only.
            ``torch.float32``: the exact average, as an MPI group's, which sums in fp32.
        hierarchical: exchange with Birder's Hierarchical-1-bit-All-Reduce
            (:func:`onebit.comm.compressed_allreduce`: ``True``, ``False`` or ``"auto"``).
        ranks_per_node: ranks on each node, for the hierarchical exchange (``None``: detected).
        overlap: ``None`` (``"warmup"`` on several ranks): the warm-up's fp32 all-reduce leaves
            during backward in buckets, as DDP's, and the compression stage exchanges in
            ``step()`` (below); ``True``: both stages start each bucket's exchange during
            backward, as soon as its gradients are accumulated; ``False``: one exchange of the
            whole model in ``step()``.
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 state (as DDP's).
        **options: :class:`onebit.optim.CommonOptions` (``timeout``, ``broadcast_parameters``,
            ``on_nonfinite``, ``check_replicas_every``, ``max_grad_norm``).

    ``stats`` reports the stage, the bytes this rank sent in the last step and the step
    the warm-up ended (also logged at INFO on ``onebit.optim``).

    **The warm-up during backward** (the default): the warm-up's exact all-reduce leaves in
    buckets of ``bucket_cap_mb`` as their gradients arrive, and ``step()`` waits for it. A gradient
    changed after its bucket left (a second backward outside :meth:`no_sync`, a clip: its version
    counter; GradScaler: the scaled gradients it hands ``step()``) makes the ranks agree to
    exchange in ``step()`` instead, and keep doing so (as on a DDP-wrapped model, whose gradients
    DDP writes again after backward); a write through ``p.grad.data`` is not seen (use
    ``overlap=False``). On two ranks this gives ``overlap=False``'s bits.

    **Overlapped exchange** (``overlap=True``, DDP's scheme): the parameters are grouped into
    buckets in reverse order; a post-accumulate-grad hook starts a bucket's exchange once
    all its gradients are in -- the exact fp32 all-reduce in the warm-up, ``c = e + beta1 m
    + (1 - beta1) g`` and its compressed all-to-all in the compression stage -- while
    backward computes earlier layers; ``step()`` finishes what is in flight (each bucket is
    chunked and compressed on its own, so the bits differ from ``overlap=False``; every rank
    still gets the same ones). Requirements, each checked: a flat exchange, no
    ``max_grad_norm`` (the local clip needs every gradient before the first bucket leaves),
    no GradScaler, and gradient accumulation inside :meth:`no_sync` for all micro-batches but
    the last. Two behaviours differ from ``overlap=False``: a skipped step (non-finite
    gradient) of the compression stage restarts the error-feedback buffers at zero (they were
    updated before the ranks could agree), and a trainable parameter with no gradient on
    *any* rank still has its momentum decayed by ``beta1`` in the exchange.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=100)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.stats["stage"]
        'warmup'
    """

    applies_by_bucket = True  # each parameter's step reads only its own state and average

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str = "auto",
        bias_correction: bool = True,
        group: comm.Group = None,
        *,
        freeze_threshold: float | None = None,
        freeze_window: int | None = None,
        min_freeze_step: int = 0,
        max_freeze_step: int | None = None,
        compressor: str = "sign",
        scales: str = "tensor",
        clip_update: float | None = 10.0,
        refresh_every: int | None = 8,
        refresh_dtype: torch.dtype = torch.bfloat16,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        overlap: bool | str | None = None,
        bucket_cap_mb: float = 25.0,
        **options: Unpack[CommonOptions],
    ) -> None:
        self.clip_update = check_optional_positive("clip_update", clip_update)
        self.refresh_every = None if refresh_every is None else check_positive_int("refresh_every", refresh_every)
        # A refresh of the frozen state: the gradients' average, as the warm-up's but in refresh_dtype
        self._refresh = Stage(Wire("refresh", Sends.GRADIENTS, check_wire_dtype("refresh_dtype", refresh_dtype)),
                              ("exp_avg", "frozen_denom"), averages=True, renames=_FROZEN.renames)
        check_overlap(overlap)
        beta2 = check_adam_args(lr, betas, eps, weight_decay)[1]
        warmup = Stage(EXACT_GRADIENT, _ADAM, averages=True)
        schedule = freeze_schedule(freeze_step, beta2, threshold=freeze_threshold, window=freeze_window,
                                   min_step=min_freeze_step, max_step=max_freeze_step,
                                   corrected=check_bool("bias_correction", bias_correction),
                                   max_windows=None if self.refresh_every is None else _REFRESHED_WINDOWS)
        name = type(self).__name__
        self._stages = (TwoStages(name, warmup, _FROZEN, schedule, watch="exp_avg_sq") if self.refresh_every is None
                        else RefreshedStages(name, warmup, _FROZEN, self._refresh, schedule, watch="exp_avg_sq",
                                             every=self.refresh_every))
        self._unused: list[int] = []  # the parameters with values unused through the warm-up
        self._init_adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, group=group, options=options)
        self._drive(self._allreduce(compressor, hierarchical=hierarchical, ranks_per_node=ranks_per_node,
                                    overlap=overlap is True, scales=scales), overlap=overlap,
                    bucket_cap_mb=bucket_cap_mb)

    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """``m' = beta1 m + (1 - beta1) g`` (line 6); a frozen parameter's ``m`` as it is."""
        m = self.flat.buffers["exp_avg"][lo:hi]
        if live:
            ema_(m, grad, group["betas"][0], out=out)
        else:
            out.copy_(m)

    def _landing(self, wire: Wire) -> Tensor:
        # the warm-up averages the gradients; the compressed momentum average replaces m
        return self._grad if not wire.formed else self.flat.buffers["exp_avg"]

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        """The step of parameters ``members`` alone (None: all; each parameter's update reads only
        its own state and average): the overlapped exchange applies each bucket as it lands."""
        if wire == EXACT_GRADIENT:  # the warm-up
            self._adam(average, members)
            return
        b = self.flat.buffers
        step, updated = self._step_count, self._stages.updated_at
        if wire == self._refresh.wire:  # the gradients' average enters m and the frozen variance
            refresh_preconditioner(self.flat.offsets, grads=self.flat.split(average, members), active=self._active,
                                   indices=members, exp_avg=b["exp_avg"], frozen_denom=b["frozen_denom"], step=step,
                                   since=updated, betas=self._hyper("betas"), eps=self.eps,
                                   bias_correction=self.bias_correction)
            updated = step
        unused = self._unused if members is None else set(members).intersection(self._unused)
        mask_unused_(b["exp_avg"], b["frozen_denom"], self.eps, self.flat.offsets, unused)
        onebit_adam(self.flat.params, self.flat.offsets, active=self._active, indices=members, exp_avg=b["exp_avg"],
                    frozen_denom=b["frozen_denom"], step=step, lrs=self._hyper("lr"),
                    betas=self._hyper("betas"), weight_decays=self._hyper("weight_decay"),
                    bias_correction=self.bias_correction, clip_update=self.clip_update,
                    frozen_at=updated)

    def _enter(self, stage: Stage) -> None:
        """Algorithm 1 line 2: the variance, renamed ``"frozen_denom"``, becomes in place the frozen
        preconditioner ``sqrt(v_T / (1 - beta2^T)) + eps`` (``1`` for ``1 - beta2^T`` without bias
        correction). The compression stage only ever divides by it, so it takes ``v``'s buffer
        rather than a second model-sized one, and costs nothing per step; it reads each rank's own
        gradients where they lie (no averaged gradients' buffer). Back from a refresh, which
        updated it in place: the values still without a gradient."""
        frozen_at = self._stages.frozen_at
        froze = frozen_at == self._step_count  # else back from a refresh, or into one
        if froze:
            d = self.flat.buffers["frozen_denom"]
            bc2 = [1.0 - beta2**frozen_at if self.bias_correction else 1.0 for _, beta2 in self._hyper("betas")]
            adam_denominators(d, self.flat.offsets, eps=self.eps, bias_corrections2=bc2, out=d)
            if not self.bias_correction:
                warn_early_freeze(type(self).__name__, frozen_at, max(b for _, b in self._hyper("betas")))
        if stage is not self._refresh:
            self._note_unused(log=froze)

    def _note_unused(self, log: bool = True) -> None:
        # sqrt(v_hat) + eps == eps: no gradient through the warm-up and refreshes (or one below eps's rounding)
        self._unused = count_unused(type(self).__name__, self.flat.buffers["frozen_denom"], self.eps,
                                   self.flat.offsets, log=log)

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        if self._stages.frozen_at is not None:
            self._note_unused()
