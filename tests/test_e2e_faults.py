"""End to end, the platform's faults and recoveries with real processes and sockets
(tests/e2e_helpers.py): a frozen node's zombie fenced from its successor, an elastic job
restarting on the node left, the portal and scheduler restarted under a running job, a hung job
detected with its stacks, a frozen rank named from outside, a straggler flagged on its node, and
a quota reclaim that checkpoints the borrower, runs the owner and resumes the borrower."""

import os
import signal
import time
from datetime import datetime

import pytest

from tests.e2e_helpers import e2e_cluster, submit_job
from tests.live import Api, wait_for, worker_pids

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from e2e_cluster(tmp_path_factory)


def test_a_zombie_on_a_frozen_node_never_runs_beside_its_successor_unfenced(cluster):
    """Invariant 3 with a real zombie. A 2-GPU job runs on one node; that node's agent is
    frozen (SIGSTOP) past the heartbeat timeout while its workers keep training. The node is
    declared down, the attempt lost, and the job restarts on the other node from its latest
    checkpoint. When the agent wakes, its first act is to kill the zombie workers. At no time
    are there two live attempts, and the zombies' saves never mix with the successor's."""
    api = cluster.alice
    job = submit_job(
        api,
        "e2e-zombie",
        ["python", "-m", "trainer", "--steps", "300", "--checkpoint-every", "20"],
        gpus=2,
    )
    checkpoint = wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/checkpoints/").json(), 180, "a committed checkpoint"
    )[0]
    first = api.get(f"/api/v1/jobs/{job}/").json()["attempts"][0]
    (frozen,) = first["nodes"]
    (other,) = {"e2e-a", "e2e-b"} - {frozen}
    agent = cluster.procs[f"agent-{frozen}"]
    os.kill(agent.pid, signal.SIGSTOP)
    try:

        def successor():
            cluster.check_alive()
            attempts = api.get(f"/api/v1/jobs/{job}/").json()["attempts"]
            return len(attempts) == 2 and attempts[1]["state"] == "running" and attempts

        attempts = wait_for(successor, 120, "the job to restart on the other node")
        assert attempts[0]["state"] == "lost"
        assert f"node {frozen} lost" in attempts[0]["ended"]["reason"]
        assert attempts[1]["nodes"] == [other]
        assert attempts[1]["resumed_from_step"] >= checkpoint["step"] > 0
        # The zombies are still alive (their agent is frozen) beside the successor.
        assert worker_pids(first["id"]), "expected the frozen node's workers to still run"
        nodes = {n["name"]: n["state"] for n in api.get("/api/v1/nodes/").json()["results"]}
        assert nodes[frozen] == "down"
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    wait_for(lambda: not worker_pids(first["id"]), 30, "the zombie workers to be fenced")
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/").json()["state"] == "SUCCEEDED",
        300,
        "the job to succeed",
    )
    detail = api.get(f"/api/v1/jobs/{job}/").json()
    assert len(detail["attempts"]) == 2 and detail["latest_checkpoint"]["step"] == 300
    second_id = detail["attempts"][1]["id"]
    for saved in api.get(f"/api/v1/jobs/{job}/checkpoints/").json():
        expected = "attempt-2" if saved["attempt"] == second_id else "attempt-1"
        assert f"/job-{job}/{expected}/" in saved["path"]
    nodes = {n["name"]: n["state"] for n in api.get("/api/v1/nodes/").json()["results"]}
    assert nodes[frozen] == "up"


