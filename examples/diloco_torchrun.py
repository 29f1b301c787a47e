"""DiLoCo with 1-bit outer gradients in a plain torchrun script.

    torchrun --nproc_per_node 2 examples/diloco_torchrun.py [--sync-every 16] [--compressor identity]
        [--outer-step nesterov] [--fragments 4 --delay 2]

Each rank takes AdamW steps on its own shard of the data; every ``--sync-every`` steps the
ranks exchange how far each moved (1 bit per value, each rank carrying what its bit did not
send) and take the outer step together. Streamed (``--fragments``, ``--delay``): a quarter of the model every 4 steps, each
exchange running under the next 2 inner steps. Several machines: the same script under
``torchrun --nnodes N --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

import onebit
from _bytes import CONTEXT, byte_model, byte_windows
from _teardown import destroy_process_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=16, help="inner steps per synchronisation (H)")
    parser.add_argument("--compressor", choices=("sign", "identity"), default="sign")
    parser.add_argument("--outer-step", choices=("sparseloco", "nesterov"), default="sparseloco",
                        help="nesterov: the paper's (with --compressor identity, DiLoCo as published)")
    parser.add_argument("--fragments", type=int, default=1, help="fragments synchronised in turn (streaming)")
    parser.add_argument("--delay", type=int, default=0, help="inner steps each synchronisation stays in flight")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets rank and world size; "nccl" on GPUs
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = byte_model()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = onebit.DiLoCo(inner, sync_every=args.sync_every, outer_step=args.outer_step, compressor=args.compressor,
                        fragments=args.fragments, delay=args.delay)
    data = byte_windows(rank, world, args.steps * args.batch_size)
    for step in range(args.steps):
        batch = data[step * args.batch_size : (step + 1) * args.batch_size]
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[:, :CONTEXT]), batch[:, CONTEXT])
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % args.sync_every == 0:
            print(f"step {step + 1}: loss {loss.item():.3f}, {opt.stats['bytes_sent']} bytes sent", flush=True)
    opt.check_replicas()
    opt.wait()  # a synchronisation sent near the end completes before the process group goes
    if rank == 0:
        print(json.dumps({"loss": loss.item(), "stats": opt.stats, "ddp_hook": None}))
    destroy_process_group()


if __name__ == "__main__":
    main()
