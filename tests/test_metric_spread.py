"""A wide job's charts (jobs/metrics_spread.py): the band across every rank is each bucket's
true lowest and highest value, from the raw points or from the rollup alike; the lines drawn
are rank 0 and the ranks farthest from the rest (a straggler is among them); the GPU history
of a wide job is the band plus a few ranks, not every rank; bad parameters are refused."""

import random
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import metrics_spread, rollup
from jobs.metrics_query import metric_series
from jobs.metrics_spread import gpu_spread, metric_spread, pick_ranks
from jobs.models import Allocation, Attempt, GpuSample, MetricPoint
from tests.heartbeats import submit

WORLD = 80  # wider than LIVE_RANKS_MAX (64): ranks other than 0 keep the coarse rollup only
SLOW = 37  # the straggler


def _wide_job(team, user, *, steps: int, ranks: int = WORLD, seed: int = 3):
    cache.clear()  # a rolled-back test's job id comes again: no answer shared from it
    job = submit(team, user, gpus=ranks)
    attempt = Attempt.objects.create(
        job=job,
        number=1,
        state="running",
        master_addr="127.0.0.1",
        master_port=29400,
        created_at=timezone.now() - timedelta(minutes=5),
        running_at=timezone.now() - timedelta(minutes=5),
    )
    rng = random.Random(seed)
    now = timezone.now()
    points = []
    for rank in range(ranks):
        for step in range(1, steps + 1):
            value = 1.0 + rng.gauss(0, 0.02)
            if rank == SLOW and step > steps // 2:
                value += 0.5  # slower for the second half of the run
            if rank == 11 and step == steps // 3:
                value = 9.0  # one spike of one rank the band must keep
            points.append(
                MetricPoint(
                    job=job,
                    attempt=attempt,
                    rank=rank,
                    step=step,
                    name="step_time_s",
                    value=value,
                    time=now,
                )
            )
    for i in range(0, len(points), 5000):
        with transaction.atomic():
            batch = MetricPoint.objects.bulk_create(points[i : i + 5000])
            rollup.record(job.id, batch, world=ranks)
    return job, attempt, points


def _true_band(points, width, origin):
    """Per bucket of `width` steps from `origin`: (first step, lowest, highest) of any rank."""
    out: dict[int, list] = {}
    for p in points:
        b = (p.step - origin) // width
        row = out.setdefault(b, [p.step, p.value, p.value])
        row[0] = min(row[0], p.step)
        row[1] = min(row[1], p.value)
        row[2] = max(row[2], p.value)
    return [tuple(out[b]) for b in sorted(out)]


def test_pick_ranks_takes_rank_0_and_the_farthest_either_side():
    means = {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.1, 4: -2.0, 5: 0.9}
    assert pick_ranks(means, 3) == [0, 2, 4]  # 4 is 3 below the median, 2 is 2 above
    assert pick_ranks(means, 1) == [0]
    assert pick_ranks({1: 1.0, 2: 1.1, 3: 5.0}, 1) == [3]  # no rank 0 in the range
    assert pick_ranks({}, 4) == []


@pytest.mark.django_db
def test_the_band_is_every_ranks_lowest_and_highest_and_the_straggler_is_drawn(setup):
    team, user, _, _ = setup
    job, _, points = _wide_job(team, user, steps=300)
    got = metric_spread(job.id, "step_time_s", lines=4)
    spread = got["spread"]
    assert spread["ranks"] == WORLD
    want = _true_band(points, spread["bucket_steps"], 1)
    assert list(zip(spread["step"], spread["low"], spread["high"], strict=True)) == want
    assert 9.0 in spread["high"], "one rank's spike survives in the band"
    # Rank 0 and three others, the straggler first among them, each exact (300 points fit).
    assert list(got["ranks"]) == sorted(got["ranks"], key=int) and len(got["ranks"]) == 4
    assert "0" in got["ranks"] and str(SLOW) in got["ranks"]
    assert got["lines"]["0"] == "rank 0" and got["lines"][str(SLOW)] == "above"
    slow = [p.value for p in points if p.rank == SLOW]
    assert got["ranks"][str(SLOW)]["value"] == slow
    assert got["downsampled"][str(SLOW)] is False
    # Zoomed to the first half, before it slowed down: the band is that range's only.
    early = metric_spread(job.id, "step_time_s", lines=4, since_step=0, until_step=90)
    assert early["spread"]["step"][0] == 1 and early["spread"]["step"][-1] <= 90
    assert max(early["spread"]["high"]) < 1.5
    assert max(early["ranks"][str(r)]["step"][-1] for r in early["ranks"]) == 90


def _band_over(points, edges):
    """(first step, lowest, highest) of every rank's points per span [edges[i], edges[i+1])."""
    out = []
    for a, b in zip(edges, edges[1:], strict=False):
        inside = [p for p in points if a <= p.step < b]
        if inside:
            values = [p.value for p in inside]
            out.append((min(p.step for p in inside), min(values), max(values)))
    return out


