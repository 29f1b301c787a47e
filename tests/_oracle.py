"""Plain single-process oracles written from the papers, independent of the library code."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sign_compress(v: Tensor) -> Tensor:
    """1-bit Adam's C_w: sign(v) * ||v||_2 / sqrt(n) (sign bit decides, so +0 -> +, -0 -> -)."""
    n = v.numel()
    if n == 0:
        return v.clone()
    scale = torch.sqrt(torch.sum(v.double() * v.double()) / n).float()
    return torch.where(torch.signbit(v), -scale, scale)


class SplitMix64:
    """Steele, Lea and Flood's SplitMix64 (Vigna's reference code), in Python integers:
    ``state += 0x9E3779B97F4A7C15``, then two xor-shift-multiply rounds and a last xor-shift.
    :meth:`uniform` takes the next ``n`` outputs, each's top 24 bits times ``2**-24``."""

    def __init__(self, seed: int) -> None:
        self.state = seed % 2**64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) % 2**64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    def uniform(self, n: int) -> Tensor:
        return torch.tensor([(self.next() >> 40) / 2**24 for _ in range(n)], dtype=torch.float32)


def chunk_topk_compress(v: Tensor, k: int, chunk: int, bits: int, sigmas: float) -> Tensor:
    """SparseLoCo's Q(TopK(v)) of one tensor, value by value: in each run of ``chunk`` values
    keep the ``k`` largest magnitudes; quantize the kept values together -- centred on their
    mean, bins of width ``sigmas * std / 2^bits`` around bin ``2^bits / 2``, each bin decoded
    as the mean of the centred values in it -- and put them back in their places."""
    kept = []
    for lo in range(0, v.numel(), chunk):
        part = [(abs(float(v[i])), i) for i in range(lo, min(lo + chunk, v.numel()))]
        kept += [i for _, i in sorted(part, reverse=True)[:k]]
    out = torch.zeros_like(v)
    if not kept:
        return out
    values = [float(v[i]) for i in kept]
    mean = sum(values) / len(values)
    centred = [x - mean for x in values]
    std = math.sqrt(sum(c * c for c in centred) / (len(centred) - 1)) if len(centred) > 1 else 0.0
    bins = 2 ** bits
    width = sigmas * std / bins or 1.0
    codes = [min(max(round(c / width + bins // 2), 0), bins - 1) for c in centred]
    decoded = {}
    for code in set(codes):
        members = [c for c, q in zip(centred, codes) if q == code]
        decoded[code] = sum(members) / len(members)
    for i, code in zip(kept, codes):
        out[i] = decoded[code] + mean
    return out


def chunks(n: int, world: int, align: int) -> list[tuple[int, int]]:
    chunk = math.ceil(n / (world * align)) * align
    return [(min(j * chunk, n), min((j + 1) * chunk, n)) for j in range(world)]


def pieces(lo: int, hi: int, starts: list[int], align: int) -> list[tuple[int, int]]:
    """The pieces of chunk ``[lo, hi)`` cut where a segment starts (each start rounded down to
    ``align``), in the chunk's own coordinates."""
    cuts = sorted({lo, hi, *(s // align * align for s in starts if lo < s // align * align < hi)})
    return [(a - lo, b - lo) for a, b in zip(cuts, cuts[1:])]


class SimulatedCompressedAllReduce:
    """n workers + per-chunk servers of Algorithm 1 (lines 7, 10, 11), one process, plain loops.
    With ``segments``, each piece of a chunk between segment starts is compressed on its own."""

    def __init__(self, n_workers: int, numel: int, compress=sign_compress, align: int = 8,
                 segments: list[int] | None = None) -> None:
        self.w = n_workers
        self.bounds = chunks(numel, n_workers, align)
        self.pieces = [pieces(lo, hi, segments or [], align) for lo, hi in self.bounds]
        self.compress = compress
        self.worker_err = [torch.zeros(numel) for _ in range(n_workers)]
        self.server_err = [torch.zeros(hi - lo) for lo, hi in self.bounds]

    def _compress_chunk(self, j: int, c: Tensor) -> Tensor:
        if c.numel() == 0:
            return c.clone()
        return torch.cat([self.compress(c[a:b]) for a, b in self.pieces[j]])

    def __call__(self, xs: list[Tensor]) -> Tensor:
        sent = []
        for i, x in enumerate(xs):
            c = x.float() + self.worker_err[i]
            q = torch.cat([self._compress_chunk(j, c[lo:hi]) for j, (lo, hi) in enumerate(self.bounds)])
            self.worker_err[i] = c - q
            sent.append(q)
        out = []
        for j, (lo, hi) in enumerate(self.bounds):
            avg = sum(q[lo:hi] for q in sent) / self.w
            s = avg + self.server_err[j]
            m = self._compress_chunk(j, s)
            self.server_err[j] = s - m
            out.append(m)
        return torch.cat(out)


class SimulatedCompressedAllGather:
    """n workers of Comp-AMS's exchange (Algorithm 2, lines 5-11), one process, plain loops: each
    compresses ``x + e`` (one scale per piece between segment starts, rounded down to ``align``),
    keeps ``e <- x + e - C(x + e)``, and the average of the compressed values is everyone's."""

    def __init__(self, n_workers: int, numel: int, compress=sign_compress, align: int = 8,
                 segments: list[int] | None = None) -> None:
        self.w = n_workers
        self.pieces = pieces(0, numel, segments or [], align)
        self.compress = compress
        self.worker_err = [torch.zeros(numel) for _ in range(n_workers)]

    def __call__(self, xs: list[Tensor]) -> Tensor:
        sent = []
        for i, x in enumerate(xs):
            c = x.float() + self.worker_err[i]
            q = torch.cat([self.compress(c[a:b]) for a, b in self.pieces])
            self.worker_err[i] = c - q
            sent.append(q)
        return sum(sent) / self.w
