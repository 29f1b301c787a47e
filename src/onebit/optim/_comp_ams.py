"""Comp-AMS (Li et al., 2022, Algorithm 2) and its baseline QAdam (Algorithm 4)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .. import comm
from ..compress import BlockSignCompressor, Compressor, TopKCompressor, UniformCompressor
from ._base import OnebitOptimizer, check_adam_args, check_bool
from ._functional import _ema_, apply_update_
from ._overlap import Buckets, collectives_state, load_collectives_state, restart_errors

__all__ = ["CompAMS", "QAdam", "comp_ams"]

_COMPRESSORS = ("topk", "block_sign", "none")


def _waited(pending: comm.Pending) -> comm.Stages:
    """A collective already in flight, as stages (its result the last)."""
    yield pending
    return pending.wait()


def comp_ams(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grad: Tensor,
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor,
    exchange,
    step: int,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    eps: float,
    bias_correction: bool,
) -> None:
    """One Comp-AMS step: ``g = exchange(grad)`` (lines 7-12), then AMSGrad (lines 13-16).

    ``exchange(grad)`` returns the average over workers of the (compressed) gradients.
    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, ``v^ = max(v^, v)``,
    ``x <- x - lr m / (sqrt(v^) + eps)`` (with ``bias_correction``: ``m / (1 - b1^t)`` and
    ``v^ / (1 - b2^t)``, as ``torch.optim.AdamW(amsgrad=True)``); decoupled weight decay.
    """
    g_all = exchange(grad)
    for p, (lo, hi), lr, (b1, b2), wd, on in zip(params, offsets, lrs, betas, weight_decays, active):
        if not on:  # no gradient on any rank: not updated
            continue
        g = g_all[lo:hi]
        m, v, vmax = exp_avg[lo:hi], exp_avg_sq[lo:hi], max_exp_avg_sq[lo:hi]
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        torch.maximum(vmax, v, out=vmax)
        bc1 = 1.0 - b1**step if bias_correction else 1.0
        bc2 = 1.0 - b2**step if bias_correction else 1.0
        denom = vmax.sqrt().div_(math.sqrt(bc2)).add_(eps)
        apply_update_(p, m, denom, lr=lr, weight_decay=wd, step_size=lr / bc1)


class _GradientExchange(OnebitOptimizer):
    """A flat buffer (Comp-AMS: the gradients; QAdam: ``m / sqrt(v + eps)``) plus the exchange
    that averages it across the group in place."""

    def _setup_exchange(self, compressor: Compressor | None, error_feedback: bool) -> None:
        self._grad = self._new_grad_buffer()
        self.exchange = None if compressor is None else comm.CompressedAllGather(
            compressor, self.process_group, error_feedback=error_feedback, timeout=self.timeout
        )
        if self.exchange is not None:
            self.exchange.warm_up(self.flat.device)

    def _average(self, buffer: Tensor) -> Tensor:
        if self.exchange is None:
            return self._allreduce(buffer)
        return self.exchange(buffer, out=buffer)

    def _collectives(self) -> list[comm.CompressedAllGather | None]:
        """The compressed all-gathers: the one-shot one, or one per bucket (None: none)."""
        return [self.exchange] if self._buckets is None else self._bucket_exchange

    def _extra_state(self) -> dict[str, Any]:
        collectives = self._collectives()
        return {} if all(c is None for c in collectives) else collectives_state("exchange", self._buckets, collectives)

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        collectives = self._collectives()
        if any(c is not None for c in collectives):
            load_collectives_state(self, "exchange", state, own_state, collectives)


def _check_common(lr: float, betas: object, eps: float, weight_decay: float, error_feedback: object) -> None:
    check_adam_args(lr, betas, eps, weight_decay)
    if not isinstance(error_feedback, bool):
        raise TypeError(f"Invalid error_feedback value: {error_feedback!r} (expected a bool)")


class CompAMS(_GradientExchange):
    """Comp-AMS: AMSGrad on the average of error-feedback-compressed gradients (Algorithm 2).

    Every rank compresses its gradient plus its error (``error_feedback=False``: the
    paper's no-EF control), the compact payloads are all-gathered -- values + int32
    indices for Top-k, packed signs + block scales for Block-Sign, never a dense tensor --
    and every rank applies the same AMSGrad update to the exact average: the "central
    server" replicated. ``compressor="none"`` is distributed AMSGrad (an fp32
    all-reduce); world size 1 is Algorithm 3 (one machine, compressed gradients).

    Args:
        compressor: ``"topk"`` (Definition 1, ``k = ceil(ratio * d)`` over the whole fused
            gradient), ``"block_sign"`` (Definition 2) or ``"none"``.
        ratio: Top-k's kept fraction, in ``(0, 1]``.
        block: Block-Sign blocks: an int block size (default 64: 1.5 bits per value with the
            fp32 scales, 21x less than fp32) or ``"tensor"``, one block per parameter tensor
            (the paper's "blocks are the network layers", 1 bit per value). Per-tensor blocks
            give every value of a layer the same magnitude, which erases Adam's per-value
            scale: on the byte-LM task of ``onebit bench convergence`` they ended +38% above
            AMSGrad where 64-value blocks ended +5% (README, "What the matrix found").
        bias_correction: divide ``m`` and ``v^`` by ``1 - beta^t`` (off in the paper).
        overlap: start each bucket's exchange during backward, as soon as its gradients are
            accumulated (see below); ``False``: one exchange of the whole model in ``step()``.
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 gradients (as DDP's).

    The all-gather volume grows with the world size: each rank receives ``w - 1``
    payloads. Missing gradients follow :class:`onebit.optim.OnebitOptimizer`'s rule.

    **Overlapped exchange** (``overlap=True``, DDP's scheme, as :class:`OnebitAdam`'s): the
    parameters are grouped into buckets in reverse order, and a post-accumulate-grad hook
    compresses a bucket's gradients (plus its error) and starts their all-gather once they
    are all in, while backward computes earlier layers; ``step()`` waits for what is in
    flight and averages. Block-Sign's blocks never straddle two exchanges: a bucket sends
    whole blocks of the fused gradient, the block the bucket boundary cuts going with the
    next bucket (the parameters before it, whose gradients come later), so every value has
    the one-shot exchange's block, sign and scale: ``overlap=True`` gives ``overlap=False``'s
    bits. ``compressor="none"`` all-reduces each bucket (the same bits on two ranks; on more,
    gloo sums in an order that depends on where a bucket starts). Top-k is refused: its ``k``
    largest values are over the whole gradient (Definition 1), which no bucket can wait for.
    Requirements, each checked: no GradScaler, and gradient accumulation inside
    :meth:`no_sync` for all micro-batches but the last. A skipped step (non-finite gradient)
    restarts the error-feedback buffers at zero: they took the gradients in before the ranks
    could agree.
    """

    _flat_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        compressor: str = "topk",
        ratio: float = 0.01,
        block: str | int = 64,
        error_feedback: bool = True,
        group: comm.Group = None,
        *,
        bias_correction: bool = False,
        timeout: float | timedelta | None = None,
        broadcast_parameters: bool = True,
        on_nonfinite: str = "skip",
        check_replicas_every: int = 0,
        max_grad_norm: float | None = None,
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        _check_common(lr, betas, eps, weight_decay, error_feedback)
        if compressor not in _COMPRESSORS:
            raise ValueError(f"Invalid compressor value: {compressor!r} (expected one of {', '.join(_COMPRESSORS)})")
        if check_bool("overlap", overlap) and compressor == "topk":
            raise ValueError("Invalid compressor value with overlap=True: 'topk' (Top-k keeps the k largest values "
                             "of the whole gradient, which the first bucket's exchange cannot wait for); use "
                             "'block_sign' or overlap=False")
        if block != "tensor" and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"Invalid block value: {block!r} (expected 'tensor' or an int >= 1)")
        topk = TopKCompressor(ratio) if compressor == "topk" else None  # validates ratio
        if not isinstance(bias_correction, bool):
            raise TypeError(f"Invalid bias_correction value: {bias_correction!r} (expected a bool)")
        self.eps = float(eps)
        self.bias_correction = bias_correction
        super().__init__(
            params,
            {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay},
            group=group,
            timeout=timeout,
            broadcast_parameters=broadcast_parameters,
            on_nonfinite=on_nonfinite,
            check_replicas_every=check_replicas_every,
            max_grad_norm=max_grad_norm,
        )
        self._block = block if compressor == "block_sign" else None
        if overlap:
            self._use_buckets(bucket_cap_mb, error_feedback)
        else:
            self._setup_exchange(topk if self._block is None else self._block_sign(0, self.flat.numel), error_feedback)

    def _block_sign(self, lo: int, hi: int) -> BlockSignCompressor:
        """Block-Sign of the flat values ``[lo, hi)``: ``block`` values per block, or (``"tensor"``)
        one block per parameter inside it."""
        if self._block != "tensor":
            return BlockSignCompressor(block_size=self._block)
        # a zero-size tensor is no block
        return BlockSignCompressor(block_sizes=[b - a for a, b in self.flat.offsets if lo <= a < b <= hi])

    def _use_buckets(self, bucket_cap_mb: float, error_feedback: bool) -> None:
        """The overlapped exchange: each bucket's span of whole blocks, and its all-gather (or
        ``compressor="none"``: all-reduce) in flight between backward and ``step()``."""
        self._grad = self._new_grad_buffer()
        self.exchange = None
        self._buckets = Buckets(self.flat.params, self.flat.offsets, bucket_cap_mb, self._launch_bucket)
        n, size = self.flat.numel, self._block if isinstance(self._block, int) else 1
        # A bucket's span starts at the first block boundary inside it and ends where the span
        # of the bucket launched before it (the parameters after it) starts -- at the model's
        # end for the first bucket.
        starts = [min(n, -(-lo // size) * size) for lo, _, _ in self._buckets.bounds]
        self._spans = [(start, end) for start, end in zip(starts, [n, *starts])]
        self._bucket_exchange = [
            None if self._block is None or end == start else comm.CompressedAllGather(
                self._block_sign(start, end), self.process_group, error_feedback=error_feedback, timeout=self.timeout)
            for start, end in self._spans
        ]
        for exchange in self._bucket_exchange:
            if exchange is not None:
                exchange.warm_up(self.flat.device)
        self._flights: list[comm.Stages | None] = [None] * len(self._spans)

    def _launch_bucket(self, b: int) -> None:
        """Gather bucket ``b``'s gradients into ``self._grad`` and start its span's exchange."""
        lo, hi, members = self._buckets.bounds[b]
        self.flat.gather_grads(self._grad[lo:hi], members, base=lo)
        start, end = self._spans[b]
        exchange = self._bucket_exchange[b]
        if self._block is None:  # distributed AMSGrad: the bucket's exact average
            stages = _waited(comm.all_reduce_mean(self._grad[lo:hi], self.process_group, self.timeout, async_op=True))
        elif exchange is not None:
            stages = exchange.stages(self._grad[start:end], out=self._grad[start:end])
        else:  # no whole block in this bucket: its values go with the next one
            return
        next(stages)
        self._flights[b] = stages

    def _finish_buckets(self, grad: Tensor) -> Tensor:
        """Wait for every bucket's exchange; ``grad`` (``self._grad``) then holds the average."""
        for b, stages in enumerate(self._flights):
            if stages is not None:
                self._flights[b] = None
                comm.run_stages(stages)
        return grad

    def _abandon_buckets(self) -> None:
        self._finish_buckets(self._grad)
        if self._block is not None:
            restart_errors(self, self._bucket_exchange)

    def _step(self) -> None:
        if self._buckets is None:
            self.flat.gather_grads(self._grad)
        b = self.flat.buffers
        comp_ams(
            self.flat.params,
            self.flat.offsets,
            grad=self._grad,
            active=self._active,
            exp_avg=b["exp_avg"],
            exp_avg_sq=b["exp_avg_sq"],
            max_exp_avg_sq=b["max_exp_avg_sq"],
            exchange=self._clipped(self._average if self._buckets is None else self._finish_buckets),
            step=self._step_count,
            lrs=self._hyper("lr"),
            betas=self._hyper("betas"),
            weight_decays=self._hyper("weight_decay"),
            eps=self.eps,
            bias_correction=self.bias_correction,
        )


class QAdam(_GradientExchange):
    """QAdam (Chen et al., 2020) as the Comp-AMS paper runs it (Algorithm 4, one-way).

    Each rank keeps its own moments from its local gradient, forms
    ``a = m / sqrt(v + eps)``, sends ``Q_b(a + e)`` (the uniform ``bits``-bit quantizer,
    :class:`onebit.compress.UniformCompressor`; ``bits=1`` is the paper's 1-bit QAdam)
    with error feedback, and every rank steps ``x <- x - lr * mean(Q_b(a + e))``.
    The moments differ between ranks, so each rank checkpoints its own ``state_dict``.
    """

    _flat_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bits: int = 1,
        group: comm.Group = None,
        *,
        error_feedback: bool = True,
        timeout: float | timedelta | None = None,
        broadcast_parameters: bool = True,
        on_nonfinite: str = "skip",
        check_replicas_every: int = 0,
        max_grad_norm: float | None = None,
    ) -> None:
        _check_common(lr, betas, eps, weight_decay, error_feedback)
        quantizer = UniformCompressor(bits)  # validates bits
        self.eps = float(eps)
        super().__init__(
            params,
            {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay},
            group=group,
            timeout=timeout,
            broadcast_parameters=broadcast_parameters,
            on_nonfinite=on_nonfinite,
            check_replicas_every=check_replicas_every,
            max_grad_norm=max_grad_norm,
        )
        self._setup_exchange(quantizer, error_feedback)

    def _step(self) -> None:
        m_all, v_all, a = self.flat.buffers["exp_avg"], self.flat.buffers["exp_avg_sq"], self._grad
        grads = self._local_grads()  # local moments: the averaged gradient never exists
        for (lo, hi), g, (b1, b2), on in zip(self.flat.offsets, grads, self._hyper("betas"), self._active):
            if not on:
                continue
            _ema_(m_all[lo:hi], g, b1)
            v = v_all[lo:hi].mul_(b2)
            if g is not None:
                v.view(g.shape).addcmul_(g, g, value=1.0 - b2)
        # a = m / sqrt(v + eps), formed in the exchange's buffer and averaged there in place.
        torch.div(m_all, torch.add(v_all, self.eps, out=a).sqrt_(), out=a)
        a_bar = self._average(a)
        for p, (lo, hi), lr, wd, on in zip(self.flat.params, self.flat.offsets, self._hyper("lr"),
                                           self._hyper("weight_decay"), self._active):
            if on:
                apply_update_(p, a_bar[lo:hi], None, lr=lr, weight_decay=wd, step_size=lr)
