"""`lockstep events` against a live portal (pytest-django's live server): a job's events oldest
first, the last --tail of the --kind prefixes, every page of a long run's, --follow until the
job ends (exit 1 when cancelled); another team's job is not found."""

import json
import threading
import time

import pytest
from django.utils import timezone

from jobs import actions
from jobs.actions.strikes import strike_node
from jobs.api import EVENTS_PAGE
from jobs.models import Attempt, Event, Node
from lockstep_cli import client
from lockstep_cli.cli import main


def lockstep(capsys, live_server, token, *args):
    code = main(["--url", live_server.url, "--token", token, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def job_of_ann(make_team, make_user, make_nodes, token_for):
    team = make_team("lab", quota=4)
    ann = make_user("ann", team=team)
    node = make_nodes(1, 4)[0]
    job = actions.do_submit_job(
        owner=ann,
        team=team,
        now=timezone.now(),
        name="long-run",
        image="lockstep/trainer:latest",
        command=["python", "-m", "trainer"],
        gpus=4,
    )
    # A long run's checkpoints, then a lost node and a restart: more than one page.
    Event.objects.bulk_create(
        Event(job=job, kind="checkpoint.committed", message=f"checkpoint at step {i * 100}")
        for i in range(1, EVENTS_PAGE + 6)
    )
    Event.objects.create(job=job, node=node, kind="rank.exited", message="rank 0 on node-0 exited")
    Event.objects.create(job=job, node=node, kind="attempt.lost", message="the node went silent")
    Event.objects.create(job=job, kind="attempt.started", message="attempt 2 starting")
    return job, ann, token_for(ann)


@pytest.mark.django_db(transaction=True)
def test_a_strike_for_an_attempts_failure_is_in_the_jobs_events(live_server, job_of_ann, capsys):
    # strike_node writes the node and the attempt, no job: it is still why the job moved.
    job, _, token = job_of_ann
    node = Node.objects.get(name="node-0")
    attempt = Attempt.objects.create(
        job=job,
        number=1,
        state="failed",
        master_addr="127.0.0.1",
        master_port=29401,
        created_at=timezone.now(),
    )
    strike_node(node, "rank 0 exited with code 1", now=timezone.now(), attempt=attempt)
    code, out, _ = lockstep(
        capsys, live_server, token, "events", str(job.id), "--kind", "node", "--tail", "0"
    )
    assert code == client.EXIT_OK
    assert out.splitlines()[-1].endswith("strike on node-0: rank 0 exited with code 1")


@pytest.mark.django_db(transaction=True)
def test_events_pages_through_a_long_run_and_filters_by_kind(live_server, job_of_ann, capsys):
    job, _, token = job_of_ann
    total = job.events.count()
    assert total > EVENTS_PAGE + 1  # job.submitted, the checkpoints, the loss, the restart

    code, out, _ = lockstep(capsys, live_server, token, "events", str(job.id), "--tail", "0")
    lines = out.splitlines()
    assert code == client.EXIT_OK and len(lines) == total  # every page, none twice
    assert "job.submitted" in lines[0] and "attempt 2 starting" in lines[-1]
    assert "attempt.lost" in lines[-2] and "[node-0] the node went silent" in lines[-2]
    assert lines[-3].endswith("rank.exited               rank 0 on node-0 exited")  # named

    code, out, _ = lockstep(capsys, live_server, token, "events", str(job.id), "--tail", "3")
    assert [line.split()[2] for line in out.splitlines()] == [
        "rank.exited",
        "attempt.lost",
        "attempt.started",
    ]
    code, out, _ = lockstep(
        capsys, live_server, token, "--json", "events", str(job.id), "--kind", "attempt,job"
    )
    assert [e["kind"] for e in json.loads(out)] == [
        "job.submitted",
        "attempt.lost",
        "attempt.started",
    ]


@pytest.mark.django_db(transaction=True)
def test_events_follow_prints_new_ones_until_the_job_ends(live_server, job_of_ann, capsys):
    job, ann, token = job_of_ann

    def later():
        time.sleep(1.0)
        Event.objects.create(job=job, kind="attempt.preempted", message="checkpointed, stopped")
        actions.do_cancel_job(job, actor=ann, now=timezone.now(), reason="enough")

    writer = threading.Thread(target=later)
    writer.start()
    try:
        code, out, err = lockstep(
            capsys, live_server, token, "events", str(job.id), "--tail", "1", "-F",
            "--poll-s", "0.2",
        )  # fmt: skip
    finally:
        writer.join()
    lines = out.splitlines()
    assert code == client.EXIT_FAILED  # cancelled, as `wait` and `logs --follow` say
    assert "attempt 2 starting" in lines[0]  # the tail, then what came after it
    assert any("checkpointed, stopped" in line for line in lines[1:])
    assert sum("attempt 2 starting" in line for line in lines) == 1  # nothing printed twice
    assert f"job {job.id} CANCELLED" in err


@pytest.mark.django_db(transaction=True)
def test_another_teams_job_is_not_found(live_server, job_of_ann, make_user, token_for, capsys):
    job, _, _ = job_of_ann
    mallory = token_for(make_user("mallory"))
    code, out, err = lockstep(capsys, live_server, mallory, "events", str(job.id))
    assert code == client.EXIT_FAILED and "not found" in err and out == ""
