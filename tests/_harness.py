"""Run a function on real gloo ranks, each its own spawned process (world sizes 2, 3, ...)."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_CTX = mp.get_context("spawn")


def _entry(fn, rank, world_size, init_file, results, args, pg_timeout):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 -- the parent re-raises it with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, pg_timeout: float = 60.0
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, computed by ``world_size`` real processes.

    ``fn`` must be a module-level function. A rank that raises makes this raise with its
    traceback; ranks still running after ``timeout`` seconds are killed and reported.
    """
    with tempfile.TemporaryDirectory() as tmp:
        results = _CTX.Queue()
        procs = [
            _CTX.Process(
                target=_entry, args=(fn, r, world_size, os.path.join(tmp, "init"), results, args, pg_timeout)
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        failures: list[str] = []
        try:
            for _ in range(world_size):
                rank, ok, value = results.get(timeout=timeout)
                if ok:
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failures.append(f"rank {rank} failed:\n{value}")
        except queue.Empty:
            failures.append(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout}s")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            raise AssertionError("\n".join(failures))
        return [out[r] for r in range(world_size)]
