"""Optimizers: ``torch.optim.Optimizer`` subclasses that average across the group themselves."""

from .._checks import CommonOptions
from ._agreement import ReplicaDivergence
from ._base import OnebitOptimizer
from ._birder import Birder, SoftSignSGD, soft_sign_direction, soft_sign_moments, soft_sign_sgd
from ._comp_ams import CompAMS, QAdam, comp_ams, qadam_direction
from ._ddp import attach, local_gradient_hook
from ._deepspeed import from_deepspeed_config
from ._diloco import DiLoCo
from ._freeze import FreezeSchedule, ZeroOneSchedule
from ._functional import adam_step_bound, clip_to_adam_step_
from ._onebit_adam import OnebitAdam, adam, onebit_adam, refresh_preconditioner
from ._onebit_adam_naive import OnebitAdamNaive
from ._onebit_lamb import OnebitLamb, lamb, onebit_lamb
from ._registry import REGISTRY, Spec, make_optimizer
from ._zero_one_adam import ZeroOneAdam, local_step, refresh_variance, synchronise

__all__ = [
    "Birder",
    "CommonOptions",
    "CompAMS",
    "DiLoCo",
    "FreezeSchedule",
    "OnebitAdam",
    "OnebitAdamNaive",
    "OnebitLamb",
    "OnebitOptimizer",
    "QAdam",
    "REGISTRY",
    "ReplicaDivergence",
    "SoftSignSGD",
    "Spec",
    "ZeroOneAdam",
    "ZeroOneSchedule",
    "adam",
    "adam_step_bound",
    "attach",
    "clip_to_adam_step_",
    "comp_ams",
    "from_deepspeed_config",
    "lamb",
    "local_gradient_hook",
    "local_step",
    "make_optimizer",
    "onebit_adam",
    "onebit_lamb",
    "qadam_direction",
    "refresh_preconditioner",
    "refresh_variance",
    "soft_sign_direction",
    "soft_sign_moments",
    "soft_sign_sgd",
    "synchronise",
]
