"""Fair share's usage history as the reader takes it from the database (scheduling/reader.py):
decayed GPU-seconds per team over four half-lives, read grouped per gang, and the leader's
memo that decays the released part instead of reading it every pass. Runs on SQLite and on
PostgreSQL (DATABASE_URL)."""

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs.bulk_sql import read_rows
from jobs.models import GPU, PRIORITY_RANK, Allocation, Attempt, Job, Priority
from jobs.scheduling.reader import QueueMemo, UsageMemo, take_snapshot
from tests.heartbeats import submit

HALF_LIFE_S = 3600.0


def _gang(team, user, gpus, claimed, released, number=1):
    """A finished (or, with `released` None, live) attempt holding `gpus` GPUs, one row each."""
    job = Job.objects.create(
        name="h",
        team=team,
        owner=user,
        image="x",
        command=["true"],
        gpus=len(gpus),
        submitted_at=claimed,
        state=Job.State.SUCCEEDED if released else Job.State.RUNNING,
    )
    attempt = Attempt.objects.create(
        job=job,
        number=number,
        state=Attempt.State.SUCCEEDED if released else Attempt.State.RUNNING,
        master_addr="x",
        master_port=29500,
        created_at=claimed,
        ended_at=released,
    )
    Allocation.objects.bulk_create(
        Allocation(
            attempt=attempt,
            gpu=gpu,
            node_id=gpu.node_id,
            rank=rank,
            local_rank=rank,
            group_rank=0,
            claimed_at=claimed,
            released_at=released,
        )
        for rank, gpu in enumerate(gpus)
    )


def _expected(now, rows):
    """The rule, one GPU at a time: every second held within the last four half-lives,
    weighted 0.5 ** (age / half-life) at the allocation's midpoint."""
    since = now - timedelta(seconds=4 * HALF_LIFE_S)
    usage = {}
    for team_id, claimed, released in rows:
        start, end = max(claimed, since), min(released or now, now)
        seconds = (end - start).total_seconds()
        if seconds > 0:
            age = (now - (start + (end - start) / 2)).total_seconds()
            usage[team_id] = usage.get(team_id, 0.0) + seconds * 0.5 ** (age / HALF_LIFE_S)
    return usage


@pytest.fixture
def history(settings, make_team, make_user, make_nodes):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "USAGE_HALF_LIFE_S": HALF_LIFE_S}
    a, b, idle = make_team("a", quota=8), make_team("b", quota=8), make_team("idle", quota=8)
    user = make_user("hu", team=a)
    make_nodes(2, 8)
    gpus = list(GPU.objects.order_by("node_id", "index"))
    now = timezone.now()
    hours = lambda h: now - timedelta(hours=h)  # noqa: E731
    _gang(a, user, gpus[0:8], hours(2), hours(1))  # a gang of 8 inside the window
    _gang(a, user, gpus[0:2], hours(9), hours(5))  # straddles the window's start (4 h)
    _gang(b, user, gpus[8:10], hours(12), hours(10))  # wholly before it: not counted
    _gang(b, user, gpus[8:12], hours(0.5), None)  # live: counted up to now, and as used
    _gang(a, user, gpus[2:3], hours(0.2), None)
    rows = list(
        Allocation.objects.values_list("attempt__job__team_id", "claimed_at", "released_at")
    )
    return now, {"a": a, "b": b, "idle": idle}, rows


@pytest.mark.django_db
def test_decayed_usage_and_gpus_in_use_per_team(history):
    now, teams, rows = history
    views = {t.id: t for t in take_snapshot(now).teams}
    expected = _expected(now, rows)
    for name in ("a", "b"):
        view = views[teams[name].id]
        assert view.usage_history == pytest.approx(expected[teams[name].id], rel=1e-9)
    assert views[teams["idle"].id].usage_history == 0.0
    assert [views[teams[n].id].used for n in ("a", "b", "idle")] == [1, 4, 0]
    # b's history is its live gang alone: the old one ended before the window.
    assert views[teams["b"].id].usage_history == pytest.approx(
        4 * 1800 * 0.5 ** (900 / HALF_LIFE_S), rel=1e-9
    )
    # Teams come in id order, whatever order the database groups in.
    assert [t.id for t in take_snapshot(now).teams] == sorted(views)


def _reads(now, memo):
    with CaptureQueriesContext(connection) as ctx:
        teams = {t.id: t.usage_history for t in take_snapshot(now, memo).teams}
    allocation_reads = [
        q["sql"] for q in ctx.captured_queries if 'FROM "jobs_allocation"' in q["sql"]
    ]
    return teams, allocation_reads


