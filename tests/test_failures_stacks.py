"""A hang's diagnosis (DESIGN.md section 8): the innermost frame of each rank's stacks
(py-spy or faulthandler), the rank outside the collective the others wait in, a stopped
rank, a rank that cannot dump its stacks, and the flight recorders where the stacks name
nobody; the node of the rank named is struck, and only it. Detecting the hang itself is in
tests/test_failures.py."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import actions
from jobs.health import innermost_frame, odd_rank_out
from jobs.models import Event, LogChunk
from jobs.scheduling.loop import run_pass
from tests.failures_helpers import _run, _steps
from tests.heartbeats import beat


def _py_spy(rank: int, *frames: str, state: str = "S") -> str:
    """A rank's log tail as the agent writes it: its header (with the process's state) over
    py-spy's dump (--native)."""
    body = "\n".join(f"    {f}" for f in frames)
    return (
        f"step 24 loss 1.2\nlockstep agent: stacks of rank {rank}, read from outside "
        f"(py-spy dump), process state {state}\nProcess {100 + rank}: python -m trainer\n"
        "Python v3.11.7 (/usr/bin/"
        f'python3.11)\n\nThread {100 + rank} (idle): "MainThread"\n{body}\n'
        f'Thread {200 + rank} (idle): "Thread-1 (pin_memory)"\n    wait (threading.py:327)\n'
    )


WAITING = (
    "pthread_cond_wait (libc.so.6)",
    "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)",
    "backward (torch/autograd/__init__.py:266)",
    "run_step (trainer/train.py:410)",
    "<module> (trainer/__main__.py:4)",
)
STALLED = (
    "clock_nanosleep (libc.so.6)",
    "stall (trainer/faults.py:31)",
    "run_step (trainer/train.py:402)",
    "<module> (trainer/__main__.py:4)",
)


def test_the_innermost_python_frame_is_read_from_py_spy_or_faulthandler():
    assert innermost_frame(_py_spy(1, *WAITING)) == "backward (__init__.py)"
    assert innermost_frame(_py_spy(0, *STALLED)) == "stall (faults.py)"
    faulthandler = (
        "Thread 0x00007f0a (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n\n'
        "Current thread 0x00007f0b (most recent call first):\n"
        '  File "/opt/lockstep/trainer/faults.py", line 31 in stall\n'
        '  File "/opt/lockstep/trainer/train.py", line 402 in run_step\n'
    )
    assert innermost_frame(faulthandler) == "stall (faults.py)"
    assert innermost_frame("rank 3 printed this and nothing else\n") is None


def test_the_rank_outside_the_collective_the_others_wait_in_is_named():
    stacks = {0: _py_spy(0, *STALLED), **{r: _py_spy(r, *WAITING) for r in (1, 2, 3)}}
    assert odd_rank_out(stacks) == (0, "stall (faults.py)", "backward (__init__.py)")
    # Two ranks, or a gang split in two, or everyone in one place: nobody can be named.
    assert odd_rank_out({0: stacks[0], 1: stacks[1]}) is None
    assert odd_rank_out({0: stacks[0], 1: stacks[1], 2: stacks[0], 3: stacks[1]}) is None
    assert odd_rank_out({r: _py_spy(r, *WAITING) for r in range(4)}) is None


def test_a_stopped_rank_is_named_by_its_process_state_whatever_its_stack():
    """Frozen by SIGSTOP inside its backward pass, a rank shows the Python frame its peers wait
    in for its gradients: its state (T) names it."""
    stacks = {r: _py_spy(r, *WAITING) for r in range(4)}
    stacks[2] = _py_spy(2, *WAITING, state="T")
    assert odd_rank_out(stacks) == (2, "stopped (SIGSTOP)", "")
    stacks[3] = _py_spy(3, *WAITING, state="D")  # two stuck ranks: no telling
    assert odd_rank_out(stacks) is None


@pytest.mark.django_db
def test_the_node_of_a_rank_that_cannot_dump_its_stacks_is_blamed_for_a_hang(setup, settings):
    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0, "DUMP_WAIT_S": 3.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 10), now=t0)
    t = t0 + timedelta(seconds=25)
    for node, ranks in ((a, {0: None, 1: None}), (b, {2: None, 3: None})):
        beat(node, attempt, ranks, now=t)
    run_pass(now=t)
    for rank in (0, 1, 2):  # rank 3 is stopped: no dump
        LogChunk.objects.create(
            attempt=attempt,
            rank=rank,
            created_at=t,
            text="Current thread 0x1 (most recent call first):\n",
        )
    later = t + timedelta(seconds=4)
    for node, ranks in ((a, {0: None, 1: None}), (b, {2: None, 3: None})):
        beat(node, attempt, ranks, now=later)
    run_pass(now=later)
    attempt.refresh_from_db()
    assert "no stacks from rank(s) 3" in attempt.end_reason
    assert Event.objects.filter(node=b, kind="node.strike").count() == 1
    assert not Event.objects.filter(node=a, kind="node.strike").exists()


