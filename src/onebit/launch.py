"""Start N local ranks over gloo (loopback) and collect what each returns.

Used by the ``onebit`` command (demo, bench, train on one machine) and by the tests.
Each rank is a new process with one intra-op thread, so N ranks on N cores do not
oversubscribe; a rank that raises makes :func:`spawn` raise with its traceback, and
ranks still running after ``timeout`` seconds are killed.

Ranks are forked from multiprocessing's fork server, which imports torch and onebit once
per calling process, with what a rank's first optimizer loads (``onebit._preload``): a rank
then starts in about 0.1 s instead of the ~8 s a fresh interpreter spends importing them and
loading the optimizer's machinery (most of a short test's or benchmark cell's time). The
server runs no thread of its own, so the fork is safe; each rank still gets the
caller's current working directory, ``sys.path`` and main module (as under "spawn") and
its current environment variables.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "spawn"]

_CTX = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
if _CTX.get_start_method() == "forkserver":
    _CTX.set_forkserver_preload(["torch", "torch.distributed", "onebit", "onebit._preload"])
_GRACE = 30.0  # seconds the other ranks get to report (their collectives fail fast on a dead peer)


class RankFailure(RuntimeError):
    """One or more ranks raised or did not finish."""


def _enter_namespace(name: str) -> None:
    """Move this process into the network namespace ``name`` (``ip netns`` naming)."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):
            os.setns(fd, os.CLONE_NEWNET)
        else:  # Python < 3.12
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                errno = ctypes.get_errno()
                raise OSError(errno, f"setns into network namespace {name!r} failed: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _entry(fn, rank, world_size, init_file, results, args, pg_timeout, threads, place, environ):
    # The fork server's environment is the caller's when the server started: take today's.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)
    try:
        if place is None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        else:
            _enter_namespace(place[0])
            os.environ["GLOO_SOCKET_IFNAME"] = place[1]
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
    except BaseException:  # noqa: BLE001 -- re-raised in the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 600.0,
    pg_timeout: float = 120.0,
    threads: int = 1,
    placement: list[tuple[str, str]] | None = None,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, one gloo process per rank.

    ``fn`` must be importable (a module-level function); return values travel back
    through ``torch.save``. ``timeout=None`` waits as long as the ranks run (their
    collectives still time out on a stalled peer). ``placement`` puts rank ``r`` into network namespace
    ``placement[r][0]``, talking over its interface ``placement[r][1]`` (an emulated
    cluster's nodes); without it every rank uses loopback.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if placement is not None and len(placement) != world_size:
        raise ValueError(f"placement has {len(placement)} entries for world_size {world_size}")
    with tempfile.TemporaryDirectory() as tmp:
        results = _CTX.Queue()
        init = os.path.join(tmp, "init")
        procs = [
            _CTX.Process(
                target=_entry,
                args=(fn, r, world_size, init, results, args, pg_timeout, threads, placement and placement[r],
                      dict(os.environ)),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        failures: list[str] = []
        reported: set[int] = set()
        deadline = None if timeout is None else time.monotonic() + timeout
        grace: float | None = None  # after a rank died: time left for the others to report their errors
        try:
            while len(reported) < world_size:
                now = time.monotonic()
                if (grace is not None and now > grace) or (deadline is not None and now > deadline):
                    missing = sorted(set(range(world_size)) - reported)
                    waited = f"{_GRACE:g}s after a rank died" if grace is not None and now > grace else f"{timeout:g}s"
                    failures.append(f"ranks {missing} did not finish in {waited}")
                    break
                try:
                    rank, ok, value = results.get(timeout=0.5)
                except queue.Empty:
                    # A rank that exited without reporting (killed, crashed at start-up) fails the run now
                    # instead of after the whole timeout; the survivors get a moment to report their errors.
                    dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in reported]
                    if dead and results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        failures.append(f"ranks {dead} exited without a result (exit codes {codes})")
                        reported.update(dead)
                        grace = time.monotonic() + _GRACE
                    continue
                reported.add(rank)
                if ok:
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    failures.append(f"rank {rank} failed:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            raise RankFailure("\n".join(failures))
        return [out[r] for r in range(world_size)]
