"""A Hugging Face Trainer script as a lab writes it: nothing of Lockstep in it. It learns a
small regression with the Trainer's DDP, logs to TensorBoard, saves checkpoint-N/ directories
every --every steps and resumes from the last one in its output directory. --crash-at N makes
a run that did not resume fail at step N (a failure to restart from)."""

from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.net(x)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


class Points(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 8, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.x[i].sum(dim=0, keepdim=True)}


class CrashOnce(TrainerCallback):
    def __init__(self, at: int, resumed: bool) -> None:
        self.at, self.resumed = at, resumed

    def on_step_end(self, args, state, control, **kwargs):
        if self.at and state.global_step == self.at and not self.resumed:
            raise RuntimeError(f"crashing at step {self.at} on purpose")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=0)
    args = parser.parse_args()

    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=0.05,
        logging_steps=2,
        save_steps=args.every,
        report_to=["tensorboard"],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=Regression(),
        args=training,
        train_dataset=Points(),
        callbacks=[CrashOnce(args.crash_at, resumed=last is not None)],
    )
    trainer.train(resume_from_checkpoint=last)
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
