"""Node agent: one attempt's trouble never silences the node or takes the other jobs down, and a
planned leave is never read as a success.

A launch that breaks off half-way (a full disk) and an attempt whose polling raises are failed
on their own, their ranks killed and reported exited, while the agent keeps heartbeating and the
other attempts run on; a forked worker is never taken for an earlier one that had its pid, nor
loses its exit status when its zygote is replaced; and every heartbeat of a leaving agent says
so, since the portal may not have heard the leaving call. A kill that does not take (a process
group that outlives SIGKILL, a container `rm --force` that fails) is tried again, its ranks
reported running until they are gone, and refuses launches onto their GPUs if it lasts. Real
processes throughout (and real podman where there is one); only an engine's failures are faked,
at its subprocess boundary. The shared helpers are in tests/nodeagent_helpers.py.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import nodeagent.supervisor as supervisor_module
from nodeagent.container import Engine
from nodeagent.supervisor import WorkerSupervisor
from nodeagent.zygote import ForkedWorker, Zygote
from tests.nodeagent_helpers import (
    SLEEPER,
    clean_env_fixture,  # noqa: F401 (fixture)
    launch_spec,
    one_rank,
    portal_fixture,  # noqa: F401 (fixture)
    process_alive,
    read_pids,
    run_item,
    running_agent_fixture,  # noqa: F401 (fixture)
    supervisor_factory_fixture,  # noqa: F401 (fixture)
    wait_launched,
    wait_until,
    warm_supervisor,
)

pytestmark = pytest.mark.timeout(120)

TWO_RANKS = [
    {"rank": 0, "local_rank": 0, "gpu_index": 0},
    {"rank": 1, "local_rank": 1, "gpu_index": 1},
]


def _exited_report(portal, attempt_id: int):
    """The first accepted report of the attempt in which every rank has exited."""
    for report in portal.attempt_in_beats(attempt_id):
        if report["ranks"] and all(r["state"] == "exited" for r in report["ranks"]):
            return report
    return None


def _log_text(portal, attempt_id: int) -> str:
    return "".join(
        chunk["text"] for report in portal.attempt_in_beats(attempt_id) for chunk in report["logs"]
    )


def _script(tmp_path: Path, name: str, text: str) -> list[str]:
    path = tmp_path / name
    path.write_text(text)
    return ["python", str(path)]


# -- a planned leave ------------------------------------------------------------------------

TERM_EXIT0 = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
open(os.environ["LOCKSTEP_METRICS_PATH"] + ".up", "w").close()
time.sleep(60)
"""


def test_every_heartbeat_of_a_leaving_agent_says_so_while_the_leaving_call_fails(
    running_agent, portal
):
    """A trainer checkpoints and exits 0 on the leave's SIGTERM; if the leaving call did not
    get through, only the beat itself can keep the portal from ending the attempt succeeded."""
    real = portal.handle
    leaving_tries = []

    def handle(path, token, body):
        if path == "/api/v1/agent/leaving/":
            leaving_tries.append(body)
            return 503, {"detail": "database is locked"}
        return real(path, token, body)

    portal.handle = handle
    portal.set_desired([run_item(51, launch_spec(TERM_EXIT0, one_rank()))])
    attempt = wait_launched(running_agent, 51)
    up = Path(str(attempt.workers[0].metrics_path) + ".up")
    wait_until(up.exists, what="the worker to start")
    before = len(portal.beats_since(0))
    assert before and not any("leaving" in beat for beat in portal.beats_since(0))

    running_agent.request_leave(signal.SIGTERM)
    report = wait_until(lambda: _exited_report(portal, 51), what="the exit in an accepted beat")
    assert report["ranks"][0]["exit_code"] == 0
    exit_beat = next(b for b in portal.beats_since(0) if report in b["attempts"])
    assert exit_beat.get("leaving") is True
    wait_until(lambda: len(leaving_tries) >= 2, what="the leaving call to be tried again")
    # The beat in flight when the leave was asked may not say so; its data predates the
    # SIGTERM. Every later one does.
    assert all(beat.get("leaving") is True for beat in portal.beats_since(before + 1))
    assert portal.leaving == []


