"""Training that survives a lost node: torchrun's elastic restarts and onebit.Checkpoints.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:4 --nproc_per_node 1 --max-restarts 10 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id myjob \\
        --rdzv-conf last_call_timeout=2,keep_alive_interval=1 \\
        examples/elastic_torchrun.py [--optimizer diloco]

Start the same command on each machine. When a node dies, the survivors' collectives fail
within ``--timeout`` seconds, torchrun stops their workers and restarts them among the nodes
left (at least the minimum of ``--nnodes``); each worker resumes from the newest complete
checkpoint, so at most the steps since it are done again. A node started again later joins at
the next restart, which torchrun makes as soon as it sees it waiting. The variable gives each
restart a new store for the workers: with the store torchrun shares by default, a restarted
worker can read a dead peer's address and a node that comes back cannot join. The
``--rdzv-conf`` shortens the restart: torchrun drops the lost node from the rendezvous after 3
missed heartbeats (3 s instead of 15 s) and waits 2 s for late nodes (instead of 30 s).

``--record`` appends one JSON line per step on rank 0 (the step, the world size, the loss) to
follow what happened.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import onebit
from _bytes import CONTEXT, byte_model, byte_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--optimizer", choices=("onebit_adam", "diloco"), default="onebit_adam")
    parser.add_argument("--sync-every", type=int, default=8, help="DiLoCo: inner steps between synchronisations")
    parser.add_argument("--fragments", type=int, default=1, help="DiLoCo: fragments synchronised in turn")
    parser.add_argument("--delay", type=int, default=0, help="DiLoCo: steps a fragment's exchange stays in flight")
    parser.add_argument("--checkpoints", default="checkpoints", help="a directory every node shares")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a collective waits for a peer")
    parser.add_argument("--record", help="rank 0 appends each step's JSON line to this file")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds each step waits (to watch a failure)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets rank and world size at each (re)start
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = byte_model()
    if args.optimizer == "diloco":
        opt = onebit.DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every=args.sync_every,
                            fragments=args.fragments, delay=args.delay, timeout=args.timeout)
    else:
        opt = onebit.OnebitAdam(model.parameters(), lr=3e-3, timeout=args.timeout)
    checkpoints = onebit.Checkpoints(args.checkpoints, timeout=args.timeout)
    start = 0
    if (found := checkpoints.load()) is not None:
        start, state = found
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        opt.check_replicas()  # the ranks resume from one model (or, for DiLoCo, one anchor)
    for step in range(start + 1, args.steps + 1):
        # Each step's batch is a function of the step and of the ranks running it, so that a
        # step done again after a restart on the same ranks is the same step.
        batch = byte_windows(rank, world, args.batch_size, seed=step)
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[:, :CONTEXT]), batch[:, CONTEXT])
        loss.backward()
        opt.step()
        if rank == 0 and args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps({"step": step, "world": world, "loss": loss.item(), "resumed_from": start,
                                    "time": time.time()}) + "\n")
        time.sleep(args.pause)
        if step % args.checkpoint_every == 0:
            checkpoints.save(step, model=model.state_dict(), opt=opt.state_dict())
    opt.wait()
    opt.check_replicas()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
