"""Comp-AMS (Li et al., 2022, Algorithm 2) and its baseline QAdam (Algorithm 4).

The math: :func:`comp_ams` (AMSGrad, lines 13-16, on the average of the compressed
gradients) and :func:`qadam_direction` (what a QAdam rank sends, ``m / sqrt(v + eps)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import comm
from .._checks import check_adam_args, check_bool
from ..compress import BlockSignCompressor, Compressor, TopKCompressor, UniformCompressor
from ._base import OnebitOptimizer
from ._stages import COMPRESSED_FORMED, COMPRESSED_GRADIENT, OneStage, Sends, Stage, Wire
from ._functional import apply_update_, ema_

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["CompAMS", "QAdam", "comp_ams", "qadam_direction"]

_COMPRESSORS = ("topk", "block_sign", "none")


def comp_ams(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grad: Tensor,
    active: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor,
    step: int,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    eps: float,
    bias_correction: bool,
) -> None:
    """Comp-AMS's server step, AMSGrad (lines 13-16), on ``grad``, the average over the workers of
    their (compressed) gradients (lines 7-12): ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, ``v^ = max(v^, v)``,
    ``x <- x - lr m / (sqrt(v^) + eps)`` (with ``bias_correction``: ``m / (1 - b1^t)`` and
    ``v^ / (1 - b2^t)``, as ``torch.optim.AdamW(amsgrad=True)``); decoupled weight decay. ``grad``
    is used as scratch: it holds the denominators afterwards.
    """
    for p, (lo, hi), lr, (b1, b2), wd, on in zip(params, offsets, lrs, betas, weight_decays, active):
        if not on:  # no gradient on any rank: not updated
            continue
        g = grad[lo:hi]
        m, v, vmax = exp_avg[lo:hi], exp_avg_sq[lo:hi], max_exp_avg_sq[lo:hi]
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        torch.maximum(vmax, v, out=vmax)
        bc1 = 1.0 - b1**step if bias_correction else 1.0
        bc2 = 1.0 - b2**step if bias_correction else 1.0
        denom = torch.sqrt(vmax, out=g).div_(math.sqrt(bc2)).add_(eps)  # into g: not read again
        apply_update_(p, m, denom, lr=lr, weight_decay=wd, step_size=lr / bc1)


def qadam_direction(m: Tensor, v: Tensor, grad: Tensor | None, *, betas: tuple[float, float], eps: float,
                    out: Tensor) -> Tensor:
    """Algorithm 4, one block of a rank's own state: the moments ``m <- b1 m + (1-b1) g``,
    ``v <- b2 v + (1-b2) g^2`` in place (``grad=None``: a zero gradient), then what it sends,
    ``a = m / sqrt(v + eps)``, in ``out``."""
    b1, b2 = betas
    ema_(m, grad, b1)
    v.mul_(b2)
    if grad is not None:
        v.addcmul_(grad, grad, value=1.0 - b2)
    return torch.div(m, torch.add(v, eps, out=out).sqrt_(), out=out)


def _check_common(lr: float, betas: object, eps: float, weight_decay: float, error_feedback: object) -> None:
    check_adam_args(lr, betas, eps, weight_decay)
    if not isinstance(error_feedback, bool):
        raise TypeError(f"Invalid error_feedback value: {error_feedback!r} (expected a bool)")


class _GradientExchange(OnebitOptimizer):
    """Comp-AMS and QAdam: a flat buffer (the gradients; ``m / sqrt(v + eps)``) averaged by a
    compressed all-gather (or an exact all-reduce), in place."""

    def _init_exchange(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], *, lr: float,
                       betas: tuple[float, float], weight_decay: float, group: comm.Group,
                       options: CommonOptions) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}, group=group,
                         **options)

    def _gathers(self, compressor: Callable[[int, int], Compressor] | None, error_feedback: bool,
                 overlap: bool = False) -> Callable[[int, int], comm.CompressedAllGather | None] | None:
        """``collective(start, end)`` for the exchange: the compressed all-gather of ``compressor(start,
        end)`` (None: an exact all-reduce, no collective of its own)."""
        if compressor is None:
            return None
        # a bucket's span without a whole block (Block-Sign) has nothing to send
        return lambda start, end: None if overlap and end == start else comm.CompressedAllGather(
            compressor(start, end), self.process_group, error_feedback=error_feedback, timeout=self.timeout)

    @property
    def exchange(self) -> comm.CompressedAllGather | None:
        """The compressed all-gather of the one-shot exchange (None with ``overlap=True``, where each
        bucket has its own, or without compression)."""
        return None if self._overlap else self._collectives[0]

    def _landing(self, wire: Wire) -> Tensor:
        return self._grad


class CompAMS(_GradientExchange):
    """Comp-AMS: AMSGrad on the average of error-feedback-compressed gradients (Algorithm 2).

    Every rank compresses its gradient plus its error (``error_feedback=False``: the
    paper's no-EF control), the compact payloads are all-gathered -- values + int32
    indices for Top-k, packed signs + block scales for Block-Sign, never a dense tensor --
    and every rank applies the same AMSGrad update to the exact average: the "central
    server" replicated. ``compressor="none"`` is distributed AMSGrad (an fp32
    all-reduce); world size 1 is Algorithm 3 (one machine, compressed gradients).

    Args:
        params: parameters or param groups (options ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate (read every step, so LR schedulers work).
        betas: ``(beta1, beta2)`` of AMSGrad's moments.
        eps: added to ``sqrt(v^)`` in the denominator.
        weight_decay: decoupled weight decay.
        compressor: ``"topk"`` (Definition 1, ``k = ceil(ratio * d)`` over the whole fused
            gradient), ``"block_sign"`` (Definition 2) or ``"none"``.
        ratio: Top-k's kept fraction, in ``(0, 1]``.
        block: Block-Sign blocks: an int block size (default 64: 1.5 bits per value with the
            fp32 scales, 21x less than fp32) or ``"tensor"``, one block per parameter tensor
            (the paper's "blocks are the network layers", 1 bit per value). Per-tensor blocks
            give every value of a layer the same magnitude, which erases Adam's per-value
            scale (the Comp-AMS page of the documentation has the measurements).
        error_feedback: keep each rank's compression error and add it to its next gradient
            (``False``: the paper's no-EF control).
        group: process group (``None``: default), an :class:`onebit.comm.MPIGroup`, or a
            backend name (``"mpi"``).
        bias_correction: divide ``m`` and ``v^`` by ``1 - beta^t`` (off in the paper).
        overlap: start each bucket's exchange during backward, as soon as its gradients are
            accumulated (see below); ``False``: one exchange of the whole model in ``step()``.
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 gradients (as DDP's).
        **options: :class:`onebit.optim.CommonOptions`.

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

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.CompAMS(model.parameters(), lr=1e-3, compressor="block_sign")
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.stats["stage"]
        'compressed'
    """

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
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
        **options: Unpack[CommonOptions],
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
        wire = COMPRESSED_GRADIENT if compressor != "none" else Wire("compressed", Sends.GRADIENTS)
        self._stages = OneStage(Stage(wire, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), averages=True))
        self._init_exchange(params, lr=lr, betas=betas, weight_decay=weight_decay, group=group, options=options)
        self._block = block if compressor == "block_sign" else None
        self._overlap = overlap
        make = None if compressor == "none" else (lambda start, end: topk) if self._block is None else self._block_sign
        self._drive(self._gathers(make, error_feedback, overlap), overlap=overlap, bucket_cap_mb=bucket_cap_mb,
                    alignment=self._block if isinstance(self._block, int) else 1, key="exchange")

    def _block_sign(self, lo: int, hi: int) -> BlockSignCompressor:
        """Block-Sign of the flat values ``[lo, hi)``: ``block`` values per block, or (``"tensor"``)
        one block per parameter inside it."""
        if self._block != "tensor":
            return BlockSignCompressor(block_size=self._block)
        # a zero-size tensor is no block
        return BlockSignCompressor(block_sizes=[b - a for a, b in self.flat.offsets if lo <= a < b <= hi])

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        b = self.flat.buffers
        comp_ams(self.flat.params, self.flat.offsets, grad=average, active=self._active, exp_avg=b["exp_avg"],
                 exp_avg_sq=b["exp_avg_sq"], max_exp_avg_sq=b["max_exp_avg_sq"], step=self._step_count,
                 lrs=self._hyper("lr"), betas=self._hyper("betas"), weight_decays=self._hyper("weight_decay"),
                 eps=self.eps, bias_correction=self.bias_correction)


class QAdam(_GradientExchange):
    """QAdam (Chen et al., 2020) as the Comp-AMS paper runs it (Algorithm 4, one-way).

    Each rank keeps its own moments from its local gradient, forms
    ``a = m / sqrt(v + eps)``, sends ``Q_b(a + e)`` (the uniform ``bits``-bit quantizer,
    :class:`onebit.compress.UniformCompressor`; ``bits=1`` is the paper's 1-bit QAdam)
    with error feedback, and every rank steps ``x <- x - lr * mean(Q_b(a + e))``.
    The moments differ between ranks, so each rank checkpoints its own ``state_dict``.

    Args:
        params: parameters or param groups (options ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate (read every step).
        betas: ``(beta1, beta2)`` of each rank's moments.
        eps: added to ``v`` under the square root.
        weight_decay: decoupled weight decay.
        bits: bits per value of the uniform quantizer (1: 1-bit QAdam).
        group: process group (``None``: default), an :class:`onebit.comm.MPIGroup`, or a
            backend name (``"mpi"``).
        error_feedback: keep each rank's quantization error for its next step.
        **options: :class:`onebit.optim.CommonOptions`.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.QAdam(model.parameters(), lr=1e-3, bits=2)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.stats["stage"]
        'compressed'
    """

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
        **options: Unpack[CommonOptions],
    ) -> None:
        _check_common(lr, betas, eps, weight_decay, error_feedback)
        quantizer = UniformCompressor(bits)  # validates bits
        self.eps = float(eps)
        self._stages = OneStage(Stage(COMPRESSED_FORMED, ("exp_avg", "exp_avg_sq"), averages=True))
        self._init_exchange(params, lr=lr, betas=betas, weight_decay=weight_decay, group=group, options=options)
        self._overlap = False
        self._drive(self._gathers(lambda start, end: quantizer, error_feedback), key="exchange")

    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """``a = m / sqrt(v + eps)`` after the moments move (QAdam has no overlap: its exchange is
        always launched in the agreed step, and its moments move here)."""
        b = self.flat.buffers
        m, v = b["exp_avg"][lo:hi], b["exp_avg_sq"][lo:hi]
        if live:
            qadam_direction(m, v, grad, betas=group["betas"], eps=self.eps, out=out)
        else:
            torch.div(m, torch.add(v, self.eps, out=out).sqrt_(), out=out)

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        """``x <- x (1 - lr wd) - lr a_bar``."""
        for p, (lo, hi), lr, wd, on in zip(self.flat.params, self.flat.offsets, self._hyper("lr"),
                                           self._hyper("weight_decay"), self._active):
            if on:
                apply_update_(p, average[lo:hi], None, lr=lr, weight_decay=wd, step_size=lr)
