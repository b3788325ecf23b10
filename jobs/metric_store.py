"""Where metric points live and how long (issue 20): storage tiers with retention by partition.

A 4,096-rank run stepping once a second with four metrics writes about 16,000 points a second,
1.4 billion a day. Kept forever in one indexed table, a week of one flagship run would outgrow
the database every page reads. So the points are kept in tiers:

- **rank 0, every step, for the job's life**: the loss curve researchers read, exact;
- **every rank, every step, for `METRIC_RAW_RETENTION_S`** (6 h by default): what straggler
  and hang detection read (the last minutes) and per-rank charts zoomed into recent steps;
- **every rank at reduced resolution, for the job's life**: the rollups (`jobs/rollup.py`,
  buckets of 16 to 1,048,576 steps with min, max and count), kept at ingest, from which the
  whole-run charts are drawn.

On PostgreSQL `jobs_metricpoint` is partitioned (migration 0020), so the old raw points of
ranks other than 0 go by dropping whole partitions, never by a DELETE that would rewrite and
bloat the table and its indexes:

    jobs_metricpoint                    PARTITION BY LIST ((rank = 0))
      jobs_metricpoint_kept             FOR VALUES IN (true)       rank 0: kept
      jobs_metricpoint_ranks            FOR VALUES IN (false)      PARTITION BY RANGE (time)
        jobs_metricpoint_r<YYYYMMDDtHHMM>   one per METRIC_RAW_PARTITION_S, dropped when old
        jobs_metricpoint_ranks_default      DEFAULT: points whose span has no partition yet

`maintain` (the scheduler's housekeeping, at most every MAINTAIN_EVERY_S) creates the
partitions of the next hours ahead of time and drops those wholly past the retention. The
default partition is a safety net (nothing accepted is lost): a point lands there only when
maintenance fell hours behind, and its old rows are deleted (they are few).

A point's `time` is the worker's clock, clamped at ingest to within CLOCK_SKEW_S of the
portal's (`clamp_time`), so a wrong clock can neither hide a point in a partition about to be
dropped nor route it past the partitions made ahead.

SQLite (the laptop default) has no partitions: `maintain` deletes the old rows of ranks other
than 0 instead; at that size a DELETE costs nothing.
"""

from __future__ import annotations

import logging
import math
import re
import time
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction

from jobs.conf import lockstep_setting

log = logging.getLogger(__name__)

TABLE = "jobs_metricpoint"
KEPT = f"{TABLE}_kept"
RANKS = f"{TABLE}_ranks"
DEFAULT = f"{RANKS}_default"
PREFIX = f"{TABLE}_r"
NAME = re.compile(rf"^{PREFIX}(\d{{8}}t\d{{4}})$")
AHEAD = 6  # partitions made ahead of the current one
MAINTAIN_EVERY_S = 300.0
CLOCK_SKEW_S = 3600.0  # a worker's clock further off than this is taken as the portal's

_next_run: float = 0.0  # this process's next maintenance (monotonic seconds)


def partitioned() -> bool:
    return connection.vendor == "postgresql"


def clamp_time(when: datetime, now: datetime) -> datetime:
    """The time a point is stored under: the worker's, unless it is more than CLOCK_SKEW_S from
    the portal's clock."""
    skew = timedelta(seconds=CLOCK_SKEW_S)
    return when if now - skew <= when <= now + skew else now


def _span() -> float:
    return max(60.0, float(lockstep_setting("METRIC_RAW_PARTITION_S")))


def _bounds(now: datetime, count: int) -> list[tuple[datetime, datetime]]:
    """[start, end) of the partition holding `now` and of the `count` after it, on a grid of
    the partition span anchored at the epoch (the same grid in every process)."""
    span = _span()
    first = math.floor(now.timestamp() / span) * span
    return [
        (
            datetime.fromtimestamp(first + k * span, UTC),
            datetime.fromtimestamp(first + (k + 1) * span, UTC),
        )
        for k in range(count + 1)
    ]


def partition_name(start: datetime) -> str:
    return f"{PREFIX}{start.astimezone(UTC):%Y%m%dt%H%M}"


def raw_partitions() -> list[tuple[str, datetime, datetime]]:
    """The time partitions of every rank's raw points: (name, start, end), oldest first."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname, pg_get_expr(c.relpartbound, c.oid)
            FROM pg_inherits i
            JOIN pg_class c ON c.oid = i.inhrelid
            JOIN pg_class p ON p.oid = i.inhparent
            WHERE p.relname = %s
            """,
            [RANKS],
        )
        rows = cursor.fetchall()
    out = []
    for name, bound in rows:
        if not NAME.match(name):
            continue
        start, end = re.findall(r"'([^']+)'", bound)
        out.append((name, datetime.fromisoformat(start), datetime.fromisoformat(end)))
    return sorted(out, key=lambda row: row[1])


def ensure_partitions(now: datetime) -> list[str]:
    """Create the partitions of the span holding `now` and of the AHEAD spans after it that do
    not exist yet. Returns the names created. A span the default partition already holds rows
    of is left to the default partition (PostgreSQL refuses the partition then)."""
    existing = {name for name, _, _ in raw_partitions()}
    made = []
    for start, end in _bounds(now, AHEAD):
        name = partition_name(start)
        if name in existing:
            continue
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(
                    f'CREATE TABLE "{name}" PARTITION OF {RANKS} FOR VALUES FROM (%s) TO (%s)',
                    [start, end],
                )
            made.append(name)
        except Exception as exc:  # noqa: BLE001 - rows already in the default partition
            log.warning("metric partition %s not created: %s", name, exc)
    return made


def drop_expired(now: datetime) -> dict:
    """Drop the raw partitions wholly older than the retention, and delete the default
    partition's rows older than it. Returns what went: {"dropped": [names], "deleted": rows}."""
    horizon = pruned_before(now)
    dropped = []
    for name, _, end in raw_partitions():
        if end <= horizon:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f'DROP TABLE "{name}"')
            dropped.append(name)
    with connection.cursor() as cursor:
        cursor.execute(f'DELETE FROM "{DEFAULT}" WHERE time < %s', [horizon])
        deleted = cursor.rowcount
    return {"dropped": dropped, "deleted": deleted}


def delete_expired(now: datetime) -> int:
    """Without partitions (SQLite): delete the raw points of ranks other than 0 older than the
    retention. Returns the rows deleted."""
    with connection.cursor() as cursor:
        cursor.execute(f'DELETE FROM "{TABLE}" WHERE rank <> 0 AND time < %s', [pruned_before(now)])
        return cursor.rowcount


def maintain(now: datetime, *, force: bool = False) -> dict | None:
    """Partitions ahead, expired raw points gone; at most every MAINTAIN_EVERY_S per process
    unless `force`. Returns what it did, or None when it was not due."""
    global _next_run
    if not force and time.monotonic() < _next_run:
        return None
    _next_run = time.monotonic() + MAINTAIN_EVERY_S
    if not partitioned():
        return {"created": [], "dropped": [], "deleted": delete_expired(now)}
    created = ensure_partitions(now)
    gone = drop_expired(now)
    if created or gone["dropped"] or gone["deleted"]:
        log.info(
            "metric partitions: created %s, dropped %s, %d old default rows deleted",
            created,
            gone["dropped"],
            gone["deleted"],
        )
    return {"created": created, **gone}


def pruned_before(now: datetime) -> datetime:
    """Raw points of ranks other than 0 older than this may be gone."""
    return now - timedelta(seconds=float(lockstep_setting("METRIC_RAW_RETENTION_S")))
