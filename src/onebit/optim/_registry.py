"""The one list of onebit's optimizers: what the benchmarks, the command line and the tests'
contract tables read.

Adding an optimizer is its file and one :class:`Spec` here: ``onebit bench``, ``onebit
compare`` / ``train`` and every shared test table (missing gradients, layouts, reliability,
DDP, clipping, fuzzing, overlap, MPI, GPU) pick it up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._base import OnebitOptimizer
from ._birder import Birder, SoftSignSGD
from ._comp_ams import CompAMS, QAdam
from ._onebit_adam import OnebitAdam, OnebitAdamNaive
from ._onebit_lamb import OnebitLamb
from ._zero_one_adam import ZeroOneAdam

__all__ = ["REGISTRY", "Spec", "make_optimizer", "spec"]


@dataclass(frozen=True)
class Spec:
    """One optimizer as the benchmarks and tests know it.

    ``cls`` with ``kwargs`` (what makes this variant, e.g. ``compressor="block_sign"``);
    ``counterpart``: the uncompressed optimizer its convergence is compared with (None: it is
    one); ``footprint(w)``: the state the algorithm itself keeps, in fp32 model sizes at world
    size ``w`` (``onebit bench memory`` holds it to this, after ``freeze``); ``overlap`` /
    ``hierarchical``: it takes ``overlap=True`` / ``hierarchical=``; ``freeze``: for an
    optimizer with a warm-up, the arguments that end it after step ``T`` (None: one stage);
    ``seeded``: it takes ``seed``; ``test_kwargs``: small settings that reach the compressed
    stage within a few steps, for the contract tests, with replicas identical after every step.
    """

    cls: type[OnebitOptimizer]
    counterpart: str | None
    footprint: Callable[[int], float]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    overlap: bool = False
    hierarchical: bool = False
    freeze: Callable[[int], dict[str, Any]] | None = None
    seeded: bool = False
    test_kwargs: Mapping[str, Any] = field(default_factory=dict)


REGISTRY: dict[str, Spec] = {
    # m, frozen v, worker error, server error (n/w)
    "onebit_adam": Spec(OnebitAdam, "adamw", lambda w: 3.0 + 1.0 / w, overlap=True, hierarchical=True,
                        freeze=lambda t: {"freeze_step": t}, test_kwargs={"lr": 0.01, "freeze_step": 2}),
    # m, v, the exchanged gradient, worker and server error
    "onebit_adam_naive": Spec(OnebitAdamNaive, "adamw", lambda w: 4.0 + 1.0 / w, overlap=True, hierarchical=True,
                              test_kwargs={"lr": 0.01}),
    # m, fresh v, frozen v, last m, worker and server error
    "onebit_lamb": Spec(OnebitLamb, "lamb", lambda w: 5.0 + 1.0 / w, overlap=True, hierarchical=True,
                        freeze=lambda t: {"freeze_step": t}, test_kwargs={"lr": 0.01, "freeze_step": 2}),
    # m, frozen v, worker and server error (n/w); with local steps the anchor and accumulated momentum
    # (refreshes before the freeze: v and their averaged gradient). After step T the local-step
    # interval doubles every T/4 steps: the footprint measured includes the local steps' buffers.
    "zero_one_adam": Spec(ZeroOneAdam, "adamw", lambda w: 5.0 + 1.0 / w, overlap=True, hierarchical=True,
                          freeze=lambda t: {"var_freeze_step": t, "local_step_scaler": max(1, t // 4)},
                          test_kwargs={"lr": 0.01, "var_freeze_step": 3, "var_update_scaler": 1,
                                       "local_step_clipper": 1}),
    # m, v, v^, error, the averaged gradient
    "comp_ams": Spec(CompAMS, "amsgrad", lambda w: 5.0, kwargs={"compressor": "topk"},
                     test_kwargs={"lr": 0.01, "ratio": 0.3}),
    "comp_ams_block_sign": Spec(CompAMS, "amsgrad", lambda w: 5.0, kwargs={"compressor": "block_sign"}, overlap=True,
                                test_kwargs={"lr": 0.01}),
    # m, v, a = m / sqrt(v + eps) (sent and averaged in place), error
    "qadam": Spec(QAdam, "adamw", lambda w: 4.0, test_kwargs={"lr": 0.01}),
    # m, b, the averaged gradient
    "softsign_sgd": Spec(SoftSignSGD, None, lambda w: 3.0, test_kwargs={"lr": 0.01}),
    # m, b, worker error, server error (n/w)
    "birder": Spec(Birder, "softsign_sgd", lambda w: 3.0 + 1.0 / w, overlap=True, hierarchical=True, seeded=True,
                   test_kwargs={"lr": 0.01, "seed": 1}),
}


def spec(name: str) -> Spec:
    """The registry entry ``name``; a ``ValueError`` naming the known ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(REGISTRY)}") from None


def make_optimizer(name: str, params: Any, **kwargs: Any) -> OnebitOptimizer:
    """``REGISTRY[name].cls(params, **REGISTRY[name].kwargs, **kwargs)``."""
    entry = spec(name)
    return entry.cls(params, **{**entry.kwargs, **kwargs})
