"""Container engine calls that can block run off the agent's loop (nodeagent/engine_calls.py).

A hung or crawling engine (`rm --force` waiting its minute) blocked the agent's loop: its
heartbeats stopped, the portal declared the node lost, and every job on it was restarted
elsewhere although only one container's removal was slow. Here the engine's `rm` hangs for
real: a `podman` of the test's own on PATH, which hangs on `rm` while a file exists and hands
everything else (and then `rm` too) to the real podman. Also: a removal past its timeout counts
as failed and the next one starts once it returned (never two at once for a container); a
failing `ps` is an error, not "no containers"; and stale containers that could not be removed
at start-up are tried again while the agent runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from nodeagent import container as container_module
from nodeagent import container_launch, engine_calls, kill_confirm
from nodeagent.container import Engine, EngineError
from nodeagent.engine_calls import EngineCalls
from nodeagent.supervisor import WorkerSupervisor
from nodeagent.workers import AttemptWorkers, RankWorker
from tests.nodeagent_helpers import (
    CLUSTER_TOKEN,
    clean_env_fixture,  # noqa: F401 (fixture)
    launch_spec,
    one_rank,
    portal_fixture,  # noqa: F401 (fixture)
    run_item,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

PODMAN = Engine.detect("podman")
IMAGE = "localhost/lockstep/trainer:latest"
IGNORES_TERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
"""
# The test's podman: each call of the verb (`rm`, `kill`, `image inspect`...) is noted in
# calls.log and waits while `hang` exists, then is real; every other call is real at once.
FAKE_PODMAN = """#!/bin/sh
case "$1 $2" in
    "{verb} "*|"{verb}")
        echo "$@" >> "{dir}/calls.log"
        while [ -e "{dir}/hang" ]; do sleep 0.05; done;;
esac
exec {real} "$@"
"""
NEEDS_IMAGE = pytest.mark.skipif(
    PODMAN is None or not PODMAN.image_present(IMAGE), reason=f"no podman or no {IMAGE}"
)


def _agent_on_a_hanging_engine(verb, tmp_path, portal, clean_env, monkeypatch, name):
    """An Agent whose `podman` hangs on `verb` while tmp_path/bin/hang exists; returns it and
    a function counting the verb's calls so far."""
    from nodeagent.agent import Agent

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "podman").write_text(FAKE_PODMAN.format(dir=fake, real=PODMAN.binary, verb=verb))
    (fake / "podman").chmod(0o755)
    for key in list(os.environ):
        if key not in clean_env:
            monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    agent = Agent(
        portal.url,
        CLUSTER_TOKEN,
        1,
        name=name,
        work_dir=tmp_path / "agent",
        gpu_kind="cpu",
        runtime="podman",
    )
    assert agent.engine.binary == str(fake / "podman")
    log = fake / "calls.log"

    def calls() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    return agent, calls


@contextlib.contextmanager
def _agent_running(agent):
    """Run the agent's loop in a thread; yields a list the test adds its containers' names
    to. On the way out the engine answers again, the agent stops, and the containers go."""
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    containers: list[str] = []
    try:
        yield containers
    finally:
        (Path(agent.engine.binary).parent / "hang").unlink(missing_ok=True)
        agent.request_stop()
        thread.join(timeout=90)
        for name in containers:
            PODMAN.remove(name)
    assert not thread.is_alive()


def _running_in_a_container(agent, portal, attempt_id: int, containers: list[str]) -> str:
    """Wait until the attempt's rank runs (a pid in the heartbeats); its container's name,
    added to `containers` (removed at the end)."""
    wait_until(
        lambda: any(r["ranks"][0]["pid"] is not None for r in portal.attempt_in_beats(attempt_id)),
        90,
        f"attempt {attempt_id}'s rank to run in its container",
    )
    name = agent.supervisor.get(attempt_id).container.name
    containers.append(name)
    return name


