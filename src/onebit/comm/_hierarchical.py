"""Birder's Hierarchical-1-bit-All-Reduce (section 4, Figure 1), and the flat/hierarchical choice."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from .._checks import check_entries
from ..compress import Compressor
from ._compressed import CompressedAllReduce, _Sized, _check_segments, chunk_bounds, chunk_codecs
from ._wire import read_payload
from ._dist import Stages, all_gather_bytes, reduce_scatter_mean, run_stages, split, to_timedelta
from ._transport import Group, get_rank, get_world_size

__all__ = ["HierarchicalAllReduce", "compressed_allreduce", "resolve_ranks_per_node"]

_log = logging.getLogger(__name__)

# Sub-groups are created once per (parent group, ranks per node): creating one is collective
# (torch's new_group over the whole default group, MPI's Comm.Split) and costs a round trip.
_SUBGROUPS: dict[tuple[Any, int], tuple[Any, Any]] = {}


def resolve_ranks_per_node(ranks_per_node: int | None, world_size: int) -> int | None:
    """``ranks_per_node`` validated, else torchrun's ``LOCAL_WORLD_SIZE``, else ``None`` (unknown)."""
    if ranks_per_node is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            return None
        try:
            ranks_per_node = int(env)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an int, got {env!r}") from None
        source = "LOCAL_WORLD_SIZE"
    else:
        source = "ranks_per_node"
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
            raise TypeError(f"ranks_per_node must be an int, got {ranks_per_node!r}")
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"{source}={ranks_per_node} must be >= 1 and divide the world size {world_size}")
    return ranks_per_node


def _subgroups(group: Group, per_node: int, timeout: timedelta) -> tuple[Any, Any]:
    """(this rank's node group, this rank's inter-node group of equal local index)."""
    key = (group, per_node)
    if key not in _SUBGROUPS:
        world = get_world_size(group)
        nodes = world // per_node
        intra = [list(range(k * per_node, (k + 1) * per_node)) for k in range(nodes)]
        inter = [list(range(local, world, per_node)) for local in range(per_node)]
        _SUBGROUPS[key] = (split(intra, group, timeout), split(inter, group, timeout))
    return _SUBGROUPS[key]


class _InterNode(CompressedAllReduce):
    """The 1-bit all-reduce of one shard between nodes; its bytes count as inter-node."""

    _link = "inter"


