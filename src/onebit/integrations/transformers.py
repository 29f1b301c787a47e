"""Hugging Face ``transformers.Trainer`` with an onebit optimizer."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from ..optim import attach

__all__ = ["AttachCallback"]

_log = logging.getLogger(__name__)


class AttachCallback(TrainerCallback):
    """Switch off DDP's all-reduce for the onebit optimizer when training begins.

    ``Trainer`` wraps the model in DDP inside ``train()``, after the optimizer passed in
    ``optimizers=(optimizer, scheduler)`` was built; ``on_train_begin`` runs after the
    wrapping and before the first backward, where DDP accepts a comm hook. Use with
    ``TrainingArguments(max_grad_norm=0)`` and the optimizer's own ``max_grad_norm``: the
    Trainer's clipping would act on each rank's local gradient.
    """

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if optimizer is None or args.world_size == 1:
            return
        attach(optimizer)
        if args.max_grad_norm:
            _log.warning(
                "TrainingArguments(max_grad_norm=%s) clips each rank's local gradient before the onebit optimizer "
                "averages it; for clipping of the averaged gradient set max_grad_norm=0 there and pass "
                "max_grad_norm=%s to the optimizer", args.max_grad_norm, args.max_grad_norm,
            )
