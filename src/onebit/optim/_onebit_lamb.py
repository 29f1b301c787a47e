"""1-bit LAMB (Li et al., 2022): LAMB warm-up, then 1-bit momentum with adaptive layer-wise
coefficients (Algorithm 1, appendix A.5)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import comm
from .._checks import check_adam_args, check_beta, check_optional_positive, check_overlap, check_positive
from ..ops import max_ratio
from ._base import OnebitOptimizer
from ._stages import COMPRESSED_FORMED, EXACT_GRADIENT, Stage, TwoStages, Wire
from ._freeze import freeze_schedule
from ._functional import apply_update_, clip_to_adam_step_, count_unused, ema_, mask_unused_

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["OnebitLamb", "lamb", "lamb_coefficient", "onebit_lamb"]


def lamb_coefficient(param: Tensor, update: Tensor, *, min_coeff: float, max_coeff: float) -> Tensor:
    """``clip(||x|| / ||u||, c_min, c_max)`` of eq. (1), the clip on the whole trust ratio
    (footnote 3); ``1`` when either norm is zero (a zero-initialised bias, say).

    A 0-d float64 tensor on the parameter's device: no host synchronisation per layer.
    """
    x_norm = param.detach().reshape(-1).float().norm().double()  # logical order, whatever the layout
    return _trust_ratio(x_norm, update.norm().double(), min_coeff=min_coeff, max_coeff=max_coeff)


def _trust_ratio(x_norm: Tensor, u_norm: Tensor, *, min_coeff: float, max_coeff: float) -> Tensor:
    ratio = (x_norm / u_norm).clamp(min_coeff, max_coeff)
    return torch.where((x_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)


# sum_per_param / max_per_param: a float64 vector with an entry per parameter, computed on the
# local shards of FSDP2-sharded parameters, reduced in place over the ranks sharing each
Reduce = Callable[[Tensor], Tensor]


def _shard_norms(tensors: Mapping[int, tuple[Tensor, Tensor]], n: int, sum_per_param: Reduce,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """The whole parameters' norms of each pair ``(x, u)`` of local shards, by parameter index."""
    squares = torch.zeros(2, n, dtype=torch.float64, device=device)
    for i, (x, u) in tensors.items():
        squares[0, i] = x.detach().reshape(-1).double().square().sum()
        squares[1, i] = u.double().square().sum()
    return sum_per_param(squares.view(-1)).view(2, n).sqrt()


def lamb(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor],
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    coeff_avg: Tensor,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    eps: float,
    coeff_beta: float,
    max_coeff: float,
    min_coeff: float,
    sum_per_param: Reduce | None = None,
) -> Tensor:
    """LAMB, eq. (1), per tensor on the averaged gradients ``grads`` (scratch once used: each
    update is formed in its gradient's place): ``u = m / (sqrt(v) + eps) + wd x``,
    ``x <- x - lr c u`` with ``c`` :func:`lamb_coefficient`, and the moving average of the
    coefficients ``c_avg <- b3 c_avg + (1 - b3) c`` (line 2). Returns each tensor's ``c``
    (0 where ``active[i]`` is false: not updated); ``coeff_avg`` is a float64 vector on the
    device, updated in place, so a step makes no host round trip. ``sum_per_param``: the
    parameters are FSDP2 shards, and the norms are the whole parameters' (one reduction)."""
    updates: dict[int, Tensor] = {}
    for i, (lo, hi) in enumerate(offsets):
        if not active[i]:
            continue
        b1, b2 = betas[i]
        g, m, v = grads[i].reshape(-1), exp_avg[lo:hi], exp_avg_sq[lo:hi]
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        update = torch.div(m, torch.sqrt(v, out=g).add_(eps), out=g)  # g's buffer is free now
        if weight_decays[i]:
            update.add_(params[i].detach().reshape(-1).float(), alpha=weight_decays[i])
        updates[i] = update
    coeffs = torch.zeros(len(offsets), dtype=torch.float64, device=exp_avg.device)
    if sum_per_param is not None:
        norms = _shard_norms({i: (params[i], u) for i, u in updates.items()}, len(offsets), sum_per_param,
                             exp_avg.device)
    for i, update in updates.items():
        c = lamb_coefficient(params[i], update, min_coeff=min_coeff, max_coeff=max_coeff) if sum_per_param is None \
            else _trust_ratio(norms[0, i], norms[1, i], min_coeff=min_coeff, max_coeff=max_coeff)
        coeff_avg[i] = coeff_beta * coeff_avg[i] + (1.0 - coeff_beta) * c
        apply_update_(params[i], update, None, lr=lrs[i], weight_decay=0.0, step_size=lrs[i] * c)
        coeffs[i] = c
    return coeffs


