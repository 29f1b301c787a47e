"""What the ranks agree on before and after a step: finite gradients, and identical replicas."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .. import comm

if TYPE_CHECKING:
    from ._base import OnebitOptimizer

__all__ = ["check_own_parameters", "check_replicas", "parameter_sums", "start_agreement"]

_log = logging.getLogger("onebit.optim")


def start_agreement(opt: OnebitOptimizer, *, everywhere: bool = True,
                    stale: bool = False) -> Callable[[], tuple[bool, list[bool], bool]]:
    """Unscale (GradScaler), then launch one tiny all-reduce(max) of "some gradient here is not
    finite", of "parameter i has a gradient here" (``opt._present()``; :func:`onebit.comm.nonfinite`,
    :func:`onebit.comm.agree`: the skipped step's one mechanism, the DDP hooks' too) and of
    ``stale`` (the warm-up's buckets sent during backward are stale here); returns what
    waits for it and says whether every rank skips the step, which parameters have a gradient
    on some rank and whether some rank was stale -- the collectives issued in between leave behind it. Raises
    ``FloatingPointError`` instead of skipping with ``on_nonfinite="raise"``. ``everywhere=False``
    (a step that sends nothing): only the ranks sharing FSDP2 shards agree, inside their node, and
    without shards each rank decides alone, with no collective."""
    params = opt.flat.params
    grads = [p.grad for p in params if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise ValueError("onebit optimizers do not support sparse gradients")
    scale = getattr(opt, "grad_scale", None)
    if scale is not None and grads:
        torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
    # flag[0]: some gradient here is not finite; flag[1 + i]: parameter i has a gradient here; the
    # last: this rank's warm-up buckets are stale.
    flag = torch.zeros(2 + len(params), dtype=torch.float32, device=opt.flat.device)
    flag[0] = comm.nonfinite(grads, opt.flat.device)
    present = opt._present()
    if all(present):
        flag[1:-1] = 1.0  # the common case, without a host-to-device copy
    else:
        flag[1:-1] = torch.tensor(present, dtype=torch.float32)
    if stale:
        flag[-1] = 1.0
    found_inf = getattr(opt, "found_inf", None)
    if found_inf is not None:
        flag[0] = torch.maximum(flag[0], found_inf.reshape(()).to(flag))
    # Over the whole job where the parameters are FSDP2 shards: every shard takes the same steps.
    group = opt._shards.agreement_group if everywhere else opt._shards.shard_group
    pending = comm.agree(flag, group, opt.timeout, async_op=True) if everywhere or group is not None else None

    def result() -> tuple[bool, list[bool], bool]:
        values = flag.tolist() if pending is None else pending.wait().tolist()
        active, stale_anywhere = [v > 0 for v in values[1:-1]], values[-1] > 0
        if not values[0]:
            return False, active, stale_anywhere
        step = opt._step_count + 1
        if opt.on_nonfinite == "raise":
            local = [i for i, p in enumerate(params) if p.grad is not None and not torch.isfinite(p.grad).all()]
            where = f"parameter {local[0]} (shape {tuple(params[local[0]].shape)}) on rank {opt.rank}" if local \
                else f"another rank than {opt.rank}"
            raise FloatingPointError(f"non-finite gradient at step {step}: {where}")
        where = "every rank" if everywhere else f"rank {opt.rank}"
        _log.warning("step %d skipped on %s: non-finite gradient", step, where)
        return True, active, stale_anywhere

    return result


def check_replicas(opt: OnebitOptimizer, tensors: Sequence[Tensor] | None = None) -> str | None:
    """Which parameter differs between ranks after the last step, as a message (None: none);
    ``tensors``: compare these, one per parameter, instead of the parameters.

    Each parameter's bits, read as integers, are summed on its device, and the sums (8 bytes
    per parameter) are all-gathered -- any single-value difference shows.
    """
    if opt.world_size == 1:
        return None
    params = opt.flat.params if tensors is None else tensors
    table = comm.all_gather_object_sizes(parameter_sums(params), opt.process_group, opt.timeout, opt.flat.device)
    differs = (table != table[0]).any(dim=0).nonzero()
    if not differs.numel():
        return None
    i = int(differs[0])
    ranks = [r for r in range(opt.world_size) if table[r, i] != table[0, i]]
    return f"replicas differ after step {opt._step_count}: {_name(opt, i, params)} on ranks {ranks} differs from rank 0"


def parameter_sums(params: Sequence[Tensor]) -> list[int]:
    """Each tensor's bits, read as integers, summed on its device: any single-value change shows."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return torch.stack([p.detach().reshape(-1).view(ints[p.element_size()]).sum(dtype=torch.int64)
                        for p in params]).tolist()


def check_own_parameters(opt: OnebitOptimizer, saved: Sequence[int]) -> str | None:
    """Which rank's parameters are not those it saved with its optimizer state (``saved``: their
    :func:`parameter_sums`), as a message (None: every rank's are); one all-reduce, so that every
    rank raises alike. Between synchronisations each rank holds its own parameters (DiLoCo's
    inner steps, fragments or merge; 0/1 Adam's local steps) and its optimizer state is only
    right beside them: rank 0's model, or the one :meth:`~onebit.DiLoCo.anchored` gives, loaded
    on every rank resumes another run without a word from the replica check, whose anchors agree."""
    differs = [i for i, (now, then) in enumerate(zip(parameter_sums(opt.flat.params), saved)) if now != then]
    flags = torch.zeros(opt.world_size, dtype=torch.float32, device=opt.flat.device)
    flags[opt.rank] = 1.0 if differs else 0.0
    ranks = [r for r, v in enumerate(comm.agree(flags, opt.process_group, opt.timeout)) if v]
    if not ranks:
        return None
    here = f" (here, {_name(opt, differs[0], opt.flat.params)} first)" if differs else ""
    return (f"the parameters of ranks {ranks} are not those each saved with its {type(opt).__name__} state at step "
            f"{opt._step_count}{here}: between synchronisations every rank holds its own, so each rank must load "
            "the model state it saved itself (not rank 0's, nor the one taken inside anchored())")


def _name(opt: OnebitOptimizer, i: int, params: Sequence[Tensor]) -> str:
    names = [n for g in opt.param_groups for n in g.get("param_names", [None] * len(g["params"]))]
    return names[i] or f"parameter {i} (shape {tuple(params[i].shape)})"