def test_an_elastic_job_restarts_on_the_node_left_with_the_same_global_batch(cluster):
    """Issue 5's elastic restart, with real workers: a 4-GPU job that allows 2 runs across both
    agents; one agent is frozen past the heartbeat timeout; the job restarts at once on the 2
    GPUs left, resharding its checkpoint, keeping the global batch by gradient accumulation,
    says so in its events; when the agent is back, the job grows back to 4 GPUs (checkpoint,
    stop, restart resharded again) and finishes."""
    api = cluster.alice
    job = submit_job(
        api,
        "e2e-elastic",
        ["python", "-m", "trainer", "--steps", "400", "--checkpoint-every", "20"],
        min_gpus=2,
    )
    checkpoint = wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/checkpoints/").json(), 180, "a committed checkpoint"
    )[0]
    first = api.get(f"/api/v1/jobs/{job}/").json()["attempts"][0]
    assert first["world_size"] == 4 and len(first["nodes"]) == 2
    frozen = first["nodes"][1]
    agent = cluster.procs[f"agent-{frozen}"]
    os.kill(agent.pid, signal.SIGSTOP)
    try:

        def shrunk():
            cluster.check_alive()
            attempts = api.get(f"/api/v1/jobs/{job}/").json()["attempts"]
            return len(attempts) == 2 and attempts[1]["state"] == "running" and attempts

        attempts = wait_for(shrunk, 120, "the job to restart on the node left")
        assert attempts[1]["world_size"] == 2 and frozen not in attempts[1]["nodes"]
        assert attempts[1]["resumed_from_step"] >= checkpoint["step"] > 0
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    events = api.get(f"/api/v1/jobs/{job}/events/").json()
    (note,) = [e for e in events if e["kind"] == "attempt.shrunk"]
    assert "runs on 2 of the job's 4 GPUs" in note["message"]

    def grown():
        attempts = api.get(f"/api/v1/jobs/{job}/").json()["attempts"]
        return len(attempts) == 3 and attempts[2]["state"] != "starting" and attempts

    attempts = wait_for(grown, 120, "the job to grow back to 4 GPUs (LiveCluster: after 3 s)")
    assert attempts[1]["state"] == "preempted"
    assert attempts[2]["world_size"] == 4 and len(attempts[2]["nodes"]) == 2
    assert attempts[2]["resumed_from_step"] > attempts[1]["resumed_from_step"]
    events = api.get(f"/api/v1/jobs/{job}/events/").json()
    (growing,) = [e for e in events if e["kind"] == "job.growing"]
    assert "runs on 2 of 4 GPUs; growing back to 4 GPUs" in growing["message"]
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/").json()["state"] == "SUCCEEDED",
        300,
        "the elastic job to succeed",
    )
    log = "\n".join(api.get(f"/api/v1/jobs/{job}/logs/", params={"attempt": 2}).json()["lines"])
    assert "elastic attempt on 2 of the job's 4 GPUs" in log
    # The first attempt's global batch (4 ranks x the default batch size of 32), now as 2 ranks
    # x 2 micro-batches.
    assert "global batch 128 = 2 x 2 micro-batches" in log, log[-2000:]


def test_portal_and_scheduler_restarts_lose_no_running_job(cluster):
    """The portal and the scheduler hold no state of their own: restarting them mid-run leaves
    the attempt running (agents keep their workers and retry heartbeats) and the job finishes
    without a restart."""
    api = cluster.alice
    job = api.post(
        "/api/v1/jobs/",
        {
            "name": "e2e-portal-restart",
            "team": "e2e",
            "image": "lockstep/trainer:latest",
            "command": ["python", "-m", "trainer", "--steps", "150", "--checkpoint-every", "50"],
            "gpus": 4,
        },
    ).json()["id"]
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/").json()["state"] == "RUNNING", 120, "the job to run"
    )
    before = api.get(f"/api/v1/jobs/{job}/").json()["attempts"][0]["last_step"]
    cluster.restart("scheduler")
    cluster.restart("portal", down_s=3)
    wait_for(cluster._portal_up, 60, "the portal to come back")
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/").json()["state"] == "SUCCEEDED",
        240,
        "the job to succeed",
    )
    detail = api.get(f"/api/v1/jobs/{job}/").json()
    assert len(detail["attempts"]) == 1 and detail["restart_count"] == 0
    assert detail["attempts"][0]["last_step"] == 150 > before
    # Steps made while the portal was down were re-sent by the agents, none lost.
    steps = api.get(f"/api/v1/jobs/{job}/metrics/?name=loss&rank=0&max_points=100000").json()
    assert steps["ranks"]["0"]["step"] == list(range(1, 151))