@pytest.mark.django_db
def test_past_its_raw_budget_the_band_reads_the_rollup_for_all_but_recent_steps(setup, monkeypatch):
    team, user, _, _ = setup
    job, _, points = _wide_job(team, user, steps=2048, ranks=3)
    # Four band buckets of 512 steps; at most 500 raw points: 3 ranks x the last 167 steps,
    # from the rollup bucket's edge before them (step 1792) on.
    monkeypatch.setattr(metrics_spread, "BAND_BUCKETS", 4)
    monkeypatch.setattr(metrics_spread, "BAND_RAW_ROWS", 500)
    got = metric_spread(job.id, "step_time_s", lines=2)["spread"]
    assert got["bucket_steps"] == 512 and got["raw_from_step"] == 1792
    want = _band_over(points, [0, 512, 1024, 1536, 1792, 2049])
    assert list(zip(got["step"], got["low"], got["high"], strict=True)) == want
    # A few ranks read together are what each rank read alone gives, from the rollup too.
    for max_points in (8, 2000):
        together = metric_series(job.id, "step_time_s", max_points=max_points, ranks=[0, 2])
        assert list(together["ranks"]) == ["0", "2"]
        for r in (0, 2):
            alone = metric_series(job.id, "step_time_s", max_points=max_points, rank=r)
            assert together["ranks"][str(r)] == alone["ranks"][str(r)], (max_points, r)
            assert together["downsampled"][str(r)] == alone["downsampled"][str(r)]
    # Once the raw points of ranks other than 0 are gone (retention), the rollup still has
    # every rank's older steps.
    MetricPoint.objects.filter(job=job).exclude(rank=0).delete()
    cache.clear()  # the whole run's answer is shared for a few seconds
    kept = metric_spread(job.id, "step_time_s", lines=2)["spread"]
    assert kept["raw_from_step"] == 1536
    assert list(zip(kept["step"], kept["low"], kept["high"], strict=True))[:3] == want[:3]
    # Zoomed: the rollup bucket the range starts in, then the recent raw points.
    zoomed = metric_spread(job.id, "step_time_s", lines=2, since_step=600, until_step=1400)
    spread = zoomed["spread"]
    assert spread["raw_from_step"] == 768 and spread["step"][0] == 512
    assert (spread["low"][0], spread["high"][0]) == _band_over(points, [512, 768])[0][1:]


@pytest.mark.django_db
def test_the_whole_run_answer_is_shared_by_every_watcher_for_a_few_seconds(setup):
    team, user, _, _ = setup
    job, _, _ = _wide_job(team, user, steps=20, ranks=70)
    cache.clear()
    first = metric_spread(job.id, "step_time_s", lines=3)
    with CaptureQueriesContext(connection) as queries:
        again = metric_spread(job.id, "step_time_s", lines=3)
    assert again == first and len(queries) == 0
    with CaptureQueriesContext(connection) as queries:  # a zoom is the viewer's own
        metric_spread(job.id, "step_time_s", lines=3, since_step=5, until_step=10)
    assert len(queries) > 0


@pytest.mark.django_db
def test_a_wide_jobs_gpu_history_is_a_band_and_a_few_ranks(setup, make_nodes):
    team, user, _, _ = setup
    job, attempt, _ = _wide_job(team, user, steps=2, ranks=16)
    node = make_nodes(1, 16, prefix="wide")[0]
    for rank, gpu in enumerate(node.gpus.order_by("index")):
        Allocation.objects.create(
            attempt=attempt,
            node=node,
            gpu=gpu,
            rank=rank,
            local_rank=rank,
            group_rank=0,
            claimed_at=timezone.now(),
        )
    t0 = (int(timezone.now().timestamp()) - 600) // 60 * 60
    GpuSample.objects.bulk_create(
        GpuSample(
            job=job,
            attempt=attempt,
            rank=rank,
            t=t0 + 10 * i,
            util=20.0 if rank == 5 else 90.0 + rank % 3,
            mem_used=1 << 30,
            mem_total=80 << 30,
        )
        for rank in range(16)
        for i in range(60)
    )
    got = gpu_spread(job.id, lines=3, max_points=30)
    drawn = {s["rank"] for s in got["series"]}
    assert len(drawn) == 3 and {0, 5} <= drawn, drawn  # rank 5 idles at 20 %
    band = got["spread"]
    assert band["ranks"] == 16 and min(band["low"]) == 20.0 and max(band["high"]) == 92.0
    assert len(band["t"]) <= 31 and got["bucket_s"] == band["t"][1] - band["t"][0]


@pytest.mark.django_db
def test_the_api_answers_lines_and_refuses_bad_ones(setup, client):
    team, user, _, _ = setup
    job, _, _ = _wide_job(team, user, steps=50, ranks=70)
    client.force_login(user)
    url = f"/api/v1/jobs/{job.id}/metrics/?name=step_time_s&lines=5"
    body = client.get(url).json()
    assert len(body["ranks"]) == 5 and body["spread"]["ranks"] == 70
    for bad, field in (("lines=0", "lines"), ("lines=65", "lines"), ("lines=x", "lines"),
                       ("lines=3&rank=2", "lines")):  # fmt: skip
        answer = client.get(f"/api/v1/jobs/{job.id}/metrics/?name=step_time_s&{bad}")
        assert answer.status_code == 400 and field in answer.json(), bad
    answer = client.get(f"/api/v1/jobs/{job.id}/gpus/history/?lines=3&since=5")
    assert answer.status_code == 400 and "lines" in answer.json()
    assert client.get(f"/api/v1/jobs/{job.id}/gpus/history/?lines=3").json()["spread"] is None
    # Another team's user sees none of it.
    from teams.actions import do_add_member, do_create_team

    other = do_create_team("other", quota=1)
    stranger = user.__class__.objects.create_user(username="eve", password="pw-123456789")
    do_add_member(other, stranger)
    client.force_login(stranger)
    assert client.get(url).status_code == 404
