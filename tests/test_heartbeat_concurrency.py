"""Heartbeats of one gang's nodes arriving at the same moment, each on its own database
connection: the attempt must still move on (RUNNING when every rank is up, ended when every
rank has exited). Meaningful on PostgreSQL (the .ci/run leg), where transactions overlap; SQLite
serializes writers, so there it only checks the outcome."""

import threading
from functools import partial

import pytest
from django.db import connection, connections
from django.utils import timezone

from jobs import actions
from jobs.models import Attempt, Job
from jobs.scheduling.loop import run_pass
from tests.heartbeats import beat, live_attempt, submit

ROUNDS = 12


def _together(calls) -> None:
    """Run the calls in threads released at once; each thread uses its own connection."""
    barrier = threading.Barrier(len(calls))
    errors = []

    def run(call):
        try:
            barrier.wait(timeout=30)
            call()
        except Exception as exc:  # reported below, with the thread's cause
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


@pytest.mark.django_db(transaction=True)
def test_simultaneous_reports_from_every_node_of_a_gang_start_and_end_it(setup):
    team, user, (a, b), _ = setup
    for round_ in range(ROUNDS):
        job = submit(team, user)
        run_pass()
        attempt = live_attempt(job)
        _together(
            [
                partial(beat, a, attempt, {0: None, 1: None}),
                partial(beat, b, attempt, {2: None, 3: None}),
            ]
        )
        assert Attempt.objects.get(pk=attempt.pk).state == Attempt.State.RUNNING, (
            f"round {round_}: every rank reported running, the attempt stayed "
            f"{Attempt.objects.get(pk=attempt.pk).state}"
        )
        if round_ % 2:  # half the rounds end in a stop (a preemption or cancel), half by exit
            actions.do_cancel_job(Job.objects.get(pk=job.pk), actor=user, now=timezone.now())
        _together(
            [partial(beat, a, attempt, {0: 0, 1: 0}), partial(beat, b, attempt, {2: 0, 3: 0})]
        )
        ended = Attempt.objects.get(pk=attempt.pk)
        assert ended.ended_at is not None, (
            f"round {round_}: every rank exited, the attempt stayed {ended.state} on "
            f"{connection.vendor}"
        )
