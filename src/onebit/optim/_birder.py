"""Birder (Peng et al., Algorithm 1, eqs. (4)-(5)) and its uncompressed form SoftSignSGD (appendix B)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .. import comm
from ..compress import StochasticSignCompressor
from ._base import OnebitOptimizer, check_bool, check_nonneg, check_positive
from ._functional import _BLOCK, UpdateByChunks, _ema_
from ._overlap import OverlappedExchange

__all__ = ["Birder", "SoftSignSGD", "birder", "check_beta", "check_seed", "soft_sign_direction", "soft_sign_moments",
           "soft_sign_sgd"]

# exchange(send, consume): average ``send`` over the group, handing consume(lo, hi, values) its chunks
Exchange = Callable[[Tensor, Callable[[int, int, Tensor], None]], None]


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"Invalid seed value: {seed!r} (expected an int)")
    if not 0 <= seed < 2**32:
        raise ValueError(f"Invalid seed value: {seed} (must be in [0, 2**32))")
    return seed


def check_beta(beta: object) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"Invalid beta value: {beta!r} (expected a float)")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"Invalid beta value: {beta}")
    return float(beta)


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
        _ema_(exp_avg[lo:hi], g, beta)
        _ema_(exp_avg_abs[lo:hi], None if g is None else g.abs(), beta)
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
    accumulate: bool = False,
) -> Tensor:
    """The moments (:func:`soft_sign_moments`), then ``out = m / (b + eps)``, each element in
    ``[-1, 1]`` -- added to ``out`` with ``accumulate`` (a worker error, through block-sized
    scratch). ``out`` may be the buffer the gradients lie in."""
    denom = soft_sign_moments(offsets, grads=grads, active=active, exp_avg=exp_avg, exp_avg_abs=exp_avg_abs,
                              max_exp_avg_abs=max_exp_avg_abs, use_max=use_max, betas=betas)
    if not accumulate:
        torch.add(denom, eps, out=out)
        return torch.div(exp_avg, out, out=out)
    for lo in range(0, out.numel(), _BLOCK):
        hi = min(lo + _BLOCK, out.numel())
        out[lo:hi].add_(exp_avg[lo:hi] / (denom[lo:hi] + eps))
    return out


def birder(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grads: Sequence[Tensor | None],
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_abs: Tensor,
    max_exp_avg_abs: Tensor | None,
    send: Tensor,
    accumulate: bool,
    exchange: Exchange,
    step: int,
    lrs: Sequence[float],
    betas: Sequence[float],
    weight_decays: Sequence[float],
    eps: float,
    threshold_step: int | None,
) -> None:
    """One Birder step (Algorithm 1): local ``m``, ``b`` from the local ``grads``, ``u = m / (b + eps)``
    written to ``send`` (added to it with ``accumulate``: ``send`` is then the collective's worker
    error), ``exchange(send, consume)`` hands ``consume`` the error-compensated 1-bit average
    ``u_bar`` chunk by chunk (lines 8-14), which applies ``x <- x (1 - lr wd) - lr u_bar``
    (line 16 with decoupled weight decay)."""
    soft_sign_direction(
        offsets,
        grads=grads,
        active=active,
        exp_avg=exp_avg,
        exp_avg_abs=exp_avg_abs,
        max_exp_avg_abs=max_exp_avg_abs,
        use_max=threshold_step is not None and step > threshold_step,
        betas=betas,
        eps=eps,
        out=send,
        accumulate=accumulate,
    )
    exchange(send, UpdateByChunks(params, offsets, lrs=lrs, weight_decays=weight_decays, active=active))


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


class _SoftSign(OnebitOptimizer):
    """Argument checks and buffers shared by Birder and SoftSignSGD."""

    def __init__(self, params, lr, beta, eps, weight_decay, group, timeout, broadcast_parameters, on_nonfinite,
                 check_replicas_every, max_grad_norm) -> None:
        check_nonneg("learning rate", lr)
        check_beta(beta)
        check_positive("epsilon", eps)  # b is exactly 0 wherever no gradient was seen yet
        check_nonneg("weight_decay", weight_decay)
        self.eps = float(eps)
        super().__init__(
            params,
            {"lr": lr, "beta": float(beta), "weight_decay": weight_decay},
            group=group,
            timeout=timeout,
            broadcast_parameters=broadcast_parameters,
            on_nonfinite=on_nonfinite,
            check_replicas_every=check_replicas_every,
            max_grad_norm=max_grad_norm,
        )
        for g in self.param_groups:
            check_beta(g["beta"])


class Birder(OverlappedExchange, _SoftSign):
    """Birder: element-wise 1-bit stochastic adaptive updates, no warm-up (Algorithm 1).

    Each rank keeps ``m`` and ``b`` (EMAs of ``g`` and ``|g|`` with the same ``beta``, so
    ``|m / b| <= 1`` and no bias correction is needed), sends ``u = Q(m / (b + eps) + e)``
    with its worker error ``e`` (``Q``: eq. (5), +1 with probability ``(x + 1) / 2``), the
    owner of each chunk averages the ``+-1`` updates, adds its server error and re-quantises
    with ``Q``, and every rank applies the same all-gathered ``u_bar``:
    ``x <- x (1 - lr * weight_decay) - lr * u_bar``. Weight decay is decoupled (AdamW-style),
    as in the paper's experiments (e.g. 0.05 with lr 0.005 for ResNet-20, appendix B.1).

    Randomness: rank ``r`` of ``group`` draws from its own ``torch.Generator`` seeded with
    ``seed + r * 2**32`` (independent workers, reproducible for a fixed ``seed`` and world
    size); each step it draws ``torch.rand`` for its chunks of ``u`` in chunk order, then for
    the chunk it owns as server. The generator state is in :meth:`state_dict`.

    Args:
        hierarchical: ``True`` uses :class:`onebit.comm.HierarchicalAllReduce` (section 4;
            ``ranks_per_node`` or torchrun's ``LOCAL_WORLD_SIZE``), ``"auto"`` whenever the
            group spans several nodes of several ranks.
        threshold_step: ``T_0`` of line 7: after it, ``b`` is the running maximum of the
            EMA (AMSGrad-style, the analysis' variant). ``None`` (default) never, as in the
            paper's experiments.
        compressor: the quantiser of the exchange; ``"identity"`` sends fp32 and gives the
            average of the workers' ``m / (b + eps)`` (SoftSignSGD at world size 1).
        overlap, bucket_cap_mb: start each bucket's exchange during backward, as
            :class:`onebit.OnebitAdam` does: a bucket's launch sends ``e + m' / (b' + eps)``
            with the moments ``m'``, ``b'`` formed in scratch; ``step()`` applies each
            bucket's ``u_bar`` as it arrives, then moves ``m`` and ``b`` (so a skipped step
            leaves them; only the error-feedback buffers restart at zero). Each bucket is
            quantised on its own, drawing from the same generator in bucket order. The
            requirements are :class:`onebit.OnebitAdam`'s (flat exchange, no
            ``max_grad_norm``, no GradScaler, :meth:`no_sync` for accumulation).

    A ``+-1`` code cannot say "no update", so a parameter's code is exchanged every step;
    missing gradients follow :class:`onebit.optim.OnebitOptimizer`'s rule (a parameter
    without a gradient on any rank ignores its code: it is not updated).
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
        timeout: float | timedelta | None = None,
        broadcast_parameters: bool = True,
        on_nonfinite: str = "skip",
        check_replicas_every: int = 0,
        max_grad_norm: float | None = None,
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
        self._flat_names = ("exp_avg", "exp_avg_abs") + (("max_exp_avg_abs",) if threshold_step is not None else ())
        super().__init__(params, lr, beta, eps, weight_decay, group, timeout, broadcast_parameters, on_nonfinite,
                         check_replicas_every, max_grad_norm)
        quantiser = (
            StochasticSignCompressor(seed + self.rank * 2**32) if compressor == "stochastic_sign" else "identity"
        )
        def collective() -> Any:  # the buckets' collectives share the quantiser and its generator
            return comm.compressed_allreduce(quantiser, self.process_group, hierarchical=hierarchical,
                                             ranks_per_node=ranks_per_node, timeout=self.timeout)

        self.allreduce = collective()
        self.allreduce.warm_up(self.flat.device)  # kernels loaded now, not at the first compressed step
        if overlap:
            self._use_buckets(bucket_cap_mb, collective, hierarchical=hierarchical)
        # The flat exchange takes u added straight into its worker error and hands its average
        # back chunk by chunk: no model-sized buffer for either. The hierarchical one reduces
        # the fp32 u within the node first, so u needs a buffer of its own there.
        self._update = None if self.allreduce.reduces_added_input else \
            torch.zeros(self.flat.numel, dtype=torch.float32, device=self.flat.device)

    def _use_max(self, step: int) -> bool:
        """Line 7's running maximum is on at ``step``."""
        return self.threshold_step is not None and step > self.threshold_step

    def _bucket_input(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, options: dict[str, Any],
                      scratch: Tensor) -> Tensor:
        """``m' / (b' + eps)`` (lines 5-7) with ``m'``, ``b'`` in scratch, the moments untouched (a
        frozen parameter's as they are): the one-shot step's operations."""
        b = self.flat.buffers
        m, b_abs = b["exp_avg"][lo:hi], b["exp_avg_abs"][lo:hi]
        if live:
            m = _ema_(m, grad, options["beta"], out=scratch[0])
            b_abs = _ema_(b_abs, None if grad is None else grad.abs(), options["beta"], out=scratch[1])
        if "max_exp_avg_abs" in b and self._use_max(self._step_count + 1):
            b_abs = torch.maximum(b["max_exp_avg_abs"][lo:hi], b_abs, out=scratch[1])
        return torch.div(m, b_abs + self.eps, out=scratch[0])

    def _exchange_update(self, u: Tensor, consume: Callable[[int, int, Tensor], None]) -> None:
        if self._update is None:
            self.allreduce.reduce_added(consume)
        else:
            consume(0, u.numel(), self.allreduce(u, out=u))

    def _step(self) -> None:
        b = self.flat.buffers
        if self._buckets is not None:  # the exchanges started during backward: apply u_bar, then move m, b
            self._finish_buckets(consume=UpdateByChunks(self.flat.params, self.flat.offsets, lrs=self._hyper("lr"),
                                                        weight_decays=self._hyper("weight_decay"),
                                                        active=self._active))
            soft_sign_moments(self.flat.offsets, grads=self._local_grads(), active=self._active,
                              exp_avg=b["exp_avg"], exp_avg_abs=b["exp_avg_abs"],
                              max_exp_avg_abs=b.get("max_exp_avg_abs"), use_max=self._use_max(self._step_count),
                              betas=self._hyper("beta"))
            return
        streamed = self._update is None
        birder(
            self.flat.params,
            self.flat.offsets,
            grads=self._local_grads(),  # local moments: the averaged gradient never exists
            active=self._active,
            exp_avg=b["exp_avg"],
            exp_avg_abs=b["exp_avg_abs"],
            max_exp_avg_abs=b.get("max_exp_avg_abs"),
            send=self.allreduce.input_buffer(self.flat.numel, self.flat.device) if streamed else self._update,
            accumulate=streamed,
            exchange=self._exchange_update,
            step=self._step_count,
            lrs=self._hyper("lr"),
            betas=self._hyper("beta"),
            weight_decays=self._hyper("weight_decay"),
            eps=self.eps,
            threshold_step=self.threshold_step,
        )

    def _extra_state(self) -> dict[str, Any]:
        return self._collectives_state()

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        self._load_collectives_state(state, own_state)


