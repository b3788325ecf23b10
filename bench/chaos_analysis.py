"""The chaos benchmark's analysis (bench/chaos.py): the results file's compact form of events and
rank-0 records, what each injected incident cost (detect, recover, redone work), the run's
summary and goals, and the markdown report for docs/reliability.md. It reads only the results
dict, so `--replot` can redo it from a stored file."""

from __future__ import annotations

import datetime as dt
import json
import statistics


def iso_epoch(value: str | None) -> float | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --- what the results file keeps ------------------------------------------------------------


def strip_event(event: dict) -> dict:
    data = dict(event.get("data") or {})
    if "stacks" in data:
        stacks = data.pop("stacks")
        data["stacks_ranks"] = sorted(stacks)
        data["stacks_chars"] = {rank: len(text) for rank, text in stacks.items()}
    return {**event, "data": data, "t": iso_epoch(event["created_at"])}


def compact_records(records: list[dict]) -> dict:
    """Rank 0's records of one attempt, as columns (steps: step, time, step_time_s)."""
    steps = [r for r in records if r.get("kind") == "step"]
    return {
        "start": next((r for r in records if r.get("kind") == "start"), None),
        "step": [r["step"] for r in steps],
        "time": [round(r["time"], 3) for r in steps],
        "step_time_s": [round(r["step_time_s"], 4) for r in steps],
        "checkpoints": [
            {k: r.get(k) for k in ("step", "time", "save_s", "bytes")}
            for r in records
            if r.get("kind") == "checkpoint"
        ],
    }


# --- analysis -------------------------------------------------------------------------------


