"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105) with its outer gradients sent at 1 bit a value.

Each rank takes ``sync_every`` (H) steps of its own inner optimizer; at every H-th step, after
its inner step, it sends its outer gradient ``delta_i = anchor - x_i`` (the anchor: the
parameters of the last synchronisation, Algorithm 1 line 9), the ranks average them
(line 10; here each rank's compressed outer gradient is all-gathered and the average taken
exactly, or they go through 1-bit Adam's compressed all-reduce, which compresses the average
again), and the outer optimizer moves the anchor with the average in place of a gradient
(line 12): :func:`outer_step`, Nesterov momentum SGD as ``torch.optim.SGD`` computes it.
Every rank then continues from the same new anchor; the inner optimizer's state stays its own.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512, section 2): with ``fragments`` P the
model is cut into P fragments (contiguous ones of about equal size, or the parameters the
user groups, e.g. the paper's strided fragments of every P-th layer), each synchronised
every H steps on its own schedule, staggered by H / P, so one synchronisation sends 1 / P of
the model; with ``delay`` tau its exchange is launched tau steps before it lands and stays in
flight under the inner steps between; on arrival the outer step moves the fragment's anchor
and the fragment's parameters become ``merge * x + (1 - merge) * anchor`` (the paper's
alpha), keeping part of the tau local steps taken meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import comm, compress
from .._checks import check_bool, check_nonneg, check_positive, check_positive_int, check_scales
from ._base import OnebitOptimizer
from ._driver import Wire, allgather_factory
from ._stages import Stage, StepStages

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["DiLoCo", "outer_step"]

_BUFFERS = ("anchor", "outer_momentum")
# Inner steps send nothing and wait for nothing: not even the agreement on skipping a step
_INNER = Stage(Wire("local", formed=True, exact=False, exchanged=False, agreed=False), _BUFFERS)


def outer_step(anchor: Tensor, momentum: Tensor, delta: Tensor, *, lr: float, momentum_factor: float,
               nesterov: bool) -> None:
    """The outer optimizer (Algorithm 1 line 12), in place on flat fp32 tensors: ``delta`` (the
    averaged outer gradient) in the place of a gradient in ``torch.optim.SGD``'s update,
    ``b <- mu b + delta``, ``anchor <- anchor - lr (delta + mu b)`` with Nesterov, else
    ``anchor - lr b``. ``momentum_factor=0``: ``anchor - lr delta`` (``lr=1``: FedAvg, the
    average of the ranks' parameters)."""
    if momentum_factor:
        momentum.mul_(momentum_factor).add_(delta)
        direction = delta.add(momentum, alpha=momentum_factor) if nesterov else momentum
    else:
        direction = delta
    anchor.sub_(direction, alpha=lr)


