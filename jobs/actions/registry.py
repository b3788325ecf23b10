"""The model registry: a committed checkpoint registered as an immutable model version, and
its export on the queue worker."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.db.models import Max

from jobs import queue
from jobs.actions.base import record_event
from jobs.event_kinds import EventKind
from jobs.models import (
    Checkpoint,
    MetricPoint,
    ModelVersion,
)


@transaction.atomic
def do_register_model_version(
    *, name: str, checkpoint: Checkpoint, actor, now: datetime, notes: str = ""
) -> ModelVersion:
    latest = (
        ModelVersion.objects.select_for_update(no_key=True)
        .filter(name=name)
        .aggregate(v=Max("version"))["v"]
        or 0
    )
    at_step = {
        p.name: p.value
        for p in MetricPoint.objects.filter(job_id=checkpoint.job_id, step=checkpoint.step, rank=0)
    }
    version = ModelVersion.objects.create(
        name=name,
        version=latest + 1,
        checkpoint=checkpoint,
        job_id=checkpoint.job_id,
        step=checkpoint.step,
        created_by=actor,
        created_at=now,
        notes=notes,
        metrics=at_step,
    )
    record_event(
        EventKind.MODEL_REGISTERED,
        f"{name} v{version.version} registered from job {checkpoint.job_id} step {checkpoint.step}",
        job_id=checkpoint.job_id,
        actor=actor,
    )
    queue.enqueue_export(version.id)
    return version


@transaction.atomic
def do_finish_model_export(version: ModelVersion, *, path: str | None, error: str = "") -> None:
    if path:
        version.export_state, version.export_path = ModelVersion.ExportState.READY, path
        message = f"{version} exported to {path}"
    else:
        version.export_state = ModelVersion.ExportState.FAILED
        message = f"{version} export failed: {error}"
    version.save(update_fields=["export_state", "export_path"])
    record_event(EventKind.MODEL_EXPORTED, message, job_id=version.job_id)