@NEEDS_IMAGE
def test_the_agent_beats_on_while_the_engines_rm_hangs_and_reports_the_ranks_gone_once_it_worked(
    tmp_path, portal, clean_env, monkeypatch
):
    """The agent fences a container whose `rm --force` hangs: heartbeats keep coming, each with
    the rank running (the kill is not confirmed); a removal past its timeout is tried again;
    once `rm` works the rank is reported exited (-9) and the container is gone."""
    # An `rm` past this is killed and counts as failed (60 s in the field).
    monkeypatch.setattr(container_module, "REMOVE_TIMEOUT_S", 3.0)
    agent, rms = _agent_on_a_hanging_engine(
        "rm", tmp_path, portal, clean_env, monkeypatch, "hung-rm"
    )
    hang = tmp_path / "bin" / "hang"

    ckpt = tmp_path / "ckpt" / "job-5"
    spec = launch_spec(
        IGNORES_TERM, one_rank(), image=IMAGE, team_id=1, checkpoint_dir=str(ckpt), resume_from=""
    )
    portal.set_desired([run_item(81, spec)])
    with _agent_running(agent) as containers:
        name = _running_in_a_container(agent, portal, 81, containers)
        hang.touch()
        portal.set_desired([])  # fencing: the agent kills the attempt
        wait_until(lambda: rms() >= 1, 30, "the fencing's rm")
        first_rm = len(portal.beats_since(0))
        time.sleep(2.0)  # the rm hangs meanwhile (it counts as failed only after 3 s)
        during = portal.beats_since(first_rm)
        assert len(during) >= 5, f"{len(during)} heartbeat(s) in 2 s while `rm` hung"
        wait_until(lambda: rms() >= 2, 30, "a second rm once the first timed out")
        hung = portal.attempt_in_beats(81, since=first_rm)
        assert hung and all(r["ranks"][0]["state"] == "running" for r in hung)
        assert not PODMAN.stopped(name)  # it runs on: the kill is not confirmed

        hang.unlink()  # the engine answers again
        wait_until(
            lambda: any(r["ranks"][0]["state"] == "exited" for r in portal.attempt_in_beats(81)),
            60,
            "the rank reported exited",
        )
        exited = [r for r in portal.attempt_in_beats(81) if r["ranks"][0]["state"] == "exited"]
        assert exited[0]["ranks"][0]["exit_code"] == -signal.SIGKILL
        assert PODMAN.stopped(name)


@NEEDS_IMAGE
def test_a_stops_sigterm_through_a_hung_engine_neither_silences_the_agent_nor_holds_its_deadline(
    tmp_path, portal, clean_env, monkeypatch
):
    """A stop's SIGTERM goes through the engine (`podman kill --signal TERM`, up to 30 s, as
    long as the portal's heartbeat timeout): made on the loop, a wedged engine turned a planned
    stop into a lost node. Here `kill` hangs: heartbeats go on, and the stop's deadline removes
    the container (a real `rm`) while the SIGTERM is still stuck."""
    agent, kills = _agent_on_a_hanging_engine(
        "kill", tmp_path, portal, clean_env, monkeypatch, "hung-kill"
    )
    hang = tmp_path / "bin" / "hang"
    spec = launch_spec(
        IGNORES_TERM,
        one_rank(),
        image=IMAGE,
        team_id=1,
        checkpoint_dir=str(tmp_path / "ckpt" / "job-6"),
        resume_from="",
    )
    portal.set_desired([run_item(82, spec)])
    with _agent_running(agent) as containers:
        name = _running_in_a_container(agent, portal, 82, containers)
        hang.touch()
        portal.set_desired([{"attempt_id": 82, "action": "stop", "deadline_s": 3}])
        wait_until(lambda: kills() >= 1, 30, "the stop's SIGTERM through the engine")
        first = len(portal.beats_since(0))
        time.sleep(2.0)
        during = portal.beats_since(first)
        assert len(during) >= 5, f"{len(during)} heartbeat(s) in 2 s while `kill` hung"
        wait_until(
            lambda: any(r["ranks"][0]["state"] == "exited" for r in portal.attempt_in_beats(82)),
            60,
            "the rank ended by the stop's deadline",
        )
        exited = [r for r in portal.attempt_in_beats(82) if r["ranks"][0]["state"] == "exited"]
        assert exited[0]["ranks"][0]["exit_code"] == -signal.SIGKILL  # it ignored SIGTERM
        assert hang.exists() and PODMAN.stopped(name)  # removed while `kill` still hung