class SoftSignSGD(_SoftSign):
    """SoftSignSGD (Birder appendix B): Birder without compression, the control.

    Gradients are averaged exactly (fp32 all-reduce), then ``m``, ``b`` as Birder and
    ``x <- x (1 - lr * weight_decay) - lr * m / (b + eps)``. Its stats report stage
    ``"warmup"`` on every step: every exchange is uncompressed.
    """

    _flat_names = ("exp_avg", "exp_avg_abs")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        group: comm.Group = None,
        *,
        timeout: float | timedelta | None = None,
        broadcast_parameters: bool = True,
        on_nonfinite: str = "skip",
        check_replicas_every: int = 0,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(params, lr, beta, eps, weight_decay, group, timeout, broadcast_parameters, on_nonfinite,
                         check_replicas_every, max_grad_norm)
        self._grad = self._new_grad_buffer()  # the averaged gradient, then m / (b + eps) in its place

    def _stage(self) -> str:
        return "warmup"

    def _step(self) -> None:
        b = self.flat.buffers
        soft_sign_sgd(
            self.flat.params,
            self.flat.offsets,
            grads=self._averaged_grads(self._clipped(self._allreduce)),
            active=self._active,
            exp_avg=b["exp_avg"],
            exp_avg_abs=b["exp_avg_abs"],
            update=self._grad,
            lrs=self._hyper("lr"),
            betas=self._hyper("beta"),
            weight_decays=self._hyper("weight_decay"),
            eps=self.eps,
        )
