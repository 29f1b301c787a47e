"""Optimizers: ``torch.optim.Optimizer`` subclasses that average across the group themselves."""

from ._base import OnebitOptimizer
from ._comp_ams import CompAMS, QAdam, comp_ams
from ._freeze import FreezeSchedule
from ._functional import onebit_adam
from ._onebit_adam import OnebitAdam, OnebitAdamNaive

__all__ = [
    "CompAMS",
    "FreezeSchedule",
    "OnebitAdam",
    "OnebitAdamNaive",
    "OnebitOptimizer",
    "QAdam",
    "comp_ams",
    "onebit_adam",
]
