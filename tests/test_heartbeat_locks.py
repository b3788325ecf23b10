"""What a heartbeat locks and writes on rows every node of a gang shares (the attempt's row):
a steady report (a RUNNING attempt, ranks running, points and logs) reads the attempt without
a lock and writes its progress only when it moved; a report that may change the attempt's
state locks it. All 512 nodes of a whole-cluster job report for one attempt
(bench/hollow.py --flagship 4096). Runs on SQLite and on PostgreSQL (DATABASE_URL)."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs.models import Attempt
from jobs.scheduling.loop import run_pass
from tests.heartbeats import beat, live_attempt, step_records, submit


def _attempt_sql(queries) -> tuple[list[str], list[str]]:
    """(reads of the attempt row that lock it, writes to it)."""
    locking = [
        q["sql"]
        for q in queries
        if q["sql"].startswith("SELECT")
        and 'FROM "jobs_attempt"' in q["sql"]
        and " FOR " in q["sql"]
    ]
    writes = [q["sql"] for q in queries if q["sql"].startswith('UPDATE "jobs_attempt"')]
    return locking, writes


@pytest.mark.django_db
def test_a_steady_report_neither_locks_nor_rewrites_the_shared_attempt(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=4)
    run_pass()
    attempt = live_attempt(job)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, now=t0)
    beat(b, attempt, {2: None, 3: None}, now=t0)
    assert live_attempt(job).state == Attempt.State.RUNNING

    def report(node, ranks, records, at):
        with CaptureQueriesContext(connection) as ctx:
            beat(node, attempt, ranks, records=records, now=at)
        return _attempt_sql(ctx.captured_queries)

    # Node a's steps 1-3 move the attempt on: one write, and no lock.
    locking, writes = report(a, {0: None, 1: None}, step_records(0, (1, 2, 3)), t0)
    assert locking == [] and len(writes) == 1
    assert live_attempt(job).last_step == 3
    # Node b reports the same steps for its ranks a moment later: nothing left to write.
    locking, writes = report(b, {2: None, 3: None}, step_records(2, (1, 2, 3)), t0)
    assert locking == [] and writes == []
    # A later step, or the same steps after PROGRESS_WRITE_S, is written again.
    locking, writes = report(b, {2: None, 3: None}, step_records(3, (1, 2, 3, 4)), t0)
    assert len(writes) == 1 and live_attempt(job).last_step == 4
    later = t0 + timedelta(seconds=2)
    locking, writes = report(a, {0: None, 1: None}, step_records(1, (1, 2)), later)
    assert len(writes) == 1
    again = live_attempt(job)
    assert again.last_step == 4 and again.last_progress_at == later  # the step never goes back

    # A layout record merges into the attempt's row (the ranks' count): locked, so two nodes'
    # records cannot overwrite each other's count.
    layout = {"kind": "layout", "rank": 2, "measured_bytes": {"total": 1000}}
    locking, _ = report(b, {2: None, 3: None}, [layout], later)
    if connection.vendor == "postgresql":
        assert locking and "FOR NO KEY UPDATE" in locking[0]
    assert Attempt.objects.get(pk=attempt.pk).layout["ranks"] == 1

    # A rank's exit may end the attempt: that report locks it (on PostgreSQL the lock is in
    # the SQL; SQLite serializes writers and has no FOR UPDATE).
    locking, _ = report(b, {2: None, 3: 1}, [], later)
    if connection.vendor == "postgresql":
        assert locking and "FOR NO KEY UPDATE" in locking[0]
    assert Attempt.objects.get(pk=attempt.pk).state == Attempt.State.FAILED


@pytest.mark.django_db
def test_step_records_sent_again_are_known_by_the_ranks_mark_not_by_reading_points(setup):
    """Delivery is at least once. A rank's allocation keeps the highest step stored, so a
    record sent again is dropped without reading the job's points of that step (a wide gang
    has one per rank); the first batch of a rank, with no mark yet, is checked against the
    points themselves."""
    from jobs.models import Allocation, MetricPoint

    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=4)
    run_pass()
    attempt = live_attempt(job)
    beat(a, attempt, {0: None, 1: None})
    beat(b, attempt, {2: None, 3: None})

    def send(records):
        with CaptureQueriesContext(connection) as ctx:
            beat(a, attempt, {0: None, 1: None}, records=records)
        return [q["sql"] for q in ctx.captured_queries if 'FROM "jobs_metricpoint"' in q["sql"]]

    first = step_records(0, (1, 2, 3)) + step_records(1, (1, 2, 3))
    assert len(send(first)) == 1  # no mark yet: the points are read once
    marks = dict(Allocation.objects.filter(attempt=attempt).values_list("rank", "recorded_step"))
    assert marks == {0: 3, 1: 3, 2: None, 3: None}
    # The same records again (the answer was lost), with step 4: no read, step 4 stored once.
    assert send(first + step_records(0, (4,)) + step_records(1, (4,))) == []
    stored = MetricPoint.objects.filter(attempt=attempt)
    assert stored.count() == 2 * 4 * 4  # ranks 0 and 1, steps 1-4, four metrics
    assert sorted(stored.filter(rank=0, name="loss").values_list("step", flat=True)) == [1, 2, 3, 4]
    assert Allocation.objects.get(attempt=attempt, rank=0).recorded_step == 4
