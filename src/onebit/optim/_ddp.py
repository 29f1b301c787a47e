"""Onebit optimizers on DDP-wrapped models: DDP keeps its bookkeeping, the optimizer communicates.

DDP all-reduces every gradient in fp32 during backward. An onebit optimizer exchanges the
gradients (warm-up) or the momentum (compression stage) itself in ``step()``, so on a
DDP-wrapped model DDP's all-reduce must be switched off -- on every step, since the
optimizer communicates on every step. DDP's documented way to replace its all-reduce is a
communication hook: :func:`local_gradient_hook` sends nothing and hands each bucket back
unchanged, so after backward every rank holds its own local gradient, as without DDP.
DDP's logging data (``_get_ddp_logging_data()["comm_hook"]``) then names this hook.
"""

# No ``from __future__ import annotations``: DDP compares a hook's annotations with the real
# ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
import gc
import logging
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

__all__ = ["attach", "attach_ddp", "check_ddp", "ddp_modules_holding", "has_local_gradient_hook", "local_gradient_hook",
           "register_local_gradient_hook"]

_log = logging.getLogger("onebit.optim")


def local_gradient_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook that communicates nothing: the bucket's local gradients come back as they
    are (DDP does not pre-divide them), for an onebit optimizer to exchange in ``step()``."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def ddp_modules_holding(params: Iterable[Tensor]) -> list[DistributedDataParallel]:
    """The live ``DistributedDataParallel`` modules that hold any of ``params``.

    DDP does not mark the parameters it reduces, so the DDP modules are found among the
    live objects (one pass over the garbage collector's list: milliseconds, done at
    construction and at the first step, not per step).
    """
    ids = {id(p) for p in params}
    # isinstance() against DDP goes through ABCMeta (DDP is a Joinable): ~1 us per object,
    # 0.4 s for a process's ~400k objects; a set lookup of the exact type is ~30x cheaper.
    kinds, todo = set(), [DistributedDataParallel]
    while todo:
        kind = todo.pop()
        kinds.add(kind)
        todo += kind.__subclasses__()
    return [obj for obj in gc.get_objects()
            if type(obj) in kinds and any(id(p) in ids for p in obj.module.parameters())]


def has_local_gradient_hook(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` carries :func:`local_gradient_hook`."""
    return any(hook is local_gradient_hook for hook, _ in getattr(ddp, "_comm_hooks", []))


def register_local_gradient_hook(ddp: DistributedDataParallel, owner: str) -> None:
    """Register :func:`local_gradient_hook` on ``ddp`` (once); refuse a DDP that has another hook."""
    if has_local_gradient_hook(ddp):
        return
    others = [getattr(hook, "__qualname__", repr(hook)) for hook, _ in getattr(ddp, "_comm_hooks", [])]
    if others:
        raise ValueError(
            f"the DistributedDataParallel model already has the comm hook {others[0]}: {owner} exchanges the "
            "gradients itself and DDP takes one hook only; remove that hook, or keep it with a torch.optim optimizer"
        )
    try:
        ddp.register_comm_hook(None, local_gradient_hook)
    except RuntimeError as exc:  # a built-in hook (fp16 compression, ...) was registered in C++
        raise ValueError(f"cannot switch off the DDP all-reduce for {owner}: {exc}") from None


def attach_ddp(params: Iterable[Tensor], owner: str,
               model: Optional[DistributedDataParallel] = None) -> list[DistributedDataParallel]:
    """Register :func:`local_gradient_hook` on ``model`` (default: every DDP module holding
    ``params``, the parameters of optimizer ``owner``); the DDP modules now carrying it."""
    params = list(params)
    found = ddp_modules_holding(params)
    if model is not None:
        if not any(ddp is model for ddp in found):
            raise ValueError(f"the DistributedDataParallel model holds none of {owner}'s parameters")
        found = [model]
    for ddp in found:
        register_local_gradient_hook(ddp, owner)
    return found


def check_ddp(params: Iterable[Tensor], owner: str, world_size: int, construction: bool) -> bool:
    """A DDP module holding ``params`` (of optimizer ``owner``) gets :func:`local_gradient_hook`
    at construction (DDP's fp32 all-reduce would otherwise run before the optimizer's exchange,
    and nothing would be saved); one found at the first step without it raises, because DDP
    takes a hook only before its first backward, which has run by then. Returns whether one was
    found at construction."""
    if world_size == 1:
        return False
    params = list(params)
    if construction:
        if attach_ddp(params, owner):
            _log.info("%s: DDP's gradient all-reduce switched off (local_gradient_hook); the optimizer "
                      "exchanges in step()", owner)
            return True
        return False
    if not all(has_local_gradient_hook(ddp) for ddp in ddp_modules_holding(params)):
        raise ValueError(
            f"the parameters of {owner} belong to a DistributedDataParallel model wrapped after "
            f"the optimizer was built: DDP all-reduced the gradients in fp32 and {owner} would "
            "exchange them again, saving nothing. Call onebit.attach(optimizer) after wrapping the model "
            "and before the first backward (Accelerate: after accelerator.prepare; HF Trainer: "
            "callbacks=[onebit.integrations.transformers.AttachCallback()]), or build the optimizer after wrapping"
        )
    return False


def attach(optimizer: object, model: Optional[DistributedDataParallel] = None) -> list[DistributedDataParallel]:
    """Switch off DDP's gradient all-reduce for an onebit optimizer: call it after wrapping the
    model in DDP and before the first backward.

    DDP would all-reduce the gradients in fp32 and the optimizer exchange them again, saving
    nothing; the hook registered here leaves each rank its own gradient. An optimizer built on
    a model that is already wrapped does this itself at construction.

    Args:
        optimizer: an onebit optimizer or a trainer's wrapper around one (Accelerate's
            ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``: their ``optimizer`` /
            ``_optimizer`` is followed).
        model: the DDP module (``None``: every live DDP module holding the optimizer's
            parameters).

    Returns:
        The DDP modules now carrying the hook.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.OnebitAdam(model.parameters(), lr=1e-3)
        >>> # init_process_group(...); ddp = DistributedDataParallel(model)
        >>> onebit.attach(opt)  # no DDP module holds these parameters: nothing to do
        []
    """
    inner = optimizer
    while inner is not None and not hasattr(inner, "attach_ddp"):
        inner = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
    if inner is None:
        raise TypeError(f"optimizer must be an onebit optimizer (or a wrapper around one), got "
                        f"{type(optimizer).__name__}")
    if model is not None and not isinstance(model, DistributedDataParallel):
        raise TypeError(f"model must be a DistributedDataParallel module, got {type(model).__name__}")
    return inner.attach_ddp(model)
