"""The MPI transport under a real ``mpirun``: every collective and optimizer against gloo.

Each job runs ``_mpi_worker.py`` on N ranks that hold both an MPI communicator and a gloo
process group, so the same inputs go through both transports in the same processes.
Skipped where ``mpirun`` or mpi4py is missing (the test extra installs both on Linux).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onebit.optim import REGISTRY
import torch

import onebit
from onebit import comm
from onebit.cli import main

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found")]
pytest.importorskip("mpi4py.MPI", reason="mpi4py or its MPI library is missing")

WORKER = Path(__file__).with_name("_mpi_worker.py")


def _launch(world: int, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``mpirun -np world python -m mpi4py args...`` (an uncaught error aborts the whole job)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-np", str(world), sys.executable, "-m", "mpi4py", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _mpirun(world: int, out: Path, *checks: str, timeout: float = 240.0) -> tuple[int, float]:
    start = time.monotonic()
    proc = _launch(world, str(WORKER), str(out), *checks, timeout=timeout)
    elapsed = time.monotonic() - start
    if "stall" not in checks and proc.returncode:
        pytest.fail(f"mpirun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.returncode, elapsed


_JOBS: dict[int, list[dict]] = {}


def _results(world: int, tmp_path_factory) -> list[dict]:
    """Per-rank results of one job per world size, shared by the tests below."""
    if world not in _JOBS:
        out = tmp_path_factory.mktemp(f"mpi{world}")
        checks = ("collectives", "optimizers", "overlap") if world < 4 else ("collectives",)
        _mpirun(world, out, *checks)
        _JOBS[world] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return _JOBS[world]


def _same(a, b, exact: bool) -> bool:
    """Equal, or within rounding of the last sum (bf16: one ulp of values up to 4)."""
    atol = 1e-6 if a.dtype == torch.float32 else 2**-5
    return torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_compressed_collectives_over_mpi_equal_gloo_bit_for_bit(world, tmp_path_factory):
    ranks = _results(world, tmp_path_factory)
    names = {name for _, name in ranks[0]["collectives"] if isinstance(ranks[0]["collectives"]["mpi", name], list)}
    assert {"sign", "block_sign", "topk_gather"} <= names and ("hierarchical" in names) == (world % 2 == 0)
    for name in names:
        for rank in ranks:
            mpi, gloo = rank["collectives"]["mpi", name], rank["collectives"]["torch", name]
            for step, ((out_m, bytes_m), (out_g, bytes_g)) in enumerate(zip(mpi, gloo)):
                assert torch.equal(out_m, out_g), (name, step)
                assert torch.equal(out_m, ranks[0]["collectives"]["mpi", name][step][0]), (name, step)
                assert bytes_m == bytes_g > 0


@pytest.mark.parametrize("world", [2, 3])
def test_plain_collectives_over_mpi(world, tmp_path_factory):
    """Max and broadcast are exact; sums match gloo bit for bit on 2 ranks (a + b is
    commutative) and to rounding on 3 (the order of a three-way sum is each library's own);
    every rank gets the same bytes either way."""
    ranks = _results(world, tmp_path_factory)
    x = [torch.randn(1001, generator=torch.Generator().manual_seed(900 + r)) for r in range(world)]
    expect = {"max": torch.stack(x).amax(0), "broadcast": x[-1], "mean": sum(x) / world}
    for rank in ranks:
        res = rank["collectives"]
        for name in ("max", "broadcast", "mean", "mean_bf16"):
            out_m, out_g = res["mpi", name][0], res["torch", name][0]
            assert torch.equal(out_m, ranks[0]["collectives"]["mpi", name][0]), name
            assert _same(out_m, out_g, exact=world == 2 or name in ("max", "broadcast")), name
            assert res["mpi", name][1] == res["torch", name][1]
            if name in expect:
                assert torch.allclose(out_m, expect[name], atol=1e-6), name
        assert res["mpi", "mean_bf16"][0].dtype == torch.bfloat16


@pytest.mark.parametrize("world", [2, 3])
def test_every_optimizer_accepts_the_mpi_backend(world, tmp_path_factory):
    ranks = _results(world, tmp_path_factory)
    names = {name for _, name in ranks[0]["optimizers"]}
    assert names == set(REGISTRY)
    for name in names:
        mpi = [r["optimizers"]["mpi", name] for r in ranks]
        gloo = ranks[0]["optimizers"]["torch", name]
        assert all(m["digests"] == mpi[0]["digests"] for m in mpi), f"{name}: ranks differ over MPI"
        assert mpi[0]["bytes"] == gloo["bytes"], name
        if world == 2:
            assert mpi[0]["digests"] == gloo["digests"], name
        for a, b in zip(mpi[0]["params"], gloo["params"]):
            assert torch.allclose(a, b, atol=1e-4), name


@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_exchanges_over_mpi_equal_gloo(world, tmp_path_factory):
    """Several buckets' non-blocking MPI collectives in flight at once, started during backward."""
    ranks = _results(world, tmp_path_factory)
    for name in ("onebit_adam", "birder"):
        mpi = [r["overlap"]["mpi", name] for r in ranks]
        gloo = ranks[0]["overlap"]["torch", name]
        assert mpi[0]["buckets"] >= 3 and all(n == mpi[0]["buckets"] for n in mpi[0]["in_backward"]), name
        assert all(m["digests"] == mpi[0]["digests"] for m in mpi), f"{name}: ranks differ over MPI"
        assert mpi[0]["bytes"] == gloo["bytes"], name
        if world == 2:  # a sum of two values does not depend on the order
            assert mpi[0]["digests"] == gloo["digests"], name
    for r in ranks:  # streamed DiLoCo: every rank's own parameters (they differ between ranks by design)
        mpi, gloo = r["overlap"]["mpi", "diloco_streamed"], r["overlap"]["torch", "diloco_streamed"]
        assert mpi["bytes"] == gloo["bytes"] and sum(mpi["bytes"]) > 0
        if world == 2:
            assert mpi["digests"] == gloo["digests"]


def test_stalled_mpi_peer_gives_a_timeout_error_and_the_job_aborts(tmp_path):
    rc, elapsed = _mpirun(3, tmp_path, "stall", timeout=120)
    assert rc != 0 and elapsed < 60
    for r in (0, 2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["stall"]
        assert res["error"] == f"all_to_all on MPI communicator MPI_COMM_WORLD (rank {r} of 3) timed out (timeout 1.5s)"
        assert res["elapsed"] < 5


def test_onebit_train_under_mpirun_matches_the_spawned_gloo_run(tmp_path):
    """``mpirun -np 2 onebit train --backend mpi`` follows the gloo run loss for loss (two-rank
    sums do not depend on the order), saved after step 6 and resumed over MPI (``onebit.Checkpoints``
    on its communicator), and only rank 0 writes the outputs. MPI has no bf16 sum: its variance
    refresh sums in fp32, as the gloo run's with ``--refresh-dtype fp32``."""
    flags = ["--optimizer", "onebit_adam", "--freeze-step", "4", "--batch-size", "8", "--quiet"]
    for steps, more in (("6", ["--checkpoint-every", "6"]), ("12", ["--resume"])):
        proc = _launch(2, "-m", "onebit.cli", "train", "--backend", "mpi", "--out", str(tmp_path / "mpi"), "--steps",
                       steps, *more, *flags, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.stdout.count("metrics: ") == 1
    assert main(["train", "--world-size", "2", "--refresh-dtype", "fp32", "--out", str(tmp_path / "gloo"),
                 "--steps", "12", *flags]) == 0
    mpi, gloo = (
        [json.loads(line) for line in (tmp_path / run / "onebit_adam" / "metrics.jsonl").read_text().splitlines()]
        for run in ("mpi", "gloo")
    )
    # the first step after the load also sends the check that the ranks loaded one save: an
    # all-reduce of 2 int64 values per rank, 2 * (2 - 1) * 32 / 2 bytes a rank
    check = [32 if r["step"] == 7 else 0 for r in gloo]
    assert [(r["loss"], r["bytes_sent"], r["stage"]) for r in mpi] == [(r["loss"], r["bytes_sent"] + c, r["stage"])
                                                                      for r, c in zip(gloo, check)]
    assert [r["stage"] for r in mpi][3:] == ["warmup"] + ["compressed"] * 7 + ["refresh"]  # every 8th step


def test_bench_comm_under_mpirun_reports_from_rank_zero():
    proc = _launch(3, "-m", "onebit.cli", "bench", "comm", "--backend", "mpi", "--numel", "4099", "--repeat", "2",
                   timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("onebit bench comm: 4099 fp32 values, 3 ranks (mpi)") == 1
    assert "compressed_allreduce sign" in proc.stdout


def test_mpi_group_in_one_process():
    """Singleton MPI (no mpirun): world size 1, the same contract as an absent process group."""
    group = comm.MPIGroup()
    assert comm.backend_of(group) == comm.backend_of("mpi") == "mpi" and comm.get_world_size("mpi") == 1
    x = torch.randn(33)
    assert torch.equal(comm.CompressedAllReduce("sign", "mpi")(x), comm.CompressedAllReduce("sign")(x))
    opt = onebit.OnebitAdam([torch.nn.Parameter(torch.ones(3))], group="mpi")
    assert opt.world_size == 1
    with pytest.raises(TypeError, match="comm must be an mpi4py intra-communicator, got int"):
        comm.MPIGroup(3)
    with pytest.raises(ValueError, match="process_group must be a torch.distributed process group"):
        onebit.hooks.ErrorFeedbackState(process_group="mpi")
