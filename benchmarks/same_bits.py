"""Same bits across a refactor: every registry optimizer, step by step, on real gloo ranks.

A behaviour-preserving change must leave the parameters, the checkpointed state (flat
buffers, stages, the collectives' worker and server errors), the bytes sent and the stage of
every step identical. This script records them after every step of a small model with what
real models contain (an embedding with rows never looked up, a frozen layer, a parameter used
on one rank only, one never used, a zero-size one, a channels_last convolution), for every
entry of ``onebit.optim.REGISTRY`` in each configuration it takes:

* ``plain``, ``clip`` (``max_grad_norm``), ``skip`` (a NaN on rank 1 at step 3), ``resume``
  (``state_dict`` through ``torch.save`` into fresh objects after step 4), on 2 and 3 ranks;
* ``overlap``, ``overlap_skip``, ``overlap_resume`` (small buckets) where the entry overlaps;
* ``hierarchical`` (4 ranks, 2 per node) where it takes the hierarchical exchange;
* 0/1 Adam with intervals of local steps (``local``, ``local_resume``);
* ``hsdp``: FSDP2 inside 2 nodes of 2 ranks, the 1-bit exchange between them.

Usage, from a checkout::

    python benchmarks/same_bits.py /tmp/before            # capture
    python benchmarks/same_bits.py /tmp/after --against /tmp/before   # capture again, compare
    python benchmarks/same_bits.py /tmp/b --optimizers zero_one_adam,diloco  # some entries only (both captures)
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
from typing import Any

import torch
from torch import nn

import onebit
from onebit.launch import spawn
from onebit.optim import REGISTRY, make_optimizer

_STEPS = 8
_NAN_AT, _RESUME_AT = 3, 4
_BUCKET_MB = 0.001  # ~262 values: several buckets on this model
# 0/1 Adam with local steps: intervals of 1, 2 and 4 steps after the freeze at step 3.
_LOCAL = {"var_freeze_step": 3, "var_update_scaler": 1, "local_step_scaler": 2, "local_step_clipper": 4}


class _Net(nn.Module):
    one_rank_only = True  # rank0_only's gradient exists on rank 0 only

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 6)  # rows 10-19 are never looked up
        self.conv = nn.Conv2d(2, 3, 3).to(memory_format=torch.channels_last)
        self.lin1 = nn.Linear(6 + 3, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.lin2 = nn.Linear(16, 3)
        self.rank0_only = nn.Parameter(torch.randn(4))
        self.unused = nn.Parameter(torch.randn(5))
        self.empty = nn.Parameter(torch.empty(0))

    def forward(self, step: int, rank: int) -> torch.Tensor:  # FSDP2's hooks run around forward
        gen = torch.Generator().manual_seed(1000 * step + rank)
        idx = torch.randint(0, 10, (8, 3), generator=gen)
        img = torch.randn(8, 2, 5, 5, generator=gen).to(memory_format=torch.channels_last)
        y = torch.randn(8, 3, generator=gen)
        h = torch.cat([self.emb(idx).mean(1), self.conv(img).mean((2, 3))], 1)
        out = self.lin2(torch.tanh(self.frozen(torch.tanh(self.lin1(h)))))
        loss = nn.functional.mse_loss(out, y)
        if rank == 0 or not self.one_rank_only:  # FSDP2 reduce-scatters every sharded gradient
            loss = loss + (0.01 if rank == 0 else 0.0) * self.rank0_only.square().sum()
        return loss


def _detached(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor cloned (nothing shared with the optimizer)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _train(make: Any, rank: int, steps: int, *, nan_at: int | None = None, resume_at: int | None = None,
           build: Any = None) -> list[dict[str, Any]]:
    """``steps`` steps of ``make(model)`` on ``build()``; the record of each step."""
    build = build or _Net
    model = build()
    opt = make(model)
    records = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        model(step, rank).backward()
        if step == nan_at and rank == 1:
            grad = model.lin1.weight.grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
        opt.step()
        records.append({"params": _params(model), "state": _detached(opt.state_dict()["onebit"]),
                        "stats": {k: v for k, v in opt.stats.items() if k != "overlap"}})  # overlap: a timing
        if step == resume_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)  # FSDP2's DTensors
            model = build()
            model.load_state_dict(saved["model"])
            opt = make(model)
            opt.load_state_dict(saved["opt"])
    return records


def _configs(world: int, names: list[str]) -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    """``{config: (registry name, optimizer arguments, training arguments)}`` for ``world`` ranks
    and the registry entries ``names``."""
    out: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    for name in names:
        spec = REGISTRY[name]
        kw = dict(spec.test_kwargs)
        if world == 4:
            if spec.hierarchical:
                out[f"{name}/hierarchical"] = (name, {**kw, "hierarchical": True, "ranks_per_node": 2}, {})
            continue
        out[f"{name}/plain"] = (name, kw, {})
        out[f"{name}/clip"] = (name, {**kw, "max_grad_norm": 0.05}, {})
        out[f"{name}/skip"] = (name, kw, {"nan_at": _NAN_AT})
        out[f"{name}/resume"] = (name, kw, {"resume_at": _RESUME_AT})
        if spec.overlap:
            over = {**kw, "overlap": True, "bucket_cap_mb": _BUCKET_MB}
            out[f"{name}/overlap"] = (name, over, {})
            out[f"{name}/overlap_skip"] = (name, over, {"nan_at": _NAN_AT})
            out[f"{name}/overlap_resume"] = (name, over, {"resume_at": _RESUME_AT})
    if world != 4 and "zero_one_adam" in names:
        local = {"lr": 0.01, **_LOCAL}
        out["zero_one_adam/local"] = ("zero_one_adam", local, {"steps": 14})
        out["zero_one_adam/local_resume"] = ("zero_one_adam", local, {"steps": 14, "resume_at": 9})
        out["zero_one_adam/local_overlap"] = ("zero_one_adam", {**local, "overlap": True, "bucket_cap_mb": _BUCKET_MB},
                                              {"steps": 14})
    return out


def _worker(rank: int, world: int, out_dir: str, names: list[str]) -> None:
    records: dict[str, Any] = {}
    for config, (name, kw, train) in _configs(world, names).items():
        steps = train.pop("steps", _STEPS)
        try:
            records[config] = _train(lambda m: make_optimizer(name, m.parameters(), **kw), rank, steps, **train)
        except Exception as exc:  # an error is a result too: it must stay the same
            records[config] = f"{type(exc).__name__}: {exc}"
    torch.save(records, os.path.join(out_dir, f"flat-w{world}-r{rank}.pt"))


def _hsdp_worker(rank: int, world: int, out_dir: str, names: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build() -> _Net:
        model = _Net()
        model.one_rank_only = False
        model.conv.to(memory_format=torch.contiguous_format)  # FSDP2 shards contiguous parameters only
        for layer in (model.lin1, model.frozen, model.lin2):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        return model

    records: dict[str, Any] = {}
    group = mesh["replicate"].get_group()
    for name in names:
        kw = dict(REGISTRY[name].test_kwargs)
        for config, train in (("hsdp", {}), ("hsdp_skip", {"nan_at": _NAN_AT}), ("hsdp_resume", {"resume_at": 4})):
            try:
                records[f"{name}/{config}"] = _train(
                    lambda m: make_optimizer(name, m.parameters(), group=group, **kw), rank, _STEPS, build=build,
                    **train)
            except Exception as exc:
                records[f"{name}/{config}"] = f"{type(exc).__name__}: {exc}"
    torch.save(records, os.path.join(out_dir, f"hsdp-w{world}-r{rank}.pt"))


def _bits(t: torch.Tensor) -> bytes:
    t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard (DTensor): this rank's values
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and _bits(a) == _bits(b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} != {b!r}"]


def compare(before: str, after: str) -> int:
    """Print every configuration whose records differ; the number of them."""
    bad = 0
    files = sorted(f for f in os.listdir(before) if f.endswith(".pt"))
    for f in files:
        a, b = torch.load(os.path.join(before, f), weights_only=False), \
            torch.load(os.path.join(after, f), weights_only=False)
        for config in sorted(set(a) | set(b)):
            if (config in a) != (config in b):  # an optimizer or configuration added or removed
                bad += 1
                print(f"{f} {config}: only in {'before' if config in a else 'after'}")
                continue
            diffs = _differences(a[config], b[config], config)
            if diffs:
                bad += 1
                print(f"{f} {config}: {len(diffs)} differences, first {diffs[:3]}")
    configs = sum(len(torch.load(os.path.join(before, f), weights_only=False)) for f in files if f.endswith("r0.pt"))
    errors = sum(isinstance(v, str) for f in files for v in torch.load(os.path.join(before, f), weights_only=False).values())
    print(f"{configs} configurations compared ({len(files)} rank files, {errors} records that are errors); {bad} differ")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory for this capture")
    parser.add_argument("--against", help="a previous capture to compare with")
    parser.add_argument("--parts", default="flat,hsdp", help="what to capture: flat (2, 3 and 4 ranks), hsdp")
    parser.add_argument("--optimizers", default=",".join(REGISTRY),
                        help="registry entries to capture, comma-separated (default: all)")
    args = parser.parse_args(argv)
    names = args.optimizers.split(",")
    unknown = sorted(set(names) - set(REGISTRY))
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}; choose from {sorted(REGISTRY)}")
    os.makedirs(args.out, exist_ok=True)
    parts = args.parts.split(",")
    for world in (2, 3, 4) if "flat" in parts else ():
        spawn(_worker, world, args.out, names, timeout=900, pg_timeout=60.0)
    if "hsdp" in parts:
        spawn(_hsdp_worker, 4, args.out, names, timeout=900, pg_timeout=60.0)
    print(f"captured into {args.out} with onebit {onebit.__version__}")
    return 1 if args.against and compare(args.against, args.out) else 0


if __name__ == "__main__":
    sys.exit(main())