@NEEDS_IMAGE
def test_a_launch_waits_for_a_hung_image_inspect_off_the_loop_and_a_timeout_is_the_nodes(
    tmp_path, portal, clean_env, monkeypatch
):
    """Before a container starts, `image inspect` says whether the image is here. A wedged
    engine took its minute to answer on the loop. Now the heartbeats go on; an inspect past
    its timeout refuses the attempt as the node's fault (kind "health": the portal starts the
    job elsewhere, without using a restart), not the image's; and once the engine answers, a
    launch starts as before."""
    agent, inspects = _agent_on_a_hanging_engine(
        "image inspect", tmp_path, portal, clean_env, monkeypatch, "hung-inspect"
    )
    agent.supervisor._calls.timeout_s = 6.0  # an engine call's timeout (60 s in the field)
    hang = tmp_path / "bin" / "hang"
    hang.touch()

    def spec(job: int) -> dict:
        ckpt = tmp_path / "ckpt" / f"job-{job}"
        return launch_spec(
            IGNORES_TERM, one_rank(), image=IMAGE, team_id=1, checkpoint_dir=str(ckpt),
            resume_from="", job_id=job,
        )  # fmt: skip

    portal.set_desired([run_item(83, spec(7))])
    with _agent_running(agent) as containers:
        wait_until(lambda: inspects() >= 1, 30, "the launch's image inspect")
        # The launch itself waits for it this long (its usual 50 ms), then leaves it to polls.
        time.sleep(container_launch.INSPECT_WAIT_S + 0.5)
        first = len(portal.beats_since(0))
        time.sleep(2.0)
        during = portal.beats_since(first)
        assert len(during) >= 5, f"{len(during)} heartbeat(s) in 2 s while the inspect hung"
        assert all(r["ranks"][0]["pid"] is None for r in portal.attempt_in_beats(83))
        refused = wait_until(
            lambda: [r for r in portal.attempt_in_beats(83) if r.get("error")],
            30,
            "the attempt refused once the inspect timed out",
        )
        assert refused[0]["error"]["kind"] == "health", refused[0]["error"]
        assert "did not answer `image inspect" in refused[0]["error"]["message"]
        # ... with a failed check, so that the portal cordons the node (not placing the job,
        # or the next, onto the same wedged engine).
        health = next(b["health"] for b in portal.beats_since(0) if "health" in b)
        assert health["ok"] is False and "did not answer `image inspect" in health["reason"]

        hang.unlink()  # the engine answers again: the next launch starts its container
        portal.set_desired([run_item(84, spec(8))])
        _running_in_a_container(agent, portal, 84, containers)


class _Container:
    """A container whose removals wait until the test lets each return, with its answer."""

    name = "c"

    def __init__(self) -> None:
        self.answers: list[tuple[threading.Event, bool]] = []
        self.calls: list[str] = []

    def _call(self, what: str) -> bool:
        self.calls.append(what)
        release, answer = self.answers[len(self.calls) - 1]
        assert release.wait(30)
        return answer

    def kill(self) -> bool:
        return self._call("kill")

    def remove(self) -> bool:
        return self._call("remove")


def test_a_removal_past_its_timeout_counts_as_failed_and_the_next_starts_once_it_returned(
    tmp_path, caplog
):
    """At most one removal runs per container; one still running after its timeout is failed
    (logged, the ranks still running), and the next try starts REMOVE_RETRY_S after it
    returned, not while it runs; the ranks go once a removal worked."""
    container = _Container()
    container.answers = [(threading.Event(), False), (threading.Event(), True)]
    worker = RankWorker(0, 0, 0, tmp_path / "log", tmp_path / "metrics", None, state="running")
    attempt = AttemptWorkers(1, {}, tmp_path, workers=[worker], container=container)
    calls = EngineCalls(timeout_s=0.2)
    log = logging_for(caplog)

    def follow(now: float) -> None:
        kill_confirm.follow_up(attempt, now, lambda w, s: None, log, calls)

    kill_confirm.kill(attempt, 0.0, lambda w, s: None, calls)
    first = attempt.pending_kill.removal
    assert calls.start("c", "another", container.remove) is first  # one at a time
    time.sleep(0.3)
    follow(1.0)
    assert first.overdue() and "no answer from the engine" in caplog.text
    follow(1.0 + kill_confirm.REMOVE_RETRY_S)  # due, but the first still runs
    assert container.calls == ["kill"] and not attempt.pending_kill.removed
    container.answers[0][0].set()  # it returns: failed
    wait_until(lambda: first.done, 5, "the first call's return")
    follow(10.0)
    assert attempt.pending_kill.removal is None and container.calls == ["kill"]
    follow(10.0 + kill_confirm.REMOVE_RETRY_S)
    assert container.calls == ["kill", "remove"]
    assert "(try 2)" in caplog.text
    container.answers[1][0].set()
    wait_until(lambda: attempt.pending_kill.removal.done, 5, "the second call's return")
    follow(16.0)
    assert attempt.pending_kill.removed
    worker.state = "exited"  # the supervisor's poll reaps the rank once removed
    follow(16.5)
    assert attempt.pending_kill is None


