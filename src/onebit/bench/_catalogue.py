"""The lab's table of the library's optimizers: how the benchmarks compare and price each one.

One :class:`Benchmarked` row per entry of :data:`onebit.optim.REGISTRY`, under the same name:
the uncompressed optimizer its convergence is compared with, its cells and target in the
convergence matrix (``onebit bench convergence``), its rows of the cost model (``onebit
model``) and which of ``onebit train``'s options it takes. Adding a variant of one (another
compressor, say) is one :class:`Variant` of its row. The uncompressed optimizers the matrix
compares with are the :data:`COUNTERPARTS`, each a setting of a registry entry. The library
never reads this table: the lab stands on the library, not the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BENCHMARKED", "COUNTERPARTS", "NEVER", "Benchmarked", "Cost", "Counterpart", "Variant", "benchmarked"]

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
    1-bit Adam's variance refreshes (in bf16: counted as half an fp32 step), ``"refresh"``: 0/1
    Adam's refreshes, its local steps sending nothing, ``"sync"``: DiLoCo's synchronisations, its
    inner steps sending nothing)."""

    collective: str
    label: str
    kernels: float = 1.0
    exact: str | None = None


@dataclass(frozen=True)
class Benchmarked:
    """One optimizer as the benchmarks know it: ``counterpart``, the uncompressed optimizer its
    convergence is compared with (None: it is one); ``matrix``, its name in the convergence
    matrix (None: not in it), with its ``variants`` there (``{suffix: Variant}``, named
    ``matrix + "_" + suffix``) and ``target``, the largest mean paired gap it may show against
    its counterpart there (C1 in docs/design.md: % of held-out loss, points of digits' error
    rate); ``costs``, its rows of the cost model (``{name: Cost}``); ``options``, what it takes
    of ``onebit train``'s options (``{TrainConfig field: argument}``); ``control``, the suffix of
    the variant that is the entry's own identity control where no variant is it with the
    identity compressor alone (None: that one, if any)."""

    counterpart: str | None
    matrix: str | None = None
    variants: Mapping[str, Variant] = field(default_factory=dict)
    target: float | None = None
    costs: Mapping[str, Cost] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)
    control: str | None = None


@dataclass(frozen=True)
class Counterpart:
    """An uncompressed optimizer of the convergence matrix: registry entry ``entry`` with
    ``kwargs``, at the learning rates ``lrs`` (low, high) of its family."""

    entry: str
    kwargs: Mapping[str, Any]
    lrs: tuple[float, float]


_ONEBIT = "1-bit compressed all-reduce"
_IDENTITY = Variant({"compressor": "identity"}, control=True)
# 0.5 MB buckets: every task's model is split into several, each compressed on its own
_OVERLAP = Variant({"overlap": True, "bucket_cap_mb": 0.5}, extended=True)
# DiLoCo's outer step as the paper's (Nesterov momentum SGD) with one scale per tensor piece: its
# default until SparseLoCo's became it, which every committed run of these variants was made with
_PAPER = {"outer_step": "nesterov", "scales": "tensor", "error_feedback": False}
_FEDAVG = {**_PAPER, "outer_lr": 1.0, "outer_momentum": 0.0}  # ... as periodic averaging
# SparseLoCo (arXiv 2508.15706): plain averaged descent (alpha = 1, no outer momentum), each rank's
# compression error carried with the decay beta = 0.95 in its place (DiLoCo's default outer step)
_SPARSELOCO = {"outer_step": "sparseloco", "scales": "tensor"}
_COMPRESSOR_OPTION = {"compressor": "compressor"}  # what it sends (identity: the exact-exchange control)
_ADAM_OPTIONS = {"bias_correction": "bias_correction", **_COMPRESSOR_OPTION}
_COMP_AMS_OPTIONS = {"bias_correction": "bias_correction", "topk_ratio": "ratio"}

