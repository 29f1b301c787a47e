"""Benchmarks behind ``onebit bench``: bit kernels against a memory copy, collectives against
``torch.distributed.all_reduce``. Figures are ratios measured in the same run."""

from ._catalogue import BENCHMARKED, COUNTERPARTS, Benchmarked, Cost, Counterpart, Variant, benchmarked
from ._comm import CommResult, bench_comm
from ._kernels import KernelResult, bench_kernels

__all__ = ["BENCHMARKED", "COUNTERPARTS", "Benchmarked", "CommResult", "Cost", "Counterpart", "KernelResult", "Variant",
           "bench_comm", "bench_kernels", "benchmarked"]
