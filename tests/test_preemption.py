"""Checkpoint-first preemption through the real actions and scheduler pass: quota reclaim is
automatic and bounded, priority preemption waits for an admin (or its deadline), victims are
requeued and resume from their preemption checkpoint, and reclaim thrash is prevented."""

from datetime import timedelta

import pytest
from django.db import OperationalError
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.actions import do_cancel_job
from jobs.actions import preemption as preemption_actions
from jobs.models import Event, Job, PreemptionRequest
from jobs.scheduling.loop import run_pass
from jobs.scheduling.reader import CLAIM_AFTER_EXIT_S, take_snapshot
from tests.heartbeats import beat, commit_checkpoint, live_attempt, past_protection, submit


@pytest.fixture
def two_teams(make_team, make_user, make_nodes, settings, tmp_path):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "CHECKPOINT_ROOT": str(tmp_path / "ckpt"),
        "PREEMPTION_APPROVAL_DELAY_S": 120.0,
    }
    owner = make_team("owner", quota=2)
    guest = make_team("guest", quota=0, borrow_limit=2)
    (node,) = make_nodes(1, 2)
    return (
        (owner, make_user("olga", team=owner)),
        (guest, make_user("gus", team=guest)),
        node,
        tmp_path / "ckpt",
    )


def _reclaim(two_teams):
    """The guest borrows the owner's 2 GPUs and runs; then the owner's job queues and reclaims
    them. (borrowed job, its attempt, claimant job)"""
    (owner, olga), (guest, gus), node, _ = two_teams
    borrowed = submit(guest, gus, gpus=2)
    run_pass()
    victim_attempt = live_attempt(borrowed)
    beat(node, victim_attempt, {0: None, 1: None})
    claimant = submit(owner, olga, gpus=2)
    run_pass()
    return borrowed, victim_attempt, claimant


def _stop_and_exit(node, attempt, root):
    """The victim's trainer saves on SIGTERM, reports the checkpoint, and every rank exits 0."""
    (desired,) = beat(node, attempt, {0: None, 1: None})["desired"]
    assert desired["action"] == "stop"
    beat(node, attempt, {0: 0, 1: 0}, records=[commit_checkpoint(root, attempt.job, 37)])


@pytest.mark.django_db
def test_quota_reclaim_is_automatic_checkpoint_first_and_the_victim_resumes(two_teams):
    (owner, olga), (guest, gus), node, root = two_teams
    borrowed, victim_attempt, claimant = _reclaim(two_teams)
    (request,) = PreemptionRequest.objects.all()
    assert (request.kind, request.state, request.victim, request.claimant) == (
        "reclaim",
        "executed",
        borrowed,
        claimant,
    )
    borrowed.refresh_from_db()
    assert borrowed.state == "PREEMPTING"
    claimant.refresh_from_db()
    assert claimant.state == "QUEUED" and claimant.reason.startswith(
        f"waiting for job {borrowed.id} to checkpoint and stop (reclaiming its team's quota)"
    )
    _stop_and_exit(node, victim_attempt, root)
    victim_attempt.refresh_from_db()
    assert victim_attempt.state == "preempted"
    borrowed.refresh_from_db()
    assert borrowed.state == "QUEUED" and "requeued after preemption" in borrowed.reason
    assert borrowed.checkpoints.get().preemption is True
    run_pass()
    assert live_attempt(claimant).allocations.count() == 2
    request.refresh_from_db()
    assert request.reclaim_s is not None and request.reclaim_s < 5
    started = Event.objects.get(kind="preemption.claimant_started")
    assert started.data["reclaim_s"] == pytest.approx(request.reclaim_s)
    # Thrash prevention: the guest team may not borrow again right away...
    borrowed.refresh_from_db()
    assert "borrowing paused after a reclaim" in borrowed.reason
    # ... and when the owner's job ends, the victim resumes from its preemption checkpoint.
    attempt = live_attempt(claimant)
    beat(node, attempt, {0: 0, 1: 0})
    run_pass(now=timezone.now() + timedelta(seconds=301))
    resumed = live_attempt(borrowed)
    assert resumed.number == 2 and resumed.resumed_from_step == 37