def onebit_lamb(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    frozen_exp_avg_sq: Tensor,
    last_exp_avg: Tensor,
    coeff_avg: Tensor,
    ratio: Tensor,
    momentum_scale: Tensor,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    eps: float,
    factor_max: float,
    factor_min: float,
    factor_threshold: float,
    clip_update: float | None = 10.0,
    frozen_at: int = 0,
    scaling_ratio: str = "norm",
    max_per_param: Reduce | None = None,
    sum_per_param: Reduce | None = None,
    frozen_norms: Tensor | None = None,
) -> Tensor:
    """Algorithm 1 lines 12-21 on the averaged scaled momentum ``exp_avg`` (``last_exp_avg``
    holds ``m_{t-1}``, and scratch after it): unscale (A.5.2);
    ``g = (m_t - b1 m_{t-1}) / (1 - b1)``; fresh ``v``; the scaling ratio ``r`` (``"norm"``:
    ``||v_frozen||_1 / ||v||_1``; ``"max"``: line 17's ``max(v_frozen / v)``) clipped to
    ``(1 +- r_threshold) r_prev`` then ``[r_min, r_max]``; ``c = r c_avg``;
    ``x <- x - lr c (m / (sqrt(v_frozen) + eps) + wd x)``. Unless ``clip_update`` is None the
    averaged momentum is first clipped to ``clip_update`` times Adam's largest step
    (:func:`clip_to_adam_step_`). Returns each tensor's ``c`` (0 where ``active[i]`` is false:
    not updated); ``ratio`` and the other per-tensor vectors are float64 on the device.
    ``max_per_param`` / ``sum_per_param``: the parameters are FSDP2 shards, and the maximum or
    the norms are the whole parameters' (one reduction). ``frozen_norms``: each tensor's
    ``||v_frozen||_1`` (float64 sums, as this function takes them), kept by the caller: they do not
    change after the freeze."""
    device = exp_avg.device
    by_norm = scaling_ratio == "norm"
    # "max": the largest quotient (-inf: no value with a variance); "norm": the two l1 norms
    largest = torch.full((len(offsets),), float("-inf"), dtype=torch.float64, device=device)
    norms = torch.zeros(2, len(offsets), dtype=torch.float64, device=device)
    for i, (lo, hi) in enumerate(offsets):
        b1, b2 = betas[i]
        m = exp_avg[lo:hi].div_(momentum_scale[i])
        if not active[i]:
            continue
        v, v_frozen = exp_avg_sq[lo:hi], frozen_exp_avg_sq[lo:hi]
        denom = v_frozen.sqrt().add_(eps)
        if clip_update is not None:  # the warm-up's variance has no bias correction: frozen at step frozen_at
            clip_to_adam_step_(m, denom, b1, b2, bias_correction2=1.0 - b2**frozen_at, factor=clip_update)
        # m_{t-1} is needed only to form g: g, then v_frozen / v, then the update take its place.
        work = last_exp_avg[lo:hi]
        g = work.mul_(-b1).add_(m).div_(1.0 - b1)  # (m_t - b1 m_{t-1}) / (1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        if by_norm:
            norms[0, i] = v_frozen.sum(dtype=torch.float64) if frozen_norms is None else frozen_norms[i]
            norms[1, i] = v.sum(dtype=torch.float64)
        elif hi > lo:
            largest[i] = max_ratio(v_frozen, v, largest[i], work=work)
        # The update's direction now, while the square root is at hand: the ratio only scales it.
        torch.div(m, denom, out=work)
    if by_norm:
        if sum_per_param is not None:
            norms = sum_per_param(norms.view(-1)).view(2, -1)
        largest = torch.where(norms[1] > 0, norms[0] / norms[1], largest)
    elif max_per_param is not None:
        max_per_param(largest)
    # Lines 17-20 for every tensor at once (element-wise float64: each tensor's own arithmetic;
    # the previous ratio where no value has a variance); an inactive tensor keeps its ratio.
    r = torch.where(largest == float("-inf"), ratio, largest)
    r = torch.minimum(torch.maximum(r, (1.0 - factor_threshold) * ratio), (1.0 + factor_threshold) * ratio)
    r = r.clamp(factor_min, factor_max)
    coeffs = r * coeff_avg
    for i, (lo, hi) in enumerate(offsets):
        if not active[i]:
            coeffs[i] = 0.0
            continue
        ratio[i] = r[i]
        update = last_exp_avg[lo:hi]  # m / (sqrt(v_frozen) + eps), from the loop above
        if weight_decays[i]:
            update.add_(params[i].detach().reshape(-1).float(), alpha=weight_decays[i])
        apply_update_(params[i], update, None, lr=lrs[i], weight_decay=0.0, step_size=lrs[i] * coeffs[i])
    return coeffs


