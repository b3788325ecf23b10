"""The policy on many generated workloads in the target's shape (jobs.scheduling.generate):
no preemption loop, no job preempted more than the safety bound; with checkpoint-first stops no
worse than EASY backfill on mean JCT and starvation on every seed, and over the seeds no worse on
utilisation, work thrown away by preemptions included (on these short traces; longer ones put
lockstep 0.8 points below, docs/thrash.md). About 40 seconds.

Scaled down from the target (128 GPUs in nodes of 8, four teams, 150 jobs with quarter- and
half-cluster gangs, 10 % high and 20 % low priority, log-normal durations around an hour) so
that two dozen seeds run in the suite; loads from 80 % to 150 %. The 1,024-GPU trace of the
issue runs in bench/thrash.py (docs/thrash.md)."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from jobs.scheduling.generate import TraceShape, generate
from jobs.scheduling.simulate import SimConfig, run
from jobs.scheduling.trace import load_quotas, load_trace

ROOT = Path(__file__).resolve().parent.parent

SEEDS = range(24)
LOADS = (0.8, 1.0, 1.15, 1.3, 1.5)


def _shape(seed: int) -> TraceShape:
    return TraceShape(
        gpus=128,
        teams=4,
        jobs=150,
        load=LOADS[seed % len(LOADS)],
        seed=seed,
        duration_median_s=3600,
    )


@pytest.fixture(scope="module")
def runs():
    out = []
    for seed in SEEDS:
        shape = _shape(seed)
        trace = generate(shape)
        config = SimConfig(gpus=shape.gpus, quotas=shape.quotas())
        lockstep = run(trace, "lockstep", config)  # a preemption loop raises SimulationError
        # Checkpoint-first stops, as DESIGN's rule 6 preempts (the victim saves when told).
        saving = run(trace, "lockstep", replace(config, checkpoint_on_stop=True))
        backfill = run(trace, "backfill", config)
        out.append((seed, config, lockstep.metrics, backfill.metrics, saving.metrics))
    return out


def test_no_job_is_preempted_more_than_the_safety_bound_on_any_seed(runs):
    for seed, config, lockstep, _, saving in runs:
        for metrics in (lockstep, saving):
            per_job = metrics["preemptions_per_job"]
            assert per_job["max_in_a_day"] <= config.safety_stop, (seed, per_job)
            assert per_job["max"] <= 2 * config.safety_stop, (seed, per_job)
            assert per_job["mean_of_preempted"] <= 2.5, (seed, per_job)
            # The bound comes from the policy's own rules: the simulator (as the live action)
            # never had to refuse one of its proposals.
            assert metrics["safety_stops"] == 0, seed
            assert metrics["rejected_placements"] == 0, (seed, metrics["rejected_examples"])
            assert metrics["plans_missing_reasons"] == 0, seed


def test_on_every_seed_mean_jct_and_starvation_no_worse_than_easy_backfill(runs):
    # With checkpoint-first stops, on each trace by itself.
    for seed, _, _, backfill, saving in runs:
        assert saving["jct_mean_s"] <= backfill["jct_mean_s"], seed
        assert saving["starved"] <= backfill["starved"], seed
        assert saving["completed"] == saving["jobs"], seed


def test_over_the_seeds_no_worse_than_easy_backfill(runs):
    def total(key, which):
        return sum(r[which][key] for r in runs)

    # Index 2: lockstep, 3: backfill, 4: lockstep with checkpoint-first stops; same traces.
    assert total("jct_mean_s", 2) <= total("jct_mean_s", 3)
    assert total("utilization", 2) >= total("utilization", 3) - 0.005 * len(runs)
    assert total("starved", 2) <= total("starved", 3)
    assert all(r[2]["completed"] == r[2]["jobs"] for r in runs)
    # The trace's own work over the GPU time (no credit for work a preemption threw away): no
    # worse than backfill's over the seeds (0.819 against 0.810). Per trace it is not, on 9 of
    # 24: the last jobs of a 150-job trace decide its makespan, and the gap moves from -9 to
    # +7 points between seeds. On 1,200-job traces of the same shape, where the tail weighs
    # less, lockstep is 0.8 points below EASY backfill on average (bench/utilization_gap.py,
    # docs/thrash.md "Where the utilization goes, by ablation"): this sum does not show
    # that the gap is closed, only that it is small. Most of that gap is the restarts stops
    # cost (at 30 s a restart, -0.2), but even with stops free 11 of 24 traces stay below
    # EASY's ("What a restart costs decides the gap"): per trace it is not a property of the
    # policy under any stop cost, so it is not asserted per trace.
    assert total("work_utilization", 4) >= total("work_utilization", 3)


def test_the_generator_makes_the_shape_it_is_asked_for():
    shape = TraceShape(gpus=1024, teams=8, jobs=3000, load=1.15, seed=7)
    trace = generate(shape)
    assert trace == generate(shape)  # one seed, one trace
    assert len(trace) == 3000 and {j.team for j in trace} == set(shape.team_names())
    sizes = {j.gpus for j in trace}
    assert {8, 16, 32, 64, 256, 512} == sizes  # quarter and half of the cluster
    high = sum(j.priority == 2 for j in trace) / len(trace)
    low = sum(j.priority == 0 for j in trace) / len(trace)
    assert 0.08 < high < 0.12 and 0.17 < low < 0.23
    span = trace[-1].submit_s - trace[0].submit_s
    offered = sum(j.gpus * j.duration_s for j in trace) / (shape.gpus * span)
    assert 1.05 < offered < 1.25  # Poisson arrivals at the asked load
    assert sum(q.quota for q in shape.quotas().values()) == 1024
    with pytest.raises(ValueError, match="shares"):
        TraceShape(teams=2, shares=(1.0,))
    with pytest.raises(ValueError, match="sizes"):
        TraceShape(sizes={"eleventy": 1.0})


def test_the_cli_writes_a_generated_trace_and_quotas_that_simulate_replays(tmp_path):
    trace, quotas = tmp_path / "t.csv", tmp_path / "q.csv"
    cli = [sys.executable, "-m", "lockstep_cli.cli"]
    generated = [
        "trace",
        "--gpus",
        "64",
        "--teams",
        "2",
        "--jobs",
        "40",
        "--seed",
        "5",
        "-o",
        str(trace),
        "--quotas-out",
        str(quotas),
    ]
    subprocess.run(cli + generated, cwd=ROOT, check=True, timeout=60)
    shape = TraceShape(gpus=64, teams=2, jobs=40, seed=5)
    assert load_trace(trace) == generate(shape)  # the CSV round-trips, priorities included
    assert load_quotas(quotas) == shape.quotas()
    out = subprocess.run(
        cli + ["simulate", "--trace", str(trace), "--quotas", str(quotas), "--gpus", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "preemptions of one job" in out and "most in a day" in out
    # Bad input: a clear message, exit 2, nothing written.
    bad = subprocess.run(
        cli + ["trace", "--sizes", "8=1,huge=2", "-o", str(tmp_path / "bad.csv")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "'huge' is not a GPU count" in bad.stderr
    assert not (tmp_path / "bad.csv").exists()
