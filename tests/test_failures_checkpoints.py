"""What a failure costs and what bounds it (DESIGN.md section 8), through the real actions
and scheduler pass: which checkpoint reports are taken, a committed checkpoint recovered from
disk after its report was lost, retention (the last K, registered and preemption checkpoints
kept; prunes queued once and run in the rq worker's own process), the Young/Daly interval,
and goodput per job and per team (the teams API, where only admins change quotas)."""

import os
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import actions, queries
from jobs.checkpoint_policy import checkpoint_advice
from jobs.health import young_daly_interval
from jobs.models import Attempt, Checkpoint, Event, Job
from jobs.reports.goodput import job_goodput
from jobs.scheduling.loop import run_pass
from jobs.tasks import prune_checkpoints
from tests.failures_helpers import _run, _steps
from tests.heartbeats import beat, commit_checkpoint, live_attempt, submit


def test_young_daly():
    assert young_daly_interval(10.0, 3600.0) == pytest.approx(268.3, abs=0.1)


@pytest.mark.django_db
def test_checkpoint_records_outside_the_jobs_own_directory_are_ignored(setup):
    job, attempt, a, b, root = _run(setup)
    other = submit(setup[0], setup[1])
    outside = root.parent / "elsewhere"
    records = []
    for path in (
        root / f"job-{other.id}" / "step-000010",  # another job's committed save
        root / f"job-{job.id}" / ".." / f"job-{other.id}" / "step-000010",  # climbing out
        outside / "step-000010",  # outside the checkpoint root
        root / f"job-{job.id}-x" / "step-000010",  # a sibling whose name starts the same
    ):
        path.mkdir(parents=True, exist_ok=True)
        (path / "COMMITTED").write_text('{"step": 10}')
        records.append({"kind": "checkpoint", "rank": 0, "step": 10, "path": str(path)})
    link = root / f"job-{job.id}" / "step-000020"  # a link inside that points out
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / "step-000010")
    records.append({"kind": "checkpoint", "rank": 0, "step": 20, "path": str(link)})
    beat(a, attempt, {0: None, 1: None}, records=records)
    assert not Checkpoint.objects.exists()
    # The job's own committed save is taken.
    beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 30)])
    assert [c.step for c in Checkpoint.objects.all()] == [30]


@pytest.mark.django_db
def test_a_committed_checkpoint_whose_report_was_lost_with_its_node_is_resumed_from(setup):
    job, attempt, a, b, root = _run(setup)
    beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 20)])
    # Rank 0's node commits step 40, then goes silent before its agent reports it.
    unreported = root / f"job-{job.id}" / "attempt-1" / "step-000040"
    unreported.mkdir(parents=True)
    (unreported / "COMMITTED").write_text('{"step": 40, "world_size": 4}')
    actions.do_mark_node_lost(a, now=timezone.now(), reason="test")
    Job.objects.filter(pk=job.pk).update(restart_after=timezone.now())
    actions.do_heartbeat(a, {"boot_id": a.boot_id}, now=timezone.now())
    run_pass()
    second = live_attempt(job)
    assert second.resumed_from_step == 40
    assert Event.objects.filter(job=job, kind="checkpoint.recovered").count() == 1


@pytest.mark.django_db
def test_commits_while_a_prune_waits_queue_no_second_prune(
    setup, settings, django_capture_on_commit_callbacks
):
    import django_rq

    settings.LOCKSTEP = {**settings.LOCKSTEP, "KEEP_CHECKPOINTS": 1}
    job, attempt, a, b, root = _run(setup)
    queue = django_rq.get_queue()
    queue.empty()
    django_rq.get_connection().delete(f"lockstep:prune-pending:{job.id}")

    def prunes():
        return [j for j in queue.get_jobs() if j.args == (job.id,)]

    with django_capture_on_commit_callbacks(execute=True):
        beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 10)])
        beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 20)])
    assert len(prunes()) == 1
    # The waiting prune covers both commits once it runs (as the worker would).
    assert prunes()[0].perform() == [10]
    queue.empty()
    with django_capture_on_commit_callbacks(execute=True):
        beat(a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, 30)])
    assert len(prunes()) == 1  # a commit after the prune started queues the next one
    assert prunes()[0].perform() == [20]


