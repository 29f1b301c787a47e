"""1-bit Adam in DeepSpeed 0.19.6 and in onebit, in lock-step in the same ranks, from one state.

Each rank holds one copy of the model per side, all from the same initial weights, and feeds
every copy the same batch at every step: DeepSpeed's engine (its ``OneBitAdam``, gradients
all-reduced by the engine in the warm-up) and one ``onebit.from_deepspeed_config`` optimizer per
``--variant`` (constructor overrides, e.g. ``clip_update=null``). The warm-ups run side by side
from the first step; right after the freeze step DeepSpeed's parameters and moments are loaded
into every onebit side (``exp_avg`` as it is, ``exp_avg_sq`` as the frozen preconditioner
``sqrt(v) + eps``), so that the compression stages start from one state and differ only by what
each does from there. Recorded per side: the training loss of every step (mean over ranks), the
held-out loss every ``--every`` steps, and over the first ``--trace`` compressed steps how far each
onebit side's momentum and parameters are from DeepSpeed's. Run it in DeepSpeed's venv with onebit
installed there (``pip install --no-deps -e .``)::

    OMP_NUM_THREADS=1 "$HOME/ds-venv/bin/torchrun" --standalone --nproc_per_node 3 \\
        benchmarks/deepspeed_lockstep.py --seed 0 --variant '{}' --variant '{"clip_update": null}' \\
        --out benchmarks/results/deepspeed-lockstep/results.jsonl
    python benchmarks/deepspeed_lockstep.py --report benchmarks/results/deepspeed-lockstep/results.jsonl

The task is a byte-level MLP: a 256 x 32 embedding of a 16-byte context into a 512-256-256-256 GELU
MLP, on the English text of ``onebit bench convergence``'s ``byte_mlp`` (each rank its own slice).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
from _deepspeed_sides import start
from _records import append_row, provenance, provenance_note, read_rows
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--report", metavar="FILE", help="print the table of FILE's runs and exit")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--freeze-step", type=int, default=120)
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--batch", type=int, default=64, help="per rank")
parser.add_argument("--weight-decay", type=float, default=0.0)
parser.add_argument("--gradient-clipping", type=float, default=None,
                    help="the config's gradient_clipping (default: none given, DeepSpeed 0.19.6's 1.0 applies)")
parser.add_argument("--variant", action="append", default=[], metavar="JSON",
                    help="a onebit side: its constructor overrides as a JSON object (repeatable; default: '{}')")
parser.add_argument("--skip-first-step", action="store_true",
                    help="onebit sides make no update at step 1, as DeepSpeed's first step() (and freeze a step "
                         "earlier by their own count): the warm-ups then agree step by step, and each side keeps "
                         "its own state at the freeze (a run end to end)")
parser.add_argument("--every", type=int, default=60, help="held-out loss every this many steps")
parser.add_argument("--trace", type=int, default=10, help="compressed steps traced against DeepSpeed's")
parser.add_argument("--out")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

CONTEXT, EMBED, HIDDEN = 16, 32, 256


def _label(side: str) -> str:
    return "`from_deepspeed_config` as it maps the config" if side == "{}" else f"overrides `{side}`"


def _gaps(pairs: list[tuple[dict, dict]]) -> tuple[list[float], str]:
    """Per seed, a onebit side's held-out loss at the end against DeepSpeed's (%), and their mean with
    its 95% interval and the worst seed, as table cells."""
    from onebit.bench._analysis import mean_interval

    gaps = [100 * (o["heldout"][-1][1] / d["heldout"][-1][1] - 1) for d, o in pairs]
    mean, half = mean_interval(gaps)
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps, f"{mean:+.1f}% ± {half:.1f} | {gaps[worst]:+.1f}% (seed {pairs[worst][1]['seed']})"


def report(rows: list[dict]) -> str:
    """Runs from DeepSpeed's state at the freeze: each onebit side's held-out loss at the end against
    DeepSpeed's, paired over seeds, and its first compressed update's distance from DeepSpeed's. Runs
    with ``--skip-first-step``: how far each side's warm-up losses are from DeepSpeed's."""
    out = []
    for skip in (False, True):
        runs = [r for r in rows if r.get("skip_first_step", False) == skip]
        if not runs:
            continue
        by_seed: dict[tuple, dict[str, dict]] = {}
        for r in runs:
            by_seed.setdefault((r["steps"], r["freeze_step"], r["lr"], r["seed"]), {})[r["side"]] = r
        sides = sorted({r["side"] for r in runs if r["side"] != "deepspeed"})
        pairs = {side: [(s["deepspeed"], s[side]) for s in by_seed.values() if "deepspeed" in s and side in s]
                 for side in sides}
        if skip:
            out += ["| onebit side, end to end, its first update skipped | largest training-loss difference in the "
                    "warm-up | first step that differs by more than 1e-4 (per seed) | held-out loss at the end "
                    "against DeepSpeed's, mean ± 95% | worst seed | seeds |", "|---|---|---|---|---|---|"]
            for side in sides:
                freeze = pairs[side][0][0]["freeze_step"]
                diffs = [[abs(a - b) for a, b in zip(d["losses"][:freeze], o["losses"][:freeze])]
                         for d, o in pairs[side]]
                first = [next((i + 1 for i, x in enumerate(row) if x > 1e-4), None) for row in diffs]
                out.append(f"| {_label(side)} | {max(max(row) for row in diffs):.2g} "
                           f"| {', '.join('none' if f is None else str(f) for f in first)} "
                           f"| {_gaps(pairs[side])[1]} | {len(diffs)} |")
        else:
            out += ["| onebit side, from DeepSpeed's state at the freeze | held-out loss at the end against "
                    "DeepSpeed's, mean ± 95% | worst seed | seeds | first compressed update's distance from "
                    "DeepSpeed's | per seed |", "|---|---|---|---|---|---|"]
            for side in sides:
                gaps, cells = _gaps(pairs[side])
                first = sum(o["trace"][0]["update"] for _, o in pairs[side]) / len(gaps)
                out.append(f"| {_label(side)} | {cells} | {len(gaps)} | {first:.3f} "
                           f"| {', '.join(f'{g:+.1f}' for g in gaps)} |")
        ds = [s["deepspeed"]["heldout"][-1][1] for s in by_seed.values() if "deepspeed" in s]
        first = runs[0]
        clip = "DeepSpeed's default" if first["gradient_clipping"] is None else first["gradient_clipping"]
        out.append(f"\nDeepSpeed's held-out loss at the end: {sum(ds) / len(ds):.4f} (mean of {len(ds)} seeds); "
                   f"{first['steps']} steps, freeze after step {first['freeze_step']}, lr {first['lr']:g}, "
                   f"gradient_clipping {clip}, {first['world_size']} gloo ranks, batch {first['batch']} per rank. "
                   f"{provenance_note(runs)}\n")
    return "\n".join(out).rstrip()


if args.report:
    print(report(read_rows(args.report)))
    sys.exit(0)
if args.out is None:
    parser.error("--out is required (or --report)")
variants = args.variant or ["{}"]

dist = start("deepspeed")

import deepspeed  # noqa: E402

import onebit  # noqa: E402
from onebit.bench._tasks import ByteCorpus, ByteMLP  # noqa: E402

rank, world = dist.get_rank(), dist.get_world_size()
corpus = ByteCorpus(text="english", split="blocks")
corpus.shard(rank, world)
torch.manual_seed(args.seed)
initial = ByteMLP(context=CONTEXT, embed=EMBED, hidden=HIDDEN, hidden2=HIDDEN)
config = {"train_micro_batch_size_per_gpu": args.batch, "steps_per_print": 10**9,
          "optimizer": {"type": "OneBitAdam",
                        "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": args.weight_decay,
                                   "freeze_step": args.freeze_step, "cuda_aware": False,
                                   "comm_backend_name": "compressed"}}}
if args.gradient_clipping is not None:
    config["gradient_clipping"] = args.gradient_clipping
ds_model = copy.deepcopy(initial)
engine, ds_opt, _, _ = deepspeed.initialize(model=ds_model, model_parameters=ds_model.parameters(), config=config)
ds_params = list(engine.module.parameters())
sides: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
for text in variants:
    model = copy.deepcopy(initial)
    own = {"freeze_step": args.freeze_step - 1} if args.skip_first_step else {}
    sides[text] = (model, onebit.from_deepspeed_config(config, model.parameters(), **own, **json.loads(text)))


def heldout(model: nn.Module) -> float:
    gen = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        return sum(nn.functional.cross_entropy(model(x), y).item()
                   for x, y in (corpus.batch(CONTEXT, 256, gen, heldout=True) for _ in range(8))) / 8


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / world


def load_deepspeed_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """DeepSpeed's parameters and moments at its freeze, into a onebit side frozen at the same step."""
    eps = config["optimizer"]["params"]["eps"]
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), ds_params):
            mine.copy_(theirs)
            opt.state[mine]["exp_avg"].copy_(ds_opt.state[theirs]["exp_avg"])
            opt.state[mine]["frozen_denom"].copy_(ds_opt.state[theirs]["exp_avg_sq"].sqrt().add_(eps))
    opt.load_state_dict(opt.state_dict())  # re-derives what the state implies (values never updated)


