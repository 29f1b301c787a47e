"""One rank of an ``mpirun`` job for test_mpi.py: runs the named checks over MPI and over gloo.

Usage: ``mpirun -np N python -m mpi4py _mpi_worker.py OUTDIR CHECK [CHECK ...]``. Every rank also joins
a gloo process group (port chosen by rank 0, broadcast over MPI), so each collective and
optimizer runs on the same inputs over both transports; results go to ``OUTDIR/rank{r}.pt``
for the test to compare.
"""

from __future__ import annotations

import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import onebit  # noqa: E402
from onebit import comm  # noqa: E402
from _problem import OPTIMIZERS, digest, optimizer_class, run_problem  # noqa: E402


def _inputs(rank: int, step: int, n: int = 1001) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * step + rank))


def _metered(fn):
    with comm.measure() as m:
        out = fn()
    return out, m.bytes_sent


def collectives(rank: int, world: int) -> dict:
    """Each collective, three steps, over ``group`` = None (gloo) and "mpi"."""
    res = {}
    for backend in ("torch", "mpi"):
        kinds = {
            "sign": comm.CompressedAllReduce("sign", backend),
            "block_sign": comm.CompressedAllReduce("block_sign", backend, block_size=64),
            "topk_gather": comm.CompressedAllGather("topk", backend, ratio=0.1),
        }
        if world % 2 == 0:
            kinds["hierarchical"] = comm.HierarchicalAllReduce("sign", backend, ranks_per_node=2)
        for name, collective in kinds.items():
            res[backend, name] = [_metered(lambda: collective(_inputs(rank, step))) for step in range(3)]
        x = _inputs(rank, 9)
        res[backend, "mean"] = _metered(lambda: comm.all_reduce_mean(x.clone(), backend))
        res[backend, "mean_bf16"] = _metered(lambda: comm.all_reduce_mean(x.bfloat16(), backend))
        res[backend, "max"] = _metered(lambda: comm.all_reduce_max(x.clone(), backend))
        res[backend, "broadcast"] = _metered(lambda: comm.broadcast(x.clone(), world - 1, backend))
    return res


def optimizers(rank: int, world: int) -> dict:
    res = {}
    for backend in ("torch", "mpi"):
        for name, kwargs in OPTIMIZERS:
            cls = optimizer_class(name)
            run = run_problem(lambda params: cls(params, group=backend, **kwargs), rank, steps=6)
            res[backend, name] = {"digests": run["digests"], "bytes": [s["bytes_sent"] for s in run["stats"]],
                                  "params": run["params"]}
    return res


def _steps(model, opt, rank: int, steps: int, **stats: str) -> dict:
    """``steps`` steps on each rank's own batches: the parameters' digest and the bytes sent after
    each, and each of ``stats`` (``key=stats name``)."""
    run = {"digests": [], "bytes": [], **{key: [] for key in stats}}
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(6, 12, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        run["digests"].append(digest([p.detach() for p in model.parameters()]))
        run["bytes"].append(opt.stats["bytes_sent"])
        for key, name in stats.items():
            run[key].append(opt.stats[name])
    return run


def overlap(rank: int, world: int) -> dict:
    """The overlapped exchanges on a 3-layer MLP in 0.004 MB buckets: each bucket's non-blocking
    collectives start during backward, several in flight at once."""
    res = {}
    for backend in ("torch", "mpi"):
        for name, kwargs in (("onebit_adam", dict(freeze_step=2)), ("birder", dict(seed=1))):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.GELU(), torch.nn.Linear(48, 40),
                                        torch.nn.GELU(), torch.nn.Linear(40, 3))
            opt = optimizer_class(name)(model.parameters(), lr=0.01, group=backend, overlap=True,
                                        bucket_cap_mb=0.004, **kwargs)
            run = _steps(model, opt, rank, 6, in_backward="buckets_in_backward")
            res[backend, name] = {**run, "buckets": len(opt._exchange.bounds)}
        # Streaming DiLoCo: each fragment's exchange completed on a thread of its own, across steps
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.GELU(), torch.nn.Linear(48, 3))
        opt = onebit.DiLoCo(model.parameters(), lr=0.01, group=backend, sync_every=4, fragments=2, delay=1,
                            check_replicas_every=1)
        res[backend, "diloco_streamed"] = _steps(model, opt, rank, 9)
        opt.wait()  # the last step sent a fragment: its exchange completes before the groups go
    return res


def stall(rank: int, world: int) -> dict:
    """Rank 1 never arrives; the others must give up after their 1.5 s timeout."""
    car = comm.CompressedAllReduce("sign", "mpi", timeout=1.5)
    if rank == 1:
        time.sleep(60)  # the job is aborted long before this ends
        return {}
    start = time.monotonic()
    try:
        car(torch.ones(64))
    except comm.CollectiveError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


CHECKS = {"collectives": collectives, "optimizers": optimizers, "overlap": overlap, "stall": stall}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    world_comm = MPI.COMM_WORLD
    rank, world = world_comm.Get_rank(), world_comm.Get_size()
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world_comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {name: CHECKS[name](rank, world) for name in names}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    if "stall" in names:
        # The abandoned collective cannot be finished: as in a real job, an uncaught error
        # under ``python -m mpi4py`` aborts every rank instead of hanging in MPI_Finalize.
        time.sleep(1.0 if rank == 0 else 60)
        raise SystemExit("rank 0 gives up after the timeout")
    world_comm.Barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
