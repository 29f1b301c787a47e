"""The one list of onebit's optimizers: what the command line and the tests' contract tables read.

Adding an optimizer is its file and one :class:`Spec` here: ``onebit train`` / ``compare``
(its name), ``onebit bench memory`` (its footprint) and every shared test table (missing
gradients, layouts, reliability, DDP, clipping, fuzzing, overlap, MPI, GPU) pick it up. How the
benchmarks compare and price it -- its uncompressed counterpart, its cells and target in the
convergence matrix, its rows of the cost model -- is the lab's, one row of
``onebit.bench.BENCHMARKED`` under the same name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._base import OnebitOptimizer
from ._birder import Birder, SoftSignSGD
from ._comp_ams import CompAMS, QAdam
from ._diloco import DiLoCo
from ._onebit_adam import OnebitAdam
from ._onebit_adam_naive import OnebitAdamNaive
from ._onebit_lamb import OnebitLamb
from ._zero_one_adam import ZeroOneAdam

__all__ = ["REGISTRY", "Spec", "make_optimizer", "spec"]


@dataclass(frozen=True)
class Spec:
    """One optimizer as the library and its tests know it.

    ``cls`` with ``kwargs`` (what makes this variant, e.g. ``compressor="block_sign"``);
    ``footprint(w)``: the state the algorithm itself keeps, in fp32 model sizes at world size
    ``w`` (``onebit bench memory`` and the memory tests hold it to this, after ``freeze``);
    ``overlap`` / ``hierarchical``: it takes ``overlap=True`` / ``hierarchical=``; ``freeze``:
    the arguments that make its schedule act within a run whose warm-up would end after step
    ``T`` -- the end of the warm-up (1-bit Adam, 1-bit LAMB, 0/1 Adam), DiLoCo's synchronisation
    every ``T`` steps (None: one stage); ``seeded``: it takes ``seed``; ``test_kwargs``: small
    settings that reach the compressed stage within a few steps, for the contract tests, with
    replicas identical after every step.
    """

    cls: type[OnebitOptimizer | DiLoCo]
    footprint: Callable[[int], float]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    overlap: bool = False
    hierarchical: bool = False
    freeze: Callable[[int], dict[str, Any]] | None = None
    seeded: bool = False
    test_kwargs: Mapping[str, Any] = field(default_factory=dict)


REGISTRY: dict[str, Spec] = {
    # m, frozen v, worker error, server error (n/w)
    "onebit_adam": Spec(OnebitAdam, lambda w: 3.0 + 1.0 / w, overlap=True, hierarchical=True,
                        freeze=lambda t: {"freeze_step": t}, test_kwargs={"lr": 0.01, "freeze_step": 2}),
    # m, v, the exchanged gradient, worker and server error
    "onebit_adam_naive": Spec(OnebitAdamNaive, lambda w: 4.0 + 1.0 / w, overlap=True, hierarchical=True,
                              test_kwargs={"lr": 0.01}),
    # m, fresh v, frozen v, last m, worker and server error
    "onebit_lamb": Spec(OnebitLamb, lambda w: 5.0 + 1.0 / w, overlap=True, hierarchical=True,
                        freeze=lambda t: {"freeze_step": t}, test_kwargs={"lr": 0.01, "freeze_step": 2}),
    # m, frozen v, worker and server error (n/w); with local steps the anchor and accumulated momentum
    # (refreshes before the freeze: v and their averaged gradient). After step T the local-step
    # interval doubles every T/4 steps: the footprint measured includes the local steps' buffers.
    "zero_one_adam": Spec(ZeroOneAdam, lambda w: 5.0 + 1.0 / w, overlap=True, hierarchical=True,
                          freeze=lambda t: {"var_freeze_step": t, "local_step_scaler": max(1, t // 4)},
                          test_kwargs={"lr": 0.01, "var_freeze_step": 3, "var_update_scaler": 1,
                                       "local_step_clipper": 1}),
    # m, v, v^, error, the averaged gradient
    "comp_ams": Spec(CompAMS, lambda w: 5.0, kwargs={"compressor": "topk"}, test_kwargs={"lr": 0.01, "ratio": 0.3}),
    "comp_ams_block_sign": Spec(CompAMS, lambda w: 5.0, kwargs={"compressor": "block_sign"}, overlap=True,
                                test_kwargs={"lr": 0.01}),
    # m, v, a = m / sqrt(v + eps) (sent and averaged in place), error
    "qadam": Spec(QAdam, lambda w: 4.0, test_kwargs={"lr": 0.01}),
    # m, b, the averaged gradient
    "softsign_sgd": Spec(SoftSignSGD, lambda w: 3.0, test_kwargs={"lr": 0.01}),
    # m, b, worker error, server error (n/w)
    "birder": Spec(Birder, lambda w: 3.0 + 1.0 / w, overlap=True, hierarchical=True, seeded=True,
                   test_kwargs={"lr": 0.01, "seed": 1}),
    # the inner AdamW's m and v, the anchor, and each rank's error accumulator (SparseLoCo's outer
    # step; outer_step="nesterov": the outer momentum instead; with the all-reduce also the server
    # error, n/w, between synchronisations);
    # sync_every=1 in the contract tests: every step synchronises, so replicas match after each
    "diloco": Spec(DiLoCo, lambda w: 4.0, freeze=lambda t: {"sync_every": t},
                   test_kwargs={"lr": 0.01, "sync_every": 1}),
}


def spec(name: str) -> Spec:
    """The registry entry ``name``; a ``ValueError`` naming the known ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(REGISTRY)}") from None


def make_optimizer(name: str, params: Any, **kwargs: Any) -> OnebitOptimizer | DiLoCo:
    """``REGISTRY[name].cls(params, **REGISTRY[name].kwargs, **kwargs)``."""
    entry = spec(name)
    return entry.cls(params, **{**entry.kwargs, **kwargs})
