"""Queue work (django-rq): slow things that must not run inside a request. The rq worker
runs these; the domain queues them by name through jobs.queue, so nothing imports this module
but the worker (and tests)."""

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import django_rq
from django.utils import timezone

from jobs.actions import do_finish_model_export
from jobs.conf import lockstep_setting
from jobs.models import Attempt, Checkpoint, ModelVersion
from jobs.queue import prune_mark
from jobs.whatif import execute_whatif
from trainer.checkpoint_layout import job_dir, remove_step_dir
from trainer.framework_saves import inside

log = logging.getLogger(__name__)

# A 70B model's shards gathered into one file on a network filesystem: minutes, not hours.
EXPORT_TIMEOUT_S = 3000  # under the queue's 3600 s, so a timeout is recorded


def export_model_version(version_id: int) -> str | None:
    """Export the version's checkpoint: a DCP save consolidated into one torch.save file, a
    framework's save as the model's weights in one safetensors file."""
    version = ModelVersion.objects.select_related("checkpoint").get(pk=version_id)
    root = Path(lockstep_setting("MODEL_ROOT")).resolve()
    out_dir = (root / version.name / f"v{version.version}").resolve()
    if not out_dir.is_relative_to(root) or out_dir.parent.parent != root:
        # Names are validated where they are entered; this holds even for one that was not.
        do_finish_model_export(version, path=None, error=f"unsafe model name {version.name!r}")
        return None
    fmt = version.checkpoint.format
    source = Path(version.checkpoint.path)
    own = job_dir(lockstep_setting("CHECKPOINT_ROOT"), version.job_id)
    if source.is_symlink() or not inside(source, own):
        # The job could have swapped its save for a link since it was recorded.
        do_finish_model_export(version, path=None, error="the checkpoint is not a file of its job")
        return None
    # The reference trainer's save becomes one torch.save file; a framework's, the model's
    # weights as safetensors (trainer/export.py).
    out = out_dir / ("state_dict.pt" if fmt == Checkpoint.Format.DCP else "model.safetensors")
    out_dir.mkdir(parents=True, exist_ok=True)
    # The trainer's own command does the torch work: the domain's processes import no torch.
    command = [
        sys.executable,
        "-m",
        "trainer.export",
        version.checkpoint.path,
        str(out),
        "--format",
        fmt,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=EXPORT_TIMEOUT_S)
        error = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        done, error = None, f"the export took over {EXPORT_TIMEOUT_S} s"
    if done is None or done.returncode != 0:  # record why, so the registry page can show it
        log.error("export of %s failed: %s", version, error)
        do_finish_model_export(version, path=None, error=error)
        return None
    do_finish_model_export(version, path=str(out))
    return str(out)


def prune_checkpoints(job_id: int) -> list[int]:
    """Retention: keep the last KEEP_CHECKPOINTS, every registered one, every preemption
    checkpoint, any a live attempt resumed from, and every framework's save (its own rotation
    decides); delete the rest from disk."""
    # First, so that a checkpoint committed from here on queues a prune of its own.
    django_rq.get_connection().delete(prune_mark(job_id))

    keep_last = lockstep_setting("KEEP_CHECKPOINTS")
    live = Checkpoint.objects.filter(job_id=job_id, deleted_at__isnull=True).order_by(
        "-step", "-id"
    )
    running = set(
        Attempt.objects.filter(job_id=job_id, ended_at__isnull=True).values_list("id", flat=True)
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
            # A running framework keeps its own saves (Lightning's save_top_k, the Hugging
            # Face Trainer's save_total_limit); those of ended attempts, which its rotation
            # no longer sees, are pruned like any.
            or (checkpoint.format != Checkpoint.Format.DCP and checkpoint.attempt_id in running)
            or checkpoint.preemption
            or checkpoint.id in protected
            or checkpoint.versions.exists()
        ):
            continue
        if checkpoint.format == Checkpoint.Format.DCP:
            # The marker goes first: a prune cut short never leaves a marked, partial save.
            remove_step_dir(checkpoint.path, ignore_errors=True)
        else:
            remove_framework_save(checkpoint.path)
        checkpoint.deleted_at = timezone.now()
        checkpoint.save(update_fields=["deleted_at"])
        pruned.append(checkpoint.step)
    if pruned:
        log.info("job %s: pruned checkpoints at steps %s", job_id, pruned)
    return pruned


def remove_framework_save(path: str) -> None:
    """Delete a framework's save: a file, or a directory of files (a Hugging Face save). A link
    is removed as a link: whatever it points at is not the job's to delete."""
    target = Path(path)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def run_whatif(run_id: int) -> str:
    """An admin's what-if too large to run inside the request (jobs.whatif)."""
    return execute_whatif(run_id).state
