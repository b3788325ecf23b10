"""Node agent: what it gathers to diagnose a hang or a fault.

Stack dumps (SIGUSR1 to the ranks that catch it, py-spy from outside, the portal's `dump`
action), each rank's CPU use, GPU telemetry where NVML is missing, and a GPU's Xid reported as
a failed health check. Everything here runs real processes; the shared helpers are in
tests/nodeagent_helpers.py.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.nodeagent_helpers import (
    SLEEPER,
    WRITE_HELPER,
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
)

pytestmark = pytest.mark.timeout(60)


BUSY_CHILD_AND_SLEEPER = """
import os, subprocess, sys, time
if os.environ["RANK"] == "0":
    # The work happens in a child (a data loader, say): still this rank's CPU use.
    burn = "import time\\nt = time.time()\\nwhile time.time() - t < 60: pass"
    subprocess.run([sys.executable, "-c", burn])
else:
    time.sleep(60)
"""


def test_the_status_carries_each_ranks_cpu_use_children_included(supervisor_factory):
    sup = supervisor_factory()
    ranks = [{"rank": r, "local_rank": r, "gpu_index": r} for r in (0, 1)]
    sup.launch(8, launch_spec(BUSY_CHILD_AND_SLEEPER, ranks))

    def cpu() -> dict[int, float]:
        sup.poll()
        return {r["rank"]: r.get("cpu_s") for r in sup.status(8)}

    wait_until(lambda: (cpu()[0] or 0) >= 1.5, timeout_s=30, what="rank 0's child to burn CPU")
    used = cpu()
    assert used[1] is not None and used[1] < 0.5, used  # sleeping: next to nothing
    sup.kill(8)
    assert sup.wait(8, timeout_s=10)
    assert all("cpu_s" not in r for r in sup.status(8))  # only live ranks carry it


CATCHES_USR1 = (
    WRITE_HELPER
    + """
import os, signal, time
signal.signal(signal.SIGUSR1, lambda *_: print("stacks of rank", os.environ["RANK"], flush=True))
publish(os.environ["LOCKSTEP_METRICS_PATH"] + ".pids", f"{os.getpid()} 0")
time.sleep(120)
"""
)


def test_a_stack_dump_goes_only_to_ranks_that_catch_it(supervisor_factory):
    """A plain script has no SIGUSR1 handler: asking it for stacks would kill it (the default
    action), and its end would read as a signal rather than the hang it is."""
    sup = supervisor_factory()
    plain = sup.launch(11, launch_spec(SLEEPER, one_rank()))
    dumps = sup.launch(12, launch_spec(CATCHES_USR1, one_rank()))
    read_pids(plain.workers[0].metrics_path)
    read_pids(dumps.workers[0].metrics_path)
    sup.dump_stacks(11)
    sup.dump_stacks(12)
    wait_until(
        lambda: "stacks of rank 0" in dumps.workers[0].log_path.read_text(),
        what="the catching rank to dump",
    )
    time.sleep(0.5)
    sup.poll()
    assert [w.alive for w in (*plain.workers, *dumps.workers)] == [True, True]
    # Both are read from outside by py-spy too (nodeagent/stacks.py), the plain one included.
    wait_until(lambda: sup.dump_settled(11) and sup.dump_settled(12), what="py-spy")
    plain_log = plain.workers[0].log_path.read_text()
    assert "lockstep agent: stacks of rank 0, read from outside (py-spy dump)" in plain_log
    assert "MainThread" in plain_log and "<module>" in plain_log, plain_log[-2000:]


DUMPS_STACKS = (
    WRITE_HELPER
    + """
import faulthandler, os, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
# A helper without a handler: SIGUSR1's default action would kill it.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
def hang_here():
    while True:
        time.sleep(0.05)
