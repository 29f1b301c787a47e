"""Argument checks and the options every onebit optimizer takes.

Errors name the argument and the value, as ``torch.optim``'s do
(``Invalid beta parameter at index 0: 1.0``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, TypedDict

import torch

__all__ = [
    "COMMON_OPTIONS",
    "CommonOptions",
    "check_adam_args",
    "check_beta",
    "check_betas",
    "check_bool",
    "check_entries",
    "check_nonneg",
    "check_optional_positive",
    "check_overlap",
    "check_positive",
    "check_positive_int",
    "check_scales",
    "check_seed",
]


class CommonOptions(TypedDict, total=False):
    """The keyword-only options of every onebit optimizer (see :class:`onebit.optim.OnebitOptimizer`).

    ``timeout``: per-collective timeout in seconds (default 300); ``broadcast_parameters``:
    rank 0's parameters to all ranks at construction (default True); ``on_nonfinite``:
    ``"skip"`` (default) or ``"raise"``; ``check_replicas_every``: compare the replicas after
    every K-th step (0: never); ``max_grad_norm``: gradient clipping (None: off).
    """

    timeout: float | timedelta | None
    broadcast_parameters: bool
    on_nonfinite: str
    check_replicas_every: int
    max_grad_norm: float | None


COMMON_OPTIONS: dict[str, object] = {
    "timeout": None,
    "broadcast_parameters": True,
    "on_nonfinite": "skip",
    "check_replicas_every": 0,
    "max_grad_norm": None,
}


def check_positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Invalid {name} value: {value!r} (expected a number)")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"Invalid {name} value: {value}")
    return float(value)


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Invalid {name} value: {value!r} (expected an int >= 1)")
    if value < 1:
        raise ValueError(f"Invalid {name} value: {value} (expected an int >= 1)")
    return value


def check_nonneg(name: str, value: object) -> float:
    return check_positive(name, value, allow_zero=True)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name} value: {value!r} (expected a bool)")
    return value


def check_entries(state: Any, keys: Iterable[str], owner: str) -> None:
    """Refuse (``ValueError``) a saved ``owner`` state that is not a mapping or lacks one of
    ``keys``: called before anything is loaded, so that a state refused changes nothing."""
    if not isinstance(state, Mapping):
        raise ValueError(f"invalid {owner} state: a {type(state).__name__}, expected a mapping")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"incomplete {owner} state: missing {missing} (truncated, or saved by another version)")


def check_overlap(value: object) -> bool | str | None:
    """``overlap`` of the optimizers with an fp32 warm-up: ``None`` (the default), ``"warmup"``, ``True``
    or ``False``."""
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value == "warmup"):
        return value
    raise ValueError(f"Invalid overlap value: {value!r} (expected None, 'warmup', True or False)")


def check_optional_positive(name: str, value: object) -> float | None:
    """``None`` (off) or a positive finite number: ``clip_update``, ``max_grad_norm``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Invalid {name} value: {value!r} (expected None or a positive number)")
    return float(value)


def check_betas(betas: object) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"Invalid betas: {betas!r} (expected a pair of floats)")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"Invalid beta parameter at index {i}: {b!r}")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    return float(betas[0]), float(betas[1])


def check_beta(beta: object, name: str = "beta") -> float:
    """A decay rate or other fraction in ``[0, 1)``."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"Invalid {name} value: {beta!r} (expected a number)")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"Invalid {name} value: {beta} (expected a number in [0, 1))")
    return float(beta)


def check_scales(scales: object, *, row: bool = False) -> str:
    """``scales`` of an exchange by a compressed all-reduce: ``"tensor"`` (one scale per tensor
    piece of each chunk) or ``"chunk"``, and with ``row`` also ``"row"`` (one per slice along a
    tensor's first dimension); a ``ValueError`` naming the value otherwise."""
    if scales not in ("tensor", "chunk", "row") or (scales == "row" and not row):
        expected = "'tensor', 'chunk' or 'row'" if row else "'tensor' or 'chunk'"
        raise ValueError(f"Invalid scales value: {scales!r} (expected {expected})")
    return scales  # type: ignore[return-value]


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_wire_dtype(name: str, value: object) -> torch.dtype:
    """The dtype an all-reduce of fp32 values sums in: ``torch.float32``, ``torch.bfloat16`` or
    ``torch.float16``; a ``TypeError`` naming the value otherwise."""
    if not isinstance(value, torch.dtype) or value not in _WIRE_DTYPES:
        raise TypeError(f"Invalid {name} value: {value!r} (expected torch.float32, torch.bfloat16 or torch.float16)")
    return value


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"Invalid seed value: {seed!r} (expected an int)")
    if not 0 <= seed < 2**32:
        raise ValueError(f"Invalid seed value: {seed} (must be in [0, 2**32))")
    return seed


def check_adam_args(lr: object, betas: object, eps: object, weight_decay: object) -> tuple[float, float]:
    """Validate the options every Adam-like optimizer takes; returns the betas."""
    check_nonneg("learning rate", lr)
    parsed = check_betas(betas)
    check_nonneg("epsilon", eps)
    check_nonneg("weight_decay", weight_decay)
    return parsed
