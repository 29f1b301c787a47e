"""What every onebit optimizer does on construction and around its step, as helpers that take values.

The 1-bit family's base (:class:`~onebit.optim.OnebitOptimizer`) and :class:`~onebit.DiLoCo`
are built apart; what both must do alike -- refuse bad options and parameters, start every
rank from rank 0's parameters, clip a rank's own gradients -- is here.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .. import comm
from .._checks import COMMON_OPTIONS, check_betas, check_nonneg, check_optional_positive
from ._flat import FlatState
from ._shards import Shards

__all__ = ["broadcast_parameters", "check_groups", "check_params", "check_same_parameters_everywhere", "clip_",
           "clip_coef", "closure_loss", "common_options", "place"]


def common_options(options: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """The :class:`onebit.optim.CommonOptions` given, validated, with the defaults of those not given."""
    unknown = sorted(set(options) - set(COMMON_OPTIONS))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    options = {**COMMON_OPTIONS, **options}
    if options["on_nonfinite"] not in ("skip", "raise"):
        raise ValueError(f"Invalid on_nonfinite value: {options['on_nonfinite']!r} (expected 'skip' or 'raise')")
    check_every = options["check_replicas_every"]
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
        raise ValueError(f"Invalid check_replicas_every value: {check_every!r} (expected an int >= 0)")
    options["max_grad_norm"] = check_optional_positive("max_grad_norm", options["max_grad_norm"])
    options["timeout"] = comm.to_timedelta(options["timeout"])
    return options


def check_groups(param_groups: Sequence[Mapping[str, Any]], defaults: Mapping[str, Any], cls: type) -> None:
    """Param groups may override the defaults: validate what each group will use. A constructor
    option of ``cls`` that is not per-group (eps, say) given in a group would be ignored: refuse it."""
    signature = set(inspect.signature(cls.__init__).parameters) | set(COMMON_OPTIONS)
    global_only = signature - set(defaults) - {"self", "params", "options"}
    for i, g in enumerate(param_groups):
        ignored = sorted(global_only & set(g))
        if ignored:
            raise ValueError(f"param group {i} sets {ignored}, which {cls.__name__} takes only for all "
                             f"parameters (per-group options: {sorted(defaults)})")
        if "lr" in g:
            check_nonneg("learning rate", g["lr"])
        if "betas" in g:
            check_betas(g["betas"])
        if "weight_decay" in g:
            check_nonneg("weight_decay", g["weight_decay"])


def place(param_groups: Sequence[Mapping[str, Any]], group: comm.Group, timeout: timedelta, owner: str, *,
          max_grad_norm: float | None, broadcast: bool, replicate: bool = True) -> tuple[Shards, FlatState]:
    """What each rank updates -- the parameters, or their FSDP2 shards -- checked and laid out in one
    flat state; with ``replicate``, the same everywhere (checked) and, with ``broadcast``, rank 0's.
    ``replicate=False``: a replica whose parameters come from a peer's state later."""
    shards = Shards([p for g in param_groups for p in g["params"]], group, owner, timeout)
    if shards.sharded and max_grad_norm is not None:
        raise ValueError(f"Invalid max_grad_norm value with FSDP2-sharded parameters: {max_grad_norm!r} (the norm "
                         "spans every shard); call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) "
                         "before step() instead")
    params = shards.tensors
    check_params(params)
    if replicate:
        check_same_parameters_everywhere(params, group, timeout)
        if broadcast:
            broadcast_parameters(params, group, timeout)
    return shards, FlatState(params)


def check_params(params: Sequence[Tensor]) -> None:
    """Refuse what the fp32 flat state cannot hold: no parameters, several devices, integer or fp64 ones."""
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    if any(not p.is_floating_point() for p in params):
        raise TypeError("all parameters must be floating-point tensors")
    wide = [tuple(p.shape) for p in params if p.dtype == torch.float64]
    if wide:
        # The state and the math are fp32: an fp64 parameter would be rounded to fp32 every step.
        raise TypeError(f"float64 parameters are not supported (state and updates are fp32), got shapes {wide}; "
                        "use float32, bfloat16 or float16 parameters")


def check_same_parameters_everywhere(params: Sequence[Tensor], group: comm.Group, timeout: timedelta) -> None:
    """Compare parameter count, total size and shapes across ranks with one small all-gather.

    A mismatch would otherwise surface as a hang or a size error deep inside the first
    collective; here every rank raises the same ``ValueError`` at construction.
    """
    if comm.get_world_size(group) == 1:
        return
    shapes = ";".join("x".join(map(str, p.shape)) for p in params)
    mine = [len(params), sum(p.numel() for p in params), zlib.crc32(shapes.encode())]
    table = comm.all_gather_object_sizes(mine, group, timeout, params[0].device)
    if not bool((table == table[0]).all()):
        rows = ", ".join(f"rank {r}: {int(t[0])} tensors / {int(t[1])} values" for r, t in enumerate(table))
        raise ValueError(f"parameters differ across ranks ({rows}; shape checksums {table[:, 2].tolist()})")


@torch.no_grad()
def broadcast_parameters(params: Iterable[Tensor], group: comm.Group, timeout: timedelta) -> None:
    """Rank 0's parameters to every rank of ``group``, in place."""
    for p in params:
        if p.is_contiguous():
            comm.broadcast(p.data, 0, group, timeout)
        else:  # channels_last and other layouts travel in logical order
            buf = p.data.contiguous()
            comm.broadcast(buf, 0, group, timeout)
            p.data.copy_(buf)


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """``closure()`` evaluated with grad enabled (the loss ``step(closure)`` returns); None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def clip_coef(max_grad_norm: float, norm: Tensor) -> Tensor:
    """``min(1, max_grad_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` scales, on the device."""
    return (max_grad_norm / (norm + 1e-6)).clamp_(max=1.0)


@torch.no_grad()
def clip_(grads: Iterable[Tensor | None], max_grad_norm: float | None) -> None:
    """``clip_grad_norm_`` on ``grads`` (a rank's own), in place, the norm taken in fp32 over all of them."""
    present = [g for g in grads if g is not None]
    if max_grad_norm is not None and present:
        coef = clip_coef(max_grad_norm, torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float32) for g in present])))
        for g in present:
            g.mul_(coef)
