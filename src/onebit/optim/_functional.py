"""The math of 1-bit Adam (Algorithm 1) on flat buffers, with the collective passed in.

``exchange(buffer)`` must replace ``buffer`` in place by its average over the workers: an
exact all-reduce for the warm-up, the compressed all-reduce for the compression stage --
or, in a single-process test, any stand-in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["adam_denominator", "apply_update_", "onebit_adam"]

Exchange = Callable[[Tensor], object]


def adam_denominator(exp_avg_sq: Tensor, *, eps: float, bias_correction2: float, out: Tensor | None = None) -> Tensor:
    """``sqrt(v / bias_correction2) + eps`` -- the preconditioner of eq. (1)."""
    out = torch.sqrt(exp_avg_sq, out=out)
    return out.div_(math.sqrt(bias_correction2)).add_(eps)


def apply_update_(
    param: Tensor, numer: Tensor, denom: Tensor | None, *, lr: float, weight_decay: float,
    step_size: float | Tensor,
) -> None:
    """``x <- x (1 - lr wd) - step_size * numer [/ denom]`` (decoupled weight decay, as AdamW).

    ``numer``/``denom`` are flat fp32; low-precision parameters are updated in fp32 and
    rounded once. ``step_size`` may be a 0-d tensor on the parameter's device (1-bit
    LAMB's layer-wise coefficient), which keeps the step free of host synchronisation.
    """
    x = param.view(-1) if param.dtype == torch.float32 else param.detach().reshape(-1).float()
    if weight_decay:
        x.mul_(1.0 - lr * weight_decay)
    if isinstance(step_size, Tensor):
        numer = numer if denom is None else numer / denom
        x.addcmul_(numer, step_size.neg().to(torch.float32))
    elif denom is None:
        x.add_(numer, alpha=-step_size)
    else:
        x.addcdiv_(numer, denom, value=-step_size)
    if param.dtype != torch.float32:
        param.copy_(x.view_as(param))


def onebit_adam(
    params: Sequence[Tensor],
    offsets: Sequence[tuple[int, int]],
    *,
    grad: Tensor,
    has_grad: Sequence[bool],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    frozen_denom: Tensor | None,
    exchange: Exchange,
    compressed: bool,
    step: int,
    lrs: Sequence[float],
    betas: Sequence[tuple[float, float]],
    weight_decays: Sequence[float],
    eps: float,
    bias_correction: bool,
) -> list[bool]:
    """One step of 1-bit Adam over all parameters; returns which parameters were updated.

    ``grad`` holds the local gradients at ``offsets`` followed by one participation flag
    per parameter (1.0 where the parameter has a gradient on this rank, as ``has_grad``).
    A parameter is updated where its flag is positive after ``exchange``; when every
    parameter has a local gradient that is known without reading the flags back from the
    device, so the usual step has no host synchronisation.

    Warm-up (``compressed=False``): ``exchange(grad)`` averages gradients and flags, then
    exact Adam, eq. (1), on every parameter that has a gradient on some rank.
    Compression (Algorithm 1 lines 6-13): ``m <- beta1 m + (1 - beta1) g_local`` for the
    parameters with a local gradient, ``exchange(exp_avg)`` replaces the fused momentum by
    its error-compensated 1-bit average, and ``x <- x - lr m / frozen_denom``.
    With ``bias_correction`` the momentum is divided by ``1 - beta1^t`` and the variance by
    ``1 - beta2^t`` (frozen at the freeze step in ``frozen_denom``), as ``torch.optim.AdamW``.
    """
    n = len(params)
    flags = grad[grad.numel() - n :]
    if not compressed:
        exchange(grad)
    active = [True] * n if all(has_grad) else (flags > 0).tolist()
    for i, (lo, hi) in enumerate(offsets):
        if not active[i]:
            continue
        beta1, beta2 = betas[i]
        g = grad[lo:hi]
        if compressed:
            exp_avg[lo:hi].mul_(beta1).add_(g, alpha=1.0 - beta1)
        else:
            exp_avg[lo:hi].lerp_(g, 1.0 - beta1)
            exp_avg_sq[lo:hi].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    if compressed:
        exchange(exp_avg)
    for i, (p, (lo, hi)) in enumerate(zip(params, offsets)):
        if not active[i]:
            continue
        beta1, beta2 = betas[i]
        bc1 = 1.0 - beta1**step if bias_correction else 1.0
        if compressed:
            denom = frozen_denom[lo:hi]
        else:
            bc2 = 1.0 - beta2**step if bias_correction else 1.0
            denom = adam_denominator(exp_avg_sq[lo:hi], eps=eps, bias_correction2=bc2)
        apply_update_(p, exp_avg[lo:hi], denom, lr=lrs[i], weight_decay=weight_decays[i], step_size=lrs[i] / bc1)
    return active
