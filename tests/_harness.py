"""Run a function on real gloo ranks (one spawned process each) for the multi-rank tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onebit.launch import spawn


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]`` from real gloo processes, one thread each."""
    return spawn(fn, world_size, *args, timeout=timeout, pg_timeout=60.0, threads=1)