BENCHMARKED: dict[str, Benchmarked] = {
    "onebit_adam": Benchmarked("adamw", matrix="onebit_adam", variants={"identity": _IDENTITY, "overlap": _OVERLAP},
                               target=3.0, costs={"onebit_adam": Cost("onebit", _ONEBIT, exact="warmup_refreshed")},
                               options={**_ADAM_OPTIONS, "refresh_every": "refresh_every",
                                        "refresh_dtype": "refresh_dtype"}),
    "onebit_adam_naive": Benchmarked("adamw", costs={"onebit_adam_naive": Cost("onebit", _ONEBIT)},
                                     options=_ADAM_OPTIONS),
    "onebit_lamb": Benchmarked("lamb", matrix="onebit_lamb", variants={"identity": _IDENTITY, "overlap": _OVERLAP},
                               target=3.0, costs={"onebit_lamb": Cost("onebit", _ONEBIT, exact="warmup")},
                               options=_COMPRESSOR_OPTION),
    "zero_one_adam": Benchmarked("adamw", matrix="zero_one_adam", variants={"identity": _IDENTITY}, target=3.0,
                                 costs={"zero_one_adam": Cost("onebit", _ONEBIT, exact="refresh")},
                                 options={**_ADAM_OPTIONS, "local_step_scaler": "local_step_scaler",
                                          "refresh_schedule": "refresh_schedule"}),
    "comp_ams": Benchmarked("amsgrad", matrix="comp_ams_topk",
                            variants={"no_ef": Variant({"error_feedback": False}, extended=True),
                                      "5pct": Variant({"ratio": 0.05}, extended=True),
                                      "25pct": Variant({"ratio": 0.25}, extended=True)}, target=5.0,
                            costs={"comp_ams": Cost("allgather_topk", "all-gather of top-k values+indices",
                                                    kernels=1 / 3)},
                            options=_COMP_AMS_OPTIONS),
    "comp_ams_block_sign": Benchmarked("amsgrad", matrix="comp_ams_block_sign",
                                       variants={"no_ef": Variant({"error_feedback": False}, extended=True),
                                                 "layers": Variant({"block": "tensor"}, extended=True),
                                                 "overlap": _OVERLAP}, target=5.0,
                                       costs={"comp_ams_block_sign": Cost("allgather_sign",
                                                                          "all-gather of signs+scales")},
                                       options=_COMP_AMS_OPTIONS),
    "qadam": Benchmarked("adamw", costs={"qadam": Cost("allgather_sign", "all-gather of signs+scale")},
                         options={"qadam_bits": "bits"}),
    "softsign_sgd": Benchmarked(None),
    "birder": Benchmarked("softsign_sgd", matrix="birder", variants={"identity": _IDENTITY, "overlap": _OVERLAP},
                          target=5.0, costs={"birder": Cost("onebit", _ONEBIT),
                                             "birder_hierarchical": Cost("onebit_hierarchical",
                                                                         "Hierarchical-1-bit-All-Reduce")},
                          options=_COMPRESSOR_OPTION),
    "diloco": Benchmarked("adamw", matrix="diloco",
                          # each explicit about its outer step, scales and error feedback whatever the
                          # defaults (the committed runs name them); a variant equal to the defaults, or to
                          # an earlier one, is not run twice (as given: sparseloco_sign_rows, today's
                          # defaults spelt out, is)
                          variants={"identity": Variant({**_PAPER, "compressor": "identity"}, control=True),
                                    "nesterov": Variant(_PAPER, extended=True),
                                    "ef": Variant({**_PAPER, "error_feedback": True}, extended=True),
                                    "no_ef": Variant({**_PAPER, "error_feedback": False}, extended=True),
                                    "allreduce": Variant({**_PAPER, "collective": "allreduce",
                                                          "error_feedback": False}, extended=True),
                                    "allreduce_ef": Variant({**_PAPER, "collective": "allreduce",
                                                             "error_feedback": True}, extended=True),
                                    # Streaming DiLoCo: a quarter of the model every H / 4 steps, a step in flight
                                    "streamed": Variant({**_PAPER, "fragments": 4, "delay": 1}, extended=True),
                                    # one scale per embedding row (and per row of each weight)
                                    "rows": Variant({**_PAPER, "scales": "row"}, extended=True),
                                    "fedavg": Variant(_FEDAVG, extended=True),
                                    "fedavg_identity": Variant({**_FEDAVG, "compressor": "identity"}, control=True,
                                                               extended=True),
                                    "fedavg_ef": Variant({**_FEDAVG, "error_feedback": True}, extended=True),
                                    "fedavg_no_ef": Variant({**_FEDAVG, "error_feedback": False}, extended=True),
                                    "sparseloco": Variant({**_SPARSELOCO, "compressor": "chunk_topk"}, extended=True),
                                    "sparseloco_sign": Variant({**_SPARSELOCO, "compressor": "sign"}, extended=True),
                                    "sparseloco_allreduce": Variant({**_SPARSELOCO, "compressor": "chunk_topk",
                                                                     "collective": "allreduce"}, extended=True),
                                    # the same accumulator with the sign, through the compressed all-reduce,
                                    # whose bytes per worker do not grow with the workers
                                    "sparseloco_sign_allreduce": Variant({**_SPARSELOCO, "compressor": "sign",
                                                                          "collective": "allreduce"}, extended=True),
                                    # and with a scale per row (rarely looked-up embedding rows)
                                    "sparseloco_sign_rows": Variant({**_SPARSELOCO, "compressor": "sign",
                                                                     "scales": "row"}, extended=True),
                                    # both: bytes per worker flat in W, a scale per row
                                    "sparseloco_sign_allreduce_rows": Variant({**_SPARSELOCO, "compressor": "sign",
                                                                               "collective": "allreduce",
                                                                               "scales": "row"}, extended=True),
                                    # the default with a larger outer step (SparseLoCo's is 1)
                                    **{f"sparseloco_sign_rows_lr{name}": Variant({**_SPARSELOCO, "compressor": "sign",
                                                                                  "scales": "row", "outer_lr": lr},
                                                                                 extended=True)
                                       for name, lr in (("125", 1.25), ("15", 1.5), ("2", 2.0))}},
                          costs={"diloco": Cost("allgather_sign", "all-gather of signs+scales", exact="sync"),
                                 "diloco_allreduce": Cost("onebit", _ONEBIT, exact="sync"),
                                 "diloco_fp32": Cost("allreduce_fp32", "ring all-reduce fp32", kernels=0.0,
                                                     exact="sync")},
                          options={"sync_every": "sync_every", "fragments": "fragments", "delay": "delay",
                                   "collective": "collective", **_COMPRESSOR_OPTION},
                          # fp32 DiLoCo as published, what every DiLoCo setting is measured against
                          control="identity"),
}

# The uncompressed optimizers the convergence matrix compares with, by the name its tables use
COUNTERPARTS: dict[str, Counterpart] = {
    "adamw": Counterpart("onebit_adam", {"freeze_step": NEVER}, (1e-3, 3e-3)),
    "lamb": Counterpart("onebit_lamb", {"freeze_step": NEVER}, (3e-3, 1e-2)),
    "amsgrad": Counterpart("comp_ams", {"compressor": "none"}, (1e-3, 3e-3)),
    "softsign_sgd": Counterpart("softsign_sgd", {}, (1e-3, 3e-3)),
}


def benchmarked(name: str) -> Benchmarked:
    """The row of registry entry ``name``; a ``ValueError`` naming the known ones otherwise."""
    try:
        return BENCHMARKED[name]
    except KeyError:
        raise ValueError(f"no benchmark row for optimizer {name!r}; rows: {', '.join(BENCHMARKED)}") from None
