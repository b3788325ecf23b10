"""What a heartbeat brings in for one attempt: metric points (bulk insert and rollups),
checkpoint commits and the trainer's start and end records.

Two kinds of records: what a script writes through trainer.api (`step` records with the
STEP_METRICS, `checkpoint` records of committed DCP saves), and what the agent sees a framework
write on its own (`scalar` records read from TensorBoard event files, `checkpoint` records with
a `format` for Lightning, Hugging Face and torch.save files: nodeagent/scalars.py, saves.py).
Steps are progress (the hang detector's clock); scalars are the script's output, so they count
as activity only: a framework logs every N steps, too seldom to time a step by."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from django.db import connection
from django.db.models import Max, Value
from django.db.models.functions import Coalesce, Greatest
from django.template.defaultfilters import filesizeformat

from jobs import metric_store, queue, rollup
from jobs.actions.base import record_event
from jobs.bulk import bulk_set
from jobs.bulk_sql import insert_rows
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    Allocation,
    Attempt,
    Checkpoint,
    MetricPoint,
)
from jobs.notify import on_commit_send
from trainer.checkpoint_layout import MARKER, job_dir
from trainer.framework_saves import regular_file

log = logging.getLogger(__name__)


STEP_METRICS = ("loss", "tokens_per_s", "step_time_s", "compute_s")
# Steps and ranks are PositiveIntegerFields: 32 bits on PostgreSQL. A report beyond them is
# dropped as bad, rather than failing the whole heartbeat in the database.
MAX_COUNTER = 2**31 - 1
# An attempt's progress (last step, when) is written at most this often when no new step
# came: every node of a wide gang reports the same steps, and each write locks the attempt's
# row until its heartbeat commits (the hang detector's timeouts are a minute or more).
PROGRESS_WRITE_S = 1.0


FRAMEWORK_FORMATS = {
    Checkpoint.Format.LIGHTNING,
    Checkpoint.Format.HF,
    Checkpoint.Format.TORCH,
}
# Longest series name kept; TensorBoard tags are free text, the column is not.
MAX_NAME = 64


def _is_whole(path: Path, fmt: str) -> bool:
    """The portal's own check that a reported save is there and finished: the DCP marker, the
    Hugging Face Trainer's last file, or a file (the agent checked the zip index)."""
    if fmt == Checkpoint.Format.DCP:
        return (path / MARKER).exists()
    if fmt == Checkpoint.Format.HF:
        return regular_file(path / "trainer_state.json")
    return regular_file(path)


def _record_checkpoint(attempt: Attempt, record: dict, *, now: datetime) -> Checkpoint | None:
    path = str(record.get("path", ""))
    fmt = str(record.get("format") or Checkpoint.Format.DCP)
    if fmt not in Checkpoint.Format.values:
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    own = job_dir(lockstep_setting("CHECKPOINT_ROOT"), attempt.job_id)
    resolved = Path(path).resolve()
    # Only paths inside the job's own checkpoint directory, never a link the job made (the
    # export reads it as the portal's user), and only finished saves.
    if Path(path).is_symlink() or not resolved.is_relative_to(own) or not _is_whole(resolved, fmt):
        log.warning("ignoring checkpoint record outside %s or unfinished: %s", own, path)
        return None
    # A framework's save may carry no step in its name: it is then the attempt's latest.
    step = int(record["step"]) if "step" in record else _latest_step(attempt)
    if not 0 <= step <= MAX_COUNTER or not 0 <= int(record.get("bytes", 0)) < 2**63:
        raise ValueError(f"checkpoint step or size out of range: {record}")
    checkpoint, created = Checkpoint.objects.get_or_create(
        job_id=attempt.job_id,
        path=str(resolved),
        defaults={
            "attempt": attempt,
            "preemption": attempt.state == Attempt.State.STOPPING,
            "step": step,
            "bytes": int(record.get("bytes", 0)),
            "save_s": float(record.get("save_s", 0)),
            "created_at": now,
            "format": fmt,
        },
    )
    rewritten = (checkpoint.step, checkpoint.bytes) != (step, int(record.get("bytes", 0)))
    if (
        not created
        and fmt != Checkpoint.Format.DCP
        and checkpoint.deleted_at is None
        and rewritten
        # A registered save keeps the step it was registered at (its version says so).
        and not checkpoint.versions.exists()
    ):
        # A framework's save overwritten in place (latest.pt): the same path, newer contents.
        checkpoint.step, checkpoint.bytes = step, int(record.get("bytes", 0))
        checkpoint.attempt, checkpoint.created_at = attempt, now
        checkpoint.save(update_fields=["step", "bytes", "attempt", "created_at"])
        record_event(
            EventKind.CHECKPOINT_COMMITTED,
            f"{Checkpoint.Format(fmt).label} checkpoint rewritten at step {step} "
            f"({filesizeformat(checkpoint.bytes)}): {resolved.name}",
            job_id=attempt.job_id,
            attempt=attempt,
            data={"step": step, "format": fmt, "rewritten": True},
        )
    if created:
        label = "" if fmt == Checkpoint.Format.DCP else f"{Checkpoint.Format(fmt).label} "
        took = f", saved in {checkpoint.save_s:.2f}s" if checkpoint.save_s else ""
        record_event(
            EventKind.CHECKPOINT_COMMITTED,
            f"{label}checkpoint at step {checkpoint.step} "
            f"({filesizeformat(checkpoint.bytes)}{took})",
            job_id=attempt.job_id,
            attempt=attempt,
            data={"step": checkpoint.step, "format": fmt},
        )
        on_commit_send(
            attempt.job_id, {"type": "checkpoint", "step": checkpoint.step, "id": checkpoint.id}
        )
        queue.enqueue_prune(attempt.job_id)
    return checkpoint