def analyse(result: dict) -> dict:
    config, injections = result["config"], result["injections"]
    every = config["checkpoint_every_steps"]
    attempts = {a["number"]: a for a in result["attempts"]}
    rank0 = {int(k): v for k, v in result["rank0"].items()}
    incidents_portal = {i["attempt"]: i for i in result["job"]["goodput"]["incidents"]}
    events = result["events"]
    t0, t_end = config["t0"], config["t_end"]

    first_injection = injections[0]["t"] if injections else t_end
    # Failure-free stretch: every attempt's steps between the job's first step and the first
    # injection (attempt 1 is not always the one: it can fail on its own before stepping).
    baseline_gaps = step_gaps(rank0, list(rank0), t0, first_injection)
    baseline_interval = median(baseline_gaps)
    all_gaps = step_gaps(rank0, list(rank0), t0, t_end)
    save_s = [c["save_s"] for n in rank0 for c in rank0[n]["checkpoints"] if c.get("save_s")]

    rows = []
    for inj in injections:
        portal = incidents_portal.get(inj["attempt"], {})
        rows.append(
            incident_row(inj, portal, events, attempts, rank0, t0, every, baseline_interval)
        )

    injected = {inj["attempt"] for inj in injections}
    unplanned = [i for i in result["job"]["goodput"]["incidents"] if i["attempt"] not in injected]

    goodput = result["job"]["goodput"]
    wall = t_end - t0
    chaos_window = t_end - first_injection
    costs = [r["cost_s"] for r in rows if r["cost_s"] is not None]
    # Detect + recover per incident = injection -> the next attempt's first step (downtime).
    detect_recover = [r["downtime_s"] for r in rows]
    interval_s = every * (baseline_interval or 0)
    save_overhead = (median(save_s) or 0) / interval_s if interval_s else None
    mean_cost = statistics.mean(costs) if costs else None
    summary = {
        "baseline_step_interval_s": baseline_interval,
        "all_step_interval_median_s": median(all_gaps),
        "checkpoint_every_steps": every,
        "checkpoint_interval_s_at_baseline": round(interval_s, 1),
        "median_save_s": median(save_s),
        "save_overhead_fraction": round(save_overhead, 4) if save_overhead else None,
        "incidents": len(rows),
        "unplanned_incidents": unplanned,
        "injection_rate_per_min": round(len(rows) / (wall / 60), 3),
        "run_wall_s": round(wall, 1),
        "chaos_window_s": round(chaos_window, 1),
        "final_step": max((s for r in rank0.values() for s in r["step"]), default=0),
        "portal_goodput": goodput,
        "portal_checkpoint_policy": result["job"].get("checkpoint_policy"),
        "mean_cost_s": round(mean_cost, 1) if mean_cost else None,
        "median_downtime_s": median(r["downtime_s"] for r in rows),
        "median_detect_s": median(r["detect_s"] for r in rows),
        "median_recover_s": median(r["recover_s"] for r in rows),
        "median_detect_plus_recover_s": median(detect_recover),
    }
    summary.update(measured_effective(rank0, attempts, baseline_interval, first_injection, t_end))
    if mean_cost is not None:
        for mtbf in (300.0, config["interval_s"]):
            summary[f"effective_derived_at_mtbf_{int(mtbf)}s"] = round(
                1 - (save_overhead or 0) - mean_cost / mtbf, 4
            )
        model_cost = (summary["median_detect_plus_recover_s"] or 0) + interval_s / 2
        summary["effective_model_at_mtbf_300s"] = round(
            1 - (save_overhead or 0) - model_cost / 300.0, 4
        )
    by_kind = per_kind(rows)
    summary["by_kind"] = by_kind
    phases = [r["phases"] for r in rows if r["phases"]]
    if phases:
        summary["median_recovery_phases_s"] = {
            key: median(p[key] for p in phases) for key in phases[0]
        }
    kind_costs = [k["mean_cost_s"] for k in by_kind.values() if k["mean_cost_s"] is not None]
    if kind_costs:
        # Each kind weighted equally (the rotation over a short run need not hit them equally).
        balanced = statistics.mean(kind_costs)
        summary["kind_balanced_mean_cost_s"] = round(balanced, 1)
        summary["effective_derived_kind_balanced_at_mtbf_300s"] = round(
            1 - (save_overhead or 0) - balanced / 300.0, 4
        )
    stall = median(save_s)
    downtime = summary["median_detect_plus_recover_s"]
    if stall and downtime is not None:
        # What Young/Daly's interval would give this toy at one failure per 5 minutes.
        tau = (2 * stall * 300.0) ** 0.5
        summary["young_daly_tau_at_mtbf_300s"] = round(tau, 1)
        summary["effective_model_young_daly_at_mtbf_300s"] = round(
            1 - stall / tau - (downtime + tau / 2) / 300.0, 4
        )
    summary["goals"] = goals(rows, summary)
    kinds = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return {"incidents": rows, "summary": summary, "event_counts": kinds}


def step_gaps(rank0: dict, numbers, lo: float, hi: float) -> list[float]:
    """Seconds between consecutive rank-0 step records within [lo, hi], over the attempts
    `numbers` (never across two attempts)."""
    out = []
    for n in numbers:
        times = [t for t in rank0.get(n, {}).get("time", []) if lo <= t <= hi]
        out += [b - a for a, b in zip(times, times[1:], strict=False)]
    return out