# -- a launch that breaks off ---------------------------------------------------------------


def test_a_launch_that_fails_writing_its_files_is_killed_reported_exited_and_the_agent_beats_on(
    running_agent, portal, monkeypatch
):
    def disk_full(self, attempt):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(WorkerSupervisor, "_write_workers_file", disk_full)
    portal.set_desired([run_item(41, launch_spec(SLEEPER, one_rank()))])
    report = wait_until(lambda: _exited_report(portal, 41), what="the failed attempt's exit")
    assert report["ranks"][0]["exit_code"] == -signal.SIGKILL
    assert not process_alive(report["ranks"][0]["pid"])
    wait_until(lambda: "launch failed: OSError" in _log_text(portal, 41), what="the reason")
    # The node's fault, not the job's: refused by its health, and a failed check to cordon it.
    assert report["error"]["kind"] == "health" and "No space left" in report["error"]["message"]
    health = wait_until(
        lambda: next((b["health"] for b in portal.beats_since(0) if "health" in b), None),
        what="the failed health report",
    )
    assert health["ok"] is False and "launch: launch failed: OSError" in health["reason"]

    # The node still answers its portal: given up, the attempt's exit is recorded and forgotten.
    portal.set_desired([])
    wait_until(lambda: 41 not in running_agent.supervisor, what="the attempt forgotten")
    beats = len(portal.beats_since(0))
    wait_until(lambda: len(portal.beats_since(0)) > beats + 2, what="more heartbeats")


def test_a_launch_broken_off_between_ranks_kills_those_started_and_starts_no_more(
    supervisor_factory, monkeypatch
):
    real = supervisor_module.expand_command

    def expand(command, env):
        if env["RANK"] == "1":  # rank 0 is running by now
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(command, env)

    monkeypatch.setattr(supervisor_module, "expand_command", expand)
    sup = supervisor_factory()
    attempt = sup.launch(8, launch_spec(SLEEPER, TWO_RANKS))
    assert sup.wait(8, timeout_s=10)
    codes = [r["exit_code"] for r in sup.status(8)]
    assert codes == [-signal.SIGKILL, supervisor_module.EXIT_NOT_FOUND]
    assert attempt.workers[1].pid is None  # never started
    assert not process_alive(attempt.workers[0].pid)
    assert "launch failed: OSError" in attempt.workers[1].log_path.read_text()
    assert not (attempt.dir / "workers.json").exists()


# -- an attempt whose polling raises -------------------------------------------------------


class _Unpollable:
    """A worker handle whose poll() raises, as a bug or a vanished file would."""

    def __init__(self, popen):
        self._popen = popen
        self.pid = popen.pid

    def poll(self):
        raise RuntimeError("cannot read the worker's state")


def test_an_attempt_whose_polling_raises_is_failed_and_the_others_run_on(running_agent, portal):
    portal.set_desired(
        [
            run_item(61, launch_spec(SLEEPER, one_rank())),
            run_item(62, launch_spec(SLEEPER, [{"rank": 0, "local_rank": 0, "gpu_index": 1}])),
        ]
    )
    broken, healthy = wait_launched(running_agent, 61), wait_launched(running_agent, 62)
    broken_pid, _ = read_pids(broken.workers[0].metrics_path)
    healthy_pid, _ = read_pids(healthy.workers[0].metrics_path)
    broken.workers[0].popen = _Unpollable(broken.workers[0].popen)

    report = wait_until(lambda: _exited_report(portal, 61), what="the failed attempt's exit")
    assert report["ranks"][0]["exit_code"] == -signal.SIGKILL
    wait_until(lambda: not process_alive(broken_pid), what="its rank killed")
    wait_until(lambda: "supervising it failed" in _log_text(portal, 61), what="the reason")
    # The agent's loop lives on, and with it the other job.
    beats = len(portal.beats_since(0))
    wait_until(lambda: len(portal.beats_since(0)) > beats + 2, what="more heartbeats")
    assert process_alive(healthy_pid)
    assert portal.attempt_in_beats(62, since=beats)[-1]["ranks"][0]["state"] == "running"


# -- a kill that does not take ---------------------------------------------------------------