class _Point(NamedTuple):
    """A metric point on its way in: what `rollup.record` reads, without a model instance."""

    rank: int
    step: int
    name: str
    value: float
    time: datetime


def _insert_points(job_id: int, attempt_id: int, points: list[_Point]) -> None:
    """Plain tuples, inserted in bulk (jobs.bulk_sql): `bulk_create` spent most of a
    heartbeat's CPU building a model instance per point (the portal's share of the platform
    overhead, docs/training-benchmarks.md); the values here are already typed and checked."""
    adapt_time = connection.ops.adapt_datetimefield_value
    insert_rows(
        MetricPoint,
        ("job_id", "attempt_id", "rank", "step", "name", "value", "time"),
        [(job_id, attempt_id, p.rank, p.step, p.name, p.value, adapt_time(p.time)) for p in points],
    )


def _latest_step(attempt: Attempt) -> int:
    latest = MetricPoint.objects.filter(attempt=attempt).aggregate(step=Max("step"))["step"]
    return max(attempt.last_step, latest or 0)


def _scalar(rank: int, record: dict, now: datetime) -> _Point | None:
    """A TensorBoard scalar as a point, or None for a non-finite value (a diverged loss: the
    agent sends null)."""
    step, name, value = int(record["step"]), str(record["name"])[:MAX_NAME], record["value"]
    if not 0 <= step <= MAX_COUNTER or not name:
        raise ValueError(f"scalar step {step} or name {name!r} out of range")
    if value is None:
        return None
    when = datetime.fromtimestamp(float(record.get("time", now.timestamp())), now.tzinfo)
    return _Point(rank, step, name, float(value), metric_store.clamp_time(when, now))


# What a layout record may carry into Attempt.layout: numbers and short strings only, so a
# worker cannot grow the row (4,096 ranks each send one record; only the largest is kept).
_LAYOUT_NUMBERS = ("pp", "dp", "tp", "zero", "micro_batches", "global_batch",
                   "memory_limit_bytes", "pipeline_bubble", "stages_per_rank")  # fmt: skip
_LAYOUT_TEXT = ("how", "mode", "pp_schedule", "hardware")
_BYTES = ("weights", "grads", "optimizer", "activations", "overhead", "total",
          "cuda_peak_allocated")  # fmt: skip
_TIMES = ("compute_s", "exposed_comm_s", "bubble_s", "comm_s", "total_s")


def _numbers(d: object, keys: tuple[str, ...]) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    return {
        k: d[k] if isinstance(d[k], int) else float(d[k])
        for k in keys
        if isinstance(d.get(k), int | float) and not isinstance(d.get(k), bool)
    }