def logging_for(caplog):
    caplog.set_level(logging.INFO, logger="test.engine_calls")
    return logging.getLogger("test.engine_calls")


class _Scripted(Engine):
    """An engine whose CLI answers from a script: `ps` and `rm` per call, in order."""

    def __init__(self, ps: list, rm: list) -> None:
        super().__init__("podman", "/no/podman")
        object.__setattr__(self, "script", {"ps": ps, "rm": rm, "inspect": []})
        object.__setattr__(self, "seen", [])

    def _run(self, args, timeout=60.0):
        self.seen.append(args[0] if args[0] != "rm" else f"rm {args[-1]}")
        script = self.script[args[0]]
        answer = script.pop(0) if script else (0, "", "")
        if args[0] == "inspect":
            answer = (0, "running\n", "")
        if answer == "hang":
            raise subprocess.TimeoutExpired([self.binary, *args], timeout)
        return subprocess.CompletedProcess([self.binary, *args], *answer)


def test_a_failing_ps_is_an_error_not_an_empty_list():
    engine = _Scripted(ps=[(125, "", "Error: cannot connect"), "hang", (0, "c-1 1\n", "")], rm=[])
    with pytest.raises(EngineError, match="cannot connect"):
        engine.containers("agent")
    with pytest.raises(EngineError, match="no answer"):
        engine.containers("agent")
    assert engine.containers("agent") == [{"name": "c-1", "attempt": "1"}]


def test_stale_containers_not_removed_at_start_up_are_removed_later_off_the_loop(
    tmp_path, caplog, monkeypatch
):
    """A failing `ps` at start-up listed nothing, and a stale container that could not be
    removed was only logged: either could train on beside the attempts that replaced it. Both
    are tried again from the supervisor's polls until they went; a container of an attempt the
    agent holds stays, unless the node came back after being declared lost and the attempt is
    no longer desired."""
    monkeypatch.setattr(engine_calls, "STALE_RETRY_S", 0.05)
    listing = (0, "c-7 7\nc-8 8\n", "")
    engine = _Scripted(
        ps=[(125, "", "Error: engine down"), listing, listing],
        rm=[(125, "", "Error: busy"), (0, "", "")],
    )
    sup = WorkerSupervisor(tmp_path / "work", engine=engine, node="stale", gpu_kind="cpu")
    assert sup.remove_stale_containers() == 0
    assert "cannot list this agent's containers" in caplog.text and "engine down" in caplog.text
    sup.refuse(8, {}, {"kind": "health", "message": "held here"})  # an attempt it holds
    wait_until(lambda: (sup.poll(), not sup._sweep.wanted)[1], 10, "the stale containers removed")
    assert [s for s in engine.seen if s.startswith("rm")] == ["rm c-7", "rm c-7"]
    assert "c-7 not removed; trying again" in caplog.text
    assert "removed stale container c-7" in caplog.text
    assert engine.seen.count("ps") == 3
    # Back after being declared lost: the held attempt 8 is not desired (it is fenced), and
    # its container goes too; the desired 9's stays.
    engine.script["ps"] = [(0, "c-8 8\nc-9 9\n", "")]
    sup.sweep_stale_containers(keep={9})
    wait_until(lambda: (sup.poll(), not sup._sweep.wanted)[1], 10, "the rejoin's sweep")
    assert [s for s in engine.seen if s.startswith("rm")] == ["rm c-7", "rm c-7", "rm c-8"]
    sup.close()


