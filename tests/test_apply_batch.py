"""The set-based applier: a pass of many gangs in a few queries, with the per-gang semantics of
the one-gang-per-savepoint applier it replaced (each gang whole or not at all, a gang that lost
a race rejected alone, the rest applied), and wait reasons written in bulk, only when changed,
never onto a job that left QUEUED. Runs on SQLite and on PostgreSQL (DATABASE_URL)."""

import math
import threading
from collections import Counter
from dataclasses import replace

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from jobs import actions
from jobs.actions import claim
from jobs.models import GPU, Allocation, Attempt, Event, Job, Node
from jobs.scheduling.apply import ReasonMemo, apply_plan
from jobs.scheduling.vocab import Placement, Plan
from tests.claims import check_claim_invariants, placement_on
from tests.heartbeats import submit


def _gangs(team, user, count: int, size: int = 2) -> tuple[list[Job], list[Placement]]:
    """`count` queued jobs of `size` GPUs, each placed on its own free GPUs, in GPU order."""
    free = list(GPU.objects.order_by("node_id", "index"))
    jobs = [submit(team, user, gpus=size) for _ in range(count)]
    placements = [placement_on(job, free[i * size : (i + 1) * size]) for i, job in enumerate(jobs)]
    return jobs, placements


@pytest.mark.django_db
def test_a_pass_of_many_gangs_starts_each_whole_with_its_event_and_its_own_port(
    make_team, make_user, make_nodes
):
    team = make_team("big", quota=1000)
    user = make_user("bo", team=team)
    make_nodes(10, 8)
    jobs, placements = _gangs(team, user, 40)
    result = apply_plan(Plan(placements=tuple(placements)), now=timezone.now())
    assert result.rejected == {}
    assert set(result.applied) == {j.id for j in jobs}
    check_claim_invariants()
    for job, placement in zip(jobs, placements, strict=True):
        job.refresh_from_db()
        attempt = Attempt.objects.get(job=job)
        assert result.applied[job.id] == attempt.id
        assert job.state == Job.State.STARTING and job.first_started_at is not None
        node = Node.objects.get(pk=placement.slots[0].node_id)
        indices = ",".join(str(s.index) for s in placement.slots)
        assert job.reason == f"attempt 1 starting on {node.name}[{indices}]; fresh start"
        assert (attempt.number, attempt.master_addr) == (1, node.address)
        assert sorted(attempt.allocations.values_list("gpu_id", "rank")) == sorted(
            (s.gpu_id, s.rank) for s in placement.slots
        )
        (event,) = Event.objects.filter(job=job, kind="attempt.started")
        assert (event.attempt_id, event.team_id, event.message) == (attempt.id, team.id, job.reason)
    # Every master is 127.0.0.1 here: 40 rendezvous on one address, 40 different ports.
    ports = list(Attempt.objects.values_list("master_port", flat=True))
    assert len(set(ports)) == len(ports) and 0 not in ports


def _queue_many(team, user, count: int) -> None:
    """`count` queued 1-GPU jobs, created in one statement."""
    now = timezone.now()
    Job.objects.bulk_create(
        Job(
            name=f"q{i}",
            team=team,
            owner=user,
            image="x",
            command=["true"],
            gpus=1,
            submitted_at=now,
            reason="queued",
        )
        for i in range(count)
    )


def _apply_counting(plan: Plan, **kwargs):
    with CaptureQueriesContext(connection) as ctx:
        result = apply_plan(plan, now=timezone.now(), **kwargs)
    return result, ctx.captured_queries


@pytest.mark.django_db
def test_queries_per_pass_do_not_grow_with_the_number_of_gangs(make_team, make_user, make_nodes):
    team = make_team("q", quota=1000)
    user = make_user("qa", team=team)
    make_nodes(14, 8)
    jobs, placements = _gangs(team, user, 55)
    r5, q5 = _apply_counting(Plan(placements=tuple(placements[:5])))
    r50, q50 = _apply_counting(Plan(placements=tuple(placements[5:])))
    assert len(r5.applied) == 5 and len(r50.applied) == 50
    # Ten times the gangs, not ten times the queries: a small constant per pass.
    assert len(q50) < len(q5) * 3, (len(q5), len(q50))
    assert len(q50) <= 30, [q["sql"][:80] for q in q50]
    check_claim_invariants()


