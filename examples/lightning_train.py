"""Lightning with 1-bit Adam: ``Trainer(strategy="ddp")`` and the optimizer from
``configure_optimizers``. Lightning wraps the model in DDP before it builds the optimizer,
and the optimizer switches DDP's all-reduce off itself at construction: no glue.

    torchrun --nproc_per_node 2 examples/lightning_train.py
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
import torch.nn.functional as F

import onebit
from _bytes import CONTEXT, byte_model, byte_windows, freeze_step
from _teardown import destroy_process_group


class ByteModel(L.LightningModule):
    def __init__(self, freeze_step: int | str) -> None:
        super().__init__()
        self.freeze_step = freeze_step
        self.ddp_hook: str | None = None
        self.net = byte_model()

    def training_step(self, window: torch.Tensor, index: int) -> torch.Tensor:
        loss = F.cross_entropy(self.net(window[:, :CONTEXT]), window[:, CONTEXT])
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_end(self) -> None:
        # Lightning unwraps the model when fit ends: read DDP's logging data while it is wrapped.
        self.ddp_hook = self.trainer.strategy.model._get_ddp_logging_data().get("comm_hook")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Clipping belongs to the optimizer: Lightning's gradient_clip_val would clip each
        # rank's local gradient.
        return onebit.OnebitAdam(self.parameters(), lr=3e-3, freeze_step=self.freeze_step, max_grad_norm=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--freeze-step", type=freeze_step, default="auto", help=freeze_step.__doc__)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ByteModel(args.freeze_step)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=True)
    # Every rank reads the whole file; Lightning's distributed sampler gives each its shard.
    loader = torch.utils.data.DataLoader(byte_windows(0, 1, args.steps * 2 * 16), batch_size=16)
    trainer.fit(model, loader)
    opt = trainer.optimizers[0]
    if trainer.is_global_zero:
        print(json.dumps({"loss": float(trainer.callback_metrics["loss"]), "stats": opt.stats,
                          "ddp_hook": model.ddp_hook}))
    # Lightning leaves the process group open: free its DDP model, then destroy the group (a
    # gloo worker still releasing the last collective's tensors at exit aborted one run).
    del trainer, opt
    destroy_process_group()


if __name__ == "__main__":
    main()