# "auto"'s latest freeze, in windows of its criterion (400 steps at beta2 = 0.999). Uncapped, the
# criterion never fired in the 12.9M GPT's 1,024 steps at a constant learning rate; after one window
# (1-bit Adam's, which has refreshes to keep an early freeze up) 1-bit LAMB was +5% to +39% behind LAMB
# on two tasks; at 400 the GPT compressed 61% of its steps and ended below LAMB on 3 seeds
# (benchmarks/results: onebit-lamb-uncapped/, time-to-loss/gpt/onebit_lamb-seed*).
_MAX_WINDOWS = 4


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB (Algorithm 1 of Li et al., 2022).

    * Warm-up (steps ``1 .. freeze_step``): gradients averaged by an fp32 all-reduce, exact
      LAMB, eq. (1), per tensor (each weight and bias its own trust ratio, clipped as a
      whole to ``[min_coeff, max_coeff]``), and each tensor's moving average ``c_avg``.
    * At the freeze: the variance is stored per tensor (``v_Tw``), ``c_avg`` stops moving,
      and each tensor gets a momentum scale coefficient ``mean_l(s_l) / s_l`` with
      ``s_l = ||m_l|| / sqrt(n_l)`` (A.5.2), so all layers reach the 1-bit exchange at a
      similar scale.
    * Compression: see :func:`onebit_lamb` -- one :class:`onebit.comm.CompressedAllReduce`
      of the fused momentum (a view over all layers, A.5.1), fresh variance from the
      reconstructed gradient, clipped scaling ratios. Values whose frozen variance is zero
      (never a gradient in the warm-up) keep a zero momentum, as in :class:`onebit.OnebitAdam`;
      each value's step is clipped to ``clip_update`` (default 10) times Adam's own largest
      step (:func:`onebit.optim.clip_to_adam_step_`, not in the paper; ``None``: no clip).

    **The scaling ratio.** Line 17 takes the largest element of ``v_frozen / v`` over the layer
    (``scaling_ratio="max"``). One value decides it: an embedding row looked up in the warm-up
    and rarely since, whose fresh variance decays, drives the whole table's ratio to ``r_max``
    and its steps to 4x -- +43% held-out loss over LAMB on a sparse embedding task, loss 13 on
    one seed. The default ``"norm"`` takes the ratio of the layer's l1 norms,
    ``||v_frozen||_1 / ||v||_1`` (the quantity of the paper's own freeze criterion): how much
    the layer's variance as a whole has moved since the freeze.

    Where this differs from DeepSpeed 0.19.6's ``OnebitLamb`` -- the ratio, the order of its clips
    (lines 18-19), values without a fresh variance, no weight-decay blend -- and why: the table of
    the documentation's "Coming from DeepSpeed".

    Args:
        params: parameters or param groups (options ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate (read every step, so LR schedulers work).
        betas: ``(beta1, beta2)`` of the moments.
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: weight decay, added to the update inside the trust ratio (as LAMB).
        freeze_step: last warm-up step (an int), or ``"auto"``: 1-bit Adam's variance
            criterion on the bias-corrected variance (:class:`onebit.optim.FreezeSchedule`; the
            paper shows LAMB's variance stabilising the same way, section 3), by
            ``max_freeze_step`` at the latest.
        max_coeff: ``c_max``, the upper clip of each tensor's trust ratio.
        min_coeff: ``c_min``, its lower clip.
        coeff_beta: ``beta_3``, the rate of the trust ratio's moving average ``c_avg``.
        factor_max: ``r_max``, the upper clip of the scaling ratio.
        factor_min: ``r_min``, its lower clip.
        factor_threshold: ``r_threshold``: each step the ratio moves at most this fraction
            from the previous one.
        scaling_ratio: ``"norm"``: ``||v_frozen||_1 / ||v||_1`` per layer; ``"max"``: the
            paper's ``max(v_frozen / v)`` (line 17; see above).
        group: process group (``None``: default), an :class:`onebit.comm.MPIGroup`, or a
            backend name (``"mpi"``).
        freeze_threshold: the auto criterion's band ``[threshold, 1 / threshold]`` on the
            bias-corrected variance (0.96; 1-bit Adam's 0.85 left its compressed stage further
            behind LAMB with a large, sparsely used embedding).
        freeze_window: the auto criterion's window ``D`` (``None``: ``round(0.1 / (1 - beta2))``).
        min_freeze_step: as :class:`onebit.OnebitAdam`'s.
        max_freeze_step: "auto" freezes at this step at the latest (``None``: after four of its
            windows, step 400 with the defaults, or at ``min_freeze_step`` if later: at a constant
            learning rate the criterion may not fire within a run of 1,000 steps).
        compressor: compressor of the momentum exchange (``"sign"``; ``"identity"`` isolates
            what the bits cost).
        scales: ``"tensor"``: a compressor with scales (``"sign"``) gives each parameter's
            piece of a rank's chunk its own, as DeepSpeed's per-tensor exchange (4 bytes more per
            piece); ``"chunk"``: one per rank's chunk of the fused buffer, which gives a layer of
            small values the magnitude of its larger neighbours.
        clip_update: clip each value's compressed step to this many times Adam's largest step
            (``None``: no clip).
        hierarchical: Birder's Hierarchical-1-bit-All-Reduce for the momentum exchange.
        ranks_per_node: ranks on each node, for the hierarchical exchange (``None``: detected).
        overlap: ``None`` (the default): the warm-up's all-reduce leaves during backward and the
            compression stage exchanges in ``step()``, as :class:`onebit.OnebitAdam`'s;
            ``True``: both stages during backward (below); ``False``: both in ``step()``.
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 state (as DDP's).
        **options: :class:`onebit.optim.CommonOptions`.

    With ``overlap=True`` a bucket's launch sends ``e + s_l (beta1 m + (1 - beta1) g)`` (its
    scaled momentum) in the compression stage; ``step()`` keeps ``m_{t-1}``, takes the
    averages and goes on as above. The requirements and the two behaviours that differ are
    :class:`onebit.OnebitAdam`'s.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.OnebitLamb(model.parameters(), lr=1e-3, freeze_step=100)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> len(opt.last_coefficients)
        2
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str = "auto",
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        scaling_ratio: str = "norm",
        group: comm.Group = None,
        *,
        freeze_threshold: float = 0.96,
        freeze_window: int | None = None,
        min_freeze_step: int = 0,
        max_freeze_step: int | None = None,
        compressor: str = "sign",
        scales: str = "tensor",
        clip_update: float | None = 10.0,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        overlap: bool | str | None = None,
        bucket_cap_mb: float = 25.0,
        **options: Unpack[CommonOptions],
    ) -> None:
        beta2 = check_adam_args(lr, betas, eps, weight_decay)[1]
        check_overlap(overlap)
        clips = {name: check_positive(name, value) for name, value in (
            ("max_coeff", max_coeff), ("min_coeff", min_coeff), ("factor_max", factor_max), ("factor_min", factor_min))}
        if min_coeff > max_coeff:
            raise ValueError(f"Invalid min_coeff value: {min_coeff} (greater than max_coeff={max_coeff})")
        if factor_min > factor_max:
            raise ValueError(f"Invalid factor_min value: {factor_min} (greater than factor_max={factor_max})")
        if scaling_ratio not in ("norm", "max"):
            raise ValueError(f"Invalid scaling_ratio value: {scaling_ratio!r} (expected 'norm' or 'max')")
        self.options = {**clips, "coeff_beta": check_beta(coeff_beta, "coeff_beta"),
                        "factor_threshold": check_beta(factor_threshold, "factor_threshold"),
                        "clip_update": check_optional_positive("clip_update", clip_update),
                        "scaling_ratio": scaling_ratio}
        buffers = ("exp_avg", "exp_avg_sq", "frozen_exp_avg_sq", "last_exp_avg")
        self._stages = TwoStages(type(self).__name__, Stage(EXACT_GRADIENT, buffers, averages=True),
                                 Stage(COMPRESSED_FORMED, buffers),
                                 freeze_schedule(freeze_step, beta2, threshold=freeze_threshold, window=freeze_window,
                                                 min_step=min_freeze_step, max_step=max_freeze_step, corrected=True,
                                                 max_windows=_MAX_WINDOWS),
                                 watch="exp_avg_sq")
        self.eps = float(eps)
        self._unused: list[int] = []  # the parameters with values unused through the warm-up
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}, group=group,
                         **options)
        n, device = len(self.flat.params), self.flat.device
        self.coeff_avg = torch.zeros(n, dtype=torch.float64, device=device)
        self.ratio = torch.ones(n, dtype=torch.float64, device=device)
        self.momentum_scale = torch.ones(n, dtype=torch.float64, device=device)
        self._coefficients: Tensor | None = None
        self._frozen_sums: Tensor | None = None  # each tensor's ||v_Tw||_1 once frozen (_note_frozen)
        self._drive(self._allreduce(compressor, hierarchical=hierarchical, ranks_per_node=ranks_per_node,
                                    overlap=overlap is True, scales=scales), overlap=overlap,
                    bucket_cap_mb=bucket_cap_mb)

    @property
    def allreduce(self) -> Any:
        """The compressed all-reduce (with ``overlap=True``, the first bucket's)."""
        return self._collectives[0]

    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """``s_l (beta1 m + (1 - beta1) g)`` (line 6 and A.5.2); ``s_l m`` for a frozen parameter."""
        m = self.flat.buffers["exp_avg"][lo:hi]
        if live:
            ema_(m, grad, group["betas"][0], out=out)
        else:
            out.copy_(m)
        out.mul_(self.momentum_scale[i])

    def _landing(self, wire: Wire) -> Tensor:
        if not wire.formed:
            return self._grad
        b = self.flat.buffers
        b["last_exp_avg"].copy_(b["exp_avg"])  # m_{t-1}, before the average replaces m
        return b["exp_avg"]

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        b, o, shards = self.flat.buffers, self.options, self._shards
        # FSDP2 shards: each layer's norms and maxima are the whole parameter's, reduced over its shards
        common = {"lrs": self._hyper("lr"), "betas": self._hyper("betas"), "weight_decays": self._hyper("weight_decay"),
                  "eps": self.eps, "sum_per_param": shards.sum_per_param if shards.sharded else None}
        if not wire.formed:
            self._coefficients = lamb(self.flat.params, self.flat.offsets, grads=self.flat.split(average),
                                      active=self._active, exp_avg=b["exp_avg"], exp_avg_sq=b["exp_avg_sq"],
                                      coeff_avg=self.coeff_avg, coeff_beta=o["coeff_beta"],
                                      max_coeff=o["max_coeff"], min_coeff=o["min_coeff"], **common)
            return
        mask_unused_(b["exp_avg"], b["frozen_exp_avg_sq"], 0.0, self.flat.offsets, self._unused)
        self._coefficients = onebit_lamb(
            self.flat.params, self.flat.offsets, active=self._active, exp_avg=b["exp_avg"],
            exp_avg_sq=b["exp_avg_sq"], frozen_exp_avg_sq=b["frozen_exp_avg_sq"], last_exp_avg=b["last_exp_avg"],
            coeff_avg=self.coeff_avg, ratio=self.ratio, momentum_scale=self.momentum_scale,
            factor_max=o["factor_max"], factor_min=o["factor_min"], factor_threshold=o["factor_threshold"],
            clip_update=o["clip_update"], frozen_at=self._stages.frozen_at, scaling_ratio=o["scaling_ratio"],
            max_per_param=shards.max_per_param if shards.sharded else None,
            frozen_norms=self._frozen_sums if o["scaling_ratio"] == "norm" else None, **common)

    def _enter(self, stage: Stage) -> None:
        """Line 3 and A.5.2: store v_Tw (c_avg stops moving), derive the momentum scale coefficients.
        The compression stage reads each rank's own gradients where they lie."""
        b = self.flat.buffers
        b["frozen_exp_avg_sq"].copy_(b["exp_avg_sq"])
        self._note_frozen()
        if self._shards.sharded:  # the whole parameters' norms, from their shards'
            squares = torch.stack([b["exp_avg"][lo:hi].double().square().sum() for lo, hi in self.flat.offsets])
            norms = self._shards.sum_per_param(squares).sqrt().tolist()
        else:
            norms = [float(b["exp_avg"][lo:hi].norm()) for lo, hi in self.flat.offsets]
        scales = [norm / math.sqrt(n) if n else 0.0 for norm, n in zip(norms, self._shards.numels)]
        positive = [s for s in scales if s > 0]
        united = sum(positive) / len(positive) if positive else 1.0
        self.momentum_scale = torch.tensor([united / s if s > 0 else 1.0 for s in scales], dtype=torch.float64,
                                           device=self.flat.device)

    @property
    def last_coefficients(self) -> list[float]:
        """Each tensor's layer-wise coefficient ``c_t`` of the last step (reading it synchronises a GPU)."""
        return [] if self._coefficients is None else self._coefficients.tolist()

    def _note_frozen(self) -> None:
        """What the compression stage reads of ``v_Tw``, which stays as it is: the values without a
        gradient in the warm-up, and each tensor's ``||v_Tw||_1`` (float64 sums)."""
        v, offsets = self.flat.buffers["frozen_exp_avg_sq"], self.flat.offsets
        self._unused = count_unused(type(self).__name__, v, 0.0, offsets)
        self._frozen_sums = torch.stack([v[lo:hi].sum(dtype=torch.float64) for lo, hi in offsets])

    _extra_required = ("coeff_avg", "ratio", "momentum_scale")

    def _extra_state(self) -> dict[str, Any]:
        return {"coeff_avg": self.coeff_avg.clone(), "ratio": self.ratio.clone(),
                "momentum_scale": self.momentum_scale.clone()}

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        if self._stages.frozen_at is not None:
            self._note_frozen()
        else:
            self._frozen_sums = None
        as_vector = {"dtype": torch.float64, "device": self.flat.device, "copy": True}
        self.coeff_avg = state["coeff_avg"].to(**as_vector)
        self.ratio = state["ratio"].to(**as_vector)
        self.momentum_scale = state["momentum_scale"].to(**as_vector)