@pytest.mark.django_db
def test_a_reclaim_whose_approval_dies_is_proposed_again_by_the_next_pass(two_teams, monkeypatch):
    """The approval of a reclaim can lose a race (on PostgreSQL, a deadlock victim). Its
    proposal must not survive it: a reclaim has no approval deadline, and a proposal left open
    blocks every later one for that victim, so the borrower never stopped (a CI failure)."""
    (owner, olga), (guest, gus), node, _ = two_teams
    borrowed = submit(guest, gus, gpus=2)
    run_pass()
    beat(node, live_attempt(borrowed), {0: None, 1: None})
    claimant = submit(owner, olga, gpus=2)

    def deadlock(request, *, now):
        raise OperationalError("deadlock detected")

    with monkeypatch.context() as patched:
        patched.setattr(preemption_actions, "_execute_preemption", deadlock)
        run_pass()
    assert not PreemptionRequest.objects.exists()
    assert Job.objects.get(pk=borrowed.pk).state == "RUNNING"
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    assert (request.state, request.victim_id, request.claimant_id) == (
        "executed",
        borrowed.id,
        claimant.id,
    )
    assert Job.objects.get(pk=borrowed.pk).state == "PREEMPTING"


@pytest.mark.django_db
def test_a_reclaim_left_proposed_is_carried_out_by_the_next_pass(two_teams):
    """Before reclaims were proposed and approved in one transaction, a failed approval left
    the proposal open for good (reclaims have no approval deadline). One found in the
    database is carried out."""
    (owner, olga), (guest, gus), node, _ = two_teams
    borrowed = submit(guest, gus, gpus=2)
    run_pass()
    beat(node, live_attempt(borrowed), {0: None, 1: None})
    claimant = submit(owner, olga, gpus=2)
    stuck = PreemptionRequest.objects.create(
        victim=borrowed,
        claimant=claimant,
        kind=PreemptionRequest.Kind.RECLAIM,
        reason="reclaiming its team's quota",
        created_at=timezone.now(),
    )
    run_pass()
    stuck.refresh_from_db()
    assert stuck.state == "executed"
    assert Job.objects.get(pk=borrowed.pk).state == "PREEMPTING"
    assert PreemptionRequest.objects.count() == 1


@pytest.mark.django_db
def test_a_reclaims_gpus_go_to_its_claimant_even_past_a_higher_priority_job(
    two_teams, make_team, make_user
):
    (owner, olga), (guest, gus), node, root = two_teams
    rival_team = make_team("rival", quota=0, borrow_limit=2)
    rival_user = make_user("rita", team=rival_team)
    borrowed, victim_attempt, claimant = _reclaim(two_teams)
    (desired,) = beat(node, victim_attempt, {0: None, 1: None})["desired"]
    assert desired["action"] == "stop"
    # The snapshot links the stopping victim to its claimant, and the claimant to the node.
    snap = take_snapshot(timezone.now())
    assert {j.id: j.claim_nodes for j in snap.queued} == {claimant.id: (node.id,)}
    assert {r.id: r.claimant_id for r in snap.running} == {borrowed.id: claimant.id}
    # A stopping job is expected to end by its stop deadline (it had no time limit).
    (stopping,) = snap.running
    victim_attempt.refresh_from_db()
    assert stopping.expected_end == victim_attempt.stop_deadline is not None
    assert stopping.frees_by == victim_attempt.stop_deadline  # killed then at the latest
    # A higher-priority job arrives while the victim checkpoints: it is ordered first.
    rival = submit(rival_team, rival_user, gpus=2, priority="high")
    run_pass()
    assert PreemptionRequest.objects.count() == 1  # nothing more stopped for either
    claimant.refresh_from_db()
    assert claimant.reason.startswith(f"waiting for job {borrowed.id} to checkpoint and stop")
    beat(node, victim_attempt, {0: 0, 1: 0}, records=[commit_checkpoint(root, borrowed, 5)])
    # Once the victim is gone the claim lasts a few ticks, then it is spent.
    later = take_snapshot(timezone.now() + timedelta(seconds=CLAIM_AFTER_EXIT_S + 1))
    assert all(j.claim_nodes == () for j in later.queued)
    run_pass()
    assert live_attempt(claimant).allocations.count() == 2
    rival.refresh_from_db()
    assert rival.state == "QUEUED"