def test_hung_job_is_detected_its_stacks_captured_and_it_resumes(cluster):
    """Rank 0 stalls before step 25 (alive, no progress; the others block in the all-reduce).
    The portal sees no progress past its adaptive timeout, asks the agents for stacks, kills
    the gang, and the job restarts from the step-20 checkpoint and finishes."""
    api = cluster.alice
    job = submit_job(
        api,
        "e2e-hang",
        [
            "python",
            "-m",
            "trainer",
            "--steps",
            "60",
            "--checkpoint-every",
            "10",
            "--fault-stall-at-step",
            "25",
        ],
    )

    def restarted():
        cluster.check_alive()
        attempts = api.get(f"/api/v1/jobs/{job}/").json()["attempts"]
        return len(attempts) == 2 and attempts

    attempts = wait_for(restarted, 180, "the hang to be detected and the job restarted")
    first = attempts[0]
    assert first["state"] == "failed" and first["last_step"] == 24
    assert "hung: no progress for" in first["ended"]["reason"]
    assert attempts[1]["resumed_from_step"] == 20
    events = api.get(f"/api/v1/jobs/{job}/events/").json()
    assert any(e["kind"] == "attempt.hang_detected" for e in events)
    failed = next(e for e in events if e["kind"] == "attempt.failed")
    stacks = failed["data"]["stacks"]
    assert "0" in stacks and "in fault" in stacks["0"], stacks.keys()
    # Read from outside too (py-spy), and compared: rank 0 is the one not in the all-reduce.
    assert all("read from outside (py-spy dump)" in stacks[r] for r in "0123"), stacks.keys()
    assert failed["data"].get("odd_rank") == 0, failed["message"]
    assert "rank 0 on e2e-" in failed["message"], failed["message"]
    # The flight recorders agree, by sequence number: every rank's recorder was read (the
    # trainer serves the dump pipe under gloo), and rank 0 is the one behind.
    flights = failed["data"]["flight_recorder"]
    assert set(flights) == {"0", "1", "2", "3"}, flights
    assert failed["data"]["flight_verdict"].startswith("never entered collective #"), failed
    behind, ahead = flights["0"]["groups"]["0"], flights["1"]["groups"]["0"]
    assert behind["entered"] < ahead["entered"] and ahead["completed"] < ahead["entered"], flights
    assert failed["data"]["detect_s"] < 12 + 3 + 10
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/").json()["state"] == "SUCCEEDED",
        240,
        "the job to succeed",
    )


def _frozen_outside_the_collective(pid: int, tries: int = 40) -> str:
    """SIGSTOP the rank at a moment it is not inside an all-reduce (checked from outside with
    py-spy, the way the agent reads it), so that it is the one rank the others wait for."""
    from jobs.health import innermost_frame
    from nodeagent.stacks import dump, py_spy

    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        text = dump(py_spy(), pid)
        frame = innermost_frame("read from outside (py-spy dump)\n" + text) or ""
        inside = ("all_reduce", "wait", "barrier")
        if frame and not any(word in frame for word in inside):
            return frame
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.13)
    raise AssertionError("the rank was always caught inside the collective")


def test_a_frozen_rank_is_named_with_its_node_from_stacks_read_outside(cluster):
    """Rank 2 is frozen (SIGSTOP): it can neither step nor dump its own stacks (a stopped
    process runs no signal handler), and the others block in the all-reduce it never joins.
    The agents read every rank from outside (py-spy); the one rank not in the collective is
    named with its node, which alone takes the strike."""
    api = cluster.alice
    job = submit_job(
        api,
        "e2e-frozen",
        ["python", "-m", "trainer", "--steps", "100000", "--checkpoint-every", "10"],
    )

    def stepping():
        cluster.check_alive()
        detail = api.get(f"/api/v1/jobs/{job}/").json()
        attempts = detail["attempts"]
        return attempts and attempts[0]["last_step"] >= 15 and detail

    detail = wait_for(stepping, 180, "the job to make steps")
    attempt = detail["attempts"][0]
    node = next(a["node"] for a in detail["allocation"] if a["rank"] == 2)
    pids = {r: p for r, p in worker_pids(attempt["id"]).items() if os.getsid(p) == p}
    frame = _frozen_outside_the_collective(pids[2])

    def restarted():
        cluster.check_alive()
        attempts = api.get(f"/api/v1/jobs/{job}/").json()["attempts"]
        return len(attempts) == 2 and attempts

    try:
        wait_for(restarted, 180, "the hang to be detected and the job restarted")
    finally:
        api.post(f"/api/v1/jobs/{job}/cancel/")
    events = api.get(f"/api/v1/jobs/{job}/events/").json()
    failed = next(e for e in events if e["kind"] == "attempt.failed")
    stacks = failed["data"]["stacks"]
    assert all("read from outside (py-spy dump)" in stacks[r] for r in "0123"), stacks.keys()
    assert failed["data"].get("odd_rank") == 2, (frame, failed["message"], stacks["2"][-2000:])
    assert f"rank 2 on {node}" in failed["message"], failed["message"]
    # The strike is recorded with the failure: on the frozen rank's node, on no other.
    assert failed["node"] == node, failed


