"""GPU paths: the Triton kernels (in Triton's interpreter here, on the device where one is
present), and CUDA tensors through every compressor, collective, optimizer and hook.

The ``cuda`` tests are skipped without a CUDA device. One GPU holds one NCCL rank, so they
use an NCCL group of world size 1; multi-rank behaviour is the CPU tests' (same code above
the kernels).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import onebit
from onebit import comm, ops
from onebit.optim import REGISTRY
from _harness import run_ranks
from _problem import OPTIMIZERS, grads, initial_params, optimizer_class

CHECK = Path(__file__).with_name("_triton_check.py")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_triton_kernels_bit_identical_to_reference_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-identical to the reference: 117 cases" in proc.stdout
    assert "dispatch through the public ops bit-identical: 72 cases" in proc.stdout


@pytest.mark.cuda
@cuda
def test_triton_kernels_bit_identical_to_reference_on_cuda():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(CHECK), "--device", "cuda"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("n", [1, 9, 1001, 1 << 20])
def test_fused_cuda_path_matches_the_reference(n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x, e = torch.randn(n, generator=g, device="cuda"), torch.randn(n, generator=g, device="cuda")
    fast_e, ref_e = e.clone(), e.clone()
    packed, scale = ops.ef_sign_compress_(fast_e, x)
    with ops.reference_kernels():
        ref_packed, ref_scale = ops.ef_sign_compress_(ref_e, x)
    assert packed.is_cuda and scale.is_cuda
    assert torch.equal(packed, ref_packed) and torch.equal(scale, ref_scale) and torch.equal(fast_e, ref_e)
    rows = [ops.pack_signs(torch.randn(n, generator=g, device="cuda")) for _ in range(3)]
    scales = [torch.rand(1, generator=g, device="cuda") for _ in range(3)]
    fast = ops.average_signs(rows, scales, n, torch.ones(n, device="cuda"), accumulate=True)
    with ops.reference_kernels():
        ref = ops.average_signs(rows, scales, n, torch.ones(n, device="cuda"), accumulate=True)
    assert torch.equal(fast, ref)
    assert torch.equal(ops.unpack_signs(packed, n, scale).cpu(), ops.unpack_signs(packed.cpu(), n, scale.cpu()))


@pytest.fixture
def nccl_world_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()




def _run(name, kwargs, device, dtype, steps=6):
    params = [p.to(device, dtype).requires_grad_() for p in initial_params()]
    opt = optimizer_class(name)(params, **kwargs)
    for step in range(1, steps + 1):
        for p, g in zip(params, grads([p.detach().float().cpu() for p in params], 0, step)):
            p.grad = g.to(device, dtype)
        opt.step()
    return params, opt


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_optimizers_on_cuda_under_nccl(nccl_world_one, name, kwargs, dtype):
    """CUDA parameters (fp32/bf16/fp16) stay on the device in their dtype and follow the CPU run
    (Birder's random bits come from a CUDA generator, which draws other numbers than the CPU's)."""
    params, opt = _run(name, kwargs, "cuda", dtype)
    ref, ref_opt = _run(name, kwargs, "cpu", dtype)
    assert all(p.is_cuda and p.dtype == dtype and torch.isfinite(p).all() for p in params)
    assert opt.stats["step"] == 6 and opt.stats["stage"] == ref_opt.stats["stage"]
    # torch.topk breaks ties between equal magnitudes one way on CUDA and another on CPU, and
    # 16-bit gradients are full of ties: Top-k picks other (equally large) values there
    ties = kwargs.get("compressor") == "topk" and dtype != torch.float32
    if not REGISTRY[name].seeded and not ties:
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for p, r in zip(params, ref):
            assert torch.allclose(p.detach().float().cpu(), r.detach().float(), atol=tol, rtol=tol), name
    state = opt.state_dict()
    fresh = _run(name, kwargs, "cuda", dtype, steps=0)[1]
    fresh.load_state_dict(state)  # checkpoints of CUDA state load back onto CUDA


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("compressor", ["sign", "identity"])
def test_streamed_diloco_on_cuda_under_nccl(nccl_world_one, compressor):
    """Each fragment's exchange finished on a thread of its own (CUDA tensors, NCCL): the CPU run's."""
    kwargs = dict(lr=0.01, sync_every=4, fragments=2, delay=1, compressor=compressor)
    params, opt = _run("diloco", kwargs, "cuda", torch.float32, steps=9)
    ref, _ = _run("diloco", kwargs, "cpu", torch.float32, steps=9)
    assert opt.stats["step"] == 9 and all(p.is_cuda for p in params)
    for p, r in zip(params, ref):
        assert torch.allclose(p.detach().cpu(), r.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb"])
def test_compressed_step_synchronises_the_host_once(nccl_world_one, name):
    """The only host round trip of a compressed step is the 4-byte "any non-finite gradient"
    flag every rank must agree on (GradScaler reads its found_inf the same way)."""
    params, opt = _run(name, dict(lr=0.01, freeze_step=2), "cuda", torch.float32, steps=4)
    assert opt.stats["stage"] == "compressed"
    for p in params:
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (the first use of the debug mode also warns that it is a prototype: not a synchronisation)
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["sign", "block_sign", "stochastic_sign", "topk"])
def test_collectives_keep_cuda_tensors_on_the_device(nccl_world_one, kind):
    x = torch.randn(1001, device="cuda")
    gather = kind == "topk"
    collective = comm.CompressedAllGather(kind) if gather else comm.CompressedAllReduce(kind)
    with comm.measure() as meter:
        out = collective(x)
    assert out.is_cuda and out.shape == x.shape and meter.bytes_sent == 0
    cpu = (comm.CompressedAllGather(kind) if gather else comm.CompressedAllReduce(kind))(x.cpu())
    if kind != "stochastic_sign":  # CPU and CUDA generators draw different numbers
        assert torch.allclose(out.cpu(), cpu, atol=1e-5)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("hook", ["error_feedback", "birder"])
def test_ddp_hooks_on_cuda_under_nccl(nccl_world_one, hook):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    if hook == "birder":
        state, fn = onebit.hooks.BirderState(), onebit.hooks.birder_hook
    else:
        state, fn = onebit.hooks.ErrorFeedbackState(), onebit.hooks.error_feedback_hook
    ddp.register_comm_hook(state, fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(30):
        x = torch.randn(64, 16, device="cuda", generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x[:, :1].sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(losses[-5:]) < sum(losses[:5])


def _warm_up_on_cuda(rank, world):
    """The default (the warm-up's all-reduce during backward) beside overlap=False on CUDA
    parameters, two gloo ranks sharing the one GPU (NCCL takes one rank per GPU)."""
    torch.cuda.set_device(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                          torch.nn.GELU(), torch.nn.Linear(64, 2)).cuda())
    a, b = models
    oa = onebit.OnebitAdam(a.parameters(), lr=1e-2, freeze_step=100, bucket_cap_mb=0.0005)
    ob = onebit.OnebitAdam(b.parameters(), lr=1e-2, freeze_step=100, overlap=False)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    same, in_backward = [], []
    for _ in range(4):
        x = torch.randn(8, 16, device="cuda", generator=gen)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        same.append(all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())))
        in_backward.append(oa.stats["buckets_in_backward"])
    return same, in_backward, len(oa._exchange.warm_bounds), oa._buckets.warmup_in_backward


@pytest.mark.cuda
@cuda
def test_warm_up_in_backward_on_cuda_tensors():
    for same, in_backward, buckets, warm in run_ranks(_warm_up_on_cuda, 2):
        assert warm and buckets >= 3 and in_backward == [buckets] * 4
        assert all(same), "the warm-up during backward differs from overlap=False on two ranks"
