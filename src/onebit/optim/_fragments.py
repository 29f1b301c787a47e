"""DiLoCo's fragments: each one's parameters, its exchange and its synchronisation in flight.

A fragment (Streaming DiLoCo, arXiv 2501.18512, section 2) is a set of parameters synchronised
on a schedule of its own. It holds the compressed collectives of its runs of consecutive
parameters (the pieces it sends), forms its outer gradients, launches their exchange and, with
a delay, completes it on a thread of its own while the inner steps go on (``_flight.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import comm, compress
from .._checks import check_bool, check_entries, check_nonneg, check_positive, check_positive_int, check_scales
from ._checkpoint import check_buffers, onebit_entry
from ._flat import FlatState, starts_inside
from ._flight import Flight

__all__ = ["Fragment", "Schedule", "build_fragments", "by_size", "check_exchange", "check_fragments_state",
           "check_state", "default_scales", "fragment_bounds", "fragment_of", "fragments_state", "load_fragments",
           "regroup_fragments", "runs"]


class Schedule:
    """When each of ``fragments`` fragments (an int, or each parameter's fragment) is sent: every
    ``sync_every`` steps, fragment p landing at the steps ``k period`` (``period = sync_every /
    fragments``) with ``k`` congruent to ``p + 1`` modulo the fragments, and sent ``delay``
    steps before (Algorithm 2 of arXiv 2501.18512, torchft's schedule); where it lands, ``x <-
    merge x + (1 - merge) anchor`` (the paper's alpha; None: 0.5 with a delay, else 0)."""

    __slots__ = ("sync_every", "fragments", "delay", "period", "merge")

    def __init__(self, sync_every: int, fragments: int | Sequence[int], delay: int, merge: float | None) -> None:
        given = not isinstance(fragments, int)
        self.sync_every = sync_every
        self.fragments = max(fragments) + 1 if given else check_positive_int("fragments", fragments)
        if sync_every % self.fragments:
            shown = f"{self.fragments} lists" if given else fragments
            raise ValueError(f"Invalid fragments value: {shown} (sync_every={sync_every} must be a multiple of it)")
        self.period = sync_every // self.fragments  # steps between two landings
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < self.period:
            raise ValueError(f"Invalid delay value: {delay!r} (expected an int in [0, {self.period}): "
                             "sync_every / fragments steps between two synchronisations)")
        self.delay = delay
        self.merge = check_nonneg("merge", (0.5 if delay else 0.0) if merge is None else merge)
        if self.merge >= 1 or (self.merge and not delay):
            raise ValueError(f"Invalid merge value: {merge} (expected a number in [0, 1), and 0 with delay=0)")

    def sent_at(self, step: int) -> int | None:
        """The fragment whose synchronisation is sent at ``step`` (None: an inner step alone)."""
        k, early = divmod(step + self.delay, self.period)
        return None if early else (k - 1) % self.fragments


class Fragment:
    """Fragment ``index``: its runs ``(b, lo, hi, members)`` (``b`` numbers the runs of the whole
    model; ``[lo, hi)`` their flat values; ``members`` their parameters), the collective of each
    run (None: the exact fp32 mean), the group and timeout of its exchange, and its
    synchronisation in flight: ``flight``, and ``sent``, which of its parameters had a gradient
    on some rank since its last synchronisation when it was sent (both None: nothing in flight)."""

    __slots__ = ("index", "runs", "members", "collectives", "error_decay", "group", "timeout", "sent", "flight",
                 "retry")

    def __init__(self, index: int, runs: list[tuple[int, int, int, list[int]]], collectives: list[Any],
                 group: comm.Group, timeout: timedelta, error_decay: float = 1.0) -> None:
        self.index, self.runs, self.collectives, self.group, self.timeout = index, runs, collectives, group, timeout
        self.error_decay = error_decay
        self.members = [i for *_, m in runs for i in m]
        self.sent: list[bool] | None = None
        self.flight: Flight | None = None
        # With a quorum: the outer gradients and the collectives' states the flight left with
        self.retry: tuple[dict[int, Tensor], list[Any]] | None = None

    @property
    def exact(self) -> bool:
        """Its exchange is the exact fp32 mean (no compression error to keep)."""
        return all(c is None for c in self.collectives)

    def send(self, anchor: Tensor, params: Sequence[Tensor], offsets: Sequence[tuple[int, int]], touched: list[bool],
             *, lands_at: int, in_flight: bool, live: bool = False) -> None:
        """Form the outer gradients ``anchor - x`` (Algorithm 1 line 9) of each run into a buffer of
        its own, where its average lands, and exchange them: to the end here, or ``in_flight``,
        each run's first collective here and the rest on the flight's thread. ``touched[i]``:
        parameter ``i`` had a gradient on some rank since its last synchronisation (agreed).
        ``live`` (a quorum): keep what :meth:`resend` needs, and leave a failed exchange to
        raise where the flight is joined."""
        self.sent = [touched[i] for i in self.members]
        landing: dict[int, Tensor] = {}
        for b, lo, hi, members in self.runs:
            land = landing[b] = torch.empty(hi - lo, dtype=torch.float32, device=anchor.device)
            for i in members:
                first, last = offsets[i]
                torch.sub(anchor[first:last], params[i].detach().reshape(-1), out=land[first - lo:last - lo])
        if live:
            self.retry = ({b: t.clone() for b, t in landing.items()},
                          [None if c is None else c.state_dict() for c in self.collectives])
        self._exchange(landing, lands_at, in_flight, live)

    def resend(self) -> None:
        """The exchange of the flight that failed, again, over the collectives of the group the
        quorum re-formed: from the outer gradients it left with, the errors restored to theirs
        where they are this rank's own. Completed here. A flight loaded from a checkpoint holds
        its average already, the same on every member: nothing to send again."""
        if self.retry is None:
            return
        deltas, states = self.retry
        for c, state in zip(self.collectives, states):
            if c is not None:
                c.compressor.load_state_dict(state["compressor"])
                if c.own_error:
                    c.worker_error.load_state_dict(state["worker_error"])
        self._exchange({b: t.clone() for b, t in deltas.items()}, self.flight.lands_at, False, True)
        self.flight.join()

    def _exchange(self, landing: dict[int, Tensor], lands_at: int, in_flight: bool, live: bool) -> None:
        exchanges: list[comm.Stages] = []
        try:
            for (b, *_), collective in zip(self.runs, self.collectives):
                land = landing[b]
                if collective is None:
                    stages = comm.all_reduce_mean_stages(land, self.group, self.timeout)
                else:
                    if self.error_decay != 1:  # SparseLoCo: e <- beta e + delta, sent C(e), e <- e - C(e)
                        collective.decay_error(self.error_decay)
                    stages = collective.stages(land, out=land)
                next(stages)
                exchanges.append(stages)
            if not in_flight:
                for stages in exchanges:
                    comm.run_stages(stages)
        except comm.CollectiveError as exc:
            if not live:
                raise
            self.flight = Flight(lands_at, landing, error=exc)
            return
        self.flight = Flight(lands_at, landing, exchanges if in_flight else ())

    def land(self, outer: Optimizer, anchors: Sequence[Tensor], params: Sequence[Tensor],
             offsets: Sequence[tuple[int, int]], *, merge: float, error_feedback: bool) -> int:
        """The synchronisation in flight, waited for: ``outer`` steps with its average as the
        gradient of its parameters' anchors (Algorithm 1 line 12), and they take the anchors, or
        ``merge x + (1 - merge) anchor`` (the paper's alpha); the bytes its thread sent. A
        parameter without a gradient on any rank during the whole interval is not updated (the
        library's rule for missing gradients): its outer gradient is zero, but the 1-bit
        exchange gives it its neighbours' scale and the outer momentum would move it."""
        flight, self.flight, self.retry = self.flight, None, None
        flight.join()
        touched, self.sent = dict(zip(self.members, self.sent)), None
        for b, lo, _, members in self.runs:
            for i in members:
                if touched[i]:
                    first, last = offsets[i]
                    anchors[i].grad = flight.landing[b][first - lo:last - lo].view(anchors[i].shape)
        outer.step()
        for i in self.members:
            anchors[i].grad = None
            if touched[i]:
                p = params[i]  # merge 0 takes the anchor bit for bit
                p.copy_(torch.lerp(p.detach().float(), anchors[i], 1 - merge) if merge else anchors[i])
        if not error_feedback:
            self.reset()
        return flight.bytes_sent

    def reset(self) -> None:
        """The collectives' errors restart at zero."""
        for c in self.collectives:
            if c is not None:
                c.reset()


def fragment_bounds(offsets: Sequence[tuple[int, int]], fragments: int) -> list[tuple[int, int, list[int]]]:
    """``(lo, hi, parameter indices)`` of ``fragments`` contiguous fragments of the flat values
    at ``offsets``, each ending at the parameter boundary nearest its share ``k / fragments`` of
    the values (at least one parameter each)."""
    n = len(offsets)
    if fragments > n:
        raise ValueError(f"Invalid fragments value: {fragments} (more than the {n} parameters)")
    total, ends, last = offsets[-1][1], [hi for _, hi in offsets], -1
    cuts = []
    for k in range(1, fragments):
        nearest = min(range(n), key=lambda j: abs(ends[j] - k * total / fragments))
        last = min(max(nearest, last + 1), n - fragments + k - 1)
        cuts.append(last)
    firsts = [0, *(c + 1 for c in cuts)]
    lasts = [*cuts, n - 1]
    return [(offsets[a][0], offsets[z][1], list(range(a, z + 1))) for a, z in zip(firsts, lasts)]


def fragment_of(fragments: Iterable[Iterable[Tensor]], params: Sequence[Tensor]) -> list[int]:
    """Each parameter's fragment (in the order of ``params``), from ``fragments`` given as lists
    of parameters: every one of ``params`` in exactly one."""
    if isinstance(fragments, (str, Tensor)) or not isinstance(fragments, Iterable):
        raise TypeError(f"Invalid fragments value: a {type(fragments).__name__} (expected an int, or lists of "
                        "parameters)")
    fragments = list(fragments)
    if not fragments:
        raise ValueError("Invalid fragments value: [] (expected an int, or lists of parameters)")
    index = {id(p): i for i, p in enumerate(params)}
    owner: list[int | None] = [None] * len(index)
    for f, members in enumerate(fragments):
        if isinstance(members, Tensor) or not isinstance(members, Iterable):
            raise TypeError(f"Invalid fragments value: fragment {f} is a {type(members).__name__} (expected a list "
                            "of parameters)")
        members = list(members)
        if not members:
            raise ValueError(f"Invalid fragments value: fragment {f} is empty (expected a list of parameters)")
        for p in members:
            if not isinstance(p, Tensor):
                raise TypeError(f"Invalid fragments value: fragment {f} holds a {type(p).__name__} (expected "
                                "parameters)")
            i = index.get(id(p))
            if i is None:
                raise ValueError(f"Invalid fragments value: fragment {f} holds a tensor of shape {tuple(p.shape)} "
                                 "that is not a parameter of the inner optimizer")
            if owner[i] is not None:
                where = f"listed twice in fragment {f}" if owner[i] == f else f"in fragments {owner[i]} and {f}"
                raise ValueError(f"Invalid fragments value: parameter {i} is {where} (each parameter in exactly one)")
            owner[i] = f
    missing = [i for i, f in enumerate(owner) if f is None]
    if missing:
        raise ValueError(f"Invalid fragments value: parameters {missing} of the inner optimizer are in no fragment "
                         "(each parameter in exactly one)")
    return owner


def runs(owner: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(fragment, parameter indices)`` of each run of consecutive parameters in one fragment."""
    out: list[tuple[int, list[int]]] = []
    for i, f in enumerate(owner):
        if out and out[-1][0] == f:
            out[-1][1].append(i)
        else:
            out.append((f, [i]))
    return out


def by_size(offsets: Sequence[tuple[int, int]], fragments: int) -> list[int]:
    """Each parameter's fragment where ``fragments`` are cut by size (:func:`fragment_bounds`)."""
    return [f for f, (_, _, members) in enumerate(fragment_bounds(offsets, fragments)) for _ in members]


def check_exchange(compressor: Any, collective: str, error_feedback: bool, error_decay: float,
                   scales: str | None) -> str:
    """Refuse a bad option of :func:`build_fragments` before anything is built (the value is the
    caller's); ``scales``, checked (None: a scale per row for the sign, one per tensor piece for
    every other compressor)."""
    if not isinstance(compressor, compress.Compressor) and compressor not in compress.available():
        raise ValueError(f"Invalid compressor value: {compressor!r} (expected one of "
                         f"{', '.join(compress.available())}, or a onebit.compress.Compressor)")
    if collective not in ("allgather", "allreduce"):
        raise ValueError(f"Invalid collective value: {collective!r} (expected 'allgather' or 'allreduce')")
    check_bool("error_feedback", error_feedback)
    if check_positive("error_decay", error_decay) > 1 or (error_decay != 1 and not error_feedback):
        raise ValueError(f"Invalid error_decay value: {error_decay!r} (expected a number in (0, 1], and 1 "
                         "without error_feedback=True: it decays the errors carried)")
    return check_scales(default_scales(compressor) if scales is None else scales, row=True)


def default_scales(compressor: Any) -> str:
    """DiLoCo's ``scales`` where not given: a scale per row for the sign (it measured better at
    most intervals, and on rarely looked-up embedding rows), one per tensor piece for every other
    compressor (SparseLoCo's Top-k as published)."""
    return "row" if compress.get(compressor).name == "sign" else "tensor"


def build_fragments(flat: FlatState, owner: Sequence[int], compressor: Any, *, collective: str, error_feedback: bool,
                    error_decay: float = 1.0, scales: str, delay: int, group: comm.Group,
                    timeout: timedelta) -> list[Fragment]:
    """The fragments of parameters ``owner[i]`` (each parameter's fragment), each with the
    compressed collective of each of its runs of consecutive parameters (None where
    ``compressor`` is the identity: the exact mean): every rank's all-gathered
    (``collective="allgather"``), or 1-bit Adam's compressed all-reduce; ``scales="tensor"``
    (``"row"``): a compressor with per-block scales gives every parameter's (every slice along a
    parameter's first dimension's) piece its own; ``error_decay``:
    each rank's error is multiplied by it before each send. Over ``group``, or with a ``delay``
    over a duplicate of it."""
    # An exchange in flight across inner steps is completed on a thread (the flight's), over a
    # group of its own: when each rank issues its collectives there differs, their order does not.
    if delay and comm.get_world_size(group) > 1 and not comm.concurrent(group):
        raise ValueError(f"Invalid delay value with a {comm.backend_of(group)} group whose backend is not "
                         f"thread-safe across groups: {delay} (the exchange in flight is completed on a thread of "
                         "its own: NCCL, or MPI without MPI_THREAD_MULTIPLE, do not allow it); use delay=0, or a "
                         "gloo group")
    group = comm.duplicate(group, timeout) if delay else group
    codec = compress.get(compressor)
    exact = codec.name == "identity"
    if scales == "row" and not (exact or codec.blockwise):
        raise ValueError(f"Invalid scales value for compressor {codec.name!r}: 'row' (it has no per-block scales; "
                         "take 'sign' or another compressor with blockwise=True)")
    bounds = None
    if codec.blockwise and scales in ("tensor", "row"):
        bounds = flat.offsets if scales == "tensor" else flat.rows()
    pieces: dict[int, list[tuple[int, int, int, list[int]]]] = {f: [] for f in sorted(set(owner))}
    collectives: dict[int, list[Any]] = {f: [] for f in pieces}
    for b, (f, members) in enumerate(runs(owner)):
        lo, hi = flat.offsets[members[0]][0], flat.offsets[members[-1]][1]
        pieces[f].append((b, lo, hi, members))
        segments = starts_inside(bounds, lo, hi) if bounds is not None else None
        if exact:
            c = None
        elif collective == "allgather":
            c = comm.CompressedAllGather(compressor, group, error_feedback=error_feedback, segments=segments,
                                         timeout=timeout)
        else:
            c = comm.compressed_allreduce(compressor, group, hierarchical=False, ranks_per_node=None,
                                          segments=segments, timeout=timeout)
        if c is not None:
            c.warm_up(flat.device)  # kernels loaded now, not at the first synchronisation
        collectives[f].append(c)
    return [Fragment(f, pieces[f], collectives[f], group, timeout, error_decay) for f in pieces]


def regroup_fragments(fragments: Sequence[Fragment], rebuilt: Sequence[Fragment]) -> None:
    """Each fragment takes the collectives and group of its twin in ``rebuilt`` (the same
    fragments built over a re-formed quorum), each collective going on from the one it replaces
    (its compressor's state; this rank's error where it is its own)."""
    for fragment, twin in zip(fragments, rebuilt):
        for old, new in zip(fragment.collectives, twin.collectives):
            if old is not None:
                new.carry(old)
        fragment.collectives, fragment.group = twin.collectives, twin.group


def fragments_state(fragments: Sequence[Fragment]) -> dict[str, Any]:
    """What the fragments hold, for a checkpoint (the layout of onebit 0.x's where it had one):
    ``"sent"``, the synchronisations in flight (``"arrivals"``: each one's fragment, step and
    average; waited for first), and the collectives' errors -- ``{"allreduce": state}`` of one
    run, or the runs' bounds and each one's; none for the exact exchange."""
    out: dict[str, Any] = {"sent": [f.sent for f in fragments]}
    arrivals = []
    for f in fragments:
        if f.flight is not None:
            f.flight.join()
            arrivals.append({"fragment": f.index, "lands_at": f.flight.lands_at,
                             "average": {b: t.clone() for b, t in f.flight.landing.items()}})
    if arrivals:
        out["arrivals"] = arrivals
    collectives = [c for f in fragments for c in f.collectives]
    if all(c is None for c in collectives):
        return out
    if len(collectives) == 1:
        return {**out, "allreduce": collectives[0].state_dict()}
    return {**out, "bucket_bounds": [[lo, hi] for f in fragments for _, lo, hi, _ in f.runs],
            "bucket_allreduce": [c.state_dict() for c in collectives]}


def load_fragments(fragments: Sequence[Fragment], state: Mapping[str, Any], own_state: bool,
                   device: torch.device) -> None:
    """Restore :func:`fragments_state` (onebit 0.x's ``"arrivals"`` named the runs they sent);
    saved by another rank, on another world size or with other runs, the collectives' errors
    restart at zero."""
    owner = {b: f.index for f in fragments for b, *_ in f.runs}  # each run's fragment
    for f, sent in zip(fragments, state.get("sent", [None] * len(fragments))):
        f.sent = None if sent is None else [bool(t) for t in sent]
        f.flight = f.retry = None
    for arrival in state.get("arrivals", ()):
        index = arrival["fragment"] if "fragment" in arrival else owner[(arrival["wire"]["buckets"] or [0])[0]]
        landing = {int(b): t.to(device, torch.float32).clone() for b, t in arrival["average"].items()}
        fragments[index].flight = Flight(int(arrival["lands_at"]), landing)
    for c, s in _saved_collectives(fragments, state, own_state):
        if s is None:
            c.reset()
        else:
            c.load_state_dict(s)


def check_fragments_state(fragments: Sequence[Fragment], state: Mapping[str, Any], own_state: bool) -> None:
    """Refuse (``ValueError``) a collective's saved state that :func:`load_fragments` would fail
    to read, before anything is loaded."""
    for c, s in _saved_collectives(fragments, state, own_state):
        if s is not None:
            c.check_state_dict(s)


def _saved_collectives(fragments: Sequence[Fragment], state: Mapping[str, Any],
                       own_state: bool) -> list[tuple[Any, Any]]:
    """Each compressed collective with its saved state: None where the state is another rank's
    or laid out in other runs (the errors restart at zero)."""
    collectives = [c for f in fragments for c in f.collectives]
    bounds = [(lo, hi) for f in fragments for _, lo, hi, _ in f.runs]
    if "bucket_bounds" in state:
        layout, saved = [tuple(b) for b in state["bucket_bounds"]], state["bucket_allreduce"]
    else:  # one run, the whole model
        layout, saved = [(0, bounds[-1][1])], [state.get("allreduce")]
    same = own_state and layout == bounds
    return [(c, s) for c, s in zip(collectives, saved if same else [None] * len(collectives)) if c is not None]


def check_state(state_dict: Any, flat: FlatState, *, fragments: int, delay: int, fragment_of: list[int],
                collective: str, exact: bool, error_feedback: bool, error_decay: float,
                scales: str) -> Mapping[str, Any]:
    """The ``"onebit"`` entry of a DiLoCo ``state_dict``, refused (``ValueError``, before anything
    is loaded) where incomplete, or saved with another schedule, other fragments, another
    collective, other error feedback or other scales than these (``exact``: the exact exchange,
    which keeps no error, loads either's)."""
    extra = onebit_entry(state_dict, "DiLoCo", ("inner", "touched"), param_groups=False)
    saved = list(extra.get("streaming", [1, 0]))  # checkpoints from before streaming: the whole model at once
    if saved != [fragments, delay]:
        raise ValueError(f"DiLoCo state_dict saved with fragments={saved[0]}, delay={saved[1]}; this optimizer has "
                         f"fragments={fragments}, delay={delay} (its schedule and the exchanges in flight depend on "
                         "them): build it with the saved ones")
    # a checkpoint from before the option: its fragments cut by size
    saved = extra.get("fragment_of") or by_size(flat.offsets, fragments)
    if list(saved) != fragment_of:
        raise ValueError(f"DiLoCo state_dict saved with its parameters in the fragments {list(saved)}; this "
                         f"optimizer has them in {fragment_of}: build it with the saved fragments")
    # checkpoints from before the option: the compressed all-reduce, the only exchange then
    saved = extra.get("collective", "allreduce")
    if saved != collective and not exact:
        raise ValueError(f"DiLoCo state_dict saved with collective={saved!r}; this optimizer has "
                         f"collective={collective!r} (their error state differs): build it with the saved one")
    # checkpoints from before the record: whatever they were built with
    saved = list(extra.get("error_feedback", [error_feedback, error_decay]))
    if saved != [error_feedback, error_decay] and not exact:
        raise ValueError(f"DiLoCo state_dict saved with error_feedback={saved[0]}, error_decay={saved[1]}; this "
                         f"optimizer has error_feedback={error_feedback}, error_decay={error_decay} (the errors it "
                         "carries mean another algorithm): build it with the saved ones (outer_step='nesterov' "
                         "carries none by default, 'sparseloco' carries them with error_decay=0.95)")
    saved = extra.get("scales", scales)  # checkpoints from before the record: whatever they were built with
    if saved != scales and not exact:
        raise ValueError(f"DiLoCo state_dict saved with scales={saved!r}; this optimizer has scales={scales!r} "
                         "(another code: its errors and the bits it sends differ): build it with the saved one")
    expected = ["anchor"] if "outer" in extra else ["anchor", "outer_momentum"]  # onebit 0.x: a flat momentum
    check_buffers(extra["flat"], expected, flat.numel)
    for name in ("inner", "outer"):
        if name in extra:
            check_entries(extra[name], ("state", "param_groups"), f"DiLoCo {name} optimizer")
    return extra