@pytest.mark.django_db
def test_the_per_gang_path_costs_queries_per_gang(make_team, make_user, make_nodes):
    """The same bound fails for gang-by-gang application (chunk=1): the bound above means
    something."""
    team = make_team("pg", quota=1000)
    user = make_user("pa", team=team)
    make_nodes(8, 8)
    jobs, placements = _gangs(team, user, 25)
    r5, q5 = _apply_counting(Plan(placements=tuple(placements[:5])), chunk=1)
    r20, q20 = _apply_counting(Plan(placements=tuple(placements[5:])), chunk=1)
    assert len(r5.applied) == 5 and len(r20.applied) == 20
    assert len(q20) > len(q5) * 3


@pytest.mark.django_db
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_each_gang_that_fails_a_check_is_rejected_alone(chunk, make_team, make_user, make_nodes):
    """The same outcome gang by gang (chunk=1), in small batches and in one batch."""
    team = make_team("lab", quota=9)
    other = make_team("other", quota=100)
    user = make_user("li", team=team)
    make_nodes(4, 4)
    gpus = list(GPU.objects.order_by("node_id", "index"))  # 16 GPUs, 4 per node
    Node.objects.filter(name="node-3").update(state=Node.State.DOWN)  # gpus[12:16]
    ok1, on_down, claimed, ok2, held, twice_a, twice_b, ok3, over_cap = (
        submit(team, user, gpus=2) for _ in range(9)
    )
    # `claimed` was started by another scheduler; gpus[5] is held by another team's job.
    Job.objects.filter(pk=claimed.pk).update(state=Job.State.STARTING)
    holder = submit(other, user, gpus=1)
    holder_plan = Plan(placements=(placement_on(holder, [gpus[5]]),))
    assert holder.id in apply_plan(holder_plan, now=timezone.now()).applied
    placements = [
        placement_on(ok1, gpus[0:2]),
        placement_on(on_down, gpus[12:14]),
        placement_on(claimed, gpus[2:4]),
        placement_on(ok2, gpus[2:4]),
        placement_on(held, gpus[4:6]),
        placement_on(twice_a, gpus[6:8]),
        placement_on(twice_b, [gpus[7], gpus[8]]),  # gpus[7] is twice_a's, in the same plan
        placement_on(ok3, gpus[8:10]),
        placement_on(over_cap, gpus[10:12]),  # ok1, ok2, twice_a, ok3 hold 8 of the 9
    ]
    result = apply_plan(Plan(placements=tuple(placements)), now=timezone.now(), chunk=chunk)
    assert set(result.applied) == {ok1.id, ok2.id, twice_a.id, ok3.id}
    assert result.rejected[on_down.id] == "a node of the placement is no longer up"
    assert result.rejected[claimed.id] == f"job {claimed.id} is STARTING, not QUEUED"
    assert result.rejected[held.id] == f"claim lost a race: GPU {gpus[5].id} is held"
    # Given earlier in the same batch; held by then when twice_a went in an earlier batch.
    assert result.rejected[twice_b.id] == (
        f"GPU {gpus[7].id} is given to another job of the plan"
        if chunk == 1000
        else f"claim lost a race: GPU {gpus[7].id} is held"
    )
    assert result.rejected[over_cap.id] == "team lab would exceed 9 GPUs"
    assert len(result.rejected) == 5
    check_claim_invariants()
    for job in (on_down, held, twice_b, over_cap):
        job.refresh_from_db()
        assert job.state == Job.State.QUEUED and not job.attempts.exists()
        assert job.reason.startswith("placement rejected (") and "retrying next pass" in job.reason
    assert Job.objects.get(pk=claimed.pk).reason.startswith("queued")  # not QUEUED: untouched
    assert not Event.objects.filter(
        job__in=[on_down, held, twice_b, over_cap], kind="attempt.started"
    ).exists()


