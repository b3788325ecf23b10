"""Why a reclaim ran past its bound: replay a trace through `lockstep` and, at every plan while a
queued job's reclaim clock is past its bound, keep what the plan said about it and what the
cluster held (issue 17; docs/thrash.md, "The real traces with the new rules"). The bound is
the clock's own (jobs.scheduling.sim_reclaims: the stop grace, or rule 5's longer one where only
drained-for gangs held what a reclaim could take); `--past-grace` follows every clock past the
grace instead, as this script did before 2026-12-06.

    .venv/bin/python bench/reclaim_replay.py --trace msft_itp_2021.csv --gpus 1280
    .venv/bin/python bench/reclaim_replay.py ... --checkpoint-on-stop
    .venv/bin/python bench/reclaim_replay.py --generated 1.15,0   # bench/thrash.py's shape

Writes bench/results/reclaim-replay-<trace>-<gpus>.json: per claimant over the bound, its wait,
and each change of its wait reason with the state behind it (free GPUs, the team's room, the
teams beyond quota and their jobs: protected, exempt as a drained-for gang, fillers, stopping;
only the first and last state where more than 50 claimants ran over), and counts of what they
waited on when first past the bound and at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobs.scheduling.order import aged  # noqa: E402 (after the path insert)
from jobs.scheduling.policy import plan  # noqa: E402
from jobs.scheduling.protection import is_protected, reclaim_exempt  # noqa: E402
from jobs.scheduling.simulate import SimConfig, _at, _Engine  # noqa: E402
from jobs.scheduling.trace import load_trace, traces_dir  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def _state(snap, job, reason, reserved=frozenset(), holder_within_quota=None) -> dict:
    """What stood between `job` and its quota at this plan (`reserved`: the node ids of the
    plan's reservation, held by another job, whose team it would keep within its quota or
    not: `holder_within_quota`)."""
    teams = {t.id: t for t in snap.teams}
    largest = max(n.total for n in snap.nodes)
    team = teams[job.team_id]
    free = {n.id: len(n.free) for n in snap.nodes if n.free}
    borrowers = {}
    takable: dict[int, int] = {}
    for run in snap.running:
        owner = teams[run.team_id]
        if owner.used <= owner.quota:
            continue
        kinds = borrowers.setdefault(owner.name, {"used": owner.used, "quota": owner.quota})
        key = (
            "stopping"
            if run.stopping
            else "exempt_gang"
            if reclaim_exempt(run, owner.quota, largest, snap.now, snap.gang_reclaim_exempt_s)
            else "protected"
            if is_protected(run, snap.now, snap.preempt_exempt_s)
            else "takable"
        )
        if run.filler:
            key += "_filler"
        kinds[key] = kinds.get(key, 0) + run.gpus
        if key.startswith("takable") and owner.id != team.id:
            for node_id, _ in run.slots:  # another team's GPUs a reclaim could take, by node
                takable[node_id] = takable.get(node_id, 0) + 1
    return {
        "reason": None if reason is None else {"code": reason.code, **_plain(reason.data)},
        "team": team.name,
        "team_used": team.used,
        "quota": team.quota,
        "gpus": job.gpus,
        "free_gpus": sum(free.values()),
        "largest_free_on_a_node": max(free.values(), default=0),
        "claim_nodes": len(job.claim_nodes),
        "borrowers": borrowers,
        # Another team's takable GPUs on the reservation's nodes and elsewhere, and the most a
        # single node outside the reservation could offer (free + takable there).
        "takable_on_reserved": sum(v for k, v in takable.items() if k in reserved),
        "takable_elsewhere": sum(v for k, v in takable.items() if k not in reserved),
        "best_node_elsewhere": max(
            (free.get(n.id, 0) + takable.get(n.id, 0) for n in snap.nodes if n.id not in reserved),
            default=0,
        ),
        "reservation_holder_within_quota": holder_within_quota,
    }


def _plain(data: dict) -> dict:
    return {
        k: (list(v)[:8] if isinstance(v, tuple | list | frozenset | set) else v)
        for k, v in data.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="msft_itp_2021.csv")
    parser.add_argument("--gpus", type=int, default=1280)
    parser.add_argument("--checkpoint-on-stop", action="store_true")
    parser.add_argument("--limit", type=int, default=None, help="first N jobs of the trace")
    parser.add_argument("--generated", help="LOAD,SEED: bench/thrash.py's trace instead")
    parser.add_argument("--past-grace", action="store_true", help="clocks past the grace")
    parser.add_argument(
        "--wait-for-ending",
        action="store_true",
        help="the setting WAIT_FOR_ENDING_JOBS on (SimConfig.wait_for_ending)",
    )
    parser.add_argument(
        "--quota-promise",
        action="store_true",
        help="the admin's quota settings: AGED_BORROWED_FIRST=false, QUOTA_BEFORE_DRAIN=true "
        "(bench/quota_promise.py)",
    )
    parser.add_argument(
        "--events-only",
        action="store_true",
        help="no pass when a job's protection ends (SimConfig.pass_at_protection_end off, "
        "as every replay before 2026-12-06)",
    )
    args = parser.parse_args()
    if args.generated:
        from bench.thrash import _shape
        from jobs.scheduling.generate import generate

        load, seed = args.generated.split(",")
        shape = _shape(int(seed), float(load))
        trace, quotas = generate(shape), shape.quotas()
        args.trace, args.gpus = f"generated-{load}-{seed}", shape.gpus
    else:
        trace = load_trace(str(traces_dir() / args.trace), limit=args.limit)
        quotas = None
    config = SimConfig(
        gpus=args.gpus,
        quotas=quotas,
        checkpoint_on_stop=args.checkpoint_on_stop,
        pass_at_protection_end=not args.events_only,
        wait_for_ending=args.wait_for_ending,
        aged_borrowed_first=not args.quota_promise,
        quota_before_drain=args.quota_promise,
    )
    seen: dict[int, dict] = {}  # job id -> its clock, its reasons over time
    engine = None
    t_zero = _at(0.0)

    def traced(snap):
        decided = plan(snap)
        t = (snap.now - t_zero).total_seconds()
        holder = decided.reservation  # (job id, node ids): the same for every claimant
        holder_within_quota = held = None
        if holder:
            held = next((j for j in snap.queued if j.id == holder[0]), None)
            owner = next((team for team in snap.teams if held and team.id == held.team_id), None)
            if owner is not None:
                holder_within_quota = owner.used + held.gpus <= owner.quota
        for job in snap.queued:
            started = engine.clocks.start[job.id - 1]
            bound = config.grace_s if args.past_grace else engine.clocks.bound[job.id - 1]
            if started is None or t - started <= bound:
                continue
            entry = seen.setdefault(
                job.id, {"clock_from_s": started, "bound_s": round(bound, 1), "steps": []}
            )
            reason = decided.waits.get(job.id)
            if holder and holder[0] != job.id:
                state = _state(snap, job, reason, frozenset(holder[1]), holder_within_quota)
                if held is not None:  # why the holder goes first (rule 1's order)
                    state["holder"] = {
                        "priority": "higher"
                        if held.priority > job.priority
                        else "same"
                        if held.priority == job.priority
                        else "lower",
                        "same_team": held.team_id == job.team_id,
                        "aged": aged(held, snap.now),
                    }
            else:
                state = _state(snap, job, reason)
            steps = entry["steps"]
            if not steps or steps[-1]["state"] != state:
                steps.append(
                    {"t_s": round(t, 1), "waited_s": round(t - started, 1), "state": state}
                )
            entry["last_s"] = t
        return decided

    engine = _Engine(trace, traced, "lockstep", config, None)
    began = time.perf_counter()
    result = engine.run()
    for job_id, entry in seen.items():
        first = engine.first_start[job_id - 1]
        entry["started_s"] = first
        entry["trace_job"] = engine.jobs[job_id - 1].job_id
    by_first: dict[str, int] = {}
    for entry in seen.values():  # what each claimant waited on when first past the bound
        first = entry["steps"][0]["state"]
        others = {
            kind
            for team, kinds in first["borrowers"].items()
            if team != first["team"]
            for kind in kinds
            if kind.startswith("takable")
        }
        code = (first["reason"] or {}).get("code", "started")
        holder = first.get("holder")
        if code == "behind_reservation" and holder:
            whose = "its own team's" if holder["same_team"] else "another team's"
            quota = (
                "borrowing" if first["reservation_holder_within_quota"] is False else "guaranteed"
            )
            code += f" of {whose} {quota} job of {holder['priority']} priority" + (
                ", aged" if holder["aged"] else ""
            )
        key = f"{code}, {'a' if others else 'no'} takable job borrowed by another team"
        by_first[key] = by_first.get(key, 0) + 1
    by_reason: dict[str, int] = {}
    for entry in seen.values():  # what each claimant waited on last, over the bound
        last = entry["steps"][-1]["state"]
        code = (last["reason"] or {}).get("code", "started")
        if last["team_used"] >= last["quota"]:
            code = "team at its quota"
        elif all(
            not any(k.startswith("takable") for k in kinds) for kinds in last["borrowers"].values()
        ):
            code = f"{code}, no takable borrowed job"
        by_reason[code] = by_reason.get(code, 0) + 1
    out = {
        "trace": args.trace,
        "by_first_reason": dict(sorted(by_first.items(), key=lambda kv: -kv[1])),
        "by_last_reason": by_reason,
        "gpus": args.gpus,
        "checkpoint_on_stop": args.checkpoint_on_stop,
        "quota_promise": args.quota_promise,
        "wall_s": round(time.perf_counter() - began, 1),
        "past": "grace" if args.past_grace else "their own bound",
        "reclaims_over_bound": result.metrics["reclaims_over_bound"],
        "reclaims_over_their_bound": result.metrics["reclaims_over_their_bound"],
        "reclaims_gang_bounded": result.metrics["reclaims_gang_bounded"],
        "reclaim_max_s": result.metrics["reclaim_max_s"],
        # Every change of state for a few claimants; the first and the last for many.
        "claimants": {
            str(k): v if len(seen) <= 50 else {**v, "steps": [v["steps"][0], v["steps"][-1]]}
            for k, v in seen.items()
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = (
        ("-ckpt-on-stop" if args.checkpoint_on_stop else "")
        + ("-past-grace" if args.past_grace else "")
        + ("-events-only" if args.events_only else "")
        + ("-wait-for-ending" if args.wait_for_ending else "")
        + ("-quota-promise" if args.quota_promise else "")
    )
    name = args.trace if args.generated else Path(args.trace).stem
    path = RESULTS / f"reclaim-replay-{name}-{args.gpus}{suffix}.json"
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(
        f"{len(seen)} claimants past the bound; {out['reclaims_over_their_bound']} clocks over"
        f" their bound, {out['reclaims_over_bound']} over the grace; {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