def _record_layout(attempt: Attempt, rank: int, record: dict) -> None:
    """The trainer's layout and prediction (rank 0's) and the largest measurement of any
    rank (the planner predicts the worst stage's memory), into Attempt.layout."""
    current = dict(attempt.layout or {})
    chosen = record.get("layout")
    if rank == 0 and isinstance(chosen, dict):
        kept = _numbers(chosen, _LAYOUT_NUMBERS)
        kept.update({k: str(chosen[k])[:80] for k in _LAYOUT_TEXT if chosen.get(k) is not None})
        kept["predicted_bytes"] = _numbers(chosen.get("predicted_bytes"), _BYTES)
        kept["predicted_resident_bytes"] = _numbers(chosen.get("predicted_resident_bytes"), _BYTES)
        kept["predicted_time"] = _numbers(chosen.get("predicted_time"), _TIMES)
        reasons = chosen.get("reasons")
        kept["reasons"] = [str(r)[:300] for r in reasons[:8]] if isinstance(reasons, list) else []
        current["chosen"] = kept
        record_event(
            EventKind.ATTEMPT_LAYOUT,
            layout_sentence(kept),
            job_id=attempt.job_id,
            attempt=attempt,
        )
    measured = _numbers(record.get("measured_bytes"), _BYTES)
    if measured:
        largest = current.get("measured_max") or {}
        current["measured_max"] = {
            k: max(v, float(largest.get(k, 0))) for k, v in {**largest, **measured}.items()
        }
        current["ranks"] = int(current.get("ranks", 0)) + 1
    attempt.layout = current
    # Under the attempt's row lock (the heartbeat holds it): ranks' records cannot race.
    Attempt.objects.filter(pk=attempt.pk).update(layout=current)


def layout_sentence(chosen: dict) -> str:
    """One line for the Event: what runs, why it was chosen, the prediction."""
    how = chosen.get("how", "")
    shape = (
        f"pp {int(chosen.get('pp', 1))} x dp {int(chosen.get('dp', 1))} x "
        f"tp {int(chosen.get('tp', 1))}, {chosen.get('mode', '?')}"
    )
    total = chosen.get("predicted_bytes", {}).get("total")
    step = chosen.get("predicted_time", {}).get("total_s")
    tail = ""
    if total is not None:
        tail += f"; predicted {total / (1 << 20):,.1f} MiB per GPU"
    if step is not None:
        tail += f", {step * 1000:,.1f} ms per step"
    return f"layout ({how}): {shape}{tail}"


def ingest_records(attempt: Attempt, records: list, *, now: datetime) -> list[dict]:
    points, pushed = [], []
    read_step = attempt.last_step  # as the row said when read
    step_keys = set()  # points that are steps (progress); the rest are a framework's scalars
    for record in records:
        if not isinstance(record, dict):
            continue
        kind = record.get("kind")
        try:
            rank = int(record.get("rank", 0))
            if not 0 <= rank <= MAX_COUNTER:
                raise ValueError(f"rank {rank} out of range")
            if kind == "step":
                step = int(record["step"])
                if not 0 <= step <= MAX_COUNTER:
                    raise ValueError(f"step {step} out of range")
                when = metric_store.clamp_time(
                    datetime.fromtimestamp(float(record.get("time", now.timestamp())), now.tzinfo),
                    now,
                )
                for name in STEP_METRICS:
                    if isinstance(record.get(name), int | float):
                        value = float(record[name])
                        points.append(_Point(rank, step, name, value, when))
                        step_keys.add((rank, step, name))
                attempt.last_step = max(attempt.last_step, step)
            elif kind == "scalar":
                point = _scalar(rank, record, now)
                if point is not None:
                    points.append(point)
            elif kind == "checkpoint":
                _record_checkpoint(attempt, record, now=now)
            elif kind == "start" and rank == 0:
                _trainer_up(attempt, record)
                if record.get("total_steps") is not None:
                    _record_total_steps(attempt, record["total_steps"])
            elif kind == "total_steps" and rank == 0:
                _record_total_steps(attempt, record.get("total_steps"))
            elif kind == "layout":
                _record_layout(attempt, rank, record)
            elif kind == "end" and rank == 0:
                record_event(
                    EventKind.ATTEMPT_TRAINER_ENDED,
                    f"trainer ended at step {record.get('step')}: {record.get('reason')}",
                    job_id=attempt.job_id,
                    attempt=attempt,
                )
        except (KeyError, TypeError, ValueError, OverflowError, OSError) as exc:
            # OverflowError, OSError: a timestamp out of the platform's range.
            log.warning("bad metric record from attempt %s: %s (%s)", attempt.id, record, exc)
    if points:
        points = _fresh(attempt, points, step_keys)
        pushed = [
            {
                "rank": p.rank,
                "step": p.step,
                "name": p.name,
                "value": p.value,
                "attempt": attempt.number,
            }
            for p in points
        ]
    if points:
        _insert_points(attempt.job_id, attempt.id, points)
    if any((p.rank, p.step, p.name) in step_keys for p in points):
        _note_progress(attempt, read_step, now)
    if points:
        # Last: the series' header rows are locked from here to the heartbeat's commit, and
        # every node of the job takes them (the attempt's row, above, comes first in both
        # this and the state-changing path, so they cannot deadlock).
        rollup.record(attempt.job_id, points, world=attempt.world_size)
    return pushed


