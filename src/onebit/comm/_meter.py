"""Byte meter: what each collective call put on the wire from this rank.

Counts are exact for the algorithm each collective runs: an all-to-all sends every peer
its slot; an all-gather sends this rank's slot to each of the ``w - 1`` peers; a ring
all-reduce of ``N`` bytes sends ``2 (w - 1) / w * N``; a broadcast root sends ``N`` to each
peer. Bytes a rank "sends" to itself are not counted.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Meter", "measure", "record", "record_time"]

_local = threading.local()


@dataclass
class Meter:
    """Totals of one :func:`measure` block: ``bytes_sent``, per operation and per link, and
    ``seconds`` spent waiting in collectives (launch to completion, on this rank)."""

    bytes_sent: int = 0
    seconds: float = 0.0
    calls: int = 0
    by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_link: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def _stack() -> list[Meter]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def measure() -> Iterator[Meter]:
    """Count the bytes this rank sends inside the block (nested blocks all count)."""
    meter = Meter()
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
