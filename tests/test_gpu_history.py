"""GPU use kept per run: the nodes' heartbeat telemetry is kept per rank every GPU_SAMPLE_S
(`jobs.actions.heartbeat._sample_gpus`) and read back averaged into time buckets
(`GET /api/v1/jobs/{id}/gpus/history/`), so the job page charts GPU use over the whole run,
after it ended too, not only while someone watches."""

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import actions
from jobs.models import Attempt, GpuSample
from jobs.scheduling.loop import run_pass
from tests.heartbeats import beat, live_attempt, submit

GIB = 2**30


def _telemetry(utils: dict[int, float], mem_used: int = 3 * GIB) -> list[dict]:
    return [
        {"index": i, "kind": "cuda", "util": u, "mem_used": mem_used + i, "mem_total": 80 * GIB}
        for i, u in utils.items()
    ]


def _client(user, token_for):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    return client


@pytest.fixture
def spanning(setup, settings):
    """A 4-GPU job over both 2-GPU nodes, every rank started."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "GPU_SAMPLE_S": 10.0}
    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=4)
    run_pass()
    attempt = live_attempt(job)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, now=t0)
    beat(b, attempt, {2: None, 3: None}, now=t0)
    return job, attempt, a, b, t0


def _gpu_of(attempt, rank):
    allocation = attempt.allocations.select_related("node", "gpu").get(rank=rank)
    return allocation.node, allocation.gpu.index


@pytest.mark.django_db
def test_each_rank_keeps_its_own_gpus_reading_once_per_period(spanning):
    job, attempt, a, b, t0 = spanning
    GpuSample.objects.all().delete()  # the start beats carried no telemetry
    a.refresh_from_db()
    b.refresh_from_db()
    a.telemetry_sampled_at = b.telemetry_sampled_at = None
    a.save()
    b.save()
    utils = {a.id: {0: 91.0, 1: 42.5}, b.id: {0: 77.0, 1: 12.0}}
    for seconds in (1, 2, 5, 11, 12, 21.5):  # kept at 1, 11 and 21.5: every 10 s per node
        for node in (a, b):
            beat(
                node,
                attempt,
                {0: None, 1: None} if node == a else {2: None, 3: None},
                now=t0 + timedelta(seconds=seconds),
                telemetry=_telemetry(utils[node.id]),
            )
    samples = GpuSample.objects.filter(job=job)
    assert samples.count() == 3 * 4
    for rank in range(4):
        node, index = _gpu_of(attempt, rank)
        kept = samples.filter(rank=rank).order_by("t")
        assert [s.util for s in kept] == [utils[node.id][index]] * 3
        assert {s.mem_used for s in kept} == {3 * GIB + index}
        assert {s.mem_total for s in kept} == {80 * GIB}
        assert [s.t for s in kept] == [
            int((t0 + timedelta(seconds=x)).timestamp()) for x in (1, 11, 21.5)
        ]
        assert {s.attempt_id for s in kept} == {attempt.id}


@pytest.mark.django_db
def test_nothing_is_kept_for_ranks_not_started_or_attempts_ended(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "GPU_SAMPLE_S": 10.0}
    team, user, (a, _), _ = setup
    job = submit(team, user, gpus=2)
    run_pass()
    attempt = live_attempt(job)
    node = attempt.allocations.first().node
    # The agent reports no rank yet (still launching): nothing of this job is kept.
    actions.do_heartbeat(
        node,
        {"boot_id": node.boot_id, "telemetry": _telemetry({0: 50.0, 1: 50.0})},
        now=timezone.now(),
    )
    assert not GpuSample.objects.filter(job=job).exists()
    beat(
        node,
        attempt,
        {0: None, 1: None},
        now=timezone.now() + timedelta(seconds=11),
        telemetry=_telemetry({0: 50.0, 1: 50.0}),
    )
    assert GpuSample.objects.filter(job=job).count() == 2
    Attempt.objects.filter(pk=attempt.pk).update(ended_at=timezone.now(), state="failed")
    node.refresh_from_db()
    actions.do_heartbeat(
        node,
        {"boot_id": node.boot_id, "telemetry": _telemetry({0: 50.0, 1: 50.0})},
        now=timezone.now() + timedelta(seconds=30),
    )
    assert GpuSample.objects.filter(job=job).count() == 2


@pytest.mark.django_db
def test_readings_that_are_not_numbers_are_kept_as_missing(spanning):
    job, attempt, a, _, t0 = spanning
    telemetry = [
        # What JSON can carry (the API refuses NaN and Infinity): strings, booleans, numbers
        # out of range, nulls.
        {"index": 0, "util": "97", "mem_used": [1], "mem_total": True},
        {"index": 1, "util": None, "mem_used": 10**30, "mem_total": {"bytes": 1}},
    ]
    beat(a, attempt, {0: None, 1: None}, now=t0 + timedelta(seconds=30), telemetry=telemetry)
    kept = GpuSample.objects.filter(job=job, t=int((t0 + timedelta(seconds=30)).timestamp()))
    assert kept.count() == 2
    assert {(s.util, s.mem_used, s.mem_total) for s in kept} == {(None, None, None)}


def _samples(attempt, ranks, *, start, count, every, util):
    GpuSample.objects.bulk_create(
        GpuSample(
            job_id=attempt.job_id,
            attempt=attempt,
            rank=rank,
            t=start + i * every,
            util=util(rank, i),
            mem_used=GIB * (rank + 1),
            mem_total=80 * GIB,
        )
        for rank in ranks
        for i in range(count)
    )


@pytest.mark.django_db
def test_history_averages_each_ranks_readings_into_at_most_the_asked_buckets(spanning, token_for):
    job, attempt, *_ = spanning
    user = job.owner
    GpuSample.objects.all().delete()
    # 100 readings 10 s apart per rank, alternating between two levels 50 points apart.
    _samples(
        attempt,
        range(4),
        start=10_000,
        count=100,
        every=10,
        util=lambda rank, i: 10.0 * rank + (50.0 if i % 2 else 0.0),
    )
    answer = _client(user, token_for).get(f"/api/v1/jobs/{job.id}/gpus/history/?points=10")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["bucket_s"] == 100  # 991 s of readings in 10 buckets
    assert [(s["attempt"], s["rank"]) for s in body["series"]] == [(1, r) for r in range(4)]
    for series in body["series"]:
        node, index = _gpu_of(attempt, series["rank"])
        assert (series["node"], series["gpu"]) == (node.name, index)
        assert series["t"] == list(range(10_000, 11_000, 100))
        # Each bucket holds 5 readings of each level: its mean is half way.
        assert series["util"] == [10.0 * series["rank"] + 25.0] * 10
        assert series["mem_used"] == [GIB * (series["rank"] + 1)] * 10
        assert series["mem_total"] == 80 * GIB
    # Enough points asked: one per reading, at the sampling period.
    full = _client(user, token_for).get(f"/api/v1/jobs/{job.id}/gpus/history/?points=5000")
    assert full.json()["bucket_s"] == 10
    assert len(full.json()["series"][0]["util"]) == 100
    since = _client(user, token_for).get(
        f"/api/v1/jobs/{job.id}/gpus/history/?since=10500&points=5000"
    )
    assert since.json()["series"][0]["t"][0] == 10_500
    assert len(since.json()["series"][0]["t"]) == 50


@pytest.mark.django_db
def test_history_keeps_attempts_apart(spanning, token_for):
    job, attempt, *_ = spanning
    Attempt.objects.filter(pk=attempt.pk).update(ended_at=timezone.now(), state="failed")
    second = Attempt.objects.create(
        job=job,
        number=2,
        state="running",
        master_addr="127.0.0.1",
        master_port=29999,
        created_at=timezone.now(),
        running_at=timezone.now(),
    )
    GpuSample.objects.all().delete()
    _samples(attempt, [0], start=1000, count=3, every=10, util=lambda r, i: 90.0)
    _samples(second, [0], start=2000, count=3, every=10, util=lambda r, i: 30.0)
    body = _client(job.owner, token_for).get(f"/api/v1/jobs/{job.id}/gpus/history/").json()
    assert [(s["attempt"], s["util"]) for s in body["series"]] == [
        (1, [90.0, 90.0, 90.0]),
        (2, [30.0, 30.0, 30.0]),
    ]


@pytest.mark.django_db
def test_history_of_a_job_that_never_ran_is_empty(setup, token_for):
    team, user, _, _ = setup
    job = submit(team, user, gpus=64)  # never fits
    body = _client(user, token_for).get(f"/api/v1/jobs/{job.id}/gpus/history/").json()
    assert body == {"bucket_s": None, "series": []}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "query, field",
    [("points=0", "points"), ("points=x", "points"), ("since=-1", "since")],
)
def test_bad_history_parameters_are_refused_by_name(spanning, token_for, query, field):
    job, *_ = spanning
    answer = _client(job.owner, token_for).get(f"/api/v1/jobs/{job.id}/gpus/history/?{query}")
    assert answer.status_code == 400
    assert field in answer.json()


@pytest.mark.django_db
def test_another_teams_user_cannot_read_the_history(spanning, make_team, make_user, token_for):
    job, *_ = spanning
    stranger = make_user("bob", team=make_team("other"))
    answer = _client(stranger, token_for).get(f"/api/v1/jobs/{job.id}/gpus/history/")
    assert answer.status_code == 404