@pytest.mark.django_db
def test_the_leaders_memo_decays_released_usage_and_reads_only_what_changed(history):
    now, teams, _ = history
    memo = UsageMemo(refresh_s=300)
    first, first_reads = _reads(now, memo)
    assert memo.at == now and memo.closed  # the released gangs, read once
    fresh = {t.id: t.usage_history for t in take_snapshot(now).teams}
    assert first == pytest.approx(fresh, rel=1e-12)

    # 100 s later: a gang of a's ends and another of b's is released after the memo was made;
    # the memo's part is decayed, only what is held or released since `at` is read.
    later = now + timedelta(seconds=100)
    live_b = Allocation.objects.filter(attempt__job__team=teams["b"], released_at__isnull=True)
    live_b.update(released_at=now + timedelta(seconds=50))
    second, second_reads = _reads(later, memo)
    assert memo.at == now
    exact = {t.id: t.usage_history for t in take_snapshot(later).teams}
    # Exact but for the window's far edge moving 100 s (a's straddling gang there weighs
    # 1/16 of a second per second): well within a thousandth.
    assert second == pytest.approx(exact, rel=1e-3)
    assert second[teams["b"].id] == pytest.approx(exact[teams["b"].id], rel=1e-12)
    # The decayed part is not read again: one history read fewer than at the refresh.
    assert len(second_reads) == len(first_reads) - 1

    # Past refresh_s it is read afresh and exact again; a clock that went back does too.
    for when in (now + timedelta(seconds=301), now - timedelta(seconds=5)):
        again, _ = _reads(when, memo)
        assert memo.at == when
        assert again == pytest.approx(
            {t.id: t.usage_history for t in take_snapshot(when).teams}, rel=1e-12
        )


@pytest.mark.django_db
def test_queued_rows_read_with_psycopgs_own_timestamp_loader_equal_the_orms(make_team, make_user):
    # read_rows (jobs/bulk_sql.py) skips Django's Python timestamp loader on PostgreSQL: the
    # rows must be the ORM's, to the microsecond and time zone, None included.
    team = make_team("q", quota=8)
    user = make_user("qu", team=team)
    at = timezone.now().replace(microsecond=123457)
    for k in range(3):
        Job.objects.create(
            name=f"q{k}",
            team=team,
            owner=user,
            image="x",
            command=["true"],
            gpus=1,
            submitted_at=at - timedelta(days=400 * k, microseconds=k),
            first_started_at=None if k == 0 else at + timedelta(seconds=k),
            state=Job.State.QUEUED,
        )
    query = Job.objects.filter(state=Job.State.QUEUED).order_by("id")
    fields = ("id", "name", "submitted_at", "first_started_at", "time_limit_s")
    rows = read_rows(query.values_list(*fields, named=True))
    assert rows == list(query.values_list(*fields, named=True)) and len(rows) == 3
    assert rows[1].submitted_at == at - timedelta(days=400, microseconds=1)
    assert rows[0].first_started_at is None and rows[2].submitted_at.utcoffset() == timedelta(0)
    # The snapshot takes them from there.
    snapshot = take_snapshot(timezone.now())
    assert sorted(j.submitted_at for j in snapshot.queued) == sorted(r.submitted_at for r in rows)


@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="the memo keys rows by PostgreSQL's xmin; on SQLite the queue is read whole (above)",
)
@pytest.mark.django_db(transaction=True)  # each change its own transaction, as in production
def test_the_leaders_queue_memo_reads_only_new_and_changed_rows_and_equals_a_full_read(
    make_team, make_user
):
    team = make_team("q", quota=8)
    user = make_user("qu", team=team)
    jobs = [submit(team, user, gpus=1, name=f"q{k}") for k in range(6)]
    memo, now = QueueMemo(), timezone.now()
    first = take_snapshot(now, queue=memo)
    assert memo.reread == 6 and first == take_snapshot(now)
    assert take_snapshot(now, queue=memo) == first and memo.reread == 0  # nothing changed
    # A changed row, a job that left the queue, a new one: those two rows read, no other.
    Job.objects.filter(pk=jobs[1].pk).update(priority=Priority.HIGH)
    Job.objects.filter(pk=jobs[2].pk).update(state=Job.State.CANCELLED)
    late = submit(team, user, gpus=2, name="late")
    third = take_snapshot(now, queue=memo)
    assert memo.reread == 2
    assert third == take_snapshot(now)  # the same snapshot as a full read, in the same order
    assert [j.id for j in third.queued] == sorted(
        {j.id for j in jobs} - {jobs[2].id} | {late.id}, reverse=True
    )
    assert next(j for j in third.queued if j.id == jobs[1].id).priority == PRIORITY_RANK["high"]
    # A row lock writes no new version: not a change.
    with transaction.atomic():
        Job.objects.select_for_update().get(pk=jobs[3].pk)
    take_snapshot(now, queue=memo)
    assert memo.reread == 0
    # Past refresh_s everything is read again.
    memo.refresh_s = 0.0
    assert take_snapshot(now, queue=memo) == third and memo.reread == 6