LOST_KILLS = 3


def test_a_failed_attempts_rank_is_reported_running_until_a_retried_kill_has_ended_its_group(
    supervisor_factory, monkeypatch
):
    """fail() reported the ranks exited (-9) right after sending SIGKILL, without looking: a
    process group the kill did not end (a thread stuck in a driver) held its GPUs while the
    portal gave them away. Here the first SIGKILLs are lost: the rank is reported running
    while it lives, and exited once a retry has killed its whole group."""
    sup = supervisor_factory()
    attempt = sup.launch(21, launch_spec(SLEEPER, one_rank()))
    worker_pid, child_pid = read_pids(attempt.workers[0].metrics_path)
    sup.poll()
    real, sent = WorkerSupervisor._signal_group, []

    def lossy(self, worker, sig):
        sent.append(sig)
        if len(sent) > LOST_KILLS:
            real(self, worker, sig)

    monkeypatch.setattr(WorkerSupervisor, "_signal_group", lossy)
    attempt.workers[0].popen = _Unpollable(attempt.workers[0].popen)  # what made it give up
    sup.fail(21, "supervising it failed: RuntimeError: a test")
    for _ in range(LOST_KILLS):  # fail()'s SIGKILL, then one per poll, are lost
        assert process_alive(worker_pid) and process_alive(child_pid)
        assert [(r["state"], r["exit_code"]) for r in sup.status(21)] == [("running", None)]
        sup.poll()
    wait_until(lambda: (sup.poll(), sup.all_exited(21))[1], what="the kill confirmed")
    assert sup.status(21)[0]["exit_code"] == -signal.SIGKILL
    assert not process_alive(worker_pid) and not process_alive(child_pid)
    assert sent[LOST_KILLS:] and set(sent) == {signal.SIGKILL}
    assert attempt.pending_kill is None


def test_a_kill_unconfirmed_for_long_refuses_launches_onto_its_gpus_until_it_is_confirmed(
    tmp_path, clean_env, monkeypatch
):
    """The portal may release a fenced attempt's GPUs before its ranks are gone: a launch onto
    a GPU whose kill is unconfirmed for KILL_CONFIRM_S is refused by the node's health (the
    portal cordons the node and starts the job elsewhere); others go ahead, and so does that
    GPU's once the kill is seen to work."""
    from nodeagent import kill_confirm
    from nodeagent.agent import Agent

    for key in list(os.environ):
        if key not in clean_env:
            monkeypatch.delenv(key)
    agent = Agent(
        "http://127.0.0.1:9", "token", 2, name="node-k", work_dir=tmp_path / "agent", gpu_kind="cpu"
    )
    sup, now = agent.supervisor, [1000.0]
    sup._clock = lambda: now[0]

    def on_gpu(attempt_id: int, gpu: int):
        ckpt = tmp_path / "ckpt" / f"job-{attempt_id}"
        ranks = [{"rank": 0, "local_rank": 0, "gpu_index": gpu}]
        spec = launch_spec(SLEEPER, ranks, checkpoint_dir=str(ckpt), resume_from="")
        agent._launch(attempt_id, spec)
        return sup.get(attempt_id)

    try:
        fenced = on_gpu(31, 0)
        read_pids(fenced.workers[0].metrics_path)
        real = WorkerSupervisor._signal_group
        monkeypatch.setattr(WorkerSupervisor, "_signal_group", lambda self, worker, sig: None)
        sup.kill(31)  # fencing; its SIGKILLs do not take
        now[0] += kill_confirm.KILL_CONFIRM_S - 1
        sup.poll()
        assert sup.stuck_kills([0]) == []  # a healthy kill takes a moment
        now[0] += 1
        sup.poll()
        assert sup.status(31)[0]["state"] == "running"

        refused = on_gpu(32, 0)
        assert refused.workers == [] and refused.error["kind"] == "health"
        assert "attempt 31's ranks could not be confirmed killed" in refused.error["message"]
        assert agent.health.pending["ok"] is False
        assert (
            "kill: attempt 31's ranks could not be confirmed killed"
            in (agent.health.pending["reason"])
        )
        elsewhere = on_gpu(33, 1)
        assert elsewhere.error is None and len(elsewhere.workers) == 1

        monkeypatch.setattr(WorkerSupervisor, "_signal_group", real)  # the kill takes now
        wait_until(lambda: (sup.poll(), sup.all_exited(31))[1], what="the kill confirmed")
        assert sup.status(31)[0]["exit_code"] == -signal.SIGKILL
        agent.health.pending = None
        again = on_gpu(34, 0)
        assert again.error is None and len(again.workers) == 1
    finally:
        monkeypatch.undo()
        sup.kill_all()
        for attempt_id in sup.attempt_ids():
            sup.wait(attempt_id, 10)
        sup.close()


