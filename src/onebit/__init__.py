"""onebit: communication-compressed distributed optimizers for PyTorch.

1-bit Adam, 1-bit LAMB, Comp-AMS and Birder, the compressed collectives they need
(``onebit.comm``), their compressors (``onebit.compress``) and bit kernels (``onebit.ops``).
"""

from . import comm, compress, ops
from .feedback import ErrorFeedback

__all__ = ["ErrorFeedback", "comm", "compress", "ops"]
__version__ = "0.1.0"
