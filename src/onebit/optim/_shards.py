"""Parameters sharded by FSDP2 inside a node, replicated across nodes: HSDP with a 1-bit exchange.

FSDP2's own HSDP (``fully_shard`` on a 2-D mesh) reduce-scatters each gradient inside the node,
then all-reduces the shard across the replicas in fp32 -- over the slow link. Sharded with
``fully_shard(module, mesh=mesh["shard"])`` instead, FSDP stops after the exact reduce-scatter
and every rank holds the mean gradient of its node for its shard; the optimizer, given
``group=mesh["replicate"].get_group()``, runs its algorithm on the local shards and exchanges
each shard with the ranks holding the same shard on the other nodes, compressed. Its state is
that of the shard only.

What is a function of a whole parameter -- 1-bit LAMB's trust ratios, scaling ratios and
momentum scales -- is reduced over the ranks sharing it (:meth:`Shards.sum_per_param`,
:meth:`Shards.max_per_param`: one small all-reduce of a vector with an entry per parameter,
inside the node). Refused: ``max_grad_norm`` (``torch.nn.utils.clip_grad_norm_`` on the DTensor
parameters computes the global norm; call it before ``step()``) and ``overlap`` (FSDP overlaps
its reduce-scatter with backward; the exchange runs in ``step()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm

__all__ = ["Shards"]


def _dtensor_types() -> tuple[type, type, type] | None:
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # a build of torch without distributed
        return None
    return DTensor, Replicate, Shard


class Shards:
    """The local shards of FSDP2-sharded parameters, standing in for them in the flat state.

    ``tensors``: what the optimizer updates -- the parameters themselves, or each DTensor's
    local shard (a view of FSDP's sharded storage, so an in-place update is the parameter's).
    ``sharded``: the parameters are DTensors. ``agreement_group``: where the ranks agree to
    take a step (the whole job when sharded: every shard must take the same steps).
    ``shard_group``: the ranks that share each parameter (FSDP's mesh; None when not sharded).
    ``numels``: each parameter's whole number of values.
    """

    def __init__(self, params: Sequence[Tensor], group: object, owner: str,
                 timeout: float | timedelta | None = None) -> None:
        self.params = list(params)
        self.numels = [p.numel() for p in self.params]  # a DTensor's is the whole parameter's
        self.shard_group = None
        self._timeout = timeout
        types = _dtensor_types()
        flat = [p for p in self.params if getattr(p, "_is_flat_param", False)]
        if flat:
            raise TypeError(
                f"{owner} got a FullyShardedDataParallel (FSDP1) flat parameter of {flat[0].numel()} values: "
                "each rank holds a different piece of it, which a replicated optimizer would overwrite; shard "
                "with FSDP2's fully_shard(module, mesh=mesh['shard']) and pass group=mesh['replicate'].get_group(), "
                "or use DistributedDataParallel"
            )
        dtensors = [] if types is None else [p for p in self.params if isinstance(p, types[0])]
        self.sharded = bool(dtensors)
        self.agreement_group = group
        if not self.sharded:
            self.tensors = self.params
            return
        if len(dtensors) != len(self.params):
            raise ValueError(
                f"{owner} got {len(dtensors)} DTensor parameters (FSDP2) and {len(self.params) - len(dtensors)} "
                "plain ones: a parameter FSDP does not shard is a full copy on every rank of the node, which "
                "the exchange between nodes alone cannot keep identical; shard every parameter or none"
            )
        self._check_placements(dtensors, owner)
        self._check_group(dtensors[0].device_mesh, group, owner)
        self.agreement_group = None  # the whole job
        self.shard_group = dtensors[0].device_mesh.get_group()
        with torch.no_grad():  # plain views of FSDP's storage, not autograd views of the parameters
            self.tensors = [p.to_local() for p in dtensors]

    @staticmethod
    def _check_placements(dtensors: list[Tensor], owner: str) -> None:
        _, replicate, shard = _dtensor_types()
        mesh = dtensors[0].device_mesh
        for i, p in enumerate(dtensors):
            placements = tuple(p.placements)
            if placements == (replicate(), shard(0)):
                raise ValueError(
                    f"{owner}: parameter {i} is sharded by FSDP2's HSDP (a 2-D mesh, placements "
                    f"{placements}), which all-reduces every gradient between the replicas in fp32 itself; "
                    "shard inside the node only, fully_shard(module, mesh=mesh['shard']), and pass "
                    "group=mesh['replicate'].get_group() so that the exchange between replicas is onebit's"
                )
            if placements != (shard(0),):
                raise ValueError(
                    f"{owner}: parameter {i} has DTensor placements {placements} on a {p.device_mesh.ndim}-D mesh; "
                    "only FSDP2's (Shard(dim=0),) on the node's 1-D mesh is supported (tensor parallelism is not)"
                )
            if p.device_mesh != mesh:
                raise ValueError(f"{owner}: parameter {i} is sharded on another mesh than parameter 0 "
                                 f"({p.device_mesh} vs {mesh}); shard every parameter on the same mesh")

    @staticmethod
    def _check_group(mesh: object, group: object, owner: str) -> None:
        """``group`` must hold this rank's replicas: one rank of every node, each holding the same
        shard -- the ranks of the shard mesh and of the group meet in this rank only."""
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"{owner} got DTensor parameters without an initialised process group")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise ValueError(f"{owner}: Invalid group for FSDP2-sharded parameters: {type(group).__name__} (its "
                             "replicas are one process each); pass torch.distributed's group of this rank's "
                             "replicas, mesh['replicate'].get_group()")
        shard_ranks = set(mesh.mesh.flatten().tolist())
        replica_ranks = set(dist.get_process_group_ranks(group)) if group is not None \
            else set(range(dist.get_world_size()))
        if shard_ranks & replica_ranks != {dist.get_rank()} or \
                len(shard_ranks) * len(replica_ranks) != dist.get_world_size():
            raise ValueError(
                f"Invalid group for FSDP2-sharded parameters: ranks {sorted(replica_ranks)}, with the shard mesh "
                f"on ranks {sorted(shard_ranks)} (world size {dist.get_world_size()}); pass the replicas of this "
                "rank's shard, group=mesh['replicate'].get_group() of the 2-D mesh whose mesh['shard'] FSDP shards on"
            )

    def sum_per_param(self, values: Tensor) -> Tensor:
        """``values`` (an entry per parameter, computed on the local shards) summed over the ranks
        sharing each parameter, in place; as it is when the parameters are whole."""
        return values if self.shard_group is None else comm.all_reduce_sum(values, self.shard_group, self._timeout,
                                                                           link="intra")

    def max_per_param(self, values: Tensor) -> Tensor:
        """As :meth:`sum_per_param`, the maximum."""
        return values if self.shard_group is None else comm.all_reduce_max(values, self.shard_group, self._timeout)

    def bind_grads(self) -> None:
        """Point each local shard's ``.grad`` at its parameter's local gradient (or None): the
        algorithm reads gradients from the tensors it updates."""
        if self.sharded:
            for i, p in enumerate(self.params):
                # Taken afresh (the flat state holds this list): FSDP may re-create its sharded storage
                self.tensors[i] = t = p.to_local()
                t.grad = None if p.grad is None else p.grad.to_local()

    def release_grads(self) -> None:
        """Drop the references :meth:`bind_grads` made, so that ``zero_grad`` frees the gradients."""
        if self.sharded:
            for t in self.tensors:
                t.grad = None

