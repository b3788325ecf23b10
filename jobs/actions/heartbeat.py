"""One agent heartbeat applied: node liveness, per-rank states and exits, logs, metrics and GPU
samples; the answer lists what should run on the node."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from jobs.actions.activity import note_activity
from jobs.actions.attempts import do_mark_attempt_running
from jobs.actions.base import record_event, wake
from jobs.actions.failures import (
    agent_time,
    fail_at_start,
    note_pull,
    record_exits,
    record_image,
    revise_cause,
)
from jobs.actions.ingest import ingest_records
from jobs.actions.node_health import do_record_health, requeue_off_unhealthy_node, wants_check
from jobs.actions.nodes import back_from_down, do_node_leaving
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.models import (
    Allocation,
    Attempt,
    GpuSample,
    LogChunk,
    Node,
)
from jobs.notify import on_commit_send
from jobs.queries import (
    desired_for_node,
)


def _report_order(report) -> int:
    attempt_id = report.get("attempt_id") if isinstance(report, dict) else None
    return attempt_id if isinstance(attempt_id, int) else -1


def reported_attempts(body: dict) -> frozenset[int]:
    """The attempts the agent reported in this heartbeat: it holds them, so their launch
    specs need not be sent again."""
    return frozenset(
        r["attempt_id"]
        for r in body.get("attempts") or []
        if isinstance(r, dict) and isinstance(r.get("attempt_id"), int)
    )


def scalar_ranks(records: list) -> set[int]:
    """Ranks that logged a scalar in this report. Records come from files a job writes:
    anything not a small integer is skipped here, as ingest skips the record itself."""
    ranks = set()
    for record in records:
        if isinstance(record, dict) and record.get("kind") == "scalar":
            rank = record.get("rank", 0)
            if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 2**31:
                ranks.add(rank)
    return ranks


def do_heartbeat(node: Node, body: dict, *, now: datetime) -> dict:
    """Apply one agent heartbeat; returns the response (what should run on the node)."""
    acked = []
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
        # A node whose agent said it is leaving stays down while that agent reports its
        # workers' last exits; it is up again when an agent registers with a new boot.
        # Back after being declared lost (not after a planned leave): the agent then removes
        # everything it still holds that is not wanted (nodeagent/agent.py).
        rejoined = node.state == Node.State.DOWN and node.leaving_at is None
        if rejoined:
            held = back_from_down(node)
            record_event(
                EventKind.NODE_UP,
                f"node {node.name} is back (heartbeat resumed)"
                + (f", still {held}: {node.state_reason}" if held else ""),
                node=node,
            )
            wake("node up")
        node.last_heartbeat_at = now
        node.telemetry = body.get("telemetry") or []
        node.save(
            update_fields=[
                "state",
                "state_reason",
                "held_state",
                "held_reason",
                "last_heartbeat_at",
                "telemetry",
            ]
        )
        if body.get("leaving") is True and node.leaving_at is None:
            # The agent is leaving but its leaving/ call has not got through (a 5xx, a
            # timeout): its ranks were told to stop, and their exits, 0 after the checkpoint,
            # would read as a finished job. The leave goes first.
            do_node_leaving(node, reason="said in its heartbeat", now=now)
            node.refresh_from_db()
        if isinstance(body.get("health"), dict):
            # First: a node that failed its check is out of scheduling before any attempt it
            # refused is requeued below.
            node = do_record_health(node, body["health"], now=now)

        # In attempt id order, so two heartbeats lock shared attempts in one order (no deadlock).
        for report in sorted(body.get("attempts") or [], key=_report_order):
            attempt_id = report.get("attempt_id")
            attempt = _attempt(attempt_id, report)
            if (
                attempt is None
                or attempt.ended_at is not None
                or not attempt.allocations.filter(node=node).exists()
            ):
                # Fencing on the portal side: reports from attempts that are no longer live
                # (or never were on this node) change nothing, except the cause of a failure
                # just ended on another node's report (`revise_cause`).
                if attempt is not None and attempt.state == Attempt.State.FAILED:
                    revise_cause(attempt, node, report, now=now)
                acked.append(attempt_id)
                continue
            chunks = [
                LogChunk(
                    attempt=attempt,
                    rank=int(item["rank"]),
                    # A worker may print NUL characters; PostgreSQL text cannot store them.
                    text=str(item["text"]).replace("\x00", "\ufffd"),
                    created_at=now,
                )
                for item in report.get("logs") or []
                if isinstance(item, dict) and item.get("text")
            ]
            LogChunk.objects.bulk_create(chunks)
            # After the logs: its rollup locks rows every node of the job takes (ingest.py).
            pushed = ingest_records(attempt, report.get("records") or [], now=now)
            if report.get("error"):
                # Before the ranks' states: a refused attempt's ranks are reported exited (the
                # engine's 125) without ever having run, and must not mark it running first.
                error = report["error"]
                if error.get("kind") == "health":
                    requeue_off_unhealthy_node(attempt, node, str(error["message"]), now=now)
                else:
                    fail_at_start(attempt, node, error, now=now)
                continue
            ranks = report.get("ranks") or []
            started = [int(r["rank"]) for r in ranks if r.get("state") in ("running", "exited")]
            if started:
                attempt.allocations.filter(
                    node=node, rank__in=started, started_at__isnull=True
                ).update(started_at=now)
                if (
                    attempt.state == Attempt.State.STARTING
                    and not attempt.allocations.filter(started_at__isnull=True).exists()
                ):
                    do_mark_attempt_running(attempt, now=now)
                    attempt.refresh_from_db()
            if attempt.state == Attempt.State.RUNNING:
                # A framework's logged scalars are output too (they are not steps).
                printed = {c.rank for c in chunks} | scalar_ranks(report.get("records") or [])
                note_activity(attempt, node, ranks, printed=printed, now=now)
            if report.get("pull") and not attempt.image_digest:
                note_pull(attempt, node, report["pull"])
            if report.get("image") and not attempt.image_digest:
                record_image(attempt, node, report["image"])
            exits = {
                int(r["rank"]): (int(r["exit_code"]), agent_time(r.get("exited_at"), now))
                for r in ranks
                if r.get("state") == "exited" and r.get("exit_code") is not None
            }
            if exits:
                record_exits(attempt, node, exits, now=now)
            live = chunks
            if (attempt.world_size or attempt.job.gpus) > lockstep_setting("LIVE_RANKS_MAX"):
                # A wide job's pages get rank 0 live and fetch the other ranks from the server
                # (job.js): every rank's points to every watcher is a push per node and
                # heartbeat, times the watchers, which a 4,096-rank job's page cannot draw and
                # the portal cannot send (bench/hollow.py --flagship 4096).
                pushed = [p for p in pushed if p["rank"] == 0]
                live = [c for c in chunks if c.rank == 0]
            if pushed:
                on_commit_send(attempt.job_id, {"type": "metrics", "points": pushed})
            for chunk in live:
                on_commit_send(
                    attempt.job_id,
                    {
                        "type": "log",
                        "rank": chunk.rank,
                        "attempt": attempt.number,
                        "text": chunk.text,
                    },
                )
        _sample_gpus(node, now)
    return {
        "heartbeat_s": lockstep_setting("HEARTBEAT_S"),
        "desired": desired_for_node(node, now, known=reported_attempts(body)),
        "acked": acked,
        **({"rejoined": True} if rejoined else {}),
        **({"health_check": True} if wants_check(node, now) else {}),
    }


def _attempt(attempt_id, report: dict) -> Attempt | None:
    """The reported attempt, locked where this report may change its state.

    Locked: the nodes of one gang report at the same moment (every rank exits at the end, or
    on a stop), each in its own transaction. Unlocked, on PostgreSQL each saw the other nodes'
    ranks still running and none ended the attempt (or marked it RUNNING), leaving it to the
    stop deadline or the start timeout. A RUNNING attempt's report with no exit, no error and
    only step and scalar records adds points, logs and activity, which need no lock: one on
    every heartbeat queued all 512 nodes of a whole-cluster job behind each other
    (bench/hollow.py --flagship 4096)."""
    if not isinstance(attempt_id, int):
        return None
    attempts = Attempt.objects.select_related("job").filter(pk=attempt_id)
    # Only steps and scalars (new rows, and the progress written with GREATEST): a layout
    # record merges into the attempt's row, a checkpoint record may create a shared row, and
    # those were read-modify-writes that the lock serialized (two nodes' layout counts).
    steady = (
        not report.get("error")
        and not any(
            isinstance(r, dict) and r.get("state") == "exited" for r in report.get("ranks") or []
        )
        and all(
            isinstance(r, dict) and r.get("kind") in ("step", "scalar")
            for r in report.get("records") or []
        )
    )
    if steady:
        attempt = attempts.first()
        if attempt is None or (attempt.state == Attempt.State.RUNNING and attempt.ended_at is None):
            return attempt
    return attempts.select_for_update(of=("self",), no_key=True).first()


def _reading_number(value, kind=float):
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = kind(value)
    except (OverflowError, ValueError):  # inf, nan as an int
        return None
    return number if number == number and abs(number) < 2**62 else None


def _sample_gpus(node: Node, now: datetime) -> None:
    """Keep the node's latest telemetry for every rank of a live attempt on it, at most every
    GPU_SAMPLE_S: the heartbeat's readings are otherwise overwritten by the next one. One
    sample per rank per period whatever the heartbeat rate (4,096 GPUs: ~410 rows a second
    at the default 10 s)."""
    every = lockstep_setting("GPU_SAMPLE_S")
    last = node.telemetry_sampled_at
    if not every or (last is not None and (now - last).total_seconds() < every):
        return
    readings = {
        reading.get("index"): reading for reading in node.telemetry if isinstance(reading, dict)
    }
    allocations = Allocation.objects.filter(
        node=node, started_at__isnull=False, released_at__isnull=True, attempt__ended_at=None
    ).values_list("attempt__job_id", "attempt_id", "rank", "gpu__index")
    samples = [
        GpuSample(
            job_id=job_id,
            attempt_id=attempt_id,
            rank=rank,
            t=int(now.timestamp()),
            util=_reading_number(reading.get("util")),
            mem_used=_reading_number(reading.get("mem_used"), int),
            mem_total=_reading_number(reading.get("mem_total"), int),
        )
        for job_id, attempt_id, rank, index in allocations
        if (reading := readings.get(index)) is not None
    ]
    GpuSample.objects.bulk_create(samples)
    Node.objects.filter(pk=node.pk).update(telemetry_sampled_at=now)
