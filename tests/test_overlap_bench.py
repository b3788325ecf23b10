"""The communication-overlap benchmark (bench/overlap.py): its interval accounting
(bench/overlap_trace.py) on a trace whose answer is known, and a real 2-rank gloo run whose
profiled steps must add up."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import overlap_trace as ov  # noqa: E402

Ev = ov.Ev


def test_hidden_and_exposed_are_the_parts_of_communication_under_and_outside_compute():
    main, gloo_a, gloo_b = 1, 2, 3
    events = [
        Ev("overlap::step", main, 0, 100),
        Ev("overlap::forward", main, 0, 30),
        Ev("overlap::backward", main, 30, 90),
        Ev("overlap::optimizer", main, 90, 100),
        # Compute: a matmul with a nested op (its self time plus the child's: all of [0, 30]).
        Ev("aten::mm", main, 0, 30),
        Ev("aten::expand", main, 5, 6),
        Ev("aten::addmm", main, 30, 58),
        Ev("aten::view", main, 59, 60),  # 1 us after addmm: the interpreter, bridged
        Ev("c10d::allreduce_", main, 60, 62),  # launching a collective: not compute
        # FSDP's frame: its copy is compute, its own time (a Python-level wait) is not.
        Ev("FSDP::all_gather (blocks.0)", main, 62, 70),
        Ev("aten::copy_", main, 62, 63),
        Ev("aten::add_", main, 80, 88),  # after 17 us of nothing: a wait, not bridged
        Ev("aten::mul_", main, 90, 95),  # 2 us after add_: bridged
        # Two collectives at once on gloo's two threads: [40, 85] in flight, 45 us.
        Ev("gloo:all_reduce", gloo_a, 40, 75),
        Ev("gloo:all_reduce", gloo_b, 50, 85),
        Ev("aten::copy_", gloo_b, 84, 85),  # a gloo thread's op is not the main thread's compute
    ]
    # The other rank entered the first collective at 45 and the second at 82.
    peer = [[(45.0, 75.0), (82.0, 85.0)]]
    (step,) = ov.analyze(events, gap_us=5, peers=[peer])
    assert step["step_us"] == 100
    assert step["comm_us"] == 45
    assert step["comm_sum_us"] == 35 + 35
    assert step["collectives"] == 2
    # Under compute: [40, 60] + [62, 63] + [80, 85].
    assert step["hidden_us"] == 26
    assert step["exposed_us"] == 19
    assert step["share"] == pytest.approx(26 / 45)
    assert step["busy_us"] == 60 + 1 + 15
    # Waiting for the peer: [40, 45] (under compute) and [50, 82] (of which [60, 62] and
    # [63, 80] exposed).
    assert step["peer_wait_us"] == 5 + 32
    assert step["exposed_peer_wait_us"] == 2 + 17
    assert step["phases"]["forward"]["comm_us"] == 0
    assert step["phases"]["backward"] == {
        "comm_us": 45,
        "hidden_us": 26,
        "exposed_us": 19,
        "share": pytest.approx(26 / 45),
        "collectives": 2,
    }
    assert step["phases"]["optimizer"]["share"] is None


def test_a_collective_is_cut_at_the_end_of_the_phase_that_started_it():
    step = Ev("overlap::step", 1, 0, 100)
    backward = Ev("overlap::backward", 1, 30, 90)
    late = Ev("gloo:all_reduce", 2, 80, 97)  # its event closed after the main thread went on
    inside = Ev("gloo:all_reduce", 3, 40, 60)
    between = Ev("gloo:all_reduce", 3, 95, 120)  # outside any phase: the step's end
    kept, cut = ov.closed_by_phase([late, inside, between], [backward, step])
    assert kept == [late._replace(end=90), inside, between._replace(end=100)]
    assert cut == [(late, 7), (between, 20)]


def test_interval_arithmetic():
    a = ov.union([(0, 10), (5, 12), (20, 30), (30, 31)])
    assert a == [(0, 12), (20, 31)]
    b = ov.union([(2, 4), (11, 25)])
    assert ov.intersect(a, b) == [(2, 4), (11, 12), (20, 25)]
    assert ov.subtract(a, b) == [(0, 2), (4, 11), (25, 31)]
    assert ov.length(ov.intersect(a, b)) + ov.length(ov.subtract(a, b)) == ov.length(a)
    assert ov.clip(a, 5, 22) == [(5, 12), (20, 22)]


def test_a_real_two_rank_sweep_accounts_for_every_collective(tmp_path):
    out = tmp_path / "overlap.json"
    settings = "ddp-nosync,ddp-0.05,ddp-25,fsdp-explicit1-async"
    done = subprocess.run(
        [sys.executable, "bench/overlap.py", "--quick", "--settings", settings]
        + ["--n-layer", "2", "--n-embd", "64", "--batch-size", "4"]
        + ["--out", str(out), "--no-figure", "--deadline-s", "240"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".csv").is_file()
    rows = {r["setting"]: r for r in result["rows"]}
    assert set(rows) == set(settings.split(","))
    for name, row in rows.items():
        assert len(row["ranks"]) == 2
        for rank in row["ranks"]:
            assert len(rank["profiled"]) == 2
            for st in rank["profiled"]:
                assert st["hidden_us"] + st["exposed_us"] == pytest.approx(st["comm_us"], abs=1e-6)
                assert 0 <= st["hidden_us"] <= st["comm_us"] <= st["step_us"], name
                assert st["comm_us"] <= st["comm_sum_us"] + 1e-6
                if st["comm_us"] > 0:
                    assert 0 <= st["share"] <= 1
                    assert 0 <= st["exposed_peer_wait_us"] <= st["exposed_us"] + 1e-6
                    assert st["exposed_peer_wait_us"] <= st["peer_wait_us"] <= st["comm_us"]
                phases = st["phases"]
                assert set(phases) == {"forward", "backward", "optimizer"}
                assert sum(p["comm_us"] for p in phases.values()) <= st["comm_us"] + 1e-6
                for p in phases.values():
                    assert p["hidden_us"] + p["exposed_us"] == pytest.approx(p["comm_us"])
    # No gradient sync: no collective in the forward or backward pass (the optimizer phase's
    # gradient clip may have its own, whatever the mode).
    for rank in rows["ddp-nosync"]["ranks"]:
        for st in rank["profiled"]:
            for phase in ("forward", "backward"):
                assert st["phases"][phase]["collectives"] == 0
                assert st["phases"][phase]["comm_us"] == 0
    # DDP: one all-reduce per bucket a step, all in the backward pass.
    for name in ("ddp-0.05", "ddp-25"):
        buckets = len(rows[name]["buckets"])
        for rank in rows[name]["ranks"]:
            for st in rank["profiled"]:
                assert st["phases"]["backward"]["collectives"] == buckets
                assert st["phases"]["forward"]["collectives"] == 0
                assert st["collectives"] >= buckets
    assert len(rows["ddp-0.05"]["buckets"]) > 1 and len(rows["ddp-25"]["buckets"]) == 1
    # FSDP gathers parameters in the forward pass.
    for rank in rows["fsdp-explicit1-async"]["ranks"]:
        assert all(st["phases"]["forward"]["comm_us"] > 0 for st in rank["profiled"])
    summary = {r["setting"]: r for r in result["summary"]}
    assert summary["ddp-nosync"]["backward_share"] is None and summary["ddp-0.05"]["buckets"] > 1
    assert 0 <= summary["ddp-0.05"]["backward_share"] <= 1
    assert result["config"]["grad_bytes"] == 4 * result["config"]["params"]