@pytest.mark.django_db
def test_priority_preemption_waits_for_an_admin_who_may_reject_it(two_teams, make_user):
    (owner, olga), (guest, gus), node, root = two_teams
    low = submit(owner, olga, gpus=2, priority="low")
    run_pass()
    beat(node, live_attempt(low), {0: None, 1: None})
    past_protection()
    urgent = submit(owner, olga, gpus=2, priority="urgent")
    Job.objects.filter(pk=urgent.pk).update(submitted_at=timezone.now())
    owner.quota = 4
    owner.save()
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    assert (request.kind, request.state) == ("priority", "proposed")
    assert live_attempt(low).state != "stopping"
    member, admin = APIClient(), APIClient()
    member.force_authenticate(olga)
    admin.force_authenticate(make_user("root", staff=True))
    listed = member.get("/api/v1/preemptions/").json()["results"]
    assert [p["id"] for p in listed] == [request.id]
    assert member.post(f"/api/v1/preemptions/{request.id}/approve/").status_code == 403
    rejected = admin.post(f"/api/v1/preemptions/{request.id}/reject/")
    assert rejected.status_code == 200 and rejected.json()["state"] == "rejected"
    assert admin.post(f"/api/v1/preemptions/{request.id}/approve/").status_code == 409
    assert live_attempt(low).state == "running" or live_attempt(low).state == "starting"


def _proposed_in_team(two_teams):
    """The owner's low-priority job runs on the node (past its minimum run) and its own
    high-priority job proposes to preempt it: (the low job, the open request)."""
    (owner, olga), _, node, _ = two_teams
    owner.quota = 4
    owner.save()
    low = submit(owner, olga, gpus=2, priority="low")
    run_pass()
    beat(node, live_attempt(low), {0: None, 1: None})
    past_protection()
    high = submit(owner, olga, gpus=2, priority="high")
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    return low, high, request


@pytest.mark.django_db
def test_priority_preemption_approves_itself_at_its_deadline(two_teams):
    _, _, node, _ = two_teams
    low, _, request = _proposed_in_team(two_teams)
    run_pass(now=timezone.now() + timedelta(seconds=60))
    request.refresh_from_db()
    assert request.state == "proposed"
    later = timezone.now() + timedelta(seconds=121)
    beat(node, live_attempt(low), {0: None, 1: None}, now=later)
    run_pass(now=later)
    request.refresh_from_db()
    assert request.state == "executed" and request.decided_by is None
    assert live_attempt(low).state == "stopping"
    assert Event.objects.filter(
        kind="preemption.approved", message__contains="approval deadline passed"
    ).exists()


