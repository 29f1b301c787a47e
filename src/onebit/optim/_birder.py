"""Birder (Peng et al., Algorithm 1, eqs. (4)-(5)) and its uncompressed form SoftSignSGD (appendix B).

The math: :func:`soft_sign_moments` (lines 5-7), :func:`soft_sign_direction` (``m / (b + eps)``,
what a rank sends, each element in ``[-1, 1]``; the DDP hook's too) and :func:`soft_sign_sgd`;
Birder's update on the average ``u_bar`` of the quantised directions (line 16) is
:class:`~onebit.optim._functional.UpdateByChunks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import comm, ops
from .._checks import check_beta, check_bool, check_nonneg, check_positive, check_seed
from ..compress import StochasticSignCompressor
from ._base import OnebitOptimizer
from ._stages import COMPRESSED_FORMED, EXACT_GRADIENT, OneStage, Stage, Wire
from ._functional import UpdateByChunks, ema_

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["Birder", "SoftSignSGD", "soft_sign_direction", "soft_sign_moments", "soft_sign_sgd"]


def soft_sign_moments(
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor | None],
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_abs: Tensor,
    max_exp_avg_abs: Tensor | None,
    use_max: bool,
    betas: Sequence[float],
) -> Tensor:
    """``m = b m + (1-b) g``, ``b^ = b b^ + (1-b)|g|`` (lines 5-6) and ``b = max(b_prev, b^)``
    when ``use_max`` else ``b^`` (line 7), in place; returns ``b``. ``grads[i]`` is parameter
    ``i``'s gradient, shaped like it (``None``: zero)."""
    for (lo, hi), g, beta, on in zip(offsets, grads, betas, active):
        if not on:  # no gradient on any rank: moments untouched
            continue
        ema_(exp_avg[lo:hi], g, beta)
        ema_(exp_avg_abs[lo:hi], None if g is None else g.abs(), beta)
    if max_exp_avg_abs is None:
        return exp_avg_abs
    if use_max:
        return torch.maximum(max_exp_avg_abs, exp_avg_abs, out=max_exp_avg_abs)
    return max_exp_avg_abs.copy_(exp_avg_abs)


def soft_sign_direction(
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor | None],
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_abs: Tensor,
    max_exp_avg_abs: Tensor | None,
    use_max: bool,
    betas: Sequence[float],
    eps: float,
    out: Tensor,
) -> Tensor:
    """The moments (:func:`soft_sign_moments`), then ``out = m / (b + eps)``, each element in
    ``[-1, 1]``. ``out`` may be the buffer the gradients lie in."""
    denom = soft_sign_moments(offsets, grads=grads, active=active, exp_avg=exp_avg, exp_avg_abs=exp_avg_abs,
                              max_exp_avg_abs=max_exp_avg_abs, use_max=use_max, betas=betas)
    torch.add(denom, eps, out=out)
    return torch.div(exp_avg, out, out=out)


def soft_sign_sgd(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor],
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_abs: Tensor,
    update: Tensor,
    lrs: Sequence[float],
    betas: Sequence[float],
    weight_decays: Sequence[float],
    eps: float,
) -> None:
    """One SoftSignSGD step (appendix B, Algorithm 1) on the averaged gradients ``grads``:
    ``m = b m + (1-b) g``, ``b = b b + (1-b)|g|``, ``x <- x (1 - lr wd) - lr m / (b + eps)``
    (``update``: where ``m / (b + eps)`` is formed; it may hold ``grads``)."""
    soft_sign_direction(
        offsets,
        grads=grads,
        active=active,
        exp_avg=exp_avg,
        exp_avg_abs=exp_avg_abs,
        max_exp_avg_abs=None,
        use_max=False,
        betas=betas,
        eps=eps,
        out=update,
    )
    UpdateByChunks(params, offsets, lrs=lrs, weight_decays=weight_decays, active=active)(0, update.numel(), update)


_MOMENTS = ("exp_avg", "exp_avg_abs")  # m and b


class _SoftSign(OnebitOptimizer):
    """Argument checks shared by Birder and SoftSignSGD."""

    def _init_soft_sign(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *, lr: float, beta: float,
                        eps: float, weight_decay: float, group: comm.Group, options: CommonOptions) -> None:
        check_nonneg("learning rate", lr)
        check_beta(beta)
        check_positive("epsilon", eps)  # b is exactly 0 wherever no gradient was seen yet
        check_nonneg("weight_decay", weight_decay)
        self.eps = float(eps)
        super().__init__(params, {"lr": lr, "beta": float(beta), "weight_decay": weight_decay}, group=group,
                         **options)
        for g in self.param_groups:
            check_beta(g["beta"])

    def _update(self) -> UpdateByChunks:
        """``x <- x (1 - lr wd) - lr u`` for ``u`` handed over chunk by chunk (line 16)."""
        return UpdateByChunks(self.flat.params, self.flat.offsets, lrs=self._hyper("lr"),
                              weight_decays=self._hyper("weight_decay"), active=self._active)


