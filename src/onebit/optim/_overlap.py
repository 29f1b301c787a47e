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

:class:`OverlappedExchange` is what an optimizer adds to use them: one collective per bucket,
the exact fp32 all-reduce of a warm-up stage, and the compressed all-reduce whose input
each optimizer forms block by block (:meth:`OverlappedExchange._bucket_input`).
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
from ._functional import _BLOCK

__all__ = ["Buckets", "OverlappedExchange", "bucket_bounds", "collectives_state", "load_collectives_state",
           "restart_errors"]

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


class OverlappedExchange:
    """The overlapped exchange (``overlap=True``) of an :class:`~onebit.optim.OnebitOptimizer`
    whose compressed all-reduce takes its input added into the worker error
    (``reduces_added_input``).

    Each bucket has its own collective (its own chunks, errors and wire buffers: together
    the one-shot collective's sizes); ``self.allreduce`` is the first bucket's, so the
    one-shot exchange never runs. A bucket's launch, during backward, is the exact fp32
    all-reduce of its gradients into ``self._grad`` in a ``"warmup"`` stage, else the
    compressed all-to-all of ``e + x`` with ``x`` the subclass's
    :meth:`_bucket_input`, formed block by block from the state as it was before the
    step and the gradients -- the state itself changes only in ``step()``, after every
    rank agreed the gradients are finite. The subclass's ``_step`` calls
    :meth:`_finish_buckets`. A skipped step restarts the error-feedback buffers at zero:
    they took in the values before any rank could know.
    """

    allreduce: Any
    flat: Any
    process_group: comm.Group
    timeout: Any
    max_grad_norm: float | None
    _grad: Tensor | None
    _buckets: Buckets | None
    param_groups: list[dict[str, Any]]
    _stage: Callable[[], str]
    _restore_collective: Callable[[Any, Mapping[str, Any], bool], None]

    def _use_buckets(self, bucket_cap_mb: float, collective: Callable[[], Any], *, hierarchical: object,
                     clips_locally: bool = True) -> None:
        """Turn the overlapped exchange on; ``collective()`` makes a bucket's compressed all-reduce.
        ``clips_locally``: ``max_grad_norm`` clips each rank's own gradients over all parameters,
        which the first bucket's exchange cannot wait for (refused)."""
        if clips_locally and self.max_grad_norm is not None:
            raise ValueError(f"Invalid max_grad_norm value with overlap=True: {self.max_grad_norm!r} (the "
                             f"{type(self).__name__} step clips each rank's gradient over all parameters, which the "
                             "first bucket's exchange cannot wait for); use overlap=False to clip")
        if not self.allreduce.reduces_added_input:
            raise ValueError(f"Invalid hierarchical value with overlap=True: {hierarchical!r} (the overlapped "
                             "exchange needs the flat compressed all-reduce)")
        self._buckets = Buckets(self.flat.params, self.flat.offsets, bucket_cap_mb, self._launch_bucket)
        self._bucket_allreduce = [self.allreduce] + [collective() for _ in self._buckets.bounds[1:]]
        self._bucket_pending: list[comm.Pending | None] = [None] * len(self._buckets.bounds)

    def _bucket_input(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, options: dict[str, Any],
                      scratch: Tensor) -> Tensor | None:
        """Values ``[lo, hi)`` (flat offsets, inside parameter ``i``) of what this rank exchanges,
        as ``step()`` without overlap would form them (the same operations: the same bits), or
        None for zeros. ``grad``: that block of the parameter's gradient in logical order (None
        where it has none here); ``live``: the parameter can have one (trainable, or holding
        one), else it is frozen and its state enters as it is; ``options``: its param group;
        ``scratch``: two rows of ``hi - lo`` fp32 values."""
        raise NotImplementedError

    def _launch_bucket(self, b: int) -> None:
        """Start bucket ``b``'s exchange (see the class docstring)."""
        lo, hi, members = self._buckets.bounds[b]
        if self._stage() == "warmup":
            self.flat.gather_grads(self._grad[lo:hi], members, base=lo)
            self._bucket_pending[b] = comm.all_reduce_mean(self._grad[lo:hi], self.process_group, self.timeout,
                                                           async_op=True)
            return
        collective = self._bucket_allreduce[b]
        c = collective.input_buffer(hi - lo, self.flat.device)
        scratch = torch.empty(2, min(_BLOCK, hi - lo), dtype=torch.float32, device=c.device)
        groups = [g for g in self.param_groups for _ in g["params"]]  # read now: LR schedulers change them
        for i in members:
            p, (start, end) = self.flat.params[i], self.flat.offsets[i]
            g = p.grad.reshape(-1) if p.grad is not None else None  # logical order (a copy if channels_last)
            live = p.requires_grad or p.grad is not None
            for at in range(start, end, _BLOCK):
                to = min(at + _BLOCK, end)
                x = self._bucket_input(i, at, to, None if g is None else g[at - start : to - start], live,
                                       groups[i], scratch[:, : to - at])
                if x is not None:
                    c[at - lo : to - lo].add_(x)
        collective.start_added()

    def _finish_buckets(self, out: Tensor | None = None,
                        consume: Callable[[int, int, Tensor], None] | None = None) -> None:
        """Wait for every bucket's exchange: the averaged gradients in ``self._grad`` (warm-up), or
        the compressed averages written to the flat ``out`` or handed to ``consume(lo, hi,
        values)`` chunk by chunk (flat offsets; ``values`` is scratch)."""
        if self._stage() == "warmup":
            self._wait_allreduces()
            return
        for collective in self._bucket_allreduce:  # every all-gather in flight before waiting on one
            collective.advance_added()
        for (lo, hi, _), collective in zip(self._buckets.bounds, self._bucket_allreduce):
            if out is not None:
                collective.finish_added(out[lo:hi])
            else:
                collective.finish_added_by_chunks(lambda a, b, values, lo=lo: consume(lo + a, lo + b, values))

    def _wait_allreduces(self) -> None:
        """Wait for the warm-up's bucket all-reduces in flight (the averages land in ``_grad``)."""
        for b, pending in enumerate(self._bucket_pending):
            if pending is not None:
                pending.wait()
                self._bucket_pending[b] = None

    def _abandon_buckets(self) -> None:
        """Every rank skips this step: wait for and drop the exchanges already launched."""
        self._wait_allreduces()
        if self._stage() != "warmup":
            for collective in self._bucket_allreduce:
                collective.abandon()
            restart_errors(self, self._bucket_allreduce)

    def _collectives(self) -> list[Any]:
        """The compressed all-reduces: the one-shot one, or one per bucket."""
        return [self.allreduce] if self._buckets is None else self._bucket_allreduce

    def _collectives_state(self) -> dict[str, Any]:
        """The collectives' errors (and random state), with the bucketing they belong to."""
        return collectives_state("allreduce", self._buckets, self._collectives())

    def _load_collectives_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        """Restore :meth:`_collectives_state`; saved with another bucketing (or by another rank)
        the errors restart at zero."""
        load_collectives_state(self, "allreduce", state, own_state, self._collectives())


