"""The one exchange driver: what every onebit optimizer sends, one-shot or bucketed and overlapped.

Every optimizer is one contract in three phases (:class:`~onebit.optim.OnebitOptimizer`):

1. **form** (``_form``): what goes on the wire for a block of the flat layout, from the
   gradients and the state as it was -- the state is not touched before every rank agreed to
   take the step (the one-shot exchange may move it there, where ``_apply`` would repeat it);
2. **the exchange**: a collective from :mod:`onebit.comm`, run by :class:`Driver`;
3. **apply** (``_apply``): the average lands (``_landing``) and the state moves.

Each stage declares its :class:`Wire` -- what is sent (the gradients themselves, or what
``_form`` makes) and how (the exact fp32 mean, or the optimizer's compressed collective) --
and the driver does the rest for every optimizer alike: without overlap, one bucket spanning
the whole model, launched in ``step()`` once every rank agreed the gradients are finite;
with ``overlap=True``, DDP's scheme: the parameters are grouped into buckets of about
``bucket_cap_mb`` in reverse registration order -- the order backward produces their
gradients -- each a contiguous range of the flat state, and a post-accumulate-grad hook
launches a bucket's exchange once its gradients are all in, while backward goes on with
earlier layers. No optimizer knows about buckets.

Collectives must be issued in the same order on every rank, so buckets are launched
strictly in bucket order: a bucket whose gradients are complete waits for every bucket
before it. A bucket that never completes during backward (a parameter unused on this rank,
or trainable only here) is launched by :meth:`Driver.flush` at the start of ``step()``,
still in order and before the step's non-finite agreement, so every rank issues the same
sequence whatever its own timing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dataclasses import dataclass

from .. import comm, compress
from .._checks import check_scales
from ._functional import _BLOCK

__all__ = ["COMPRESSED_FORMED", "COMPRESSED_GRADIENT", "Buckets", "Driver", "EXACT_GRADIENT", "LOCAL", "Wire",
           "allreduce_factory", "bucket_bounds"]

_log = logging.getLogger("onebit.optim")


def bucket_bounds(offsets: Sequence[tuple[int, int]], cap: int,
                  vectors: Sequence[bool] | None = None) -> list[tuple[int, int, list[int]]]:
    """``(lo, hi, parameter indices)`` of each bucket, last parameters first; a bucket is closed
    before a parameter that would take it past ``cap`` values (a larger parameter is a bucket of
    its own), so the first bucket -- the last layers -- leaves as early as possible.

    ``vectors[i]``: parameter ``i`` is 1-D. The 1-D parameters registered right after the one
    that opens a new bucket move into it with it: a layer registers its weight and then its
    bias, and backward produces both at once, so a bucket that kept the bias would wait for
    the weight anyway."""
    vectors = vectors or [False] * len(offsets)
    groups: list[list[int]] = []
    members: list[int] = []
    for i in reversed(range(len(offsets))):
        if members and offsets[members[0]][1] - offsets[i][0] > cap:
            keep = len(members)
            while keep and vectors[members[keep - 1]]:
                keep -= 1
            if keep:
                groups.append(members[:keep])
            members = members[keep:]
        members.append(i)
    if members:
        groups.append(members)
    return [(offsets[m[-1]][0], offsets[m[0]][1], m[::-1]) for m in groups]


def _bucket_cap(bucket_cap_mb: object) -> int:
    """``bucket_cap_mb`` (MB of fp32 values, as DDP's) in values."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
        raise ValueError(f"Invalid bucket_cap_mb value: {bucket_cap_mb!r} (expected a positive number)")
    return max(1, int(bucket_cap_mb * 2**20 / 4))


class Buckets:
    """The hooks and bookkeeping of the overlapped exchange of one optimizer.

    ``launch(b)`` starts bucket ``b``'s exchange (called once per step for every bucket, in
    order); the driver finishes them in ``step()``. Of the last step: the number of buckets
    ``launched_in_backward``, and ``overlap``, the fraction of the exchange's wall time (first
    launch to the last bucket finished) that passed before ``step()`` began, i.e. alongside
    backward.
    """

    def __init__(self, params: Sequence[Tensor], bounds: list[tuple[int, int, list[int]]],
                 launch: Callable[[int], None]) -> None:
        self.bounds = bounds
        self._launch = launch
        self._params = params
        self._bucket_of = [0] * len(params)
        for b, (_, _, members) in enumerate(self.bounds):
            for i in members:
                self._bucket_of[i] = b
        self._index = {id(p): i for i, p in enumerate(params)}
        self._hooked = [p.requires_grad for p in params]
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._paused = False
        self.bytes_sent = 0
        self._in_backward = 0
        self.launched_in_backward = 0
        self.overlap = 0.0
        self._reset()

    def _reset(self) -> None:
        self._seen = [False] * len(self._params)
        # A bucket is complete when every parameter that can fire its hook (trainable now) has.
        self._waiting = [sum(self._hooked[i] and self._params[i].requires_grad for i in members)
                         for _, _, members in self.bounds]
        self._next = 0
        self._first_launch: float | None = None
        self._backward_end: float | None = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside the block; the backward after it starts the exchange."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def _on_grad(self, param: Tensor) -> None:
        if self._paused:
            return
        i = self._index[id(param)]
        if self._seen[i]:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(param.shape)}) received a second gradient before step(): with "
                "overlap=True its bucket's exchange started at the first one. Accumulate gradients inside "
                "`with optimizer.no_sync():` for every micro-batch but the last, as with DDP"
            )
        self._seen[i] = True
        b = self._bucket_of[i]
        self._waiting[b] -= 1
        while self._next < len(self.bounds) and self._waiting[self._next] <= 0:
            with comm.measure() as meter:  # outside step(), whose meter counts the rest
                self._start(self._next)
            self.bytes_sent += meter.bytes_sent
            self._in_backward += 1

    def _start(self, b: int) -> None:
        if self._first_launch is None:
            self._first_launch = time.perf_counter()
        with torch.no_grad():
            self._launch(b)
        self._next = b + 1

    def flush(self) -> None:
        """Launch, in order, every bucket backward did not (the start of ``step()``)."""
        self._backward_end = time.perf_counter()
        while self._next < len(self.bounds):
            self._start(self._next)

    def done(self) -> int:
        """Close the step: record the overlap, reset the bookkeeping; returns the bytes sent
        by the launches (outside ``step()``'s own meter)."""
        if self._first_launch is not None and self._backward_end is not None:
            total = time.perf_counter() - self._first_launch
            self.overlap = max(0.0, self._backward_end - self._first_launch) / total if total > 0 else 0.0
        sent, self.bytes_sent = self.bytes_sent, 0
        self.launched_in_backward, self._in_backward = self._in_backward, 0
        self._reset()
        return sent


