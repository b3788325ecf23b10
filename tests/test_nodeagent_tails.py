"""Node agent: forwarding each rank's metrics and log files to the portal.

The tails read what a worker appended, hold a partial line or character back, resend until a
heartbeat that carried it is acknowledged, and keep the heartbeat valid JSON when a script
writes NaN. The shared helpers are in tests/nodeagent_helpers.py.
"""

from __future__ import annotations

import json

import pytest

from nodeagent.tail import LogTail, MetricsTail
from tests.nodeagent_helpers import (
    clean_env_fixture,  # noqa: F401 (fixture)
    launch_spec,
    portal_fixture,  # noqa: F401 (fixture)
    run_item,
    running_agent_fixture,  # noqa: F401 (fixture)
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def test_metrics_tail_holds_a_partial_line_and_resends_until_acked(tmp_path):
    path = tmp_path / "rank-1.metrics.jsonl"
    tail = MetricsTail(path, rank=1)
    assert tail.read() == ([], 0)  # no file yet
    with open(path, "ab") as f:
        f.write(b'{"kind": "step", "step": 1, "loss": 2.5}\n{"kind": "st')
    records, end = tail.read()
    assert records == [{"kind": "step", "step": 1, "loss": 2.5, "rank": 1}]
    assert not tail.at_eof  # the half-written line is still owed
    # The heartbeat carrying it failed: no ack, so the same record comes again, plus the rest.
    with open(path, "ab") as f:
        f.write(b'ep", "step": 2, "rank": 0}\n')
    records, end = tail.read()
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["rank"] == 0  # a rank the trainer wrote is kept
    tail.ack(end)
    assert tail.read() == ([], end)
    assert tail.at_eof


def test_metrics_tail_skips_bad_lines_and_a_torn_last_line_once_the_writer_exited(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'not json\n[1, 2]\n{"step": 3}\n{"step": 4, "lo')
    tail = MetricsTail(path, rank=0)
    records, end = tail.read()
    assert records == [{"step": 3, "rank": 0}]
    tail.ack(end)
    records, end = tail.read(final=True)
    assert records == [] and tail.at_eof
    tail.ack(end)
    assert end == path.stat().st_size


def test_metrics_tail_turns_nan_and_infinities_into_null(tmp_path):
    """Python's json.dumps writes NaN and Infinity unless told not to, so a script that logs a
    diverged loss does. The heartbeat body must stay JSON the portal accepts."""
    import requests

    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"step": 1, "loss": NaN, "tokens_per_s": Infinity, "step_time_s": -Infinity}\n'
        '{"step": 2, "loss": 1e999, "grad": [NaN, 2.5], "compute_s": 0.25}\n'
    )
    records, _ = MetricsTail(path, rank=0).read()
    assert records == [
        {"step": 1, "loss": None, "tokens_per_s": None, "step_time_s": None, "rank": 0},
        {"step": 2, "loss": None, "grad": [None, 2.5], "compute_s": 0.25, "rank": 0},
    ]
    body = requests.Request("POST", "http://portal", json={"records": records}).prepare().body
    assert json.loads(body)["records"] == records


def test_log_tail_ships_at_most_64k_per_read_and_resends_until_acked(tmp_path):
    path = tmp_path / "rank-0.log"
    path.write_bytes(b"a" * 100_000)
    tail = LogTail(path, rank=0)
    text, end = tail.read()
    assert len(text) == 64 * 1024 and end == 64 * 1024 and not tail.at_eof
    assert tail.read() == (text, end)  # not acked: the same chunk again
    tail.ack(end)
    text, end = tail.read()
    assert len(text) == 100_000 - 64 * 1024 and tail.at_eof


def test_log_tail_does_not_split_a_utf8_character(tmp_path):
    path = tmp_path / "rank-0.log"
    snowman = "☃".encode()
    path.write_bytes(b"loss " + snowman[:2])
    tail = LogTail(path, rank=0)
    text, end = tail.read()
    assert text == "loss " and end == 5
    tail.ack(end)
    with open(path, "ab") as f:
        f.write(snowman[2:] + b"\xff\n")
    text, end = tail.read()
    assert text == "☃\ufffd\n"  # invalid bytes are replaced, not fatal


# -- through the agent's heartbeats ----------------------------------------------------------


DIVERGED = """
import json, os, time
rank = int(os.environ["RANK"])
with open(os.environ["LOCKSTEP_METRICS_PATH"], "a") as f:
    for step, loss in ((1, 2.0), (2, float("nan")), (3, float("inf"))):
        f.write(json.dumps({"kind": "step", "step": step, "loss": loss, "time": time.time()}))
        f.write("\\n")
"""


def test_agent_keeps_heartbeating_when_a_script_writes_nan(portal, running_agent):
    wait_until(lambda: portal.accepted, what="a first heartbeat")
    ranks = [{"rank": 0, "local_rank": 0, "gpu_index": 0}]
    portal.set_desired(
        [run_item(31, launch_spec(DIVERGED, ranks, world_size=1, group_rank=0, group_world_size=1))]
    )

    def exited_beat():
        reports = portal.attempt_in_beats(31)
        return [a for a in reports if all(r["state"] == "exited" for r in a["ranks"])]

    wait_until(exited_beat, what="the rank's exit reported")
    losses = sorted(
        (r["step"], r["loss"]) for a in portal.attempt_in_beats(31) for r in a["records"]
    )
    assert losses == [(1, 2.0), (2, None), (3, None)]
    assert portal.invalid == []
