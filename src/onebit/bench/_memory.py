"""``onebit bench memory``: what each optimizer holds, against what its algorithm needs.

Three figures per optimizer, world size and stage, all measured while stepping a model:

* **held** -- bytes of every tensor the optimizer object keeps between steps (its state,
  its collectives' error and wire buffers), found by walking its attributes; parameters
  and gradients are the model's and are not counted; views count once per storage;
* **peak** -- the process's peak resident memory during the steps, above what it held
  before the optimizer was built (model, gradients and data already there): the held
  state plus whatever a step allocates and frees;
* on CUDA, ``torch.cuda.max_memory_allocated`` during the steps, above the same baseline.

All three are multiples of the fp32 model size (4 bytes per parameter value), the unit of
the algorithms' footprints in :data:`FOOTPRINTS`. With ``shards`` > 1 the model is sharded by
FSDP2 over that many ranks of each node (HSDP with the 1-bit exchange between the nodes,
``w / shards`` replicas): the figures are then in fp32 *shard* sizes, against the footprint at
the number of replicas.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..comm import all_reduce_mean
from ..launch import spawn
from ..optim import REGISTRY, make_optimizer

__all__ = ["FOOTPRINTS", "WIRE_ALLOWANCE", "MemoryResult", "bench_memory", "held_bytes"]

# What each algorithm itself keeps, in fp32 model sizes, at world size w: the registry's
# footprints, and torch.optim.AdamW's m and v for reference.
FOOTPRINTS: dict[str, Callable[[int], float]] = {"adamw": lambda w: 2.0,
                                                  **{name: spec.footprint for name, spec in REGISTRY.items()}}
# Packed wire buffers on top of the footprint: 1-bit payloads are n/8 bytes (1/32 of the fp32
# model) each way, plus one scale per chunk or block and one scalar per tensor.
WIRE_ALLOWANCE = 0.1

_MODULES = ("onebit.", "torch.optim")


def _storage(tensor: Tensor) -> Any:
    """The storage holding ``tensor``'s values: a DTensor's (FSDP2's) is its local shard's."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).untyped_storage()


def held_bytes(optimizer: object, modules: tuple[str, ...] = _MODULES) -> int:
    """Bytes of the tensor storages reachable from ``optimizer``'s attributes, each storage
    once, leaving out its parameters' and their gradients' storages.

    The walk descends into containers and into objects of the classes of ``modules`` (by
    default onebit's and ``torch.optim``'s: the optimizer, its collectives, compressors,
    error buffers), not into process groups, loggers or modules.
    """
    params = [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]
    skip = {_storage(t).data_ptr() for p in params for t in (p, p.grad) if t is not None}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    todo: list[Any] = [optimizer]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            storage = _storage(obj)
            if storage.data_ptr() not in skip:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo.extend(obj)
        elif type(obj).__module__.startswith(modules):
            todo.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            for cls in type(obj).__mro__:
                todo.extend(getattr(obj, s) for s in getattr(cls, "__slots__", ()) if hasattr(obj, s))
    return sum(storages.values())


@dataclass(frozen=True)
class MemoryResult:
    optimizer: str
    world_size: int
    shards: int  # ranks of a node sharing the model (FSDP2); 1: the model is whole on every rank
    stage: str  # "warmup" or "compressed" (the steps after the freeze; every step for the others)
    held: float  # most held between steps, in fp32 model sizes
    footprint: float  # the algorithm's own (FOOTPRINTS)
    peak: float | None  # peak resident memory during the steps above the baseline, fp32 model sizes
    cuda_peak: float | None  # torch.cuda.max_memory_allocated above the baseline, fp32 model sizes


def _build(name: str, params: list[nn.Parameter], freeze: int, group: Any = None) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params)
    spec = REGISTRY[name]
    return make_optimizer(name, params, group=group, **(spec.freeze(freeze) if spec.freeze is not None else {}))


def _model(size: int, dev: torch.device, world: int, shards: int) -> tuple[nn.Module, Any]:
    """``nn.Linear(size, size)``, and the optimizer's group: with ``shards`` > 1 the model is
    sharded by FSDP2 inside each node and the group is the replicas of this rank's shard."""
    model = nn.Linear(size, size).to(dev)
    if shards == 1:
        return model, None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh["shard"])
    return model, mesh["replicate"].get_group()


