"""One-pass element-wise updates of the optimizers' flat fp32 state.

numba on CPU (:mod:`._cpu`), Triton for ``clamp_scaled_`` on CUDA (:mod:`._triton`); torch
elsewhere and inside :func:`reference_kernels`. All give the same bits: the fast kernels compute
the same fp32 operations, value by value.
On CPU the torch forms are several passes over memory with temporaries (a comparison into
a bool mask, then a masked fill: ~20 ms for 10.5M values on one thread, against ~4 ms).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from . import _bits, _cpu, _triton

__all__ = ["clamp_scaled_", "max_ratio", "soft_sign_", "zero_where_equal_"]

_BLOCK = 1 << 20  # values per block of the torch form's limits: scratch of a bounded size


def _numba_ok(*tensors: Tensor) -> bool:
    # The kernels are fp32 (the limits' product too): other dtypes take the torch form.
    return _bits._numba_ok(*tensors) and all(t.dtype == torch.float32 for t in tensors)


@functools.cache
def _torch_add_rounds_once() -> bool | None:
    """Whether torch's ``x.add_(y, alpha=a)`` on CPU rounds ``x + a * y`` once (a fused
    multiply-add, as its AVX2 kernels do), twice (``False``), or neither on every value (``None``:
    no fast kernel can match it). Probed, not assumed, since it depends on the CPU and on
    ``ATEN_CPU_CAPABILITY``: ``-1 + (1 + 2^-12)^2`` is ``2^-11 + 2^-24`` rounded once and
    ``2^-11`` rounded twice; 67 values reach both the vectorised loop and its scalar tail."""
    a = 1.0 + 2.0**-12
    cpu32 = {"dtype": torch.float32, "device": "cpu"}  # whatever the defaults: the kernel's case
    x = torch.full((67,), -1.0, **cpu32).add_(torch.full((67,), a, **cpu32), alpha=a)
    once = x == 2.0**-11 + 2.0**-24
    if bool(once.all()):
        return True
    return False if bool((x == 2.0**-11).all()) else None


def soft_sign_(m: Tensor, b: Tensor, g: Tensor, out: Tensor, *, beta: float, eps: float) -> Tensor:
    """Birder's lines 5-6 and its direction in one pass: ``m <- beta m + (1 - beta) g``,
    ``b <- beta b + (1 - beta) |g|`` in place, then ``out = m / (b + eps)``; all four flat fp32 of
    one size. The torch form is ``m.mul_(beta).add_(g, alpha=1 - beta)`` (and ``b``'s), then
    ``torch.div(m, b + eps, out=out)``; the kernel rounds as it does on this machine (the same
    bits, but for which NaN's sign survives where two NaNs meet).

    Examples:
        >>> m, b, out = torch.zeros(3), torch.zeros(3), torch.empty(3)
        >>> g = torch.tensor([2.0, -1.0, 0.0])
        >>> onebit.ops.soft_sign_(m, b, g, out, beta=0.5, eps=1e-8)
        tensor([ 1., -1.,  0.])
    """
    rounds_once = _torch_add_rounds_once()
    if rounds_once is not None and _numba_ok(m, b, g, out):
        _cpu.soft_sign_(m.numpy(), b.numpy(), g.numpy(), out.numpy(), np.float32(beta), np.float32(1.0 - beta),
                        np.float32(eps), rounds_once)
        return out
    m.mul_(beta).add_(g, alpha=1.0 - beta)
    b.mul_(beta).add_(g.abs(), alpha=1.0 - beta)
    return torch.div(m, b + eps, out=out)


def clamp_scaled_(x: Tensor, bound: Tensor, scale: float) -> Tensor:
    """``x <- clamp(x, -bound * scale, bound * scale)`` in place; ``x`` and ``bound`` are flat
    fp32 of the same size, and ``bound * scale`` is the fp32 product."""
    x, bound = x.view(-1), bound.view(-1)
    if _numba_ok(x, bound):
        _cpu.clamp_scaled_(x.numpy(), bound.numpy(), np.float32(scale))
        return x
    if _bits._fast_gpu(x) and x.dtype == bound.dtype == torch.float32:
        _triton.clamp_scaled(x, bound, scale)
        return x
    for lo in range(0, x.numel(), _BLOCK):
        limit = bound[lo : lo + _BLOCK] * scale
        torch.clamp(x[lo : lo + _BLOCK], min=limit.neg(), max=limit, out=x[lo : lo + _BLOCK])
    return x


def zero_where_equal_(x: Tensor, ref: Tensor, value: float) -> Tensor:
    """``x[i] <- 0`` wherever ``ref[i] == value``, in place (``x.masked_fill_(ref == value, 0)``)."""
    if _numba_ok(x, ref):
        _cpu.zero_where_equal_(x.view(-1).numpy(), ref.view(-1).numpy(), np.float32(value))
        return x
    return x.masked_fill_(ref == value, 0.0)


def max_ratio(num: Tensor, den: Tensor, default: Tensor, *, work: Tensor | None = None) -> Tensor:
    """``max(num / den)`` over the values with ``den > 0`` (fp32 quotients), as a 0-d tensor of
    ``default``'s dtype and device, or ``default`` where no value has ``den > 0`` -- 1-bit LAMB's
    scaling ratio ``max(v_Tw / v_t)`` (Algorithm 1 line 17). ``work`` (``num``'s size) is the
    torch form's scratch."""
    if _numba_ok(num, den):
        largest, seen = _cpu.max_ratio(num.view(-1).numpy(), den.view(-1).numpy())
        return default.new_tensor(largest) if seen else default
    seen = den > 0
    largest = torch.div(num, den, out=work).masked_fill_(~seen, float("-inf")).max().to(default.dtype)
    return torch.where(seen.any(), largest, default)
