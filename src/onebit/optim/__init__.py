"""Optimizers: ``torch.optim.Optimizer`` subclasses that average across the group themselves."""

from ._base import OnebitOptimizer, ReplicaDivergence
from ._birder import Birder, SoftSignSGD, birder, soft_sign_sgd
from ._comp_ams import CompAMS, QAdam, comp_ams
from ._ddp import attach, local_gradient_hook
from ._deepspeed import from_deepspeed_config
from ._freeze import FreezeSchedule
from ._functional import adam_step_bound, clip_to_adam_step_, onebit_adam
from ._onebit_adam import OnebitAdam, OnebitAdamNaive
from ._onebit_lamb import OnebitLamb, onebit_lamb

__all__ = [
    "Birder",
    "CompAMS",
    "FreezeSchedule",
    "OnebitAdam",
    "OnebitAdamNaive",
    "OnebitLamb",
    "OnebitOptimizer",
    "QAdam",
    "ReplicaDivergence",
    "SoftSignSGD",
    "adam_step_bound",
    "attach",
    "birder",
    "clip_to_adam_step_",
    "comp_ams",
    "from_deepspeed_config",
    "local_gradient_hook",
    "onebit_adam",
    "onebit_lamb",
    "soft_sign_sgd",
]