def restart_errors(owner: Any, collectives: Sequence[Any]) -> None:
    """A step skipped after ``owner``'s overlapped exchange had started: the buckets' errors took
    in values before any rank could know, so they restart at zero (None: a bucket without one)."""
    for collective in collectives:
        if collective is not None:
            collective.reset()
    _log.warning("%s: step skipped after the overlapped exchange had started: error-feedback buffers "
                 "restarted at zero", type(owner).__name__)


def collectives_state(key: str, buckets: Buckets | None, collectives: Sequence[Any]) -> dict[str, Any]:
    """The checkpoint of an exchange's compressed collectives: ``{key: state}`` of the one-shot
    collective, or with ``buckets`` the bucketing and ``{"bucket_" + key: [state or None]}``
    (None: a bucket without one)."""
    if buckets is None:
        return {key: collectives[0].state_dict()}
    return {"bucket_bounds": [[lo, hi] for lo, hi, _ in buckets.bounds],
            "bucket_" + key: [None if c is None else c.state_dict() for c in collectives]}


def load_collectives_state(owner: Any, key: str, state: Mapping[str, Any], own_state: bool,
                           collectives: Sequence[Any]) -> None:
    """Restore :func:`collectives_state` into ``collectives`` (``owner``'s, one per bucket);
    saved with another bucketing, or by another rank, the errors restart at zero."""
    saved = state["bucket_" + key] if "bucket_bounds" in state else [state[key]]
    layout = state.get("bucket_bounds")
    mine = None if owner._buckets is None else [[lo, hi] for lo, hi, _ in owner._buckets.bounds]
    same = own_state and (None if layout is None else [list(b) for b in layout]) == mine
    if own_state and not same:
        _log.warning("%s: checkpoint saved with another bucketing (overlap=%s): error-feedback buffers "
                     "restart at zero", type(owner).__name__, layout is not None)
    for i, collective in enumerate(collectives):
        if collective is not None:
            owner._restore_collective(collective, saved[i] if same else {}, same)
