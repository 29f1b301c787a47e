"""The one exchange driver: what every onebit optimizer sends, one-shot or bucketed and overlapped.

The driver is the optimizer floor's lower half: it is handed the flat layout, the process
group and the collectives when the optimizer is built, and before each step a :class:`Plan`
-- the stage's :class:`Wire`, how to form what is sent, where the average lands -- and it
returns the step's average. The optimizer's base (:class:`~onebit.optim.OnebitOptimizer`) is
its only caller, and it reads nothing of the optimizer; it calls back into it through the plan
(``form``, ``landing``) and :meth:`Driver.run`'s ``landed``.

Each stage declares its :class:`Wire` -- what is sent (the gradients themselves, or what
the optimizer forms) and how (the mean by an all-reduce, or the optimizer's compressed collective) --
and the driver does the rest for every optimizer alike: without overlap, one bucket spanning
the whole model, launched in ``step()`` once every rank agreed the gradients are finite;
with ``overlap=True``, DDP's scheme: the parameters are grouped into buckets of about
``bucket_cap_mb`` in reverse registration order -- the order backward produces their
gradients -- each a contiguous range of the flat state, and a post-accumulate-grad hook
launches a bucket's exchange once its gradients are all in, while backward goes on with
earlier layers. With ``overlap="warmup"`` (1-bit Adam's and 1-bit LAMB's default) only the
all-reduce does so, in buckets of its own over a duplicate of the group, and a compressed
stage keeps the one-shot exchange. No optimizer knows about buckets.

Collectives must be issued in the same order on every rank, so buckets are launched
strictly in bucket order: a bucket whose gradients are complete waits for every bucket
before it. A bucket that never completes during backward (a parameter unused on this rank,
or trainable only here) is launched by :meth:`Driver.flush` at the start of ``step()``,
still in order and before the step's non-finite agreement, so every rank issues the same
sequence whatever its own timing.

A compressed bucket's second phase (the server average and its all-gather) starts when the
next bucket's all-to-all has been launched (an :class:`onebit.comm.Pipeline`), the last one's
in ``step()`` right after the step's non-finite agreement is launched (:meth:`Driver.gather`):
the order is ``a2a(0), a2a(1), ag(0), a2a(2), ag(1), ..., a2a(n-1), ag(n-2)``, the agreement,
``ag(n-1)``, on every rank whatever its timing, and the link always holds the next bucket's
bytes while one is averaged. The agreement
then waits on a busy link for the bytes before it only, and an optimizer that
``applies_by_bucket`` steps each bucket as it lands (:meth:`Driver.run`'s ``landed``), the
buckets before the last while the last one's all-gather is on the wire. Waiting for the
previous bucket's all-to-all holds backward only while the link is busy with the bucket
before: where the link is the bottleneck, that costs nothing.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import comm, compress
from ..comm import Consume
from .._checks import check_scales

from ._flat import starts_inside

if TYPE_CHECKING:
    from ._flat import FlatState

__all__ = ["COMPRESSED_FORMED", "COMPRESSED_GRADIENT", "Buckets", "Driver", "EXACT_GRADIENT", "LOCAL", "Plan", "Sends",
           "Wire", "allreduce_factory", "bucket_bounds"]

_log = logging.getLogger("onebit.optim")


def bucket_bounds(offsets: Sequence[tuple[int, int]], cap: int, vectors: Sequence[bool] | None = None,
                  first: int | None = None) -> list[tuple[int, int, list[int]]]:
    """``(lo, hi, parameter indices)`` of each bucket, last parameters first; a bucket is closed
    before a parameter that would take it past ``cap`` values (``first``, if given, for the first
    bucket: DDP's 1 MB, so that the link starts with backward's first gradients; a larger
    parameter is a bucket of its own), so the first bucket -- the last layers -- leaves as early
    as possible.

    ``vectors[i]``: parameter ``i`` is 1-D. The 1-D parameters registered right after the one
    that opens a new bucket move into it with it: a layer registers its weight and then its
    bias, and backward produces both at once, so a bucket that kept the bias would wait for
    the weight anyway."""
    vectors = vectors or [False] * len(offsets)
    groups: list[list[int]] = []
    members: list[int] = []
    for i in reversed(range(len(offsets))):
        if members and offsets[members[0]][1] - offsets[i][0] > (cap if groups or first is None else min(cap, first)):
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


# DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES, 1 MB), in fp32 values.
_FIRST_BUCKET = (1 << 20) // 4


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
                 launch: Callable[[int], None], *, strict: bool = True) -> None:
        self.bounds = bounds
        self._launch = launch
        self._params = params
        # strict (overlap=True): a second gradient before step() raises. Otherwise (the warm-up's
        # exchange, by default) it makes what left during backward stale: see stale().
        self._strict = strict
        self.active = True  # False: the hooks do nothing (a stage exchanged in step() alone)
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
        # each parameter whose gradient a launch in backward read: the gradient and its version then
        self._sent: list[tuple[Tensor, Tensor | None, int]] = []
        self._second = False  # a parameter received a second gradient before step()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside the block; the backward after it starts the exchange."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def _on_grad(self, param: Tensor) -> None:
        if self._paused or not self.active or self._second:
            return
        i = self._index[id(param)]
        if self._seen[i] and not self._strict:
            self._second = True  # accumulation outside no_sync(): step() exchanges the whole sum again
            return
        if self._seen[i]:
            raise RuntimeError(
                f"parameter {i} (shape {tuple(param.shape)}) received a second gradient before step(): with "
                "overlap=True its bucket's exchange started at the first one. Accumulate gradients inside "
                "`with optimizer.no_sync():` for every micro-batch but the last, as with DDP"
            )
        self._seen[i] = True
        b = self._bucket_of[i]
        self._waiting[b] -= 1
        if not self._waiting[b]:
            comm.instant("ready", "backward", bucket=b)
        while self._next < len(self.bounds) and self._waiting[self._next] <= 0:
            if not self._strict:
                for j in self.bounds[self._next][2]:
                    p = self._params[j]
                    self._sent.append((p, p.grad, -1 if p.grad is None else p.grad._version))
            with comm.measure() as meter:  # outside step(), whose meter counts the rest
                self._start(self._next)
            self.bytes_sent += meter.bytes_sent
            self._in_backward += 1

    def stale(self) -> bool:
        """Whether what left during backward is no longer this rank's gradients (``strict=False``):
        a parameter received a second gradient before ``step()`` (accumulation outside
        :meth:`no_sync`), or a gradient sent was changed in place or replaced since (a clip,
        ``p.grad = ...``): its tensor's version counter tells (a write through ``.data`` does not
        move it). GradScaler's scaled gradients are the driver's to see (:meth:`Driver.flush`)."""
        return self._second or any(p.grad is not g or (g is not None and g._version != v) for p, g, v in self._sent)

    def _start(self, b: int) -> None:
        if self._first_launch is None:
            self._first_launch = time.perf_counter()
        with torch.no_grad(), comm.labelled(bucket=b), comm.span("launch", "backward"):
            self._launch(b)
        self._next = b + 1

    def flush(self) -> None:
        """Launch, in order, every bucket backward did not (the start of ``step()``)."""
        if not self.active:
            return
        self._backward_end = time.perf_counter()
        while self._next < len(self.bounds):
            self._start(self._next)

    def done(self) -> int:
        """Close the step: record the overlap, reset the bookkeeping; returns the bytes sent
        by the launches (outside ``step()``'s own meter)."""
        if self._first_launch is not None and self._backward_end is not None:
            total = time.perf_counter() - self._first_launch
            self.overlap = max(0.0, self._backward_end - self._first_launch) / total if total > 0 else 0.0
        elif not self.active:
            self.overlap = 0.0
        sent, self.bytes_sent = self.bytes_sent, 0
        self.launched_in_backward, self._in_backward = self._in_backward, 0
        self._reset()
        return sent


class Sends(enum.Enum):
    """The kinds of step, by what they send. ``GRADIENTS``: the gradients' mean (an all-reduce, in
    the :class:`Wire`'s ``dtype``: exact in fp32); ``COMPRESSED_GRADIENTS``: the gradients,
    through the optimizer's compressed collectives; ``FORMED``: what the optimizer's ``_form``
    makes (momentum, an update), through them; ``NOTHING``: a step each rank takes on its own
    (0/1 Adam's local steps), whose ``_apply`` gets no average and reads the local gradients
    itself."""

    GRADIENTS = "gradients"
    COMPRESSED_GRADIENTS = "compressed gradients"
    FORMED = "formed"
    NOTHING = "nothing"


@dataclass(frozen=True)
class Wire:
    """What a stage sends, as an optimizer declares it: ``stage``, its name in
    ``stats["stage"]`` (``"warmup"``: uncompressed, ``"compressed"``, ...), the kind of step
    it ``sends``, and the ``dtype`` the gradients' all-reduce sums in (``Sends.GRADIENTS`` only;
    fp32: their exact mean). Read from the kind: ``formed``, the gradients are not what is sent
    (the optimizer forms it, or sends nothing) -- where the gradients are sent, their average
    exists and ``max_grad_norm`` clips it; where they are not, it never exists and each rank clips
    its own gradients before forming (what ``clip_grad_norm_`` does on one process);
    ``all_reduced``, the gradients' mean by an all-reduce; ``exchanged``, something is sent."""

    stage: str
    sends: Sends
    dtype: torch.dtype = torch.float32
    formed: bool = field(init=False)
    all_reduced: bool = field(init=False)
    exchanged: bool = field(init=False)

    def __post_init__(self) -> None:
        # set once (a frozen dataclass), read as plain attributes by every step
        object.__setattr__(self, "formed", self.sends in (Sends.FORMED, Sends.NOTHING))
        object.__setattr__(self, "all_reduced", self.sends is Sends.GRADIENTS)
        object.__setattr__(self, "exchanged", self.sends is not Sends.NOTHING)


EXACT_GRADIENT = Wire("warmup", Sends.GRADIENTS)
COMPRESSED_GRADIENT = Wire("compressed", Sends.COMPRESSED_GRADIENTS)
COMPRESSED_FORMED = Wire("compressed", Sends.FORMED)
LOCAL = Wire("local", Sends.NOTHING)


@dataclass(frozen=True)
class Plan:
    """What one step sends, handed to the :class:`Driver` by the optimizer before the step's
    backward (its buckets may leave during it).

    ``wire``: the stage's :class:`Wire`; ``step``: the step's number; ``form(out, base,
    members, live, agreed, add)``: write (``add``: add) into ``out``, from flat offset ``base``
    on, what parameters ``members`` send (``live[i]``: parameter ``i`` takes a gradient this
    step; ``agreed``: every rank agreed to take the step); ``landing()``: where the average
    lands -- a flat fp32 buffer, or ``consume(lo, hi, values)`` handed it chunk by chunk --
    asked at most once per step, right before it is first written."""

    wire: Wire
    step: int
    form: Callable[[Tensor, int, Sequence[int], Sequence[bool], bool, bool], None]
    landing: Callable[[], Tensor | Consume]


class Driver:
    """Runs one optimizer's exchange, step after step (see the module docstring): handed the
    flat layout, the process group and the collectives at construction and a :class:`Plan`
    before each step, it returns each step's average (calling the optimizer back only through
    the plan and ``landed``).

    ``collective(start, end)`` makes the compressed collective of the flat values
    ``[start, end)`` (``None``: the optimizer has none; it may return None for a span it cannot
    exchange, which then sends nothing). A bucket of the overlapped exchange sends the values of
    its span: its own range, or with ``alignment`` > 1 (Block-Sign's blocks of the fused
    gradient) from the first multiple of ``alignment`` inside it to where the span of the bucket
    launched before it starts, so that no block straddles two exchanges; a bucket with an empty
    span sends nothing, its values going with the next one.

    A bucket's input is formed where its average lands and exchanged in place (the
    collective's ``stages``), except where it must stay out of that buffer -- a bucket formed
    during backward, before the ranks agreed to step -- or where the average is handed out
    chunk by chunk: it is then added into the worker error of a collective that
    ``reduces_added_input`` (no model-sized buffer for either). ``key`` names the
    collectives' entry in checkpoints; ``owner`` names the optimizer in messages.
    """

    def __init__(self, flat: FlatState, group: comm.Group, timeout: timedelta,
                 collective: Callable[[int, int], Any] | None, *, overlap: bool | str, bucket_cap_mb: float,
                 alignment: int = 1, key: str = "allreduce", owner: str = "",
                 warm_group: comm.Group = None) -> None:
        self.flat, self.group, self.timeout, self.key, self.owner = flat, group, timeout, key, owner
        self.buckets: Buckets | None = None
        vectors = [p.dim() == 1 for p in flat.params]  # (bucket_bounds: a bias goes with its weight)
        self.bounds = bucket_bounds(flat.offsets, _bucket_cap(bucket_cap_mb), vectors) \
            if overlap is True else [(0, flat.numel, list(range(len(flat.params))))]
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
        if overlap is True:
            self.buckets = Buckets(flat.params, self.bounds, self._launch_in_backward)
        # overlap="warmup": the exact exchange (the warm-up's fp32 mean of the gradients) leaves during
        # backward in buckets of its own, as DDP's all-reduce does; a compressed stage keeps the
        # one-shot exchange in step(), and with it its bits and what it allows (a clip of each rank's
        # gradients, GradScaler, accumulation without no_sync()). The buckets go over ``warm_group``,
        # a duplicate of the group: which of them leave during backward differs between ranks (a
        # parameter unused on one), and on the user's group that would interleave them with the
        # user's own collectives (a loss all-reduced before step(), SyncBatchNorm) in another order
        # on each rank.
        self._warm_group = warm_group
        self._warm: list[tuple[int, int, list[int]]] | None = None
        self._warm_flights = comm.Pipeline()  # the warm-up's exact means, completed in step()
        self._stale = False  # this step's warm-up buckets sent in backward are stale on this rank
        self._warm_off = False  # a step found them stale: the warm-up exchanges in step() from then on
        if overlap == "warmup":
            self._warm = bucket_bounds(flat.offsets, _bucket_cap(bucket_cap_mb), vectors, first=_FIRST_BUCKET)
            self.buckets = Buckets(flat.params, self._warm, self._launch_warm, strict=False)
        self._plan: Plan | None = None
        self._flights = comm.Pipeline()  # the buckets' exchanges, a phase behind the next
        self._compressed_in_flight = False
        self._land: Tensor | Consume | None = None

    # ------------------------------------------------------------------ the step
    def stats(self) -> dict[str, Any]:
        """``overlap`` and ``buckets_in_backward`` of the last step (overlapped only)."""
        if self.buckets is None:
            return {}
        return {"overlap": self.buckets.overlap, "buckets_in_backward": self.buckets.launched_in_backward}

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.buckets.no_sync() if self.buckets is not None else contextlib.nullcontext()

    def plan(self, plan: Plan) -> None:
        """What the next step sends (before its backward: its buckets may leave during it)."""
        self._plan = plan
        if self._warm is not None:  # (buckets already launched in this step are all sent)
            self.buckets.active = self.warmup_in_backward and plan.wire.all_reduced or bool(self._warm_flights)

    @property
    def warmup_in_backward(self) -> bool:
        """Whether the exact exchange leaves during backward (``overlap="warmup"``, until a step
        found it stale on some rank: then it runs in ``step()`` from there on)."""
        return self._warm is not None and not self._warm_off

    def stop_warmup_in_backward(self, why: str) -> None:
        """The exact exchange runs in ``step()`` from the next step on (``why``: logged)."""
        if self.warmup_in_backward:
            self._warm_off = True
            self.buckets.active = bool(self._warm_flights)  # those launched in this step are all sent
            _log.info("%s: the warm-up's fp32 exchange runs in step() from now on, not during backward (%s)",
                      self.owner, why)

    @property
    def stale(self) -> bool:
        """This rank's warm-up buckets sent during backward are stale (set by :meth:`flush`); the step's
        agreement tells every rank, and :meth:`run` exchanges again in ``step()`` if any was."""
        return self._stale

    def flush(self, *, scaled: bool = False) -> None:
        """The start of ``step()``, before the non-finite agreement: launch, in order, every
        bucket backward did not (every rank then issues the same sequence), and the second phase
        of every bucket but the last (:meth:`gather` starts it). ``scaled``: a
        GradScaler handed the step gradients still scaled, which buckets sent during backward
        could not wait for."""
        if self.buckets is None or not self.buckets.active:
            return
        if self._warm is not None:
            # Every rank launches every bucket, stale or not: the same collectives in the same order.
            self._stale = scaled or self.buckets.stale()
            self.buckets.flush()
            return
        if scaled:
            raise ValueError(f"{self.owner}(overlap=True) exchanged the gradients during backward, before "
                             "GradScaler could unscale them or find infs: use overlap=False with GradScaler")
        self.buckets.flush()  # (every bucket's second phase but the last's, which gather() starts)

    def gather(self) -> None:
        """Start the second phase of every bucket still waiting for it (the last one's, once the
        step's agreement is launched: see the module docstring)."""
        self._flights.catch_up()

    def run(self, live: Sequence[bool], landed: Callable[[Tensor, Sequence[int]], None] | None = None, *,
            stale: bool = False) -> Tensor | None:
        """The planned step, which every rank agreed to take (``live[i]``: parameter ``i`` has a
        gradient on some rank): launch the one-shot exchange, land every bucket's average;
        returns it (None where it was handed out chunk by chunk). ``landed(average, members)``,
        where given, is called as each bucket lands, in bucket order, with the step's buffer
        (landed for that bucket's parameters ``members``) -- the others may still be in flight;
        only where :attr:`lands_by_bucket`. A collective that fails leaves the buckets before
        its own applied. ``stale``: some rank's warm-up buckets sent during backward are stale (the
        step's agreement of :attr:`stale`): they are dropped, the exchange runs here again, and in
        ``step()`` from now on."""
        if self._warm_flights:
            if not stale:
                land = self._landing()
                self._warm_flights.finish(None if landed is None else lambda b, _: landed(land, self._warm[b][2]))
                self._end_step()
                return land
            self._warm_flights.drop()
            self.stop_warmup_in_backward("the gradients changed after their bucket left: accumulation outside "
                                         "no_sync(), GradScaler, a clip or another change of p.grad before step()")
        if self.buckets is None or self._warm is not None:
            for b in range(len(self.bounds)):
                with comm.labelled(bucket=b):
                    self._launch(b, live, agreed=True)
        land = self._landing()
        self._flights.catch_up()  # every added bucket's all-gather in flight first
        self._flights.finish(None if landed is None else lambda b, _: landed(land, self.bounds[b][2]))
        self._end_step()
        return land if isinstance(land, Tensor) else None

    def abandon(self) -> None:
        """Every rank skips the step: wait for the exchanges launched and drop them. A compressed
        one took its values into the error-feedback buffers before any rank could know: they
        restart at zero."""
        self._warm_flights.drop()
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

    def done(self) -> int:
        """Bytes sent outside ``step()``'s own meter: by the launches during backward."""
        return 0 if self.buckets is None else self.buckets.done()

    def _end_step(self) -> None:
        # (the pipelines are empty: finish() and drop() forget what they ran)
        self._stale = False
        self._compressed_in_flight = False
        self._land = None

    def _landing(self) -> Tensor | Consume:
        """Where this step's average lands, asked of the plan once per step."""
        if self._land is None:
            self._land = self._plan.landing()
        return self._land

    # ------------------------------------------------------------------ a bucket
    def _launch_warm(self, b: int) -> None:
        """Warm-up bucket ``b``'s gradients into where the average lands, and their exact mean started."""
        lo, hi, members = self._warm[b]
        land = self._landing()[lo:hi]
        self._plan.form(land, lo, members, [True] * len(self.flat.params), False, False)
        stages = comm.all_reduce_mean_stages(land, self._warm_group, self.timeout, divide_first=True,
                                             dtype=self._plan.wire.dtype)
        self._warm_flights.launch(stages, bucket=b, lags=False)

    def _launch_in_backward(self, b: int) -> None:
        if not self._plan.wire.exchanged:
            return
        if not self._launch(b, [p.requires_grad or p.grad is not None for p in self.flat.params], agreed=False):
            self._flights.catch_up()  # (all before b: the second phases a launch of b would have started)

    def _launch(self, b: int, live: Sequence[bool], *, agreed: bool) -> bool:
        """Form bucket ``b``'s input for the planned step and start its exchange (whether it sent
        anything), a phase behind the next: an added bucket's second phase starts when the next
        bucket's first has left (see the module docstring); the others -- one collective, or
        the one-shot exchange -- run to their end in ``step()``. ``live[i]``: parameter ``i``
        takes a gradient this step (one-shot: some rank has one; during backward: it is
        trainable or has one here); the others' state enters as it is. ``agreed``: launched in
        ``step()``, once every rank agreed to take it."""
        wire, form = self._plan.wire, self._plan.form
        lo, hi, members = self.bounds[b]
        start, end = self.spans[b]
        collective = None if wire.all_reduced else self.collectives[b]
        self._compressed_in_flight |= collective is not None
        # Added into the collective's worker error where what is formed must stay out of the
        # landing buffer (a bucket formed during backward, before the ranks agreed to step) or
        # where the average is handed out chunk by chunk; otherwise formed in place where the
        # average lands and exchanged there, as the one-shot step does: a pass fewer over the
        # model, since the collective's fused compression reads x and e together.
        added = collective is not None and collective.reduces_added_input and (
            not agreed or not isinstance(self._landing(), Tensor))
        if added:
            form(collective.input_buffer(end - start, self.flat.device), lo, members, live, agreed, True)
            # Where the average lands is asked once it is gathered, in step(): the ranks agreed then.
            stages = collective.stages(None, land=lambda start=start, end=end: self._landed(start, end))
            self._flights.launch(stages, bucket=b)
            return True
        land = self._landing()
        form(land[lo:hi], lo, members, live, agreed, False)
        if wire.all_reduced:
            stages = comm.all_reduce_mean_stages(land[lo:hi], self.group, self.timeout, dtype=wire.dtype)
        elif collective is None:  # no whole block in this bucket: its values go with the next one
            return False
        else:
            stages = collective.stages(land[start:end], out=land[start:end])
        self._flights.launch(stages, bucket=b, lags=False)
        return True

    def _landed(self, start: int, end: int) -> Tensor | Consume:
        """Where the average of the flat values ``[start, end)`` lands: that span of the step's
        buffer, or the step's ``consume`` shifted to it."""
        land = self._landing()
        if isinstance(land, Tensor):
            return land[start:end]
        return lambda a, z, values: land(start + a, start + z, values)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The collectives' errors (and random state): ``{key: state}`` of the one-shot collective,
        or the bucketing and ``{"bucket_" + key: [state or None]}``; nothing without collectives."""
        state: dict[str, Any] = {}
        if self._warm is not None:  # the exchange of a resumed warm-up leaves where it did (the same bits)
            state["warmup_in_backward"] = self.warmup_in_backward
        if all(c is None for c in self.collectives):
            return state
        if len(self.bounds) == 1:
            return {**state, self.key: self.collectives[0].state_dict()}
        return {**state, "bucket_bounds": [[lo, hi] for lo, hi, _ in self.bounds],
                "bucket_" + self.key: [None if c is None else c.state_dict() for c in self.collectives]}

    def load_state_dict(self, state: Mapping[str, Any], own_state: bool) -> None:
        """Restore :meth:`state_dict`; saved with another bucketing, by another rank or on another
        world size, the errors restart at zero (freshly seeded)."""
        self._warm_off = self._warm_off or not state.get("warmup_in_backward", True)
        if all(c is None for c in self.collectives):
            return
        key = self.key
        saved = state["bucket_" + key] if "bucket_bounds" in state else [state[key]]
        # one bucket spanning the model is the one-shot layout, however it was saved
        layout = state.get("bucket_bounds")
        layout = None if layout is None or [list(b) for b in layout] == [[0, self.flat.numel]] \
            else [list(b) for b in layout]
        mine = None if len(self.bounds) == 1 else [[lo, hi] for lo, hi, _ in self.bounds]
        same = own_state and layout == mine
        if own_state and not same:
            _log.warning("%s: checkpoint saved with another bucketing (overlap=%s): error-feedback buffers "
                         "restart at zero", self.owner, layout is not None)
        for i, c in enumerate(self.collectives):
            if c is None:
                continue
            if same:
                c.load_state_dict(saved[i])
            else:
                c.reset()


def allreduce_factory(offsets: Sequence[tuple[int, int]], group: comm.Group, timeout: timedelta, compressor: Any, *,
                      hierarchical: bool | str, ranks_per_node: int | None, overlap: bool,
                      scales: str = "chunk") -> Callable[[int, int], Any]:
    """``collective(start, end)`` for :class:`Driver`: the compressed all-reduce
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
