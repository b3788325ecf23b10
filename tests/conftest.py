"""Shared fixtures: database objects made through the real actions."""

import os

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from jobs import actions
from teams.actions import do_add_member, do_create_team, do_issue_token

# Fixtures shared from a plain module keep pytest's detailed assertion messages (before any
# test file imports it).
pytest.register_assert_rewrite("tests.nodeagent_helpers")
pytest.register_assert_rewrite("tests.container_runtime_helpers")
pytest.register_assert_rewrite("tests.e2e_helpers")

# Agents the suite starts run jobs as plain processes (their test jobs use the suite's own
# interpreter), whatever engine the machine has; tests/test_container_runtime.py asks for
# containers by name.
os.environ.setdefault("LOCKSTEP_AGENT_RUNTIME", "process")

# Test files that check nothing specific to a database or a channel layer, and why: `make test`
# (SQLite, embedded Redis) runs them, and .ci/run's PostgreSQL leg deselects them with
# `-m "not one_leg"` instead of running them twice. What depends on the database (claims,
# heartbeats, locks, bulk SQL, page and API queries, the whole platform end to end) runs in both.
ONE_LEG = {
    "test_trainer.py": "torch processes over gloo; no database",
    "test_trainer_parallel.py": "torch processes over gloo; no database",
    "test_trainer_elastic.py": "torch processes over gloo; no database",
    "test_trainer_pipeline.py": "torch processes over gloo; no database",
    "test_trainer_layout.py": "torch processes over gloo; no database",
    "test_overlap_bench.py": "torch processes over gloo; no database",
    "test_trainer_async.py": "torch processes over gloo; no database",
    "test_trainer_api.py": "the helper API in torch processes; no database",
    "test_trainer_export.py": "a checkpoint converted by a command; no database",
    "test_checkpoint_layout.py": "checkpoint directories and markers on disk; no database",
    "test_ring.py": "a ring all-reduce over gloo; no database",
    "test_flops.py": "FLOP counts and the MFU benchmark; no database",
    "test_zygote.py": "the agent's fork server; no database",
    "test_nodeagent.py": "the agent against a stub portal; no database",
    "test_nodeagent_launch.py": "the agent against a stub portal; no database",
    "test_nodeagent_stop.py": "the agent against a stub portal; no database",
    "test_nodeagent_tails.py": "the agent against a stub portal; no database",
    "test_nodeagent_diagnostics.py": "the agent against a stub portal; no database",
    "test_nodeagent_cli.py": "the agent against a stub portal; no database",
    "test_framework_outputs.py": "the agent's readers of framework files; no database",
    "test_planner.py": "the memory planner's arithmetic and its read-only endpoint",
    "test_planner_layouts.py": "the memory planner's arithmetic and its read-only endpoint",
    "test_planner_api.py": "the memory planner's arithmetic and its read-only endpoint",
    "test_policy.py": "the pure policy",
    "test_policy_backfill.py": "the pure policy",
    "test_policy_preemption.py": "the pure policy",
    "test_policy_claims.py": "the pure policy",
    "test_policy_reasons.py": "the pure policy",
    "test_policy_elastic.py": "the pure policy",
    "test_policy_properties.py": "the pure policy",
    "test_simulate.py": "the pure simulator",
    "test_protection.py": "the pure policy's preemption protection",
    "test_thrash_properties.py": "the pure policy on generated workloads",
    "test_estimate_accuracy.py": "the pure simulator's start promises",
    "test_container_runtime.py": "jobs in podman containers; the database part is e2e's",
    "test_container_runtime_images.py": "jobs in podman containers; the database part is e2e's",
    "test_container_runtime_recovery.py": "jobs in podman containers; the database part is e2e's",
    "test_up.py": "lockstep up on its embedded defaults (SQLite, its own Redis) in any leg",
    "test_layers.py": "the code's own imports",
    "test_cli_layers.py": "the CLI package's imports",
    "test_cli.py": "the CLI's parsing and output",
    "test_cli_live.py": "the CLI as a client: its requests and output, not the database's",
    "test_settings_table.py": "settings parsing",
    "test_production_settings.py": "settings parsing",
    "test_api_docs.py": "the OpenAPI schema and its offline docs page",
    "test_browser.py": "pages in Chromium; their queries run on PostgreSQL in test_portal_pages",
    "test_browser_console.py": "pages in Chromium; their queries run on PostgreSQL in test_console",
    "test_browser_research.py": "pages in Chromium; their queries run on PostgreSQL in "
    "test_portal_pages",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in ONE_LEG:
            item.add_marker(pytest.mark.one_leg)


@pytest.fixture(autouse=True)
def fresh_heartbeat_intake(monkeypatch):
    """The scheduler's heartbeat intake lives in a module global (one per scheduler process).
    A test that runs passes at future times leaves it "resumed" in the future, and a later
    test's hang or lost-node detection then waits for a timeout from that moment: each test
    gets an intake as if its scheduler had been running for an hour."""
    from datetime import timedelta

    from jobs.scheduling import loop

    monkeypatch.setattr(loop, "intake", loop.HeartbeatIntake(timezone.now() - timedelta(hours=1)))


@pytest.fixture(autouse=True)
def lenient_auth_throttle(settings):
    """Every test client comes from 127.0.0.1, and the failed-auth counters live in Redis across
    tests: tests that send wrong credentials on purpose would otherwise lock out later ones.
    tests/test_tokens.py sets its own small limits, on addresses of its own."""
    settings.LOCKSTEP_THROTTLE_AUTH_FAILURES = "1000000/min"


@pytest.fixture
def setup(make_team, make_user, make_nodes, settings, tmp_path):
    settings.LOCKSTEP = {
        **settings.LOCKSTEP,
        "CHECKPOINT_ROOT": str(tmp_path / "ckpt"),
        "RESTART_BACKOFF_S": 10.0,
    }
    team = make_team("lab", quota=8)
    user = make_user("ann", team=team)
    nodes = make_nodes(2, 2)
    return team, user, nodes, tmp_path / "ckpt"


@pytest.fixture
def make_user():
    def make(username: str, *, team=None, role: str = "member", staff: bool = False):
        user = get_user_model().objects.create_user(
            username=username, password="pw-" + username, is_staff=staff
        )
        if team is not None:
            do_add_member(team, user, role=role)
        return user

    return make


@pytest.fixture
def make_team():
    def make(name: str, quota: int = 8, borrow_limit: int = 0):
        return do_create_team(name, quota=quota, borrow_limit=borrow_limit)

    return make


@pytest.fixture
def make_nodes():
    def make(count: int, gpus: int, prefix: str = "node"):
        return [
            actions.do_register_node(
                name=f"{prefix}-{i}",
                gpus=gpus,
                address="127.0.0.1",
                boot_id=f"boot-{i}",
                now=timezone.now(),
            )[0]
            for i in range(count)
        ]

    return make


@pytest.fixture
def token_for():
    def make(user) -> str:
        return do_issue_token(user)[1]

    return make


@pytest.fixture
def make_recorded_job():
    """A job as the platform records it, for reports over past windows: submitted at
    `submitted`, with one attempt per (start, end) in `runs` (end None: still running). The
    job's state is `state`, by default QUEUED without runs, RUNNING with a live attempt, else
    SUCCEEDED."""
    from jobs.models import Attempt, Job

    def make(
        team,
        owner,
        *,
        submitted,
        gpus: int = 1,
        priority: str = "normal",
        runs=(),
        time_limit_s=None,
        state: str | None = None,
        name: str = "recorded",
    ):
        job = actions.do_submit_job(
            owner=owner,
            team=team,
            now=submitted,
            name=name,
            image="lockstep/trainer:latest",
            command=["python", "-m", "trainer"],
            gpus=gpus,
            priority=priority,
            time_limit_s=time_limit_s,
        )
        for number, (start, end) in enumerate(runs, start=1):
            Attempt.objects.create(
                job=job,
                number=number,
                state="running" if end is None else "succeeded",
                master_addr="127.0.0.1",
                master_port=29400 + number,
                created_at=start,
                running_at=start,
                ended_at=end,
            )
        live = bool(runs) and runs[-1][1] is None
        state = state or ("RUNNING" if live else "SUCCEEDED" if runs else "QUEUED")
        Job.objects.filter(pk=job.pk).update(
            state=state,
            first_started_at=runs[0][0] if runs else None,
            finished_at=runs[-1][1] if runs and not live and state in Job.TERMINAL else None,
        )
        job.refresh_from_db()
        return job

    return make
