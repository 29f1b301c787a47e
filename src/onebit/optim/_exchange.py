"""The exchange of an optimizer's buckets: handed a bucket's values, it starts their average.

The exchange is a service of the optimizer's step (``_base.py``): it is built with the flat
layout, the process group and the collectives, and each call hands it one bucket's values --
the gradients for their exact mean, or what the optimizer formed for its compressed
all-reduce -- and starts their exchange; :meth:`Exchange.completed` then runs them to their
end, handing back each bucket as it lands. It holds no method of the optimizer and calls
nothing of it: the step forms, launches, waits and applies.

Without overlap, one bucket spans the whole model, launched in ``step()`` once every rank
agreed the gradients are finite; with ``overlap=True`` the buckets of DDP's scheme
(``_buckets.py``) leave during backward; with ``overlap="warmup"`` only the warm-up's exact
mean does, in buckets of its own over a duplicate of the group (:attr:`Exchange.warm_bounds`).

A compressed bucket's second phase (the server average and its all-gather) starts when the
next bucket's all-to-all has been launched (an :class:`onebit.comm.Pipeline`), the last one's
in ``step()`` right after the step's non-finite agreement is launched (:meth:`Exchange.gather`):
the order is ``a2a(0), a2a(1), ag(0), a2a(2), ag(1), ..., a2a(n-1), ag(n-2)``, the agreement,
``ag(n-1)``, on every rank whatever its timing, and the link always holds the next bucket's
bytes while one is averaged. The agreement then waits on a busy link for the bytes before it
only, and an optimizer that ``applies_by_bucket`` steps each bucket as it lands, the buckets
before the last while the last one's all-gather is on the wire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import comm, compress
from .._checks import check_scales
from ._buckets import FIRST_BUCKET, bucket_bounds, bucket_cap
from ._flat import starts_inside

if TYPE_CHECKING:
    from ._flat import FlatState

__all__ = ["Exchange", "allreduce_factory"]

_log = logging.getLogger("onebit.optim")


class Exchange:
    """One optimizer's exchange, step after step (see the module docstring).

    ``collective(start, end)`` makes the compressed collective of the flat values
    ``[start, end)`` (``None``: the optimizer has none; it may return None for a span it cannot
    exchange, which then sends nothing). A bucket ``b`` of :attr:`bounds` sends the values of
    its span, ``spans[b]``: its own range, or with ``alignment`` > 1 (Block-Sign's blocks of the
    fused gradient) from the first multiple of ``alignment`` inside it to where the span of the
    bucket launched before it starts, so that no block straddles two exchanges; a bucket with
    an empty span sends nothing, its values going with the next one. ``warm_group``
    (``overlap="warmup"``): the group of the warm-up's buckets, :attr:`warm_bounds`. ``key``
    names the collectives' entry in checkpoints; ``owner`` names the optimizer in messages.
    """

    def __init__(self, flat: FlatState, group: comm.Group, timeout: timedelta,
                 collective: Callable[[int, int], Any] | None, *, overlap: bool | str, bucket_cap_mb: float,
                 alignment: int = 1, key: str = "allreduce", owner: str = "",
                 warm_group: comm.Group = None) -> None:
        self.flat, self.group, self.timeout, self.key, self.owner = flat, group, timeout, key, owner
        vectors = [p.dim() == 1 for p in flat.params]  # (bucket_bounds: a bias goes with its weight)
        cap = bucket_cap(bucket_cap_mb)
        self.bounds = bucket_bounds(flat.offsets, cap, vectors) if overlap is True \
            else [(0, flat.numel, list(range(len(flat.params))))]
        # A span ends where the span of the bucket launched before it (the parameters after it)
        # starts -- at the model's end for the first bucket.
        starts = [min(flat.numel, -(-lo // alignment) * alignment) for lo, _, _ in self.bounds]
        self.spans = list(zip(starts, [flat.numel, *starts]))
        # Every bucket sends its own parameters' values (no alignment moves some to the next one):
        # a bucket that has landed holds its parameters' whole average.
        self.lands_by_bucket = self.spans == [(lo, hi) for lo, hi, _ in self.bounds]
        self.collectives = [None if collective is None else collective(start, end) for start, end in self.spans]
        for c in self.collectives:
            if c is not None:
                c.warm_up(flat.device)  # kernels loaded now, not at the first compressed step
        # overlap="warmup": the warm-up's fp32 mean leaves during backward in buckets of its own, as
        # DDP's all-reduce does, over ``warm_group``, a duplicate of the group: which of them leave
        # during backward differs between ranks (a parameter unused on one), and on the user's
        # group that would interleave them with the user's own collectives (a loss all-reduced
        # before step(), SyncBatchNorm) in another order on each rank.
        self.warm_group = warm_group
        # Closed as DDP closes its buckets: a first bucket that stops short of the last layer's
        # weight leaves with a few biases, and the link idles until the next, much larger, one.
        self.warm_bounds = None if warm_group is None else bucket_bounds(flat.offsets, cap, first=FIRST_BUCKET,
                                                                         past=True)
        self._warm = comm.Pipeline()  # the warm-up's exact means, completed in step()
        self._flights = comm.Pipeline()  # the buckets' exchanges, a phase behind the next
        self._added: set[int] = set()  # buckets whose average is decoded where the step says
        self._compressed_in_flight = False

    # ------------------------------------------------------------------ launches
    def mean(self, b: int, values: Tensor, dtype: torch.dtype, *, warm: bool = False) -> None:
        """Start the exact mean of bucket ``b``'s ``values``, in place, summed in ``dtype`` (``warm``:
        a bucket of :attr:`warm_bounds`, over :attr:`warm_group`)."""
        if warm:
            stages = comm.all_reduce_mean_stages(values, self.warm_group, self.timeout, divide_first=True, dtype=dtype)
            self._warm.launch(stages, bucket=b, lags=False)
        else:
            stages = comm.all_reduce_mean_stages(values, self.group, self.timeout, dtype=dtype)
            self._flights.launch(stages, bucket=b, lags=False)

    def compressed(self, b: int, values: Tensor) -> None:
        """Start the compressed average of bucket ``b``'s span ``values``, in place."""
        self._compressed_in_flight = True
        self._flights.launch(self.collectives[b].stages(values, out=values), bucket=b, lags=False)

    def input_buffer(self, b: int) -> Tensor:
        """Where bucket ``b``'s values are added, for :meth:`added` (the collective's worker error:
        no model-sized buffer), where its collective ``reduces_added_input``."""
        self._compressed_in_flight = True
        start, end = self.spans[b]
        return self.collectives[b].input_buffer(end - start, self.flat.device)

    def added(self, b: int) -> None:
        """Start the compressed average of what was added into :meth:`input_buffer`; its second
        phase when the next bucket's first has left (see the module docstring). Where it lands is
        the step's to say when it does (:meth:`completed`)."""
        self._added.add(b)
        self._flights.launch(self.collectives[b].stages(None), bucket=b)

    def gather(self) -> None:
        """Start the second phase of every bucket still waiting for it (the last one's, once the
        step's agreement is launched: see the module docstring)."""
        self._flights.catch_up()

    # ------------------------------------------------------------------ completion
    @property
    def warm_in_flight(self) -> bool:
        """Buckets of the warm-up's exact mean were launched (during backward) and not completed."""
        return len(self._warm) > 0

    def completed(self, landing: Tensor | comm.Consume, *, warm: bool = False) -> Iterator[list[int]]:
        """Run the launched buckets (``warm``: the warm-up's) to their end, yielding each one's
        parameters as it lands in ``landing`` (others may still be in flight), in bucket order
        for the one-shot exchange. ``landing``: the step's flat buffer of averages, or
        ``consume(lo, hi, values)``, handed a bucket's average chunk by chunk. A collective that
        fails raises after the buckets before it were yielded."""
        bounds = self.warm_bounds if warm else self.bounds
        if not warm:
            self._flights.catch_up()  # every added bucket's all-gather in flight first
        try:
            for b, result in (self._warm if warm else self._flights).completed():
                if b in self._added:
                    self.collectives[b].land(result, _span(landing, *self.spans[b]))
                yield bounds[b][2]
        finally:
            self._end_step()

    def drop_warm(self) -> None:
        """Wait for the warm-up's buckets launched and forget them (stale: exchanged again)."""
        self._warm.drop()

    def abandon(self) -> None:
        """Every rank skips the step: wait for the exchanges launched and drop them. A compressed
        one took its values into the error-feedback buffers before any rank could know: they
        restart at zero."""
        self._warm.drop()
        self._flights.drop()
        if self._compressed_in_flight:
            self.reset()
            _log.warning("%s: step skipped after the overlapped exchange had started: error-feedback buffers "
                         "restarted at zero", self.owner)
        self._end_step()

    def reset(self, buckets: Sequence[int] | None = None) -> None:
        """The collectives' errors (of ``buckets``; None: all) restart at zero."""
        for b, c in enumerate(self.collectives):
            if c is not None and (buckets is None or b in buckets):
                c.reset()

    def _end_step(self) -> None:
        self._added.clear()
        self._compressed_in_flight = False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The collectives' errors (and random state): ``{key: state}`` of the one-shot collective,
        or the bucketing and ``{"bucket_" + key: [state or None]}``; nothing without collectives."""
        if all(c is None for c in self.collectives):
            return {}
        if len(self.bounds) == 1:
            return {self.key: self.collectives[0].state_dict()}
        return {"bucket_bounds": [[lo, hi] for lo, hi, _ in self.bounds],
                "bucket_" + self.key: [None if c is None else c.state_dict() for c in self.collectives]}

    def required(self, state: Mapping[str, Any]) -> tuple[str, ...]:
        """The entries :meth:`load_state_dict` reads from ``state`` (as it was bucketed when saved)."""
        if all(c is None for c in self.collectives):
            return ()
        bucketed = "bucket_" + self.key
        if bucketed in state or "bucket_bounds" in state:
            return ("bucket_bounds", bucketed)
        return (self.key,)

    def _saved(self, state: Mapping[str, Any], own_state: bool) -> list[Any] | None:
        """Each collective's saved state, where it is this rank's and bucketed as this exchange is
        (None otherwise: the errors restart)."""
        # one bucket spanning the model is the one-shot layout, however it was saved
        layout = state.get("bucket_bounds")
        layout = None if layout is None or [list(b) for b in layout] == [[0, self.flat.numel]] \
            else [list(b) for b in layout]
        mine = None if len(self.bounds) == 1 else [[lo, hi] for lo, hi, _ in self.bounds]
        if not own_state or layout != mine:
            return None
        return state["bucket_" + self.key] if "bucket_bounds" in state else [state[self.key]]

    def check_state_dict(self, state: Mapping[str, Any], own_state: bool) -> None:
        """Refuse (``ValueError``) a collective's saved state that :meth:`load_state_dict` would
        fail to read, before anything is loaded."""
        if all(c is None for c in self.collectives):
            return
        for c, s in zip(self.collectives, self._saved(state, own_state) or ()):
            if c is not None:
                c.check_state_dict(s)

    def load_state_dict(self, state: Mapping[str, Any], own_state: bool) -> None:
        """Restore :meth:`state_dict`; saved with another bucketing, by another rank or on another
        world size, the errors restart at zero (freshly seeded)."""
        if all(c is None for c in self.collectives):
            return
        saved = self._saved(state, own_state)
        if own_state and saved is None:
            _log.warning("%s: checkpoint saved with another bucketing (overlap=%s): error-feedback buffers "
                         "restart at zero", self.owner, "bucket_bounds" in state)
        for i, c in enumerate(self.collectives):
            if c is None:
                continue
            if saved is None:
                c.reset()
            else:
                c.load_state_dict(saved[i])


def _span(landing: Tensor | comm.Consume, start: int, end: int) -> Tensor | comm.Consume:
    """The flat values ``[start, end)`` of ``landing``: its span, or ``consume`` shifted to it."""
    if isinstance(landing, Tensor):
        return landing[start:end]
    return lambda a, z, values: landing(start + a, start + z, values)


def allreduce_factory(offsets: Sequence[tuple[int, int]], group: comm.Group, timeout: timedelta, compressor: Any, *,
                      hierarchical: bool | str, ranks_per_node: int | None, overlap: bool,
                      scales: str = "chunk") -> Callable[[int, int], Any]:
    """``collective(start, end)`` for :class:`Exchange`: the compressed all-reduce
    (:func:`onebit.comm.compressed_allreduce`: flat, or Birder's hierarchical one) of the flat
    values of parameters at ``offsets``. The overlapped exchange needs the flat one: what a
    bucket forms must stay out of the state until ``step()``, so it is added into the
    collective's worker error, which only the flat all-reduce takes. ``scales="tensor"``: a
    compressor with per-block scales gives every parameter's piece of a chunk its own
    (:func:`check_scales`); ``"chunk"``: one per chunk."""
    segments = _segmenter(offsets, compressor, scales)

    def collective(start: int, end: int) -> Any:
        made = comm.compressed_allreduce(compressor, group, hierarchical=hierarchical, ranks_per_node=ranks_per_node,
                                         segments=segments(start, end), timeout=timeout)
        if overlap and not made.reduces_added_input:
            raise ValueError(f"Invalid hierarchical value with overlap=True: {hierarchical!r} (the overlapped "
                             "exchange needs the flat compressed all-reduce)")
        return made
    return collective


def _segmenter(offsets: Sequence[tuple[int, int]], compressor: Any,
               scales: str) -> Callable[[int, int], list[int] | None]:
    """``segments(start, end)`` of a bucket's collective: where the parameters starting inside
    ``[start, end)`` start, relative to ``start``, for a compressor with per-block scales and
    ``scales="tensor"``; None (one scale per chunk) otherwise."""
    if check_scales(scales) != "tensor" or not compress.get(compressor).blockwise:
        return lambda start, end: None
    return lambda start, end: starts_inside(offsets, start, end)
