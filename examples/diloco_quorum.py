"""DiLoCo whose replicas come and go without a restart: a quorum over a store no replica hosts.

    # on a machine that does not train, the store:
    python -c "import time; from torch.distributed import TCPStore; \\
      s = TCPStore('0.0.0.0', 29400, is_master=True, wait_for_workers=False); time.sleep(1e9)"
    # on each machine, one replica (plain python: no torchrun):
    python examples/diloco_quorum.py --store STOREHOST:29400 --replicas 4 [--replica-id NAME]

The run starts once ``--replicas`` have come. A replica that dies is left behind at the next
synchronisation and the others go on from where they were, nothing redone; one started later
(or the same machine again) takes a live peer's state after a synchronisation and trains with
them. Each replica draws its batches by its name, so its data follows it whatever its rank.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

import torch
import torch.nn.functional as F

import onebit
from _bytes import CONTEXT, byte_model, byte_windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="HOST:PORT of the store")
    parser.add_argument("--replicas", type=int, default=2, help="replicas the first synchronisation waits for")
    parser.add_argument("--replica-id", help="this replica's name (default: host name and process id)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--sync-every", type=int, default=16, help="inner steps per synchronisation (H)")
    parser.add_argument("--fragments", type=int, default=1, help="fragments synchronised in turn (streaming)")
    parser.add_argument("--delay", type=int, default=0, help="inner steps each synchronisation stays in flight")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per replica per step")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a peer may hang before it is left")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds each step waits (a slower machine)")
    parser.add_argument("--record", help="append a JSON line per step to this file")
    args = parser.parse_args()

    torch.set_num_threads(1)
    quorum = onebit.comm.Quorum(args.store, args.replica_id, min_replicas=args.replicas, timeout=args.timeout)
    torch.manual_seed(0)
    model = byte_model()
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Returns once this replica is in: at step 0 with the first ones, or later with a peer's state
    opt = onebit.DiLoCo(inner, sync_every=args.sync_every, fragments=args.fragments, delay=args.delay, group=quorum)
    data = byte_windows(0, 1, args.steps * args.batch_size, seed=zlib.crc32(quorum.replica_id.encode()))
    record = open(args.record, "a") if args.record else None
    while opt.stats["step"] < args.steps:
        step = opt.stats["step"]
        batch = data[step * args.batch_size : (step + 1) * args.batch_size]
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[:, :CONTEXT]), batch[:, CONTEXT])
        loss.backward()
        opt.step()
        if record is not None:
            record.write(json.dumps({"replica": quorum.replica_id, "step": opt.stats["step"], "world": opt.world_size,
                                     "loss": loss.item(), "time": time.time()}) + "\n")
            record.flush()
        if opt.stats["step"] % args.sync_every == 0:
            print(f"{quorum.replica_id} step {opt.stats['step']}: loss {loss.item():.3f}, {opt.world_size} replicas",
                  flush=True)
        time.sleep(args.pause)
    opt.check_replicas()
    opt.wait()  # a synchronisation sent near the end completes before the groups go
    with opt.anchored():
        fingerprint = sum(p.double().sum().item() for p in model.parameters())
    print(json.dumps({"replica": quorum.replica_id, "loss": loss.item(), "anchors": fingerprint, "stats": opt.stats}))
    quorum.close()


if __name__ == "__main__":
    main()
