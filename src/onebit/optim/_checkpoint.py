"""What every onebit ``state_dict`` holds in its ``"onebit"`` entry, and the checks on loading one:
helpers that take values, shared by the 1-bit family (``_state.py``) and DiLoCo (``_diloco_checkpoint.py``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from ._agreement import parameter_sums

__all__ = ["check_buffers", "onebit_entry", "own_state", "saved_entry"]

_log = logging.getLogger("onebit.optim")


def saved_entry(*, world_size: int, rank: int, step: int, bytes_sent_total: int, buffers: Mapping[str, Tensor],
                params: Sequence[Tensor], synchronised: bool) -> dict[str, Any]:
    """The entries of ``"onebit"`` common to every optimizer: who saved it, the step, the bytes
    sent, copies of the flat ``buffers``; between synchronisations (not ``synchronised``) the
    state belongs beside this rank's own parameters: their fingerprint (``"own_parameters"``),
    checked before the first step after a load."""
    return {"world_size": world_size, "rank": rank, "step": step, "bytes_sent_total": bytes_sent_total,
            "flat": {name: buf.clone() for name, buf in buffers.items()},
            **({} if synchronised else {"own_parameters": parameter_sums(params)})}


def onebit_entry(state_dict: Any, owner: str, required: Iterable[str] = (), *,
                 param_groups: bool = True) -> Mapping[str, Any]:
    """The ``"onebit"`` entry of ``owner``'s ``state_dict``, refused (``ValueError``) where there is
    none or it lacks the common entries, those ``required``, or (``param_groups``) the param groups."""
    if not isinstance(state_dict, Mapping) or "onebit" not in state_dict:
        raise ValueError(f"not a {owner} state_dict: missing the 'onebit' entry (keys: "
                         f"{sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__})")
    extra = state_dict["onebit"]
    missing = sorted({"world_size", "step", "bytes_sent_total", "flat", *required} - set(extra))
    if param_groups and "param_groups" not in state_dict:
        missing.append("param_groups")
    if missing:
        raise ValueError(f"incomplete {owner} state_dict: missing {missing} (truncated, or saved by another "
                         "optimizer or version)")
    return extra


def check_buffers(buffers: Mapping[str, Tensor], expected: Iterable[str], numel: int) -> None:
    """Refuse saved flat ``buffers`` other than ``expected`` or of another size than the parameters'."""
    if sorted(buffers) != sorted(expected):
        raise ValueError(f"state_dict holds buffers {sorted(buffers)}, expected {sorted(expected)}")
    for name, buf in buffers.items():
        if buf.numel() != numel:
            raise ValueError(f"state_dict buffer {name!r} has {buf.numel()} values, the parameters have {numel}")


def own_state(extra: Mapping[str, Any], world_size: int, rank: int, *, owner: str, restarts: str,
              warn: bool = True) -> bool:
    """Whether this rank saved ``extra`` on this world size; if not (and ``warn``), a warning says
    that what belongs to the rank that saved it -- ``restarts`` -- starts again here."""
    saved_rank = int(extra.get("rank", rank))  # checkpoints of earlier versions have no rank
    own = int(extra["world_size"]) == world_size and saved_rank == rank
    if not own and warn:
        _log.warning("%s state saved on world size %d by rank %d, loaded on world size %d by rank %d: %s; save and "
                     "load one state_dict per rank to resume exactly", owner, extra["world_size"], saved_rank,
                     world_size, rank, restarts)
    return own