@dataclass(frozen=True)
class Wire:
    """What a stage sends, as an optimizer declares it.

    ``stage``: its name in ``stats["stage"]`` (``"warmup"``: uncompressed, ``"compressed"``).
    ``formed``: the optimizer's ``_form`` makes what is sent (momentum, an update); else the
    gradients themselves are. Where the gradients are sent, their average exists and
    ``max_grad_norm`` clips it; where they are not, it never exists and each rank clips its
    own gradients before forming (what ``clip_grad_norm_`` does on one process).
    ``exact``: the exact fp32 mean (an all-reduce); else the optimizer's compressed collectives.
    ``exchanged``: False for a step each rank takes on its own (0/1 Adam's local steps): nothing
    is sent, ``_apply`` gets no average and reads the local gradients itself.
    """

    stage: str
    formed: bool
    exact: bool
    exchanged: bool = True


EXACT_GRADIENT = Wire("warmup", formed=False, exact=True)
COMPRESSED_GRADIENT = Wire("compressed", formed=False, exact=False)
COMPRESSED_FORMED = Wire("compressed", formed=True, exact=False)
LOCAL = Wire("local", formed=True, exact=False, exchanged=False)

# consume(lo, hi, values): the average's flat values [lo, hi), handed over chunk by chunk (scratch)
Consume = Callable[[int, int, Tensor], None]


