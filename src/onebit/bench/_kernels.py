"""Throughput of the sign kernels and of the optimizers' one-pass element-wise updates
against a plain copy of the same fp32 data (target P5).

Each kernel is timed with its fast path (numba on CPU, Triton on CUDA) and the pure-torch
reference. Two ratios: ``vs_copy`` (copy time / kernel time, the P5 figure) and
``bandwidth`` (the kernel's own memory traffic per second / the copy's: how close a kernel
that reads and writes different amounts runs to the device's copy bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..ops import _cpu, _triton
from ._timing import median_seconds

__all__ = ["KernelResult", "bench_kernels"]

SERVER_RANKS = 4  # payloads averaged by the server-side kernel


@dataclass(frozen=True)
class KernelResult:
    kernel: str
    implementation: str
    seconds: float
    gbytes_per_s: float  # fp32 values (4 bytes each) processed per second
    vs_copy: float  # copy time / kernel time: 1.0 means as fast as copying the fp32 data
    traffic_gbytes_per_s: float  # bytes the kernel reads and writes, per second
    bandwidth: float  # traffic_gbytes_per_s / the copy's (which reads and writes 4 bytes per value)


def _fast_name(device: torch.device, kernel: str) -> str:
    """Which implementation the dispatch picks for ``kernel`` on ``device``."""
    if device.type == "cpu":
        if kernel == "pack_signs":
            return "numpy"
        return "numba" if _cpu.numba is not None else "torch"
    if kernel == "zero_where_equal":  # a masked fill: one pass in torch already
        return "torch"
    return "triton" if _triton.available(torch.empty(0, device=device)) else "torch"


def bench_kernels(numel: int = 10_500_000, repeat: int = 10, device: str = "cpu") -> list[KernelResult]:
    """Time pack/unpack/fused error feedback/server average, and a copy, of ``numel`` fp32 values."""
    dev = torch.device(device)
    x = torch.randn(numel, device=dev)
    dst = torch.empty_like(x)
    packed = torch.empty(ops.packed_numel(numel), dtype=torch.uint8, device=dev)
    error = torch.zeros_like(x)
    work = torch.empty_like(x)
    rows = [ops.pack_signs(torch.randn(numel, device=dev)) for _ in range(SERVER_RANKS)]
    scales = [torch.rand(1, device=dev) for _ in range(SERVER_RANKS)]
    server_error = torch.zeros_like(x)
    bound = x.abs()
    unused = torch.where(torch.rand(numel, device=dev) < 0.1, 0.0, x)  # 10% zeros: values never given a gradient

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        fn()  # compile/warm up outside the timing
        return median_seconds(lambda: (fn(), sync()), repeat)

    n, b = numel, ops.packed_numel(numel)
    copy_s = timed(lambda: dst.copy_(x))
    copy_traffic = 8 * n
    results = [KernelResult("copy", "torch", copy_s, 4 * n / copy_s / 1e9, 1.0, copy_traffic / copy_s / 1e9, 1.0)]
    # (call, bytes read + written by the fused kernel sequence)
    cases = {
        "pack_signs": (lambda: ops.pack_signs(x, out=packed), 4 * n + b),
        "unpack_signs": (lambda: ops.unpack_signs(packed, numel, 0.5, out=dst), b + 4 * n),
        # error += x (12n), the norm (4n), sign/pack/new error (8n + b)
        "ef_sign_compress": (lambda: ops.ef_sign_compress_(error, x, workspace=work, packed_out=packed), 24 * n + b),
        # unpack 4 payloads, average, add into the server error (read + write 8n)
        f"server_average_{SERVER_RANKS}": (
            lambda: ops.average_signs(rows, scales, numel, server_error, accumulate=True), SERVER_RANKS * b + 8 * n),
        # the optimizers' passes over their flat state: read x and a reference, write x
        "clamp_scaled": (lambda: ops.clamp_scaled_(work, bound, 0.5), 12 * n),
        "zero_where_equal": (lambda: ops.zero_where_equal_(work, unused, 0.0), 12 * n),
    }
    for reference in (False, True):
        for name, (fn, traffic) in cases.items():
            if reference:
                with ops.reference_kernels():
                    s = timed(fn)
            else:
                s = timed(fn)
            impl = "reference" if reference else _fast_name(dev, name)
            results.append(KernelResult(name, impl, s, 4 * n / s / 1e9, copy_s / s, traffic / s / 1e9,
                                        traffic / s / (copy_traffic / copy_s)))
    return results
