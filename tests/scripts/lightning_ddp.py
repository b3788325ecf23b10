"""A PyTorch Lightning DDP script as a lab writes it: nothing of Lockstep in it. It learns a
small regression, logs to TensorBoard, saves every --every steps with ModelCheckpoint and
resumes with `ckpt_path="last"`. --crash-at N makes a run that did not resume fail at step N
(a failure to restart from)."""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, _index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log("weight_norm", self.net.weight.norm())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class CrashOnce(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, *_args) -> None:
        if self.at and trainer.global_step == self.at and trainer.ckpt_path is None:
            raise RuntimeError(f"crashing at step {self.at} on purpose")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=args.num_nodes,
        strategy="ddp",
        max_steps=args.steps,
        default_root_dir=args.root,
        logger=TensorBoardLogger(args.root, name="tb"),
        log_every_n_steps=1,
        callbacks=[
            ModelCheckpoint(
                dirpath=f"{args.root}/ckpt",
                every_n_train_steps=args.every,
                save_top_k=-1,
                save_last=True,
            ),
            CrashOnce(args.crash_at),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=16), ckpt_path="last")
    # Done and saved: leave without the interpreter's teardown. With torch 2.13 and gloo it
    # can abort ("terminate called without an active exception") or deadlock: py-spy showed
    # the DDP reducer's ProcessGroupGloo destructor joining its worker thread while holding
    # the GIL that thread needs to free its last work's tensor. Scripts that hit it in the
    # wild do the same, or never end (the platform then finds them idle and hung).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
