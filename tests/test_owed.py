"""A team's quota owed: which queued jobs it owes GPUs (jobs/scheduling/owed.py), the live
scheduler's clocks on them, the Events past the reclaim bound, the reclaim report and the
console page that count them, and the setting that trades some utilization for them
(AGED_BORROWED_FIRST)."""

from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client
from django.utils import timezone

from jobs.models import Event
from jobs.reports.reclaim import reclaim_summary
from jobs.scheduling.loop import owed_clocks, run_pass
from jobs.scheduling.owed import Overdue, OwedClocks, fitting, lending, owed_jobs
from jobs.scheduling.snapshot import JobView, NodeView, RunningView, Snapshot, TeamView
from tests.heartbeats import beat, commit_checkpoint, live_attempt, submit

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def test_fitting_takes_jobs_greedily_in_order_and_passes_over_those_too_big():
    assert fitting(16, [(1, 8), (2, 16), (3, 4), (4, 4), (5, 1)]) == [1, 3, 4]
    assert fitting(16, [(1, 8), (2, 16), (3, 4), (4, 4), (5, 1)], smallest=4) == [1, 3, 4]
    assert fitting(0, [(1, 1)]) == []


def snapshot(teams, queued, running=()):
    nodes = tuple(
        NodeView(
            id=i, name=f"n{i}", rack="r", gpu_ids=tuple(range(8 * i, 8 * i + 8)), free=frozenset()
        )
        for i in range(1, 5)
    )
    return Snapshot(
        now=NOW, nodes=nodes, queued=tuple(queued), teams=tuple(teams), running=tuple(running)
    )


def job(job_id, team_id, gpus, minutes_ago, priority=1):
    return JobView(job_id, team_id, gpus, priority, NOW - timedelta(minutes=minutes_ago))


def test_a_teams_quota_owes_the_queued_jobs_that_fit_its_room_while_another_team_borrows():
    lender = TeamView(1, "lender", quota=16, borrow_limit=0, used=4)
    borrower = TeamView(2, "borrower", quota=16, borrow_limit=16, used=28)
    queued = [
        job(10, 1, 8, 30),  # first in the lender's order: fits its 12 free
        job(11, 1, 8, 20),  # no longer fits (4 left)
        job(12, 1, 2, 10),  # fits the 4 left
        job(13, 1, 1, 5, priority=0),  # low priority: last in order, 2 left, fits
        job(14, 2, 4, 40),  # the borrower's own: beyond its quota, owed nothing
    ]
    assert owed_jobs(snapshot([lender, borrower], queued)) == {10: 1, 12: 1, 13: 1}
    assert lending(snapshot([lender, borrower], queued))
    # Nobody beyond its quota: nothing is lent (clocks do not start), the room is the same.
    even = TeamView(2, "borrower", quota=16, borrow_limit=16, used=16)
    assert not lending(snapshot([lender, even], queued))
    assert owed_jobs(snapshot([lender, even], queued)) == {10: 1, 12: 1, 13: 1}
    # A team at its whole quota is owed nothing more.
    full = TeamView(1, "lender", quota=16, borrow_limit=0, used=16)
    assert owed_jobs(snapshot([full, borrower], queued)) == {}


def test_a_clock_past_the_bound_is_overdue_once_and_ends_when_the_job_is_no_longer_owed():
    clocks = OwedClocks(bound_s=65.0)
    assert clocks.update({10: 1, 12: 1}, NOW) == ([], [])
    newly, ended = clocks.update({10: 1, 12: 1}, NOW + timedelta(seconds=66))
    assert sorted(o.job_id for o in newly) == [10, 12] and ended == []
    assert clocks.update({10: 1, 12: 1}, NOW + timedelta(seconds=90)) == ([], [])  # once
    newly, ended = clocks.update({12: 1, 15: 1}, NOW + timedelta(seconds=100))
    assert newly == [] and [(o.job_id, o.since, o.ended) for o in ended] == [
        (10, NOW, NOW + timedelta(seconds=100))
    ]
    # A clock that ends within the bound leaves nothing to report.
    newly, ended = clocks.update({12: 1}, NOW + timedelta(seconds=120))
    assert newly == [] and ended == []  # 15 was owed 20 s
    # One past the bound at the very pass that ends it is reported as ended, without an alert.
    clocks.update({12: 1, 16: 1}, NOW + timedelta(seconds=130))
    newly, ended = clocks.update({12: 1}, NOW + timedelta(seconds=200))
    assert newly == [] and [o.job_id for o in ended] == [16]


