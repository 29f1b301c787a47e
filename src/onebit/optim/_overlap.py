"""Buckets whose exchange starts during backward (``overlap=True``), as DDP's reducer does.

The parameters are grouped into buckets of about ``bucket_cap_mb`` in reverse registration
order -- the order backward produces their gradients -- and each bucket is a contiguous
range of the flat state (the flat layout follows the parameters). A post-accumulate-grad
hook counts each bucket's gradients; when the last one has arrived, the optimizer's
``launch(b)`` starts that bucket's exchange on an asynchronous collective, while backward
goes on with earlier layers.

Collectives must be issued in the same order on every rank, so buckets are launched
strictly in bucket order: a bucket whose gradients are complete waits for every bucket
before it. A bucket that never completes during backward (a parameter unused on this rank,
or trainable only here) is launched by :meth:`Buckets.flush` at the start of ``step()``,
still in order and before the step's non-finite agreement, so every rank issues the same
sequence whatever its own timing.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .. import comm

__all__ = ["Buckets", "bucket_bounds"]


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


class Buckets:
    """The hooks and bookkeeping of the overlapped exchange of one optimizer.

    ``launch(b)`` starts bucket ``b``'s exchange (called once per step for every bucket, in
    order); the optimizer finishes them in ``step()``. Of the last step: the number of buckets
    ``launched_in_backward``, and ``overlap``, the fraction of the exchange's wall time (first
    launch to the last bucket finished) that passed before ``step()`` began, i.e. alongside
    backward.
    """

    def __init__(self, params: Sequence[Tensor], offsets: Sequence[tuple[int, int]], bucket_cap_mb: float,
                 launch: Callable[[int], None]) -> None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
            raise ValueError(f"Invalid bucket_cap_mb value: {bucket_cap_mb!r} (expected a positive number)")
        self.bounds = bucket_bounds(offsets, max(1, int(bucket_cap_mb * 2**20 / 4)), [p.dim() == 1 for p in params])
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
