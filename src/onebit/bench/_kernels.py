"""Throughput of the sign kernels against a plain copy of the same fp32 data (target P5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ._timing import median_seconds

__all__ = ["KernelResult", "bench_kernels"]


@dataclass(frozen=True)
class KernelResult:
    kernel: str
    implementation: str
    seconds: float
    gbytes_per_s: float  # fp32 input (pack) or output (unpack) bytes per second
    vs_copy: float  # copy time / kernel time: 1.0 means as fast as copying the fp32 data


def bench_kernels(numel: int = 10_500_000, repeat: int = 10, device: str = "cpu") -> list[KernelResult]:
    """Time pack/unpack/fused-EF (fast path and reference) and a copy of ``numel`` fp32 values."""
    dev = torch.device(device)
    x = torch.randn(numel, device=dev)
    dst = torch.empty_like(x)
    packed = torch.empty(ops.packed_numel(numel), dtype=torch.uint8, device=dev)
    error = torch.zeros_like(x)
    work = torch.empty_like(x)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        return median_seconds(lambda: (fn(), sync()), repeat)

    copy_s = timed(lambda: dst.copy_(x))
    nbytes = 4 * numel
    results = [KernelResult("copy", "torch", copy_s, nbytes / copy_s / 1e9, 1.0)]
    cases = {
        "pack_signs": lambda: ops.pack_signs(x, out=packed),
        "unpack_signs": lambda: ops.unpack_signs(packed, numel, 0.5, out=dst),
        "ef_sign_compress": lambda: ops.ef_sign_compress_(error, x, workspace=work, packed_out=packed),
    }
    for impl in ("fast", "reference"):
        for name, fn in cases.items():
            if impl == "reference":
                with ops.reference_kernels():
                    s = timed(fn)
            else:
                s = timed(fn)
            results.append(KernelResult(name, impl, s, nbytes / s / 1e9, copy_s / s))
    return results