def test_the_engines_calls_are_counted_until_they_return():
    calls = EngineCalls(timeout_s=5)
    release = threading.Event()
    call = calls.start("k", "a call", lambda: release.wait(5))
    assert not call.done and not call.overdue()
    assert not calls.wait(0.05)
    release.set()
    assert calls.wait(5) and call.ok
    again = calls.start("k", "again", lambda: 1 / 0)
    assert again is not call
    wait_until(lambda: again.done, 5)
    assert isinstance(again.error, ZeroDivisionError) and not again.ok


@NEEDS_IMAGE
def test_a_rank_whose_engine_client_died_alone_is_reported_gone_only_once_its_container_is(
    tmp_path, clean_env, monkeypatch
):
    """The `podman run` client can die alone (killed by hand, by the OOM killer) while its
    container runs on: conmon, not the client, holds it. Its exit used to be read as the
    container's: the rank was reported killed (-9), the portal freed its GPUs, and the
    container ran on under the next job. Now the engine removes the container first, and the
    rank is reported gone once it did."""
    for key in list(os.environ):
        if key not in clean_env:
            monkeypatch.delenv(key)
    sup = WorkerSupervisor(tmp_path / "sup", engine=PODMAN, node="lone-client", gpu_kind="cpu")
    ckpt = tmp_path / "ckpt" / "job-9"
    spec = launch_spec(
        IGNORES_TERM, one_rank(), image=IMAGE, team_id=1, checkpoint_dir=str(ckpt), resume_from=""
    )
    attempt = sup.launch(91, spec)
    name = attempt.container.name if attempt.container else None
    try:

        def started() -> bool:
            sup.poll()
            return attempt.workers[0].pid is not None

        wait_until(started, 90, "the rank to run in its container")
        name = attempt.container.name
        attempt.container.popen.kill()  # the client alone
        attempt.container.popen.wait(timeout=10)
        assert not PODMAN.stopped(name), "the container should outlive its client"

        def reported_exited() -> bool:
            sup.poll()
            return not attempt.workers[0].alive

        wait_until(reported_exited, 60, "the rank reported exited")
        assert attempt.workers[0].exit_code == -signal.SIGKILL
        assert PODMAN.stopped(name)  # gone before it was reported so
    finally:
        sup.kill_all()
        sup.close()
        if name is not None:
            PODMAN.remove(name)


# -- without an engine: the loop's side of the calls ----------------------------------------


class _InspectWaits(Engine):
    """An engine whose `image inspect` answers only once the test lets it; nothing else of
    it may be called (a container start would be a bug here)."""

    def __init__(self) -> None:
        super().__init__("podman", "/nonexistent/podman")
        self.answer = threading.Event()
        self.inspects = 0

    def image_digest(self, image: str) -> str:
        self.inspects += 1
        assert self.answer.wait(30)
        return "sha256:" + "0" * 64

    def _run(self, args, timeout=0):
        raise AssertionError(f"unexpected engine call {args}")


def test_an_attempt_stopped_while_its_image_is_inspected_ends_unstarted_and_never_starts(
    tmp_path, clean_env, monkeypatch
):
    """The launch waits for the inspect a little, then the loop's polls carry it on; a stop
    meanwhile ends the ranks unstarted (nothing ran, nothing to save), and the inspect's late
    answer starts nothing."""
    for key in list(os.environ):
        if key not in clean_env:
            monkeypatch.delenv(key)
    monkeypatch.setattr(container_launch, "INSPECT_WAIT_S", 0.2)
    engine = _InspectWaits()
    sup = WorkerSupervisor(tmp_path / "sup", engine=engine, node="slow-inspect", gpu_kind="cpu")
    spec = launch_spec(
        "", one_rank(), image=IMAGE, team_id=1, checkpoint_dir=str(tmp_path / "ck" / "job-5")
    )
    attempt = sup.launch(51, spec)
    assert attempt.preparing and attempt.container is None and engine.inspects == 1
    sup.poll()
    assert attempt.workers[0].alive and attempt.workers[0].pid is None  # still waiting
    sup.stop(51, deadline_s=30)
    assert [w.exit_code for w in attempt.workers] == [-signal.SIGTERM]
    assert not attempt.preparing
    engine.answer.set()
    wait_until(lambda: sup._calls.wait(0.05), 5, "the inspect's return")
    sup.poll()
    assert attempt.container is None and attempt.error is None


