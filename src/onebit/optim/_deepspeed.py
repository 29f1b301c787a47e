"""Build an onebit optimizer from a DeepSpeed config: the way off DeepSpeed's removed 1-bit optimizers.

DeepSpeed 0.19.6 was the last release with ``OneBitAdam``, ``OneBitLamb`` and ``ZeroOneAdam``.
Their configs name the optimizer and its arguments in an ``"optimizer"`` block, and clipping
in the top-level ``"gradient_clipping"``. :func:`from_deepspeed_config` maps every argument of
the three to the onebit optimizer that behaves as DeepSpeed's did, and refuses what has no
meaning here with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor

from ._onebit_adam import OnebitAdam
from ._onebit_lamb import OnebitLamb
from ._zero_one_adam import ZeroOneAdam

__all__ = ["from_deepspeed_config"]

_log = logging.getLogger(__name__)

_COMMON = ("lr", "betas", "eps", "weight_decay", "freeze_step")
_LAMB = ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min", "factor_threshold")
_ZERO_ONE = ("lr", "betas", "eps", "weight_decay", "var_freeze_step", "var_update_scaler", "local_step_scaler",
             "local_step_clipper")
# DeepSpeed arguments handled below rather than passed on by name.
_HANDLED = ("bias_correction", "eps_inside_sqrt", "max_grad_norm", "amsgrad", "cuda_aware", "comm_backend_name")
_TYPES = {"onebitadam": (OnebitAdam, _COMMON), "onebitlamb": (OnebitLamb, _COMMON + _LAMB),
          "zerooneadam": (ZeroOneAdam, _ZERO_ONE)}
# Whose update never applied bias correction in DeepSpeed, whatever the config said.
_UNCORRECTED = (OnebitAdam, ZeroOneAdam)
_FREEZE_DEFAULT = 100_000  # DeepSpeed's default freeze_step of 1-bit Adam and LAMB
# DeepSpeed's gradient_clipping when a config omits it: 1.0 from 0.19.3 on (DeepSpeed pull request 8068),
# 0 (no clipping) in every release before
_CLIPPING_DEFAULT = 1.0


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    raise TypeError(f"config must be a dict or the path of a DeepSpeed JSON config, got {type(config).__name__}")


def from_deepspeed_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    **overrides: Any,
) -> OnebitAdam | OnebitLamb | ZeroOneAdam:
    """The onebit optimizer a DeepSpeed config's ``"optimizer"`` block and ``"gradient_clipping"`` describe.

    ``type`` ``"OneBitAdam"`` gives :class:`OnebitAdam`, ``"OneBitLamb"``
    :class:`OnebitLamb`, ``"ZeroOneAdam"`` :class:`ZeroOneAdam` (case-insensitive, as
    DeepSpeed). Arguments map by name (``lr``, ``betas``, ``eps``, ``weight_decay``,
    ``freeze_step`` -- DeepSpeed's default 100000 when absent -- LAMB's ``max_coeff``,
    ``min_coeff``, ``coeff_beta``, ``factor_max``, ``factor_min``, ``factor_threshold``, and
    0/1 Adam's ``var_freeze_step``, ``var_update_scaler``, ``local_step_scaler``,
    ``local_step_clipper``, with DeepSpeed's defaults, which are also onebit's), with these
    translations:

    * ``bias_correction``: DeepSpeed's 1-bit Adam and 0/1 Adam accept it and never apply it
      (their update is ``m / (sqrt(v) + eps)``), so :class:`OnebitAdam` and
      :class:`ZeroOneAdam` get ``bias_correction=False`` whatever the config says -- the same
      training.
    * :class:`OnebitAdam` gets ``refresh_every=None``: DeepSpeed's variance stays frozen after
      ``freeze_step``, Algorithm 1's. :class:`ZeroOneAdam` gets ``max_refresh_interval=None``
      and ``refresh_weight="refresh"``: DeepSpeed's refreshes, Algorithm 1's.
    * ``gradient_clipping`` (top level) becomes ``max_grad_norm``; the optimizer block's own
      ``max_grad_norm``, which DeepSpeed stored and never used, is refused when positive. A
      config without ``gradient_clipping`` clips at 1.0, as DeepSpeed 0.19.3 to 0.19.6 did, with
      a warning: releases before 0.19.3 did not clip (``"gradient_clipping": 0`` or the override
      ``max_grad_norm=None`` trains as they did).
    * ``comm_backend_name``: ``"nccl"`` and ``"compressed"`` use the default process group
      (NCCL or gloo, whichever it is), ``"mpi"`` uses ``group="mpi"``; ``cuda_aware=true``
      does not apply (CUDA tensors go to NCCL or MPI as they are) and is refused, as are
      ``amsgrad=true`` (DeepSpeed refused it too) and ``eps_inside_sqrt=true`` (DeepSpeed
      ignored it: eps was added outside the square root).

    DeepSpeed's optimizer state (checkpoints) does not carry over: start the onebit optimizer
    from the model weights.

    Args:
        config: a DeepSpeed config (a dict, or the path of its JSON file).
        params: parameters or param groups, as for the optimizer's constructor.
        **overrides: passed to the constructor last (e.g. ``group=``, ``clip_update=``,
            ``bias_correction=True``).

    Returns:
        The optimizer, built.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> config = {"optimizer": {"type": "OneBitAdam",
        ...                         "params": {"lr": 1e-3, "freeze_step": 400}},
        ...           "gradient_clipping": 1.0}
        >>> opt = onebit.from_deepspeed_config(config, model.parameters())
        >>> type(opt).__name__, opt.max_grad_norm, opt.bias_correction
        ('OnebitAdam', 1.0, False)
    """
    cfg = _load(config)
    block = cfg.get("optimizer")
    if not isinstance(block, Mapping) or "type" not in block:
        raise ValueError("the DeepSpeed config has no 'optimizer' block with a 'type'")
    kind = str(block["type"])
    if kind.lower() not in _TYPES:
        raise ValueError(f"optimizer type {kind!r} is not OneBitAdam, OneBitLamb or ZeroOneAdam (not a 1-bit "
                         "optimizer: use torch.optim)")
    cls, names = _TYPES[kind.lower()]
    given = dict(block.get("params", {}))
    unknown = sorted(set(given) - set(names) - set(_HANDLED))
    if unknown:
        raise ValueError(f"DeepSpeed {kind} has no argument(s) {unknown} (known: {sorted(names + _HANDLED)})")
    if given.get("amsgrad"):
        raise ValueError(f"amsgrad=true: {kind} has no AMSGrad variant (DeepSpeed refused it too)")
    if given.get("eps_inside_sqrt"):
        raise ValueError("eps_inside_sqrt=true: DeepSpeed's 1-bit optimizers ignored it (eps is added outside the "
                         "square root, as here); remove it")
    if given.get("cuda_aware"):
        raise ValueError("cuda_aware=true does not apply: onebit hands CUDA tensors to NCCL or MPI as they are; "
                         "remove it (and use comm_backend_name 'mpi' for MPI)")
    if given.get("max_grad_norm"):
        raise ValueError(f"optimizer max_grad_norm={given['max_grad_norm']}: DeepSpeed's {kind} stored it and never "
                         "clipped with it; use the top-level 'gradient_clipping' (which is what clipped)")
    backend = given.get("comm_backend_name", "nccl")
    if backend not in ("nccl", "compressed", "mpi"):
        raise ValueError(f"comm_backend_name {backend!r} is not supported: use 'nccl' or 'compressed' (the default "
                         "process group) or 'mpi'")
    kwargs: dict[str, Any] = {name: given[name] for name in names if name in given}
    if "freeze_step" in names:
        kwargs.setdefault("freeze_step", _FREEZE_DEFAULT)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if cls in _UNCORRECTED:
        kwargs["bias_correction"] = False
    if cls is OnebitAdam:  # DeepSpeed's variance stays frozen from freeze_step on
        kwargs["refresh_every"] = None
    if cls is ZeroOneAdam:  # DeepSpeed's refreshes thin out without bound, each one step's weight
        kwargs.update(max_refresh_interval=None, refresh_weight="refresh")
    kwargs["group"] = "mpi" if backend == "mpi" else None
    clipping = cfg.get("gradient_clipping", _CLIPPING_DEFAULT)
    if "gradient_clipping" not in cfg and "max_grad_norm" not in overrides:
        warnings.warn(f"the DeepSpeed config has no 'gradient_clipping': clipping at {_CLIPPING_DEFAULT}, DeepSpeed "
                      "0.19.3-0.19.6's default; releases before 0.19.3 did not clip (set \"gradient_clipping\": 0 to "
                      "train as they did, or give it explicitly to silence this)", stacklevel=2)
    if clipping:
        kwargs["max_grad_norm"] = clipping
    kwargs.update(overrides)
    _log.info("from DeepSpeed %s: %s(%s)", kind, cls.__name__, ", ".join(f"{k}={v!r}" for k, v in kwargs.items()))
    return cls(params, **kwargs)
