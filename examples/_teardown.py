"""Ending an example's gloo run without a hang at exit."""

from __future__ import annotations

import gc

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def destroy_process_group() -> None:
    """Destroy the default group once every DDP model is gone; raise if one is still alive.

    DDP's C++ reducer holds the process group. If the reducer drops the group's last
    reference, the group's destructor joins gloo's worker threads with the GIL held, while a
    worker may still be releasing a finished collective's tensors, which needs the GIL: a hang
    at exit (seen after the Trainer's last all_gather, about one run in seven). A reducer freed
    while the group is still registered only decrements a count; ``destroy_process_group``
    then drops the group's Python object, whose destructor releases the GIL while it joins.
    """
    dist.barrier()  # no rank tears the group down while another still uses it
    gc.collect()  # DDP modules held only by reference cycles
    alive = [obj for obj in gc.get_objects() if isinstance(obj, DistributedDataParallel)]
    if alive:
        raise RuntimeError(f"{len(alive)} DistributedDataParallel model(s) still referenced: delete them first")
    dist.destroy_process_group()