def test_a_wedged_engine_stops_the_launches_brief_waits_from_adding_up():
    """A launch waits up to INSPECT_WAIT_S for its inspect; once some call has run longer
    than that, the next ones are not waited for at all: a heartbeat carrying 16 launches onto
    a wedged engine would otherwise hold the loop 32 s, past the portal's timeout."""
    calls = EngineCalls()
    release = threading.Event()
    first = calls.start("a image", "inspect a", lambda: release.wait(30))
    assert not calls.settle(first, 0.5)  # waited its 0.5 s: no answer, the engine is stuck
    second = calls.start("b image", "inspect b", lambda: release.wait(30))
    started = time.monotonic()
    assert not calls.settle(second, 0.5)
    assert time.monotonic() - started < 0.25  # not waited for
    release.set()
    assert calls.wait(5)
    quick = calls.start("c image", "inspect c", lambda: time.sleep(0.1) or True)
    assert calls.settle(quick, 0.5)  # the engine answers again: waited for, and done


def test_a_refusal_raises_one_failed_check_to_cordon_the_node_and_a_quick_checks_stays():
    """A refusal (kind "health") found at the launch or later raises a failed check once,
    unless the quick check that refused it is already the pending report; and a full check is
    not due while any report has not reached the portal (it would overwrite it)."""
    from nodeagent.attempt_report import Tracked
    from nodeagent.health_check import HealthChecker, engine_check
    from nodeagent.heartbeat_body import _cordon_for

    health = HealthChecker(gpus=1, gpu_kind="cpu", dirs=[], env={}, every_s=60.0)
    refused = {"error": {"kind": "health", "message": "podman did not answer"}}
    remembered = Tracked()
    _cordon_for(refused, remembered, health)
    sent = health.pending
    assert sent["ok"] is False and "launch: podman did not answer" in sent["reason"]
    assert not health.due(idle=True, asked=True)  # not before the portal has it
    health.ack(sent)
    _cordon_for(refused, remembered, health)
    assert health.pending is None  # once per attempt
    assert health.due(idle=True, asked=True)

    quick = {"kind": "quick", "ok": False, "reason": "disk: full", "checks": []}
    health.pending = quick
    _cordon_for(refused, Tracked(), health)
    assert health.pending is quick
    _cordon_for({"error": {"kind": "image", "message": "no such image"}}, Tracked(), health)
    assert health.pending is quick  # the job's fault, not the node's

    class Wedged:
        name = "podman"

        def works(self) -> bool:
            return False

    check = engine_check(Wedged())
    assert check["ok"] is False and "did not answer `info`" in check["detail"]


def test_a_container_whose_client_died_is_removed_off_the_loop_and_tried_again(
    tmp_path, monkeypatch
):
    """`confirmed_gone`: the removal runs in a thread, one at a time; a failed one is tried
    again GONE_RETRY_S later; the container counts as gone only once a removal worked."""
    monkeypatch.setattr(container_module, "GONE_RETRY_S", 0.2)
    answers = [False, True]

    class Removes(Engine):
        def __init__(self) -> None:
            super().__init__("podman", "/nonexistent/podman")
            self.removes = 0

        def remove(self, name: str) -> bool:
            self.removes += 1
            time.sleep(0.1)
            return answers[self.removes - 1]

    engine = Removes()
    client = subprocess.Popen(["true"])
    client.wait()
    container = container_module.ContainerAttempt(
        engine, "c", tmp_path / "ranks.json", client, calls=EngineCalls()
    )
    assert not container.confirmed_gone()
    assert not container.confirmed_gone() and engine.removes == 1  # one at a time
    wait_until(lambda: container.confirmed_gone() or engine.removes == 2, 5, "a second try")
    wait_until(container.confirmed_gone, 5, "the second removal's success")
    assert engine.removes == 2 and container.removed
