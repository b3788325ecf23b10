"""`lockstep up` as a newcomer runs it: the whole platform in one command, stopped with Ctrl-C
(once, or twice in a hurry) and started again over the state it left.

Each test runs the real `lockstep up` in a process of its own, on a free port (never 8000) and
a var directory of its own (its own SQLite file and embedded Redis), so the suite can run while
someone uses `make up`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import requests
from django.utils import timezone

from jobs import actions
from jobs.actions.strikes import strike_node
from jobs.event_kinds import EventKind
from jobs.models import Event, Node
from nodeagent import exclusive
from portal.embedded_redis import start_embedded_redis
from portal.up import node_report
from portal.up_guard import descendants, leftovers, port_free, stop_leftovers
from tests.live import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
# A bound on one start: migrations, daphne, the agents' registration (2 cores, a cold cache).
START_TIMEOUT_S = 120
# "Within a few seconds": one Ctrl-C waits for the agents to stop their workers, then for the
# platform; two kill what is left at once.
STOP_TIMEOUT_S = 15
TWO_SIGNALS_STOP_S = 6


class Up:
    """One `lockstep up` process and what it printed."""

    def __init__(self, var: Path, port: int, *args: str, env: dict[str, str] | None = None):
        self.var, self.port = var, port
        self.url = f"http://127.0.0.1:{port}"
        env_over = env
        env = dict(os.environ, LOCKSTEP_VAR_DIR=str(var), PYTHONUNBUFFERED="1")
        # Its own embedded Redis and SQLite file, as on a laptop; never the suite's.
        env.pop("REDIS_URL", None)
        env.pop("DATABASE_URL", None)
        env.update(
            LOCKSTEP_RESTART_BACKOFF_S="1",
            LOCKSTEP_SCHEDULER_TICK_S="1",
            LOCKSTEP_THROTTLE_AUTH_FAILURES="1000000/min",
            # Rendezvous ports apart from a `make up` on the same machine.
            LOCKSTEP_MASTER_PORT_BASE=str(20000 + port % 9000),
            LOCKSTEP_MASTER_PORT_SPAN="3000",
        )
        env.update(env_over or {})
        lockstep = Path(sys.executable).parent / "lockstep"
        argv = [str(lockstep), "up"] if lockstep.exists() else [sys.executable, "-m", "portal.up"]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [*argv, "--port", str(port), *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a signal for it alone, as Ctrl-C is for the terminal's
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_up(self) -> requests.Session:
        """Until it says it is up; returns an API session with alice's token."""

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"lockstep up exited with {self.proc.returncode}:\n{self}")
            return "Lockstep is up" in self.output

        wait_for(ready, START_TIMEOUT_S, f"lockstep up to start:\n{self}")
        token = re.search(r"alice's API token: (\S+)", self.output).group(1)
        api = requests.Session()
        api.headers["Authorization"] = f"Bearer {token}"
        return api

    def get(self, api: requests.Session, path: str, **params):
        answer = api.get(self.url + path, params=params, timeout=15)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def interrupt(self, times: int = 1, gap_s: float = 0.2) -> dict[int, int]:
        """Ctrl-C `times` times; returns every process it had running below it (pid -> start
        time) just before."""
        below = descendants(self.proc.pid)
        for i in range(times):
            if i:
                time.sleep(gap_s)
            self.proc.send_signal(signal.SIGINT)
        return below

    def __str__(self) -> str:
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted((self.var / "logs").glob("*.log"))
        )
        return f"{self.output}\n{logs}"


def _alive(processes: dict[int, int]) -> list[str]:
    """Those of `processes` still alive (same pid and start time, not a zombie)."""
    left = []
    for pid, start in processes.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[19]) == start and fields[0] != "Z":
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            left.append(f"{pid} {cmdline.decode(errors='replace')[:120]}")
    return left


def _stop(up: Up, *, times: int = 1, within: float = STOP_TIMEOUT_S) -> float:
    """Stop it with `times` SIGINTs; assert everything it ran is gone and its port is free
    within `within` seconds; returns how long it took."""
    started = time.monotonic()
    below = up.interrupt(times)
    assert below, "lockstep up had no processes running"
    try:
        up.proc.wait(timeout=within)
    except subprocess.TimeoutExpired as exc:
        up.proc.kill()
        message = f"lockstep up still running {within:.0f}s after SIGINT:\n{up}"
        raise AssertionError(message) from exc
    took = time.monotonic() - started
    assert _alive(below) == [], f"left behind after {took:.1f}s:\n{_alive(below)}\n{up}"
    assert port_free(up.port), f"port {up.port} still taken after the stop"
    assert took < within
    return took


