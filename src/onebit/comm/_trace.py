"""A timeline of one step on one rank: when each bucket's gradients were ready, and when each
phase of each exchange ran -- the arithmetic (compress, the server's average, decode) and the
collectives in flight, from launch to the wait that returned them.

:func:`trace` collects the events of a block in Chrome's trace event format (open the JSON in
https://ui.perfetto.dev or ``chrome://tracing``; ``onebit.bench`` draws it too). Outside a
block nothing is recorded and every hook is a no-op. Lanes: ``step`` (the optimizer's numbered
steps), ``compute`` (the phases of the compressed collectives), ``wire`` (collectives in
flight), ``backward`` (buckets ready and launched during backward), and with ``link`` the bytes
that actually left through a network interface (``link``: what it carried, as counter events):
a collective "in flight" may be waiting for a peer while the link idles, and only the interface
tells the two apart.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Trace", "instant", "labelled", "link_bytes", "span", "trace", "traced"]


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


def link_bytes(interface: str) -> int:
    """Bytes transmitted so far through network ``interface`` of this process's network
    namespace (Linux's ``/proc/self/net/dev``: the interface's counter, every process's bytes)."""
    try:
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if counters and name.strip() == interface:
                    return int(counters.split()[8])  # receive's 8 counters, then transmit's bytes
    except OSError as exc:
        raise RuntimeError(f"cannot read the link's counters (Linux's /proc/self/net/dev): {exc}") from None
    raise ValueError(f"link {interface!r} is not a network interface of this process's namespace")


class _LinkSampler:
    """A thread reading ``interface``'s transmitted bytes every ``interval`` seconds until
    stopped; the trace gets one counter event per sample: the bytes sent since the trace began."""

    def __init__(self, interface: str, interval: float) -> None:
        self.interface, self.interval = interface, interval
        self.samples = [(time.perf_counter(), link_bytes(interface))]
        self.error: Exception | None = None  # what stopped the sampling early
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="onebit-link-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                self.samples.append((time.perf_counter(), link_bytes(self.interface)))
        except (OSError, RuntimeError, ValueError) as exc:  # the interface went away: the samples so far
            self.error = exc

    def stop(self, into: Trace) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is None:
            try:
                self.samples.append((time.perf_counter(), link_bytes(self.interface)))
            except (RuntimeError, ValueError) as exc:  # never hides what ended the traced block
                self.error = exc
        if self.error is not None:
            into.events.append({"name": "link lost", "cat": "link", "ph": "i", "s": "t", "pid": into.rank,
                                "tid": "link", "ts": round((self.samples[-1][0] - into.start) * 1e6, 1),
                                "args": {"error": str(self.error)}})
        first = self.samples[0][1]
        for t, sent in self.samples:
            into.events.append({"name": "link", "cat": "link", "ph": "C", "pid": into.rank, "tid": "link",
                                "ts": round((t - into.start) * 1e6, 1), "args": {"bytes": sent - first}})


@contextlib.contextmanager
def trace(rank: int = 0, *, link: str | None = None, interval: float = 1e-3) -> Iterator[Trace]:
    """Record the events of the block (one at a time per process).

    ``link``: also sample, every ``interval`` seconds, the bytes leaving network interface
    ``link`` (e.g. ``os.environ["GLOO_SOCKET_IFNAME"]``; Linux only), as lane ``link``'s counter
    events (the bytes sent since the block began: where they stay flat, the link idles). The
    sampler is a thread of this process: on a machine whose cores are all busy it takes a little
    of their time.
    """
    global _active
    if _active is not None:
        raise RuntimeError("a trace is already being recorded in this process")
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < math.inf:
        raise ValueError(f"interval must be a finite positive number of seconds, got {interval!r}")
    recording = Trace(rank)
    sampler = None if link is None else _LinkSampler(link, float(interval))
    _active = recording
    try:
        yield _active
    finally:
        _active = None
        if sampler is not None:
            sampler.stop(recording)


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
