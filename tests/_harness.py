"""Run a function on real gloo ranks (one spawned process each) for the multi-rank tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from onebit.launch import spawn


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]`` from real gloo processes, one thread each."""
    return spawn(fn, world_size, *args, timeout=timeout, pg_timeout=60.0, threads=1)


# The head of a script run by torchrun on the examples' task: each rank's process group, its
# thread, and the examples' model built from one seed (a script adds its optimizer and loop).
BYTE_TASK_SCRIPT = f"""
import os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
import onebit
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent / "examples")!r})
from _bytes import CONTEXT, byte_model, byte_windows

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = byte_model()
"""


def run_torchrun(tmp_path: Path, body: str, world_size: int, timeout: float = 120.0) -> tuple[int, str]:
    """``BYTE_TASK_SCRIPT + body`` run by ``torchrun --standalone`` on ``world_size`` ranks: its exit
    status and its output (stdout and stderr)."""
    script = tmp_path / "script.py"
    script.write_text(BYTE_TASK_SCRIPT + body)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size),
           str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr
