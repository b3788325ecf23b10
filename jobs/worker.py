"""The rq worker class Lockstep runs (`RQ["WORKER_CLASS"]`).

rq's default worker forks a work horse for every job, which isolates a job's memory, imports
and crashes from the worker: right for a model export (torch, gigabytes) or a what-if replay.
A retention prune is a few queries and an `rmtree`, queued after every committed checkpoint;
forking a Django process for it cost about 30 ms of CPU per prune, most of the rq worker's
0.03 cores in bench/overhead.py. Those jobs run inside the worker process instead.
"""

from django.db import connections
from rq.job import Job
from rq.queue import Queue
from rq.worker import SimpleWorker, Worker


class LockstepWorker(Worker):
    # Small, frequent, no large imports, and safe to fail inside the worker (rq records the
    # failure either way).
    in_process = frozenset({"jobs.tasks.prune_checkpoints"})

    def execute_job(self, job: Job, queue: Queue) -> None:
        if job.func_name not in self.in_process:
            super().execute_job(job, queue)
            return
        try:
            SimpleWorker.execute_job(self, job, queue)
        finally:
            # A later job may run in a forked horse, which would inherit an open database
            # socket and close it on exit under this process's feet.
            connections.close_all()