def _hung_with_logs(setup, settings, logs: dict[int, str]) -> Event:
    """A 4-rank attempt on node-0 (ranks 0, 1) and node-1 (2, 3) that stops stepping; once its
    stacks are asked for, each rank's log carries `logs[rank]`. Returns the failure's event."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0, "DUMP_WAIT_S": 3.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 3, rank=0), now=t0)
    beat(b, attempt, {2: None, 3: None}, now=t0)
    t = t0 + timedelta(seconds=21)
    beat(a, attempt, {0: None, 1: None}, now=t)
    beat(b, attempt, {2: None, 3: None}, now=t)
    run_pass(now=t)  # hung: the stacks are asked for
    t += timedelta(seconds=1)
    beat(a, attempt, {0: None, 1: None}, logs={r: logs[r] for r in (0, 1)}, now=t)
    beat(b, attempt, {2: None, 3: None}, logs={r: logs[r] for r in (2, 3)}, now=t)
    t += timedelta(seconds=3)
    beat(a, attempt, {0: None, 1: None}, now=t)
    beat(b, attempt, {2: None, 3: None}, now=t)
    run_pass(now=t)
    return Event.objects.get(attempt=attempt, kind="attempt.failed")


@pytest.mark.django_db
def test_a_hang_names_the_odd_rank_and_strikes_only_its_node(setup, settings):
    logs = {0: _py_spy(0, *STALLED), **{r: _py_spy(r, *WAITING) for r in (1, 2, 3)}}
    failed = _hung_with_logs(setup, settings, logs)
    assert failed.data["odd_rank"] == 0 and failed.data["common_frame"] == "backward (__init__.py)"
    assert "rank 0 on node-0 is in stall (faults.py) while the other ranks wait in" in (
        failed.message
    )
    struck = set(Event.objects.filter(kind="node.strike").values_list("node__name", flat=True))
    assert struck == {"node-0"}


def _flight_line(rank: int, entered: int, completed: int) -> str:
    """The agent's line for a rank's flight recorder (nodeagent/flight_recorder.py)."""
    group = {
        "entered": entered,
        "completed": completed,
        "desc": "default_pg",
        "last": {"seq": entered, "op": "nccl:all_reduce", "sizes": [[4096]], "state": "started"},
    }
    return (
        f"\nlockstep agent: flight recorder of rank {rank}: "
        + json.dumps({"groups": {"0": group}, "entries": 2000})
        + "\n"
    )


@pytest.mark.django_db
def test_a_hang_the_stacks_cannot_place_is_placed_by_the_flight_recorders(setup, settings):
    """Every rank's stack is in the same backward pass (rank 3 computes its gradients while the
    others wait for them): the stacks name nobody. The flight recorders do: rank 3 never
    entered all-reduce #118, so its node alone is struck, and the summaries are in the event."""
    logs = {r: _py_spy(r, *WAITING) + _flight_line(r, 118, 117) for r in range(3)}
    logs[3] = _py_spy(3, *WAITING) + _flight_line(3, 117, 117)
    failed = _hung_with_logs(setup, settings, logs)
    assert failed.data["odd_rank"] == 3, failed.message
    assert "rank 3 on node-1 never entered collective #118 (nccl:all_reduce of [[4096]])" in (
        failed.message
    )
    assert set(failed.data["flight_recorder"]) == {"0", "1", "2", "3"}
    struck = set(Event.objects.filter(kind="node.strike").values_list("node__name", flat=True))
    assert struck == {"node-1"}


@pytest.mark.django_db
def test_a_hung_attempt_cancelled_while_its_stacks_are_dumped_keeps_its_stop(setup, settings):
    """The dump's seconds are not a verdict on an attempt told to stop meanwhile: ending it
    `failed` cut the stop's checkpoint grace short (and, preempted, used a restart)."""
    settings.LOCKSTEP = {**settings.LOCKSTEP, "HANG_MIN_S": 20.0, "DUMP_WAIT_S": 3.0}
    job, attempt, a, b, _ = _run(setup)
    t0 = timezone.now()
    beat(a, attempt, {0: None, 1: None}, records=_steps(1, 10), now=t0)
    t = t0 + timedelta(seconds=25)
    for node, ranks in ((a, {0: None, 1: None}), (b, {2: None, 3: None})):
        beat(node, attempt, ranks, now=t)
    run_pass(now=t)
    attempt.refresh_from_db()
    assert attempt.dump_requested_at is not None
    actions.do_cancel_job(job, actor=None, now=t + timedelta(seconds=1))
    later = t + timedelta(seconds=4)
    for node, ranks in ((a, {0: None, 1: None}), (b, {2: None, 3: None})):
        beat(node, attempt, ranks, now=later)
    run_pass(now=later)
    attempt.refresh_from_db()
    assert attempt.state == "stopping" and attempt.ended_at is None
    assert not Event.objects.filter(kind="node.strike").exists()