@pytest.mark.django_db
def test_a_starving_job_stops_its_own_teams_long_job_at_once_and_runs(two_teams):
    """Scheduling rule 4's starvation claim, live: the guest's 2-minute job has waited over
    six times its stretch floor (10 min) behind the guest's own 2-hour job on the only node.
    The long job is stopped at once (no admin: the guest stays at or above its quota of 0),
    checkpoints, and is requeued without pausing the guest's borrowing; the short job runs."""
    _, (guest, gus), node, root = two_teams
    guest.borrow_limit = 4
    guest.save()
    long_job = submit(guest, gus, gpus=2, time_limit_s=7200)
    run_pass()
    attempt = live_attempt(long_job)
    # Saved a moment ago: stopping it costs little, so the claim pays (protection.pays).
    beat(node, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, long_job, 10)])
    now = timezone.now()
    attempt.created_at = now - timedelta(seconds=3600)  # past its minimum run
    attempt.save(update_fields=["created_at"])
    short = submit(guest, gus, gpus=2, time_limit_s=120)
    Job.objects.filter(pk=short.pk).update(submitted_at=now - timedelta(seconds=3000))
    run_pass()
    assert not PreemptionRequest.objects.exists()  # 5 times its length: it only waits
    Job.objects.filter(pk=short.pk).update(submitted_at=now - timedelta(seconds=3700))
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    assert (request.kind, request.state, request.victim, request.claimant) == (
        "starvation",
        "executed",
        long_job,
        short,
    )
    assert request.auto_approve_at is None and request.decided_by is None
    assert Event.objects.filter(
        kind="preemption.approved", message__contains="automatic (starvation)"
    ).exists()
    short.refresh_from_db()
    assert short.reason.startswith(
        f"waiting for job {long_job.id} to checkpoint and stop (it has waited 6 times its length)"
    )
    _stop_and_exit(node, attempt, root)
    run_pass()
    assert live_attempt(short).allocations.count() == 2
    long_job.refresh_from_db()
    assert long_job.state == "QUEUED" and "borrowing paused" not in long_job.reason
    # The periodic save, then the one its stop made (kept by retention).
    assert [c.preemption for c in long_job.checkpoints.order_by("step")] == [False, True]


def _executed_earlier(victim, claimant, at):
    """A reclaim of `victim` carried out at `at` (the safety stop counts these)."""
    PreemptionRequest.objects.create(
        victim=victim,
        claimant=claimant,
        kind="reclaim",
        state="executed",
        reason="earlier",
        created_at=at,
        executed_at=at,
    )


