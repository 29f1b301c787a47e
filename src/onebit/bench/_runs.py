"""What ``onebit train --optimizer NAME`` builds: the model wrapper, the optimizer, and how to read its stage.

onebit's optimizers average across ranks themselves (no DDP; the ``*_overlap`` variants start
each bucket's exchange during backward); ``local_adam`` exchanges nothing (the compute
floor of the same ranks); the ``ddp_*`` peers are
PyTorch DDP with its own hooks (plain all-reduce, ``fp16_compress_hook``,
``powerSGD_hook``) or with onebit's hooks. DDP's traffic is counted by thin wrappers
around the hooks that add each bucket's bytes to the meter before delegating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from .. import comm, hooks
from ..optim import REGISTRY, CompAMS, OnebitLamb, make_optimizer
from ._catalogue import BENCHMARKED

__all__ = ["NO_COMMUNICATION", "OPTIMIZERS", "REFRESH_DTYPES", "Run", "build_run"]

_log = logging.getLogger(__name__)

# The references (uncompressed, as users run them), every optimizer of the registry and its
# overlapped exchange where it has one, and DDP with its communication hooks.
OPTIMIZERS = (
    "adam",
    "local_adam",
    "lamb",
    "amsgrad",
    *(variant for name, spec in REGISTRY.items() for variant in (name, f"{name}_overlap")[: 1 + spec.overlap]),
    "ddp_allreduce",
    "ddp_fp16",
    "ddp_powersgd",
    "ddp_ef_sign",
    "ddp_birder",
)

# The compute floor: each rank steps Adam on its own gradients and nothing is exchanged, so
# its replicas drift apart by design (the end-of-run replica check does not apply).
NO_COMMUNICATION = "local_adam"
# 1-bit Adam's refresh_dtype, as the lab names it (TrainConfig.refresh_dtype, --refresh-dtype)
REFRESH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# DDP hooks compress from this iteration on (DDP rebuilds its buckets after the first).
_HOOK_START = 2


@dataclass
class Run:
    """The module to call, its optimizer, and the stage / freeze step of the step just taken."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    stage: Callable[[], str]
    freeze_step: Callable[[], int | None]
    hook_state: Any = None
    # Fraction of the last step's exchange that ran alongside backward (overlapped optimizers).
    overlap: Callable[[], float | None] = lambda: None
    # What freeze_step="auto" waits on (stats["variance_ratio"]; None without the criterion).
    variance_ratio: Callable[[], float | None] = lambda: None


def _ring(world: int, nbytes: int) -> int:
    return 2 * (world - 1) * nbytes // world


class _AllReduceAdam(torch.optim.Adam):
    """Data-parallel Adam: one fp32 all-reduce of all gradients (a single DDP-style bucket)."""

    def __init__(self, params, lr: float, group: comm.Group = None) -> None:
        super().__init__(params, lr=lr)
        self.group = group

    def step(self, closure=None):  # type: ignore[override]
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_mean(flat, self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return super().step(closure)


def _allreduce_bytes(state, bucket) -> int:
    buf = bucket.buffer()
    return _ring(dist.get_world_size(state), buf.numel() * buf.element_size())


def _fp16_bytes(state, bucket) -> int:
    return _ring(dist.get_world_size(state), bucket.buffer().numel() * 2)


def _powersgd_bytes(state: powerSGD_hook.PowerSGDState, bucket) -> int:
    """What ``powerSGD_hook`` all-reduces for this bucket: the uncompressed tensors, then P, then Q."""
    world = dist.get_world_size(state.process_group)
    if state.iter < state.start_powerSGD_iter:
        return _ring(world, bucket.buffer().numel() * 4)
    rank = state.matrix_approximation_rank
    plain = p_numel = q_numel = 0
    for grad in bucket.gradients():
        rows = grad.shape[0] if grad.dim() > 1 else 0
        cols = grad.numel() // rows if rows else 0
        if rows and powerSGD_hook._should_compress(rows, cols, rank, state.min_compression_rate)[0]:
            p_numel += rows * min(rows, cols, rank)
            q_numel += cols * min(rows, cols, rank)
        else:
            plain += grad.numel()
    return sum(_ring(world, 4 * n) for n in (plain, p_numel, q_numel) if n)


def _metered(hook, count, op: str):
    """``hook`` with its bytes recorded first (DDP checks the parameter is named ``bucket``)."""

    def metered_hook(state, bucket):
        comm.record(op, count(state, bucket))
        return hook(state, bucket)

    return metered_hook


def _ddp_run(name: str, model: nn.Module, cfg, per_node: int | None) -> Run:
    ddp = DistributedDataParallel(model, **({} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}))
    exchange = {"hierarchical": cfg.hierarchical, "ranks_per_node": per_node}
    state: Any = None
    if name == "ddp_allreduce":
        ddp.register_comm_hook(None, _metered(default_hooks.allreduce_hook, _allreduce_bytes, "ddp_allreduce"))
    elif name == "ddp_fp16":
        ddp.register_comm_hook(None, _metered(default_hooks.fp16_compress_hook, _fp16_bytes, "ddp_fp16"))
    elif name == "ddp_powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=_HOOK_START)
        ddp.register_comm_hook(state, _metered(powerSGD_hook.powerSGD_hook, _powersgd_bytes, "ddp_powersgd"))
    elif name == "ddp_ef_sign":
        state = hooks.ErrorFeedbackState(start_iter=_HOOK_START, **exchange)
        ddp.register_comm_hook(state, hooks.error_feedback_hook)
    else:
        state = hooks.BirderState(seed=cfg.seed, start_iter=_HOOK_START, **exchange)
        ddp.register_comm_hook(state, hooks.birder_hook)
    if name == "ddp_birder":
        # Birder's step is x <- x (1 - lr wd) - lr u_bar: plain SGD on the hook's output.
        opt: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=cfg.lr)
    compressing = name in ("ddp_fp16",)

    def stage() -> str:
        if compressing:
            return "compressed"
        if state is None:
            return "warmup"
        # The hook state counts iterations already finished; this step was number iter.
        it = state.iter - 1
        start = getattr(state, "start_powerSGD_iter", None) or getattr(state, "start_iter", _HOOK_START)
        return "compressed" if it >= start else "warmup"

    return Run(ddp, opt, stage, lambda: None, state)