def _cleanup(up: Up) -> None:
    """After a test, pass or fail: stop `up` as Ctrl-C does, and kill whatever was below it
    that is still there (its children run in sessions of their own and outlive a SIGKILL)."""
    if up.proc.poll() is not None:
        return
    below = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGINT)
    try:
        up.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(up.proc.pid, signal.SIGKILL)
    for line in _alive(below):
        os.kill(int(line.split()[0]), signal.SIGKILL)


def _demo_job(up: Up, api, job_id: int | None = None) -> dict:
    """The demo job (the first one up submitted, unless `job_id` names it)."""
    if job_id is None:
        jobs = up.get(api, "/api/v1/jobs/")["results"]
        job_id = min(j["id"] for j in jobs if j["name"] == "demo-addition")
    return up.get(api, f"/api/v1/jobs/{job_id}/")


def _nodes(up: Up, api) -> dict[str, dict]:
    return {n["name"]: n for n in up.get(api, "/api/v1/nodes/")["results"]}


@pytest.mark.e2e
def test_two_ctrl_c_in_quick_succession_leave_no_process_behind(tmp_path):
    """A second Ctrl-C during the stop kills what is left instead of interrupting the stop:
    every process it started (workers of the agents included) is gone and the port free."""
    up = Up(tmp_path / "var", free_port())
    try:
        api = up.wait_up()
        # The demo job's workers are running too: the deepest processes it has.
        wait_for(lambda: _demo_job(up, api)["state"] == "RUNNING", 90, "the demo job to run")
        took = _stop(up, times=2, within=TWO_SIGNALS_STOP_S)
        assert "killing what is left" in up.output
        print(f"stopped with two SIGINTs in {took:.1f}s")
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)


@pytest.mark.e2e
def test_restarted_four_times_while_the_demo_job_runs(tmp_path):
    """Stopped and started four times while the demo job runs, `lockstep up` comes up every
    time with both nodes taking work and the demo job running again from its checkpoint.

    Each stop is a planned restart of both agents: the job is checkpoint-stopped and requeued
    without a strike or a restart (jobs.actions.nodes.do_node_leaving), so with strikes set
    to cordon at two no node is ever cordoned, and the job's restart count stays 0."""
    var, port = tmp_path / "var", free_port()
    resumed: list[str] = []  # what went wrong with the job's resume, restart by restart
    job_id = checkpoint_step = None
    released = 0
    handed_out: set[tuple[str, str]] = set()
    for cycle in range(5):  # the first start, then four restarts
        up = Up(var, port, env={"LOCKSTEP_STRIKES_TO_CORDON": "2"})
        try:
            api = up.wait_up()
            nodes = _nodes(up, api)
            states = {name: nodes[name]["state"] for name in ("local-a", "local-b")}
            assert states == {"local-a": "up", "local-b": "up"}, f"start {cycle}: {nodes}\n{up}"
            assert "warning" not in up.output and "did not" not in up.output, up.output
            released += up.output.count("uncordoned (it was cordoned automatically)")
            # The demo's password and token of the first start, every time (seed_demo --keep).
            password = re.search(r"alice / (\S+)", up.output).group(1)
            handed_out.add((password, re.search(r"alice's API token: (\S+)", up.output).group(1)))
            if cycle:
                assert _demo_job(up, api, job_id)["restart_count"] == 0, up
            if cycle == 0:
                job_id = _demo_job(up, api)["id"]
                # A checkpoint to resume from before the first restart.
                checkpoint_step = wait_for(
                    functools.partial(_checkpoint_step, up, api, job_id),
                    120,
                    "the demo job's first checkpoint",
                )
            else:
                try:
                    job = wait_for(
                        functools.partial(_running_again, up, api, job_id, cycle),
                        90,
                        f"the demo job to run again after restart {cycle}",
                    )
                    latest = job["attempts"][0]
                    if (latest["resumed_from_step"] or 0) < checkpoint_step:
                        resumed.append(f"restart {cycle}: resumed from {latest}")
                except AssertionError as exc:
                    job = _demo_job(up, api, job_id)
                    resumed.append(f"restart {cycle}: {exc}; job {job['state']}: {job['reason']}")
            took = _stop(up)
            print(f"start {cycle}: up, nodes {states}; stopped in {took:.1f}s")
        finally:
            if up.proc.poll() is None:
                os.killpg(up.proc.pid, signal.SIGKILL)
    assert released == 0, "a planned restart gave a node strikes enough to cordon it"
    assert len(handed_out) == 1, handed_out
    assert not resumed, "; ".join(resumed)