def test_a_slow_rank_is_flagged_as_a_straggler_on_its_node(cluster):
    api = cluster.alice
    job = submit_job(
        api,
        "e2e-straggler",
        [
            "python",
            "-m",
            "trainer",
            "--steps",
            "80",
            "--fault-slow-rank",
            "3",
            "--fault-slow-ms",
            "150",
        ],
    )

    def flagged():
        cluster.check_alive()
        events = api.get(f"/api/v1/jobs/{job}/events/").json()
        return [e for e in events if e["kind"] == "attempt.straggler"]

    (event,) = wait_for(flagged, 180, "the straggler to be flagged")
    assert event["node"] == "e2e-b" and event["data"]["rank"] == 3
    assert event["message"].startswith("rank 3 on e2e-b is a straggler")
    # The arithmetic is in the event; the gang fills both nodes, so there is nowhere to move.
    assert not event["data"]["moved"] and ": keeping it" in event["message"]
    assert event["data"]["slowdown_s"] >= 0 and event["data"]["restart_s"] >= 0
    wait_for(
        lambda: api.get(f"/api/v1/jobs/{job}/").json()["state"] == "SUCCEEDED",
        240,
        "the job to succeed",
    )
    assert len(api.get(f"/api/v1/jobs/{job}/").json()["attempts"]) == 1


def test_quota_reclaim_checkpoints_the_borrower_runs_the_owner_then_resumes_the_borrower(
    cluster,
):
    """Team rivals borrows the whole cluster; team e2e, within its quota, submits: the
    borrower's job gets SIGTERM, saves a checkpoint and exits; the owner's job runs; when it
    ends, the borrower's job resumes from its preemption checkpoint step."""
    admin = Api(cluster.url, cluster.token("ops", "--staff"))
    teams = {t["name"]: t["id"] for t in admin.get("/api/v1/teams/").json()["results"]}
    for name, quota, borrow in (("rivals", 0, 4), ("e2e", 4, 0)):
        response = admin.session.patch(
            f"{cluster.url}/api/v1/teams/{teams[name]}/",
            json={"quota": quota, "borrow_limit": borrow},
            timeout=15,
        )
        assert response.status_code == 200, response.text
    borrower = cluster.mallory.post(
        "/api/v1/jobs/",
        {
            "name": "borrowing",
            "team": "rivals",
            "image": "lockstep/trainer:latest",
            "gpus": 4,
            "command": ["python", "-m", "trainer", "--steps", "400", "--checkpoint-every", "1000"],
        },
    ).json()["id"]

    def steps(api, job_id):
        cluster.check_alive()
        detail = api.get(f"/api/v1/jobs/{job_id}/").json()
        return detail["state"] == "RUNNING" and detail["attempts"][-1]["last_step"] > 5

    wait_for(lambda: steps(cluster.mallory, borrower), 180, "the borrower to train")
    owner = submit_job(cluster.alice, "owner", ["python", "-m", "trainer", "--steps", "40"])
    wait_for(lambda: steps(cluster.alice, owner), 180, "the owner's job to run")
    detail = cluster.mallory.get(f"/api/v1/jobs/{borrower}/").json()
    first = detail["attempts"][0]
    assert first["state"] == "preempted" and "reclaim" in first["ended"]["reason"], (
        f"the borrower's first attempt ended {first['state']}: {first.get('ended')}; "
        f"attempts: {detail['attempts']}\n{cluster.logs()}"
    )
    # The borrower spans both nodes with none of its team's quota: a gang the cluster drained
    # for, which no reclaim takes before RECLAIM_GANG_EXEMPT_S (20 s here) of its run.
    ran = datetime.fromisoformat(first["ended_at"]) - datetime.fromisoformat(first["created_at"])
    assert ran.total_seconds() >= 20, first
    (saved,) = cluster.mallory.get(f"/api/v1/jobs/{borrower}/checkpoints/").json()
    assert saved["step"] == first["last_step"] > 5  # saved at the step boundary after SIGTERM
    requests_made = admin.get("/api/v1/preemptions/").json()["results"]
    assert len(requests_made) == 1, f"one reclaim, not {requests_made}\n{cluster.logs()}"
    (request,) = requests_made
    assert (request["kind"], request["state"], request["victim"], request["claimant"]) == (
        "reclaim",
        "executed",
        borrower,
        owner,
    )
    assert request["reclaim_s"] is not None and request["reclaim_s"] < 60

    def resumed():
        cluster.check_alive()
        attempts = cluster.mallory.get(f"/api/v1/jobs/{borrower}/").json()["attempts"]
        return len(attempts) == 2 and attempts[1]["last_step"] > 0 and attempts[1]

    second = wait_for(resumed, 240, "the borrower to resume after the owner's job")
    assert second["resumed_from_step"] == saved["step"]
    assert cluster.alice.get(f"/api/v1/jobs/{owner}/").json()["state"] == "SUCCEEDED"
    cluster.mallory.post(f"/api/v1/jobs/{borrower}/cancel/")
