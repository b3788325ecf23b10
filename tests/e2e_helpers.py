"""The whole platform for the end-to-end tests (tests/test_e2e.py, tests/test_e2e_faults.py):
the portal (daphne) on a live port, the scheduler, an rq worker and two node agents with 2 CPU
"GPUs" each; team e2e (alice) and team rivals (mallory), 4 GPUs of quota each. Each test module
starts its own."""

from tests.live import Api, LiveCluster


def e2e_cluster(tmp_path_factory):
    """A module fixture's body: the cluster, started, yielded, then stopped."""
    live = LiveCluster(tmp_path_factory.mktemp("cluster"))
    try:
        live.start()
        live.alice = Api(live.url, live.token("alice", "--team", "e2e", "--quota", "4"))
        live.mallory = Api(live.url, live.token("mallory", "--team", "rivals", "--quota", "4"))
        live.wait_for_gpus(live.alice, 4)
        yield live
    finally:
        live.stop()


def submit_job(api, name, command, **extra):
    response = api.post(
        "/api/v1/jobs/",
        {
            "name": name,
            "team": "e2e",
            "image": "lockstep/trainer:latest",
            "command": command,
            "gpus": 4,
            "max_restarts": 2,
            **extra,
        },
    )
    assert response.status_code == 201, response.text
    return response.json()["id"]
