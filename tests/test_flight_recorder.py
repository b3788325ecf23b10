"""Hangs localised by PyTorch's flight recorder: the agent asks each rank for its recorder
through the dump pipe, summarises the dumps into the ranks' logs, and the portal names the rank
its peers wait for (nodeagent/flight_recorder.py, jobs/health.flight_recorder_verdict). Real
gloo processes, real dumps."""

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.health import flight_recorder_verdict, flight_records, odd_rank_out
from nodeagent.flight_recorder import FlightRecorderDump, load, summarize, targets_of
from nodeagent.workers import RankWorker
from tests.live import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "flight_recorder_hang.py"


def _gang(tmp_path: Path, world: int, behind: int) -> list[RankWorker]:
    port = free_port()
    stem = str(tmp_path / "nccl-trace-rank-")
    workers = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "BEHIND": str(behind),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            # What the agent sets for every rank (nodeagent/contract.py).
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": stem,
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem,
        }
        log = tmp_path / f"rank-{rank}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, str(SCRIPT)], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        workers.append(RankWorker(rank, rank, rank, log, tmp_path / f"m{rank}", popen, env=env))
    return workers


def _hung(workers: list[RankWorker], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(w.popen.poll() is None for w in workers), [
            w.log_path.read_text() for w in workers
        ]
        if all("entered the hang" in w.log_path.read_text() for w in workers):
            # The waiting ranks are inside their all-reduce by now; the recorder marks the
            # earlier collectives completed from a thread of its own, which lagged past 1 s on
            # a loaded machine (CI: "completed 2" for collectives long done).
            time.sleep(3.0)
            return
        time.sleep(0.1)
    raise AssertionError("the gang did not reach its hang")


def _evidence(workers: list[RankWorker]) -> dict[int, dict]:
    reader = FlightRecorderDump(targets_of(workers))
    deadline = time.monotonic() + 10
    while not reader.done and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.done
    return {w.rank: flight_records(w.log_path.read_text()) for w in workers}


def _settled_evidence(
    workers: list[RankWorker], done: dict[int, int], timeout_s: float = 30.0
) -> dict:
    """The recorders' summaries once each rank has its first `done[rank]` collectives marked
    completed, asked again until then: the recorder marks them from a thread of its own, which
    lagged by seconds on a loaded machine (CI: "completed 2" after a 1 s wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _evidence(workers)
        completed = {
            w.rank: ((records[w.rank] or {}).get("groups") or {}).get("0", {}).get("completed", 0)
            for w in workers
        }
        if all(completed[r] >= n for r, n in done.items()) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


@pytest.mark.parametrize("world, behind", [(2, 1), (3, 0)])
def test_the_rank_its_peers_wait_for_is_named_from_real_flight_recorders(tmp_path, world, behind):
    """Two ranks are the case stacks cannot decide (no third to break the tie); the recorders'
    sequence numbers can."""
    workers = _gang(tmp_path, world, behind)
    try:
        _hung(workers)
        # The ranks waiting in #5 have #1-#4 completed. The rank behind is not waited for: what
        # its recorder has marked completed is not read by the verdict (below).
        records = _settled_evidence(workers, {r: 0 if r == behind else 4 for r in range(world)})
    finally:
        for worker in workers:
            worker.popen.kill()
            worker.popen.wait()
    assert all(records[r] is not None for r in range(world)), records
    default = {r: records[r]["groups"]["0"] for r in range(world)}
    # Three all-reduces and a broadcast entered by everyone (#1-#4); the others entered #5.
    # Any rank's recorder may keep the broadcast (#4) unmarked, root or receiver, behind or
    # waiting: on a loaded machine the root's did when it was the rank behind (both legs of CI,
    # 2026-12-06), a receiver's waiting in #5 (a later PostgreSQL leg), and the root's waiting in
    # #5 (2026-12-07, "completed 3" after 30 s of asking again); unloaded, none ever has. Which
    # collective torch marks completed is not this code's to decide; the verdict reads only what
    # the ranks entered and whether the waiting ones completed their last. The rank behind's own
    # count lagged further still in a fresh-clone CI (2026-12-07: "completed 2"): not asserted.
    broadcast_marked = (3, 4)
    assert default[behind]["entered"] == 4
    assert default[behind]["completed"] <= 4, default
    for rank in set(range(world)) - {behind}:
        assert default[rank]["entered"] == 5, default
        assert default[rank]["completed"] in broadcast_marked, default
        assert default[rank]["last"]["op"] == "gloo:all_reduce"
        assert default[rank]["last"]["sizes"] == [[8]]
    rank, why = flight_recorder_verdict(records)
    assert rank == behind, why
    assert why.startswith("never entered collective #5 (gloo:all_reduce of [[8]])"), why
    if world == 2:
        assert odd_rank_out({0: "same frame", 1: "same frame"}) is None


def test_a_rank_with_no_dump_pipe_gets_no_line(tmp_path):
    """A script that serves no pipe (any script under gloo but the reference trainer): no
    flight-recorder line is invented for it; its stacks are the evidence."""
    log = tmp_path / "rank-0.log"
    log.write_text("")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stem = str(tmp_path / "nccl-trace-rank-")
    worker = RankWorker(
        0,
        0,
        0,
        log,
        tmp_path / "m",
        sleeper,
        env={"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": stem, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem},
    )
    try:
        assert _evidence([worker]) == {0: None}
    finally:
        sleeper.kill()
        sleeper.wait()
    assert log.read_text() == ""


def _record(entered: int, completed: int, op: str = "nccl:all_reduce", sizes=((1024,),)) -> dict:
    last = {"seq": entered, "op": op, "sizes": [list(s) for s in sizes], "state": "started"}
    return {
        "groups": {
            "0": {"entered": entered, "completed": completed, "desc": "default_pg", "last": last}
        }
    }


def test_the_verdict_names_one_rank_or_none():
    waiting, done = _record(42, 41), _record(42, 42)
    assert flight_recorder_verdict({0: waiting, 1: waiting, 2: _record(41, 41), 3: waiting})[0] == 2
    # Everyone finished collective #42: the hang is outside the collectives; nobody is named.
    assert flight_recorder_verdict({r: done for r in range(4)}) is None
    # Two behind: no single culprit.
    behind = _record(41, 41)
    assert flight_recorder_verdict({0: waiting, 1: behind, 2: behind}) is None
    # A mismatched collective: rank 1 broadcasts where the others all-reduce.
    odd = _record(42, 41, op="nccl:broadcast")
    rank, why = flight_recorder_verdict({0: waiting, 1: odd, 2: waiting})
    assert rank == 1 and "mismatched collective" in why and "nccl:broadcast" in why, why
    # ... and with two ranks there is no telling which of them is wrong.
    assert flight_recorder_verdict({0: waiting, 1: odd}) is None
    # A sub-group (a tensor-parallel pair) that rank 3 never joined, the default group fine.
    pair = {"entered": 7, "completed": 6, "last": {"seq": 7, "op": "nccl:all_gather"}}
    late = {"entered": 6, "completed": 6, "last": {"seq": 6, "op": "nccl:all_gather"}}
    records = {
        r: {"groups": {"0": {"entered": 9, "completed": 9}, "2": g}}
        for r, g in ((2, pair), (3, late))
    } | {0: {"groups": {"0": {"entered": 9, "completed": 9}}}}
    assert flight_recorder_verdict(records)[0] == 3


def test_a_dump_is_read_as_plain_data_only(tmp_path):
    """The dump is the job's file, read as root: a pickle that names a class (which could run
    code), a link, or a pipe in its place is refused."""
    good = tmp_path / "good"
    good.write_bytes(
        pickle.dumps(
            {
                "pg_status": {"0": {"last_enqueued_collective": 3, "last_completed_collective": 2}},
                "entries": [],
            }
        )
    )
    assert summarize(load(good))["groups"]["0"] == {"entered": 3, "completed": 2}
    evil = tmp_path / "evil"
    evil.write_bytes(b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR.")
    with pytest.raises(ValueError, match="holds no os.system|posix.system"):
        load(evil)
    assert not (tmp_path / "pwned").exists()
    link = tmp_path / "link"
    link.symlink_to(good)
    with pytest.raises(OSError):
        load(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load(fifo)


def test_a_pipe_the_trainer_cannot_make_does_not_stop_training(tmp_path, monkeypatch, capsys):
    """Under gloo with the stems pointing at a directory that is not there: the trainer says
    so and goes on without a dump pipe."""
    import torch.distributed as dist

    from trainer.flight_recorder import serve_dump_pipe

    missing = str(tmp_path / "gone" / "nccl-trace-rank-")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", missing)
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", missing)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert serve_dump_pipe(0) is None
    finally:
        dist.destroy_process_group()
    assert "flight recorder: no dump pipe" in capsys.readouterr().out