class DiLoCo(OnebitOptimizer):
    """DiLoCo's outer loop around any ``torch.optim`` optimizer, its outer gradients sent at 1 bit
    a value (section 3, Algorithm 1 of arXiv 2311.08105).

    ``params`` is the inner optimizer itself (any ``torch.optim`` optimizer, built on every rank
    over the same parameters), or parameters (or param groups) for ``inner(params, lr=lr)``,
    AdamW by default. ``step()`` is the inner optimizer's step on this rank's own gradients;
    every ``sync_every`` steps it is followed by the synchronisation: ``delta_i = anchor - x_i``
    is averaged over the group (``compressor="sign"``: 1 bit per value and one scale per tensor
    piece, every rank's all-gathered; ``"identity"``: the exact fp32 mean, DiLoCo as published)
    and :func:`outer_step` moves the anchor, which every rank's parameters then take,
    bit for bit; :meth:`check_replicas` compares the anchors between synchronisations.
    The inner optimizer's state is never averaged or reset. Its param groups are this
    optimizer's: a learning-rate scheduler built on either schedules the inner steps. An inner
    step sends nothing, not even the agreement on skipping it: a rank with a non-finite
    gradient skips its own inner step, which still counts towards ``sync_every``; a
    synchronisation step is skipped on every rank at once, as every onebit step. With
    ``fragments`` and ``delay``, Streaming DiLoCo (see the module docstring); ``state_dict()``
    in the middle of a delayed synchronisation waits for its exchange to complete and saves
    the average not yet landed; :meth:`wait` waits for it alone (before destroying the process
    group at the end of a run).

    Args:
        params: the inner optimizer (e.g. ``torch.optim.AdamW(model.parameters(), lr=1e-3)``),
            or the parameters to build it over.
        lr: the inner learning rate, where ``params`` are parameters (default 1e-3).
        weight_decay: the inner optimizer's, where ``params`` are parameters (None: its default).
        inner: the inner optimizer's class (or a factory ``inner(params, lr=lr)``), where
            ``params`` are parameters (default ``torch.optim.AdamW``).
        sync_every: inner steps per synchronisation (H; the paper: 500).
        outer_lr: the outer learning rate (0.7 in the paper; 1 with ``outer_momentum=0`` is
            periodic averaging).
        outer_momentum: the outer momentum (0.9 in the paper).
        nesterov: Nesterov momentum (the paper's outer optimizer).
        compressor: ``"sign"`` (default: 1 bit per value and a scale per tensor piece),
            ``"identity"`` (the exact fp32 mean, DiLoCo as published), another name of
            :func:`onebit.compress.available` or a :class:`onebit.compress.Compressor` (e.g.
            ``onebit.compress.get("uniform", bits=8)``, 8-bit pseudo-gradients).
        collective: how the compressed outer gradients are averaged. ``"allgather"`` (default):
            every rank's is all-gathered and their average taken exactly, so each value is
            compressed once; a rank sends ``w - 1`` times its compressed bytes. ``"allreduce"``:
            1-bit Adam's compressed all-reduce, whose chunk owners compress the average again
            before the all-gather: ``2 (w - 1) / w`` times, fewer bytes from 3 ranks on, at the
            cost of the second compression's error (see the DiLoCo page of the docs).
        fragments: synchronise the model in P fragments, each every ``sync_every`` steps,
            fragment p landing at the steps ``k H / P`` with ``k`` congruent to ``p + 1`` modulo P
            (Streaming DiLoCo; 1: the whole model at once). An int P: contiguous fragments of
            about equal size, cut at parameter boundaries in parameter order. A list of P lists
            of parameters: those fragments, every parameter of the inner optimizer in exactly
            one (the paper's strided fragments: every P-th layer in one); each
            contiguous run of a fragment's parameters is exchanged as one piece.
            ``sync_every`` must be a multiple of P.
        delay: inner steps each synchronisation stays in flight (the paper's tau, below
            ``sync_every / fragments``): its outer gradients are formed and sent ``delay``
            steps before the step it lands in, and the network works under those inner steps.
        merge: the weight of the fragment's own parameters when its synchronisation lands after
            ``delay`` local steps (the paper's alpha): ``x <- merge x + (1 - merge) anchor``.
            Default 0.5 with a delay (the paper's), 0 without (where it must be 0: the
            parameters are the ones the outer gradient was formed from).
        error_feedback: carry the compression errors (each rank's, and with the all-reduce the
            chunk owners') from one synchronisation to the next (default False: they restart at
            zero after each). The inner steps between have already moved on from what an error
            held, and the outer momentum accelerates it again; it cost quality in the settings
            measured, except periodic averaging through the all-reduce at H = 16 (where it
            helped) and 64 (about even): the DiLoCo page of the docs.
        scales: ``"tensor"`` (one scale per tensor piece, of each chunk with the all-reduce) or
            ``"chunk"`` (one per chunk with the all-reduce, per contiguous piece of a fragment with
            the all-gather).
        group: the process group the workers average over (``None``: the default group).
        **options: ``timeout``, ``broadcast_parameters``, ``on_nonfinite``,
            ``check_replicas_every``, ``max_grad_norm`` (each rank clips its own gradients
            before its inner step) -- see :class:`onebit.optim.OnebitOptimizer`.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> opt = onebit.DiLoCo(inner, sync_every=2)
        >>> for _ in range(4):
        ...     opt.zero_grad()
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     opt.step()
        >>> opt.stats["stage"]
        'outer'
    """

    def __init__(
        self,
        params: Optimizer | Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        *,
        inner: Callable[..., Optimizer] | None = None,
        weight_decay: float | None = None,
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int | Iterable[Iterable[Tensor]] = 1,
        delay: int = 0,
        merge: float | None = None,
        compressor: str | compress.Compressor = "sign",
        collective: str = "allgather",
        error_feedback: bool = False,
        scales: str = "tensor",
        group: comm.Group = None,
        **options: Unpack[CommonOptions],
    ) -> None:
        if isinstance(params, Optimizer):
            given = [name for name, value in (("inner", inner), ("lr", lr), ("weight_decay", weight_decay))
                     if value is not None]
            if given:
                raise TypeError(f"DiLoCo was given the inner optimizer {type(params).__name__} and also "
                                f"{given[0]}=: set it on the inner optimizer")
            inner = params
        else:
            lr = 1e-3 if lr is None else check_nonneg("lr", lr)
            if inner is not None and not callable(inner):
                raise TypeError(f"Invalid inner value: {inner!r} (expected a torch.optim.Optimizer class or factory)")
            decay = {} if weight_decay is None else {"weight_decay": check_nonneg("weight_decay", weight_decay)}
            inner = (inner or torch.optim.AdamW)(params, lr=lr, **decay)
            if not isinstance(inner, Optimizer):
                raise TypeError(f"Invalid inner value: it made a {type(inner).__name__}, not a torch.optim.Optimizer")
        if isinstance(inner, OnebitOptimizer):
            raise TypeError(f"Invalid inner value: {type(inner).__name__} (it exchanges itself; DiLoCo's inner "
                            "steps are each rank's own: use a torch.optim optimizer)")
        self.sync_every = check_positive_int("sync_every", sync_every)
        self.outer_lr = check_positive("outer_lr", outer_lr)
        self.outer_momentum = check_nonneg("outer_momentum", outer_momentum)
        if self.outer_momentum >= 1:
            raise ValueError(f"Invalid outer_momentum value: {outer_momentum} (expected a number in [0, 1))")
        self.nesterov = check_bool("nesterov", nesterov)
        # each parameter's fragment, where the user gave them (None: cut by size once the layout is known)
        given = None if isinstance(fragments, int) else _fragment_of(fragments, inner.param_groups)
        self.fragments = check_positive_int("fragments", fragments) if given is None else max(given) + 1
        if self.sync_every % self.fragments:
            shown = fragments if given is None else f"{self.fragments} lists"
            raise ValueError(f"Invalid fragments value: {shown} (sync_every={sync_every} must be a multiple of it)")
        period = self.sync_every // self.fragments  # steps between two landings
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < period:
            raise ValueError(f"Invalid delay value: {delay!r} (expected an int in [0, {period}): "
                             "sync_every / fragments steps between two synchronisations)")
        self.delay = delay
        if merge is None:
            merge = 0.5 if delay else 0.0
        self.merge = check_nonneg("merge", merge)
        if self.merge >= 1 or (self.merge and not delay):
            raise ValueError(f"Invalid merge value: {merge} (expected a number in [0, 1), and 0 with delay=0)")
        if not isinstance(compressor, compress.Compressor) and compressor not in compress.available():
            raise ValueError(f"Invalid compressor value: {compressor!r} (expected one of "
                             f"{', '.join(compress.available())}, or a onebit.compress.Compressor)")
        self.compressor = compressor
        if collective not in ("allgather", "allreduce"):
            raise ValueError(f"Invalid collective value: {collective!r} (expected 'allgather' or 'allreduce')")
        self.collective = collective
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.inner = inner
        exact = compress.get(compressor).name == "identity"
        # The driver's buckets are the fragments' runs of consecutive parameters, in order: where the
        # fragments are cut by size each is one run, and fragment p sends bucket p
        owners = list(range(self.fragments)) if given is None else [f for f, _ in _runs(given)]
        outer = tuple(Stage(Wire("outer", formed=True, exact=exact, local_first=True, delay=delay,
                                 buckets=tuple(b for b, f in enumerate(owners) if f == p)), _BUFFERS)
                      for p in range(self.fragments))
        self._stages = StepStages((_INNER, *outer), _stage_of(outer, period, delay), self.sync_every)
        super().__init__(inner.param_groups, dict(inner.defaults), group=group, **options)
        # Per parameter: a gradient here since its fragment was last sent (on some rank, once the
        # synchronisation's agreement has run); and of each fragment in flight, those agreed then.
        self._touched = [False] * len(self.flat.params)
        self._sent: list[list[bool] | None] = [None] * self.fragments
        for anchor, p in zip(self.flat.views("anchor"), self.flat.params):
            anchor.copy_(p.detach())  # the parameters every rank starts from (rank 0's, broadcast)
        self._fragment_of = given or _by_size(self.flat.offsets, self.fragments)
        runs = _runs(self._fragment_of)
        self._buckets = [(self.flat.offsets[m[0]][0], self.flat.offsets[m[-1]][1], m) for _, m in runs]
        self._bucket_fragment = [f for f, _ in runs]
        # An exchange in flight across inner steps is completed on a thread (the driver's), over a
        # group of its own: when each rank issues its collectives there differs, their order does not.
        if delay and self.world_size > 1 and not comm.concurrent(self.process_group):
            raise ValueError(f"Invalid delay value with a {comm.backend_of(self.process_group)} group whose backend "
                             f"is not thread-safe across groups: {delay} (the exchange in flight is completed on a "
                             "thread of its own: NCCL, or MPI without MPI_THREAD_MULTIPLE, do not allow it); use "
                             "delay=0, or a gloo group")
        stream = comm.duplicate(self.process_group, self.timeout) if delay else None
        if exact:
            exchange = None
        elif collective == "allgather":
            exchange = allgather_factory(self.flat.offsets, self.process_group if stream is None else stream,
                                         self.timeout, compressor, error_feedback=self.error_feedback,
                                         scales=check_scales(scales))
        else:
            exchange = self._allreduce(compressor, hierarchical=False, ranks_per_node=None, overlap=False,
                                       scales=check_scales(scales), group=stream)
        self._drive(exchange, fragments=self._buckets, delayed_group=stream)

    @contextlib.contextmanager
    def anchored(self) -> Iterator[None]:
        """Inside the block, every parameter holds its anchor: the model all ranks share (DiLoCo's
        global model, each fragment as its last synchronisation left it, without the inner steps
        since); after it, each its own value again. For evaluating or saving the shared model
        where each rank's parameters are its own: inside an interval of inner steps, or with
        fragments at any step. Take no step inside it (the inner step would start from the
        anchors, and its result be overwritten when the block ends).

        Examples:
            >>> model = torch.nn.Linear(4, 2)
            >>> opt = onebit.DiLoCo(model.parameters(), sync_every=8)
            >>> opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
            >>> with opt.anchored():
            ...     shared = model.weight.detach().clone()
            >>> torch.equal(shared, model.weight)  # an inner step since the anchor
            False
        """
        own = [p.detach().clone() for p in self.flat.params]
        with torch.no_grad():
            for p, anchor in zip(self.flat.params, self.flat.views("anchor")):
                p.copy_(anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self.flat.params, own):
                    p.copy_(value)

    @property
    def synchronised(self) -> bool:
        """Whether every rank holds the same parameters now: after a synchronisation of the whole
        model that took them all to the anchor (inside an interval of inner steps, or with
        fragments or a merge, the ranks' parameters differ by design)."""
        return self.fragments == 1 and not self.merge and self._step_count % self.sync_every == 0

    # ------------------------------------------------------------------ the contract
    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """The outer gradient ``anchor - x`` (Algorithm 1 line 9) of values ``[lo, hi)``."""
        first = self.flat.offsets[i][0]
        x = self.flat.params[i].detach().reshape(-1)[lo - first : hi - first]  # logical order
        torch.sub(self.flat.buffers["anchor"][lo:hi], x, out=out)

    def _landing(self, wire: Wire) -> Tensor:
        # the outer gradients of the fragment sent, averaged in place (its ranges alone are written and read)
        return torch.empty(self.flat.numel, dtype=torch.float32, device=self.flat.device)

    def _present(self) -> list[bool]:
        # A synchronisation's agreement carries each parameter's gradients since its last one.
        return [t or p.grad is not None for t, p in zip(self._touched, self.flat.params)]

    def _apply(self, wire: Wire, average: Tensor | None) -> None:
        if not wire.exchanged:
            self.inner.step()
            self._touched = [t or a for t, a in zip(self._touched, self._active)]
            return
        f = self._bucket_fragment[wire.buckets[0]]
        pieces = [self._buckets[k] for k in wire.buckets]
        members = [i for _, _, m in pieces for i in m]
        if average is None or not wire.delay:  # sent: what was touched is agreed now, the rest starts again
            self._sent[f] = [self._touched[i] for i in members]
            for i in members:
                self._touched[i] = False
        if average is None:
            return
        touched, self._sent[f] = dict(zip(members, self._sent[f])), None
        # A parameter without a gradient on any rank during the whole interval is not updated (the
        # library's rule for missing gradients): its outer gradient is zero, but the 1-bit exchange
        # gives it its neighbours' scale and the outer momentum would move it.
        b, step = self.flat.buffers, {"lr": self.outer_lr, "momentum_factor": self.outer_momentum,
                                      "nesterov": self.nesterov}
        spans = [(lo, hi) for lo, hi, _ in pieces] if all(touched.values()) else \
            [self.flat.offsets[i] for i in members if touched[i]]
        for lo, hi in spans:
            outer_step(b["anchor"][lo:hi], b["outer_momentum"][lo:hi], average[lo:hi], **step)
        anchors = self.flat.views("anchor")
        for i in members:
            if touched[i]:
                p = self.flat.params[i]
                # merge: the paper's alpha; 0 takes the anchor bit for bit
                p.copy_(torch.lerp(p.detach().float(), anchors[i], 1 - self.merge) if self.merge else anchors[i])
        if not self.error_feedback:
            self._driver.reset(wire.buckets)

    # ------------------------------------------------------------------ checkpoints
    def _extra_state(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "touched": list(self._touched), "sent": list(self._sent),
                "streaming": [self.fragments, self.delay], "fragment_of": self._fragment_of,
                "collective": self.collective}

    def _check_extra_state(self, state: Mapping[str, Any]) -> None:
        saved = list(state.get("streaming", [1, 0]))  # checkpoints from before streaming: the whole model at once
        if saved != [self.fragments, self.delay]:
            raise ValueError(f"DiLoCo state_dict saved with fragments={saved[0]}, delay={saved[1]}; this optimizer has "
                             f"fragments={self.fragments}, delay={self.delay} (its schedule and the exchanges in "
                             "flight depend on them): build it with the saved ones")
        # a checkpoint from before the option: its fragments cut by size
        saved = state.get("fragment_of") or _by_size(self.flat.offsets, self.fragments)
        if list(saved) != self._fragment_of:
            raise ValueError(f"DiLoCo state_dict saved with its parameters in the fragments {list(saved)}; this "
                             f"optimizer has them in {self._fragment_of}: build it with the saved fragments")
        # checkpoints from before the option: the compressed all-reduce, the only exchange then
        collective = state.get("collective", "allreduce")
        if collective != self.collective and self._collectives[0] is not None:  # the exact exchange has neither
            raise ValueError(f"DiLoCo state_dict saved with collective={collective!r}; this optimizer has "
                             f"collective={self.collective!r} (their error state differs): build it with the saved one")

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        self.inner.load_state_dict(state["inner"])
        self._touched = [bool(t) for t in state["touched"]]
        self._sent = [None if s is None else [bool(t) for t in s] for s in state.get("sent", [None] * self.fragments)]
        self.param_groups = self.inner.param_groups  # one list again: loading made each its own


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


