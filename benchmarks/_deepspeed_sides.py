"""The two sides of a comparison with DeepSpeed, on the same task: DeepSpeed 0.19.6's own optimizer
on CPU ranks (``../shared/reference/deepspeed-cpu``, run from its own venv) and
``onebit.from_deepspeed_config`` on the same config."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SIDES = ("deepspeed", "onebit")


def start(side: str) -> Any:
    """Initialise the gloo process group the side's way (one thread per rank); returns the side's
    ``dist`` module."""
    if side == "deepspeed":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference", "deepspeed-cpu"))
        import deepspeed
        import deepspeed.comm as dist
        from ds_cpu import apply_cpu_patches

        apply_cpu_patches()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist


def build(side: str, config: dict[str, Any], model: nn.Module,
          **overrides: Any) -> tuple[torch.optim.Optimizer, nn.Module, Callable[..., None]]:
    """The side's optimizer for ``config`` (onebit's with constructor ``overrides``), the module that
    computes the training loss (DeepSpeed's engine, or ``model``), and ``update(loss, take_step=True)``:
    backward and the step (``take_step=False``: onebit's backward only; DeepSpeed's engine always steps)."""
    if side == "deepspeed":
        import deepspeed

        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def update(loss: torch.Tensor, take_step: bool = True) -> None:
            engine.backward(loss)
            engine.step()

        return opt, engine, update
    import onebit

    opt = onebit.from_deepspeed_config(config, model.parameters(), **overrides)

    def update(loss: torch.Tensor, take_step: bool = True) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if take_step:
            opt.step()

    return opt, model, update
