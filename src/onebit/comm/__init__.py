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
    all_gather_object_sizes,
    all_reduce_max,
    all_reduce_mean,
    backend_of,
    barrier,
    broadcast,
    check_world_size,
    get_rank,
    get_world_size,
    is_distributed,
    resolve_group,
    run_stages,
    to_timedelta,
)
from ._mpi import MPIGroup
from ._meter import Meter, measure, record

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
    "all_gather_object_sizes",
    "all_reduce_max",
    "all_reduce_mean",
    "backend_of",
    "barrier",
    "broadcast",
    "check_world_size",
    "chunk_bounds",
    "compressed_allreduce",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "measure",
    "record",
    "resolve_group",
    "run_stages",
    "to_timedelta",
]