class HierarchicalAllReduce(_Sized):
    """Hierarchical-1-bit-All-Reduce (Birder section 4) over ``nodes x ranks_per_node`` ranks.

    Group ranks ``k * ranks_per_node ... (k + 1) * ranks_per_node - 1`` form node ``k``.

    1. Intra-node reduce-scatter in fp32: local rank ``l`` gets the node's average of shard ``l``.
    2-3. The shard goes through a :class:`CompressedAllReduce` among the ranks with the same
       local index on every node (worker error, all-to-all, average + server error,
       re-compress, all-gather) -- the only traffic between nodes.
    4. Intra-node all-gather of the compressed shards; every rank decodes the same bytes,
       so the result is bit-identical on all ranks.

    Between nodes each rank sends ``2 (n - 1) / n`` of its shard's 1-bit size, instead of
    the flat scheme's ``2 (w - 1) / w`` of the whole tensor's. With one rank per node it
    computes exactly what :class:`CompressedAllReduce` computes; on one node it is an
    fp32 reduce-scatter, one error-compensated quantisation per shard and a 1-bit all-gather.
    The byte meter labels the phases' links ``"intra"`` and ``"inter"``. Sub-groups are
    created at construction, collectively: every rank of the default group must construct it.

    Args:
        compressor: as :class:`CompressedAllReduce`'s (``"sign"``).
        group: process group (``None``: default); its ranks are ``nodes x ranks_per_node``.
        ranks_per_node: ranks on each node (``None``: torchrun's ``LOCAL_WORLD_SIZE``).
        segments: as :class:`CompressedAllReduce`'s (the pieces of every shard's chunks).
        timeout: per-collective timeout (``None``: 300 s).
        flag_nonfinite: as :class:`CompressedAllReduce`'s, over every rank's input
            (:attr:`nonfinite`).
        **compressor_kwargs: passed to :func:`onebit.compress.get`.
    """

    def __init__(
        self,
        compressor: str | Compressor = "sign",
        group: Group = None,
        *,
        ranks_per_node: int | None = None,
        segments: Sequence[int] | None = None,
        timeout: float | timedelta | None = None,
        flag_nonfinite: bool = False,
        **compressor_kwargs: Any,
    ) -> None:
        super().__init__(compressor, group, timeout, compressor_kwargs)
        self.segments = _check_segments(segments, self.compressor)
        per_node = resolve_ranks_per_node(ranks_per_node, self._world_size)
        if per_node is None:
            raise ValueError("ranks_per_node is required when LOCAL_WORLD_SIZE is not set")
        self.ranks_per_node = per_node
        self.nodes = self._world_size // per_node
        if self._world_size > 1:
            self.node_group, cross_group = _subgroups(self.group, per_node, self.timeout)
        else:
            self.node_group = cross_group = self.group
        # The inner collective owns the worker and server errors of this rank's shard.
        self.inter = _InterNode(self.compressor, cross_group, timeout=self.timeout, flag_nonfinite=flag_nonfinite)

    @property
    def nonfinite(self) -> Tensor | None:
        return self.inter.nonfinite

    def _size(self, numel: int, device: torch.device) -> None:
        align = self.compressor.alignment * self.nodes
        self._shards = chunk_bounds(numel, self.ranks_per_node, align)
        span = -(-numel // (self.ranks_per_node * align)) * align  # shard l starts at l * span
        self._padded = torch.zeros(self.ranks_per_node * span, dtype=torch.float32, device=device)
        self._inner_bounds = [chunk_bounds(hi - lo, self.nodes, self.compressor.alignment) for lo, hi in self._shards]
        # Each shard's pieces, from its own start: its chunks' codes, and the inner collective's.
        pieces = [None if self.segments is None else [s - lo for s in self.segments if lo < s < hi]
                  for lo, hi in self._shards]
        self._codecs = [chunk_codecs(self.compressor, bounds, p) for bounds, p in zip(self._inner_bounds, pieces)]
        self.inter.segments = pieces[get_rank(self.node_group)]
        # every shard's slots the size of the largest payload of any (the node's all-gather)
        self.inter._min_slot = max(c.wire_bytes(b - a) for codecs, bounds in zip(self._codecs, self._inner_bounds)
                                   for c, (a, b) in zip(codecs, bounds))

    def __call__(self, tensor: Tensor, out: Tensor | None = None) -> Tensor:
        """Compressed average of ``tensor`` over the group; written to ``out`` when given."""
        return run_stages(self.stages(tensor, out))

    def stages(self, tensor: Tensor, out: Tensor | None = None) -> Stages:
        """``self(tensor, out)`` in stages, as :meth:`CompressedAllReduce.stages`: the intra-node
        reduce-scatter, the inter-node exchange's two, the intra-node all-gather, then decode."""
        tensor = self._prepare(tensor, out)
        flat = tensor.detach().reshape(-1)
        self._padded[: flat.numel()].copy_(flat)
        inflight = reduce_scatter_mean(self._padded, self.node_group, self.timeout, "intra", async_op=True)
        yield inflight
        shard = inflight.wait()
        lo, hi = self._shards[get_rank(self.node_group)]
        mine = self.inter._prepare(shard[: hi - lo], None)
        gathered = yield from self.inter._stages(mine, self.inter.worker_error.buffer(mine.numel(), mine.device))
        inflight = all_gather_bytes(gathered, self.node_group, self.timeout, "intra", async_op=True)
        yield inflight
        everything = inflight.wait()
        self.inter._read_flags(everything)  # every shard's flags, all ranks' inputs between them
        result = self._output(out, flat)
        slot, per_shard = self.inter._slot, gathered.numel()
        for s, (lo, _) in enumerate(self._shards):
            for j, (a, b) in enumerate(self._inner_bounds[s]):
                start = s * per_shard + j * slot
                codec = self._codecs[s][j]
                codec.decompress(read_payload(codec, everything[start : start + slot], b - a),
                                 out=result[lo + a : lo + b])
        return self._finish(result, tensor, out)

    def state_dict(self) -> dict[str, Any]:
        """The shard's worker and server errors and the compressor state, with the layout they belong to."""
        return {
            "world_size": self._world_size,
            "ranks_per_node": self.ranks_per_node,
            "numel": self._numel,
            "inter": self.inter.state_dict(),
        }

    def check_state_dict(self, state: Any) -> None:
        owner = type(self).__name__
        check_entries(state, ("world_size", "ranks_per_node", "inter"), owner)
        if (state["world_size"], state["ranks_per_node"]) == (self._world_size, self.ranks_per_node):
            self.inter.check_state_dict(state["inter"])
        else:  # the errors restart, unread
            check_entries(state["inter"], ("compressor",), f"{owner} inter")
            self.compressor.check_state_dict(state["inter"]["compressor"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; on another world or node size the errors restart at zero (warning)."""
        layout = (state["world_size"], state["ranks_per_node"])
        if layout == (self._world_size, self.ranks_per_node):
            self.inter.load_state_dict(state["inter"])
            return
        self.compressor.load_state_dict(state["inter"]["compressor"])
        _log.warning(
            "HierarchicalAllReduce state saved on %d ranks (%d per node), loaded on %d (%d per node): "
            "error-feedback buffers re-created as zeros",
            *layout,
            self._world_size,
            self.ranks_per_node,
        )
        self.reset()

    def reset(self) -> None:
        """Forget all error-feedback state (errors restart at zero)."""
        self.inter.reset()


def compressed_allreduce(
    compressor: str | Compressor = "sign",
    group: Group = None,
    *,
    hierarchical: bool | str = False,
    ranks_per_node: int | None = None,
    segments: Sequence[int] | None = None,
    timeout: float | timedelta | None = None,
    flag_nonfinite: bool = False,
    **compressor_kwargs: Any,
) -> CompressedAllReduce | HierarchicalAllReduce:
    """The compressed all-reduce an optimizer or hook should use.

    Args:
        compressor: as :class:`CompressedAllReduce`'s.
        group: process group (``None``: default), an :class:`MPIGroup` or a backend name.
        hierarchical: ``False``: :class:`CompressedAllReduce`; ``True``:
            :class:`HierarchicalAllReduce` (``ranks_per_node`` or ``LOCAL_WORLD_SIZE``
            required); ``"auto"``: hierarchical when the node size is known and the group
            spans more than one node with more than one rank on each, flat otherwise.
        ranks_per_node: ranks on each node (``None``: torchrun's ``LOCAL_WORLD_SIZE``).
        segments: see :class:`CompressedAllReduce` (one scale per piece of each chunk).
        timeout: per-collective timeout (``None``: 300 s).
        flag_nonfinite: see :class:`CompressedAllReduce`.
        **compressor_kwargs: passed to :func:`onebit.compress.get`.

    Returns:
        The collective, sized on its first call.

    Examples:
        >>> car = onebit.comm.compressed_allreduce("sign", hierarchical="auto")
        >>> type(car).__name__  # one process: no nodes to span
        'CompressedAllReduce'
    """
    if hierarchical not in (True, False, "auto"):
        raise ValueError(f"hierarchical must be True, False or 'auto', got {hierarchical!r}")
    timeout = to_timedelta(timeout)
    if hierarchical == "auto":
        world = get_world_size(group)
        per_node = resolve_ranks_per_node(ranks_per_node, world)
        hierarchical = per_node is not None and 1 < per_node < world
    if hierarchical:
        return HierarchicalAllReduce(
            compressor, group, ranks_per_node=ranks_per_node, segments=segments, timeout=timeout,
            flag_nonfinite=flag_nonfinite, **compressor_kwargs
        )
    if ranks_per_node is not None:
        resolve_ranks_per_node(ranks_per_node, get_world_size(group))
    return CompressedAllReduce(compressor, group, segments=segments, timeout=timeout, flag_nonfinite=flag_nonfinite,
                               **compressor_kwargs)