def _fragment_of(fragments: Iterable[Iterable[Tensor]], param_groups: list[dict[str, Any]]) -> list[int]:
    """Each parameter's fragment (in param-group order), from ``fragments`` given as lists of
    parameters: every parameter of the inner optimizer in exactly one."""
    if isinstance(fragments, (str, Tensor)) or not isinstance(fragments, Iterable):
        raise TypeError(f"Invalid fragments value: a {type(fragments).__name__} (expected an int, or lists of "
                        "parameters)")
    fragments = list(fragments)
    if not fragments:
        raise ValueError("Invalid fragments value: [] (expected an int, or lists of parameters)")
    index = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
    fragment_of: list[int | None] = [None] * len(index)
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
            if fragment_of[i] is not None:
                where = f"listed twice in fragment {f}" if fragment_of[i] == f else \
                    f"in fragments {fragment_of[i]} and {f}"
                raise ValueError(f"Invalid fragments value: parameter {i} is {where} (each parameter in exactly one)")
            fragment_of[i] = f
    missing = [i for i, f in enumerate(fragment_of) if f is None]
    if missing:
        raise ValueError(f"Invalid fragments value: parameters {missing} of the inner optimizer are in no fragment "
                         "(each parameter in exactly one)")
    return fragment_of


def _runs(fragment_of: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(fragment, parameter indices)`` of each run of consecutive parameters in one fragment."""
    runs: list[tuple[int, list[int]]] = []
    for i, f in enumerate(fragment_of):
        if runs and runs[-1][0] == f:
            runs[-1][1].append(i)
        else:
            runs.append((f, [i]))
    return runs


def _by_size(offsets: Sequence[tuple[int, int]], fragments: int) -> list[int]:
    """Each parameter's fragment where ``fragments`` are cut by size (:func:`fragment_bounds`)."""
    return [f for f, (_, _, members) in enumerate(fragment_bounds(offsets, fragments)) for _ in members]


def _stage_of(outer: tuple[Stage, ...], period: int, delay: int):
    """Fragment p's synchronisation lands at the steps ``k period`` with ``k = p + 1`` modulo the
    number of fragments, and is sent ``delay`` steps before."""
    def stage_of(sync_every: int, step: int) -> Stage:
        k, sent = divmod(step + delay, period)
        return outer[(k - 1) % len(outer)] if not sent else _INNER
    return stage_of
