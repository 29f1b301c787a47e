"""The pieces of math the optimizers share, on flat fp32 buffers: moving averages, Adam's
preconditioner and its step bound, the parameter update (decoupled weight decay), and the values
a frozen preconditioner holds no gradient for."""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..ops import clamp_scaled_, zero_where_equal_

__all__ = ["UpdateByChunks", "adam_denominator", "adam_denominators", "adam_step_bound", "apply_update_",
           "clip_to_adam_step_", "count_unused", "ema_", "mask_unused_"]

_log = logging.getLogger("onebit.optim")


def adam_denominator(exp_avg_sq: Tensor, *, eps: float, bias_correction2: float, out: Tensor | None = None) -> Tensor:
    """``sqrt(v / bias_correction2) + eps`` -- the preconditioner of eq. (1)."""
    out = torch.sqrt(exp_avg_sq, out=out)
    return out.div_(math.sqrt(bias_correction2)).add_(eps)


def adam_denominators(exp_avg_sq: Tensor, offsets: Sequence[tuple[int, int]], *, eps: float,
                      bias_corrections2: Sequence[float], out: Tensor) -> Tensor:
    """:func:`adam_denominator` of each parameter's slice ``[lo, hi)`` of the flat ``exp_avg_sq``,
    with its own ``bias_correction2``, into the flat ``out`` (which may be ``exp_avg_sq`` itself)."""
    for (lo, hi), bc2 in zip(offsets, bias_corrections2):
        adam_denominator(exp_avg_sq[lo:hi], eps=eps, bias_correction2=bc2, out=out[lo:hi])
    return out


def adam_step_bound(beta1: float, beta2: float) -> float:
    """The largest step, in units of the learning rate, that Adam itself takes on a value:
    ``(1 - beta1) / sqrt(1 - beta2)`` when that exceeds 1, else 1 (Kingma & Ba, section 2.1);
    3.16 at the default betas."""
    return max(1.0, (1.0 - beta1) / math.sqrt(1.0 - beta2))


def clip_to_adam_step_(exp_avg: Tensor, denom: Tensor, beta1: float, beta2: float, bias_correction1: float = 1.0,
                       bias_correction2: float = 1.0, factor: float = 10.0) -> None:
    """Clip, in place, each value of the averaged momentum so that its bias-corrected step
    ``(exp_avg / bias_correction1) / (denom / sqrt(bias_correction2))`` is at most ``factor``
    times :func:`adam_step_bound`. ``denom`` is ``sqrt(v) + eps`` as the update uses it; pass
    the corrections it does not already contain (``bias_correction2 = 1 - beta2^T`` for a
    variance frozen uncorrected at step ``T``).

    Not in the papers; why it is needed: the 1-bit exchange gives every value of a chunk a
    magnitude of about the chunk's scale, whatever its own momentum. Divided by a frozen
    ``sqrt(v)`` that is tiny (a rarely seen embedding row, a logit that stopped receiving
    gradient), that is a step of ``lr * scale / sqrt(v)`` -- thousands of times what Adam
    would take. Error feedback cancels it only on average, and a row moved by hundreds
    diverges the model when it is next looked up. With a frozen variance a value's honest
    step can exceed Adam's bound too (its gradient grew after the freeze), hence the margin
    ``factor``: at 1 it cost 1-bit LAMB 20% of loss on a GPT task, at 10 nothing, while the
    outliers above are hundreds to thousands of times the bound.
    """
    clamp_scaled_(exp_avg, denom, factor * adam_step_bound(beta1, beta2) * bias_correction1 / math.sqrt(bias_correction2))


def apply_update_(
    param: Tensor, numer: Tensor, denom: Tensor | None, *, lr: float, weight_decay: float,
    step_size: float | Tensor,
) -> None:
    """``x <- x (1 - lr wd) - step_size * numer [/ denom]`` (decoupled weight decay, as AdamW).

    ``numer``/``denom`` are flat fp32 in the parameter's logical (row-major) order;
    low-precision and non-contiguous (e.g. ``channels_last``) parameters are updated in fp32
    and written back once. ``step_size`` may be a 0-d tensor on the parameter's device (1-bit
    LAMB's layer-wise coefficient), which keeps the step free of host synchronisation.
    """
    # fp32 and contiguous: update in place; otherwise (low precision, channels_last or another
    # layout) on an fp32 copy in logical order, written back once.
    in_place = param.dtype == torch.float32 and param.is_contiguous()
    x = param.view(-1) if in_place else param.detach().reshape(-1).float()
    if weight_decay:
        x.mul_(1.0 - lr * weight_decay)
    if isinstance(step_size, Tensor):
        numer = numer if denom is None else numer / denom
        x.addcmul_(numer, step_size.neg().to(torch.float32))
    elif denom is None:
        x.add_(numer, alpha=-step_size)
    else:
        x.addcdiv_(numer, denom, value=-step_size)
    if not in_place:
        param.copy_(x.view(param.shape))