def incident_row(
    inj: dict,
    portal: dict,
    events: list[dict],
    attempts: dict,
    rank0: dict,
    t0: float,
    every: int,
    baseline_interval: float | None,
) -> dict:
    """One injection's cost, measured here and as the portal's goodput incident (`portal`)
    reports it: time to detect, to end the attempt, to the next attempt's first step, and the
    steps since the checkpoint it resumed from."""
    number = inj["attempt"]
    mine = [e for e in events if e.get("attempt") == inj["attempt_id"]]
    hang = next((e for e in mine if e["kind"] == "attempt.hang_detected"), None)
    ended = next((e for e in mine if e["kind"] in ("attempt.failed", "attempt.lost")), None)
    detect_event = hang or ended
    following = attempts.get(number + 1)
    first_step_t = None
    if following and rank0.get(number + 1, {}).get("time"):
        first_step_t = rank0[number + 1]["time"][0]
    resumed = following["resumed_from_step"] if following else None
    step_at = inj.get("step_at_injection")
    known = step_at is not None and resumed is not None
    lost_at_injection = step_at - resumed if known else None
    per_step = median(step_gaps(rank0, [number], 0, inj["t"])) or baseline_interval
    lost_work_s = lost_at_injection * per_step if lost_at_injection is not None else None
    downtime = first_step_t - inj["t"] if first_step_t else None
    row = {
        "n": inj["n"],
        "kind": inj["kind"],
        "target": inj.get("node") + (f" rank {inj['rank']}" if "rank" in inj else ""),
        "attempt": number,
        "injected_at": inj["t"],
        "t_rel_s": round(inj["t"] - t0, 1),
        "delay_s": inj.get("delay_s"),
        "detected_by": detect_event["kind"] if detect_event else None,
        "end_state": ended["kind"].split(".")[1] if ended else None,
        "end_reason": (attempts[number]["ended"] or {}).get("reason"),
        "detect_s": round(detect_event["t"] - inj["t"], 1) if detect_event else None,
        "ended_after_s": round(ended["t"] - inj["t"], 1) if ended else None,
        "recover_s": round(first_step_t - ended["t"], 1) if first_step_t and ended else None,
        "downtime_s": round(downtime, 1) if downtime else None,
        "portal_detect_s": portal.get("detect_s"),
        "portal_recover_s": portal.get("recover_s"),
        "portal_lost_steps": portal.get("lost_steps"),
        "portal_lost_s": portal.get("lost_s"),
        "step_at_injection": step_at,
        "resumed_from_step": resumed,
        "lost_steps_at_injection": lost_at_injection,
        "lost_work_s": round(lost_work_s, 1) if lost_work_s is not None else None,
        "cost_s": round(downtime + lost_work_s, 1)
        if downtime and lost_work_s is not None
        else None,
        "recovered": bool(following and first_step_t),
        "lost_within_interval": (
            max(lost_at_injection or 0, portal.get("lost_steps") or 0) <= every + 1
            if resumed is not None
            else None
        ),
    }
    row["phases"] = recovery_phases(events, ended, following, first_step_t)
    return row


def measured_effective(
    rank0: dict, attempts: dict, baseline_interval: float | None, lo: float, hi: float
) -> dict:
    """Effective training time over the chaos window [lo, hi], measured from the steps kept."""
    chaos_window = hi - lo
    out = {}
    # Measured: over the chaos window only, progress made at the failure-free rate.
    window_steps = steps_kept_in(rank0, attempts, lo, hi)
    if baseline_interval:
        out["effective_chaos_window_measured"] = round(
            window_steps * baseline_interval / chaos_window, 4
        )
        out["kept_steps_in_chaos_window"] = window_steps
    # Measured the portal's way: each kept step is worth its own attempt's median step time.
    own = 0.0
    for number, cols in rank0.items():
        following = attempts.get(number + 1)
        keep_until = following["resumed_from_step"] if following else float("inf")
        per_step = median(step_gaps(rank0, [number], 0, float("inf")))
        if per_step:
            own += per_step * sum(
                1
                for step, t in zip(cols["step"], cols["time"], strict=False)
                if lo <= t <= hi and step <= keep_until
            )
    out["effective_chaos_window_measured_own_rate"] = round(own / chaos_window, 4)
    return out


def per_kind(rows: list[dict]) -> dict:
    """The incidents' medians and mean cost by failure kind, in the order the kinds came."""
    by_kind = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        by_kind[kind] = {
            "n": len(mine),
            "median_detect_s": median(r["detect_s"] for r in mine),
            "median_recover_s": median(r["recover_s"] for r in mine),
            "median_downtime_s": median(r["downtime_s"] for r in mine),
            "mean_cost_s": round(statistics.mean(c), 1)
            if (c := [r["cost_s"] for r in mine if r["cost_s"] is not None])
            else None,
        }
    return by_kind