@pytest.mark.django_db
def test_a_gpu_taken_after_the_check_rolls_back_and_rejects_only_its_gang(
    make_team, make_user, make_nodes, monkeypatch
):
    """The check read the GPU as free, yet the allocation index refuses it (another scheduler
    committed it in between): the batch rolls back, is retried in halves, and only the gang
    holding that GPU is rejected; the other 31 start."""
    team = make_team("b", quota=1000)
    other = make_team("o", quota=1000)
    user = make_user("bi", team=team)
    make_nodes(8, 8)
    jobs, placements = _gangs(team, user, 32)
    loser = jobs[13]
    stolen = placements[13].slots[1].gpu_id
    thief = submit(other, user, gpus=1)
    apply_plan(
        Plan(placements=(placement_on(thief, [GPU.objects.get(pk=stolen)]),)), now=timezone.now()
    )
    assert Allocation.objects.filter(gpu_id=stolen, released_at__isnull=True).exists()
    monkeypatch.setattr(claim, "_held_gpus", lambda gpu_ids: set())  # a stale read
    result, queries = _apply_counting(Plan(placements=tuple(placements)))
    assert result.rejected == {loser.id: "claim lost a race: IntegrityError"}
    assert set(result.applied) == {j.id for j in jobs} - {loser.id}
    check_claim_invariants()
    loser.refresh_from_db()
    assert loser.state == Job.State.QUEUED and not loser.attempts.exists()
    assert "claim lost a race: IntegrityError" in loser.reason
    # Retried in halves, not gang by gang: about 2 log2(n) batches, not n.
    savepoints = [q for q in queries if q["sql"].startswith("SAVEPOINT")]
    # (+2: the pass's own two transactions, the gangs' and the wait reasons', are savepoints
    # inside the test's.)
    assert len(savepoints) <= 2 * math.ceil(math.log2(len(jobs))) + 3, len(savepoints)


