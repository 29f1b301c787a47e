"""Accelerate with 1-bit Adam: ``accelerator.prepare`` wraps the model in DDP, ``onebit.attach``
switches DDP's all-reduce off, gradient accumulation runs through ``accelerator.accumulate``.

    torchrun --nproc_per_node 2 examples/accelerate_train.py
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import onebit
from _bytes import CONTEXT, byte_model, byte_windows, freeze_step
from _teardown import destroy_process_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--freeze-step", type=freeze_step, default="auto", help=freeze_step.__doc__)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)  # initialises the group
    torch.manual_seed(0)
    model = byte_model()
    opt = onebit.OnebitAdam(model.parameters(), lr=3e-3, freeze_step=args.freeze_step, max_grad_norm=1.0)
    windows = byte_windows(accelerator.process_index, accelerator.num_processes, args.steps * args.accumulate * 16)
    loader = torch.utils.data.DataLoader(windows, batch_size=16)
    # The data is already sharded per rank; prepare only the model and the optimizer.
    model, opt = accelerator.prepare(model, opt)
    onebit.attach(opt)  # after prepare (DDP now exists), before the first backward
    for window in loader:
        with accelerator.accumulate(model):  # no_sync on all but the last micro-batch
            loss = F.cross_entropy(model(window[:, :CONTEXT]), window[:, CONTEXT])
            accelerator.backward(loss)
            opt.step()  # a no-op until the last micro-batch: one exchange per optimizer step
            opt.zero_grad()
    inner = opt.optimizer
    if accelerator.is_main_process:
        print(json.dumps({"loss": loss.item(), "stats": inner.stats,
                          "ddp_hook": model._get_ddp_logging_data().get("comm_hook")}))
    del model, opt, accelerator  # the accelerator keeps the prepared (DDP) model too
    destroy_process_group()


if __name__ == "__main__":
    main()
