"""Collectives: the only package that calls ``torch.distributed`` (and mpi4py, for ``group="mpi"``)."""

from ._compressed import CompressedAllGather, CompressedAllReduce, chunk_bounds
from ._hierarchical import HierarchicalAllReduce, compressed_allreduce
from ._dist import (
    BACKENDS,
    DEFAULT_TIMEOUT,
    CollectiveError,
    Group,
    Pending,
    Stages,
    all_reduce_max,
    all_reduce_mean,
    backend_of,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    is_distributed,
    resolve_group,
    run_stages,
)
from ._mpi import MPIGroup
from ._meter import Meter, measure

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "CompressedAllGather",
    "CompressedAllReduce",
    "Group",
    "HierarchicalAllReduce",
    "MPIGroup",
    "Meter",
    "Pending",
    "Stages",
    "all_reduce_max",
    "all_reduce_mean",
    "backend_of",
    "barrier",
    "broadcast",
    "chunk_bounds",
    "compressed_allreduce",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "measure",
    "resolve_group",
    "run_stages",
]
