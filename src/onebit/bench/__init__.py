"""Benchmarks behind ``onebit bench``: bit kernels against a memory copy, collectives against
``torch.distributed.all_reduce``. Figures are ratios measured in the same run."""

from ._comm import CommResult, bench_comm
from ._kernels import KernelResult, bench_kernels

__all__ = ["CommResult", "KernelResult", "bench_comm", "bench_kernels"]