def distance(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """||mine - theirs|| / ||theirs|| over the values with a gradient in the warm-up (``used``): the others
    (embedding rows never looked up) DeepSpeed moves by ``lr * scale / eps`` a step, onebit not at all."""
    num = sum(float((a - b).double()[m].square().sum()) for a, b, m in zip(mine, theirs, used))
    den = sum(float(b.double()[m].square().sum()) for b, m in zip(theirs, used))
    return (num / den) ** 0.5 if den else float("nan")


names = ["deepspeed", *variants]
losses: dict[str, list[float]] = {n: [] for n in names}
held: dict[str, list[tuple[int, float]]] = {n: [] for n in names}
at_freeze: dict[str, float] = {}
trace: dict[str, list[dict[str, float]]] = {n: [] for n in variants}
used: list[torch.Tensor] = []  # per tensor: the values with a gradient in the warm-up (DeepSpeed's v > 0)
gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
for step in range(1, args.steps + 1):
    x, y = corpus.batch(CONTEXT, args.batch, gen)
    before = [p.detach().clone() for p in ds_params]
    loss = nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses["deepspeed"].append(mean_over_ranks(loss.item()))
    ds_step = [p.detach() - b for p, b in zip(ds_params, before)]
    for text, (model, opt) in sides.items():
        params = list(model.parameters())
        mine_before = [p.detach().clone() for p in params]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if step > 1 or not args.skip_first_step:
            opt.step()
        losses[text].append(mean_over_ranks(loss.item()))
        if args.freeze_step < step <= args.freeze_step + args.trace:
            trace[text].append({
                "step": step,
                "momentum": distance([opt.state[p]["exp_avg"] for p in params],
                                     [ds_opt.state[p]["exp_avg"] for p in ds_params]),
                "update": distance([p.detach() - b for p, b in zip(params, mine_before)], ds_step),
                "params": distance([p.detach() for p in params], [p.detach() for p in ds_params]),
            })
    if step == args.freeze_step:
        used = [ds_opt.state[p]["exp_avg_sq"] > 0 for p in ds_params]
        at_freeze["deepspeed"] = heldout(engine.module)
        for text, (model, opt) in sides.items():
            at_freeze[text] = heldout(model)
            if opt.stats["freeze_step"] != step - args.skip_first_step:
                raise RuntimeError(f"onebit side {text} did not freeze at step {step}: {opt.stats}")
            if not args.skip_first_step:
                load_deepspeed_state(model, opt)
    if step % args.every == 0 or step == args.steps:
        held["deepspeed"].append((step, heldout(engine.module)))
        for text, (model, _) in sides.items():
            held[text].append((step, heldout(model)))

if rank == 0:
    for name in names:
        row = {"side": name, "seed": args.seed, "steps": args.steps, "freeze_step": args.freeze_step, "lr": args.lr,
               "batch": args.batch, "weight_decay": args.weight_decay, "gradient_clipping": args.gradient_clipping,
               "skip_first_step": args.skip_first_step,
               "world_size": world, "losses": losses[name], "heldout": held[name],
               "heldout_at_freeze_own": at_freeze[name], "trace": trace.get(name, []),
               "unused_at_freeze": sum(int((~m).sum()) for m in used),
               **provenance(f"torchrun --standalone --nproc_per_node {world}")}
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "trace")}), flush=True)
        append_row(args.out, row)
