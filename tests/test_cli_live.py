"""The `lockstep` command against a live portal: the real CLI as a subprocess (python -m
lockstep_cli.cli, the console script's module) talking to a LiveCluster (daphne, scheduler, rq
worker and one node agent with 2 CPU "GPUs"). One short training job runs for real (submitted from
flags with --wait); another, from a YAML spec, is cancelled. Bad input exits 2 naming the field
and creates nothing; a wrong token exits 3; another team's job is "not found" (exit 1)."""

import json
import os
import re
import subprocess
import sys

import pytest

from lockstep_cli import client
from tests.live import ROOT, Api, LiveCluster, wait_for

pytestmark = pytest.mark.e2e

SHORT_TRAINING = [
    "python",
    "-m",
    "trainer",
    "--steps",
    "30",
    "--checkpoint-every",
    "10",
    "--log-every",
    "5",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    live = LiveCluster(tmp_path_factory.mktemp("cli-cluster"), agents=1, gpus_per_agent=2)
    # Failed credentials count per address in the shared Redis, and every client here is
    # 127.0.0.1, like the in-process tests' clients: their failures must not get this portal
    # to answer 429 (the wrong-token test wants the 401, exit 3).
    live.env["LOCKSTEP_THROTTLE_AUTH_FAILURES"] = "1000000/min"
    try:
        live.start()
        live.alice_token = live.token("alice", "--team", "cli", "--quota", "2")
        live.mallory_token = live.token("mallory", "--team", "rivals", "--quota", "2")
        live.alice = Api(live.url, live.alice_token)
        wait_for(
            lambda: live.alice.get("/api/v1/nodes/").json()["count"] == 1,
            60,
            "the agent to register",
        )
        yield live
    finally:
        live.stop()


def lockstep(cluster, *args: str, token: str | None = None, config: str | None = None):
    """Run the CLI; the portal and token come from LOCKSTEP_URL/LOCKSTEP_TOKEN, or from the
    config file named by LOCKSTEP_CONFIG when `config` is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKSTEP_")}
    env["XDG_CONFIG_HOME"] = str(cluster.work / "no-config")
    if config is not None:
        env["LOCKSTEP_CONFIG"] = config
    else:
        env["LOCKSTEP_URL"] = cluster.url
        env["LOCKSTEP_TOKEN"] = cluster.alice_token if token is None else token
    return subprocess.run(
        [sys.executable, "-m", "lockstep_cli.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def job_count(cluster) -> int:
    return cluster.alice.get("/api/v1/jobs/").json()["count"]


@pytest.fixture(scope="module")
def trained(cluster):
    """A 1-GPU job submitted from flags with --wait, then waited for to the end."""
    submitted = lockstep(
        cluster,
        "submit",
        "--name",
        "cli-flags",
        "--team",
        "cli",
        "--gpus",
        "1",
        "--env",
        "CLI_TEST=1",
        "--wait",
        "--timeout",
        "180",
        "--json",
        "--",
        *SHORT_TRAINING,
    )
    assert submitted.returncode == 0, submitted.stderr + cluster.logs()
    job = json.loads(submitted.stdout)
    assert job["state"] in ("RUNNING", "SUCCEEDED"), job
    assert f"submitted job {job['id']} (QUEUED)" in submitted.stderr
    done = lockstep(cluster, "wait", str(job["id"]), "--timeout", "180")
    assert done.returncode == 0, done.stderr + done.stdout + cluster.logs()
    assert f"job {job['id']} cli-flags SUCCEEDED" in done.stdout
    return job


def test_submit_from_flags_waits_and_the_job_trains_to_the_end(cluster, trained):
    detail = cluster.alice.get(f"/api/v1/jobs/{trained['id']}/").json()
    assert (detail["name"], detail["team"], detail["gpus"], detail["state"]) == (
        "cli-flags",
        "cli",
        1,
        "SUCCEEDED",
    )
    assert detail["command"] == SHORT_TRAINING and detail["env"] == {"CLI_TEST": "1"}


def test_status_checkpoints_and_logs_of_the_trained_job(cluster, trained):
    job_id = str(trained["id"])
    status = lockstep(cluster, "status", job_id)
    assert status.returncode == 0, status.stderr
    fields = {line.split()[0]: line.split()[1:] for line in status.stdout.splitlines()}
    assert fields["state"][0].rstrip(":") == "SUCCEEDED", status.stdout
    assert fields["checkpoint"][:2] == ["step", "30"], status.stdout
    assert "attempt 1 on e2e-a: succeeded" in status.stdout
    assert json.loads(lockstep(cluster, "status", job_id, "--json").stdout)["state"] == "SUCCEEDED"

    table = lockstep(cluster, "checkpoints", job_id)
    assert table.returncode == 0, table.stderr
    assert table.stdout.split()[:7] == [
        "ID",
        "STEP",
        "ATTEMPT",
        "SIZE",
        "SAVE_S",
        "CREATED",
        "PATH",
    ]
    listed = json.loads(lockstep(cluster, "checkpoints", job_id, "--json").stdout)
    assert listed and max(c["step"] for c in listed) == 30
    assert all(str(c["id"]) in table.stdout for c in listed)
    # The attempt as people count it (its id is in the JSON), save times to the hundredth.
    assert {c["attempt_number"] for c in listed} == {1}
    rows = [line.split() for line in table.stdout.splitlines()[1:]]
    assert {row[2] for row in rows} == {"1"}, table.stdout
    # SAVE_S is the sixth word: SIZE is two ("4.9 MiB").
    assert all(re.fullmatch(r"\d+\.\d\d", row[5]) for row in rows), table.stdout

    logs = lockstep(cluster, "logs", job_id, "--tail", "500")
    assert logs.returncode == 0, logs.stderr
    api_lines = cluster.alice.get(f"/api/v1/jobs/{job_id}/logs/?tail=500").json()["lines"]
    assert api_lines and logs.stdout.splitlines() == api_lines


def test_submit_from_a_yaml_spec_then_cancel(cluster, trained, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: cli-spec\n"
        "team: cli\n"
        "gpus: 2\n"
        "priority: low\n"
        "max_restarts: 0\n"
        "command: [python, -m, trainer, --steps, '100000']\n"
    )
    submitted = lockstep(cluster, "submit", "-f", str(spec), "--name", "cli-spec-flag")
    assert submitted.returncode == 0, submitted.stderr
    line = submitted.stdout.split()
    assert line[0] == "job" and line[2] == "cli-spec-flag", submitted.stdout
    job_id = line[1]
    detail = cluster.alice.get(f"/api/v1/jobs/{job_id}/").json()
    assert (detail["gpus"], detail["priority"], detail["max_restarts"]) == (2, "low", 0)
    assert detail["command"] == ["python", "-m", "trainer", "--steps", "100000"]

    cancelled = lockstep(cluster, "cancel", job_id, "--json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout)["state"] == "CANCELLED"
    assert cluster.alice.get(f"/api/v1/jobs/{job_id}/").json()["state"] == "CANCELLED"
    # Waiting on a cancelled job says so with exit 1.
    waited = lockstep(cluster, "wait", job_id, "--timeout", "30")
    assert waited.returncode == client.EXIT_FAILED and "CANCELLED" in waited.stdout


def test_jobs_as_a_table_and_as_json(cluster, trained):
    listed = json.loads(lockstep(cluster, "jobs", "--json").stdout)
    ids = [j["id"] for j in listed]
    assert trained["id"] in ids and ids == sorted(ids, reverse=True)
    assert ids == [j["id"] for j in cluster.alice.get("/api/v1/jobs/").json()["results"]]
    table = lockstep(cluster, "jobs", "--state", "succeeded")
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].split() == [
        "ID",
        "NAME",
        "TEAM",
        "STATE",
        "GPUS",
        "PRIORITY",
        "SUBMITTED",
        "REASON",
    ]
    assert rows[1].split()[:5] == [str(trained["id"]), "cli-flags", "cli", "SUCCEEDED", "1"]
    assert all("SUCCEEDED" in row for row in rows[1:])


def test_the_config_file_supplies_url_and_token(cluster, trained, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'url = "{cluster.url}"\ntoken = "{cluster.alice_token}"\n')
    config.chmod(0o600)
    status = lockstep(cluster, "status", str(trained["id"]), "--json", config=str(config))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["id"] == trained["id"]
    assert "warning" not in status.stderr


@pytest.mark.parametrize(
    ("args", "field", "message"),
    [
        (["--gpus", "0"], "gpus", "greater than or equal to 1"),
        (["--gpus", "3"], "gpus", "The cluster has 2 GPUs; this job asks for 3."),
        (["--team", "rivals"], "team", "Unknown team 'rivals'."),
        (["--image", "Not An Image!"], "image", "container image reference"),
        (["--env", "RANK=3"], "env", "set by Lockstep's launch contract"),
    ],
)
def test_bad_input_exits_2_naming_the_field_and_creates_nothing(cluster, args, field, message):
    before = job_count(cluster)
    base = {"--name": "bad", "--team": "cli", "--gpus": "1"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flags = [item for pair in base.items() for item in pair]
    done = lockstep(cluster, "submit", *flags, "--", "python", "-m", "trainer")
    assert done.returncode == client.EXIT_USAGE, (done.returncode, done.stderr)
    assert "the portal refused the request" in done.stderr
    assert any(
        line.strip().startswith(f"{field}:") and message in line
        for line in done.stderr.splitlines()
    ), done.stderr
    assert done.stdout == ""
    assert job_count(cluster) == before


def test_a_spec_with_an_unknown_field_exits_2_before_asking_the_portal(cluster, tmp_path):
    before = job_count(cluster)
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nteam: cli\ngpus: 1\ncommand: [python]\ngpu: 2\n")
    done = lockstep(cluster, "submit", "-f", str(spec))
    assert done.returncode == client.EXIT_USAGE and "unknown field(s) gpu" in done.stderr
    assert job_count(cluster) == before


def test_a_wrong_token_exits_3_and_creates_nothing(cluster):
    before = job_count(cluster)
    for args in (
        ["jobs"],
        ["submit", "--name", "x", "--team", "cli", "--gpus", "1", "--", "python"],
    ):
        done = lockstep(cluster, *args, token="lst_not-a-real-token")
        assert done.returncode == client.EXIT_AUTH, (args, done.returncode, done.stderr)
        assert "authentication failed" in done.stderr
    assert job_count(cluster) == before


def test_another_teams_job_is_not_found_like_a_missing_one(cluster, trained):
    theirs = lockstep(cluster, "status", str(trained["id"]), token=cluster.mallory_token)
    missing = lockstep(cluster, "status", "999999", token=cluster.mallory_token)
    assert theirs.returncode == missing.returncode == client.EXIT_FAILED
    assert theirs.stderr == missing.stderr == "lockstep: not found (or not yours)\n"
    cancel = lockstep(cluster, "cancel", str(trained["id"]), token=cluster.mallory_token)
    assert cancel.returncode == client.EXIT_FAILED
    assert json.loads(lockstep(cluster, "jobs", "--json", token=cluster.mallory_token).stdout) == []


def test_plan_json(cluster):
    done = lockstep(
        cluster,
        "plan",
        "--layers",
        "24",
        "--hidden",
        "2048",
        "--heads",
        "16",
        "--vocab",
        "50000",
        "--seq",
        "2048",
        "--gpus",
        "8",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["layouts"] and plan["recommended"] in plan["layouts"]
    bad = lockstep(cluster, "plan", "--layers", "0", "--hidden", "8", "--heads", "1", "--vocab",
                   "8", "--seq", "8", "--gpus", "1", "--json")  # fmt: skip
    assert bad.returncode == client.EXIT_USAGE and "--layers" in bad.stderr and bad.stdout == ""


def test_register_a_checkpoint_as_a_model_and_list_models(cluster, trained):
    listed = json.loads(lockstep(cluster, "checkpoints", str(trained["id"]), "--json").stdout)
    latest = max(listed, key=lambda c: c["step"])
    done = lockstep(cluster, "models", "register", "cli-adder", "--checkpoint", str(latest["id"]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"registered cli-adder v1 from job {trained['id']} step 30")
    models = json.loads(lockstep(cluster, "models", "--json").stdout)
    assert [(m["name"], m["version"], m["job"]) for m in models] == [
        ("cli-adder", 1, trained["id"])
    ]
    # Another team's user cannot register it: the checkpoint is unknown to them (exit 2).
    theirs = lockstep(
        cluster,
        "models",
        "register",
        "stolen",
        "--checkpoint",
        str(latest["id"]),
        token=cluster.mallory_token,
    )
    assert theirs.returncode == client.EXIT_USAGE
    assert f"checkpoint: Unknown checkpoint {latest['id']}." in theirs.stderr


def test_tokens_create_list_and_revoke(cluster):
    created = lockstep(cluster, "tokens", "create", "cli-sweeps", "--expires-days", "7")
    assert created.returncode == 0, created.stderr
    raw = created.stdout.strip()
    assert raw.startswith("lst_") and "shown this once" in created.stderr
    assert lockstep(cluster, "jobs", "--json", token=raw).returncode == 0
    listed = json.loads(lockstep(cluster, "tokens", "--json").stdout)
    (mine,) = [t for t in listed if t["name"] == "cli-sweeps"]
    assert mine["state"] == "active" and "token" not in mine
    # Somebody else's token is not found, and stays working.
    theirs = lockstep(cluster, "tokens", "revoke", str(mine["id"]), token=cluster.mallory_token)
    assert theirs.returncode == client.EXIT_FAILED and "not found" in theirs.stderr
    assert lockstep(cluster, "jobs", "--json", token=raw).returncode == 0
    revoked = lockstep(cluster, "tokens", "revoke", str(mine["id"]))
    assert revoked.returncode == 0 and f"token {mine['id']} revoked" in revoked.stdout
    refused = lockstep(cluster, "jobs", token=raw)
    assert refused.returncode == client.EXIT_AUTH and "authentication failed" in refused.stderr


LONG_LOG = """
import sys, time
time.sleep(5)  # the CLI starts following before the first line
for i in range(12000):
    print(f"line {i}")
sys.stdout.flush()
sys.stdout.write("par")
sys.stdout.flush()
time.sleep(2)  # the unfinished line reaches the portal before its end does
print("tial", flush=True)
"""


def test_logs_follow_prints_every_line_once_past_10000_lines_and_exits_with_the_job(cluster):
    submitted = lockstep(
        cluster, "submit", "--name", "chatty", "--team", "cli", "--gpus", "1", "--json",
        "--", "python", "-c", LONG_LOG,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job_id = str(json.loads(submitted.stdout)["id"])
    follow = lockstep(cluster, "logs", job_id, "--follow")
    assert follow.returncode == 0, follow.stderr + cluster.logs()
    assert follow.stdout.splitlines() == [f"line {i}" for i in range(12000)] + ["partial"]
    assert f"job {job_id} SUCCEEDED" in follow.stderr
