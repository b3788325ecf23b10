"""The rq worker class Lockstep runs (`RQ["WORKER_CLASS"]`).

rq's default worker forks a work horse for every job, which isolates a job's memory, imports
and crashes from the worker: right for a model export (torch, gigabytes) or a what-if replay.
A retention prune is a few queries and an `rmtree`, queued after every committed checkpoint;
forking a Django process for it cost about 30 ms of CPU per prune, most of the rq worker's
0.03 cores in bench/overhead.py. Those jobs run inside the worker process instead, as rq's
SimpleWorker runs every job.
"""

from django.db import connections
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.queue import Queue
from rq.worker import SimpleWorker, Worker


class LockstepWorker(Worker):
    # Small, frequent, no large imports, and safe to fail inside the worker (rq records the
    # failure either way).
    in_process = frozenset({"jobs.tasks.prune_checkpoints"})
    _running_in_process = False

    def _runs_in_process(self, job: Job) -> bool:
        try:
            return job.func_name in self.in_process
        except DeserializationError:
            return False  # a horse records the failure, as for any other job

    def execute_job(self, job: Job, queue: Queue) -> None:
        if not self._runs_in_process(job):
            super().execute_job(job, queue)
            return
        self._running_in_process = True
        try:
            SimpleWorker.execute_job(self, job, queue)
        finally:
            self._running_in_process = False
            # A later job may run in a forked horse, which would inherit an open database
            # socket and close it on exit under this process's feet.
            connections.close_all()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # Nothing renews the worker's and the execution's keys while a job runs in this
        # process (a forking worker does it between polls of its horse): they must last the
        # whole job, or rq takes a prune over its first minute and a half for abandoned.
        if self._running_in_process:
            return SimpleWorker.get_heartbeat_ttl(self, job, working_time)
        return super().get_heartbeat_ttl(job, working_time)

    def kill_horse(self, *args, **kwargs) -> None:
        # There is no horse: rq's kill would signal this worker's own process group (a stop
        # request or a cold shutdown during a prune).
        if self._running_in_process:
            return
        super().kill_horse(*args, **kwargs)