class Driver:
    """Runs an optimizer's exchange, step after step (see the module docstring).

    ``collective(start, end)`` makes the compressed collective of the flat values
    ``[start, end)`` (``None``: the optimizer has none; it may return None for a span it cannot
    exchange, which then sends nothing). A bucket sends the values of its
    span: its own range, or with ``alignment`` > 1 (Block-Sign's blocks of the fused
    gradient) from the first multiple of ``alignment`` inside it to where the span of the
    bucket launched before it starts, so that no block straddles two exchanges; a bucket
    with an empty span sends nothing, its values going with the next one.

    A bucket's input is formed where its average lands and exchanged in place (the
    collective's ``stages``), except where it must stay out of that buffer -- a bucket formed
    during backward, before the ranks agreed to step -- or where the average is handed out
    chunk by chunk: it is then added into the worker error of a collective that
    ``reduces_added_input`` (no model-sized buffer for either). ``key`` names the
    collectives' entry in checkpoints.
    """

    def __init__(self, opt: OnebitOptimizer, collective: Callable[[int, int], Any] | None, *, overlap: bool,
                 bucket_cap_mb: float, alignment: int = 1, key: str = "allreduce") -> None:
        self.opt, self.key = opt, key
        flat = opt.flat
        self.buckets: Buckets | None = None
        self.bounds = bucket_bounds(flat.offsets, _bucket_cap(bucket_cap_mb), [p.dim() == 1 for p in flat.params]) \
            if overlap else [(0, flat.numel, list(range(len(flat.params))))]
        # A span ends where the span of the bucket launched before it (the parameters after it)
        # starts -- at the model's end for the first bucket.
        starts = [min(flat.numel, -(-lo // alignment) * alignment) for lo, _, _ in self.bounds]
        self.spans = list(zip(starts, [flat.numel, *starts]))
        self.collectives = [None if collective is None else collective(start, end) for start, end in self.spans]
        for c in self.collectives:
            if c is not None:
                c.warm_up(flat.device)  # kernels loaded now, not at the first compressed step
        if overlap:
            self.buckets = Buckets(flat.params, self.bounds, self._launch_in_backward)
        self._flights: list[Any] = [None] * len(self.bounds)  # a collective, or (stages, pending)
        self._compressed_in_flight = False
        self._land: Tensor | Consume | None = None

    # ------------------------------------------------------------------ the step
    @property
    def overlapped(self) -> bool:
        return self.buckets is not None

    def stats(self) -> dict[str, Any]:
        """``overlap`` and ``buckets_in_backward`` of the last step (overlapped only)."""
        if self.buckets is None:
            return {}
        return {"overlap": self.buckets.overlap, "buckets_in_backward": self.buckets.launched_in_backward}

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.buckets.no_sync() if self.buckets is not None else contextlib.nullcontext()

    def flush(self) -> None:
        """The start of ``step()``, before the non-finite agreement: launch, in order, every
        bucket backward did not (every rank then issues the same sequence)."""
        if self.buckets is None:
            return
        opt = self.opt
        if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
            raise ValueError(
                f"{type(opt).__name__}(overlap=True) exchanged the gradients during backward, before GradScaler "
                "could unscale them or find infs: use overlap=False with GradScaler"
            )
        self.buckets.flush()

    def run(self, step: int) -> None:
        """Step ``step`` (every rank agreed its gradients are finite): launch the one-shot
        exchange, land every bucket's average, clip it where it is the gradients', apply."""
        opt, wire = self.opt, self.opt._stages.wire
        if not wire.exchanged:
            opt._clip_local_grads()
            opt._apply(wire, None)
            return
        if self.buckets is None:
            if wire.formed:
                opt._clip_local_grads()
            self._launch(0, step, opt._active, agreed=True)
        land = self._landing(wire)
        for c in self._flights:  # every all-gather in flight before waiting on one
            if c is not None and not isinstance(c, tuple):
                c.advance_added()
        for b, flight in enumerate(self._flights):
            start, end = self.spans[b]
            if isinstance(flight, tuple):
                comm.run_stages(flight[0])
            elif flight is not None and isinstance(land, Tensor):
                flight.finish_added(land[start:end])
            elif flight is not None:
                flight.finish_added_by_chunks(lambda a, z, values, lo=start: land(lo + a, lo + z, values))
        self._end_step()
        if not wire.formed and isinstance(land, Tensor):
            opt._clip_grad_(land)
        opt._apply(wire, land if isinstance(land, Tensor) else None)

    def abandon(self) -> None:
        """Every rank skips the step: wait for the exchanges launched and drop them. A compressed
        one took its values into the error-feedback buffers before any rank could know: they
        restart at zero."""
        for flight in self._flights:
            if isinstance(flight, tuple):
                flight[1].wait()
                flight[0].close()
            elif flight is not None:
                flight.abandon()
        if self._compressed_in_flight:
            for c in self.collectives:
                if c is not None:
                    c.reset()
            _log.warning("%s: step skipped after the overlapped exchange had started: error-feedback buffers "
                         "restarted at zero", type(self.opt).__name__)
        self._end_step()

    def done(self) -> int:
        """Bytes sent by the launches during backward (outside ``step()``'s own meter)."""
        return 0 if self.buckets is None else self.buckets.done()

    def _end_step(self) -> None:
        self._flights = [None] * len(self.bounds)
        self._compressed_in_flight = False
        self._land = None

    def _landing(self, wire: Wire) -> Tensor | Consume:
        """Where this step's average lands, asked of the optimizer once per step."""
        if self._land is None:
            self._land = self.opt._landing(wire)
        return self._land

    # ------------------------------------------------------------------ a bucket
    def _launch_in_backward(self, b: int) -> None:
        if not self.opt._stages.wire.exchanged:
            return
        params = self.opt.flat.params
        self._launch(b, self.opt._step_count + 1, [p.requires_grad or p.grad is not None for p in params],
                     agreed=False)

    def _launch(self, b: int, step: int, live: Sequence[bool], *, agreed: bool) -> None:
        """Form bucket ``b``'s input for step ``step`` and start its exchange. ``live[i]``: parameter
        ``i`` takes a gradient this step (one-shot: some rank has one; during backward: it is
        trainable or has one here); the others' state enters as it is. ``agreed``: launched in
        ``step()``, once every rank agreed to take it."""
        opt, wire = self.opt, self.opt._stages.wire
        lo, hi, members = self.bounds[b]
        start, end = self.spans[b]
        collective = None if wire.exact else self.collectives[b]
        self._compressed_in_flight |= collective is not None
        # Added into the collective's worker error where what is formed must stay out of the
        # landing buffer (a bucket formed during backward, before the ranks agreed to step) or
        # where the average is handed out chunk by chunk; otherwise formed in place where the
        # average lands and exchanged there, as the one-shot step does: a pass fewer over the
        # model, since the collective's fused compression reads x and e together.
        added = collective is not None and collective.reduces_added_input and (
            self.buckets is not None or not isinstance(self._landing(wire), Tensor))
        if added:
            self._form(collective.input_buffer(end - start, opt.flat.device), lo, members, wire, step, live, agreed,
                       add=True)
            collective.start_added()
            self._flights[b] = collective
            return
        land = self._landing(wire)
        self._form(land[lo:hi], lo, members, wire, step, live, agreed, add=False)
        if wire.exact:
            stages = comm.all_reduce_mean_stages(land[lo:hi], opt.process_group, opt.timeout)
        elif collective is None:  # no whole block in this bucket: its values go with the next one
            return
        else:
            stages = collective.stages(land[start:end], out=land[start:end])
        self._flights[b] = (stages, next(stages))

    def _form(self, out: Tensor, base: int, members: Sequence[int], wire: Wire, step: int, live: Sequence[bool],
              agreed: bool, *, add: bool) -> None:
        """What parameters ``members`` send, written (``add``: added) into ``out`` from flat
        offset ``base`` on: their gradients (zeros where missing), or the optimizer's
        ``_form`` block by block, in the parameters' logical order."""
        opt = self.opt
        flat = opt.flat
        if not wire.formed and not add:
            flat.gather_grads(out, members, base=base)
            return
        scratch = torch.empty(2, min(_BLOCK, out.numel()), dtype=torch.float32, device=out.device)
        groups = [g for g in opt.param_groups for _ in g["params"]]  # read now: LR schedulers change them
        for i in members:
            p, (first, last) = flat.params[i], flat.offsets[i]
            g = p.grad.reshape(-1) if p.grad is not None else None  # logical order (a copy if channels_last)
            for at in range(first, last, _BLOCK):
                to = min(at + _BLOCK, last)
                grad = None if g is None else g[at - first : to - first]
                target = out[at - base : to - base]
                if not wire.formed:  # the gradients, added
                    if grad is not None:
                        target.add_(grad)
                    continue
                rows = scratch[:, : to - at]
                opt._form(i, at, to, grad, live[i], groups[i], step, rows, rows[0] if add else target, agreed)
                if add:
                    target.add_(rows[0])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The collectives' errors (and random state): ``{key: state}`` of the one-shot collective,
        or the bucketing and ``{"bucket_" + key: [state or None]}``; nothing without collectives."""
        if all(c is None for c in self.collectives):
            return {}
        if self.buckets is None:
            return {self.key: self.collectives[0].state_dict()}
        return {"bucket_bounds": [[lo, hi] for lo, hi, _ in self.bounds],
                "bucket_" + self.key: [None if c is None else c.state_dict() for c in self.collectives]}

    def load_state_dict(self, state: Mapping[str, Any], own_state: bool) -> None:
        """Restore :meth:`state_dict`; saved with another bucketing, by another rank or on another
        world size, the errors restart at zero (freshly seeded)."""
        if all(c is None for c in self.collectives):
            return
        key = self.key
        saved = state["bucket_" + key] if "bucket_bounds" in state else [state[key]]
        layout = state.get("bucket_bounds")
        mine = None if self.buckets is None else [[lo, hi] for lo, hi, _ in self.bounds]
        same = own_state and (None if layout is None else [list(b) for b in layout]) == mine
        if own_state and not same:
            _log.warning("%s: checkpoint saved with another bucketing (overlap=%s): error-feedback buffers "
                         "restart at zero", type(self.opt).__name__, layout is not None)
        for i, c in enumerate(self.collectives):
            if c is None:
                continue
            if same:
                c.load_state_dict(saved[i])
            else:
                c.reset()


def allreduce_factory(opt: OnebitOptimizer, compressor: Any, *, hierarchical: bool | str,
                      ranks_per_node: int | None, overlap: bool, scales: str = "chunk") -> Callable[[int, int], Any]:
    """``collective(start, end)`` for :class:`Driver`: the compressed all-reduce
    (:func:`onebit.comm.compressed_allreduce`: flat, or Birder's hierarchical one). The
    overlapped exchange needs the flat one: what a bucket forms must stay out of the state
    until ``step()``, so it is added into the collective's worker error, which only the flat
    all-reduce takes. ``scales="tensor"``: a compressor with per-block scales gives every
    parameter's piece of a chunk its own (:func:`check_scales`); ``"chunk"``: one per chunk."""
    per_tensor = check_scales(scales) == "tensor" and compress.get(compressor).blockwise

    def collective(start: int, end: int) -> Any:
        segments = [lo - start for lo, _ in opt.flat.offsets if start < lo < end] if per_tensor else None
        made = comm.compressed_allreduce(compressor, opt.process_group, hierarchical=hierarchical,
                                         ranks_per_node=ranks_per_node, segments=segments, timeout=opt.timeout)
        if overlap and not made.reduces_added_input:
            raise ValueError(f"Invalid hierarchical value with overlap=True: {hierarchical!r} (the overlapped "
                             "exchange needs the flat compressed all-reduce)")
        return made
    return collective


if TYPE_CHECKING:
    from ._base import OnebitOptimizer
