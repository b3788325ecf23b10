"""Start estimates as promises (jobs.scheduling.promises): on hand-made traces where the
live scheduler's estimate at submit, and an hour on, is known exactly, the simulator records
it and the error (actual first start - promise) it reports is the one worked out by hand."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.scheduling.promises import error_stats
from jobs.scheduling.simulate import SimConfig, run
from jobs.scheduling.trace import TraceJob

ROOT = Path(__file__).resolve().parent.parent

# One 8-GPU node, one team. `a` starts at once; `b` arrives at 10 and waits for all of it.
BEHIND = [TraceJob("a", 0, 8, 100, "t"), TraceJob("b", 10, 8, 50, "t")]


def by_job(result):
    """trace job id -> (GPUs, promise at submit, promise after 1 h, first start)."""
    ids = [r[0] for r in result.records]
    return {ids[i]: (g, at, later, start) for i, g, at, later, start in result.promises}


def test_a_job_behind_an_exact_estimate_is_promised_its_start_to_the_second():
    result = run(BEHIND, "lockstep", SimConfig(gpus=8, track_promises=True))
    assert by_job(result) == {"b": (8, 100.0, None, 100.0)}  # `a` never waited: no promise
    e = result.metrics["estimates"]
    assert e["placed_at_once"] == 1 and e["placed_at_once_by_size"]["2-8"] == 1
    s = e["at_submit"]
    assert (s["waited"], s["promised"], s["coverage"], s["count"]) == (1, 1, 1.0, 1)
    assert (s["median_abs_s"], s["p90_abs_s"], s["bias_s"]) == (0.0, 0.0, 0.0)
    assert s["by_size"]["2-8"]["count"] == 1 and s["by_size"]["1"]["count"] == 0
    assert s["by_size"]["1"]["median_abs_s"] is None  # no samples: no number
    assert e["after_1h"]["waited"] == 0  # b started long before an hour
    assert e["estimate_calls"] == 1


def test_an_estimate_that_runs_long_promises_late_and_the_job_starts_early():
    # With noisy runtime estimates `a` is believed to run 100 x f seconds, f the engine's
    # first log-normal draw for the seed; it really runs 100 s, so `b` starts at 100.
    sigma, seed = 0.5, 1
    f = random.Random(seed).lognormvariate(0.0, sigma)
    assert f > 1.2  # the seed makes `a`'s estimate too long (the test's premise)
    cfg = SimConfig(gpus=8, track_promises=True, estimate_noise=sigma, seed=seed)
    result = run(BEHIND, "lockstep", cfg)
    _, promise, _, start = by_job(result)["b"]
    assert start == 100.0
    assert promise == pytest.approx(100 * f, abs=1e-3)
    s = result.metrics["estimates"]["at_submit"]
    error = 100 - 100 * f  # started this much before its promise: negative
    assert s["bias_s"] == pytest.approx(error, abs=0.1) and s["bias_s"] < -20
    assert s["median_abs_s"] == pytest.approx(-error, abs=0.1)
    assert s["late_fraction"] == 0.0


def test_a_later_arrival_that_goes_first_breaks_the_promise_at_submit_not_the_one_after_1h():
    # `a` holds the node until 10,000. `b` (normal) arrives at 10 and is promised 10,000; `c`
    # (high priority, 5,000 s) arrives at 20 and goes first, so `b` starts at 15,000. An hour
    # after submit both wait and the estimate then knows `c`: `b` 15,000, `c` 10,000. The long
    # minimum run keeps `a` from being preempted for `c`.
    trace = [
        TraceJob("a", 0, 8, 10_000, "t"),
        TraceJob("b", 10, 8, 50, "t"),
        TraceJob("c", 20, 8, 5_000, "t", priority=2),
    ]
    cfg = SimConfig(gpus=8, track_promises=True, preempt_exempt_s=1e6)
    result = run(trace, "lockstep", cfg)
    assert result.starts() == {"a": 0, "b": 15_000, "c": 10_000}
    assert by_job(result) == {
        "b": (8, 10_000.0, 15_000.0, 15_000.0),
        "c": (8, 10_000.0, 10_000.0, 10_000.0),
    }
    e = result.metrics["estimates"]
    at, later = e["at_submit"], e["after_1h"]
    assert (at["count"], at["median_abs_s"], at["p90_abs_s"]) == (2, 2_500.0, 4_500.0)
    assert at["bias_s"] == 2_500.0 and at["late_fraction"] == 0.5  # b late by 5,000, c exact
    assert (later["count"], later["median_abs_s"], later["bias_s"]) == (2, 0.0, 0.0)
    assert e["estimate_calls"] == 4  # at 10 and 20 (submit), at 3,610 and 3,620 (1 h on)


def test_jobs_past_the_estimates_horizon_get_no_promise_and_lower_the_coverage():
    # One GPU. `a` runs until 100; 250 one-GPU jobs of 1,000 s arrive at 1 and run one after
    # another. The estimate replays at most 200 events: the first at 1 starts nothing, each
    # later one ends a job and starts the next, so the first 199 are promised, all exactly.
    queue = [TraceJob(f"q{k:03d}", 1, 1, 1_000, "t") for k in range(1, 251)]
    trace = [TraceJob("a", 0, 1, 100, "t"), *queue]
    result = run(trace, "lockstep", SimConfig(gpus=1, gpus_per_node=1, track_promises=True))
    promised = by_job(result)
    starts = result.starts()
    for k in range(1, 251):
        assert starts[f"q{k:03d}"] == 100 + 1_000 * (k - 1)
    at = result.metrics["estimates"]["at_submit"]
    assert (at["waited"], at["promised"], at["count"]) == (250, 199, 199)
    assert at["coverage"] == round(199 / 250, 4)
    assert at["p90_abs_s"] == 0.0
    assert promised["q199"][1] == starts["q199"] and promised["q200"][1] is None
    # An hour on (t = 3,601) q001-q004 have started (q004 at 3,100); from there the replay
    # again reaches 199 jobs: q005-q203.
    later = result.metrics["estimates"]["after_1h"]
    assert (later["waited"], later["promised"], later["p90_abs_s"]) == (246, 199, 0.0)
    assert promised["q004"][2] is None and promised["q203"][2] == starts["q203"]
    assert promised["q204"][2] is None


def test_estimates_appear_only_when_tracked_and_error_stats_are_signed_percentiles():
    assert "estimates" not in run(BEHIND, "lockstep", SimConfig(gpus=8)).metrics
    assert run(BEHIND, "lockstep", SimConfig(gpus=8)).promises == []
    s = error_stats([-100.0, 0.0, 50.0, 300.0, 1_000.0], waited=10, never_started=1)
    assert (s["count"], s["promised"], s["coverage"]) == (5, 6, 0.6)
    assert s["median_abs_s"] == 100.0 and s["bias_s"] == 50.0
    assert s["p90_abs_s"] == pytest.approx(720.0)  # |errors| 0,50,100,300,1000: 300 + 0.6 x 700
    assert s["late_fraction"] == 0.6
    empty = error_stats([], waited=0)
    assert empty["coverage"] is None and empty["median_abs_s"] is None


def test_simulate_estimates_flag_reports_the_errors(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("job_id,submit_s,gpus,duration_s,team,status\na,0,8,100,t,x\nb,10,8,50,t,x\n")
    base = [sys.executable, "-m", "lockstep_cli.cli", "simulate", "--trace", str(path)]
    out = subprocess.run(
        [*base, "--gpus", "8", "--estimates", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    e = json.loads(out)["estimates"]
    assert e["at_submit"]["count"] == 1 and e["at_submit"]["p90_abs_s"] == 0.0
    text = subprocess.run(
        [*base, "--gpus", "8", "--estimates"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "start estimates: 1 jobs placed at once" in text
    assert "at_submit    2-8       1     100%" in text