def test_engine_remove_says_whether_the_container_is_gone():
    """Engine.remove said nothing: an `rm --force` that failed or hung was taken for done. The
    engine's subprocess is faked here: a failing engine cannot be had on demand."""
    answers = {}

    class Scripted(Engine):
        def _run(self, args, timeout=60.0):
            answer = answers[args[0]]
            if answer == "hang":
                raise subprocess.TimeoutExpired([self.binary, *args], timeout)
            return subprocess.CompletedProcess([self.binary, *args], *answer)

    engine = Scripted("podman", "/no/podman")
    answers["rm"] = (0, "c\n", "")
    assert engine.remove("c") is True
    answers["rm"] = "hang"
    assert engine.remove("c") is False
    answers["rm"] = (125, "", "Error: cannot remove container c")
    for inspect, gone in [
        ((0, "running\n", ""), False),
        ((0, "exited\n", ""), True),
        ((125, "", "Error: inspecting object: no such container c"), True),
        ((125, "", "Error: cannot connect to the engine"), False),
        ("hang", False),
    ]:
        answers["inspect"] = inspect
        assert engine.remove("c") is gone, inspect


PODMAN = Engine.detect("podman")
IMAGE = "localhost/lockstep/trainer:latest"
IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
"""


@dataclass(frozen=True)
class _RmFails(Engine):
    """Real podman, but its first `rm`s fail: one with an error, one past its timeout."""

    failures: list = field(default_factory=lambda: ["error", "timeout"], compare=False)
    rms: list = field(default_factory=list, compare=False)

    def _run(self, args, timeout=60.0):
        if args[0] == "rm":
            self.rms.append(self.failures.pop(0) if self.failures else "done")
            if self.rms[-1] == "timeout":
                raise subprocess.TimeoutExpired([self.binary, *args], timeout)
            if self.rms[-1] == "error":
                return subprocess.CompletedProcess(args, 125, "", "Error: a test's failure")
        return super()._run(args, timeout)


@pytest.mark.skipif(
    PODMAN is None or not PODMAN.image_present(IMAGE), reason=f"no podman or no {IMAGE}"
)
@pytest.mark.parametrize("how", ["fencing", "stop deadline", "fail"])
def test_a_container_whose_removal_fails_is_removed_again_and_its_ranks_exit_once_it_is_gone(
    tmp_path, monkeypatch, how
):
    """A failed `rm --force` was forgotten: the container could run on, holding its GPUs. It is
    tried again on later polls, and the ranks are reported running until it worked, even once
    the container's `podman run` client is gone (the container runs on without it). The
    failures are a fake at the engine's subprocess boundary (`_RmFails._run`), since real
    podman cannot be made to fail on demand; the container and every other call are real."""
    from nodeagent import kill_confirm

    engine, now = _RmFails("podman", PODMAN.binary), [0.0]
    sup = WorkerSupervisor(
        tmp_path / "work", engine=engine, node="rmfails", gpu_kind="cpu", clock=lambda: now[0]
    )

    def poll_later():  # when the next removal is due
        now[0] += kill_confirm.REMOVE_RETRY_S
        sup.poll()

    def returned():  # the removal runs off the loop: until a poll has taken its result
        pending = attempt.pending_kill
        done = pending is None or pending.removal is None
        return done or (sup.poll(), False)[1]

    ckpt = tmp_path / "ckpt" / "job-5"
    spec = launch_spec(
        IGNORES_TERM, one_rank(), image=IMAGE, team_id=1, checkpoint_dir=str(ckpt), resume_from=""
    )
    try:
        attempt = sup.launch(71, spec)
        wait_until(lambda: (sup.poll(), attempt.workers[0].pid)[1], 60, "the rank to start")
        name = attempt.container.name
        if how == "fencing":
            sup.kill(71)
        elif how == "stop deadline":
            sup.stop(71, 0)
            sup.poll()
        else:
            sup.fail(71, "supervising it failed: RuntimeError: a test")
        wait_until(returned, 30, "the first removal's result")
        assert engine.rms == ["error"]
        attempt.container.popen.kill()
        attempt.container.popen.wait()
        sup.poll()
        assert engine.rms == ["error"]  # not due yet
        poll_later()
        wait_until(returned, 30, "the second removal's result")
        assert engine.rms == ["error", "timeout"]
        assert not PODMAN.stopped(name)  # it runs on
        assert [(r["state"], r["exit_code"]) for r in sup.status(71)] == [("running", None)]

        wait_until(lambda: (poll_later(), sup.all_exited(71))[1], 30, "the ranks' exits")
        assert engine.rms == ["error", "timeout", "done"]
        assert sup.status(71)[0]["exit_code"] == -signal.SIGKILL
        assert PODMAN.stopped(name) and attempt.pending_kill is None
    finally:
        sup.kill_all()
        sup.close()


# -- the zygote's workers -------------------------------------------------------------------


def test_an_exit_filed_under_a_pid_is_not_a_later_workers_with_that_pid():
    zygote = Zygote(env={})  # never started: its messages are fed by hand
    zygote._handle({"exit": 4242, "code": 7, "at": 1.0})
    zygote._handle({"id": 1, "pid": 4242})  # pids wrapped round: a new worker got 4242
    assert ForkedWorker(zygote, 4242).poll() is None
    zygote._handle({"exit": 4242, "code": 3, "at": 2.0})
    worker = ForkedWorker(zygote, 4242)
    assert (worker.poll(), worker.exited_at) == (3, 2.0)
    assert zygote.take_exit(4242) is None  # handed out once


EXIT7 = "import sys; sys.exit(7)\n"
SLEEP = "import time; time.sleep(60)\n"
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


@pytest.mark.skipif(
    not os.access(NS_LAST_PID, os.W_OK), reason="setting the next pid needs root (ns_last_pid)"
)
def test_a_forked_worker_given_an_earlier_workers_pid_runs_on(tmp_path):
    sup, _ = warm_supervisor(tmp_path)
    exit7, sleep = _script(tmp_path, "exit7.py", EXIT7), _script(tmp_path, "sleep.py", SLEEP)
    try:
        reused = None
        for attempt_id in range(1, 12, 2):
            first = sup.launch(attempt_id, launch_spec("", TWO_RANKS, command=exit7))
            assert sup.wait(attempt_id, 30)
            old_pid = first.workers[0].pid
            # The pid counter wraps round to old_pid (what a week of data loaders does).
            NS_LAST_PID.write_text(str(old_pid - 1))
            second = sup.launch(attempt_id + 1, launch_spec("", TWO_RANKS, command=sleep))
            if second.workers[0].pid == old_pid:
                reused = second
                break
            sup.kill(attempt_id + 1)
            sup.wait(attempt_id + 1, 10)
        assert reused is not None, "could not get the pid reused"
        assert isinstance(reused.workers[0].popen, ForkedWorker)
        sup.poll()
        assert reused.workers[0].alive and reused.workers[0].exit_code is None
        assert process_alive(reused.workers[0].pid)
    finally:
        sup.kill_all()
        sup.close()


FLAG_WAIT = """
import os, sys, time
flag = os.environ["LOCKSTEP_METRICS_PATH"] + ".go"
while not os.path.exists(flag):
    time.sleep(0.05)