@pytest.mark.e2e
def test_a_second_start_over_a_running_platform_is_refused_and_changes_nothing(tmp_path):
    """`make up` in a second terminal while the first runs. It used to start agents of the
    same names and work dirs, whose start-up removed the running agents' containers as
    stale (the demo job killed three times, its restarts spent, its nodes struck), and to
    replace the running Redis's socket with its own and remove it at its stop. Now it says
    the platform is running, where, and how to stop it, and exits 2 having started nothing;
    the running platform's job keeps its attempt and its queue keeps its Redis."""
    var = tmp_path / "var"
    up = second = Up(var, free_port())
    try:
        api = up.wait_up()
        wait_for(lambda: _demo_job(up, api)["state"] == "RUNNING", 90, "the demo job to run")
        before = _demo_job(up, api)
        # On another port, so that only the var dir's lock can stop it.
        second = Up(var, free_port())
        assert second.proc.wait(timeout=60) == 3, second
        wait_for(lambda: "already running" in second.output, 5, "the refusal's message")
        assert f"pid {up.proc.pid}" in second.output and up.url in second.output, second.output
        assert "kill -INT" in second.output
        # What the old second start broke within seconds: give it the time to show.
        time.sleep(5)
        after = _demo_job(up, api)
        assert after["state"] == "RUNNING", after
        assert after["restart_count"] == 0, after
        assert [a["number"] for a in after["attempts"]] == [a["number"] for a in before["attempts"]]
        assert redis.Redis(unix_socket_path=str(var / "redis.sock")).ping()
        assert {n["state"] for n in _nodes(up, api).values()} == {"up"}
        _stop(up)
    finally:
        for started in {up, second}:
            _cleanup(started)


@pytest.mark.e2e
def test_a_start_after_a_killed_up_stops_what_it_left_and_the_job_resumes(tmp_path):
    """`lockstep up` SIGKILLed (an OOM kill, a closed terminal's kill -9): its children run in
    sessions of their own and outlive it, the portal holding the port and the agents their
    jobs. The next start stops them as its Ctrl-C would have (agents first: a planned
    restart, no strike, no restart used), says so, and comes up on the same port with the
    job resuming from its checkpoint."""
    var, port = tmp_path / "var", free_port()
    first = second = Up(var, port)
    try:
        api = first.wait_up()
        job_id = _demo_job(first, api)["id"]
        step = wait_for(
            functools.partial(_checkpoint_step, first, api, job_id), 120, "a checkpoint"
        )
        left = descendants(first.proc.pid)
        first.proc.kill()  # up alone: what it started lives on
        first.proc.wait(timeout=10)
        assert _alive(left) and not port_free(port)
        second = Up(var, port, env={"LOCKSTEP_STRIKES_TO_CORDON": "1"})
        api = second.wait_up()
        assert re.search(r"stopping \d+ process\(es\) that an earlier lockstep up", second.output)
        assert _alive(left) == [], _alive(left)
        assert {n["state"] for n in _nodes(second, api).values()} == {"up"}, second
        job = wait_for(
            functools.partial(_running_again, second, api, job_id, 1), 90, "the job to resume"
        )
        assert job["restart_count"] == 0, job
        assert job["attempts"][0]["resumed_from_step"] >= step, job["attempts"]
        _stop(second)
    finally:
        for started in {first, second}:
            _cleanup(started)
        for line in _alive(left if "left" in locals() else {}):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def _refused(up: Up) -> str:
    """Wait for `up` to exit; assert it was refused before it started anything."""
    try:
        assert up.proc.wait(timeout=60) == 3, up.output
    finally:
        if up.proc.poll() is None:  # it went on starting: stop all it started
            os.killpg(up.proc.pid, signal.SIGKILL)
    wait_for(lambda: "lockstep up:" in up.output, 5, "the refusal's message")
    assert "started" not in up.output, up.output
    assert not (up.var / "logs").exists() and not (up.var / "redis.sock").exists()
    return up.output