def worker_pid_and_jobs(job_id: int) -> tuple[int, int]:
    """An rq job: the process it ran in, and what it reads from the database."""
    return os.getpid(), Job.objects.filter(pk=job_id).count()


@pytest.mark.django_db(transaction=True)
def test_the_rq_worker_prunes_in_its_own_process_and_forks_a_horse_for_other_jobs(setup, settings):
    import django_rq

    from jobs.worker import LockstepWorker

    settings.LOCKSTEP = {**settings.LOCKSTEP, "KEEP_CHECKPOINTS": 1}
    job, attempt, a, b, root = _run(setup)
    queue = django_rq.get_queue()
    django_rq.get_connection().delete(f"lockstep:prune-pending:{job.id}")
    before = set(queue.get_job_ids())
    beat(
        a, attempt, {0: None, 1: None}, records=[commit_checkpoint(root, job, s) for s in (10, 20)]
    )
    # Only this test's jobs are run (the queue's Redis may be shared with other test runs).
    (prune,) = [j for j in queue.get_jobs() if j.id not in before and j.args == (job.id,)]
    queue.remove(prune)
    other = queue.enqueue(worker_pid_and_jobs, job.id)
    queue.remove(other)

    class Recording(LockstepWorker):
        in_process = LockstepWorker.in_process | {
            worker_pid_and_jobs.__module__ + ".worker_pid_and_jobs"
        }

    worker = LockstepWorker([queue], connection=queue.connection)
    assert prune.timeout == 600
    # While a job runs in the worker process nothing renews rq's keys: they last the job.
    worker._running_in_process = True
    assert worker.get_heartbeat_ttl(prune) >= prune.timeout
    worker._running_in_process = False
    assert worker.get_heartbeat_ttl(prune) < prune.timeout  # a horse's monitor renews them
    worker.execute_job(prune, queue)
    assert prune.func_name in LockstepWorker.in_process
    assert prune.get_status(refresh=True) == "finished" and prune.return_value() == [10]
    assert not (root / f"job-{job.id}" / "step-000010").exists()
    assert (root / f"job-{job.id}" / "step-000020").exists()
    # No database socket is left open for the next horse to inherit, and it still gets one.
    from django.db import connections

    assert all(c.connection is None for c in connections.all(initialized_only=True))
    worker.execute_job(other, queue)
    assert other.get_status(refresh=True) == "finished", other.latest_result()
    forked_pid, seen = other.return_value()
    assert forked_pid != os.getpid() and seen == 1

    again = queue.enqueue(worker_pid_and_jobs, job.id)
    queue.remove(again)
    Recording([queue], connection=queue.connection).execute_job(again, queue)
    assert again.return_value() == (os.getpid(), 1)


@pytest.mark.django_db
def test_retention_keeps_the_last_k_registered_and_preemption_checkpoints(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "KEEP_CHECKPOINTS": 2}
    job, attempt, a, b, root = _run(setup)
    beat(
        a,
        attempt,
        {0: None, 1: None},
        records=[commit_checkpoint(root, job, s) for s in (10, 20, 30, 40, 50)],
    )
    by_step = {c.step: c for c in Checkpoint.objects.filter(job=job)}
    actions.do_register_model_version(
        name="m", checkpoint=by_step[10], actor=job.owner, now=timezone.now()
    )
    Checkpoint.objects.filter(pk=by_step[20].pk).update(preemption=True)
    assert sorted(prune_checkpoints(job.id)) == [30]
    assert not (root / f"job-{job.id}" / "step-000030").exists()
    for step in (10, 20, 40, 50):
        assert (root / f"job-{job.id}" / f"step-{step:06d}").exists()
    assert queries.latest_checkpoint(job.id).step == 50
    # A pruned checkpoint is gone from the API and cannot be registered.
    client = APIClient()
    client.force_authenticate(job.owner)
    listed = [c["step"] for c in client.get(f"/api/v1/jobs/{job.id}/checkpoints/").json()]
    assert listed == [50, 40, 20, 10]
    response = client.post(
        "/api/v1/models/", {"name": "x", "checkpoint": by_step[30].id}, format="json"
    )
    assert response.status_code == 400


