"""A planned restart with real processes: two agents, a 4-GPU job over both (gloo workers of
the reference trainer). One agent is SIGTERMed while the job trains, as an operator upgrading
it or a newcomer pressing Ctrl-C would: the gang checkpoints and stops on both nodes, the job
is requeued without a strike on either node and without using a restart, and once the agent
is started again the job resumes from that checkpoint."""

import signal
import time

import pytest

from tests.live import Api, LiveCluster, submit_training, wait_for

pytestmark = pytest.mark.e2e

TRAIN = [
    "python",
    "-m",
    "trainer",
    "--steps",
    "5000",
    "--checkpoint-every",
    "10",
    "--log-every",
    "50",
]


@pytest.fixture
def cluster(tmp_path):
    live = LiveCluster(tmp_path)
    try:
        live.start()
        live.alice = Api(live.url, live.token("alice", "--team", "ops", "--quota", "4"))
        live.wait_for_gpus(live.alice, 4)
        yield live
    finally:
        live.stop()


def _strikes(cluster) -> int:
    out = cluster.manage(
        "shell",
        "-c",
        "from jobs.models import Event; print(Event.objects.filter(kind='node.strike').count())",
    )
    return int(out.strip().splitlines()[-1])


def _node(cluster, name):
    (node,) = [
        n for n in cluster.alice.get("/api/v1/nodes/").json()["results"] if n["name"] == name
    ]
    return node


def test_a_sigtermed_agent_leaves_no_strike_and_its_job_resumes_from_its_checkpoint(cluster):
    api = cluster.alice
    job = submit_training(api, "planned-restart", "ops", TRAIN)

    def detail():
        cluster.check_alive()
        return api.get(f"/api/v1/jobs/{job}/").json()

    wait_for(
        lambda: (
            detail()["state"] == "RUNNING" and api.get(f"/api/v1/jobs/{job}/checkpoints/").json()
        ),
        180,
        "the job to run across both agents and commit a checkpoint",
    )
    (first,) = detail()["attempts"]
    assert sorted(first["nodes"]) == ["e2e-a", "e2e-b"]

    agent = cluster.procs.pop("agent-e2e-a")
    agent.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert agent.wait(timeout=45) == 0
    left_after = time.monotonic() - started
    log = (cluster.work / "agent-e2e-a.log").read_text(errors="replace")
    assert "told the portal this node is leaving" in log, log[-3000:]

    def requeued():
        d = detail()
        return d["state"] == "QUEUED" and d["attempts"][0]["ended"] and d

    stopped = wait_for(requeued, 60, "the job to be requeued")
    ended = stopped["attempts"][0]["ended"]
    assert ended["state"] == "preempted", ended
    assert "planned restart of e2e-a" in ended["reason"]
    assert stopped["restart_count"] == 0
    assert _node(cluster, "e2e-a")["state"] == "down"  # no new work while it is away
    saved = max(c["step"] for c in api.get(f"/api/v1/jobs/{job}/checkpoints/").json())
    assert saved > 0
    # The stop checkpoint is at the step the gang stopped at (invariant 7: nothing lost).
    assert saved >= stopped["attempts"][0]["last_step"]

    cluster.start_agent("e2e-a")

    def resumed():
        d = detail()
        attempts = d["attempts"]
        return (
            d["state"] == "RUNNING"
            and len(attempts) == 2
            and attempts[1]["last_step"] > saved
            and d
        )

    again = wait_for(resumed, 180, "the job to resume on both agents")
    second = again["attempts"][1]
    assert second["resumed_from_step"] == saved
    assert sorted(second["nodes"]) == ["e2e-a", "e2e-b"]
    assert again["restart_count"] == 0
    assert _node(cluster, "e2e-a")["state"] == "up"
    assert _strikes(cluster) == 0
    assert left_after < 45
    api.post(f"/api/v1/jobs/{job}/cancel/")
