"""Node health checks (nodeagent/health_check.py, jobs/actions/node_health.py): real checks on
this machine (its disks, torch processes in a gloo collective, NVML where a driver is), the
portal's response to their reports, and live: an agent whose network setting is wrong is
cordoned at its start with the reason, and the job runs on the healthy node.

GPU paths (NVML visibility, ECC, retired pages, foreign processes) run only where a driver is;
on this CPU machine NVML says it is unavailable, and that is what is asserted."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from jobs.actions.node_health import held_for_health, wants_check
from jobs.models import Event, Job, Node
from jobs.scheduling.loop import run_pass
from nodeagent.health_check import HealthChecker, collective_check, disk_checks, gpu_checks
from nodeagent.xid import fault_report
from tests.heartbeats import live_attempt, submit
from tests.live import Api, LiveCluster, wait_for


def test_disk_checks_pass_on_a_writable_directory_and_name_what_fails(tmp_path):
    (ok,) = disk_checks([tmp_path / "work"])
    assert ok["ok"] and "GiB free" in ok["detail"]
    (full,) = disk_checks([tmp_path], min_free_bytes=1 << 60)
    assert not full["ok"] and "under" in full["detail"]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    (broken,) = disk_checks([blocker / "sub"])
    assert not broken["ok"] and broken["detail"].startswith("not writable")


def test_gpu_checks_say_so_where_nvml_is_not_there():
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("a GPU machine: the NVML checks run for real in the device script")
    (check,) = gpu_checks([0], own_pids=set())
    assert check["name"] == "nvml" and not check["ok"] and "unavailable" in check["detail"]


def test_the_collective_passes_over_a_good_network_and_fails_over_a_wrong_interface():
    good = collective_check(2, "cpu", dict(os.environ))
    assert good["ok"], good
    assert good["compute_ms"] > 0 and "gloo" in good["detail"]
    bad = collective_check(2, "cpu", {**os.environ, "GLOO_SOCKET_IFNAME": "nope0"})
    assert not bad["ok"] and "nope0" in bad["detail"], bad


class _Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_a_full_check_runs_at_start_then_only_when_idle_and_due_or_asked(tmp_path):
    clock = _Clock()
    checker = HealthChecker(
        gpus=1, gpu_kind="cpu", dirs=[tmp_path], env=dict(os.environ), every_s=60, clock=clock
    )
    assert checker.due(idle=True, asked=False)  # at the agent's start
    checker.start_full(set())
    assert checker.wait(120)
    report = checker.pending
    assert report["kind"] == "full" and report["ok"], report
    assert [c["name"] for c in report["checks"]] == [f"disk {tmp_path}", "collective"]
    assert report["device"]  # what the matmul ran on: compared only with the same
    assert not checker.due(idle=True, asked=True)  # the report has not reached the portal
    checker.ack(report)
    assert checker.pending is None
    clock.now = 30
    assert not checker.due(idle=True, asked=False)
    assert checker.due(idle=True, asked=True)  # the portal asks: once the node is idle
    assert not checker.due(idle=False, asked=True)
    clock.now = 61
    assert not checker.due(idle=False, asked=False)  # busy: the jobs come first
    assert checker.due(idle=True, asked=False)
    never = HealthChecker(gpus=1, gpu_kind="cpu", dirs=[tmp_path], env={}, every_s=0)
    assert not never.due(idle=True, asked=False) and never.due(idle=True, asked=True)


def _report(ok, reason="", compute_ms=None, kind="full", device="Xeon"):
    checks = [{"name": "collective", "ok": ok, "detail": reason or "all-reduce over 2 rank(s)"}]
    return {
        "kind": kind,
        "ok": ok,
        "checks": checks,
        "reason": reason,
        **({"compute_ms": compute_ms} if compute_ms is not None else {}),
        "device": device,
    }


@pytest.mark.django_db
def test_a_failed_check_holds_the_node_until_one_passes(make_nodes):
    (node,) = make_nodes(1, 2)
    now = timezone.now()
    node = actions.do_record_health(node, _report(False, "collective: rank 0 exited 1"), now=now)
    assert node.state == Node.State.CORDONED and held_for_health(node)
    assert node.state_reason == "health check failed: collective: rank 0 exited 1"
    assert Event.objects.filter(node=node, kind="node.health_failed").exists()
    # Asked again once HEALTH_RECHECK_S have passed since the last report.
    assert not wants_check(node, now)
    assert wants_check(node, now + timedelta(seconds=301))
    node = actions.do_record_health(node, _report(True), now=now + timedelta(seconds=301))
    assert node.state == Node.State.UP and node.state_reason == ""
    passed = Event.objects.get(node=node, kind="node.health_passed")
    assert "was held: health check failed" in passed.message


@pytest.mark.django_db
def test_a_gpus_own_xid_cordons_its_node_with_the_xid_as_the_reason(make_nodes):
    """The agent reports a node-fault Xid as a failed check (nodeagent/xid.py): the node is
    held, with the Xid named, until a full check passes."""
    (node,) = make_nodes(1, 8)
    report = fault_report([{"gpu": 3, "xid": 79, "at": 0.0}, {"gpu": 5, "xid": 48, "at": 0.0}])
    node = actions.do_record_health(node, report, now=timezone.now())
    assert node.state == Node.State.CORDONED and held_for_health(node)
    assert node.state_reason == (
        "health check failed: GPU 3: Xid 79 (GPU has fallen off the bus); "
        "GPU 5: Xid 48 (double-bit ECC error)"
    )
    failed = Event.objects.get(node=node, kind="node.health_failed")
    assert [c["name"] for c in failed.data["checks"]] == ["xid gpu 3", "xid gpu 5"]


@pytest.mark.django_db
def test_a_pass_never_releases_an_admins_cordon(make_nodes, make_user):
    (node,) = make_nodes(1, 2)
    admin = make_user("root", staff=True)
    actions.do_cordon_node(node, actor=admin, reason="rack maintenance", now=timezone.now())
    node = actions.do_record_health(node, _report(True), now=timezone.now())
    assert node.state == Node.State.CORDONED and node.state_reason == "rack maintenance"


@pytest.mark.django_db
def test_a_node_much_slower_than_the_fleet_fails_its_check(make_nodes):
    a, b, c = make_nodes(3, 2)
    now = timezone.now()
    actions.do_record_health(a, _report(True, compute_ms=10.0), now=now)
    actions.do_record_health(b, _report(True, compute_ms=12.0), now=now)
    slow = actions.do_record_health(c, _report(True, compute_ms=40.0), now=now)
    assert slow.state == Node.State.CORDONED
    assert "3.6x the fleet's median 11.0 ms" in slow.state_reason
    # Within the factor: fine.
    ok = actions.do_record_health(a, _report(True, compute_ms=15.0), now=now)
    assert ok.state == Node.State.UP
    # Another model in a mixed fleet is compared only with its own kind (none here).
    (d,) = make_nodes(1, 2, prefix="older")
    older = actions.do_record_health(d, _report(True, compute_ms=90.0, device="Older"), now=now)
    assert older.state == Node.State.UP


@pytest.mark.django_db
def test_an_attempt_refused_by_a_failed_quick_check_starts_elsewhere_without_a_restart(setup):
    team, user, (a, b), _ = setup
    job = submit(team, user, gpus=2, max_restarts=0)
    run_pass()
    attempt = live_attempt(job)
    (node,) = {al.node for al in attempt.allocations.all()}
    other = b if node == a else a
    body = {
        "boot_id": node.boot_id,
        "telemetry": [],
        "health": _report(False, "disk /ck: 0.1 GiB free, under 1.0 GiB", kind="quick"),
        "attempts": [
            {
                "attempt_id": attempt.id,
                "ranks": [],
                "records": [],
                "logs": [],
                "error": {"kind": "health", "message": "disk /ck: 0.1 GiB free, under 1.0 GiB"},
            }
        ],
    }
    actions.do_heartbeat(node, body, now=timezone.now())
    job.refresh_from_db()
    node.refresh_from_db()
    assert node.state == Node.State.CORDONED and held_for_health(node)
    # Requeued, not failed: max_restarts=0 and yet it runs again, and no node has a strike.
    assert job.state == Job.State.QUEUED and job.restart_count == 0, job.reason
    assert "failed its health check before the start" in job.reason
    assert not Event.objects.filter(kind="node.strike").exists()
    run_pass()
    second = live_attempt(job)
    assert {al.node_id for al in second.allocations.all()} == {other.id}


@pytest.mark.e2e
def test_an_agent_with_a_wrong_network_setting_is_cordoned_at_start(tmp_path):
    env_file = tmp_path / "bad.env"
    env_file.write_text("GLOO_SOCKET_IFNAME=nope0\n")
    live = LiveCluster(
        tmp_path / "cluster",
        agents=2,
        gpus_per_agent=1,
        env={"LOCKSTEP_AGENT_HEALTH_CHECK_S": "600"},
        agent_args={"e2e-b": ["--node-env-file", str(env_file)]},
    )
    try:
        live.start()
        api = Api(live.url, live.token("alice", "--team", "net", "--quota", "2"))

        def nodes():
            return {n["name"]: n for n in api.get("/api/v1/nodes/").json()["results"]}

        bad = wait_for(
            lambda: (n := nodes().get("e2e-b")) and n["state"] == "cordoned" and n, 120, "cordon"
        )
        assert "health check failed: collective" in bad["state_reason"]
        assert "nope0" in bad["state_reason"]
        assert nodes()["e2e-a"]["state"] == "up"
        response = api.post(
            "/api/v1/jobs/",
            {
                "name": "fine",
                "team": "net",
                "image": "lockstep/trainer:latest",
                "command": ["python", "-c", "print('ok')"],
                "gpus": 1,
            },
        )
        job = response.json()["id"]
        done = wait_for(
            lambda: (d := api.get(f"/api/v1/jobs/{job}/").json())["state"] == "SUCCEEDED" and d,
            120,
            "the job",
        )
        assert done["attempts"][0]["nodes"] == ["e2e-a"], done["attempts"][0]
    finally:
        live.stop()