def _resident() -> tuple[int, int]:
    """(current, peak) resident bytes of this process (Linux ``/proc``; zeros elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return 0, 0
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> bool:
    """Restart the kernel's peak-RSS counter (``clear_refs`` 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _train(name: str, size: int, steps: int, freeze: int, world: int, rank: int, dev: torch.device,
           shards: int = 1, before_build: Callable[[], None] = lambda: None,
           after_step: Callable[[torch.optim.Optimizer], None] = lambda opt: None) -> None:
    """``steps`` steps of optimizer ``name`` on an ``nn.Linear(size, size)``; the first backward
    runs before the optimizer is built, as in training, so gradients are there already."""
    model, group = _model(size, dev, world, shards)
    x = torch.randn(8, size, generator=torch.Generator().manual_seed(rank)).to(dev)
    model(x).square().mean().backward()
    before_build()
    opt = _build(name, list(model.parameters()), freeze, group)
    for _ in range(steps):
        if name == "adamw" and world > shards:  # what DDP (or HSDP) does for it: average the gradients
            for p in model.parameters():
                grad = p.grad.to_local() if shards > 1 else p.grad
                all_reduce_mean(grad, group=group)
        opt.step()
        after_step(opt)
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()


def _rank_memory(rank: int, world: int, name: str, size: int, steps: int, freeze: int,
                 device: str, shards: int) -> list[dict[str, Any]]:
    dev = torch.device(device)
    _train(name, 8, steps, freeze, world, rank, dev, shards)  # load code and kernels before measuring
    gc.collect()
    baseline: dict[str, Any] = {}
    held = {"warmup": 0, "compressed": 0}

    def before_build() -> None:
        baseline["rss"] = _resident()[0]
        baseline["peak_ok"] = _reset_peak()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            baseline["cuda"] = torch.cuda.memory_allocated(dev)

    def after_step(opt: torch.optim.Optimizer) -> None:
        stage = "warmup" if getattr(opt, "stats", {}).get("stage") == "warmup" else "compressed"
        held[stage] = max(held[stage], held_bytes(opt))

    _train(name, size, steps, freeze, world, rank, dev, shards, before_build, after_step)
    model_bytes = 4 * (size * size + size) / shards  # FSDP2's shards are even here: size % shards == 0
    peak = (_resident()[1] - baseline["rss"]) / model_bytes if baseline["peak_ok"] else None
    cuda_peak = None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        cuda_peak = (torch.cuda.max_memory_allocated(dev) - baseline["cuda"]) / model_bytes
    return [{"optimizer": name, "world_size": world, "shards": shards, "stage": stage, "held": nbytes / model_bytes,
             "footprint": FOOTPRINTS[name](world // shards), "peak": peak, "cuda_peak": cuda_peak}
            for stage, nbytes in held.items() if nbytes]


def bench_memory(names: tuple[str, ...], world_sizes: list[int], *, size: int = 2048, steps: int = 4,
                 freeze: int = 2, device: str = "cpu", shards: int = 1) -> list[MemoryResult]:
    """Step an ``nn.Linear(size, size)`` ``steps`` times with each optimizer (1-bit Adam and
    LAMB freeze after step ``freeze``) on each world size of gloo ranks, the model sharded by
    FSDP2 over ``shards`` ranks of each node when ``shards`` > 1; every rank measures, the
    largest figure over ranks is reported."""
    unknown = [n for n in names if n not in FOOTPRINTS]
    if unknown:
        raise ValueError(f"unknown optimizers {unknown}; available: {', '.join(FOOTPRINTS)}")
    if shards > 1 and (size % shards or any(w % shards or w == shards for w in world_sizes)):
        raise ValueError(f"Invalid shards value: {shards} (every world size must be a multiple of it, with two "
                         f"replicas or more, and the model's size {size} too; world sizes {world_sizes})")
    results = []
    for world in world_sizes:
        for name in names:  # a fresh process each: peak resident memory is a per-process high-water mark
            per_rank = spawn(_rank_memory, world, name, size, steps, freeze, device, shards)
            for i, row in enumerate(per_rank[0]):
                worst = {k: max((r[i][k] for r in per_rank if r[i][k] is not None), default=None)
                         for k in ("held", "peak", "cuda_peak")}
                results.append(MemoryResult(**{**row, **worst}))
    return results
