"""The overlap with backward: buckets of parameters, and the hooks that say when one is ready.

With ``overlap=True`` (DDP's scheme) the parameters are grouped into buckets of about
``bucket_cap_mb`` in reverse registration order -- the order backward produces their
gradients -- each a contiguous range of the flat state, and a post-accumulate-grad hook tells
the optimizer, through its one entry ``ready(b)``, once bucket ``b``'s gradients are all in:
the optimizer forms what the bucket sends and hands it to the exchange, while backward goes
on with earlier layers. With ``overlap="warmup"`` (1-bit Adam's and 1-bit LAMB's default) only
the warm-up's exact all-reduce does so, in buckets of its own, and a compressed stage keeps the
one-shot exchange in ``step()``.

Collectives must be issued in the same order on every rank, so buckets are readied strictly in
bucket order: a bucket whose gradients are complete waits for every bucket before it. A
bucket that never completes during backward (a parameter unused on this rank, or trainable
only here) is readied by :meth:`Buckets.flush` at the start of ``step()``, still in order and
before the step's non-finite agreement, so every rank issues the same sequence whatever its
own timing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import comm

__all__ = ["FIRST_BUCKET", "Buckets", "bucket_bounds", "bucket_cap"]

_log = logging.getLogger("onebit.optim")

# DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES, 1 MB), in fp32 values.
FIRST_BUCKET = (1 << 20) // 4


def bucket_bounds(offsets: Sequence[tuple[int, int]], cap: int, vectors: Sequence[bool] | None = None,
                  first: int | None = None, *, past: bool = False) -> list[tuple[int, int, list[int]]]:
    """``(lo, hi, parameter indices)`` of each bucket, last parameters first; a bucket is closed
    before a parameter that would take it past ``cap`` values (``first``, if given, for the first
    bucket: DDP's 1 MB, so that the link starts with backward's first gradients; a larger
    parameter is a bucket of its own), so the first bucket -- the last layers -- leaves as early
    as possible. ``past``: DDP's rule instead -- a bucket is closed after the parameter that takes
    it to its limit, which it may exceed (DDP's first bucket of the 12.9M GPT is 4.7 MB).

    ``vectors[i]``: parameter ``i`` is 1-D. The 1-D parameters registered right after the one
    that opens a new bucket move into it with it: a layer registers its weight and then its
    bias, and backward produces both at once, so a bucket that kept the bias would wait for
    the weight anyway (with ``past`` the bias is already in the weight's bucket)."""
    first = cap if first is None else min(cap, first)
    if past:
        return _closed_past(offsets, cap, first)
    vectors = vectors or [False] * len(offsets)
    groups: list[list[int]] = []
    members: list[int] = []
    for i in reversed(range(len(offsets))):
        if members and offsets[members[0]][1] - offsets[i][0] > (cap if groups else first):
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


def _closed_past(offsets: Sequence[tuple[int, int]], cap: int, first: int) -> list[tuple[int, int, list[int]]]:
    """DDP's buckets (``compute_bucket_assignment_by_size``): parameters added last first, a bucket
    closed once it holds ``first`` values (the first one) or ``cap`` (the others)."""
    groups: list[list[int]] = []
    members: list[int] = []
    for i in reversed(range(len(offsets))):
        members.append(i)
        if offsets[members[0]][1] - offsets[i][0] >= (cap if groups else first):
            groups.append(members)
            members = []
    if members:
        groups.append(members)
    return [(offsets[m[-1]][0], offsets[m[0]][1], m[::-1]) for m in groups]


def bucket_cap(bucket_cap_mb: object) -> int:
    """``bucket_cap_mb`` (MB of fp32 values, as DDP's) in values."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
        raise ValueError(f"Invalid bucket_cap_mb value: {bucket_cap_mb!r} (expected a positive number)")
    return max(1, int(bucket_cap_mb * 2**20 / 4))


class Buckets:
    """The hooks and bookkeeping of one optimizer's overlapped exchange.

    ``ready(b)`` is called once per step for every bucket, in order: by a hook once backward
    produced the bucket's gradients, or by :meth:`flush` at the start of ``step()``. Of the
    last step: the number of buckets ``launched_in_backward``, and ``overlap``, the fraction of
    the exchange's wall time (first launch to the end of :meth:`done`'s step) that passed
    before ``step()`` began, i.e. alongside backward.

    ``warmup`` (``overlap="warmup"``): only the warm-up's exact exchange leaves during backward
    (:attr:`active` where the step's stage all-reduces the gradients), until a step finds what
    left stale on some rank (:meth:`stop_warmup_in_backward`); a second gradient before
    ``step()`` makes what left stale instead of raising (see :meth:`flush`).
    """

    def __init__(self, params: Sequence[Tensor], bounds: list[tuple[int, int, list[int]]],
                 ready: Callable[[int], None], *, warmup: bool = False, owner: str = "") -> None:
        self.bounds, self.warmup, self.owner = bounds, warmup, owner
        self._ready = ready
        self._params = params
        self.active = True  # False: the hooks do nothing (a stage exchanged in step() alone)
        self._off = False  # warmup: a step found the buckets stale; they leave in step() from then on
        self.stale = False  # warmup: this step's buckets sent in backward are stale on this rank
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
        self.stale = False

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
        if self._seen[i] and self.warmup:
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
            if self.warmup:
                for j in self.bounds[self._next][2]:
                    p = self._params[j]
                    self._sent.append((p, p.grad, -1 if p.grad is None else p.grad._version))
            with comm.measure() as meter:  # outside step(), whose meter counts the rest
                self._start(self._next)
            self.bytes_sent += meter.bytes_sent
            self._in_backward += 1

    def _changed(self) -> bool:
        """Whether what left during backward is no longer this rank's gradients (``warmup``): a
        parameter received a second gradient before ``step()`` (accumulation outside
        :meth:`no_sync`), or a gradient sent was changed in place or replaced since (a clip,
        ``p.grad = ...``): its tensor's version counter tells (a write through ``.data`` does not
        move it)."""
        return self._second or any(p.grad is not g or (g is not None and g._version != v) for p, g, v in self._sent)

    def _start(self, b: int) -> None:
        if self._first_launch is None:
            self._first_launch = time.perf_counter()
        with torch.no_grad(), comm.labelled(bucket=b), comm.span("launch", "backward"):
            self._ready(b)
        self._next = b + 1

    def flush(self, *, scaled: bool = False) -> None:
        """The start of ``step()``, before the non-finite agreement: ready, in order, every bucket
        backward did not (every rank then issues the same sequence). ``scaled``: a GradScaler
        handed the step gradients still scaled, which buckets sent during backward could not wait
        for: with ``warmup`` they are :attr:`stale` (the step's agreement tells every rank, and the
        exchange runs again in ``step()``); with ``overlap=True``, a ``ValueError``."""
        if not self.active:
            return
        if self.warmup:
            # Every rank readies every bucket, stale or not: the same collectives in the same order.
            self.stale = scaled or self._changed()
        elif scaled:
            raise ValueError(f"{self.owner}(overlap=True) exchanged the gradients during backward, before "
                             "GradScaler could unscale them or find infs: use overlap=False with GradScaler")
        self._backward_end = time.perf_counter()
        while self._next < len(self.bounds):
            self._start(self._next)

    @property
    def warmup_in_backward(self) -> bool:
        """Whether the warm-up's exact exchange leaves during backward (``warmup``, until a step
        found it stale on some rank: then it runs in ``step()`` from there on)."""
        return self.warmup and not self._off

    def stop_warmup_in_backward(self, why: str) -> None:
        """The warm-up's exchange runs in ``step()`` from the next step on (``why``: logged)."""
        if self.warmup_in_backward:
            self._off = True
            self.active = self._next > 0  # (the buckets already readied in this step are all sent)
            _log.info("%s: the warm-up's fp32 exchange runs in step() from now on, not during backward (%s)",
                      self.owner, why)

    def plan(self, all_reduced: bool) -> None:
        """Whether the next step's buckets leave during backward: always with ``overlap=True``;
        with ``warmup``, where its stage all-reduces the gradients (``all_reduced``)."""
        if self.warmup:
            self.active = self.warmup_in_backward and all_reduced

    def done(self) -> int:
        """Close the step: record the overlap, reset the bookkeeping; returns the bytes sent
        by the launches during backward (outside ``step()``'s own meter)."""
        if self._first_launch is not None and self._backward_end is not None:
            total = time.perf_counter() - self._first_launch
            self.overlap = max(0.0, self._backward_end - self._first_launch) / total if total > 0 else 0.0
        elif not self.active:
            self.overlap = 0.0
        sent, self.bytes_sent = self.bytes_sent, 0
        self.launched_in_backward, self._in_backward = self._in_backward, 0
        self._reset()
        return sent

    def stats(self) -> dict[str, Any]:
        """``overlap`` and ``buckets_in_backward`` of the last step."""
        return {"overlap": self.overlap, "buckets_in_backward": self.launched_in_backward}

    def state_dict(self) -> dict[str, Any]:
        # the exchange of a resumed warm-up leaves where it did (the same bits)
        return {"warmup_in_backward": self.warmup_in_backward} if self.warmup else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._off = self._off or not state.get("warmup_in_backward", True)
