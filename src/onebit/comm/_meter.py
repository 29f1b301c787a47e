"""Byte meter: what each collective call put on the wire from this rank.

Counts are exact for the algorithm each collective runs: an all-to-all sends every peer
its slot; an all-gather sends this rank's slot to each of the ``w - 1`` peers; a ring
all-reduce of ``N`` bytes sends ``2 (w - 1) / w * N``; a broadcast root sends ``N`` to each
peer. Bytes a rank "sends" to itself are not counted.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ._trace import span

__all__ = ["Meter", "measure", "phase", "record", "record_time"]

_local = threading.local()


@dataclass(eq=False)  # nested meters are told apart by identity, never by equal counts
class Meter:
    """Totals of one :func:`measure` block: ``bytes_sent``, per operation and per link, and
    ``seconds`` spent waiting in collectives (launch to completion, on this rank), and with
    ``measure(phases=True)`` the seconds of each phase of the compressed collectives
    (``phases``: compress, all_to_all, server, all_gather, decode)."""

    bytes_sent: int = 0
    seconds: float = 0.0
    calls: int = 0
    by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_link: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    phases: dict[str, float] | None = None


def _stack() -> list[Meter]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def measure(phases: bool = False) -> Iterator[Meter]:
    """Count the bytes this rank sends inside the block (nested blocks all count); with
    ``phases``, also time each phase of the compressed collectives (:func:`phase`)."""
    meter = Meter(phases=defaultdict(float) if phases else None)
    stack = _stack()
    stack.append(meter)
    try:
        yield meter
    finally:
        stack.remove(meter)


def record(op: str, nbytes: int, link: str = "flat") -> None:
    """Add ``nbytes`` sent by ``op`` over ``link`` to every active meter."""
    for meter in _stack():
        meter.bytes_sent += nbytes
        meter.calls += 1
        meter.by_op[op] += nbytes
        meter.by_link[link] += nbytes


def record_time(seconds: float) -> None:
    """Add ``seconds`` spent in a collective to every active meter."""
    for meter in _stack():
        meter.seconds += seconds


def _synchronize() -> None:
    # Kernels run asynchronously on CUDA: a phase ends when its kernels have, not when they are queued.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's wall time to ``phases[name]`` of every active meter that times phases
    (free when none does; on CUDA the device is synchronised at both ends), and record it on
    the ``compute`` lane of a :func:`~onebit.comm.trace` being recorded."""
    timed = [m for m in _stack() if m.phases is not None]
    with span(name, "compute"):
        if not timed:
            yield
            return
        _synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize()
            elapsed = time.perf_counter() - start
            for meter in timed:
                meter.phases[name] += elapsed
