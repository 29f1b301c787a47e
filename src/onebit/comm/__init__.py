"""Collectives: the only package that calls ``torch.distributed`` (and mpi4py, for ``group="mpi"``)."""

from ._allgather import CompressedAllGather
from ._compressed import CompressedAllReduce, Consume, chunk_bounds
from ._hierarchical import HierarchicalAllReduce, compressed_allreduce
from ._dist import (
    DEFAULT_TIMEOUT,
    CollectiveError,
    Pending,
    Stages,
    all_gather_object_sizes,
    all_reduce_max,
    all_reduce_sum,
    all_reduce_mean,
    all_reduce_mean_stages,
    barrier,
    broadcast,
    duplicate,
    run_stages,
    to_timedelta,
)
from ._mpi import MPIGroup
from ._pipeline import Pipeline, run_pipelined
from ._quorum import Quorum
from ._meter import Meter, measure, record
from ._nonfinite import agree, nonfinite
from ._trace import Trace, instant, labelled, link_bytes, span, trace
from ._transport import (
    BACKENDS,
    Group,
    backend_of,
    check_world_size,
    concurrent,
    device_of,
    get_rank,
    get_world_size,
    is_distributed,
    reforms,
    resolve_group,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "CompressedAllGather",
    "CompressedAllReduce",
    "Consume",
    "Group",
    "HierarchicalAllReduce",
    "MPIGroup",
    "Meter",
    "Pending",
    "Pipeline",
    "Quorum",
    "Stages",
    "Trace",
    "agree",
    "all_gather_object_sizes",
    "all_reduce_max",
    "all_reduce_sum",
    "all_reduce_mean",
    "all_reduce_mean_stages",
    "backend_of",
    "barrier",
    "broadcast",
    "check_world_size",
    "chunk_bounds",
    "compressed_allreduce",
    "concurrent",
    "device_of",
    "duplicate",
    "get_rank",
    "get_world_size",
    "instant",
    "is_distributed",
    "labelled",
    "link_bytes",
    "measure",
    "nonfinite",
    "record",
    "reforms",
    "resolve_group",
    "run_pipelined",
    "run_stages",
    "span",
    "to_timedelta",
    "trace",
]
