"""Queue work (django-rq): slow things that must not run inside a request."""

import logging
from pathlib import Path

from jobs.conf import lockstep_setting

log = logging.getLogger(__name__)


def export_model_version(version_id: int) -> str | None:
    """Consolidate the version's sharded DCP checkpoint into one torch.save file."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from jobs.actions import do_finish_model_export
    from jobs.models import ModelVersion

    version = ModelVersion.objects.select_related("checkpoint").get(pk=version_id)
    root = Path(lockstep_setting("MODEL_ROOT")).resolve()
    out_dir = (root / version.name / f"v{version.version}").resolve()
    if not out_dir.is_relative_to(root) or out_dir.parent.parent != root:
        # Names are validated where they are entered; this holds even for one that was not.
        do_finish_model_export(version, path=None, error=f"unsafe model name {version.name!r}")
        return None
    out = out_dir / "state_dict.pt"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".pt.tmp")
        dcp_to_torch_save(version.checkpoint.path, tmp)
        tmp.replace(out)
    except Exception as exc:  # record why, so the registry page can show it
        log.exception("export of %s failed", version)
        do_finish_model_export(version, path=None, error=str(exc))
        return None
    do_finish_model_export(version, path=str(out))
    return str(out)


# An rmtree of a few large checkpoints on a network filesystem takes seconds, not minutes.
PRUNE_TIMEOUT_S = 600

# A pending prune's mark outlives a lost enqueue (a rolled-back commit) by at most this.
PRUNE_MARK_TTL_S = 300


def _prune_mark(job_id: int) -> str:
    return f"lockstep:prune-pending:{job_id}"


def enqueue_prune(job_id: int) -> bool:
    """Queue a retention pass for the job unless one is already waiting: that one reads the
    checkpoints when it starts (after clearing the mark), so it covers this commit too. One
    prune per commit cost a forked rq work horse per checkpoint (0.01-0.02 cores with a save
    every second or two in bench/overhead.py). True if a job was queued."""
    import django_rq

    if not django_rq.get_connection().set(_prune_mark(job_id), 1, nx=True, ex=PRUNE_MARK_TTL_S):
        return False
    # It runs inside the worker process (jobs/worker.py), which no other job can use meanwhile.
    django_rq.enqueue(prune_checkpoints, job_id, job_timeout=PRUNE_TIMEOUT_S)
    return True


def prune_checkpoints(job_id: int) -> list[int]:
    """Retention: keep the last KEEP_CHECKPOINTS, every registered one, every preemption
    checkpoint and any a live attempt resumed from; delete the rest from disk."""
    import shutil

    import django_rq
    from django.utils import timezone

    from jobs.models import Attempt, Checkpoint

    # First, so that a checkpoint committed from here on queues a prune of its own.
    django_rq.get_connection().delete(_prune_mark(job_id))

    keep_last = lockstep_setting("KEEP_CHECKPOINTS")
    live = Checkpoint.objects.filter(job_id=job_id, deleted_at__isnull=True).order_by(
        "-step", "-id"
    )
    protected = set(
        Attempt.objects.filter(
            job_id=job_id, ended_at__isnull=True, resumed_from__isnull=False
        ).values_list("resumed_from_id", flat=True)
    )
    pruned = []
    for index, checkpoint in enumerate(live):
        if (
            index < keep_last
            or checkpoint.preemption
            or checkpoint.id in protected
            or checkpoint.versions.exists()
        ):
            continue
        shutil.rmtree(checkpoint.path, ignore_errors=True)
        checkpoint.deleted_at = timezone.now()
        checkpoint.save(update_fields=["deleted_at"])
        pruned.append(checkpoint.step)
    if pruned:
        log.info("job %s: pruned checkpoints at steps %s", job_id, pruned)
    return pruned


def run_whatif(run_id: int) -> str:
    """An admin's what-if too large to run inside the request (jobs.whatif)."""
    from jobs.whatif import execute_whatif

    return execute_whatif(run_id).state
