"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105) with its outer gradients sent through the error-compensated 1-bit all-reduce.

Each rank takes ``sync_every`` (H) steps of its own inner optimizer; at every H-th step, after
its inner step, it sends its outer gradient ``delta_i = anchor - x_i`` (the anchor: the
parameters of the last synchronisation, Algorithm 1 line 9), the ranks average them
(line 10; here through the compressed all-reduce with worker and server error feedback, as
1-bit Adam's momentum), and the outer optimizer moves the anchor with the average in place of a
gradient (line 12): :func:`outer_step`, Nesterov momentum SGD as ``torch.optim.SGD`` computes it.
Every rank then continues from the same new anchor; the inner optimizer's state stays its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import comm, compress
from .._checks import check_bool, check_nonneg, check_positive, check_positive_int, check_scales
from ._base import OnebitOptimizer
from ._driver import LOCAL, Wire
from ._stages import Stage, StepStages

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["DiLoCo", "outer_step"]

_BUFFERS = ("anchor", "outer_momentum")
_INNER = Stage(LOCAL, _BUFFERS)


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
    """DiLoCo's outer loop around any ``torch.optim`` optimizer, its outer gradients averaged by
    the error-compensated 1-bit all-reduce (section 3, Algorithm 1 of arXiv 2311.08105).

    ``params`` is the inner optimizer itself (any ``torch.optim`` optimizer, built on every rank
    over the same parameters), or parameters (or param groups) for ``inner(params, lr=lr)``,
    AdamW by default. ``step()`` is the inner optimizer's step on this rank's own gradients;
    every ``sync_every`` steps it is followed by the synchronisation: ``delta_i = anchor - x_i``
    is averaged over the group (``compressor="sign"``: 1 bit per value, one scale per tensor
    piece, with worker and server error feedback; ``"identity"``: the exact fp32 mean, DiLoCo as
    published) and :func:`outer_step` moves the anchor, which every rank's parameters then take,
    bit for bit; :meth:`check_replicas` compares the anchors between synchronisations.
    The inner optimizer's state is never averaged or reset. Its param groups are this
    optimizer's: a learning-rate scheduler built on either schedules the inner steps.

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
        error_feedback: carry the compression errors (worker and server) from one
            synchronisation to the next (default False: they restart at zero after each).
            Measured on a byte-level GPT (4 workers, H of 16 to 256, 4 seeds), carrying them
            cost 7-20% of held-out loss with the outer Nesterov step, which accelerates the
            stale errors too; with ``outer_momentum=0`` it helped at H = 16, was about even at
            64 and hurt at 256.
        scales: ``"tensor"`` (one scale per tensor piece of each chunk) or ``"chunk"``.
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
        compressor: str | compress.Compressor = "sign",
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
        if not isinstance(compressor, compress.Compressor) and compressor not in compress.available():
            raise ValueError(f"Invalid compressor value: {compressor!r} (expected one of "
                             f"{', '.join(compress.available())}, or a onebit.compress.Compressor)")
        self.compressor = compressor
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.inner = inner
        exact = compress.get(compressor).name == "identity"
        outer = Stage(Wire("outer", formed=True, exact=exact, local_first=True), _BUFFERS)
        self._stages = StepStages((_INNER, outer), _stage_of(outer), self.sync_every)
        super().__init__(inner.param_groups, dict(inner.defaults), group=group, **options)
        self._touched = [False] * len(self.flat.params)  # a gradient on some rank since the last synchronisation
        for anchor, p in zip(self.flat.views("anchor"), self.flat.params):
            anchor.copy_(p.detach())  # the parameters every rank starts from (rank 0's, broadcast)
        self._drive(None if exact else self._allreduce(compressor, hierarchical=False, ranks_per_node=None,
                                                       overlap=False, scales=check_scales(scales)))

    @property
    def synchronised(self) -> bool:
        """Whether the last step was a synchronisation (inside an interval of inner steps the
        ranks' parameters differ by design)."""
        return self._step_count % self.sync_every == 0

    # ------------------------------------------------------------------ the contract
    def _form(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, group: dict[str, Any], step: int,
              scratch: Tensor, out: Tensor, agreed: bool) -> None:
        """The outer gradient ``anchor - x`` (Algorithm 1 line 9) of values ``[lo, hi)``."""
        first = self.flat.offsets[i][0]
        x = self.flat.params[i].detach().reshape(-1)[lo - first : hi - first]  # logical order
        torch.sub(self.flat.buffers["anchor"][lo:hi], x, out=out)

    def _landing(self, wire: Wire) -> Tensor:
        return self.flat.zeros()  # the step's outer gradients, averaged in place

    def _apply(self, wire: Wire, average: Tensor | None) -> None:
        if wire is LOCAL:
            self.inner.step()
            self._touched = [t or a for t, a in zip(self._touched, self._active)]
            return
        # A parameter without a gradient on any rank during the whole interval is not updated (the
        # library's rule for missing gradients): its outer gradient is zero, but the 1-bit exchange
        # gives it its neighbours' scale and the outer momentum would move it.
        b, step = self.flat.buffers, {"lr": self.outer_lr, "momentum_factor": self.outer_momentum,
                                      "nesterov": self.nesterov}
        if all(self._touched):
            outer_step(b["anchor"], b["outer_momentum"], average, **step)
        else:
            for (lo, hi), touched in zip(self.flat.offsets, self._touched):
                if touched:
                    outer_step(b["anchor"][lo:hi], b["outer_momentum"][lo:hi], average[lo:hi], **step)
        for anchor, p, touched in zip(self.flat.views("anchor"), self.flat.params, self._touched):
            if touched:
                p.copy_(anchor)
        self._touched = [False] * len(self._touched)
        if not self.error_feedback:
            self._driver.reset()

    # ------------------------------------------------------------------ checkpoints
    def _extra_state(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "touched": list(self._touched)}

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        self.inner.load_state_dict(state["inner"])
        self._touched = [bool(t) for t in state["touched"]]
        self.param_groups = self.inner.param_groups  # one list again: loading made each its own


def _stage_of(outer: Stage):
    def stage_of(sync_every: int, step: int) -> Stage:
        return outer if step % sync_every == 0 else _INNER
    return stage_of
