"""One scheduler for exchanges in flight side by side: the optimizers' overlapped buckets, the
DDP hooks' buckets and :func:`run_pipelined` all launch and complete them here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from ._dist import Pending, Stages
from ._trace import labelled

__all__ = ["Pipeline", "run_pipelined"]


class _Exchange:
    __slots__ = ("stages", "pending", "bucket", "lags", "stage", "done", "result")

    def __init__(self, stages: Stages, bucket: int | None, lags: bool) -> None:
        self.stages, self.bucket, self.lags = stages, bucket, lags
        self.pending: Pending | None = None
        self.stage, self.done, self.result = 0, False, None

    def label(self) -> contextlib.AbstractContextManager[None]:
        """Its bucket on every event recorded meanwhile (a trace's)."""
        return labelled(bucket=self.bucket) if self.bucket is not None else contextlib.nullcontext()

    def advance(self) -> None:
        """Its next stage: wait for the collective in flight, compute, launch the next one."""
        with self.label():
            try:
                self.pending = next(self.stages)
                self.stage += 1
            except StopIteration as finished:
                self.done, self.result = True, finished.value


class Pipeline:
    """Exchanges (each one's :class:`Stages`) launched one after another, each a stage behind the
    next, and completed stage by stage across them.

    :meth:`launch` starts an exchange (its first collective leaves) and then the second stage of
    every exchange before it that ``lags`` and has not taken it yet: for the compressed
    all-reduce ``a2a(0), a2a(1), ag(0), a2a(2), ag(1), ...``, so that the link holds the next
    exchange's bytes while one computes between its collectives. An exchange that does not lag
    takes its next stage in :meth:`completed` (an exact all-reduce, whose second stage only waits
    for it; the DDP hooks' exchanges, which wait for nothing during backward). :meth:`completed`
    then moves every exchange one stage, in launch order, round after round: the next
    collectives of all of them leave before any is waited for twice. The order depends only on
    the order of the launches, so it is the same on every rank whatever its timing. ``bucket``:
    the label its events carry in a trace, and what :meth:`completed` hands back with its result;
    :meth:`finish` runs them all and returns their results in launch order.
    """

    __slots__ = ("_exchanges",)

    def __init__(self) -> None:
        self._exchanges: list[_Exchange] = []

    def __len__(self) -> int:
        return len(self._exchanges)

    def launch(self, stages: Stages, *, bucket: int | None = None, lags: bool = True) -> None:
        """Start ``stages`` (its first collective leaves), then the one behind it takes its second."""
        exchange = _Exchange(stages, bucket, lags)
        exchange.advance()
        self._exchanges.append(exchange)
        self._second_stages(len(self._exchanges) - 1)

    def catch_up(self) -> None:
        """The second stage of every lagging exchange still at its first, the last one's too (the
        optimizers start the last bucket's behind the step's agreement)."""
        self._second_stages(len(self._exchanges))

    def _second_stages(self, upto: int) -> None:
        for exchange in self._exchanges[:upto]:
            if exchange.lags and exchange.stage == 1 and not exchange.done:
                exchange.advance()

    def finish(self) -> list[Any]:
        """Run every exchange to its end (:meth:`completed`): their results, in launch order."""
        exchanges = list(self._exchanges)
        for _ in self.completed():
            pass
        return [e.result for e in exchanges]

    def completed(self) -> Iterator[tuple[int | None, Any]]:
        """Run every exchange to its end, a stage of each in launch order round after round, and
        forget them, yielding ``(bucket, result)`` as each ends -- the others may still be in
        flight, and their next collectives leave after the caller's work on it. An exchange that
        fails raises after those that ended before it were yielded."""
        exchanges, self._exchanges = self._exchanges, []
        live = exchanges
        while live:
            for exchange in live:
                if not exchange.done:
                    exchange.advance()
                if exchange.done:
                    with exchange.label():
                        yield exchange.bucket, exchange.result
            live = [e for e in live if not e.done]

    def drop(self) -> None:
        """Wait for the collectives in flight and forget the exchanges, unfinished."""
        exchanges, self._exchanges = self._exchanges, []
        for exchange in exchanges:
            if exchange.pending is not None and not exchange.done:
                exchange.pending.wait()
            exchange.stages.close()


def run_pipelined(exchanges: Sequence[Stages]) -> list[Any]:
    """Run several exchanges (each one's :class:`Stages`) interleaved, each one stage behind the
    next (a :class:`Pipeline`): a collective split into pieces keeps the busiest link busy.
    Returns each exchange's result, in order."""
    pipeline = Pipeline()
    for stages in exchanges:
        pipeline.launch(stages)
    return pipeline.finish()