@pytest.mark.django_db(transaction=True)
def test_a_gpu_claimed_by_another_connection_mid_pass_rejects_only_that_gang(
    make_team, make_user, make_nodes, monkeypatch
):
    """A real race: between this pass's check and its insert, another connection commits an
    allocation of one of the planned GPUs."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite serializes writers: no other connection commits during a pass")
    team = make_team("m", quota=1000)
    other = make_team("x", quota=1000)
    user = make_user("mo", team=team)
    make_nodes(6, 8)
    jobs, placements = _gangs(team, user, 20)
    loser = jobs[7]
    stolen = GPU.objects.get(pk=placements[7].slots[0].gpu_id)
    thief = submit(other, user, gpus=1)
    Job.objects.filter(pk=thief.pk).update(state=Job.State.STARTING)
    thief_attempt = Attempt.objects.create(
        job=thief, number=1, created_at=timezone.now(), master_addr="127.0.0.1", master_port=1
    )
    original = claim._held_gpus
    errors: list[BaseException] = []

    def steal() -> None:
        try:
            with transaction.atomic():
                Allocation.objects.create(
                    attempt=thief_attempt,
                    gpu=stolen,
                    node_id=stolen.node_id,
                    rank=0,
                    local_rank=0,
                    group_rank=0,
                    claimed_at=timezone.now(),
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def held_then_race(gpu_ids):
        held = original(gpu_ids)
        if not errors and not Allocation.objects.filter(attempt=thief_attempt).exists():
            thread = threading.Thread(target=steal)
            thread.start()
            thread.join(timeout=30)
            assert not thread.is_alive(), "the other connection was blocked by the pass"
        return held

    monkeypatch.setattr(claim, "_held_gpus", held_then_race)
    result = apply_plan(Plan(placements=tuple(placements)), now=timezone.now())
    assert not errors, errors
    # The batch's insert hit the index; retried in halves, the loser's check saw the GPU held.
    assert result.rejected == {loser.id: f"claim lost a race: GPU {stolen.id} is held"}
    assert set(result.applied) == {j.id for j in jobs} - {loser.id}
    check_claim_invariants()
    assert Allocation.objects.get(gpu=stolen, released_at__isnull=True).attempt_id == (
        thief_attempt.id
    )
    assert Job.objects.get(pk=loser.pk).state == Job.State.QUEUED


@pytest.mark.django_db(transaction=True)
def test_schedulers_of_different_teams_racing_for_the_same_gpus(make_team, make_user, make_nodes):
    """No team lock orders these claimers: only the allocation index and the retry in halves
    keep every gang whole and every GPU single."""
    import random

    teams = [make_team(f"t{i}", quota=1000) for i in range(4)]
    user = make_user("racer")
    make_nodes(3, 4, prefix="race")
    gpus = list(GPU.objects.all())
    rng = random.Random(3)
    totals = Counter()
    for _ in range(6):
        plans = []
        for team in teams:
            jobs = [submit(team, user, gpus=rng.choice([1, 2, 3, 4])) for _ in range(5)]
            plans.append(
                Plan(placements=tuple(placement_on(j, rng.sample(gpus, j.gpus)) for j in jobs))
            )
        barrier = threading.Barrier(len(plans))
        errors: list[BaseException] = []
        results = []

        def claim(p: Plan, barrier=barrier, results=results, errors=errors) -> None:
            try:
                barrier.wait()
                results.append(apply_plan(p, now=timezone.now()))
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=claim, args=(p,)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        check_claim_invariants()
        applied = sum(len(r.applied) for r in results)
        assert applied >= 1
        totals["applied"] += applied
        totals["rejected"] += sum(len(r.rejected) for r in results)
        for attempt in Attempt.objects.filter(ended_at__isnull=True):
            actions.do_end_attempt(
                attempt, state=Attempt.State.SUCCEEDED, reason="round over", now=timezone.now()
            )
        Job.objects.filter(state=Job.State.QUEUED).update(state=Job.State.CANCELLED)
    assert totals["rejected"] > 0
    print(f"{connection.vendor}: {dict(totals)}")


def _job_updates(queries) -> list[str]:
    return [q["sql"] for q in queries if q["sql"].startswith('UPDATE "jobs_job"')]


@pytest.mark.django_db
def test_reasons_are_written_only_when_changed_and_never_onto_a_job_that_left_queued(
    make_team, make_user, monkeypatch
):
    team = make_team("r", quota=8)
    user = make_user("ru", team=team)
    a, b, c = (submit(team, user, gpus=1) for _ in range(3))
    start = timezone.now().replace(microsecond=0)
    plan = Plan(placements=(), reasons={a.id: "waits for 1 GPU", b.id: "cap", c.id: "cap"})

    result, queries = _apply_counting(plan, estimates={a.id: start})
    assert result.reasons_written == 3 and len(_job_updates(queries)) == 1  # one statement
    a.refresh_from_db()
    assert a.reason == f"waits for 1 GPU; est. start {start:%Y-%m-%d %H:%M} UTC"
    assert a.estimated_start_at == start
    assert Job.objects.get(pk=b.pk).reason == "cap"

    # Nothing changed: nothing written, not even an empty UPDATE.
    result, queries = _apply_counting(plan, estimates={a.id: start})
    assert result.reasons_written == 0 and _job_updates(queries) == []

    # Only the estimate of one job changed: that row only.
    later = start.replace(year=start.year + 1)
    result, _ = _apply_counting(plan, estimates={a.id: later})
    assert result.reasons_written == 1
    assert Job.objects.get(pk=a.pk).estimated_start_at == later

    # A job that left QUEUED before the pass read it: not even considered.
    Job.objects.filter(pk=b.pk).update(state=Job.State.CANCELLED, reason="cancelled by ru")
    # One that leaves QUEUED between the read and the write (another transaction commits in
    # between): the UPDATE's own condition keeps its reason.
    from jobs.scheduling import apply

    real_bulk_set = apply.bulk_set

    def racing_bulk_set(model, fields, rows, **kwargs):
        Job.objects.filter(pk=c.pk).update(state=Job.State.STARTING, reason="attempt 1 starting")
        return real_bulk_set(model, fields, rows, **kwargs)

    monkeypatch.setattr(apply, "bulk_set", racing_bulk_set)
    moved = Plan(
        placements=(), reasons={a.id: "waits for 1 GPU", b.id: "new", c.id: "new", 10**9: "gone"}
    )
    result = apply_plan(moved, now=timezone.now(), estimates={a.id: later})
    assert result.reasons_written == 0  # c was sent but had left QUEUED; b was not sent
    assert Job.objects.get(pk=b.pk).reason == "cancelled by ru"
    assert Job.objects.get(pk=c.pk).reason == "attempt 1 starting"


def _job_reads(queries) -> list[str]:
    return [q["sql"] for q in queries if q["sql"].startswith('SELECT "jobs_job"."id"')]


@pytest.mark.django_db
def test_the_leaders_memo_spares_reading_back_unchanged_reasons_and_is_verified_in_time(
    make_team, make_user
):
    team = make_team("m", quota=8)
    user = make_user("mu2", team=team)
    a, b = (submit(team, user, gpus=1) for _ in range(2))
    plan = Plan(placements=(), reasons={a.id: "waits for 1 GPU", b.id: "cap"})
    memo = ReasonMemo()

    result, queries = _apply_counting(plan, memo=memo)
    assert result.reasons_written == 2 and len(_job_reads(queries)) == 1
    # The same reasons again: nothing read, nothing written (without the memo: one read).
    result, queries = _apply_counting(plan, memo=memo)
    assert result.reasons_written == 0 and _job_reads(queries) == []
    assert len(_job_reads(_apply_counting(plan)[1])) == 1
    # One job's reason changes: only that job is read and written.
    result, queries = _apply_counting(
        Plan(placements=(), reasons={a.id: "waits for 1 GPU", b.id: "cap 2"}), memo=memo
    )
    assert result.reasons_written == 1 and len(_job_reads(queries)) == 1
    assert Job.objects.get(pk=b.pk).reason == "cap 2"

    # Another writer changes a queued job's reason behind the memo's back: trusted until the
    # memo's age passes verify_s, then every row is read again and the reason put right.
    Job.objects.filter(pk=a.pk).update(reason="requeued after a failure")
    again = Plan(placements=(), reasons={a.id: "waits for 1 GPU", b.id: "cap 2"})
    assert apply_plan(again, now=timezone.now(), memo=memo).reasons_written == 0
    memo.since -= memo.verify_s
    assert apply_plan(again, now=timezone.now(), memo=memo).reasons_written == 1
    assert Job.objects.get(pk=a.pk).reason == "waits for 1 GPU"

    # A job no longer waiting is forgotten.
    apply_plan(Plan(placements=(), reasons={b.id: "cap 2"}), now=timezone.now(), memo=memo)
    assert set(memo.rows) == {b.id}


@pytest.mark.django_db
def test_reasons_for_thousands_of_jobs_in_a_few_statements(make_team, make_user):
    team = make_team("many", quota=8)
    user = make_user("mu", team=team)
    _queue_many(team, user, 2500)
    ids = list(Job.objects.values_list("id", flat=True))
    result, queries = _apply_counting(
        Plan(placements=(), reasons={i: f"position {n}" for n, i in enumerate(ids)})
    )
    assert result.reasons_written == 2500
    assert len(_job_updates(queries)) <= 6, len(_job_updates(queries))
    assert Job.objects.get(pk=ids[7]).reason == "position 7"


@pytest.mark.django_db
def test_a_database_error_in_one_gang_does_not_fail_the_pass(
    make_team, make_user, make_nodes, monkeypatch
):
    """Any error the database raises for one gang (here: two ranks numbered alike, refused by
    the rank_per_attempt index) rejects that gang only."""
    team = make_team("e", quota=100)
    user = make_user("eu", team=team)
    make_nodes(2, 8)
    jobs, placements = _gangs(team, user, 6)
    bad = placements[2]
    placements[2] = Placement(
        job_id=bad.job_id,
        team_id=bad.team_id,
        slots=(bad.slots[0], replace(bad.slots[1], rank=0)),
    )
    result = apply_plan(Plan(placements=tuple(placements)), now=timezone.now())
    assert result.rejected == {jobs[2].id: "claim lost a race: IntegrityError"}
    assert len(result.applied) == 5
    check_claim_invariants()


@pytest.mark.django_db
def test_a_job_that_moves_on_after_the_check_is_rejected_alone(
    make_team, make_user, make_nodes, monkeypatch
):
    """The conditional QUEUED -> STARTING update comes up short (a job changed after it was
    read): ClaimConflict, the batch is retried in halves, that job alone is rejected."""
    team = make_team("c", quota=100)
    user = make_user("cu", team=team)
    make_nodes(2, 8)
    jobs, placements = _gangs(team, user, 8)
    mover = jobs[5]
    original = claim._held_gpus

    def held_then_move(gpu_ids):
        Job.objects.filter(pk=mover.pk).update(state=Job.State.CANCELLED)
        return original(gpu_ids)

    monkeypatch.setattr(claim, "_held_gpus", held_then_move)
    result = apply_plan(Plan(placements=tuple(placements)), now=timezone.now())
    assert result.rejected == {mover.id: f"job {mover.id} is CANCELLED, not QUEUED"}
    assert len(result.applied) == 7
    assert not Attempt.objects.filter(job=mover).exists()
    check_claim_invariants()


@pytest.mark.django_db
def test_a_gang_of_an_isolated_only_team_on_a_process_node_is_rejected(
    make_team, make_user, make_nodes
):
    strict = make_team("strict", quota=8)
    strict.isolated_only = True
    strict.save()
    user = make_user("sam", team=strict)
    make_nodes(2, 4)  # process runtime, as an agent without an engine registers
    Node.objects.filter(name="node-1").update(runtime="container", engine="podman")
    on_process, on_container = submit(strict, user, gpus=2), submit(strict, user, gpus=2)
    process_gpus = list(GPU.objects.filter(node__name="node-0").order_by("index"))
    container_gpus = list(GPU.objects.filter(node__name="node-1").order_by("index"))
    plan = Plan(
        placements=(
            placement_on(on_process, process_gpus[:2]),
            placement_on(on_container, container_gpus[:2]),
        )
    )
    result = apply_plan(plan, now=timezone.now())
    assert set(result.applied) == {on_container.id}
    assert result.rejected[on_process.id] == (
        "team strict runs on isolated nodes only; a node is process-runtime"
    )
    assert not Allocation.objects.filter(attempt__job=on_process).exists()


@pytest.mark.django_db
def test_a_backlogs_reasons_are_written_head_first_within_the_budget_over_several_passes(
    make_team, make_user, make_nodes
):
    """With a write budget a pass writes whole batches of changed reasons in the queue's order
    (a gang it could not claim first) until the budget is spent, at least one batch; the rest
    are left to the next passes and not remembered as written."""
    from jobs.bulk import BATCH

    team = make_team("bk", quota=1000)
    user = make_user("bku", team=team)
    make_nodes(1, 8)
    now = timezone.now()
    _queue_many(team, user, 2 * BATCH + 200)
    ids = list(Job.objects.order_by("-id").values_list("id", flat=True))  # the queue's order
    reasons = {i: f"behind {n} others" for n, i in enumerate(ids)}
    # The last job in the queue also holds a claim that fails (a GPU of another job's gang).
    lost = submit(team, user, gpus=1)
    held = submit(team, user, gpus=1)
    gpu = GPU.objects.first()
    assert held.id in apply_plan(Plan(placements=(placement_on(held, [gpu]),)), now=now).applied
    plan = Plan(placements=(placement_on(lost, [gpu]),), reasons=reasons)
    memo = ReasonMemo()

    first, queries = _apply_counting(plan, memo=memo, reason_budget_s=0)
    assert (first.reasons_written, first.reasons_deferred) == (BATCH, BATCH + 201)
    # Read a batch at a time too: the rows past the budget are not even read.
    reads = [q for q in _job_reads(queries) if '"jobs_job"."reason" AS "reason"' in q]
    asked = [len(q.split(" IN (", 1)[1].split(")", 1)[0].split(",")) for q in reads]
    assert asked == [BATCH], asked
    assert Job.objects.get(pk=lost.pk).wait["code"] == "rejected"  # written first
    written = set(Job.objects.filter(reason__startswith="behind").values_list("id", flat=True))
    assert written == set(ids[: BATCH - 1])
    assert set(memo.rows) == written | {lost.id}

    second = apply_plan(plan, now=timezone.now(), memo=memo, reason_budget_s=0)
    assert (second.reasons_written, second.reasons_deferred) == (BATCH, 201)
    third = apply_plan(plan, now=timezone.now(), memo=memo, reason_budget_s=0)
    assert (third.reasons_written, third.reasons_deferred) == (201, 0)
    # Every job now has its reason, the rejected one its own; nothing left to write.
    assert Job.objects.filter(reason__startswith="behind").count() == len(ids)
    assert Job.objects.get(pk=ids[-1]).reason == f"behind {len(ids) - 1} others"
    last = apply_plan(plan, now=timezone.now(), memo=memo, reason_budget_s=0)
    assert (last.reasons_written, last.reasons_deferred) == (0, 0)
    # Without a budget one pass writes them all.
    Job.objects.filter(id__in=ids).update(reason="queued")
    whole = apply_plan(plan, now=timezone.now(), reason_budget_s=None)
    assert (whole.reasons_written, whole.reasons_deferred) == (len(ids), 0)


@pytest.mark.django_db
def test_a_failed_reason_write_leaves_the_placements_committed(
    make_team, make_user, make_nodes, monkeypatch
):
    """Wait reasons are written in their own transaction after the gangs are committed: a
    database error there (a deadlock with a requeue) loses only this pass's reasons, and the
    memo forgets what it held so that the next pass writes every reason again."""
    from django.db import OperationalError

    from jobs.scheduling import apply

    team = make_team("rf", quota=100)
    user = make_user("rfu", team=team)
    make_nodes(1, 8)
    jobs, placements = _gangs(team, user, 2)
    waiting = submit(team, user, gpus=1)
    memo = ReasonMemo(rows={12345: ("old", None, {})})

    def failing_bulk_set(*args, **kwargs):
        raise OperationalError("deadlock detected")

    monkeypatch.setattr(apply, "bulk_set", failing_bulk_set)
    plan = Plan(placements=tuple(placements), reasons={waiting.id: "waits for its turn"})
    result = apply_plan(plan, now=timezone.now(), memo=memo)
    assert set(result.applied) == {job.id for job in jobs}
    assert Job.objects.filter(id__in=result.applied, state=Job.State.QUEUED).count() == 0
    assert Attempt.objects.filter(job__in=jobs).count() == 2
    assert result.reasons_written == 0 and memo.rows == {}
    monkeypatch.undo()
    again = apply_plan(Plan(placements=(), reasons=plan.reasons), now=timezone.now(), memo=memo)
    assert again.reasons_written == 1
    assert Job.objects.get(pk=waiting.pk).reason == "waits for its turn"
