"""Warm start (nodeagent/zygote.py): workers forked from a process with torch imported get what
a fresh interpreter would (environment, session, argv, cwd, logs, exit status, their own RNG
state), can be stopped and killed like Popen children, and the agent falls back to a cold start
whenever forking is not safe or the zygote is gone."""

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from nodeagent.supervisor import WorkerSupervisor
from nodeagent.zygote import ForkedWorker, Zygote, can_fork
from tests.nodeagent_helpers import launch_spec, process_alive, wait_until, warm_supervisor

pytestmark = pytest.mark.timeout(120)

PROBE = """
import json, os, random, signal, sys, time
import numpy as np
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
record = {"env": dict(os.environ), "pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv,
          "cwd": os.getcwd(), "name": __name__, "random": random.random(),
          "numpy": float(np.random.rand()), "path0": sys.path[0],
          "signals": {s.name: str(signal.getsignal(s)) for s in signal.Signals
                      if s not in (signal.SIGKILL, signal.SIGSTOP)},
          "masks": [status["SigBlk"].strip(), status["SigIgn"].strip()]}
with open(os.environ["LOCKSTEP_METRICS_PATH"], "w") as f:
    f.write(json.dumps(record))
print("stdout of rank", os.environ["RANK"], flush=True)
print("stderr of rank", os.environ["RANK"], file=sys.stderr)
mode = os.environ.get("PROBE_MODE", "")
if mode == "sleep":
    time.sleep(120)
if mode == "raise":
    raise RuntimeError("boom")
sys.exit(int(os.environ["RANK"]) + 3)
"""

TWO_RANKS = [
    {"rank": 0, "local_rank": 0, "gpu_index": 0},
    {"rank": 1, "local_rank": 1, "gpu_index": 1},
]