def test_a_start_over_a_var_dir_in_use_is_refused_before_anything_starts(tmp_path):
    var = tmp_path / "var"
    held = exclusive.hold(var / "up.lock", "lockstep up", url="http://127.0.0.1:1234")
    try:
        said = _refused(Up(var, free_port()))
    finally:
        os.close(held)
    assert f"already running over {var.resolve()} (pid {os.getpid()}" in said, said
    assert "http://127.0.0.1:1234" in said and "LOCKSTEP_VAR_DIR" in said


def test_check_says_whether_a_start_would_be_refused_and_starts_nothing(tmp_path):
    """`lockstep up --check`, which `make up` runs before it builds anything."""
    var = tmp_path / "var"
    check = [sys.executable, "-m", "portal.up", "--check"]
    env = dict(os.environ, LOCKSTEP_VAR_DIR=str(var))
    held = exclusive.hold(var / "up.lock", "lockstep up", url="http://127.0.0.1:1234")
    try:
        done = subprocess.run(check, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    finally:
        os.close(held)
    assert done.returncode == 3 and "already running over" in done.stderr, done
    done = subprocess.run(check, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done
    assert not (var / "logs").exists()
    os.close(exclusive.hold(var / "up.lock", "a test"))  # --check let go of the lock


def test_leftovers_are_up_s_own_children_only(tmp_path):
    """What a killed `lockstep up` left: a process with the var dir in its environment *and*
    one of up's command lines. A shell that exports the var dir, or an agent of another var
    dir, is not touched."""
    var = (tmp_path / "var").resolve()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    mine = dict(os.environ, LOCKSTEP_VAR_DIR=str(var))
    other = dict(os.environ, LOCKSTEP_VAR_DIR=str(tmp_path / "elsewhere"))
    started = {
        "agent": subprocess.Popen([*sleep, "-m", "nodeagent", "--name", "x"], env=mine),
        "shell": subprocess.Popen(sleep, env=mine),
        "other agent": subprocess.Popen([*sleep, "-m", "nodeagent"], env=other),
        "platform": subprocess.Popen([*sleep, "manage.py", "run_scheduler"], env=mine),
    }
    try:
        wait_for(
            lambda: all(Path(f"/proc/{p.pid}/environ").exists() for p in started.values()),
            10,
            "the processes to start",
        )
        found = leftovers(var)
        assert set(found["agent"]) == {started["agent"].pid}, found
        assert set(found["platform"]) == {started["platform"].pid}, found
        assert found["redis"] == {}
        stop_leftovers(found)
        assert started["agent"].wait(timeout=10) == -signal.SIGTERM
        assert started["platform"].wait(timeout=10) == -signal.SIGTERM
        assert started["shell"].poll() is None and started["other agent"].poll() is None
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait(timeout=10)


def test_a_start_on_a_taken_port_is_refused_before_anything_starts(tmp_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        said = _refused(Up(tmp_path / "var", port))
    assert f"port {port} is taken by another program" in said, said
    assert f"--port {port + 1}" in said
    # The refused start let go of the var dir: another start may take it.
    os.close(exclusive.hold(tmp_path / "var" / "up.lock", "a test"))


def test_the_embedded_redis_never_takes_a_live_servers_socket(tmp_path):
    """A Redis left running by a start killed before it could stop its children keeps its
    socket (its platform keeps its queue); the socket of one that died is replaced."""
    path = tmp_path / "r.sock"
    first = start_embedded_redis(path)
    try:
        with pytest.raises(RuntimeError, match="already answers on"):
            start_embedded_redis(path)
        assert redis.Redis(unix_socket_path=str(path)).ping()
    finally:
        first.kill()  # SIGKILL: its socket file stays, with no one behind it
        first.wait(timeout=10)
    assert path.exists()
    again = start_embedded_redis(path)
    try:
        assert redis.Redis(unix_socket_path=str(path)).ping()
    finally:
        again.kill()
        again.wait(timeout=10)


def _running_again(up: Up, api, job_id: int, cycle: int) -> dict | None:
    job = _demo_job(up, api, job_id)
    if job["state"] in ("FAILED", "SUCCEEDED", "CANCELLED"):
        raise AssertionError(f"job {job['state']}")
    attempts = job["attempts"]
    latest = max(attempts, key=lambda a: a["number"]) if attempts else None
    if job["state"] == "RUNNING" and latest and latest["number"] > cycle:
        job["attempts"] = [latest]
        return job
    return None


def _checkpoint_step(up: Up, api, job_id: int) -> int | None:
    return (_demo_job(up, api, job_id)["latest_checkpoint"] or {}).get("step")


def _cordon_by_strikes(node: Node, settings) -> None:
    settings.LOCKSTEP = {**settings.LOCKSTEP, "STRIKES_TO_CORDON": 1}
    strike_node(node, "agent on it restarted", now=timezone.now())
    node.refresh_from_db()
    assert node.state == "cordoned"


@pytest.mark.django_db
def test_only_an_automatic_cordon_is_released_with_an_event(make_nodes, make_user, settings):
    """What up does at start for its nodes: the strikes' cordon goes, with a node.uncordoned
    event saying by whom and why; an admin's cordon or drain stays."""
    auto, by_admin, drained, fine = make_nodes(4, 2)
    _cordon_by_strikes(auto, settings)
    admin = make_user("root", staff=True)
    actions.do_cordon_node(by_admin, actor=admin, reason="bad fan", now=timezone.now())
    actions.do_cordon_node(drained, actor=admin, reason="rma", drain=True, now=timezone.now())
    # Cordoned automatically once, uncordoned, then cordoned by an admin: the admin's.
    _cordon_by_strikes(fine, settings)
    actions.do_uncordon_node(fine, actor=admin)
    actions.do_cordon_node(fine, actor=admin, reason="testing", now=timezone.now())

    released = {
        node.name: actions.do_release_automatic_cordon(node, by="lockstep up", reason="demo")
        for node in (auto, by_admin, drained, fine)
    }
    assert released == {
        auto.name: True,
        by_admin.name: False,
        drained.name: False,
        fine.name: False,
    }
    states = dict(Node.objects.values_list("name", "state"))
    assert states == {
        auto.name: "up",
        by_admin.name: "cordoned",
        drained.name: "draining",
        fine.name: "cordoned",
    }
    event = Event.objects.filter(node=auto, kind=EventKind.NODE_UNCORDONED).get()
    assert "uncordoned by lockstep up: demo" in event.message
    assert "cordoned automatically" in event.message and event.data["automatic_cordon_released"]


@pytest.mark.django_db
def test_the_release_command_reports_every_node(make_nodes, settings, capsys):
    from django.core.management import call_command

    auto, other = make_nodes(2, 2)
    _cordon_by_strikes(auto, settings)
    call_command("release_automatic_cordons", "--by", "lockstep up", auto.name, other.name, "x")
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == {
        auto.name: {"state": "up", "reason": "", "released": True},
        other.name: {"state": "up", "reason": "", "released": False},
        "x": {"state": None, "reason": "not registered", "released": False},
    }


def test_the_node_report_says_each_nodes_true_state(tmp_path):
    from datetime import UTC, datetime, timedelta

    since = datetime.now(UTC)
    fresh, stale = (since + timedelta(seconds=1)).isoformat(), (since - timedelta(60)).isoformat()
    nodes = {
        "local-a": {
            "state": "cordoned",
            "state_reason": "3 failures in 24h",
            "gpus": 2,
            "last_heartbeat_at": fresh,
        },
        "local-b": {"state": "up", "state_reason": "", "gpus": 2, "last_heartbeat_at": stale},
        "local-d": {"state": "up", "state_reason": "", "gpus": 2, "last_heartbeat_at": fresh},
    }
    report = node_report(nodes, ["local-a", "local-b", "local-c", "local-d"], since, tmp_path)
    assert report.splitlines() == [
        "  local-a: registered but cordoned: 3 failures in 24h",
        f"  local-b: not registered; see {tmp_path / 'agent-local-b.log'}",
        f"  local-c: not registered; see {tmp_path / 'agent-local-c.log'}",
        "  local-d: registered, up (2 GPUs)",
    ]