@pytest.mark.django_db
def test_the_live_safety_stop_refuses_a_looping_preemption_and_alerts_admins_once(
    two_teams, settings
):
    """A job stopped PREEMPT_MAX_PER_DAY times within a day is not preempted again, whatever
    a planner proposes; the first refusal writes an alert Event, later ones do not repeat it.
    Its job page and API show the protection and the count."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "PREEMPT_MAX_PER_DAY": 2}
    (owner, olga), (guest, gus), node, root = two_teams
    borrowed = submit(guest, gus, gpus=2)
    run_pass()
    beat(node, live_attempt(borrowed), {0: None, 1: None})
    claimant = submit(owner, olga, gpus=2)
    now = timezone.now()
    for hours_ago in (5, 3):  # two executed preemptions today
        _executed_earlier(borrowed, claimant, now - timedelta(hours=hours_ago))
    for _ in range(2):
        refused = preemption_actions.do_propose_preemption(
            victim_id=borrowed.id, claimant_id=claimant.id, kind="reclaim", reason="x", now=now
        )
        assert refused is None
    assert live_attempt(borrowed).state == "running"
    (alert,) = Event.objects.filter(kind="preemption.safety_stop")
    assert alert.job_id == borrowed.id and "preempted 2 times within a day" in alert.message
    assert alert.data == {"preemptions": 2, "limit": 2}
    # The policy sees the count too: the pass proposes nothing for the owner's job.
    snapshot = take_snapshot(now)
    assert [r.preemptions for r in snapshot.running] == [2]
    run_pass()
    assert not PreemptionRequest.objects.filter(state__in=["proposed", "approved"]).exists()
    client = APIClient()
    client.force_authenticate(gus)
    shown = client.get(f"/api/v1/jobs/{borrowed.id}/").json()["protection"]
    assert shown["preemptions_today"] == 2 and shown["safety_stop"] == 2
    assert shown["protected"] is True  # it started a moment ago: start-up + its floor
    # A day later the count is spent: it may be reclaimed again.
    later = now + timedelta(hours=22)
    assert take_snapshot(later).running[0].preemptions == 0


@pytest.mark.django_db
def test_the_console_queue_shows_the_safety_stops_alert_to_admins(two_teams, make_user, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "PREEMPT_MAX_PER_DAY": 1}
    (owner, olga), (guest, gus), node, root = two_teams
    borrowed = submit(guest, gus, gpus=2)
    run_pass()
    claimant = submit(owner, olga, gpus=2)
    now = timezone.now()
    _executed_earlier(borrowed, claimant, now - timedelta(hours=1))
    assert (
        preemption_actions.do_propose_preemption(
            victim_id=borrowed.id, claimant_id=claimant.id, kind="reclaim", reason="x", now=now
        )
        is None
    )
    client = Client()
    client.force_login(make_user("root", staff=True))
    html = client.get("/console/queue/").content.decode()
    alerts = html.split('id="scheduler-alerts"')[1].split("</div>")[0]
    assert f"job {borrowed.id}" in alerts and "preemption loop" in alerts


@pytest.mark.django_db
def test_a_filler_runs_on_a_reservations_draining_node_and_is_stopped_for_it(
    make_team, make_user, make_nodes, settings, tmp_path
):
    """Scheduling rule 4's fillers end to end on the database: the applier records the
    filler, the reader gives it back to the policy, which stops it checkpoint-first for the
    reservation's holder once the rest of the node has drained; it is a filler once a day."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "CHECKPOINT_ROOT": str(tmp_path / "ckpt")}
    team = make_team("solo", quota=8)
    user = make_user("sol", team=team)
    (node,) = make_nodes(1, 4)
    first = submit(team, user, gpus=2, time_limit_s=3600)
    run_pass()
    beat(node, live_attempt(first), {0: None, 1: None})
    head = submit(team, user, gpus=4, time_limit_s=600)
    filler = submit(team, user, gpus=2, time_limit_s=7200, checkpoint_interval_s=1200)
    run_pass()
    head.refresh_from_db()
    assert head.wait["code"] == "reserved"
    filler_attempt = live_attempt(filler)
    assert filler_attempt.filler is True
    assert take_snapshot(timezone.now()).running[-1].filler is True
    beat(node, filler_attempt, {0: None, 1: None})
    page = Client()
    page.force_login(user)
    assert "runs as a filler" in page.get(f"/jobs/{filler.id}/").content.decode()
    assert "runs as a filler" not in page.get(f"/jobs/{first.id}/").content.decode()
    # The first job ends; the filler is past its minimum run: the head takes the node back.
    beat(node, live_attempt(first), {0: 0, 1: 0})
    run_pass()
    assert not PreemptionRequest.objects.exists()  # still within its minimum run
    past_protection(1500)  # its minimum run: 120 s start-up + 1,200 s interval
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    assert (request.kind, request.state, request.victim, request.claimant) == (
        "backfill",
        "executed",
        filler,
        head,
    )
    _stop_and_exit(node, filler_attempt, tmp_path / "ckpt")
    run_pass()
    assert live_attempt(head).allocations.count() == 4
    (queued,) = take_snapshot(timezone.now()).queued
    assert (queued.id, queued.filled) == (filler.id, True)
    # Its minimum run, should it start again: the assumed start-up (120 s) and its interval.
    assert queued.min_run_s == 120 + 1200


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["admin", "deadline"])
def test_a_job_cancelled_while_its_preemption_waits_is_not_requeued_by_the_approval(
    two_teams, make_user, how
):
    """The proposal outlived its victim: approved by an admin, or by its deadline, while the
    cancelled job checkpointed and stopped, it used to set the job PREEMPTING, and the job's
    exit then requeued it and it ran again."""
    (owner, olga), _, node, _ = two_teams
    low, _, request = _proposed_in_team(two_teams)
    attempt = live_attempt(low)
    do_cancel_job(low, actor=olga, now=timezone.now())
    request.refresh_from_db()
    assert request.state == "withdrawn"  # the cancel withdraws what it made moot
    PreemptionRequest.objects.filter(pk=request.pk).update(state="proposed")  # a race's leftover
    if how == "admin":
        root = make_user("root", staff=True)
        preemption_actions.do_decide_preemption(
            request, approve=True, actor=root, now=timezone.now()
        )
    else:
        later = timezone.now() + timedelta(seconds=121)
        beat(node, attempt, {0: None, 1: None}, now=later)
        run_pass(now=later)
    request.refresh_from_db()
    assert request.state == "withdrawn" and request.executed_at is None
    assert Event.objects.filter(
        kind="preemption.withdrawn", message__contains=f"job {low.id} no longer runs (cancelled)"
    ).exists()
    beat(node, attempt, {0: 0, 1: 0})
    low.refresh_from_db()
    assert low.state == "CANCELLED" and low.reason.startswith("cancelled by olga")


