"""Hugging Face ``transformers.Trainer`` with 1-bit Adam, on a tiny GPT-2 built from a config.

    torchrun --nproc_per_node 2 examples/hf_trainer.py

The Trainer wraps the model in DDP inside ``train()``; ``AttachCallback`` switches DDP's
all-reduce off there, so the gradients are exchanged once, by the optimizer. Clipping is
the optimizer's (``max_grad_norm=1.0``: the averaged gradient in the warm-up); the
Trainer's own (``TrainingArguments.max_grad_norm``) would clip each rank's local gradient,
so it is set to 0.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import onebit
from _bytes import byte_windows, freeze_step
from _teardown import destroy_process_group
from onebit.integrations.transformers import AttachCallback


class Windows(torch.utils.data.Dataset):
    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--freeze-step", type=freeze_step, default="auto", help=freeze_step.__doc__)
    parser.add_argument("--out", default="runs/hf_trainer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # TrainingArguments initialises the process group: build it before the optimizer.
    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8, max_grad_norm=0.0,
        logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo",
        dataloader_num_workers=0, disable_tqdm=True,
    )
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=args.freeze_step, max_grad_norm=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    # The whole file, sharded by the Trainer's distributed sampler.
    trainer = Trainer(model=model, args=training, train_dataset=Windows(byte_windows(0, 1, 4096)),
                      optimizers=(opt, schedule), callbacks=[AttachCallback()])
    result = trainer.train()
    if training.process_index == 0:
        ddp = trainer.model_wrapped
        hook = ddp._get_ddp_logging_data().get("comm_hook") if hasattr(ddp, "_get_ddp_logging_data") else None
        print(json.dumps({"loss": result.training_loss, "stats": opt.stats, "ddp_hook": hook}))
        del ddp
    # The Trainer leaves the process group open: free its DDP model, then destroy the group.
    del trainer
    destroy_process_group()


if __name__ == "__main__":
    main()