def _registry_optimizer(name: str, params, cfg, exchange: dict[str, Any]) -> torch.optim.Optimizer:
    """Registry optimizer ``name`` (``<name>_overlap``: its overlapped exchange) with the options of
    ``cfg`` it takes."""
    overlap = name.endswith("_overlap")
    spec = REGISTRY[name.removesuffix("_overlap")]
    kw: dict[str, Any] = {"lr": cfg.lr, "group": exchange["group"]}
    if spec.hierarchical:
        kw.update(exchange)
    if overlap:  # the others keep the optimizer's default (1-bit Adam's and LAMB's: the warm-up during backward)
        kw["overlap"] = True
        if cfg.bucket_cap_mb is not None:
            kw["bucket_cap_mb"] = cfg.bucket_cap_mb
    # a freeze step set by hand ("auto", 1-bit Adam's and LAMB's default, leaves each one its own)
    if spec.freeze is not None and isinstance(cfg.freeze_step, int):
        kw.update(spec.freeze(cfg.freeze_step))
    if spec.seeded:
        kw["seed"] = cfg.seed
    # the training options it takes (the lab's table): Adam's bias correction, Top-k's ratio, QAdam's bits, ...
    options = BENCHMARKED[name.removesuffix("_overlap")].options
    kw.update({arg: getattr(cfg, option) for option, arg in options.items() if getattr(cfg, option) is not None})
    if kw.get("refresh_every") == "never":  # 1-bit Adam's frozen variance, never refreshed (Algorithm 1)
        kw["refresh_every"] = None
    if "refresh_dtype" in kw:
        kw["refresh_dtype"] = REFRESH_DTYPES[kw["refresh_dtype"]]
    if kw.pop("refresh_schedule", None) == "paper":  # 0/1 Adam's refreshes as Algorithm 1 and DeepSpeed
        kw.update(max_refresh_interval=None, refresh_weight="refresh")
    return make_optimizer(name.removesuffix("_overlap"), params, **kw)


def build_run(name: str, model: nn.Module, cfg, per_node: int | None) -> Run:
    """The model wrapper and optimizer of ``name`` for ``cfg`` (a :class:`TrainConfig`)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(OPTIMIZERS)}")
    if name.startswith("ddp_"):
        return _ddp_run(name, model, cfg, per_node)
    params = model.parameters()
    group = cfg.backend
    # What the optimizers with a choice of flat or hierarchical exchange share.
    exchange = {"hierarchical": cfg.hierarchical, "ranks_per_node": per_node, "group": group}
    if name == "adam":
        for p in model.parameters():
            comm.broadcast(p.data, 0, group)
        opt: torch.optim.Optimizer = _AllReduceAdam(params, lr=cfg.lr, group=group)
    elif name == NO_COMMUNICATION:
        opt = torch.optim.Adam(params, lr=cfg.lr)
    elif name == "lamb":  # 1-bit LAMB that never leaves its warm-up: exact LAMB on all-reduced gradients
        opt = OnebitLamb(params, lr=cfg.lr, freeze_step=cfg.steps + 1, **exchange)
    elif name == "amsgrad":
        # Comp-AMS's reference: the same AMSGrad, uncompressed (its bias correction as Comp-AMS's)
        opt = CompAMS(params, lr=cfg.lr, compressor="none", group=group,
                      **({} if cfg.bias_correction is None else {"bias_correction": cfg.bias_correction}))
    else:
        opt = _registry_optimizer(name, params, cfg, exchange)
    if name in ("adam", NO_COMMUNICATION):
        return Run(model, opt, lambda: "warmup", lambda: None)
    # (DiLoCo has no warm-up to freeze nor its criterion)
    return Run(model, opt, lambda: opt.stats["stage"], lambda: opt.stats.get("freeze_step"),
               overlap=lambda: opt.stats.get("overlap"), variance_ratio=lambda: opt.stats.get("variance_ratio"))