@pytest.mark.django_db
def test_young_daly_interval_uses_the_jobs_save_stall_and_failure_rate(setup):
    job, attempt, a, b, root = _run(setup)
    record = commit_checkpoint(root, job, 10) | {"save_s": 2.0}
    beat(a, attempt, {0: None, 1: None}, records=[record])
    Attempt.objects.filter(pk=attempt.pk).update(
        running_at=timezone.now() - timedelta(seconds=3600)
    )
    beat(b, attempt, {2: 9, 3: None})
    advice = checkpoint_advice(job)
    assert (advice["save_stall_s"], advice["mtbf_source"], advice["source"]) == (
        2.0,
        "job",
        "Young/Daly",
    )
    assert advice["interval_s"] == round((2 * 2.0 * advice["mtbf_s"]) ** 0.5)
    # One failure in an hour is smoothed with one failure-free default MTBF (a day), so an
    # early failure cannot push the interval down to seconds.
    assert advice["mtbf_s"] == pytest.approx((3600 + 86400) / 2, abs=5)
    Job.objects.filter(pk=job.pk).update(checkpoint_interval_s=120)
    job.refresh_from_db()
    assert checkpoint_advice(job)["interval_s"] == 120


@pytest.mark.django_db
def test_the_suggested_interval_is_never_below_10_s_nor_20_save_stalls(setup, settings):
    from jobs import checkpoint_policy

    job, attempt, a, b, root = _run(setup)
    settings.LOCKSTEP = {**settings.LOCKSTEP, "DEFAULT_MTBF_S": 60.0}  # a failure a minute
    for stall, expected in ((0.15, 10), (2.0, 40)):
        record = commit_checkpoint(root, job, int(stall * 100)) | {"save_s": stall}
        Checkpoint.objects.filter(job=job).delete()
        beat(a, attempt, {0: None, 1: None}, records=[record])
        checkpoint_policy._fleet_cache["at"] = 0.0
        advice = checkpoint_advice(job)
        # Young/Daly alone would say sqrt(2 x stall x 60 s): 4.2 s and 15.5 s.
        assert advice["young_daly_s"] == expected and advice["interval_s"] == expected


@pytest.mark.django_db
def test_goodput_counts_lost_steps_and_detection_and_recovery_times(setup):
    job, attempt, a, b, root = _run(setup)
    t0 = timezone.now()
    beat(
        a,
        attempt,
        {0: None, 1: None},
        records=[*_steps(1, 10), commit_checkpoint(root, job, 8)],
        now=t0,
    )
    beat(a, attempt, {0: None, 1: None}, records=_steps(11, 20), now=t0 + timedelta(seconds=10))
    beat(b, attempt, {2: -9, 3: None}, now=t0 + timedelta(seconds=12))
    run_pass(now=t0 + timedelta(seconds=30))
    second = live_attempt(job)
    beat(a, second, {0: None, 1: None}, now=t0 + timedelta(seconds=31))
    beat(b, second, {2: None, 3: None}, now=t0 + timedelta(seconds=31))
    beat(a, second, {0: None, 1: None}, records=_steps(9, 30), now=t0 + timedelta(seconds=40))
    (incident,) = job_goodput(job, now=t0 + timedelta(seconds=40))["incidents"]
    assert incident["attempt"] == 1 and incident["lost_steps"] == 12  # steps 9..20 recomputed
    assert incident["recover_s"] == 28.0 and incident["detect_s"] == 0.0
    client = APIClient()
    client.force_authenticate(job.owner)
    body = client.get(f"/api/v1/jobs/{job.id}/").json()
    assert body["goodput"]["incidents"][0]["lost_steps"] == 12
    assert body["checkpoint_policy"]["source"] == "Young/Daly"


@pytest.mark.django_db
def test_teams_api_shows_usage_and_goodput_and_only_admins_change_quotas(setup, make_user):
    job, attempt, a, b, root = _run(setup)
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 10))
    member = APIClient()
    member.force_authenticate(job.owner)
    (team,) = member.get("/api/v1/teams/").json()["results"]
    assert (team["name"], team["quota"], team["used"]) == ("lab", 8, 4)
    assert team["goodput"]["jobs"] == 1 and team["goodput"]["wall_s"] >= 0
    assert (
        member.patch(f"/api/v1/teams/{team['id']}/", {"quota": 99}, format="json").status_code
        == 403
    )
    admin = APIClient()
    admin.force_authenticate(make_user("root", staff=True))
    bad = admin.patch(f"/api/v1/teams/{team['id']}/", {"quota": -1}, format="json")
    assert bad.status_code == 400 and "quota" in bad.json()
    ok = admin.patch(f"/api/v1/teams/{team['id']}/", {"quota": 12}, format="json")
    assert ok.status_code == 200 and ok.json()["quota"] == 12
    assert Event.objects.filter(kind="team.quota_changed").count() == 1
    stranger = APIClient()
    stranger.force_authenticate(make_user("nobody"))
    assert stranger.get(f"/api/v1/teams/{team['id']}/").status_code == 404


