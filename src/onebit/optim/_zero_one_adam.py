"""0/1 Adam (Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam",
ICLR 2023, arXiv 2202.06009): adaptive variance freezing and 1-bit synchronisation with local steps.

The math, plain functions on flat fp32 state: :func:`refresh_variance` (a step of ``T_v``),
:func:`local_step` (outside ``T_u``: ``x_{t+1/2}``, ``u_{t+1/2}``), :func:`synchronise` (a step of
``T_u``: ``m_{t+1} = u_bar / sum(lr)``, ``x_{t+1} = x_{t'} - u_bar / sqrt(v)``), each dividing by
``d = sqrt(v / (1 - beta2^k)) + eps`` (:meth:`ZeroOneSchedule.variance_age`'s ``k``; 1 without bias correction).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from .. import comm
from .._checks import check_adam_args, check_bool, check_optional_positive
from ..ops import zero_where_equal_
from ._base import OnebitOptimizer
from ._stages import COMPRESSED_FORMED, COMPRESSED_GRADIENT, LOCAL, Sends, Stage, StepStages, Wire
from ._freeze import Interval, ZeroOneSchedule
from ._functional import (adam_denominator, adam_denominators, apply_update_, clip_to_adam_step_, count_unused, ema_,
                          mask_unused_)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["ZeroOneAdam", "local_step", "refresh_variance", "synchronise"]

# A refresh step: the gradients' exact fp32 average (the variance needs it; so does nothing else).
REFRESH = Wire("variance", Sends.GRADIENTS)

# Up to var_freeze_step: the moments and the gradients' average (exact at a refresh, else 1-bit).
_REFRESH = Stage(REFRESH, ("exp_avg", "exp_avg_sq"), averages=True)
_GRADIENT = Stage(COMPRESSED_GRADIENT, ("exp_avg", "exp_avg_sq"), averages=True)
# After it: the variance becomes the frozen preconditioner in place, and the 1-bit exchange sends
# momentum instead of gradients, so its errors restart (DeepSpeed's reinitial_error_buffer).
_MOMENTUM = Stage(COMPRESSED_FORMED, ("exp_avg", "frozen_denom"), renames={"exp_avg_sq": "frozen_denom"},
                  resets_errors=True)
# Once intervals of local steps begin: the anchor (the parameters of the last synchronisation)
# and the interval's accumulated momentum, at synchronisations and local steps alike.
_INTERVALS = ("exp_avg", "frozen_denom", "anchor", "accum")
_SYNCHRONISE = Stage(COMPRESSED_FORMED, _INTERVALS)
_LOCAL = Stage(LOCAL, _INTERVALS)


def _stage_of(schedule: ZeroOneSchedule, step: int) -> Stage:
    """``T_v`` and ``T_u``: a refresh or a 1-bit gradient step up to ``var_freeze_step``; then a
    1-bit synchronisation, or a local step inside an interval."""
    if step <= schedule.var_freeze_step:
        return _REFRESH if schedule.refreshes(step) else _GRADIENT
    if schedule.interval(step) == 1:
        return _MOMENTUM
    return _SYNCHRONISE if schedule.synchronises(step) else _LOCAL


def refresh_variance(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor],
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    eps: float,
    bias_correction1: Sequence[float],
    bias_correction2: Sequence[float],
    span: int = 1,
) -> None:
    """A step of ``T_v`` on the averaged gradients ``grads`` (contiguous fp32 views, used as
    scratch): ``m`` takes them, ``v <- beta2^span v + (1 - beta2^span) g^2`` (``span=1``:
    Algorithm 1's), and ``x <- x (1 - lr wd) - (lr / bc1) m / d``."""
    for i, (p, (lo, hi)) in enumerate(zip(params, offsets)):
        if not active[i]:
            continue
        beta1, beta2 = betas[i]
        decay = beta2**span
        g = grads[i]
        exp_avg[lo:hi].view(p.shape).lerp_(g, 1.0 - beta1)
        exp_avg_sq[lo:hi].view(p.shape).mul_(decay).addcmul_(g, g, value=1.0 - decay)
        denom = adam_denominator(exp_avg_sq[lo:hi], eps=eps, bias_correction2=bias_correction2[i], out=g.view(-1))
        apply_update_(p, exp_avg[lo:hi], denom, lr=lrs[i], weight_decay=weight_decays[i],
                      step_size=lrs[i] / bias_correction1[i])


def local_step(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    active: Sequence[bool],
    exp_avg: Tensor,
    accum: Tensor,
    anchor: Tensor,
    denom: Tensor,
    weights: Sequence[float],
    lr_sums: Sequence[float],
    weight_decays: Sequence[float],
) -> None:
    """A step outside ``T_u``, ``exp_avg`` holding this rank's momentum ``m`` of the step (from
    its own gradient): ``u <- u + weight m`` (``weight = lr / bc1``), and ``x = x_anchor (1 -
    lr_sum wd) - u / d`` with ``lr_sum`` the learning rates summed over the interval so far.
    ``x`` is computed from the anchor, not stepped: the anchor stays exact and the same on every
    rank, and a checkpoint restores ``x`` from it."""
    for i, (p, (lo, hi)) in enumerate(zip(params, offsets)):
        if not active[i]:
            continue
        accum[lo:hi].add_(exp_avg[lo:hi], alpha=weights[i])
        _from_anchor(p, anchor[lo:hi], accum[lo:hi], denom[lo:hi], lr=lr_sums[i], weight_decay=weight_decays[i],
                     step_size=1.0)


def synchronise(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    moving: Sequence[bool],
    exp_avg: Tensor,
    anchor: Tensor | None,
    denom: Tensor,
    weight_sums: Sequence[float],
    lr_sums: Sequence[float],
    weight_decays: Sequence[float],
) -> None:
    """A step of ``T_u``: ``m`` (``exp_avg``) holds the average, ``x = x_anchor (1 - lr_sum wd) -
    weight_sum m / d`` for the parameters ``moving`` (with no anchor, ``x`` is its own: an
    interval of one step), and the anchor moves to ``x``."""
    for i, (p, (lo, hi)) in enumerate(zip(params, offsets)):
        if not moving[i]:
            continue
        if anchor is None:
            apply_update_(p, exp_avg[lo:hi], denom[lo:hi], lr=lr_sums[i], weight_decay=weight_decays[i],
                          step_size=weight_sums[i])
            continue
        _from_anchor(p, anchor[lo:hi], exp_avg[lo:hi], denom[lo:hi], lr=lr_sums[i], weight_decay=weight_decays[i],
                     step_size=weight_sums[i])
        anchor[lo:hi].copy_(p.detach().reshape(-1))


def _from_anchor(p: Tensor, anchor: Tensor, numer: Tensor, denom: Tensor, *, lr: float, weight_decay: float,
                 step_size: float) -> None:
    """``p = anchor (1 - lr wd) - step_size numer / denom``, computed in fp32 from the anchor."""
    with torch.no_grad():
        p.copy_(anchor.view(p.shape))
        apply_update_(p, numer, denom, lr=lr, weight_decay=weight_decay, step_size=step_size)


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam (Algorithm 1 of Lu et al., ICLR 2023): the variance refreshed on a thinning
    schedule, then frozen; 1-bit synchronisation, with local steps between synchronisations.

    ``stats["stage"]`` says which of three steps the last was:

    * ``"variance"``, a **refresh** (``T_v``, steps ``<= var_freeze_step``): the gradients
      all-reduced in fp32 and an exact Adam step with them (:func:`refresh_variance`); every step
      at first, then the interval doubles after every ``var_update_scaler`` refreshes, up to
      ``max_refresh_interval``. After ``var_freeze_step`` the variance is frozen.
    * ``"compressed"``, a **1-bit synchronisation** (``T_u``): the error-compensated 1-bit
      all-reduce (:class:`onebit.comm.CompressedAllReduce`) of the gradients, whose average
      enters ``m`` (DeepSpeed's form, the authors' own), and after ``var_freeze_step`` of the
      momentum, whose average replaces ``m`` (the errors restart at the freeze).
    * ``"local"``, a **local step** (after ``var_freeze_step``): between synchronisations, ``H``
      steps apart (doubling every ``local_step_scaler`` steps up to ``local_step_clipper``), each
      rank steps on its own gradients and sends nothing but the step's agreement
      (:func:`local_step`); the synchronisation exchanges the interval's step-weighted average
      momentum and moves every rank to the same parameters (:func:`synchronise`).

    Replicas are bit-identical after every refresh and synchronisation and differ inside an
    interval of local steps **by design**: :meth:`check_replicas` then compares the parameters
    of the last synchronisation (the *anchor*), and a :meth:`state_dict` saved there holds this
    rank's anchor and accumulated momentum, from which :meth:`load_state_dict` restores this
    rank's own parameters exactly (load it after the model's weights; save one per rank). Where
    it differs from DeepSpeed 0.19.6's ``ZeroOneAdam``, and why: the Coming from DeepSpeed page.

    State: ``m``, ``v`` (the preconditioner ``sqrt(v / (1 - beta2^k)) + eps`` once frozen,
    ``state[p]["frozen_denom"]``), the collective's worker and server errors and, up to the
    freeze, the gradients' average: 4 + 1/w model sizes, then 3 + 1/w; 5 + 1/w with the anchor
    and the accumulated momentum, once intervals of local steps begin.

    Args:
        params: parameters or param groups (options ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate, as ``torch.optim.AdamW``'s (read every step).
        betas: Adam's ``(beta1, beta2)``.
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: decoupled weight decay, as ``torch.optim.AdamW``'s.
        bias_correction: divide ``m`` by ``1 - beta1^t`` and ``v`` by ``1 - beta2^k``, ``k`` the
            last refresh's step (``refresh_weight="refresh"``: the refreshes so far; ``False``:
            DeepSpeed's update).
        group: process group (``None``: default), an :class:`onebit.comm.MPIGroup`, or a
            backend name (``"mpi"``).
        var_freeze_step: the last step that may refresh the variance (DeepSpeed's default
            100000: on shorter runs the variance is never frozen and no local steps happen).
        var_update_scaler: refreshes per interval before the interval doubles (kappa).
        max_refresh_interval: the longest interval between refreshes (``None``: the paper's
            and DeepSpeed's, doubling without bound; the 0/1 Adam page of the docs says why not).
        refresh_weight: ``"steps"``: a refresh updates ``v`` as if each step since the last had
            seen its gradients (Adam's memory of ``1 / (1 - beta2)`` steps); ``"refresh"``:
            Algorithm 1's, one ``(1 - beta2) g^2`` per refresh (:class:`ZeroOneSchedule`).
        local_step_scaler: steps after the freeze before the local-step interval doubles.
        local_step_clipper: the largest local-step interval (H).
        compressor: compressor of the synchronisation (``"sign"``; ``"identity"``: the exact mean).
        scales: ``"tensor"``: each parameter's piece of a rank's chunk has its own scale, as in
            DeepSpeed's per-tensor exchange (4 bytes more per piece); ``"chunk"``: one per chunk.
        clip_update: clip each value's synchronised step to this many times Adam's largest
            step (:func:`onebit.optim.clip_to_adam_step_`; ``None``: no clip).
        hierarchical: Birder's Hierarchical-1-bit-All-Reduce for the synchronisation
            (:func:`onebit.comm.compressed_allreduce`).
        ranks_per_node: ranks on each node, for the hierarchical exchange (``None``: detected).
        overlap: start each bucket's exchange during backward (refreshes and synchronisations;
            local steps send nothing).
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 state (as DDP's).
        **options: :class:`onebit.optim.CommonOptions`.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=100)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.stats["stage"]
        'variance'
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        group: comm.Group = None,
        *,
        var_freeze_step: int = 100_000,
        var_update_scaler: int = 16,
        max_refresh_interval: int | None = 8,
        refresh_weight: Literal["steps", "refresh"] = "steps",
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        compressor: str = "sign",
        scales: str = "tensor",
        clip_update: float | None = 10.0,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
        **options: Unpack[CommonOptions],
    ) -> None:
        self.clip_update = check_optional_positive("clip_update", clip_update)
        self.bias_correction = check_bool("bias_correction", bias_correction)
        check_bool("overlap", overlap)
        check_adam_args(lr, betas, eps, weight_decay)
        self.eps = float(eps)
        schedule = ZeroOneSchedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper,
                                   max_refresh_interval=max_refresh_interval, refresh_weight=refresh_weight)
        self._stages = StepStages((_REFRESH, _GRADIENT, _MOMENTUM, _SYNCHRONISE, _LOCAL), _stage_of, schedule,
                                  freeze_step=schedule.var_freeze_step)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}, group=group,
                         **options)
        self._interval = Interval(len(self.flat.params))
        self._unused: list[int] = []  # the parameters with values unused before the freeze
        self._drive(self._allreduce(compressor, hierarchical=hierarchical, ranks_per_node=ranks_per_node,
                                    overlap=overlap, scales=scales), overlap=overlap, bucket_cap_mb=bucket_cap_mb)

    @property
    def schedule(self) -> ZeroOneSchedule:
        """The refresh and synchronisation steps (:class:`ZeroOneSchedule`)."""
        return self._stages.schedule

    # ------------------------------------------------------------------ the contract
    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """The interval's weighted average momentum ``(u + w m') / (S + w)``, ``m' = beta1 m +
        (1 - beta1) g`` and ``w = lr / bc1`` this step (``m'`` alone for an interval of one
        step or with ``S + w = 0``); a parameter without a gradient adds no ``w m'``."""
        m = self.flat.buffers["exp_avg"][lo:hi]
        weight = self._weight(group, step) if live else 0.0
        total = self._interval.weight_sums[i] + weight
        accum = self.flat.buffers.get("accum")
        alone = accum is None or total == 0.0 or not self._interval.touched[i]  # m' alone
        if live:
            ema_(m, grad, group["betas"][0], out=out)
            if not alone:
                out.mul_(weight).add_(accum[lo:hi]).div_(total)
        elif alone:
            out.copy_(m)
        else:
            torch.div(accum[lo:hi], total, out=out)

    def _landing(self, wire: Wire) -> Tensor:
        # the gradients' average (exact, or 1-bit before the freeze); the momentum's replaces m
        return self.flat.buffers["exp_avg"] if wire.formed else self._grad

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        if wire is REFRESH:
            self._refresh(average)
        elif wire is LOCAL:
            self._local()
        else:
            self._synchronise(None if wire.formed else average)

    def _weight(self, group: dict[str, Any], step: int) -> float:
        """``lr / bc1`` of ``step``: what the step moves ``x`` by per unit of ``m / d``."""
        return group["lr"] / (1.0 - group["betas"][0] ** step if self.bias_correction else 1.0)

    def _weights(self, step: int) -> list[float]:
        """:meth:`_weight` of every parameter (read afresh: LR schedulers change ``lr``)."""
        return [self._weight(g, step) for g in self.param_groups for _ in g["params"]]

    def _corrections(self, step: int) -> tuple[list[float], list[float]]:
        """Per parameter: ``1 - beta1^step`` and ``1 - beta2^k`` (``k`` the schedule's
        :meth:`~ZeroOneSchedule.variance_age`), or ones."""
        betas = self._hyper("betas")
        if not self.bias_correction:
            return [1.0] * len(betas), [1.0] * len(betas)
        k = self.schedule.variance_age(step)
        return [1.0 - b1**step for b1, _ in betas], [1.0 - b2**k if k else 1.0 for _, b2 in betas]

    def _refresh(self, average: Tensor) -> None:
        step = self._step_count
        bc1, bc2 = self._corrections(step)
        b = self.flat.buffers
        refresh_variance(self.flat.params, self.flat.offsets, grads=self.flat.split(average), active=self._active,
                         exp_avg=b["exp_avg"], exp_avg_sq=b["exp_avg_sq"], lrs=self._hyper("lr"),
                         betas=self._hyper("betas"), weight_decays=self._hyper("weight_decay"), eps=self.eps,
                         bias_correction1=bc1, bias_correction2=bc2, span=self.schedule.span(step))

    def _denominator(self) -> Tensor:
        """``d``: the frozen preconditioner, or (before the freeze) formed from ``v`` in the
        gradients' average buffer, once the average has been used."""
        b = self.flat.buffers
        if "frozen_denom" in b:
            return b["frozen_denom"]
        _, bc2 = self._corrections(self._step_count)
        return adam_denominators(b["exp_avg_sq"], self.flat.offsets, eps=self.eps, bias_corrections2=bc2,
                                 out=self._grad)

    def _local(self) -> None:
        step, b = self._step_count, self.flat.buffers
        weights = self._weights(step)
        self._interval.add(self._hyper("lr"), weights, self._active)
        m, denom = b["exp_avg"], b["frozen_denom"]
        for (lo, hi), g, (beta1, _), active in zip(self.flat.offsets, self._local_grads(), self._hyper("betas"),
                                                   self._active):
            if active:
                ema_(m[lo:hi], g, beta1)
        self._protect(m, denom, self._active, step)
        local_step(self.flat.params, self.flat.offsets, active=self._active, exp_avg=m, accum=b["accum"],
                   anchor=b["anchor"], denom=denom, weights=weights, lr_sums=self._interval.lr_sums,
                   weight_decays=self._hyper("weight_decay"))

    def _synchronise(self, gradient: Tensor | None) -> None:
        """A synchronisation: ``m`` holds the momentum's 1-bit average, or (``gradient``, before
        the freeze) takes the gradient's, ``m <- beta1 m + (1 - beta1) g``; then the step."""
        step, b = self._step_count, self.flat.buffers
        if gradient is not None:
            for (lo, hi), (beta1, _), active in zip(self.flat.offsets, self._hyper("betas"), self._active):
                if active:
                    ema_(b["exp_avg"][lo:hi], gradient[lo:hi], beta1)
        interval = self._interval
        interval.add(self._hyper("lr"), self._weights(step), self._active)
        moving = interval.touched  # the parameters that stepped in the interval
        m, denom = b["exp_avg"], self._denominator()
        self._protect(m, denom, moving, step)
        synchronise(self.flat.params, self.flat.offsets, moving=moving, exp_avg=m, anchor=b.get("anchor"),
                    denom=denom, weight_sums=interval.weight_sums, lr_sums=interval.lr_sums,
                    weight_decays=self._hyper("weight_decay"))
        self._interval = Interval(len(self.flat.params))  # a new interval, its momentum from zero
        if "accum" in b:
            b["accum"].zero_()

    def _protect(self, m: Tensor, denom: Tensor, moving: Sequence[bool], step: int) -> None:
        """Before ``m`` moves the parameters: zero it where no refresh has seen a gradient (the
        1-bit average, or a local gradient, would otherwise be divided by ``eps``), and clip each
        value's step to ``clip_update`` times Adam's largest."""
        b = self.flat.buffers
        if "exp_avg_sq" in b:
            zero_where_equal_(m, b["exp_avg_sq"], 0.0)
        else:
            mask_unused_(m, denom, self.eps, self.flat.offsets, self._unused)
        if self.clip_update is None:
            return
        bc1, _ = self._corrections(step)
        # d holds the variance's bias correction where there is one; else the clip applies it
        k = None if self.bias_correction else self.schedule.variance_age(step)
        for i, ((lo, hi), (beta1, beta2)) in enumerate(zip(self.flat.offsets, self._hyper("betas"))):
            if moving[i]:
                bc2 = 1.0 if k is None else 1.0 - beta2**k
                clip_to_adam_step_(m[lo:hi], denom[lo:hi], beta1, beta2, bc1[i], bc2, self.clip_update)

    def _enter(self, stage: Stage) -> None:
        """At the freeze, the variance (renamed ``frozen_denom``) becomes in place the
        preconditioner ``d``. When the first interval of local steps begins, the anchor takes the
        parameters of this, the last synchronised, step (the accumulated momentum starts at zero)."""
        d = self.flat.buffers["frozen_denom"]
        if stage is _MOMENTUM:
            _, bc2 = self._corrections(self._step_count)
            adam_denominators(d, self.flat.offsets, eps=self.eps, bias_corrections2=bc2, out=d)
            self._unused = count_unused(type(self).__name__, d, self.eps, self.flat.offsets)
            return
        anchor = self.flat.buffers["anchor"]
        for p, (lo, hi) in zip(self.flat.params, self.flat.offsets):
            anchor[lo:hi].copy_(p.detach().reshape(-1))

    # ------------------------------------------------------------------ replicas and checkpoints
    @property
    def synchronised(self) -> bool:
        """False inside an interval of local steps, where the ranks' parameters differ by design."""
        return not any(self._interval.touched)

    def _refreshes(self) -> dict[str, Any]:
        return {"max_refresh_interval": self.schedule.max_refresh_interval,
                "refresh_weight": self.schedule.refresh_weight}

    _extra_required = ("interval",)  # (the refreshes' schedule: absent from older states)

    def _extra_state(self) -> dict[str, Any]:
        return {"interval": self._interval.state_dict(), "refreshes": self._refreshes()}

    def _check_extra_state(self, state: Mapping[str, Any]) -> None:
        Interval.check_state(state["interval"])

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        # The variance saved was refreshed on the saved schedule; this one goes on with its own
        # (another bias-correction exponent from here on), which the user should know of.
        saved = state.get("refreshes")
        if saved is not None and dict(saved) != self._refreshes():
            warnings.warn(f"ZeroOneAdam state saved with refreshes {dict(saved)}, loaded into one with "
                          f"{self._refreshes()}: the variance goes on with this optimizer's", stacklevel=3)
        b = self.flat.buffers
        self._unused = [] if "frozen_denom" not in b else \
            count_unused(type(self).__name__, b["frozen_denom"], self.eps, self.flat.offsets)
        self._interval.load_state_dict(state["interval"])
        if self.synchronised:
            return
        # The parameters inside the interval, from its anchor and accumulated momentum (whichever
        # rank's weights the model was loaded with). Another rank's interval is taken whole: this
        # rank goes on as a copy of that one. (Restarting it from the anchor, where a rank that
        # loaded its own goes on, would give the ranks other sums at the synchronisation: other
        # parameters after it, for good.)
        for p, (lo, hi), lr_sum, wd in zip(self.flat.params, self.flat.offsets, self._interval.lr_sums,
                                           self._hyper("weight_decay")):
            _from_anchor(p, b["anchor"][lo:hi], b["accum"][lo:hi], b["frozen_denom"][lo:hi], lr=lr_sum,
                         weight_decay=wd, step_size=1.0)
