"""A least-squares problem with analytic per-rank gradients, shared by the optimizer tests."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from onebit.optim import REGISTRY

DIM, BATCH = 37, 16

# Every optimizer of the registry, by its registry name, with settings that reach its compressed
# stage within a few steps: the shared contract tables iterate over these rows.
OPTIMIZERS = [(name, {**spec.kwargs, **spec.test_kwargs}) for name, spec in REGISTRY.items()]
# stats["stage"] once the row's settings reached that stage: SoftSignSGD has no compression
# stage, DiLoCo's are its inner steps ("local") and synchronisations ("outer", every step here)
_LAST_STAGE = {"softsign_sgd": "warmup", "diloco": "outer"}


def last_stage(name: str) -> str:
    return _LAST_STAGE.get(name, "compressed")


def optimizer_class(name: str) -> type:
    """The class of registry optimizer ``name`` (its row's arguments select the variant)."""
    return REGISTRY[name].cls


def flag_bytes(world: int, tensors: int = 2) -> int:
    """Bytes of the per-step agreement: a ring all-reduce of one fp32 non-finite flag, one
    has-a-gradient flag per parameter tensor (the test problem has two) and one "the warm-up's
    buckets sent during backward are stale here"."""
    return 2 * (world - 1) * 4 * (2 + tensors) // world


def check_bytes(world: int) -> int:
    """Bytes of the check an optimizer's first exchange runs, fresh or after a load (the ranks hold
    states of one step): a ring all-reduce of two int64 values per rank."""
    return 2 * (world - 1) * 8 * 2 * world // world


def different_steps(name: str, picks: Sequence[int | None]) -> str:
    """``ReplicaDivergence``'s message where rank ``r`` loaded registry optimizer ``name``'s state
    of step ``picks[r]`` (None: none)."""
    steps = ", ".join(f"rank {r}: " + ("none loaded" if s is None else f"step {s}") for r, s in enumerate(picks))
    return (f"the ranks loaded {optimizer_class(name).__name__} states saved at different steps ({steps}): "
            "every rank must load its state of one save (onebit.Checkpoints agrees on one)")


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(BATCH, DIM, generator=g)
    y = x @ torch.linspace(-1, 1, DIM) + 0.1 * torch.randn(BATCH, generator=g) + 0.5
    return x, y


def initial_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return [torch.randn(DIM, generator=g) * 0.1, torch.zeros(1)]


def grads(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor]:
    """Gradients of ``0.5 * mean((x w + b - y)^2)`` on rank ``rank``'s batch of ``step``."""
    w, b = params
    x, y = data(rank, step)
    r = x @ w + b - y
    return [x.t() @ r / BATCH, r.mean().reshape(1)]


def digest(params: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def teacher_student_loss(
    make_optimizer, steps: int, batch: int = 32, data_seed: int = 1, linear_decay: bool = False
) -> float:
    """Train a 16-64-1 tanh MLP to imitate a fixed 16-32-1 one; held-out MSE after ``steps``.

    ``make_optimizer(params)`` builds the optimizer; models are seeded identically on every call.
    ``linear_decay`` scales the learning rate from 1 down to 0 over the run.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    target = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = make_optimizer(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps) if linear_decay else None
    gen = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if schedule is not None:
            schedule.step()
    xe = torch.randn(2048, 16, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(xe), target(xe)))


def run_problem(make_optimizer, rank: int, steps: int, resume_at: int | None = None, record=None) -> dict:
    """Step ``make_optimizer(params)`` on rank ``rank``'s least-squares gradients for ``steps`` steps.

    With ``resume_at``, the optimizer and parameters go through ``torch.save`` /
    ``torch.load(weights_only=True)`` into fresh objects after that step. Returns the final
    parameters, a digest and ``opt.stats`` per step, and ``record(opt)`` per step if given.
    """
    import io

    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = make_optimizer(params)
    out = {"digests": [], "stats": [], "records": []}
    for step in range(1, steps + 1):
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
        out["digests"].append(digest(params))
        out["stats"].append(dict(opt.stats))
        if record is not None:
            out["records"].append(record(opt))
        if step == resume_at:
            buf = io.BytesIO()
            torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, buf)
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            params = [p.clone().requires_grad_() for p in ckpt["params"]]
            opt = make_optimizer(params)
            opt.load_state_dict(ckpt["opt"])
    out["params"] = [p.detach() for p in params]
    return out