def _fresh(attempt: Attempt, points: list[_Point], step_keys: set) -> list[_Point]:
    """The points not stored yet. Delivery is at least once: a heartbeat the portal committed
    but whose answer the agent never got (the portal restarted in between) is sent again. A
    step of one rank is stored once per attempt; a rank's points come from its node alone,
    whose row lock keeps two of its heartbeats from racing. Within one batch too: a
    framework may log a tag twice at one step; the first stays.

    Step records come in step order per rank, so each rank's allocation keeps the highest
    step stored (`recorded_step`) and a record at or below it was sent before. The stored
    points are read only for a framework's scalars and for ranks with no mark yet (an attempt
    begun before the mark existed): reading them for every step record read a whole-cluster
    job's 4,096 ranks' points of that step on every node's heartbeat."""
    steps = [p for p in points if (p.rank, p.step, p.name) in step_keys]
    rows = Allocation.objects.filter(attempt=attempt, rank__in={p.rank for p in steps})
    ids, marks = {}, {}
    for pk, rank, mark in rows.values_list("id", "rank", "recorded_step"):
        ids[rank], marks[rank] = pk, mark
    check = [
        p for p in points if (p.rank, p.step, p.name) not in step_keys or marks.get(p.rank) is None
    ]
    stored = set()
    if check:
        stored = set(
            MetricPoint.objects.filter(
                job_id=attempt.job_id,
                name__in={p.name for p in check},
                step__in={p.step for p in check},
                rank__in={p.rank for p in check},
                attempt=attempt,
                # A point sent again carries the time it was first stored under (or, from a
                # clock taken as the portal's, one a little earlier): on PostgreSQL this keeps
                # the lookup to the newest time partitions (jobs/metric_store.py).
                time__gte=min(p.time for p in check) - timedelta(seconds=metric_store.CLOCK_SKEW_S),
            ).values_list("rank", "step", "name")
        )
    fresh, highest = [], {}
    for point in points:
        key = (point.rank, point.step, point.name)
        mark = marks.get(point.rank)
        if key in step_keys and mark is not None and point.step <= mark:
            continue
        if key not in stored:
            stored.add(key)
            fresh.append(point)
            if key in step_keys:
                highest[point.rank] = max(highest.get(point.rank, point.step), point.step)
    # Only this rank's node writes its mark, under that node's lock: the values only grow.
    bulk_set(
        Allocation,
        ["recorded_step"],
        [(ids[rank], step) for rank, step in highest.items() if rank in ids],
    )
    return fresh


def _note_progress(attempt: Attempt, read_step: int, now: datetime) -> None:
    """Progress is what the hang detector watches: the portal's clock, not the workers'.
    The attempt may be read unlocked (a steady heartbeat, jobs/actions/heartbeat.py), so the
    write keeps the greatest step and the first first step (and its step number, the pace's
    start: jobs/progress.py) whatever another node wrote meanwhile; it is skipped when the
    row already says as much and is fresh."""
    recent = attempt.last_progress_at is not None and (
        (now - attempt.last_progress_at).total_seconds() < PROGRESS_WRITE_S
    )
    if recent and attempt.first_step_at is not None and attempt.last_step <= read_step:
        return
    changes = {
        "last_step": Greatest("last_step", Value(attempt.last_step)),
        "last_progress_at": now,
        "first_step_at": Coalesce("first_step_at", Value(now)),
    }
    if attempt.first_step_at is None:  # this batch holds the first steps (as this node read it)
        # The batch's latest step, the one done by `now` (first_step_at): its earlier steps
        # took time before it, which counted as none made the first pace too fast.
        attempt.first_step = attempt.last_step
        changes["first_step"] = Coalesce("first_step", Value(attempt.first_step))
    attempt.last_progress_at = now
    attempt.first_step_at = attempt.first_step_at or now
    Attempt.objects.filter(pk=attempt.pk).update(**changes)


def _record_total_steps(attempt: Attempt, value: object) -> None:
    """The run's length in steps, as rank 0 says it (a later record replaces it: a script may
    learn its length only once its data is loaded)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_COUNTER:
        raise ValueError(f"total_steps {value!r} is not a positive step count")
    if attempt.total_steps != value:
        attempt.total_steps = value
        Attempt.objects.filter(pk=attempt.pk).update(total_steps=value)


def _trainer_up(attempt: Attempt, record: dict) -> None:
    record_event(
        EventKind.ATTEMPT_TRAINER_STARTED,
        f"trainer up: world size {record.get('world_size')}"
        + (f" on {record['device']}" if record.get("device") else "")
        + f", resumed from step {record.get('resumed_from_step', 0)}",
        job_id=attempt.job_id,
        attempt=attempt,
    )
