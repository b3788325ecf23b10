"""The scheduler simulator and its baselines, on hand-made traces (no database)."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from jobs.scheduling.baselines import fifo
from jobs.scheduling.generate import TraceShape, generate
from jobs.scheduling.simulate import SimConfig, SimulationError, run, simulate
from jobs.scheduling.trace import TeamQuota, TraceJob, load_quotas, load_trace, traces_dir
from jobs.scheduling.vocab import _TEXTS, Plan, Preemption

ROOT = Path(__file__).resolve().parent.parent
MSFT = traces_dir() / "msft_itp_2021.csv"
HEADER = "job_id,submit_s,gpus,duration_s,team,status"


def write_trace(tmp_path, rows: list[str], header: str = HEADER) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def jobs(*rows) -> list[TraceJob]:
    return [
        TraceJob(job_id, submit, gpus, duration, team)
        for job_id, submit, gpus, duration, team in rows
    ]


# Two 8-GPU nodes. `a` and `x` start at once (a on n1, x on n2). The 8-GPU head `b` cannot fit
# until `a` ends at 100; EASY reserves n1 for it. `c` is long but fits in n2's two free GPUs
# (not the head's node); `d` uses n1's free GPUs but ends at 53, before the reservation; `e` is
# long and n2 is full, so it must wait.
HOL = jobs(
    ("a", 0, 4, 100, "t"),
    ("x", 0, 6, 1000, "t"),
    ("b", 1, 8, 100, "t"),
    ("c", 2, 2, 500, "t"),
    ("d", 3, 4, 50, "t"),
    ("e", 4, 4, 200, "t"),
)


def test_fifo_head_of_line_blocks_everyone_behind_a_big_job():
    result = run(HOL, "fifo", SimConfig(gpus=16))
    assert result.starts() == {"a": 0, "x": 0, "b": 100, "c": 100, "d": 200, "e": 200}


def test_easy_backfill_starts_small_jobs_early_without_delaying_the_head():
    result = run(HOL, "backfill", SimConfig(gpus=16))
    starts = result.starts()
    assert starts["b"] == 100  # the head starts exactly when FIFO starts it
    assert starts["c"] == 2  # long, but off the head's reserved node
    assert starts["d"] == 3  # on the reserved node, but done (t=53) before the head needs it
    assert starts["e"] == 200  # long and only the reserved node has room: waits
    assert (
        result.metrics["wait_mean_s"] < run(HOL, "fifo", SimConfig(gpus=16)).metrics["wait_mean_s"]
    )


def test_backfill_does_not_trust_jobs_without_an_estimate_on_the_reserved_node():
    one_node = jobs(("a", 0, 4, 100, "t"), ("b", 1, 8, 100, "t"), ("c", 2, 2, 50, "t"))
    assert run(one_node, "backfill", SimConfig(gpus=8)).starts() == {"a": 0, "b": 100, "c": 2}
    noisy = SimConfig(gpus=8, estimate_noise=3.0, seed=1)  # c's estimate is far too long
    assert run(one_node, "backfill", noisy).starts()["c"] in (2, 200)


def test_lockstep_holds_a_teams_next_gpus_for_its_cap_blocked_job():
    # One team, quota = the 8-GPU node. b (8 GPUs) is blocked by the team's cap while a runs;
    # c ends before a does and may pass; d (500 s) must not, or b would wait for it too.
    one_team = jobs(
        ("a", 0, 4, 100, "t"), ("b", 1, 8, 100, "t"), ("c", 2, 2, 50, "t"), ("d", 3, 2, 500, "t")
    )
    starts = run(one_team, "lockstep", SimConfig(gpus=8)).starts()
    assert starts["b"] == 100 and starts["c"] == 2
    assert starts["d"] == 200  # after b, not before it


def test_utilization_jct_and_wait_match_a_hand_computation():
    # One 8-GPU node, FIFO: j1 runs 0-100 on all 8 GPUs; j2 (4 GPUs, 50 s) and j3 (4 GPUs,
    # 100 s) both start at 100 and end at 150 and 200.
    trace = jobs(("j1", 0, 8, 100, "t"), ("j2", 0, 4, 50, "t"), ("j3", 10, 4, 100, "t"))
    m = run(trace, "fifo", SimConfig(gpus=8)).metrics
    busy = 8 * 100 + 4 * 50 + 4 * 100  # 1400 GPU-seconds
    assert m["makespan_s"] == 200
    assert m["utilization"] == round(busy / (8 * 200), 4) == 0.875
    # The queue is non-empty from 0 to 100, and all 8 GPUs are busy then.
    assert m["utilization_when_backlogged"] == 1.0
    assert m["backlogged_fraction"] == 0.5
    # JCTs 100, 150, 190; waits 0, 100, 90.
    assert m["jct_mean_s"] == round(440 / 3, 1)
    assert m["jct_median_s"] == 150
    assert m["jct_p99_s"] == round(150 + 0.98 * 40, 1)
    assert m["wait_mean_s"] == round(190 / 3, 1)
    assert m["by_size"]["2-8"] == {
        "jobs": 3,
        "wait_mean_s": round(190 / 3, 1),
        "wait_p99_s": round(90 + 0.98 * 10, 1),
        "jct_mean_s": round(440 / 3, 1),
        "jct_p99_s": round(150 + 0.98 * 40, 1),
    }
    assert m["by_size"]["1"]["jobs"] == 0
    # One team owns the whole cluster, so its fair share fits every job: FTF = JCT / duration.
    assert m["ftf_max"] == 3.0  # j2: 150 / 50
    assert m["busy_gpu_hours"] == round(busy / 3600, 1)
    assert m["starved"] == 0 and m["jobs"] == 3 and m["dropped"] == 0


def test_utilization_while_a_queued_job_fits_counts_only_gpus_something_queued_could_use():
    # HOL under FIFO: from 2 to 100, c (2 GPUs) waits behind b although n2 has 2 idle GPUs:
    # GPUs a queued job could use. From 1 to 2 only b (8 GPUs) is queued and no node has 8
    # free: idle, but nothing queued fits, so it does not count.
    m = run(HOL, "fifo", SimConfig(gpus=16)).metrics
    # Busy while c..e wait: a (4) + x (6) until 100; then x + b + c = 16, nothing idle.
    assert m["idle_gpu_hours_while_fit_queued"] == round(6 * 98 / 3600, 1)
    fit_s = m["fit_queued_fraction"] * m["makespan_s"]
    assert fit_s == pytest.approx(98, abs=1)
    assert m["utilization_when_fit_queued"] == pytest.approx(10 / 16, abs=1e-3)
    # EASY backfill starts c and d at once: the idle time left is the reserved node's, held
    # for b, while e (200 s, longer than the reservation allows) waits.
    backfill = run(HOL, "backfill", SimConfig(gpus=16)).metrics
    assert backfill["idle_gpu_hours_while_fit_queued"] < m["idle_gpu_hours_while_fit_queued"]


def test_idle_gpus_while_a_queued_job_fits_are_put_down_to_the_plans_reason():
    # Every idle GPU-second while a queued job fits goes to the wait reason the last plan gave
    # the first such job (WaitReason codes), so the split adds up to the total.
    shape = TraceShape(gpus=64, teams=2, jobs=60, load=1.3, seed=3, duration_median_s=1800)
    config = SimConfig(gpus=64, quotas=shape.quotas())
    m = run(generate(shape), "lockstep", config).metrics
    by_reason = m["idle_gpu_hours_while_fit_queued_by_reason"]
    assert m["idle_gpu_hours_while_fit_queued"] > 0 and by_reason
    assert set(by_reason) <= set(_TEXTS) | {"team_limit_paused"}
    # Each figure is rounded to 0.1 GPU-hour: the sum may be off by half that per reason.
    rounding = 0.05 * (len(by_reason) + 1) + 1e-9
    assert sum(by_reason.values()) == pytest.approx(
        m["idle_gpu_hours_while_fit_queued"], abs=rounding
    )
    assert m["work_utilization"] <= m["utilization"]
    # A baseline gives its reasons as text only: its idle time is counted, not explained.
    fifo_m = run(HOL, "fifo", SimConfig(gpus=16)).metrics
    assert fifo_m["idle_gpu_hours_while_fit_queued_by_reason"] == {
        "unexplained": fifo_m["idle_gpu_hours_while_fit_queued"]
    }
    assert fifo_m["work_utilization"] == fifo_m["utilization"]  # nothing thrown away


def test_jobs_larger_than_the_cluster_are_dropped_and_counted():
    trace = jobs(("small", 0, 8, 10, "t"), ("huge", 0, 32, 10, "t"), ("big", 5, 16, 10, "t"))
    m = run(trace, "fifo", SimConfig(gpus=16)).metrics
    assert m["dropped"] == 1
    assert m["jobs"] == 2 and m["completed"] == 2


def reclaim_for(victim: int, claimant: int):
    """A scripted planner: FIFO, except that while `claimant` waits it goes first (the victim is
    held back) and `victim` is asked to stop for it."""

    def planner(snapshot):
        queued = {j.id for j in snapshot.queued}
        if claimant not in queued:
            return fifo(snapshot)
        plan = fifo(replace(snapshot, queued=tuple(j for j in snapshot.queued if j.id != victim)))
        reasons = {**plan.reasons, **({victim: "after the claimant"} if victim in queued else {})}
        running = {r.id: r for r in snapshot.running}
        stop = victim in running and not running[victim].stopping
        preemptions = (Preemption(victim, claimant, "reclaim", "scripted"),) if stop else ()
        return Plan(plan.placements, reasons, None, preemptions)

    return planner


PREEMPT = jobs(("long", 0, 8, 10_000, "a"), ("claim", 4_000, 8, 100, "b"))


def test_preempted_job_loses_work_since_its_last_checkpoint_and_is_requeued():
    quotas = {"a": TeamQuota(0, 8), "b": TeamQuota(8, 0)}  # a runs on b's lent GPUs
    config = SimConfig(gpus=8, quotas=quotas, checkpoint_interval_s=1800, grace_s=60)
    result = run(PREEMPT, reclaim_for(1, 2), config)
    m = result.metrics
    # Stopped at 4060 (grace), last checkpoint at 3600: 460 s on 8 GPUs lost.
    assert m["preempted_gpu_hours"] == round(8 * 460 / 3600, 1)
    assert m["preempted_gpu_hours_by_kind"] == {"reclaim": round(8 * 460 / 3600, 1)}
    assert m["preemptions"]["executed"] == 1 and m["preemptions"]["stopped"] == 1
    by_id = {r[0]: r for r in result.records}
    assert by_id["claim"][3] == 4060  # started when the victim's GPUs came back
    # The victim resumes after the claimant (100 s) with 10000 - 3600 s left, after its
    # restart cost (120 s).
    assert by_id["long"][3] == 0 and by_id["long"][4] == 4160 + 120 + 6400
    assert by_id["long"][5] == 1
    # b's job was within b's quota from t=4000: the reclaim took the grace period.
    assert m["teams"]["b"]["reclaim_max_s"] == 60
    assert m["utilization"] == round((4060 + 100 + 120 + 6400) * 8 / (8 * 10_680), 4)
    # The work the trace asked for, without the 460 s thrown away nor the restart.
    assert m["work_utilization"] == round((10_000 + 100) * 8 / (8 * 10_680), 4)
    assert m["preemptions_per_job"] == {
        "max": 1,
        "p99": 0.99,
        "jobs_preempted": 1,
        "mean_of_preempted": 1.0,
        "max_in_a_day": 1,
    }


def test_checkpoint_on_stop_loses_nothing():
    config = SimConfig(gpus=8, grace_s=60, checkpoint_on_stop=True)
    result = run(PREEMPT, reclaim_for(1, 2), config)
    assert result.metrics["preempted_gpu_hours"] == 0
    assert {r[0]: r[4] for r in result.records}["long"] == 4160 + 120 + 10_000 - 4060


def test_a_restart_costs_the_victim_its_restart_time_and_nothing_more():
    config = SimConfig(gpus=8, grace_s=60, checkpoint_on_stop=True, restart_s=0)
    result = run(PREEMPT, reclaim_for(1, 2), config)
    assert {r[0]: r[4] for r in result.records}["long"] == 4160 + 10_000 - 4060


def test_a_policy_that_preempts_in_a_loop_is_stopped_with_an_error():
    def ping_pong(snapshot):  # FIFO restarts the victim at once, and it is preempted again
        plan = fifo(snapshot)
        victims = [r for r in snapshot.running if not r.stopping]
        if snapshot.queued and victims:
            stop = Preemption(victims[0].id, snapshot.queued[0].id, "reclaim", "loop")
            return Plan(plan.placements, plan.reasons, None, (stop,))
        return plan

    with pytest.raises(SimulationError, match="preempted 100 times"):
        run(PREEMPT, ping_pong, SimConfig(gpus=8, grace_s=0, safety_stop=0))


def test_the_safety_stop_refuses_a_looping_policy_and_counts_the_alert():
    def ping_pong(snapshot):
        plan = fifo(snapshot)
        victims = [r for r in snapshot.running if not r.stopping]
        if snapshot.queued and victims:
            stop = Preemption(victims[0].id, snapshot.queued[0].id, "reclaim", "loop")
            return Plan(plan.placements, plan.reasons, None, (stop,))
        return plan

    m = run(PREEMPT, ping_pong, SimConfig(gpus=8, grace_s=0, safety_stop=3)).metrics
    assert m["completed"] == 2
    # Stopped three times within a day, then refused: the live action refuses the same way.
    assert m["preemptions_per_job"]["max"] == m["preemptions_per_job"]["max_in_a_day"] == 3
    assert m["safety_stops"] == 1
    assert m["preemptions"]["refused"] >= 1


def test_lockstep_reclaims_borrowed_gpus_within_the_grace_period(tmp_path):
    quotas = tmp_path / "quotas.csv"
    quotas.write_text("team,quota,borrow_limit,weight\na,8,8,1\nb,8,8,1\n")
    trace = jobs(
        ("a1", 0, 8, 20_000, "a"),
        ("a2", 0, 8, 20_000, "a"),  # borrows b's idle quota
        ("b1", 4_000, 8, 100, "b"),  # b asks for its quota back
    )
    config = SimConfig(gpus=16, quotas=load_quotas(quotas), grace_s=60)
    m = run(trace, "lockstep", config).metrics
    assert m["preemptions"]["by_kind"].get("reclaim") == 1
    assert m["teams"]["b"]["reclaim_max_s"] == 60
    assert m["preempted_gpu_hours"] > 0


def test_a_reclaim_clock_stops_when_the_team_holds_its_whole_quota_again(tmp_path):
    # a borrows all of b's quota; b1 asks for it back at 100 s, b2 at 200 s. Nothing is
    # reclaimed (a planner that starts the latest submitted job first, without preemption):
    # a2 ends at 1,000 s and b2 takes the GPUs. From then on b holds its whole quota, so b1's
    # clock stops at 900 s; b1 then waits for its own team's b2 (until 6,000 s), which is no
    # reclaim. Kept running, the clock read 5,900 s.
    def latest_first(snapshot):
        flipped = (  # FIFO with submit times mirrored: the latest submitted first
            replace(j, submitted_at=snapshot.now + (snapshot.now - j.submitted_at))
            for j in snapshot.queued
        )
        return fifo(replace(snapshot, queued=tuple(flipped)))

    quotas = tmp_path / "quotas.csv"
    quotas.write_text("team,quota,borrow_limit,weight\na,8,8,1\nb,8,8,1\n")
    trace = jobs(
        ("a1", 0, 8, 20_000, "a"),
        ("a2", 0, 8, 1_000, "a"),
        ("b1", 100, 8, 100, "b"),
        ("b2", 200, 8, 5_000, "b"),
    )
    result = run(trace, latest_first, SimConfig(gpus=16, quotas=load_quotas(quotas)))
    starts = {r[0]: r[3] for r in result.records}
    assert starts["b2"] == 1_000 and starts["b1"] == 6_000  # the scenario happened
    b = result.metrics["teams"]["b"]
    assert b["reclaims"] == 1 and b["reclaim_max_s"] == 900


def test_a_claimant_stops_one_victim_and_gets_its_gpu_though_passes_run_during_the_grace(
    tmp_path,
):
    # a borrows all of b's 8 GPUs with 1-GPU jobs; b1 reclaims one. More of a's jobs queue
    # during the grace, so passes run every 10 s: each used to stop one more victim for b1
    # (the one already stopping no longer counted), and the GPUs freed went to whoever came
    # first in the order.
    quotas = tmp_path / "quotas.csv"
    quotas.write_text("team,quota,borrow_limit,weight\na,8,8,1\nb,8,8,1\n")
    rows = [(f"a{i}", 0, 1, 50_000, "a") for i in range(16)]
    rows.append(("b1", 1_000, 1, 100, "b"))
    rows += [(f"late{i}", 1_005 + 10 * i, 1, 100, "a") for i in range(5)]
    config = SimConfig(gpus=16, quotas=load_quotas(quotas), grace_s=60, reclaim_backoff_s=0)
    result = run(jobs(*rows), "lockstep", config)
    m = result.metrics
    assert m["preemptions"]["executed"] == 1
    assert m["teams"]["b"]["reclaim_max_s"] == 60
    starts = {r[0]: r[3] for r in result.records}
    assert starts["b1"] == 1_060


@pytest.mark.timeout(20)
def test_checkpoints_due_at_float_times_do_not_stall_the_clock():
    # With --load-scale times are fractional: 0.1 + 3 * 0.7 - 0.1 is a hair under 3 * 0.7, so
    # a checkpoint due exactly at an event must still count as done (this once looped forever).
    start, interval = 0.1, 0.7
    trace = jobs(("long", start, 1, 100, "t"))
    trace += [TraceJob(f"tick{k}", start + k * interval, 1, 0.01, "t") for k in range(1, 60)]
    m = run(trace, "fifo", SimConfig(gpus=8, checkpoint_interval_s=interval)).metrics
    assert m["completed"] == 60


def test_simulate_runs_several_policies_side_by_side():
    results = simulate(HOL, ("fifo", "backfill", "lockstep"), gpus=16)
    assert list(results) == ["fifo", "backfill", "lockstep"]
    for result in results.values():
        assert result.metrics["completed"] == len(HOL)
        assert result.metrics["rejected_placements"] == 0
        assert result.metrics["plans_missing_reasons"] == 0


@pytest.mark.skipif(
    not MSFT.exists(), reason=f"the real traces are not at {MSFT.parent} (LOCKSTEP_TRACES)"
)
def test_lockstep_plans_on_a_real_trace_slice_are_always_applicable():
    trace = load_trace(MSFT, team="cluster03", limit=600)
    for policy in ("backfill", "lockstep"):
        m = run(trace, policy, SimConfig(gpus=128)).metrics
        assert m["completed"] == m["jobs"] == 600
        assert m["rejected_placements"] == 0, m["rejected_examples"]
        assert m["plans_missing_reasons"] == 0


def test_trace_filters_priority_mapping_and_load_scale(tmp_path):
    path = write_trace(
        tmp_path,
        [
            "j1,0,1,60,x,unknown,high",
            "j2,100,2,60,y,unknown,",
            "j3,200,4,60,x,unknown,urgent",
            "j4,300,8,60,x,unknown,low",
        ],
        header=HEADER + ",priority",
    )
    assert [j.priority for j in load_trace(path)] == [2, 1, 3, 0]
    assert [j.job_id for j in load_trace(path, team="x")] == ["j1", "j3", "j4"]
    assert [j.job_id for j in load_trace(path, start_s=100, end_s=300)] == ["j2", "j3"]
    assert [j.job_id for j in load_trace(path, limit=2)] == ["j1", "j2"]
    assert [j.submit_s for j in load_trace(path, load_scale=2)] == [0, 50, 100, 150]
    qos = write_trace(
        tmp_path, ["p0,0,1,60,u,Running,BE", "p1,0,1,60,u,Running,LS"], header=HEADER + ",qos"
    )
    assert [j.priority for j in load_trace(qos)] == [0, 2]


def _simulate_json(path, *options: str) -> dict:
    """`lockstep simulate --json` on 8 GPUs: exactly one JSON document."""
    out = subprocess.run(
        [sys.executable, "-m", "lockstep_cli.cli", "simulate", "--trace", str(path), "--gpus", "8"]
        + [*options, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return json.loads(out)


def test_cli_json_prints_one_object_with_the_required_keys(tmp_path):
    path = write_trace(tmp_path, ["a,0,4,100,t,unknown", "b,1,8,100,t,unknown", "z,2,64,5,t,u"])
    m = _simulate_json(path, "--policy", "backfill")
    required = {
        "utilization",
        "utilization_when_backlogged",
        "jct_mean_s",
        "jct_median_s",
        "jct_p99_s",
        "wait_mean_s",
        "by_size",
        "ftf_max",
        "reclaim_max_s",
        "preempted_gpu_hours",
        "starved",
        "jobs",
        "dropped",
        "policy",
        "gpus",
    }
    assert required <= set(m)
    assert set(m["by_size"]) == {"1", "2-8", "16-64", ">64"}
    assert (m["policy"], m["gpus"], m["jobs"], m["dropped"]) == ("backfill", 8, 2, 1)


def test_cli_flags_reach_the_engine_and_its_config_says_so(tmp_path):
    """`--aged-borrowed-last` and `--quota-before-drain` are the live settings
    AGED_BORROWED_FIRST=false and QUOTA_BEFORE_DRAIN=true, `--events-only` the engine before
    passes at protection ends; the printed config shows what ran."""
    path = write_trace(tmp_path, ["a,0,4,100,t,unknown", "b,1,8,100,u,unknown"])

    def config(*flags):
        c = _simulate_json(path, "--policy", "lockstep", *flags)["config"]
        return c["aged_borrowed_first"], c["pass_at_protection_end"], c["quota_before_drain"]

    assert config() == (True, True, False)
    flags = ("--aged-borrowed-last", "--events-only", "--quota-before-drain")
    assert config(*flags) == (False, False, True)


def test_simulator_imports_no_django():
    code = (
        "import sys, jobs.scheduling.simulate, jobs.scheduling.baselines, "
        "jobs.scheduling.report, jobs.scheduling.policy, lockstep_cli.cli; "
        "assert not any(m == 'django' or m.startswith('django.') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_report_is_one_self_contained_file(tmp_path):
    from plotly.offline import get_plotlyjs

    from jobs.scheduling.report import write_report

    results = simulate(HOL, ("fifo", "backfill"), gpus=16)
    path = write_report(results.values(), tmp_path / "report.html")
    page = path.read_text()
    library = get_plotlyjs()
    assert library in page  # plotly.js inlined from the installed package
    ours = page.replace(library, "")
    assert "<script src" not in ours
    # plotly.min.js itself names two CDN URLs (map tiles' icons, topojson) that only map
    # charts fetch; the report has none. Everything we wrote must be URL-free.
    assert "http://" not in ours and "https://" not in ours
    for text in ("utilization over time", "Queued jobs over time", "Wait time distribution"):
        assert text.lower() in ours.lower()