@pytest.mark.django_db
def test_a_cross_team_preemption_whose_victim_is_guaranteed_again_is_withdrawn(
    two_teams, make_team, make_user
):
    """Invariant 6 at execution: a priority preemption takes only another team's borrowed
    work, and its approval may come minutes after the plan. If the victim's team is within
    its quota by then, the request is withdrawn and the victim runs on."""
    (owner, _), (guest, gus), node, _ = two_teams
    rival = make_team("rival", quota=0, borrow_limit=2)
    low = submit(guest, gus, gpus=2, priority="low")
    run_pass()
    attempt = live_attempt(low)
    beat(node, attempt, {0: None, 1: None})
    past_protection()
    owner.quota = 0  # nobody is owed these GPUs: only a priority preemption could take them
    owner.save()
    submit(rival, make_user("rita", team=rival), gpus=2, priority="urgent")
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    assert (request.kind, request.state) == ("priority", "proposed")
    guest.quota = 2  # the guest's 2 GPUs are its quota now: guaranteed
    guest.save()
    root = make_user("root", staff=True)
    preemption_actions.do_decide_preemption(request, approve=True, actor=root, now=timezone.now())
    request.refresh_from_db()
    assert request.state == "withdrawn"
    assert "team guest is within its quota again (2 of 2 GPUs)" in (
        Event.objects.get(kind="preemption.withdrawn").message
    )
    assert live_attempt(low).state == "running"
    low.refresh_from_db()
    assert low.state == "RUNNING"


@pytest.mark.django_db
def test_withdrawing_a_stale_proposal_never_overwrites_an_executed_one(two_teams):
    _, high, request = _proposed_in_team(two_teams)
    # An admin's approval committed between the stale-proposal query and its update.
    PreemptionRequest.objects.filter(pk=request.pk).update(state="executed")
    assert not preemption_actions._withdraw(request, why="test", now=timezone.now())
    Job.objects.filter(pk=high.pk).update(state="CANCELLED")
    preemption_actions.do_withdraw_stale_preemptions(now=timezone.now())
    request.refresh_from_db()
    assert request.state == "executed"
    assert not Event.objects.filter(kind="preemption.withdrawn").exists()


@pytest.mark.django_db
def test_a_priority_preemption_for_a_job_within_its_quota_is_carried_out_on_approval(
    two_teams, make_user
):
    """The re-check withdraws only what invariant 6 forbids: a claimant within its own quota
    borrows nothing, and (quotas overcommitted: 2 + 2 on 2 GPUs) may take another team's
    lower-priority work that is within that team's quota."""
    (owner, olga), (guest, gus), node, _ = two_teams
    guest.quota = 2
    guest.save()
    low = submit(guest, gus, gpus=2, priority="low")
    run_pass()
    beat(node, live_attempt(low), {0: None, 1: None})
    past_protection()
    submit(owner, olga, gpus=2, priority="urgent")
    run_pass()
    (request,) = PreemptionRequest.objects.all()
    assert (request.kind, request.state) == ("priority", "proposed")
    root = make_user("root", staff=True)
    preemption_actions.do_decide_preemption(request, approve=True, actor=root, now=timezone.now())
    request.refresh_from_db()
    assert request.state == "executed"
    assert live_attempt(low).state == "stopping"