def test_clocks_start_only_while_gpus_are_lent_and_run_on_after():
    clocks = OwedClocks(bound_s=65.0)
    clocks.update({10: 1}, NOW, lent=False)
    assert clocks.since == {}  # nothing lent: nothing owed yet
    clocks.update({10: 1}, NOW + timedelta(seconds=10))
    newly, _ = clocks.update({10: 1, 11: 1}, NOW + timedelta(seconds=80), lent=False)
    assert [o.job_id for o in newly] == [10] and 11 not in clocks.since


def test_a_new_term_takes_over_the_overdue_clocks_without_a_second_alert():
    clocks = OwedClocks(bound_s=65.0)
    clocks.adopt([Overdue(10, 1, NOW - timedelta(seconds=300))])
    assert clocks.update({10: 1}, NOW) == ([], [])
    newly, ended = clocks.update({}, NOW + timedelta(seconds=5))
    assert newly == [] and [(o.job_id, o.since) for o in ended] == [
        (10, NOW - timedelta(seconds=300))
    ]


def test_drained_for_gangs_are_counted_for_the_alert():
    from jobs.scheduling.owed import drained_for_gangs

    borrower = TeamView(2, "borrower", quota=8, borrow_limit=24, used=24)
    gang = RunningView(
        id=7, team_id=2, gpus=24, priority=1, slots=(), started_at=NOW - timedelta(hours=1)
    )
    old = RunningView(
        id=8, team_id=2, gpus=24, priority=1, slots=(), started_at=NOW - timedelta(hours=5)
    )
    assert drained_for_gangs(snapshot([borrower], [], [gang, old])) == 1


@pytest.fixture
def lent(make_team, make_user, make_nodes, settings, tmp_path):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "CHECKPOINT_ROOT": str(tmp_path / "ckpt"),
        "STOP_GRACE_S": 60.0,
        "SCHEDULER_TICK_S": 5.0,
    }
    owner = make_team("owner", quota=2)
    guest = make_team("guest", quota=0, borrow_limit=2)
    (node,) = make_nodes(1, 2)
    return owner, make_user("olga", team=owner), guest, make_user("gus", team=guest), node


@pytest.mark.django_db
def test_a_reclaim_past_its_bound_is_an_alert_and_its_end_is_counted_by_team(lent, tmp_path):
    owner, olga, guest, gus, node = lent
    clocks = owed_clocks()
    assert clocks.bound_s == 65.0
    t0 = timezone.now()
    borrowed = submit(guest, gus, gpus=2)
    run_pass(now=t0, owed=clocks)
    victim = live_attempt(borrowed)
    beat(node, victim, {0: None, 1: None})
    claimant = submit(owner, olga, gpus=2)
    run_pass(now=t0 + timedelta(seconds=1), owed=clocks)  # owed from here; the reclaim begins
    run_pass(now=t0 + timedelta(seconds=30), owed=clocks)
    assert not Event.objects.filter(kind__startswith="team.quota_overdue").exists()
    # The victim has not stopped yet (its trainer is slow to save): past the bound, an alert.
    run_pass(now=t0 + timedelta(seconds=67), owed=clocks)
    (alert,) = Event.objects.filter(kind="team.quota_overdue")
    assert alert.job_id == claimant.id and alert.team_id == owner.id
    assert "has waited 66s for GPUs within its team's quota" in alert.message
    row = reclaim_summary(since=t0, now=t0 + timedelta(seconds=67))[owner.id]
    assert row["owed_overdue_now"] == 1 and row["owed_oldest_s"] == 66.0 and row["breached"]
    # The victim saves and exits; the claimant starts at the next pass and the wait ends.
    beat(node, victim, {0: 0, 1: 0}, records=[commit_checkpoint(tmp_path / "ckpt", borrowed, 5)])
    run_pass(now=t0 + timedelta(seconds=69), owed=clocks)
    assert live_attempt(claimant) is not None
    (ended,) = Event.objects.filter(kind="team.quota_overdue_ended")
    assert ended.data["owed_s"] == 68.0 and ended.data["how"] == "started"
    row = reclaim_summary(since=t0, now=t0 + timedelta(seconds=70))[owner.id]
    assert (row["owed_overdue"], row["owed_overdue_max_s"], row["owed_overdue_now"]) == (1, 68.0, 0)
    assert row["breached"]
    # The guest, beyond its quota of 0, is owed nothing.
    assert guest.id not in reclaim_summary(since=t0, now=t0 + timedelta(seconds=70))


