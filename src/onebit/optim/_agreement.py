"""What the ranks agree on before and after a step: finite gradients, and identical replicas.

Helpers that take values (the parameters, the group, the step), shared by the 1-bit family's
base and by :class:`~onebit.DiLoCo`, which are built apart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .. import comm

__all__ = ["ReplicaDivergence", "parameter_sums", "require_loaded_alike", "require_replicas", "start_agreement"]

_log = logging.getLogger("onebit.optim")


class ReplicaDivergence(RuntimeError):
    """The ranks' parameters are no longer bit-identical."""


def start_agreement(params: Sequence[Tensor], present: Sequence[bool], group: comm.Group, timeout: timedelta, *,
                    step: int, rank: int, on_nonfinite: str, everywhere: bool = True, scale: Tensor | None = None,
                    found_inf: Tensor | None = None,
                    stale: bool = False) -> Callable[[], tuple[bool, list[bool], bool]]:
    """Unscale (GradScaler's ``scale``), then launch one tiny all-reduce(max) over ``group`` of
    "some gradient here is not finite" (or GradScaler's ``found_inf``), of ``present[i]``
    ("parameter i has a gradient here"; :func:`onebit.comm.nonfinite`, :func:`onebit.comm.agree`:
    the skipped step's one mechanism, the DDP hooks' too) and of ``stale`` (the warm-up's
    buckets sent during backward are stale here); returns what waits for it and says whether
    the ranks skip step ``step``, which parameters have a gradient on some rank and whether
    some rank was stale -- the collectives issued in between leave behind it. Raises
    ``FloatingPointError`` instead of skipping with ``on_nonfinite="raise"``.
    ``everywhere=False`` (a step that sends nothing): ``group`` is the ranks sharing FSDP2
    shards, inside their node, or None: this rank decides alone, with no collective."""
    grads = [p.grad for p in params if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise ValueError("onebit optimizers do not support sparse gradients")
    device = params[0].device
    if scale is not None and grads:
        torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
    # flag[0]: some gradient here is not finite; flag[1 + i]: parameter i has a gradient here; the
    # last: this rank's warm-up buckets are stale.
    flag = torch.zeros(2 + len(params), dtype=torch.float32, device=device)
    flag[0] = comm.nonfinite(grads, device)
    if all(present):
        flag[1:-1] = 1.0  # the common case, without a host-to-device copy
    else:
        flag[1:-1] = torch.tensor(list(present), dtype=torch.float32)
    if stale:
        flag[-1] = 1.0
    if found_inf is not None:
        flag[0] = torch.maximum(flag[0], found_inf.reshape(()).to(flag))
    pending = comm.agree(flag, group, timeout, async_op=True) if everywhere or group is not None else None

    def result() -> tuple[bool, list[bool], bool]:
        values = flag.tolist() if pending is None else pending.wait().tolist()
        active, stale_anywhere = [v > 0 for v in values[1:-1]], values[-1] > 0
        if not values[0]:
            return False, active, stale_anywhere
        if on_nonfinite == "raise":
            local = [i for i, p in enumerate(params) if p.grad is not None and not torch.isfinite(p.grad).all()]
            where = f"parameter {local[0]} (shape {tuple(params[local[0]].shape)}) on rank {rank}" if local \
                else f"another rank than {rank}"
            raise FloatingPointError(f"non-finite gradient at step {step}: {where}")
        _log.warning("step %d skipped on %s: non-finite gradient", step, "every rank" if everywhere else f"rank {rank}")
        return True, active, stale_anywhere

    return result


def parameter_sums(params: Sequence[Tensor]) -> list[int]:
    """Each tensor's bits, read as integers, summed on its device: any single-value change shows."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return torch.stack([p.detach().reshape(-1).view(ints[p.element_size()]).sum(dtype=torch.int64)
                        for p in params]).tolist()


def require_replicas(params: Sequence[Tensor], anchors: Sequence[Tensor] | None, group: comm.Group,
                     timeout: timedelta, *, step: int, param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Raise :class:`ReplicaDivergence` naming the first parameter that differs between the ranks
    of ``group`` after step ``step``: of ``params``, or inside an interval of local steps
    (``anchors`` given: the ranks' parameters differ by design) of the anchors, the parameters
    of the last synchronisation.

    Each tensor's bits, read as integers, are summed on its device, and the sums (8 bytes per
    parameter) are all-gathered -- any single-value difference shows.
    """
    world_size = comm.get_world_size(group)
    if world_size == 1:
        return
    tensors = params if anchors is None else anchors
    table = comm.all_gather_object_sizes(parameter_sums(tensors), group, timeout, tensors[0].device)
    differs = (table != table[0]).any(dim=0).nonzero()
    if not differs.numel():
        return
    i = int(differs[0])
    ranks = [r for r in range(world_size) if table[r, i] != table[0, i]]
    inside = "" if anchors is None else " (the anchors, inside an interval of local steps)"
    raise ReplicaDivergence(f"replicas differ after step {step}: {_name(param_groups, i, tensors)} on ranks {ranks} "
                            f"differs from rank 0{inside}")


def require_loaded_alike(params: Sequence[Tensor], saved: Sequence[int] | None, group: comm.Group,
                         timeout: timedelta, *, step: int, loaded: bool, owner: str,
                         param_groups: Sequence[Mapping[str, Any]]) -> None:
    """At an optimizer's first exchange, fresh or after a load: raise :class:`ReplicaDivergence` on
    every rank unless every rank holds a state of one step -- each loaded a state saved at the
    same ``step`` (``loaded``), or none did -- and, where it was saved between synchronisations
    (``saved``: the :func:`parameter_sums` of the parameters it was saved beside; None: at a
    synchronisation), holds those parameters. One all-reduce over ``group``, run by every rank at
    its first exchange whatever it loaded, so that the ranks issue it alike: a rank that loaded
    nothing while the others loaded (its file missing) runs it too, where it would otherwise pair
    its first collective with theirs (gloo aborts the process on the mismatched sizes).

    States of different steps (one rank's file from another save) ask for different collectives
    from there on -- a stage, an interval or a synchronisation apart: unlike exchanges paired
    without a word (the replicas diverge), or one waited for that the others never issue.
    Between synchronisations each rank holds its own parameters (DiLoCo's inner steps, fragments
    or merge; 0/1 Adam's local steps) and its optimizer state is only right beside them: rank 0's
    model, or the one :meth:`~onebit.DiLoCo.anchored` gives, loaded beside each rank's own state
    resumes another run without a word from the replica check, whose anchors agree. (Rank 0's
    model beside rank 0's state, on every rank, is consistent: each rank goes on as its copy.)"""
    differs = [] if saved is None else [i for i, (now, then) in enumerate(zip(parameter_sums(params), saved))
                                        if now != then]
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    # flags[r]: rank r's parameters are not those saved with its state; flags[world + r]: the step
    # of the state it loaded, -1 where it loaded none. Each rank writes its own entries over the
    # others' lowest value, so the maximum carries every rank's.
    flags = torch.full((2 * world,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=params[0].device)
    flags[rank], flags[world + rank] = int(bool(differs)), step if loaded else -1
    flags = comm.all_reduce_max(flags, group, timeout).tolist()
    steps = flags[world:]
    if len(set(steps)) > 1:
        raise ReplicaDivergence(
            f"the ranks loaded {owner} states saved at different steps ("
            + ", ".join(f"rank {r}: " + (f"step {s}" if s >= 0 else "none loaded") for r, s in enumerate(steps))
            + "): every rank must load its state of one save (onebit.Checkpoints agrees on one)")
    ranks = [r for r, v in enumerate(flags[:world]) if v]
    if ranks:
        here = f" (here, {_name(param_groups, differs[0], params)} first)" if differs else ""
        raise ReplicaDivergence(
            f"the parameters of ranks {ranks} are not those saved with the {owner} state each loaded, at step "
            f"{step}{here}: between synchronisations every rank holds its own, so each rank must load the model "
            "state saved beside the optimizer state it loads (its own: not rank 0's model, nor the one taken inside "
            "anchored())")


def _name(param_groups: Sequence[Mapping[str, Any]], i: int, params: Sequence[Tensor]) -> str:
    """Parameter ``i``'s name (``param_names`` of its group, as ``torch.optim`` keeps them), or its index and shape."""
    names = [n for g in param_groups for n in g.get("param_names", [None] * len(g["params"]))]
    return names[i] or f"parameter {i} (shape {tuple(params[i].shape)})"
