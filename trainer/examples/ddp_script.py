"""A plain torchrun-style DDP script (it reads only RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, through init_process_group) with the few lines that join Lockstep: its loss
on the job's charts, checkpoint-and-stop on preemption, and resume after a restart.

    torchrun --nproc-per-node 2 -m trainer.examples.ddp_script --steps 200
    lockstep submit ... --command "python -m trainer.examples.ddp_script --steps 200"

The lines marked `# Lockstep` are the whole change; without them it is the same script.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import trainer  # Lockstep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env://: the variables torchrun (or Lockstep) sets
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))

    start = 0
    if (path := trainer.resume_from()) is not None:  # Lockstep
        state = torch.load(path / "state.pt")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    trainer.set_total_steps(args.steps)  # Lockstep: progress and the projected end

    for step in range(start + 1, args.steps + 1):
        began = time.perf_counter()
        # Each rank draws its own batch, fixed by (step, rank): a resumed run sees the same data.
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_sleep)
        elapsed = time.perf_counter() - began
        trainer.report(step, loss=loss.item(), step_time_s=elapsed)  # Lockstep
        stop = trainer.should_stop()  # Lockstep: the same answer on every rank
        if step % args.checkpoint_every == 0 or stop or step == args.steps:
            with trainer.save_checkpoint(step) as path:  # Lockstep: committed when the block ends
                if rank == 0:
                    state = {"model": model.module.state_dict(), "step": step,
                             "optimizer": optimizer.state_dict()}  # fmt: skip
                    torch.save(state, path / "state.pt")
        if stop:  # Lockstep
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