class Birder(_SoftSign):
    """Birder: element-wise 1-bit stochastic adaptive updates, no warm-up (Algorithm 1).

    Each rank keeps ``m`` and ``b`` (EMAs of ``g`` and ``|g|`` with the same ``beta``, so
    ``|m / b| <= 1`` and no bias correction is needed), sends ``u = Q(m / (b + eps) + e)``
    with its worker error ``e`` (``Q``: eq. (5), +1 with probability ``(x + 1) / 2``), the
    owner of each chunk averages the ``+-1`` updates, adds its server error and re-quantises
    with ``Q``, and every rank applies the same all-gathered ``u_bar``:
    ``x <- x (1 - lr * weight_decay) - lr * u_bar``. Weight decay is decoupled (AdamW-style),
    as in the paper's experiments (e.g. 0.05 with lr 0.005 for ResNet-20, appendix B.1).

    Randomness: rank ``r`` of ``group`` draws from the SplitMix64 stream of
    ``seed + r * 2**32`` (:func:`onebit.ops.splitmix_uniform`: independent workers,
    reproducible for a fixed ``seed`` and world size, and on CPU drawn inside the quantiser's
    one pass, ~10x cheaper than ``torch.rand``); each step it draws for its chunks of ``u`` in
    chunk order, then for the chunk it owns as server. The count drawn is in :meth:`state_dict`.

    Args:
        params: parameters or param groups (options ``lr``, ``beta``, ``weight_decay``).
        lr: learning rate (read every step, so LR schedulers work).
        beta: the EMA rate of both ``m`` and ``b`` (the paper's 0.95).
        eps: added to ``b`` in ``m / (b + eps)``.
        weight_decay: decoupled weight decay.
        seed: seed of the quantiser's random draws (rank ``r`` uses ``seed + r * 2**32``).
        group: process group (``None``: default), an :class:`onebit.comm.MPIGroup`, or a
            backend name (``"mpi"``).
        hierarchical: ``True`` uses :class:`onebit.comm.HierarchicalAllReduce` (section 4),
            ``"auto"`` whenever the group spans several nodes of several ranks.
        ranks_per_node: ranks on each node, for the hierarchical exchange (``None``: torchrun's
            ``LOCAL_WORLD_SIZE``).
        threshold_step: ``T_0`` of line 7: after it, ``b`` is the running maximum of the
            EMA (AMSGrad-style, the analysis' variant). ``None`` (default) never, as in the
            paper's experiments.
        compressor: the quantiser of the exchange; ``"identity"`` sends fp32 and gives the
            average of the workers' ``m / (b + eps)`` (SoftSignSGD at world size 1).
        overlap: start each bucket's exchange during backward, as
            :class:`onebit.OnebitAdam` does: a bucket's launch sends ``e + m' / (b' + eps)``
            with the moments ``m'``, ``b'`` formed in scratch; ``step()`` applies each
            bucket's ``u_bar`` as it arrives, then moves ``m`` and ``b`` (so a skipped step
            leaves them; only the error-feedback buffers restart at zero). Each bucket is
            quantised on its own, drawing from the same generator in bucket order. The
            requirements are :class:`onebit.OnebitAdam`'s (flat exchange, no
            ``max_grad_norm``, no GradScaler, :meth:`no_sync` for accumulation).
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 state (as DDP's).
        **options: :class:`onebit.optim.CommonOptions`.

    A ``+-1`` code cannot say "no update", so a parameter's code is exchanged every step;
    missing gradients follow :class:`onebit.optim.OnebitOptimizer`'s rule (a parameter
    without a gradient on any rank ignores its code: it is not updated).

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.Birder(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.stats["stage"]
        'compressed'
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
        group: comm.Group = None,
        *,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        threshold_step: int | None = None,
        compressor: str = "stochastic_sign",
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
        **options: Unpack[CommonOptions],
    ) -> None:
        check_seed(seed)
        check_bool("overlap", overlap)
        if threshold_step is not None and (
            isinstance(threshold_step, bool) or not isinstance(threshold_step, int) or threshold_step < 0
        ):
            raise ValueError(f"Invalid threshold_step value: {threshold_step!r} (expected None or an int >= 0)")
        if compressor not in ("stochastic_sign", "identity"):
            raise ValueError(f"Invalid compressor value: {compressor!r} (expected 'stochastic_sign' or 'identity')")
        self.seed = seed
        self.threshold_step = threshold_step
        self._overlap = overlap
        self._stages = OneStage(Stage(COMPRESSED_FORMED, _MOMENTS + (("max_exp_avg_abs",) if threshold_step is not None
                                                                     else ())))
        self._init_soft_sign(params, lr=lr, beta=beta, eps=eps, weight_decay=weight_decay, group=group,
                             options=options)
        # the buckets' collectives share the quantiser and its generator
        quantiser = (
            StochasticSignCompressor(seed + self.rank * 2**32) if compressor == "stochastic_sign" else "identity"
        )
        self._drive(self._allreduce(quantiser, hierarchical=hierarchical, ranks_per_node=ranks_per_node,
                                    overlap=overlap), overlap=overlap, bucket_cap_mb=bucket_cap_mb)
        # The flat exchange takes u added straight into its worker error and hands its average
        # back chunk by chunk: no model-sized buffer for either. The hierarchical one reduces
        # the fp32 u within the node first, so u needs a buffer of its own there.
        self._send = None if self.allreduce.reduces_added_input else self.flat.zeros()

    @property
    def allreduce(self) -> Any:
        """The compressed all-reduce (with ``overlap=True``, the first bucket's)."""
        return self._collectives[0]

    def _use_max(self, step: int) -> bool:
        """Line 7's running maximum is on at ``step``."""
        return self.threshold_step is not None and step > self.threshold_step

    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """``m / (b + eps)`` after lines 5-7. In the agreed step the moments move here, in place
        (``_apply`` then leaves them); in a bucket formed during backward, ``m'``, ``b'`` are
        formed in scratch and ``_apply`` moves the moments once the step is agreed."""
        b = self.flat.buffers
        m, b_abs = b["exp_avg"][lo:hi], b["exp_avg_abs"][lo:hi]
        if live and agreed and grad is not None and "max_exp_avg_abs" not in b:  # the common step, one pass
            ops.soft_sign_(m, b_abs, grad, out, beta=group["beta"], eps=self.eps)
            return
        if live:
            m = ema_(m, grad, group["beta"], out=None if agreed else scratch[0])
            b_abs = ema_(b_abs, None if grad is None else grad.abs(), group["beta"], out=None if agreed else scratch[1])
        if "max_exp_avg_abs" in b:
            b_max = b["max_exp_avg_abs"][lo:hi]
            if agreed:
                b_abs = torch.maximum(b_max, b_abs, out=b_max) if self._use_max(step) else b_max.copy_(b_abs)
            elif self._use_max(step):
                b_abs = torch.maximum(b_max, b_abs, out=scratch[1])
        torch.div(m, b_abs + self.eps, out=out)

    def _landing(self, wire: Wire) -> Tensor | UpdateByChunks:
        # u_bar applied chunk by chunk as it arrives; in u's own buffer where the exchange needs one
        return self._update() if self._send is None else self._send

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        """Line 16 where ``u_bar`` landed in a buffer; then lines 5-7, the moments move, unless
        ``_form`` moved them in the agreed step."""
        if average is not None:
            self._update()(0, average.numel(), average)
        if not self._overlap:  # the one-shot exchange is formed once every rank agreed: the moments moved
            return
        b = self.flat.buffers
        soft_sign_moments(self.flat.offsets, grads=self._local_grads(), active=self._active,
                          exp_avg=b["exp_avg"], exp_avg_abs=b["exp_avg_abs"],
                          max_exp_avg_abs=b.get("max_exp_avg_abs"), use_max=self._use_max(self._step_count),
                          betas=self._hyper("beta"))


class SoftSignSGD(_SoftSign):
    """SoftSignSGD (Birder appendix B): Birder without compression, the control.

    Gradients are averaged exactly (fp32 all-reduce), then ``m``, ``b`` as Birder and
    ``x <- x (1 - lr * weight_decay) - lr * m / (b + eps)``. Its stats report stage
    ``"warmup"`` on every step: every exchange is uncompressed.

    Args:
        params: parameters or param groups (options ``lr``, ``beta``, ``weight_decay``).
        lr: learning rate (read every step).
        beta: the EMA rate of both ``m`` and ``b``.
        eps: added to ``b`` in ``m / (b + eps)``.
        weight_decay: decoupled weight decay.
        group: process group (``None``: default), an :class:`onebit.comm.MPIGroup`, or a
            backend name (``"mpi"``).
        **options: :class:`onebit.optim.CommonOptions`.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.SoftSignSGD(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.stats["stage"]
        'warmup'
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        group: comm.Group = None,
        **options: Unpack[CommonOptions],
    ) -> None:
        # the averaged gradient, then m / (b + eps) in its place
        self._stages = OneStage(Stage(EXACT_GRADIENT, _MOMENTS, averages=True))
        self._init_soft_sign(params, lr=lr, beta=beta, eps=eps, weight_decay=weight_decay, group=group,
                             options=options)
        self._drive(None)

    def _landing(self, wire: Wire) -> Tensor:
        return self._grad

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        b = self.flat.buffers
        soft_sign_sgd(self.flat.params, self.flat.offsets, grads=self.flat.split(average), active=self._active,
                      exp_avg=b["exp_avg"], exp_avg_abs=b["exp_avg_abs"], update=average, lrs=self._hyper("lr"),
                      betas=self._hyper("beta"), weight_decays=self._hyper("weight_decay"), eps=self.eps)