sys.exit(int(os.environ["RANK"]) + 3)
"""


def test_a_replaced_zygote_stays_until_its_workers_exit_so_their_statuses_are_real(tmp_path):
    sup, warmmod = warm_supervisor(tmp_path)
    command = _script(tmp_path, "wait_flag.py", FLAG_WAIT)
    try:
        first = sup.launch(1, launch_spec("", TWO_RANKS, command=command))
        assert all(isinstance(w.popen, ForkedWorker) for w in first.workers)
        old = sup._zygote
        # A deploy while attempt 1 runs; another attempt then launches on the node.
        stamp = warmmod.stat().st_mtime + 5
        os.utime(warmmod, (stamp, stamp))
        ranks = [{**r, "gpu_index": r["gpu_index"] + 2} for r in TWO_RANKS]
        sup.launch(2, launch_spec("", ranks, command=command))
        assert sup._zygote is not old
        sup.poll()
        assert old.alive()  # its workers still run

        for worker in first.workers:
            Path(str(worker.metrics_path) + ".go").write_text("")
        assert sup.wait(1, 30)
        assert [w.exit_code for w in first.workers] == [3, 4]
        wait_until(lambda: not old.alive(), what="the old zygote closed once they exited")
    finally:
        sup.kill_all()
        sup.close()


def test_an_attempt_whose_report_fails_is_sent_with_its_ranks_and_the_others_whole(monkeypatch):
    """A report that raises for one attempt (its tails unreadable) used to fail the whole
    heartbeat: the node went silent, the portal declared it lost, and its fencing never
    reached the workers."""
    import logging

    from nodeagent import heartbeat_body
    from nodeagent.attempt_report import Tracked

    class Supervisor:
        def attempt_ids(self):
            return [1, 2]

        def status(self, attempt_id):
            return [{"rank": 0, "state": "running"}]

    def report(supervisor, attempt_id, tracked, log):
        if attempt_id == 1:
            raise OSError(errno.EIO, "Input/output error")
        return {"attempt_id": 2, "ranks": [], "records": [{"kind": "step"}]}, [("t", 5)], True

    class Health:
        pending = None

    class Telemetry:
        faults: list = []

        def read(self):
            return []

    monkeypatch.setattr(heartbeat_body, "attempt_report", report)
    tracked: dict[int, Tracked] = {}

    def build():
        return heartbeat_body.build_heartbeat(
            Supervisor(),
            tracked,
            boot_id="b",
            telemetry=Telemetry(),
            health=Health(),
            leaving=False,
            log=logging.getLogger("test"),
        )

    body, acks, exits = build()
    first, second = body["attempts"]
    assert first == {"attempt_id": 1, "ranks": [{"rank": 0, "state": "running"}], "records": []}
    assert second["records"] == [{"kind": "step"}]
    assert acks == [("t", 5)] and exits == [2]  # nothing of attempt 1 acknowledged or done

    # Its rank exits: the exit is held back while its data (the final checkpoint's record)
    # cannot be read, since the portal ends an attempt on its exits; not for ever.
    exited = {"rank": 0, "state": "exited", "exit_code": 0}
    monkeypatch.setattr(Supervisor, "status", lambda self, attempt_id: [dict(exited)])
    seen = []
    for _ in range(heartbeat_body.HOLD_EXITS_BEATS):  # the first failure was the beat above
        body, _, _ = build()
        seen.append(body["attempts"][0]["ranks"][0]["state"])
    assert seen[:-1] == ["running"] * (heartbeat_body.HOLD_EXITS_BEATS - 1) and seen[-1] == "exited"


def test_a_container_launch_the_engine_fails_is_refused_by_the_nodes_health_once(
    supervisor_factory,
):
    """Unregistered, a container launch that raised was launched again at every heartbeat
    (and could create a container each time) until the portal's start timeout."""

    class BrokenEngine:
        def launch(self, attempt_id, launch, attempt_dir):
            raise OSError(errno.ENOSPC, "No space left on device")

    sup = supervisor_factory()
    sup._containers = BrokenEngine()
    attempt = sup.launch(9, launch_spec(SLEEPER, one_rank()))
    assert attempt.error["kind"] == "health" and "No space left" in attempt.error["message"]
    assert 9 in sup and attempt.workers == []
    with pytest.raises(ValueError, match="already has workers"):
        sup.launch(9, launch_spec(SLEEPER, one_rank()))
