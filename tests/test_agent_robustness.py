"""Node agent: one attempt's trouble never silences the node or takes the other jobs down, and a
planned leave is never read as a success.

A launch that breaks off half-way (a full disk) and an attempt whose polling raises are failed
on their own, their ranks killed and reported exited, while the agent keeps heartbeating and the
other attempts run on; a forked worker is never taken for an earlier one that had its pid, nor
loses its exit status when its zygote is replaced; and every heartbeat of a leaving agent says
so, since the portal may not have heard the leaving call. Real processes throughout; the shared
helpers are in tests/nodeagent_helpers.py.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

import nodeagent.supervisor as supervisor_module
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
