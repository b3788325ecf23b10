"""Node agent: its side of the portal protocol, run against a portal peer.

Registration and heartbeats (what they carry, their jittered timing), reconciling the portal's
desired state (launching what it lists, fencing what it drops) and registering again when the
portal no longer knows the node. Everything here runs real processes; the portal peer and the
helpers the agent's tests share are in tests/nodeagent_helpers.py. The agent's other concerns
have files of their own, tests/test_nodeagent_*.py: launch (the launch contract), stop
(stopping workers and the agent), tails (metrics and logs), diagnostics (stack dumps, CPU use,
telemetry, Xid) and cli (the command line).
"""

from __future__ import annotations

import os

import pytest

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
    wait_launched,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


STEPPER = """
import json, os, time
rank = int(os.environ["RANK"])
with open(os.environ["LOCKSTEP_METRICS_PATH"], "a") as f:
    f.write(json.dumps({"rank": rank, "kind": "step", "step": 1, "loss": 2.0 + rank,
                        "tokens_per_s": 900.0, "step_time_s": 0.05, "time": time.time()}))
    f.write("\\n")
print(f"rank {rank} done", flush=True)
"""


def test_agent_runs_reports_and_forgets_an_attempt(portal, running_agent):
    wait_until(lambda: portal.accepted, what="a first heartbeat")
    assert portal.registrations[0] == {
        "name": "node-t",
        "gpus": 2,
        "gpu_kind": "cpu",
        "hostname": os.uname().nodename,
        "address": "127.0.0.1",
        "rack": "r1",
        "boot_id": running_agent.boot_id,
        "killed_orphans": 0,
        "runtime": "process",  # the Agent's default: plain processes
        "engine": "",
    }
    first = portal.accepted[0]
    assert [t["index"] for t in first["telemetry"]] == [0, 1]
    assert all(t["kind"] == "cpu" for t in first["telemetry"])

    portal.fail_first_beat_with_records = True  # the records must survive a failed heartbeat
    ranks = [
        {"rank": 0, "local_rank": 0, "gpu_index": 0},
        {"rank": 1, "local_rank": 1, "gpu_index": 1},
    ]
    portal.set_desired(
        [run_item(21, launch_spec(STEPPER, ranks, world_size=2, group_rank=0, group_world_size=1))]
    )

    def exited_beat():
        reports = portal.attempt_in_beats(21)
        done = [a for a in reports if all(r["state"] == "exited" for r in a["ranks"])]
        return done[-1] if done else None

    exited = wait_until(exited_beat, what="both ranks reported exited")
    assert [(r["rank"], r["exit_code"]) for r in exited["ranks"]] == [(0, 0), (1, 0)]
    assert all(isinstance(r["pid"], int) for r in exited["ranks"])
    assert portal.refused, "the peer should have refused one heartbeat carrying records"

    reports = portal.attempt_in_beats(21)
    steps = sorted((r["rank"], r["loss"]) for a in reports for r in a["records"])
    assert steps == [(0, 2.0), (1, 3.0)]  # each record exactly once, despite the refusal
    logs = {}
    for a in reports:
        for chunk in a["logs"]:
            logs[chunk["rank"]] = logs.get(chunk["rank"], "") + chunk["text"]
    assert logs == {0: "rank 0 done\n", 1: "rank 1 done\n"}

    # Still listed as `run`: the agent keeps reporting the exit and does not relaunch.
    mark = len(portal.beats_since(0))
    wait_until(lambda: len(portal.attempt_in_beats(21, since=mark)) >= 3, what="more reports")
    assert all(
        r["state"] == "exited" for a in portal.attempt_in_beats(21, since=mark) for r in a["ranks"]
    )

    portal.set_desired([])
    wait_until(lambda: 21 not in running_agent.supervisor, what="the attempt to be forgotten")
    mark = len(portal.beats_since(0))
    wait_until(lambda: len(portal.beats_since(mark)) >= 2, what="later heartbeats")
    assert portal.attempt_in_beats(21, since=mark + 1) == []
    assert portal.invalid == []  # every heartbeat had the shape the portal checks


def test_agent_fences_an_attempt_dropped_from_desired(portal, running_agent):
    portal.set_desired([run_item(31, launch_spec(SLEEPER, one_rank()))])
    wait_until(
        lambda: any(
            r["state"] == "running" for a in portal.attempt_in_beats(31) for r in a["ranks"]
        ),
        what="the sleeper reported running",
    )
    metrics_path = running_agent.supervisor.get(31).workers[0].metrics_path
    worker_pid, child_pid = read_pids(metrics_path)

    portal.set_desired([])  # e.g. the node was declared lost and the job placed elsewhere
    fenced = wait_until(
        lambda: [a for a in portal.attempt_in_beats(31) if a["ranks"][0]["state"] == "exited"],
        what="the fenced attempt reported exited",
    )
    assert fenced[0]["ranks"][0]["exit_code"] == -9
    assert not process_alive(worker_pid)
    wait_until(lambda: not process_alive(child_pid), what="the sleeper's child to die")
    wait_until(lambda: 31 not in running_agent.supervisor, what="the attempt to be forgotten")


def test_agent_reregisters_on_401_and_keeps_its_workers(portal, running_agent):
    portal.set_desired([run_item(51, launch_spec(SLEEPER, one_rank()))])
    worker_pid, _ = read_pids(wait_launched(running_agent, 51).workers[0].metrics_path)
    with portal.lock:
        portal.node_token = "rotated"
    wait_until(lambda: len(portal.registrations) == 2, what="a re-registration")
    mark = len(portal.beats_since(0))
    wait_until(lambda: portal.attempt_in_beats(51, since=mark), what="heartbeats resuming")
    assert process_alive(worker_pid)


def test_agent_kills_everything_on_stale_boot_and_reregisters(portal, running_agent):
    portal.set_desired([run_item(61, launch_spec(SLEEPER, one_rank()))])
    worker_pid, child_pid = read_pids(wait_launched(running_agent, 61).workers[0].metrics_path)
    with portal.lock:
        portal.boot_id = "another-agent-process"
    wait_until(lambda: len(portal.registrations) == 2, what="a re-registration")
    killed = wait_until(
        lambda: [a for a in portal.attempt_in_beats(61) if a["ranks"][0]["state"] == "exited"],
        what="the killed worker reported",
    )
    assert killed[0]["ranks"][0]["exit_code"] == -9
    assert not process_alive(worker_pid)
    wait_until(lambda: not process_alive(child_pid), what="the worker's child to die")
    assert running_agent.supervisor.get(61).workers[0].popen.pid == worker_pid  # no relaunch


def test_agents_that_start_in_step_drift_apart_instead_of_beating_together():
    """512 agents registered at the same instant (a portal restart) with a 16 s interval: after
    ten beats, no one-second window holds more than a fifth of their heartbeats, where
    without jitter all 512 fell in the same one (bench/hollow.py measured that herd)."""
    import random

    from nodeagent.agent import JITTER, jittered

    rng = random.Random(20)
    interval, agents, beats = 16.0, 512, 10
    waits = [[jittered(interval, rng) for _ in range(beats)] for _ in range(agents)]
    assert all((1 - JITTER) * interval <= w <= (1 + JITTER) * interval for ws in waits for w in ws)
    mean = sum(map(sum, waits)) / (agents * beats)
    assert abs(mean - interval) < 0.05 * interval  # the interval the portal set, on average
    tenth_beat = sorted(sum(ws) for ws in waits)
    busiest = max(sum(1 for t in tenth_beat if start <= t < start + 1.0) for start in tenth_beat)
    assert busiest < agents / 5, busiest
