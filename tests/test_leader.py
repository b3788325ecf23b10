"""The scheduler's leader lease, on the suite's Redis (embedded, or REDIS_URL in .ci/run), and
two real `run_scheduler` processes: only one runs passes; the other takes over when it stops."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from jobs.scheduling.leader import LeaderLease, lease_key
from jobs.scheduling.wake import redis_client
from portal.settings import sqlite_database
from tests.live import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def key():
    name = f"{lease_key()}:test:{os.getpid()}"
    yield name
    redis_client().delete(name)


def test_one_holder_at_a_time_renewal_only_by_the_holder_and_release(key):
    first, second = LeaderLease(2, key=key), LeaderLease(2, key=key)
    assert first.acquire_or_renew() is True
    assert second.acquire_or_renew() is False
    assert second.holder() == first.identity
    assert first.acquire_or_renew() is True  # renews
    # A stale holder whose key was taken over cannot renew it.
    redis_client().set(key, second.identity, px=2000)
    second.held = True
    assert first.acquire_or_renew() is False
    assert second.acquire_or_renew() is True
    first.release()  # not the holder: must not delete the other's lease
    assert redis_client().get(key).decode() == second.identity
    second.release()
    assert redis_client().get(key) is None
    assert first.acquire_or_renew() is True
    first.release()


def test_the_lease_expires_when_its_holder_stops_renewing(key):
    first, second = LeaderLease(1, key=key), LeaderLease(1, key=key)
    assert first.acquire_or_renew()
    assert not second.acquire_or_renew()
    time.sleep(1.3)
    assert second.acquire_or_renew()
    assert not first.acquire_or_renew()
    second.release()


def test_leases_of_two_databases_do_not_meet(tmp_path):
    assert lease_key(sqlite_database(tmp_path / "a.sqlite3")) != lease_key(
        sqlite_database(tmp_path / "b.sqlite3")
    )
    assert lease_key(sqlite_database(tmp_path / "a.sqlite3")) == lease_key(
        sqlite_database(tmp_path / "a.sqlite3")
    )


def test_a_second_scheduler_stands_by_and_takes_over_when_the_leader_stops(tmp_path):
    database = tmp_path / "lease.sqlite3"
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        DATABASE_URL=f"sqlite:///{database}",
        REDIS_URL=settings.REDIS_URL,
        LOCKSTEP_SCHEDULER_TICK_S="0.3",
    )
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )
    key = lease_key(sqlite_database(database))
    cmd = [sys.executable, "manage.py", "run_scheduler"]
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("leader", "standby")}  # noqa: SIM115
    leader = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=logs["leader"])
    standby = None
    try:
        _wait_for_holder(key, leader.pid)
        standby = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=logs["standby"])
        # Until the standby has tried and lost (a loaded host takes seconds to start Django),
        # then a few more of its ticks: the leader keeps the lease throughout.
        wait_for(
            lambda: "is not the leader" in (tmp_path / "standby.log").read_text(),
            120,
            "the standby to find a leader",
        )
        time.sleep(1)
        assert standby.poll() is None and _holder_pid(key) == leader.pid
        leader.terminate()  # SIGTERM: releases the lease on the way out
        assert leader.wait(timeout=30) == 0
        # Handed over at once, well before the 15 s lease would have expired.
        _wait_for_holder(key, standby.pid, timeout=8)
        standby.terminate()
        assert standby.wait(timeout=30) == 0
    finally:
        for proc in (leader, standby):
            if proc is not None and proc.poll() is None:
                proc.kill()
    logs["standby"].seek(0)
    standby_log = logs["standby"].read()
    assert "is not the leader" in standby_log and "is the leader" in standby_log, standby_log
    assert redis_client().get(key) is None  # the standby released it too


def _holder_pid(key: str) -> int | None:
    value = redis_client().get(key)
    return int(value.decode().split(":")[1]) if value else None


def _wait_for_holder(key: str, pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _holder_pid(key) == pid:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} never became the leader (holder: {_holder_pid(key)})")