@pytest.fixture
def probe(tmp_path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture
def supervisors(tmp_path):
    made = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKSTEP_", "OMP_"))}

    def make(warm: bool, name: str) -> WorkerSupervisor:
        sup = WorkerSupervisor(tmp_path / name, gpu_kind="cpu", base_env=env, warm_start=warm)
        made.append(sup)
        if warm:
            assert sup._zygote.wait_ready(90), sup._zygote.failed
        return sup

    yield make
    for sup in made:
        sup.kill_all()
        sup.close()


def _run(sup, attempt_id, command, extra_env=None):
    attempt = sup.launch(
        attempt_id, launch_spec("", TWO_RANKS, command=command, env=extra_env or {})
    )
    assert sup.wait(attempt_id, 60)
    records = [json.loads(w.metrics_path.read_text()) for w in attempt.workers]
    return attempt, records


def test_a_forked_worker_gets_what_a_fresh_interpreter_would(supervisors, probe):
    cold, cold_records = _run(supervisors(False, "cold"), 1, ["python", str(probe), "x"])
    warm, warm_records = _run(supervisors(True, "warm"), 1, ["python", str(probe), "x"])
    assert all(isinstance(w.popen, ForkedWorker) for w in warm.workers)
    assert not any(isinstance(w.popen, ForkedWorker) for w in cold.workers)
    for c, w, worker in zip(cold_records, warm_records, warm.workers, strict=True):
        # Exactly the launch contract, nothing of the zygote's (the two work dirs differ).
        same_dir = {k: v.replace("/warm/", "/cold/") for k, v in w["env"].items()}
        assert same_dir == c["env"]
        assert w["sid"] == w["pid"] == worker.pid  # its own session: the agent signals the group
        assert (w["argv"], w["cwd"], w["name"], w["path0"]) == (
            c["argv"], c["cwd"], c["name"], c["path0"]
        )  # fmt: skip
        # Signals as a fresh interpreter has them: SIGPIPE ignored (a write to a socket whose
        # peer died raises instead of killing the rank), SIGINT as the agent's children inherit.
        assert w["signals"] == c["signals"] and w["masks"] == c["masks"]
        assert w["signals"]["SIGPIPE"] == str(signal.SIG_IGN)
        log = worker.log_path.read_text()
        assert f"stdout of rank {worker.rank}" in log and f"stderr of rank {worker.rank}" in log
    assert [w.exit_code for w in warm.workers] == [3, 4]
    assert [w.exit_code for w in cold.workers] == [3, 4]
    # Siblings forked from one zygote do not share their random streams.
    assert warm_records[0]["random"] != warm_records[1]["random"]
    assert warm_records[0]["numpy"] != warm_records[1]["numpy"]


def test_modules_run_as_main_and_errors_exit_1_with_the_message(tmp_path):
    pkg = tmp_path / "probepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKSTEP_", "OMP_"))}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    sup = WorkerSupervisor(tmp_path / "work", gpu_kind="cpu", base_env=env, warm_start=True)
    try:
        assert sup._zygote.wait_ready(90), sup._zygote.failed
        for attempt_id, module, expected in (
            (1, "probepkg", "RuntimeError: boom"),
            (2, "nosuchmodule", "No module named nosuchmodule"),
        ):
            attempt = sup.launch(
                attempt_id,
                launch_spec("", TWO_RANKS, command=["python", "-m", module],
                            env={"PROBE_MODE": "raise"}),
            )  # fmt: skip
            assert sup.wait(attempt_id, 60)
            assert all(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
            assert [w.exit_code for w in attempt.workers] == [1, 1]
            for worker in attempt.workers:
                assert expected in worker.log_path.read_text()
    finally:
        sup.kill_all()
        sup.close()


def test_forked_workers_stop_and_die_like_popen_children(supervisors, probe):
    sup = supervisors(True, "warm")
    attempt = sup.launch(3, launch_spec("", TWO_RANKS, command=["python", str(probe)],
                                        env={"PROBE_MODE": "sleep"}))  # fmt: skip
    wait_until(lambda: all(w.metrics_path.exists() for w in attempt.workers), 60, "probes up")
    pids = [w.pid for w in attempt.workers]
    # What ps and pgrep read is the worker's own command line and environment.
    for worker in attempt.workers:
        cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert [part.decode() for part in cmdline] == [sys.executable, str(probe)]
        raw = Path(f"/proc/{worker.pid}/environ").read_bytes().rstrip(b"\0").split(b"\0")
        assert dict(item.decode().split("=", 1) for item in raw) == worker.env
    sup.kill(3)
    assert sup.wait(3, 30)
    assert [w.exit_code for w in attempt.workers] == [-signal.SIGKILL, -signal.SIGKILL]
    assert not any(process_alive(pid) for pid in pids)


def test_the_agent_falls_back_to_a_cold_start(supervisors, probe):
    sup = supervisors(True, "warm")
    # Not forkable: `python -c`, or a PYTHONPATH that differs from the zygote's.
    attempt, _ = _run(sup, 4, ["python", "-c", PROBE])
    assert not any(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
    attempt, _ = _run(sup, 5, ["python", str(probe)], {"PYTHONPATH": "/elsewhere"})
    assert not any(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
    # The zygote gone: cold starts, and the exits are still seen.
    sup._zygote._proc.kill()
    sup._zygote._proc.wait()
    wait_until(lambda: not sup._zygote.alive(), 10, "the zygote to be seen gone")
    attempt, _ = _run(sup, 6, ["python", str(probe)])
    assert not any(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
    assert [w.exit_code for w in attempt.workers] == [3, 4]


def test_the_zygote_exits_when_the_agent_is_gone_and_its_workers_live_on(probe, tmp_path):
    zygote = Zygote(env={k: v for k, v in os.environ.items() if not k.startswith("OMP_")})
    zygote.start()
    assert zygote.wait_ready(90), zygote.failed
    env = dict(os.environ, RANK="0", PROBE_MODE="sleep", OMP_NUM_THREADS="1",
               LOCKSTEP_METRICS_PATH=str(tmp_path / "m.json"))  # fmt: skip
    worker = zygote.spawn([sys.executable, str(probe)], env, tmp_path / "log")
    wait_until((tmp_path / "m.json").exists, 60, "the probe to start")
    zygote._sock.shutdown(socket.SHUT_RDWR)  # what the agent's death does to the socket
    assert zygote._proc.wait(timeout=10) == 0
    try:
        assert process_alive(worker.pid)  # an orphan now, for the next agent to fence
    finally:
        os.killpg(worker.pid, signal.SIGKILL)


def test_can_fork_only_this_interpreter_running_a_module_or_script_with_threads_set():
    env = {"OMP_NUM_THREADS": "1"}
    assert can_fork([sys.executable, "-m", "trainer"], env, {})
    assert can_fork([sys.executable, "train.py", "--x"], env, {})
    assert not can_fork([sys.executable, "-m", "trainer"], {}, {})  # no thread count to set
    assert not can_fork([sys.executable, "-c", "print(1)"], env, {})
    assert not can_fork([sys.executable, "-O", "train.py"], env, {})
    assert not can_fork(["/usr/bin/python3", "-m", "trainer"], env, {})
    assert not can_fork(["bash", "run.sh"], env, {})
    assert not can_fork([sys.executable, "-m", "trainer"], {**env, "PYTHONHASHSEED": "1"}, {})


def test_code_changed_on_disk_starts_cold_then_a_new_zygote_warms_up_with_it(tmp_path, probe):
    sup, warmmod = warm_supervisor(tmp_path)
    try:
        first = sup._zygote
        assert first.wait_ready(90) and first.ready == ["warmmod"]
        attempt, _ = _run(sup, 1, ["python", str(probe)])
        assert all(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
        # A deploy: the preloaded module's file changes. Forking the old code would run what a
        # fresh interpreter no longer would.
        stamp = warmmod.stat().st_mtime + 5
        os.utime(warmmod, (stamp, stamp))
        attempt, _ = _run(sup, 2, ["python", str(probe)])
        assert not any(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
        assert sup._zygote is not first and sup._zygote.wait_ready(90)
        attempt, _ = _run(sup, 3, ["python", str(probe)])
        assert all(isinstance(w.popen, ForkedWorker) for w in attempt.workers)
    finally:
        sup.kill_all()
        sup.close()


@pytest.mark.parametrize("warm", [False, True])
def test_workers_inherit_none_of_the_agents_secrets_or_settings(tmp_path, probe, warm):
    """Workers run users' code: the cluster agent token (it registers nodes), the agent's own
    settings and, under `lockstep up`, the portal's database and Django settings stay out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCKSTEP_", "OMP_"))}
    env.update(
        LOCKSTEP_AGENT_TOKEN="cluster-secret",
        LOCKSTEP_PORTAL="http://portal",
        DJANGO_SETTINGS_MODULE="portal.settings",
        DATABASE_URL="postgres://db/lockstep",
        REDIS_URL="redis://r:6379/0",
        OPERATOR_VAR="kept",
    )
    sup = WorkerSupervisor(tmp_path / "work", gpu_kind="cpu", base_env=env, warm_start=warm)
    try:
        if warm:
            assert sup._zygote.wait_ready(90)
        attempt, records = _run(sup, 1, ["python", str(probe)])
        assert all(isinstance(w.popen, ForkedWorker) == warm for w in attempt.workers)
        for record in records:
            seen = record["env"]
            assert seen["OPERATOR_VAR"] == "kept" and seen["LOCKSTEP_JOB_ID"] == "5"
            for name in ("LOCKSTEP_AGENT_TOKEN", "LOCKSTEP_PORTAL", "DJANGO_SETTINGS_MODULE",
                         "DATABASE_URL", "REDIS_URL"):  # fmt: skip
                assert name not in seen
        if warm:  # nor does the zygote, whose memory every worker starts from
            zygote_env = Path(f"/proc/{sup._zygote._proc.pid}/environ").read_bytes()
            assert b"cluster-secret" not in zygote_env
    finally:
        sup.kill_all()
        sup.close()


def test_a_forked_worker_exits_like_an_interpreter_threads_joined_and_atexit_run(
    supervisors, tmp_path
):
    script = tmp_path / "bye.py"
    script.write_text(
        "import atexit, os, threading, time\n"
        "out = os.environ['LOCKSTEP_METRICS_PATH']\n"
        "atexit.register(lambda: open(out, 'a').write('atexit\\n'))\n"
        "def late():\n"
        "    time.sleep(0.5)\n"
        "    open(out, 'a').write('thread\\n')\n"
        "threading.Thread(target=late).start()\n"
    )
    for warm in (False, True):
        sup = supervisors(warm, "warm" if warm else "cold")
        attempt = sup.launch(1, launch_spec("", TWO_RANKS, command=["python", str(script)]))
        assert sup.wait(1, 60)
        assert all(isinstance(w.popen, ForkedWorker) == warm for w in attempt.workers)
        for worker in attempt.workers:
            assert worker.exit_code == 0
            assert worker.metrics_path.read_text() == "thread\natexit\n"


# A native object whose destructor joins a native thread while holding the GIL, the way torch's
# gloo process group does (a DDP model's Reducer joins gloo's runLoop, which may still need the
# GIL to drop a tensor). Defined in a module of its own, as torch's classes are, so that the
# script's globals hold no function and are freed by reference count alone.
JOINS_WITH_THE_GIL_HELD = """
import ctypes, time
libc = ctypes.CDLL(None)
gil_held = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL, as a C++ destructor does
START = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)

@START
def work(_):
    time.sleep(0.5)  # gives the GIL up, and needs it back to return
    return None

class Group:
    def __init__(self):
        self.thread = ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(self.thread), None, work, None)

    def __del__(self):
        gil_held.pthread_join(self.thread, None)
"""


def test_a_forked_worker_exits_when_its_objects_would_join_a_thread_holding_the_gil(
    supervisors, tmp_path
):
    """Seen with an unmodified DDP script in a warm container: a rank printed its last line
    and never exited. A fresh interpreter frees the script's objects only while finalizing,
    when a thread that wants the GIL is ended rather than left waiting; the worker must not
    free them earlier."""
    (tmp_path / "gilgroup.py").write_text(JOINS_WITH_THE_GIL_HELD)
    script = tmp_path / "ddp_like.py"
    script.write_text("from gilgroup import Group\ngroup = Group()\nprint('last line')\n")
    for warm in (False, True):
        sup = supervisors(warm, "warm" if warm else "cold")
        attempt = sup.launch(1, launch_spec("", TWO_RANKS, command=["python", str(script)]))
        assert sup.wait(1, 30), [w.log_path.read_text() for w in attempt.workers]
        assert all(isinstance(w.popen, ForkedWorker) == warm for w in attempt.workers)
        assert [w.exit_code for w in attempt.workers] == [0, 0]
        assert all("last line" in w.log_path.read_text() for w in attempt.workers)