@pytest.mark.django_db
def test_a_restarted_scheduler_ends_the_overdue_wait_its_last_term_left_open(lent):
    owner, olga, guest, gus, node = lent
    clocks = owed_clocks()
    t0 = timezone.now()
    borrowed = submit(guest, gus, gpus=2)
    run_pass(now=t0, owed=clocks)
    beat(node, live_attempt(borrowed), {0: None, 1: None})
    claimant = submit(owner, olga, gpus=2)
    run_pass(now=t0 + timedelta(seconds=1), owed=clocks)
    run_pass(now=t0 + timedelta(seconds=67), owed=clocks)  # the alert
    # The scheduler restarts; meanwhile an admin takes the owner's quota away, so the job is
    # owed nothing any more. The new term's first pass ends the wait its last term alerted.
    Team = type(owner)
    Team.objects.filter(pk=owner.pk).update(quota=0)
    again = owed_clocks(now=t0 + timedelta(seconds=68))
    assert again.overdue == {claimant.id}
    run_pass(now=t0 + timedelta(seconds=69), owed=again)
    assert Event.objects.filter(kind="team.quota_overdue").count() == 1
    (ended,) = Event.objects.filter(kind="team.quota_overdue_ended")
    assert ended.data["owed_s"] == 68.0 and ended.data["how"].startswith("still queued")
    row = reclaim_summary(since=t0, now=t0 + timedelta(seconds=70))[owner.id]
    assert (row["owed_overdue"], row["owed_overdue_now"]) == (1, 0)


@pytest.mark.django_db
def test_the_preemptions_page_shows_owed_waits_past_the_bound(lent, make_user):
    owner, olga, guest, gus, node = lent
    clocks = owed_clocks()
    t0 = timezone.now() - timedelta(minutes=5)
    borrowed = submit(guest, gus, gpus=2)
    run_pass(now=t0, owed=clocks)
    beat(node, live_attempt(borrowed), {0: None, 1: None})
    submit(owner, olga, gpus=2)
    run_pass(now=t0 + timedelta(seconds=1), owed=clocks)
    run_pass(now=t0 + timedelta(seconds=67), owed=clocks)  # before the victim's forced end
    admin = make_user("root", staff=True)
    client = Client()
    client.force_login(admin)
    html = client.get("/console/preemptions/").content.decode()
    row = html.split('data-team="owner"')[1].split("</tr>")[0]
    assert '<td class="owed"><strong>1 waiting</strong> (oldest' in row
    # The alert heads the queue page beside the safety stop's.
    queue = client.get("/console/queue/").content.decode()
    alerts = queue.split('id="scheduler-alerts"')[1].split("</div>")[0]
    assert "has waited 66s for GPUs within its team&#x27;s quota" in alerts


@pytest.mark.django_db
def test_the_quota_promise_settings_reach_the_snapshot(settings):
    from jobs.scheduling.reader import take_snapshot

    snap = take_snapshot(timezone.now())
    assert (snap.aged_borrowed_first, snap.quota_before_drain) == (True, False)
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "AGED_BORROWED_FIRST": False,
        "QUOTA_BEFORE_DRAIN": True,
    }
    snap = take_snapshot(timezone.now())
    assert (snap.aged_borrowed_first, snap.quota_before_drain) == (False, True)
