"""A gloo gang that hangs the way a real one does: rank $BEHIND stays out of the fourth
all-reduce (asleep in Python), the others wait in it. Each rank serves the flight-recorder dump
pipe as the reference trainer does (trainer/flight_recorder.py). Used by
tests/test_flight_recorder.py."""

import os
import time

import torch
import torch.distributed as dist

from trainer.flight_recorder import serve_dump_pipe

rank, behind = int(os.environ["RANK"]), int(os.environ["BEHIND"])
dist.init_process_group("gloo")
serve_dump_pipe(rank)
tensor = torch.ones(8)
for _ in range(3):
    dist.all_reduce(tensor)
dist.broadcast(tensor, src=0)
print("entered the hang", flush=True)
if rank == behind:
    time.sleep(600)
else:
    dist.all_reduce(tensor)
