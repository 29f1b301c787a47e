"""1-bit Adam in a plain torchrun script -- the README's usage, runnable.

    torchrun --nproc_per_node 2 examples/plain_torchrun.py [--ddp] [--accumulate 2]

The model is NOT wrapped in DDP: the optimizer averages the gradients itself (warm-up) and
exchanges 1-bit momentum afterwards. ``--ddp`` wraps it anyway, as code that already uses
DDP does: the optimizer then switches DDP's all-reduce off, and the run is the same.
``--accumulate K``: K micro-batches per step, one exchange per ``step()``.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import onebit
from _bytes import CONTEXT, byte_model, byte_windows, freeze_step
from _teardown import destroy_process_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--freeze-step", type=freeze_step, default="auto", help=freeze_step.__doc__)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--ddp", action="store_true", help="wrap the model in DDP")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets rank and world size; "nccl" on GPUs
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = byte_model()
    net = DistributedDataParallel(model) if args.ddp else model
    opt = onebit.OnebitAdam(model.parameters(), lr=3e-3, freeze_step=args.freeze_step,
                            max_grad_norm=args.max_grad_norm)
    data = byte_windows(rank, world, args.steps * args.batch_size)
    micro = args.batch_size // args.accumulate
    for step in range(args.steps):
        batch = data[step * args.batch_size : (step + 1) * args.batch_size]
        opt.zero_grad()
        for k in range(args.accumulate):
            window = batch[k * micro : (k + 1) * micro]
            # no_sync on all but the last micro-batch, as DDP users write: DDP's (with the
            # optimizer's hook installed DDP sends nothing either way), or the optimizer's, which
            # keeps the warm-up's all-reduce overlapped with the last backward.
            last = k == args.accumulate - 1
            with (net if args.ddp else opt).no_sync() if not last else contextlib.nullcontext():
                loss = F.cross_entropy(net(window[:, :CONTEXT]), window[:, CONTEXT]) / args.accumulate
                loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % 20 == 0:
            print(f"step {step + 1}: loss {loss.item() * args.accumulate:.3f} {opt.stats['stage']}", flush=True)
    if rank == 0:
        print(json.dumps({"loss": loss.item() * args.accumulate, "stats": opt.stats,
                          "ddp_hook": net._get_ddp_logging_data().get("comm_hook") if args.ddp else None}))
    del net
    destroy_process_group()


if __name__ == "__main__":
    main()
