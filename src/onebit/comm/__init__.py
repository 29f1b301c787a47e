"""Collectives: the only package that calls ``torch.distributed``."""

from ._compressed import CompressedAllGather, CompressedAllReduce, chunk_bounds
from ._hierarchical import HierarchicalAllReduce, compressed_allreduce
from ._dist import (
    DEFAULT_TIMEOUT,
    CollectiveError,
    all_reduce_max,
    all_reduce_mean,
    broadcast,
    get_rank,
    get_world_size,
    is_distributed,
)
from ._meter import Meter, measure

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "CompressedAllGather",
    "CompressedAllReduce",
    "HierarchicalAllReduce",
    "Meter",
    "all_reduce_max",
    "all_reduce_mean",
    "broadcast",
    "chunk_bounds",
    "compressed_allreduce",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "measure",
]
