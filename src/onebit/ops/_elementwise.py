"""One-pass element-wise updates of the optimizers' flat fp32 state.

numba on CPU (:mod:`._cpu`), Triton for ``clamp_scaled_`` on CUDA (:mod:`._triton`); torch
elsewhere and inside :func:`reference_kernels`. All give the same bits: the fast kernels compute
the same fp32 operations, value by value.
On CPU the torch forms are several passes over memory with temporaries (a comparison into
a bool mask, then a masked fill: ~20 ms for 10.5M values on one thread, against ~4 ms).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import _bits, _cpu, _triton

__all__ = ["clamp_scaled_", "max_ratio", "zero_where_equal_"]

_BLOCK = 1 << 20  # values per block of the torch form's limits: scratch of a bounded size


def _numba_ok(*tensors: Tensor) -> bool:
    # The kernels are fp32 (the limits' product too): other dtypes take the torch form.
    return _bits._numba_ok(*tensors) and all(t.dtype == torch.float32 for t in tensors)


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