def ema_(state: Tensor, value: Tensor | None, beta: float, out: Tensor | None = None) -> Tensor:
    """``state <- beta state + (1 - beta) value`` in place, ``value=None`` counting as zero;
    ``state`` is a flat slice, ``value`` may have its parameter's shape and layout (``p.grad``).
    With ``out`` (flat, ``state``'s size) the result goes there and ``state`` is left as it is:
    the same operations, so the same bits."""
    out = state.mul_(beta) if out is None else torch.mul(state, beta, out=out)
    if value is not None:
        out.view(value.shape).add_(value, alpha=1.0 - beta)
    return out


class UpdateByChunks:
    """``x <- x (1 - lr wd) - lr u`` (:func:`apply_update_`, ``step_size=lr``) for every active
    parameter, ``u`` arriving as chunks ``[lo, hi)`` of the flat layout, in order (as
    :meth:`onebit.comm.CompressedAllReduce.stages` hands them out to a ``consume``).

    An fp32 contiguous parameter takes each piece in place as it comes; any other (low
    precision, ``channels_last``) collects its pieces in an fp32 buffer of its own size and
    is updated once, by its last piece.
    """

    def __init__(self, params: Sequence[Tensor], offsets: Sequence[tuple[int, int]], *, lrs: Sequence[float],
                 weight_decays: Sequence[float], active: Sequence[bool]) -> None:
        self.params, self.offsets, self.lrs, self.weight_decays, self.active = params, offsets, lrs, weight_decays, active
        self._ends = [hi for _, hi in offsets]
        self._pending: dict[int, Tensor] = {}

    def __call__(self, lo: int, hi: int, values: Tensor) -> None:
        i = bisect.bisect_right(self._ends, lo)  # the first parameter ending after lo
        while i < len(self.params) and self.offsets[i][0] < hi:
            p, (start, end) = self.params[i], self.offsets[i]
            a, b = max(lo, start), min(hi, end)
            if self.active[i] and a < b:
                kw = {"lr": self.lrs[i], "weight_decay": self.weight_decays[i], "step_size": self.lrs[i]}
                if p.dtype == torch.float32 and p.is_contiguous():
                    apply_update_(p.view(-1)[a - start : b - start], values[a - lo : b - lo], None, **kw)
                else:
                    whole = self._pending.get(i)
                    if whole is None:
                        whole = self._pending[i] = torch.empty(end - start, dtype=torch.float32, device=p.device)
                    whole[a - start : b - start].copy_(values[a - lo : b - lo])
                    if b == end:
                        apply_update_(p, self._pending.pop(i), None, **kw)
            i += 1


def count_unused(owner: str, frozen: Tensor, value: float, offsets: Sequence[tuple[int, int]], *,
                 log: bool = True) -> list[int]:
    """The parameters (indices into ``offsets``) whose flat frozen state ``frozen`` holds
    ``value`` somewhere: it had a zero variance at the freeze, no gradient through the whole
    warm-up (an embedding row never looked up, a frozen tensor). No mask is kept:
    :func:`mask_unused_` re-derives it from the frozen state of those parameters, at no memory
    cost between steps. ``log``: say how many values at INFO."""
    counts = [int((frozen[lo:hi] == value).sum()) for lo, hi in offsets]
    if log and any(counts):
        _log.info("%s: %d values had a zero gradient through the warm-up; their momentum is held at zero",
                  owner, sum(counts))
    return [i for i, count in enumerate(counts) if count]


def mask_unused_(m: Tensor, frozen: Tensor, value: float, offsets: Sequence[tuple[int, int]],
                 params: Iterable[int]) -> None:
    """Zero the averaged momentum where the frozen state equals ``value``, in ``params`` (those
    :func:`count_unused` found; the others hold no such value and are not read).

    1-bit compression gives every value a magnitude; where the frozen variance is zero the
    step would be ``lr * scale / eps``. DeepSpeed asks users for an ``exp_avg_mask``; the zero
    variance is that mask, derived instead of asked for.
    """
    for i in params:
        lo, hi = offsets[i]
        zero_where_equal_(m[lo:hi], frozen[lo:hi], value)
