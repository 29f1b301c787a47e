"""A timeline of one step on one rank: when each bucket's gradients were ready, and when each
phase of each exchange ran -- the arithmetic (compress, the server's average, decode) and the
collectives in flight, from launch to the wait that returned them.

:func:`trace` collects the events of a block in Chrome's trace event format (open the JSON in
https://ui.perfetto.dev or ``chrome://tracing``; ``onebit.bench`` draws it too). Outside a
block nothing is recorded and every hook is a no-op. Lanes: ``step`` (the optimizer's numbered
steps), ``compute`` (the phases of the compressed collectives), ``wire`` (collectives in
flight), ``backward`` (buckets ready and launched during backward).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Trace", "instant", "labelled", "span", "trace", "traced"]


@dataclass
class Trace:
    """The events of one :func:`trace` block on rank ``rank``, times from its start (µs)."""

    rank: int
    start: float = field(default_factory=time.perf_counter)
    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, lane: str, begin: float, end: float | None = None, **args: Any) -> None:
        """An event from ``begin`` to ``end`` (``time.perf_counter()`` seconds; None: an instant)."""
        event = {"name": name, "cat": lane, "ph": "X" if end is not None else "i", "pid": self.rank, "tid": lane,
                 "ts": round((begin - self.start) * 1e6, 1), "args": {**_label, **args}}
        if end is not None:
            event["dur"] = round((end - begin) * 1e6, 1)
        else:
            event["s"] = "t"
        self.events.append(event)

    def to_json(self) -> dict[str, Any]:
        """Chrome's trace event format; ``otherData["start"]``: the start on the host's monotonic
        clock, to put several ranks' traces on one time line."""
        return {"traceEvents": self.events, "displayTimeUnit": "ms", "otherData": {"start": self.start}}


_active: Trace | None = None
_label: dict[str, Any] = {}  # what the events recorded now belong to (the bucket)


@contextlib.contextmanager
def trace(rank: int = 0) -> Iterator[Trace]:
    """Record the events of the block (one at a time per process)."""
    global _active
    if _active is not None:
        raise RuntimeError("a trace is already being recorded in this process")
    _active = Trace(rank)
    try:
        yield _active
    finally:
        _active = None


def traced() -> Trace | None:
    """The trace being recorded, if any."""
    return _active


@contextlib.contextmanager
def span(name: str, lane: str, **args: Any) -> Iterator[None]:
    """Record the block as an event of ``lane`` (free without a trace)."""
    if _active is None:
        yield
        return
    begin = time.perf_counter()
    try:
        yield
    finally:
        if _active is not None:
            _active.add(name, lane, begin, time.perf_counter(), **args)


def instant(name: str, lane: str, **args: Any) -> None:
    """Record a moment of ``lane``."""
    if _active is not None:
        _active.add(name, lane, time.perf_counter(), None, **args)


@contextlib.contextmanager
def labelled(**label: Any) -> Iterator[None]:
    """Every event recorded inside the block carries ``label`` (e.g. ``bucket=3``)."""
    saved = dict(_label)
    _label.update(label)
    try:
        yield
    finally:
        _label.clear()
        _label.update(saved)