def goals(rows: list[dict], summary: dict) -> dict:
    """The benchmark's pass/fail goals (the exit status is 0 only when all hold)."""
    hangs = [r for r in rows if r["kind"] == "worker-stop"]
    return {
        "every_incident_recovered_without_a_human": all(r["recovered"] for r in rows),
        "lost_work_within_one_interval_plus_one_step": all(
            r["lost_within_interval"] for r in rows if r["lost_within_interval"] is not None
        ),
        "hang_detected_within_2_min": bool(hangs)
        and all(r["detect_s"] is not None and r["detect_s"] <= 120 for r in hangs),
        "effective_at_least_90pct_at_1_failure_per_5_min_derived": (
            summary.get("effective_derived_at_mtbf_300s", 0) >= 0.9
        ),
    }


def recovery_phases(events, ended, following, first_step_t) -> dict | None:
    """Where a recovery's time went, from the portal's events: backoff until the job is
    requeued, placement, launch (every rank spawned), trainer start-up (imports, rendezvous,
    checkpoint load) until the first step."""
    if not (ended and following and first_step_t):
        return None
    after = [e for e in events if e["t"] >= ended["t"]]
    requeued = next((e["t"] for e in after if e["kind"] == "job.requeued"), None)
    started = next(
        (
            e["t"]
            for e in after
            if e["kind"] == "attempt.started" and e["attempt"] == following["id"]
        ),
        None,
    )
    running = next(
        (
            e["t"]
            for e in after
            if e["kind"] == "attempt.running" and e["attempt"] == following["id"]
        ),
        None,
    )
    if None in (requeued, started, running):
        return None
    return {
        "backoff_and_requeue_s": round(requeued - ended["t"], 1),
        "placement_s": round(started - requeued, 1),
        "launch_s": round(running - started, 1),
        "trainer_start_to_first_step_s": round(first_step_t - running, 1),
    }


def steps_kept_in(rank0: dict, attempts: dict, lo: float, hi: float) -> int:
    """Steps completed in [lo, hi] whose result survived (not redone by a later attempt)."""
    kept = 0
    for number, cols in rank0.items():
        following = attempts.get(number + 1)
        keep_until = following["resumed_from_step"] if following else float("inf")
        kept += sum(
            1
            for step, t in zip(cols["step"], cols["time"], strict=False)
            if lo <= t <= hi and step <= keep_until
        )
    return kept


# --- report ---------------------------------------------------------------------------------


def report(result: dict) -> str:
    """A markdown table of the incidents and the summary, for docs/reliability.md."""
    rows = result["analysis"]["incidents"]
    s = result["analysis"]["summary"]
    lines = [
        "| # | kind | target | t (s) | detected by | detect (s) | portal detect_s | ended (s) "
        "| recover (s) | portal recover_s | downtime (s) | step at fault | resumed from "
        "| lost steps (at fault / portal) | lost work (s) | within N+1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['kind']} | {r['target']} | {r['t_rel_s']} | {r['detected_by']} "
            f"| {r['detect_s']} | {r['portal_detect_s']} | {r['ended_after_s']} "
            f"| {r['recover_s']} | {r['portal_recover_s']} | {r['downtime_s']} "
            f"| {r['step_at_injection']} | {r['resumed_from_step']} "
            f"| {r['lost_steps_at_injection']} / {r['portal_lost_steps']} | {r['lost_work_s']} "
            f"| {'yes' if r['lost_within_interval'] else 'NO'} |"
        )
    lines.append("")
    lines.append("```")
    lines.append(json.dumps(s, indent=1, default=str))
    lines.append("```")
    return "\n".join(lines)
