"""Optimizers: ``torch.optim.Optimizer`` subclasses that average across the group themselves."""

from ._base import OnebitOptimizer
from ._freeze import FreezeSchedule
from ._functional import onebit_adam
from ._onebit_adam import OnebitAdam, OnebitAdamNaive

__all__ = ["FreezeSchedule", "OnebitAdam", "OnebitAdamNaive", "OnebitOptimizer", "onebit_adam"]