publish(os.environ["LOCKSTEP_METRICS_PATH"] + ".pids", f"{os.getpid()} {child.pid}")
hang_here()
"""
)


def test_agent_dump_action_gets_stacks_into_the_logs_then_fencing_kills(portal, running_agent):
    portal.set_desired([run_item(45, launch_spec(DUMPS_STACKS, one_rank()))])
    worker = wait_launched(running_agent, 45).workers[0]
    worker_pid, child_pid = read_pids(worker.metrics_path)

    mark = len(portal.beats_since(0))
    asked = time.monotonic()
    portal.set_desired([{"attempt_id": 45, "action": "dump"}])
    dumped = wait_until(
        lambda: [a for a in portal.attempt_in_beats(45, since=mark) if a.get("dumped")],
        what="a report with dumped: true",
    )
    assert time.monotonic() - asked >= 1.0  # the dump had a second to reach the log
    assert dumped[0]["dumped"] is True
    assert dumped[0]["ranks"][0]["state"] == "running"
    # Everything shipped up to and including that beat holds the dump.
    reports = portal.attempt_in_beats(45)
    upto = reports[: reports.index(dumped[0]) + 1]
    shipped = "".join(chunk["text"] for a in upto for chunk in a["logs"])
    assert "(most recent call first)" in shipped and "in hang_here" in shipped
    assert "(most recent call first)" in worker.log_path.read_text()

    # `dump` is repeated by every heartbeat; the signal is sent once and nothing is fenced.
    later = len(portal.beats_since(0))
    wait_until(lambda: len(portal.attempt_in_beats(45, since=later)) >= 3, what="more beats")
    assert all(a.get("dumped") for a in portal.attempt_in_beats(45, since=later))
    assert all(a["ranks"][0]["state"] == "running" for a in portal.attempt_in_beats(45))
    assert worker.log_path.read_text().count("(most recent call first)") == 1
    assert process_alive(worker_pid)
    assert process_alive(child_pid)  # the signal went to the worker, not its process group

    portal.set_desired([])  # the portal has its stacks: drop the attempt, the agent fences
    fenced = wait_until(
        lambda: [a for a in portal.attempt_in_beats(45) if a["ranks"][0]["state"] == "exited"],
        what="the fenced attempt reported exited",
    )
    assert fenced[0]["ranks"][0]["exit_code"] == -signal.SIGKILL
    wait_until(lambda: not process_alive(child_pid), what="the worker's child to die")


def test_nvml_bindings_are_installed_and_a_node_without_the_driver_says_so(caplog):
    """nvidia-ml-py is a dependency (GPU nodes' telemetry); where no NVIDIA driver is loaded,
    as here, a cuda node reports zeros for its slots and logs why, once."""
    import pynvml

    from nodeagent.telemetry import Telemetry

    assert hasattr(pynvml, "nvmlDeviceGetTotalEccErrors")  # NVIDIA's bindings, not a stub
    if Path("/dev/nvidiactl").exists():
        pytest.skip("an NVIDIA driver is present: this test is of a node without one")
    with caplog.at_level("INFO", logger="nodeagent.telemetry"):
        telemetry = Telemetry(2, "cuda")
    assert [r["util"] for r in telemetry.read()] == [0.0, 0.0]
    assert any("no NVML telemetry" in m and "NVML" in m for m in caplog.messages)
    assert [r["kind"] for r in Telemetry(2, "cpu").read()] == ["cpu", "cpu"]


def test_a_gpus_own_xid_goes_to_the_portal_as_a_failed_health_check(portal, running_agent):
    """The Xid events come from NVML on GPU nodes (nodeagent/xid.py; run for real by
    bench/gpu_check.py); here the telemetry's queue of node faults is filled as the NVML poll
    fills it. A job's own Xid (31, a page fault) is not held against the node; 79 is."""
    from nodeagent.xid import fault_report

    assert fault_report([{"gpu": 0, "xid": 31, "at": 0.0}]) is None
    wait_until(lambda: portal.accepted, what="a first heartbeat")
    # A CPU node has no Xid watch and reports no Xid: nothing invented.
    assert running_agent.telemetry.xid is None
    assert not any("xid" in r for b in portal.accepted for r in b.get("telemetry", []))
    running_agent.telemetry.faults = [{"gpu": 1, "xid": 79, "at": 0.0}]

    def reported():
        with portal.lock:
            return next((b["health"] for b in portal.accepted if "health" in b), None)

    health = wait_until(reported, what="the Xid in a heartbeat")
    assert not health["ok"] and health["reason"] == "GPU 1: Xid 79 (GPU has fallen off the bus)"
    assert running_agent.telemetry.faults == []
    assert not portal.invalid