@pytest.mark.django_db
def test_goodput_places_every_second_of_the_wall_time(setup, make_recorded_job, client):
    """Where the time went: training, recomputed steps, each attempt's start-up and end, and
    the waits between attempts, after a failure or after a stop (a preemption, a planned
    restart, the platform stopped), which a bare percentage ("16 % of 1,449 s") hid. Three
    attempts of one step a second: lost at 130 s (20 steps after the checkpoint recomputed),
    preempted at 265 s, succeeded at 706 s after 335 s queued again."""
    team, user, _, _ = setup
    t0 = timezone.now() - timedelta(hours=1)
    at = lambda s: t0 + timedelta(seconds=s)  # noqa: E731
    job = make_recorded_job(
        team, user, submitted=t0, runs=[(at(0), at(130)), (at(150), at(265)), (at(600), at(706))]
    )
    # (state, first step, last step record, resumed from, last step) per attempt
    runs = [
        ("lost", 20, 119, 0, 100),
        ("preempted", 160, 259, 80, 180),
        ("succeeded", 605, 704, 180, 280),
    ]
    for attempt, (state, first, last, resumed, step) in zip(
        job.attempts.order_by("number"), runs, strict=True
    ):
        attempt.state, attempt.resumed_from_step, attempt.last_step = state, resumed, step
        attempt.first_step_at, attempt.last_progress_at = at(first), at(last)
        attempt.save()
    figures = job_goodput(job)
    uses = {use["key"]: use["seconds"] for use in figures["breakdown"]}
    assert figures["wall_s"] == 706.0
    assert uses == {
        "productive_s": 280.0,  # 80 + 100 + 100 steps kept
        "recomputed_s": 20.0,  # attempt 1's steps 81-100
        "starting_s": 32.0,  # launch to first step, less that step: 19 + 9 + 4
        "ending_s": 19.0,  # last step to the end: 11 + 6 + 2
        "after_failure_s": 20.0,
        "after_stop_s": 335.0,
        "other_s": 0.0,
    }
    assert sum(uses.values()) == figures["wall_s"]
    client.force_login(user)
    page = client.get(f"/jobs/{job.id}/").content.decode()
    assert 'id="time-uses"' in page and "waiting after stops 335s" in page
    assert "flex-grow:335.0" in page


@pytest.mark.django_db
def test_goodput_of_a_live_attempt_whose_first_progress_came_with_ten_steps(
    setup, make_recorded_job
):
    """The first progress arrives with a batch (ingest keeps its latest step as `first_step`):
    the steps before it took time that is training, not start-up. Launched at 0, first
    progress at 30 s with 10 steps done, 110 steps by 130 s (a step a second), asked at 131 s:
    20 s starting, 110 s training, the last second since the latest step."""
    team, user, _, _ = setup
    t0 = timezone.now() - timedelta(hours=1)
    at = lambda s: t0 + timedelta(seconds=s)  # noqa: E731
    job = make_recorded_job(team, user, submitted=t0, runs=[(at(0), None)])
    (attempt,) = job.attempts.all()
    attempt.first_step, attempt.first_step_at = 10, at(30)
    attempt.last_step, attempt.last_progress_at = 110, at(130)
    attempt.save()
    figures = job_goodput(job, now=at(131))
    uses = {use["key"]: use["seconds"] for use in figures["breakdown"]}
    assert figures["productive_s"] == 110.0 and figures["wall_s"] == 131.0
    assert uses["starting_s"] == 20.0 and uses["other_s"] == 1.0
    assert uses["ending_s"] == uses["after_stop_s"] == uses["after_failure_s"] == 0.0
