"""The one list of onebit's optimizers: what the benchmarks, the command line and the tests'
contract tables read.

Adding an optimizer is its file and one :class:`Spec` here: ``onebit bench`` (the convergence
matrix's cells and targets, memory footprints), ``onebit model`` (its collective),
``onebit compare`` / ``train`` (choices and training options) and every shared test table
(missing gradients, layouts, reliability, DDP, clipping, fuzzing, overlap, MPI, GPU) pick it
up. Adding a variant of one (another compressor, say) is one :class:`Variant` of its entry.
The uncompressed optimizers the matrix compares with are the :data:`COUNTERPARTS`, each a
setting of a registry entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._base import OnebitOptimizer
from ._birder import Birder, SoftSignSGD
from ._comp_ams import CompAMS, QAdam
from ._diloco import DiLoCo
from ._onebit_adam import OnebitAdam, OnebitAdamNaive
from ._onebit_lamb import OnebitLamb
from ._zero_one_adam import ZeroOneAdam

__all__ = ["COUNTERPARTS", "NEVER", "REGISTRY", "Cost", "Counterpart", "Spec", "Variant", "make_optimizer", "spec"]

NEVER = 10**9  # a freeze step no run reaches: a two-stage optimizer's exact warm-up throughout


@dataclass(frozen=True)
class Variant:
    """A setting of a registry entry in the convergence matrix: its arguments beyond the
    defaults. ``control``: it isolates what the compression costs (the identity compressor),
    left out with ``--no-controls``; ``extended``: run only with ``--extended``."""

    kwargs: Mapping[str, Any]
    control: bool = False
    extended: bool = False


@dataclass(frozen=True)
class Cost:
    """A step as the cost model (``onebit model``) counts it: ``collective``, one of
    :data:`onebit.bench.COLLECTIVES` (``"onebit"``, ``"allgather_topk"``, ...), described by
    ``label``; ``kernels``: the compression arithmetic's share of 1-bit Adam's (compress, the
    server's average, decode); ``exact``: the steps that send fp32 instead (``"warmup"``: the
    warm-up fraction, ``"warmup_refreshed"``: that and every ``refresh_every``-th step after it,
    1-bit Adam's variance refreshes, ``"refresh"``: 0/1 Adam's refreshes, its local steps sending nothing)."""

    collective: str
    label: str
    kernels: float = 1.0
    exact: str | None = None


_ONEBIT = "1-bit compressed all-reduce"
_IDENTITY = Variant({"compressor": "identity"}, control=True)
# 0.5 MB buckets: every task's model is split into several, each compressed on its own
_OVERLAP = Variant({"overlap": True, "bucket_cap_mb": 0.5}, extended=True)
_FEDAVG = {"outer_lr": 1.0, "outer_momentum": 0.0}  # DiLoCo's outer step as periodic averaging


@dataclass(frozen=True)
class Spec:
    """One optimizer as the benchmarks and tests know it.

    ``cls`` with ``kwargs`` (what makes this variant, e.g. ``compressor="block_sign"``);
    ``counterpart``: the uncompressed optimizer its convergence is compared with (None: it is
    one); ``footprint(w)``: the state the algorithm itself keeps, in fp32 model sizes at world
    size ``w`` (``onebit bench memory`` holds it to this, after ``freeze``); ``overlap`` /
    ``hierarchical``: it takes ``overlap=True`` / ``hierarchical=``; ``freeze``: the arguments
    that make its schedule act within a run whose warm-up would end after step ``T`` -- the end
    of the warm-up (1-bit Adam, 1-bit LAMB, 0/1 Adam), DiLoCo's synchronisation every ``T``
    steps (None: one stage);
    ``seeded``: it takes ``seed``; ``test_kwargs``: small settings that reach the compressed
    stage within a few steps, for the contract tests, with replicas identical after every step.

    The benchmarks: ``matrix``, its name in the convergence matrix (None: not in it), with its
    ``variants`` there (``{suffix: Variant}``, named ``matrix + "_" + suffix``) and ``target``,
    the largest mean paired gap it may show against its counterpart there (C1 in
    docs/design.md: % of held-out loss, points of digits' error rate); ``costs``, its rows of the
    cost model (``{name: Cost}``); ``options``, what it takes of ``onebit train``'s options
    (``{TrainConfig field: argument}``).
    """

    cls: type[OnebitOptimizer | DiLoCo]
    counterpart: str | None
    footprint: Callable[[int], float]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    overlap: bool = False
    hierarchical: bool = False
    freeze: Callable[[int], dict[str, Any]] | None = None
    seeded: bool = False
    test_kwargs: Mapping[str, Any] = field(default_factory=dict)
    matrix: str | None = None
    variants: Mapping[str, Variant] = field(default_factory=dict)
    target: float | None = None
    costs: Mapping[str, Cost] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counterpart:
    """An uncompressed optimizer of the convergence matrix: registry entry ``entry`` with
    ``kwargs``, at the learning rates ``lrs`` (low, high) of its family."""

    entry: str
    kwargs: Mapping[str, Any]
    lrs: tuple[float, float]


_COMPRESSOR_OPTION = {"compressor": "compressor"}  # what it sends (identity: the exact-exchange control)
_ADAM_OPTIONS = {"bias_correction": "bias_correction", **_COMPRESSOR_OPTION}
_COMP_AMS_OPTIONS = {"bias_correction": "bias_correction", "topk_ratio": "ratio"}

REGISTRY: dict[str, Spec] = {
    # m, frozen v, worker error, server error (n/w)
    "onebit_adam": Spec(OnebitAdam, "adamw", lambda w: 3.0 + 1.0 / w, overlap=True, hierarchical=True,
                        freeze=lambda t: {"freeze_step": t}, test_kwargs={"lr": 0.01, "freeze_step": 2},
                        matrix="onebit_adam", variants={"identity": _IDENTITY, "overlap": _OVERLAP}, target=3.0,
                        costs={"onebit_adam": Cost("onebit", _ONEBIT, exact="warmup_refreshed")},
                        options={**_ADAM_OPTIONS, "refresh_every": "refresh_every"}),
    # m, v, the exchanged gradient, worker and server error
    "onebit_adam_naive": Spec(OnebitAdamNaive, "adamw", lambda w: 4.0 + 1.0 / w, overlap=True, hierarchical=True,
                              test_kwargs={"lr": 0.01}, costs={"onebit_adam_naive": Cost("onebit", _ONEBIT)},
                              options=_ADAM_OPTIONS),
    # m, fresh v, frozen v, last m, worker and server error
    "onebit_lamb": Spec(OnebitLamb, "lamb", lambda w: 5.0 + 1.0 / w, overlap=True, hierarchical=True,
                        freeze=lambda t: {"freeze_step": t}, test_kwargs={"lr": 0.01, "freeze_step": 2},
                        matrix="onebit_lamb", variants={"identity": _IDENTITY, "overlap": _OVERLAP}, target=3.0,
                        costs={"onebit_lamb": Cost("onebit", _ONEBIT, exact="warmup")}, options=_COMPRESSOR_OPTION),
    # m, frozen v, worker and server error (n/w); with local steps the anchor and accumulated momentum
    # (refreshes before the freeze: v and their averaged gradient). After step T the local-step
    # interval doubles every T/4 steps: the footprint measured includes the local steps' buffers.
    "zero_one_adam": Spec(ZeroOneAdam, "adamw", lambda w: 5.0 + 1.0 / w, overlap=True, hierarchical=True,
                          freeze=lambda t: {"var_freeze_step": t, "local_step_scaler": max(1, t // 4)},
                          test_kwargs={"lr": 0.01, "var_freeze_step": 3, "var_update_scaler": 1,
                                       "local_step_clipper": 1},
                          matrix="zero_one_adam", variants={"identity": _IDENTITY}, target=3.0,
                          costs={"zero_one_adam": Cost("onebit", _ONEBIT, exact="refresh")},
                          options={**_ADAM_OPTIONS, "local_step_scaler": "local_step_scaler"}),
    # m, v, v^, error, the averaged gradient
    "comp_ams": Spec(CompAMS, "amsgrad", lambda w: 5.0, kwargs={"compressor": "topk"},
                     test_kwargs={"lr": 0.01, "ratio": 0.3}, matrix="comp_ams_topk",
                     variants={"no_ef": Variant({"error_feedback": False}, extended=True),
                               "5pct": Variant({"ratio": 0.05}, extended=True),
                               "25pct": Variant({"ratio": 0.25}, extended=True)}, target=5.0,
                     costs={"comp_ams": Cost("allgather_topk", "all-gather of top-k values+indices", kernels=1 / 3)},
                     options=_COMP_AMS_OPTIONS),
    "comp_ams_block_sign": Spec(CompAMS, "amsgrad", lambda w: 5.0, kwargs={"compressor": "block_sign"}, overlap=True,
                                test_kwargs={"lr": 0.01}, matrix="comp_ams_block_sign",
                                variants={"no_ef": Variant({"error_feedback": False}, extended=True),
                                          "layers": Variant({"block": "tensor"}, extended=True),
                                          "overlap": _OVERLAP}, target=5.0,
                                costs={"comp_ams_block_sign": Cost("allgather_sign", "all-gather of signs+scales")},
                                options=_COMP_AMS_OPTIONS),
    # m, v, a = m / sqrt(v + eps) (sent and averaged in place), error
    "qadam": Spec(QAdam, "adamw", lambda w: 4.0, test_kwargs={"lr": 0.01},
                  costs={"qadam": Cost("allgather_sign", "all-gather of signs+scale")}, options={"qadam_bits": "bits"}),
    # m, b, the averaged gradient
    "softsign_sgd": Spec(SoftSignSGD, None, lambda w: 3.0, test_kwargs={"lr": 0.01}),
    # m, b, worker error, server error (n/w)
    "birder": Spec(Birder, "softsign_sgd", lambda w: 3.0 + 1.0 / w, overlap=True, hierarchical=True, seeded=True,
                   test_kwargs={"lr": 0.01, "seed": 1}, matrix="birder",
                   variants={"identity": _IDENTITY, "overlap": _OVERLAP}, target=5.0,
                   costs={"birder": Cost("onebit", _ONEBIT),
                          "birder_hierarchical": Cost("onebit_hierarchical", "Hierarchical-1-bit-All-Reduce")},
                   options=_COMPRESSOR_OPTION),
    # the inner AdamW's m and v, the anchor, the outer momentum (with error_feedback=True also the
    # worker error, and with the all-reduce the server error, n/w, between synchronisations);
    # sync_every=1 in the contract tests: every step synchronises, so replicas match after each
    "diloco": Spec(DiLoCo, "adamw", lambda w: 4.0, freeze=lambda t: {"sync_every": t},
                   test_kwargs={"lr": 0.01, "sync_every": 1}, matrix="diloco",
                   # each explicit about error feedback whatever the default (the committed runs name
                   # them); a variant equal to the defaults, or to an earlier one, is not run twice
                   variants={"identity": _IDENTITY,
                             "ef": Variant({"error_feedback": True}, extended=True),
                             "no_ef": Variant({"error_feedback": False}, extended=True),
                             "allreduce": Variant({"collective": "allreduce", "error_feedback": False},
                                                  extended=True),
                             "allreduce_ef": Variant({"collective": "allreduce", "error_feedback": True},
                                                     extended=True),
                             # Streaming DiLoCo: a quarter of the model every H / 4 steps, a step in flight
                             "streamed": Variant({"fragments": 4, "delay": 1}, extended=True),
                             "fedavg": Variant(_FEDAVG, extended=True),
                             "fedavg_identity": Variant({**_FEDAVG, "compressor": "identity"}, control=True,
                                                        extended=True),
                             "fedavg_ef": Variant({**_FEDAVG, "error_feedback": True}, extended=True),
                             "fedavg_no_ef": Variant({**_FEDAVG, "error_feedback": False}, extended=True)},
                   costs={"diloco": Cost("allgather_sign", "all-gather of signs+scales", exact="sync"),
                          "diloco_allreduce": Cost("onebit", _ONEBIT, exact="sync"),
                          "diloco_fp32": Cost("allreduce_fp32", "ring all-reduce fp32", kernels=0.0, exact="sync")},
                   options={"sync_every": "sync_every", "fragments": "fragments", "delay": "delay",
                            "collective": "collective", **_COMPRESSOR_OPTION}),
}

# The uncompressed optimizers the convergence matrix compares with, by the name its tables use
COUNTERPARTS: dict[str, Counterpart] = {
    "adamw": Counterpart("onebit_adam", {"freeze_step": NEVER}, (1e-3, 3e-3)),
    "lamb": Counterpart("onebit_lamb", {"freeze_step": NEVER}, (3e-3, 1e-2)),
    "amsgrad": Counterpart("comp_ams", {"compressor": "none"}, (1e-3, 3e-3)),
    "softsign_sgd": Counterpart("softsign_sgd", {}, (1e-3, 3e-3)),
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
