"""onebit: communication-compressed distributed optimizers for PyTorch.

1-bit Adam, 1-bit LAMB, 0/1 Adam, Comp-AMS and Birder, DiLoCo with 1-bit outer gradients, the
compressed collectives they need
(``onebit.comm``), their compressors (``onebit.compress``) and bit kernels (``onebit.ops``).
"""

from . import comm, compress, hooks, ops, optim
from ._checkpoints import Checkpoints
from .feedback import ErrorFeedback
from .optim import (Birder, CompAMS, DiLoCo, OnebitAdam, OnebitAdamNaive, OnebitLamb, QAdam, ReplicaDivergence,
                    SoftSignSGD, ZeroOneAdam, attach, from_deepspeed_config)

__all__ = [
    "Birder",
    "Checkpoints",
    "CompAMS",
    "DiLoCo",
    "ErrorFeedback",
    "OnebitAdam",
    "OnebitAdamNaive",
    "OnebitLamb",
    "QAdam",
    "ReplicaDivergence",
    "SoftSignSGD",
    "ZeroOneAdam",
    "attach",
    "comm",
    "compress",
    "from_deepspeed_config",
    "hooks",
    "ops",
    "optim",
]
__version__ = "0.1.0"
