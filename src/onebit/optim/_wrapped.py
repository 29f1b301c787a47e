"""The two optimizers :class:`~onebit.DiLoCo` wraps: the inner one (the user's, each rank's own
steps) and the outer one (over the anchors, at each synchronisation)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._checks import check_beta, check_bool, check_nonneg, check_positive
from ._base import OnebitOptimizer

__all__ = ["OUTER_STEPS", "check_outer_state", "inner_optimizer", "load_flat_momentum", "outer_factory",
           "outer_step_options"]


def _exchanges_itself(opt: Optimizer) -> bool:
    # a onebit optimizer, or a DiLoCo (which holds an inner optimizer of its own)
    return isinstance(opt, OnebitOptimizer) or isinstance(getattr(opt, "inner", None), Optimizer)


def inner_optimizer(params: Any, lr: float | None, inner: Any, weight_decay: float | None) -> Optimizer:
    """The inner optimizer: ``params`` itself, or ``inner(params, lr=lr)`` (AdamW by default)."""
    if isinstance(params, Optimizer):
        given = [name for name, value in (("inner", inner), ("lr", lr), ("weight_decay", weight_decay))
                 if value is not None]
        if given:
            raise TypeError(f"DiLoCo was given the inner optimizer {type(params).__name__} and also "
                            f"{given[0]}=: set it on the inner optimizer")
        made = params
    else:
        lr = 1e-3 if lr is None else check_nonneg("lr", lr)
        if inner is not None and not callable(inner):
            raise TypeError(f"Invalid inner value: {inner!r} (expected a torch.optim.Optimizer class or factory)")
        decay = {} if weight_decay is None else {"weight_decay": check_nonneg("weight_decay", weight_decay)}
        made = (inner or torch.optim.AdamW)(params, lr=lr, **decay)
        if not isinstance(made, Optimizer):
            raise TypeError(f"Invalid inner value: it made a {type(made).__name__}, not a torch.optim.Optimizer")
    if _exchanges_itself(made):
        raise TypeError(f"Invalid inner value: {type(made).__name__} (it exchanges itself; DiLoCo's inner "
                        "steps are each rank's own: use a torch.optim optimizer)")
    return made


# Each outer step's defaults (``DiLoCo(outer_step=...)``): the outer SGD's learning rate and
# momentum, and whether each rank carries its compression error, decayed by how much
OUTER_STEPS: dict[str, dict[str, Any]] = {
    # SparseLoCo (arXiv 2508.15706, Algorithm 1): each rank's decayed error accumulator
    # e <- beta e + delta in the place of the outer momentum, the anchor moved by the plain
    # average of what was sent
    "sparseloco": {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False, "error_feedback": True,
                   "error_decay": 0.95},
    # DiLoCo's (arXiv 2311.08105, Algorithm 1): Nesterov momentum SGD on the averaged outer
    # gradient, each compression's error dropped
    "nesterov": {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "error_feedback": False,
                 "error_decay": 1.0},
}


def outer_step_options(outer_step: object, outer: Any, **given: Any) -> dict[str, Any]:
    """``outer_lr``, ``outer_momentum``, ``nesterov``, ``error_feedback`` and ``error_decay``:
    those ``given`` (not None), the others ``outer_step``'s (:data:`OUTER_STEPS`; beside
    ``outer``, the outer optimizer's three are the user's). SparseLoCo's refuses an outer
    momentum and no error feedback: its accumulator is its momentum, and either would make it
    another algorithm (``outer_step="nesterov"`` takes them)."""
    if not isinstance(outer_step, str) or outer_step not in OUTER_STEPS:
        raise ValueError(f"Invalid outer_step value: {outer_step!r} (expected 'sparseloco' or 'nesterov')")
    theirs = ("outer_lr", "outer_momentum", "nesterov") if outer is not None else ()  # outer_factory refuses them
    options = {name: OUTER_STEPS[outer_step][name] if value is None and name not in theirs else value
               for name, value in given.items()}
    if outer_step == "sparseloco":
        momentum, nesterov = given["outer_momentum"], given["nesterov"]
        if outer is None and momentum is not None and check_beta(momentum, "outer_momentum") != 0:
            raise ValueError(f"Invalid outer_momentum value with outer_step='sparseloco': {momentum!r} (its momentum "
                             "is each rank's decayed error accumulator; outer_step='nesterov' for the paper's)")
        if outer is None and check_bool("nesterov", False if nesterov is None else nesterov):
            raise ValueError("Invalid nesterov value with outer_step='sparseloco': True (it has no outer momentum; "
                             "outer_step='nesterov' for the paper's)")
        if options["error_feedback"] is False:  # (another value than a bool: check_exchange's to refuse)
            raise ValueError("Invalid error_feedback value with outer_step='sparseloco': False (its error "
                             "accumulator is its outer step; outer_step='nesterov' sends without one)")
    return options


def check_outer_state(outer_step: str, theirs: bool, saved: Mapping[str, Any]) -> None:
    """Refuse a saved outer SGD with momentum where SparseLoCo's outer step builds its own
    without (``theirs``: the user's ``outer=``, whatever it is): loading restores the saved
    momentum, which would then run on top of the error accumulator (a state saved with the
    paper's outer step, before the state recorded its error feedback)."""
    if outer_step != "sparseloco" or theirs:
        return
    momenta = sorted({g.get("momentum", 0) for g in saved.get("param_groups", [])} - {0})
    if momenta:
        raise ValueError(f"DiLoCo state_dict saved with outer_momentum={momenta[0]}; this optimizer's outer step is "
                         "SparseLoCo's, whose momentum is each rank's error accumulator: build it with "
                         "outer_step='nesterov', scales='tensor' (the defaults it was saved with)")


def outer_factory(outer: Any, lr: float | None, momentum: float | None,
                  nesterov: bool | None) -> Callable[[list[Tensor]], Optimizer]:
    """The factory of the outer optimizer over the anchors: ``outer``, or SGD at ``lr`` and
    ``momentum`` (Nesterov's where ``nesterov``); those three are refused beside ``outer`` where
    given (they would configure nothing)."""
    if outer is not None:
        given = [name for name, value in (("outer_lr", lr), ("outer_momentum", momentum), ("nesterov", nesterov))
                 if value is not None]
        if given:
            raise TypeError(f"DiLoCo was given outer= and also {given[0]}=: set it on the outer optimizer")
        if not callable(outer):
            raise TypeError(f"Invalid outer value: {outer!r} (expected a factory of a torch.optim.Optimizer)")

        def made(anchors: list[Tensor]) -> Optimizer:
            opt = outer(anchors)
            if not isinstance(opt, Optimizer) or _exchanges_itself(opt):
                raise TypeError(f"Invalid outer value: it made a {type(opt).__name__}, not a torch.optim.Optimizer "
                                "that steps on this rank alone")
            return opt
        return made
    lr = check_positive("outer_lr", lr)
    momentum = check_beta(momentum, "outer_momentum")
    nesterov = check_bool("nesterov", nesterov)
    # torch.optim.SGD refuses Nesterov without momentum, where it would be plain SGD anyway
    return lambda anchors: torch.optim.SGD(anchors, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


def load_flat_momentum(outer: Optimizer, anchors: list[Tensor], momentum: list[Tensor]) -> None:
    """onebit 0.x's outer momentum (a flat buffer, zeros before the first synchronisation) as
    the state of ``torch.optim.SGD``, the outer optimizer it computed."""
    if type(outer) is not torch.optim.SGD:
        raise ValueError(f"a DiLoCo state_dict of onebit 0.x holds the outer momentum of Nesterov SGD; this "
                         f"optimizer's outer optimizer is a {type(outer).__name__}: build it without outer=")
    if outer.defaults["momentum"]:
        for anchor, m in zip(anchors, momentum):
            outer.state[anchor]["momentum_buffer"] = m.to(anchor).clone()
    elif any(m.any() for m in momentum):  # dropping it would change the run silently
        raise ValueError("a DiLoCo state_dict of onebit 0.x holds an outer momentum; this optimizer's outer "
                         f"optimizer has none (outer_momentum={outer.defaults['momentum']}): build it with the "
                         "outer_momentum it was saved with")
