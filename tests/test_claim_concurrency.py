"""Invariants 1 and 2 under a real race: many claimers, separate database connections.

Runs on whatever database the suite uses: SQLite (WAL, IMMEDIATE) in `make test`, PostgreSQL
in the `.ci/run` leg with DATABASE_URL set.
"""

import random
import threading
from collections import Counter

import pytest
from django.db import connection, connections
from django.utils import timezone

from jobs import actions
from jobs.models import GPU, Allocation, Attempt
from jobs.scheduling.apply import apply_plan
from jobs.scheduling.vocab import Plan
from tests.claims import check_claim_invariants, placement_on

CLAIMERS = 8
ROUNDS = 25


@pytest.mark.django_db(transaction=True)
def test_concurrent_claimers_never_share_a_gpu_nor_split_a_gang(make_team, make_user, make_nodes):
    team = make_team("race", quota=10_000)
    owner = make_user("racer", team=team)
    make_nodes(4, 4, prefix="race")
    gpus = list(GPU.objects.all())
    rng = random.Random(7)
    totals = Counter()
    for round_no in range(ROUNDS):
        jobs = [
            actions.do_submit_job(
                owner=owner,
                team=team,
                now=timezone.now(),
                name=f"r{round_no}-{i}",
                image="x",
                command=["true"],
                gpus=rng.choice([2, 3, 4, 6, 8]),
            )
            for i in range(12)
        ]
        # Each claimer proposes its own gangs over the same 16 GPUs, overlapping heavily.
        plans = [
            Plan(
                placements=tuple(
                    placement_on(j, rng.sample(gpus, j.gpus)) for j in rng.sample(jobs, 6)
                )
            )
            for _ in range(CLAIMERS)
        ]
        barrier = threading.Barrier(CLAIMERS)
        errors: list[BaseException] = []
        results = []

        def claim(p: Plan, barrier=barrier, results=results, errors=errors) -> None:
            try:
                barrier.wait()
                results.append(apply_plan(p, now=timezone.now()))
            except BaseException as exc:  # any escape is a failure (a 500 in production)
                errors.append(exc)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=claim, args=(p,)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert len(results) == CLAIMERS
        check_claim_invariants()
        applied = sum(len(r.applied) for r in results)
        totals["applied"] += applied
        totals["rejected"] += sum(len(r.rejected) for r in results)
        assert applied >= 1, "no claimer won at all"
        # A job is claimed at most once even when several claimers proposed it.
        winners = Counter(job_id for r in results for job_id in r.applied)
        assert max(winners.values()) == 1
        for attempt in Attempt.objects.filter(ended_at__isnull=True):
            actions.do_end_attempt(
                attempt, state=Attempt.State.SUCCEEDED, reason="round over", now=timezone.now()
            )
        assert not Allocation.objects.filter(released_at__isnull=True).exists()
    # The race was real: many proposals lost to a concurrent claimer.
    assert totals["rejected"] > ROUNDS
    print(f"{connection.vendor}: {dict(totals)} over {ROUNDS} rounds x {CLAIMERS} claimers")
