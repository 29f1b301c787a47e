"""Why an early freeze stalls 1-bit Adam at a constant learning rate: the frozen preconditioner
against Adam's, on the same batches, from one state (issue 60, item 2).

One process trains the 12.9M-parameter byte GPT of the time-to-loss runs (``onebit compare --task
gpt --d-model 512 --layers 4``, 4 heads, 16-byte context; a batch of 128 = 4 ranks x 32) with
Adam (lr 1e-3 constant, betas (0.9, 0.999), eps 1e-8, no weight decay) to ``--freeze-step``, then
runs each of ``--variants`` from that state on the same batches, each written out plainly:

* ``adam``: Adam goes on (never frozen).
* ``frozen``: 1-bit Adam's compression stage with the exact exchange (the ``identity`` control):
  ``x <- x - lr m / (sqrt(v_T / (1 - beta2^T)) + eps)``, each value's step clipped to 10 times
  Adam's largest one, ``lr (1 - beta1) / sqrt(1 - beta2)`` (``clip_update=10``, the default).
* ``per_tensor``: ``frozen`` with each tensor's preconditioner rescaled by how far Adam's
  variance of that tensor has moved, ``sqrt(||v_t||_1 / ||v_T||_1)`` (the tensor's scale tracked,
  its shape frozen).
* ``embeddings_exact``: ``frozen`` except the token and position embeddings, whose variance
  goes on as Adam's.
* ``clip1``: ``frozen`` with ``clip_update=1`` (no value's step above Adam's largest).
* ``recent``: ``frozen``, the variance frozen being a second, shorter average of the warm-up's
  squared gradients, ``u_t = 0.99 u_(t-1) + 0.01 g_t^2`` bias-corrected (about the last 100
  steps), instead of Adam's ``v_T / (1 - beta2^T)``, which before step ~1,000 weighs every step
  of the warm-up alike, the first steps' large gradients included.
* ``refreshK`` (``refresh4``, ``refresh8``, ``refresh16``, ``refresh32``): ``frozen``, its variance
  refreshed every K-th step from that step's exact gradient as if every step since the last
  refresh had seen it, ``v <- beta2^k v + (1 - beta2^k) g^2`` (``k``: the steps since; the cost of a
  refresh on several ranks is one fp32 all-reduce every K steps), and bias-corrected at the last
  refresh. 0/1 Adam refreshes with weight ``1 - beta2`` instead, whatever the steps between.

Recorded: the held-out loss of each variant every ``--every`` steps (4 held-out batches of 512
windows); with ``adam`` among them, for each tensor how the frozen step compares with Adam's on
Adam's own state (``m / sqrt(v_T)`` against ``m / sqrt(v_t)``: their RMS ratio, the largest over
the run) and how far its variance moved, and at every step the l1 norm of Adam's bias-corrected
variance, which the automatic freeze watches. The committed runs::

    python benchmarks/frozen_preconditioner.py --seed 0 --out benchmarks/results/frozen-preconditioner/results.jsonl
    python benchmarks/frozen_preconditioner.py --seed 0 --variants adam,frozen,recent \\
        --out benchmarks/results/frozen-preconditioner/results.jsonl
    python benchmarks/frozen_preconditioner.py --seed 0 --steps 1024 --every 100 --variants adam \\
        --out benchmarks/results/frozen-preconditioner/results.jsonl
    python benchmarks/frozen_preconditioner.py --seed 0 --variants adam,frozen,refresh8,refresh32 \
        --out benchmarks/results/frozen-preconditioner/results.jsonl
    python benchmarks/frozen_preconditioner.py --seed 0 --steps 1024 --every 100 --variants adam,refresh8,refresh16 \
        --out benchmarks/results/frozen-preconditioner/results.jsonl
    python benchmarks/frozen_preconditioner.py --report benchmarks/results/frozen-preconditioner/results.jsonl
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics

import torch
from _records import append_row, provenance, provenance_note, read_rows

VARIANTS = ("adam", "frozen", "per_tensor", "embeddings_exact", "clip1", "recent", "refresh4", "refresh8", "refresh16",
            "refresh32")
EMBEDDINGS = ("embed.weight", "position")  # the tensors whose variance goes on as Adam's in embeddings_exact
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
RECENT = 0.99  # the decay of the ``recent`` variant's average of the squared gradients
ADAM_LARGEST = (1 - BETA1) / math.sqrt(1 - BETA2)  # Adam's largest step, in units of lr

parser = argparse.ArgumentParser()
parser.add_argument("--report", metavar="FILE", help="print the tables of FILE's runs and exit")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--freeze-step", type=int, default=204)
parser.add_argument("--steps", type=int, default=604)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--batch", type=int, default=128)
parser.add_argument("--every", type=int, default=50, help="held-out loss every this many steps")
parser.add_argument("--variants", default="adam,frozen,per_tensor,embeddings_exact,clip1",
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
parser.add_argument("--out")
args = parser.parse_args()
if unknown := set(args.variants.split(",")) - set(VARIANTS):
    parser.error(f"unknown --variants {sorted(unknown)}; available: {', '.join(VARIANTS)}")


class Side:
    """One variant: its own copy of the model, Adam's moments as they were at the freeze, the
    frozen bias-corrected variance ``v_T / (1 - beta2^T)`` and its l1 norm per tensor."""

    def __init__(self, name: str, model: torch.nn.Module, adam: torch.optim.Adam, freeze: int,
                 recent: list[torch.Tensor]) -> None:
        self.name = name
        self.model = copy.deepcopy(model)
        self.params = list(self.model.parameters())
        source = list(model.parameters())
        self.m = [adam.state[p]["exp_avg"].clone() for p in source]
        self.v = [adam.state[p]["exp_avg_sq"].clone() for p in source]
        self.v_frozen = [v / (1 - RECENT**freeze) for v in recent] if name == "recent" else \
            [v / (1 - BETA2**freeze) for v in self.v]
        self.l1_frozen = [float(v.sum()) for v in self.v_frozen]
        names = [n for n, _ in self.model.named_parameters()]
        self.exact = [name == "adam" or (name == "embeddings_exact" and n in EMBEDDINGS) for n in names]
        self.clip = None if name == "adam" else (1.0 if name == "clip1" else 10.0) * ADAM_LARGEST
        self.every = int(name.removeprefix("refresh")) if name.startswith("refresh") else None
        self.v_kept = [v.clone() for v in self.v]  # refreshK: the variance as last refreshed, at step since
        self.since = freeze

    @torch.no_grad()
    def step(self, t: int, lr: float) -> None:
        refresh = self.every is not None and (t - self.since) % self.every == 0
        decay = BETA2 ** (t - self.since)
        if refresh:
            self.since = t
        for k, p in enumerate(self.params):
            g, m, v = p.grad, self.m[k], self.v[k]
            m.lerp_(g, 1 - BETA1)
            v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)  # Adam's variance, kept by every side
            if self.exact[k]:
                denominator = v / (1 - BETA2**t)
            elif self.every is not None:
                if refresh:  # the exact average enters as if every step since the last refresh had seen it
                    self.v_kept[k].mul_(decay).addcmul_(g, g, value=1 - decay)
                denominator = self.v_kept[k] / (1 - BETA2**self.since)
            elif self.name == "per_tensor" and self.l1_frozen[k] > 0:
                denominator = self.v_frozen[k] * (float((v / (1 - BETA2**t)).sum()) / self.l1_frozen[k])
            else:
                denominator = self.v_frozen[k]
            update = m / (1 - BETA1**t) / (denominator.sqrt() + EPS)
            if self.clip is not None and not self.exact[k]:
                update.clamp_(-self.clip, self.clip)
            p.add_(update, alpha=-lr)


def held_out_loss(task, model, batches) -> float:
    with torch.no_grad():
        return statistics.fmean(float(task.loss(model, x, y)) for x, y in batches)


def run() -> None:
    from onebit.bench._tasks import Task, TaskSpec

    torch.manual_seed(args.seed)
    task = Task(TaskSpec(task="gpt", d_model=512, layers=4, heads=4, context=16))
    model = task.model()
    adam = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(BETA1, BETA2), eps=EPS)
    gen = torch.Generator().manual_seed(args.seed)
    held = [task.batch(512, torch.Generator().manual_seed(10_000 + i), heldout=True) for i in range(4)]
    variance_l1 = []  # the automatic freeze's watched quantity: ||v_t / (1 - beta2^t)||_1, every step
    recent = [torch.zeros_like(p) for p in model.parameters()]
    for t in range(1, args.freeze_step + 1):
        x, y = task.batch(args.batch, gen)
        adam.zero_grad()
        task.loss(model, x, y).backward()
        adam.step()
        for u, p in zip(recent, model.parameters()):
            u.mul_(RECENT).addcmul_(p.grad, p.grad, value=1 - RECENT)
        variance_l1.append(sum(float(adam.state[p]["exp_avg_sq"].sum()) for p in model.parameters()) / (1 - BETA2**t))
    sides = [Side(name, model, adam, args.freeze_step, recent) for name in args.variants.split(",")]
    names = [n for n, _ in model.named_parameters()]
    losses = {s.name: [] for s in sides}
    rms = {n: [] for n in names}  # per tensor: the frozen step's RMS over Adam's, on Adam's state
    for t in range(args.freeze_step + 1, args.steps + 1):
        x, y = task.batch(args.batch, gen)
        for side in sides:
            side.model.zero_grad()
            task.loss(side.model, x, y).backward()
            side.step(t, args.lr)
            if side.name == "adam":
                variance_l1.append(sum(float(v.sum()) for v in side.v) / (1 - BETA2**t))
                for n, m, v, vf in zip(names, side.m, side.v, side.v_frozen):
                    adams = (v / (1 - BETA2**t)).sqrt().add_(EPS)  # Adam's own denominator at step t
                    rms[n].append(float((m / (vf.sqrt() + EPS)).norm() / (m / adams).norm().clamp_min(1e-30)))
        if (t - args.freeze_step) % args.every == 0 or t == args.steps:
            for side in sides:
                losses[side.name].append((t, held_out_loss(task, side.model, held)))
            print(t, " ".join(f"{n}={v[-1][1]:.4f}" for n, v in losses.items()), flush=True)
    adam_side = next((s for s in sides if s.name == "adam"), None)
    drift = {}
    if adam_side is not None:
        for n, v, l1 in zip(names, adam_side.v, adam_side.l1_frozen):
            v_hat = v / (1 - BETA2**args.steps)
            drift[n] = {"l1_ratio": float(v_hat.sum()) / l1 if l1 > 0 else None,
                        "rms_ratio_end": rms[n][-1], "rms_ratio_max": max(rms[n]),
                        "rms_ratio_max_at": args.freeze_step + 1 + rms[n].index(max(rms[n]))}
    if args.out:
        append_row(args.out, {"seed": args.seed, "freeze_step": args.freeze_step, "steps": args.steps, "lr": args.lr,
                              "batch": args.batch, "losses": losses, "drift": drift,
                              "variance_l1": variance_l1 if adam_side is not None else None, **provenance()})


def report(path: str) -> None:
    """One table per seed and setting, the runs of that seed merged (each variant's curve is the
    same in every run that has it: one process, the same batches); the drift and the criterion
    from the longest run that kept Adam."""
    rows = read_rows(path)
    settings: dict[tuple, list[dict]] = {}
    for row in rows:
        settings.setdefault((row["seed"], row["freeze_step"], row["lr"], row["batch"]), []).append(row)
    for (seed, freeze, lr, batch), runs in settings.items():
        curves: dict[str, dict[int, float]] = {}
        for run_ in runs:
            for name, curve in run_["losses"].items():
                curves.setdefault(name, {}).update((t, v) for t, v in curve)
        steps = sorted({t for curve in curves.values() for t in curve})
        print(f"Seed {seed}, Adam to step {freeze}, then each variant to step {max(steps)} (lr {lr} constant, "
              f"batch {batch}): held-out loss, and its gap to `adam` (— : not evaluated there).\n")
        print("| variant | " + " | ".join(str(t) for t in steps) + " |")
        print("|---|" + "---|" * len(steps))
        base = curves.get("adam", {})
        for name, curve in curves.items():
            cells = ["—" if t not in curve else f"{curve[t]:.4f}" + (
                f" ({(curve[t] / base[t] - 1) * 100:+.1f}%)" if name != "adam" and t in base else "") for t in steps]
            print(f"| `{name}` | " + " | ".join(cells) + " |")
        longest = max((r for r in runs if r["drift"]), key=lambda r: r["steps"], default=None)
        if longest is not None:
            worst = sorted(longest["drift"].items(), key=lambda kv: -kv[1]["rms_ratio_max"])[:8]
            print(f"\nThe tensors whose frozen step departs most from Adam's, to step {longest['steps']} (on Adam's "
                  "state, unclipped: RMS of `m / sqrt(v_T)` over that of `m / sqrt(v_t)`), and how far Adam's "
                  "variance moved (`||v_t||_1 / ||v_T||_1` at the end):\n")
            print("| tensor | largest RMS ratio | at step | RMS ratio at the end | variance l1, end / freeze |")
            print("|---|---|---|---|---|")
            for n, d in worst:
                l1 = "-" if d["l1_ratio"] is None else f"{d['l1_ratio']:.2f}"
                print(f"| `{n}` | {d['rms_ratio_max']:.1f} | {d['rms_ratio_max_at']} | {d['rms_ratio_end']:.2f} | {l1} |")
        traced = max((r.get("variance_l1") or [] for r in runs), key=len)
        if len(traced) > 100:
            print(criterion(traced))
        print()
    print(provenance_note(rows))


def criterion(l1: list[float], window: int = 100) -> str:
    """The automatic freeze's ratio ``||v_t||_1 / ||v_{t-D}||_1`` on Adam's bias-corrected variance
    (``D = 0.1 / (1 - beta2)``, 100 steps) through the run, and the step after which the library's own
    rule (:class:`onebit.optim._freeze.FreezeSchedule`, fed the already bias-corrected norms) would have
    frozen for a few thresholds (0.96: the default when it was written)."""
    from onebit.optim._freeze import FreezeSchedule

    def schedule(threshold: float) -> FreezeSchedule:
        return FreezeSchedule("auto", threshold=threshold, window=window, min_step=0, max_step=None)

    thresholds = (0.96, 0.93, 0.9, 0.85, 0.8)
    schedules = [schedule(th) for th in thresholds]
    fired: list[int | None] = [None] * len(thresholds)
    ratio: dict[int, float] = {}
    for t, value in enumerate(l1, start=1):
        for k, sched in enumerate(schedules):
            if sched.should_freeze(t, value) and fired[k] is None:
                fired[k] = t
        if schedules[0].ratio is not None:
            ratio[t] = schedules[0].ratio
    marks = [t for t in ratio if t % 100 == 0 or t == window + 1]
    lines = ["\nThe automatic freeze's criterion on Adam's variance, `||v_t||_1 / ||v_(t-100)||_1` (bias-corrected):\n",
             "| step | " + " | ".join(str(t) for t in marks) + " |", "|---|" + "---|" * len(marks),
             "| ratio | " + " | ".join(f"{ratio[t]:.3f}" for t in marks) + " |",
             "\n| threshold | first step inside `[threshold, 1 / threshold]` |", "|---|---|"]
    for threshold, first in zip(thresholds, fired):
        lines.append(f"| {threshold} | {first if first is not None else f'never (to step {len(l1)})'} |")
    return "\n".join(lines)

if args.report:
    report(args.report)
else:
    run()
