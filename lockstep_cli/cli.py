"""The `lockstep` command: run the platform (`up`, `agent`, `scheduler`), use it (`submit`,
`jobs`, `status`, `wait`, `cancel`, `checkpoints`, `models`, `tokens`: lockstep_cli/commands.py;
`logs`, `events`: job_output.py), plan a run's memory (`plan`), generate traces in the target's
shape (`trace`) and replay traces through the scheduler (`simulate`)."""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from typing import NoReturn

from lockstep_cli import commands
from lockstep_cli.client import EXIT_USAGE


def _hand_over(module: str, args: list[str]) -> NoReturn:
    """Become `python -m module args` (same process, same exit code and signals): the Django
    side runs in its own interpreter so this package never imports it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def _print_simulation(m: dict) -> None:
    rows = [
        ("policy", m["policy"]),
        ("cluster", f"{m['gpus']} GPUs on {m['nodes']} nodes"),
        ("jobs", f"{m['jobs']} simulated, {m['dropped']} dropped (larger than the cluster)"),
        ("makespan", f"{m['makespan_s'] / 86400:.2f} days"),
        ("utilization", f"{m['utilization']:.1%}"),
        (
            "utilization when backlogged",
            f"{m['utilization_when_backlogged']:.1%} (queue non-empty "
            f"{m['backlogged_fraction']:.1%} of the time)",
        ),
        (
            "wait mean / median / p99",
            "{wait_mean_s} / {wait_median_s} / {wait_p99_s} s".format(**m),
        ),
        ("JCT mean / median / p99", "{jct_mean_s} / {jct_median_s} / {jct_p99_s} s".format(**m)),
        ("finish-time fairness max / p99", f"{m['ftf_max']} / {m['ftf_p99']}"),
        (
            "reclaim time max / p99",
            "{reclaim_max_s} / {reclaim_p99_s} s; {reclaims_over_bound} of {reclaims_total} "
            "over the {reclaim_bound_s} s bound".format(**m)
            + (
                f" ({m['reclaims_over_their_bound']} past their own, rule 5's longer for "
                f"{m['reclaims_gang_bounded']})"
                if m.get("reclaims_gang_bounded")
                else ""
            ),
        ),
        (
            "preemptions",
            f"{m['preemptions']['executed']} executed, {m['preempted_gpu_hours']} GPU-hours lost",
        ),
        (
            "preemptions of one job",
            "max {max}, p99 {p99}, most in a day {max_in_a_day}".format(**m["preemptions_per_job"])
            + (f"; safety stop refused {m['safety_stops']} job(s)" if m["safety_stops"] else ""),
        ),
        ("starved", f"{m['starved']} ({m['never_started']} never started)"),
        (
            "plan() calls",
            f"{m['plan_calls']} in {m['plan_time_s']} s (max {m['plan_max_s']} s "
            f"with {m['plan_max_queue']} queued)",
        ),
        ("wall time", f"{m['wall_s']} s"),
    ]
    if m["rejected_placements"] or m["plans_missing_reasons"]:
        rows.append(
            (
                "plan errors",
                f"{m['rejected_placements']} placements rejected, "
                f"{m['plans_missing_reasons']} plans left a queued job without a reason",
            )
        )
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"\n{'size':>6} {'jobs':>7} {'wait mean s':>12} {'wait p99 s':>12} {'JCT mean s':>12}")
    for cls, s in m["by_size"].items():
        print(
            f"{cls:>6} {s['jobs']:>7} {s['wait_mean_s']:>12} {s['wait_p99_s']:>12} "
            f"{s['jct_mean_s']:>12}"
        )
    print()
    if "estimates" in m:
        _print_estimates(m["estimates"])


def _print_estimates(e: dict) -> None:
    """Start estimates against actual starts (error = start - promise; + is late)."""
    print(
        f"start estimates: {e['placed_at_once']} jobs placed at once (no promise); "
        f"{e['estimate_calls']} estimates in {e['estimate_time_s']} s"
    )
    head = ("promise", "size", "waited", "covered", "median |err| s", "p90 |err| s", "bias s")
    print("{:>9} {:>6} {:>7} {:>8} {:>15} {:>12} {:>9}".format(*head))
    for moment in ("at_submit", "after_1h"):
        rows = {"all": e[moment], **e[moment]["by_size"]}
        for cls, s in rows.items():
            if not s["waited"]:
                continue
            cover = "-" if s["coverage"] is None else f"{s['coverage']:.0%}"
            print(
                f"{moment:>9} {cls:>6} {s['waited']:>7} {cover:>8} "
                f"{_or_dash(s['median_abs_s']):>15} {_or_dash(s['p90_abs_s']):>12} "
                f"{_or_dash(s['bias_s']):>9}"
            )
    print()


def _or_dash(x) -> str:
    return "-" if x is None else f"{x:g}"


def cmd_simulate(args) -> int:
    """Replay a trace through a planner on a virtual clock; needs no database or settings."""
    from jobs.scheduling.simulate import POLICIES, SimConfig, run
    from jobs.scheduling.trace import load_quotas, load_trace

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if args.policy == "all":
        policies = list(POLICIES)
    if any(p not in POLICIES for p in policies) or not policies:
        print(f"lockstep: --policy must be one of {', '.join(POLICIES)}", file=sys.stderr)
        return EXIT_USAGE
    if args.limit is not None and (args.start_s is not None or args.end_s is not None):
        print("lockstep: give --start-s/--end-s or --limit, not both", file=sys.stderr)
        return EXIT_USAGE
    trace = load_trace(
        args.trace,
        team=args.team,
        start_s=args.start_s,
        end_s=args.end_s,
        limit=args.limit,
        load_scale=args.load_scale,
    )
    config = SimConfig(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        racks=args.racks,
        quotas=load_quotas(args.quotas) if args.quotas else None,
        checkpoint_interval_s=args.checkpoint_interval_s,
        grace_s=args.grace_s,
        estimate_noise=args.estimate_noise,
        seed=args.seed,
        checkpoint_on_stop=args.checkpoint_on_stop,
        approval_delay_s=args.approval_delay_s,
        reclaim_backoff_s=args.reclaim_backoff_s,
        track_promises=args.estimates,
        aged_borrowed_first=not args.aged_borrowed_last,
        quota_before_drain=args.quota_before_drain,
        pass_at_protection_end=not args.events_only,
    )

    def progress(status: dict) -> None:
        print("simulate: " + json.dumps(status), file=sys.stderr, flush=True)

    results = [
        run(trace, policy, config, progress if args.progress else None) for policy in policies
    ]
    if args.report:
        from jobs.scheduling.report import write_report

        title = f"{os.path.basename(args.trace)} on {args.gpus} GPUs"
        write_report(results, args.report, title=title)
    if args.json or args.sim_json:
        metrics = [r.metrics for r in results]
        out = metrics[0] if len(metrics) == 1 else {"policies": {m["policy"]: m for m in metrics}}
        print(json.dumps(out))
    else:
        for result in results:
            _print_simulation(result.metrics)
        if args.report:
            print(f"report: {args.report}")
    return 0


def _add_simulate(sub) -> None:
    sim = sub.add_parser(
        "simulate",
        help="replay a job trace through a scheduling policy on a virtual clock",
        description="Replay a trace (job_id,submit_s,gpus,duration_s,team,status[,priority]) "
        "through fifo, backfill or the lockstep policy. See docs/simulator.md.",
    )
    sim.add_argument("--trace", required=True, help="trace CSV")
    sim.add_argument("--gpus", type=int, required=True, help="GPUs in the simulated cluster")
    sim.add_argument("--gpus-per-node", type=int, default=8)
    sim.add_argument("--racks", type=int, default=None, help="default: one per 32 nodes")
    sim.add_argument(
        "--policy", default="lockstep", help="fifo, backfill, lockstep, a comma list, or all"
    )
    sim.add_argument("--quotas", help="CSV team,quota,borrow_limit,weight (default: equal shares)")
    sim.add_argument("--json", dest="sim_json", action="store_true", help="one JSON object")
    sim.add_argument("--report", help="write an HTML report here")
    sim.add_argument("--team", help="only this team's jobs (e.g. one msft cluster: cluster04)")
    sim.add_argument("--start-s", type=float, help="only jobs submitted at or after this time")
    sim.add_argument("--end-s", type=float, help="only jobs submitted before this time")
    sim.add_argument("--limit", type=int, help="only the first N jobs")
    sim.add_argument(
        "--load-scale", type=float, default=1.0, help="divide inter-arrival times by this"
    )
    sim.add_argument("--checkpoint-interval-s", type=float, default=1800.0)
    sim.add_argument("--grace-s", type=float, default=60.0)
    sim.add_argument(
        "--estimate-noise",
        type=float,
        default=0.0,
        help="sigma of a log-normal error on runtime estimates (default 0: exact)",
    )
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--checkpoint-on-stop",
        action="store_true",
        help="a preempted job saves when told to stop (the trainer does): it loses nothing",
    )
    sim.add_argument(
        "--approval-delay-s",
        type=float,
        default=300.0,
        help="priority preemptions auto-approve after this (reclaims are immediate)",
    )
    sim.add_argument(
        "--reclaim-backoff-s",
        type=float,
        default=300.0,
        help="a team whose GPUs were reclaimed may not borrow for this long",
    )
    sim.add_argument(
        "--aged-borrowed-last",
        action="store_true",
        help="aged borrowed jobs after the guaranteed work of their priority (the live setting "
        "LOCKSTEP_AGED_BORROWED_FIRST=false: the quota promise over some utilization)",
    )
    sim.add_argument(
        "--quota-before-drain",
        action="store_true",
        help="a job within its team's quota may start on a borrowing head's draining nodes "
        "(the live setting LOCKSTEP_QUOTA_BEFORE_DRAIN=true)",
    )
    sim.add_argument(
        "--events-only",
        action="store_true",
        help="no pass when a running job's protection ends (the engine before 2026-12-06)",
    )
    sim.add_argument(
        "--estimates",
        action="store_true",
        help="compare each job's start estimate at submit and 1 h on with its start (slower)",
    )
    sim.add_argument("--progress", action="store_true", help="status lines on stderr")


def cmd_trace(args) -> int:
    """Write a generated trace in the target's shape (jobs.scheduling.generate) as CSV, and the
    teams' quotas beside it; `lockstep simulate --trace ... --quotas ...` replays them."""
    from jobs.scheduling.generate import TraceShape, generate, to_csv

    try:
        sizes = dict(_pair(item) for item in args.sizes.split(",")) if args.sizes else None
        shares = tuple(float(x) for x in args.shares.split(",")) if args.shares else None
        shape = TraceShape(
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            teams=args.teams,
            shares=shares,
            jobs=args.jobs,
            **({"sizes": sizes} if sizes else {}),
            high=args.high,
            low=args.low,
            duration_median_s=args.duration_median_s,
            duration_sigma=args.duration_sigma,
            load=args.load,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"lockstep trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    text = to_csv(generate(shape))
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    if args.quotas_out:
        with open(args.quotas_out, "w") as f:
            f.write("team,quota,borrow_limit,weight\n")
            for name, q in shape.quotas().items():
                f.write(f"{name},{q.quota},{q.borrow_limit},{q.weight}\n")
    return 0


def _pair(item: str) -> tuple[str, float]:
    key, sep, weight = item.partition("=")
    if not sep:
        raise ValueError(f"sizes: {item!r} is not SIZE=WEIGHT (e.g. 8=0.5,half=0.1)")
    return key.strip(), float(weight)


def _add_trace(sub) -> None:
    t = sub.add_parser(
        "trace",
        help="generate a trace in the target's shape (CSV) for `lockstep simulate`",
        description=cmd_trace.__doc__,
    )
    t.add_argument("--gpus", type=int, default=1024)
    t.add_argument("--gpus-per-node", type=int, default=8)
    t.add_argument("--teams", type=int, default=8)
    t.add_argument("--shares", help="relative quotas, one per team: 1,1,2,...")
    t.add_argument("--jobs", type=int, default=3000)
    t.add_argument(
        "--sizes",
        help="GPU counts or quarter/half/whole with weights: 8=.34,16=.26,32=.2,64=.15,"
        "quarter=.03,half=.02 (the default)",
    )
    t.add_argument("--high", type=float, default=0.10, help="share of high-priority jobs")
    t.add_argument("--low", type=float, default=0.20, help="share of low-priority jobs")
    t.add_argument("--duration-median-s", type=float, default=7200.0)
    t.add_argument("--duration-sigma", type=float, default=1.0, help="of the log-normal")
    t.add_argument("--load", type=float, default=1.15, help="offered load, 1.0 = the cluster")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("-o", "--output", help="trace CSV (default: stdout)")
    t.add_argument("--quotas-out", help="also write the teams' quotas CSV here")


def cmd_plan(args) -> int:
    """Per-GPU memory and traffic of each parallel layout; pure arithmetic, no portal needed."""
    import math

    from trainer.layout import timed_plan
    from trainer.planner import ClusterShape, ModelShape, PlanError, plan
    from trainer.planner_text import format_table

    params = None
    if args.params is not None:
        if not math.isfinite(args.params) or args.params != int(args.params):
            print(
                f"lockstep plan: --params: must be a whole number, got {args.params:g}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        params = int(args.params)
    try:
        result = plan(
            ModelShape(
                layers=args.layers,
                hidden=args.hidden,
                heads=args.heads,
                vocab=args.vocab,
                seq=args.seq,
                micro_batch=args.micro_batch,
                params=params,
                dtype=args.dtype,
                optimizer=args.optimizer,
                activation_checkpointing=args.activation_checkpointing,
                flash_attention=not args.no_flash_attention,
                tied_embeddings=args.tied_embeddings,
                global_batch=args.global_batch,
            ),
            ClusterShape(
                gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_mem_gb=args.gpu_mem_gb
            ),
        )
    except PlanError as e:
        print(f"lockstep plan: --{e.field.replace('_', '-')}: {e.message}", file=sys.stderr)
        return EXIT_USAGE
    timed = timed_plan(result)
    if args.json or args.plan_json:
        print(json.dumps(timed))
        return 0
    print(format_table(result, show_all=args.all))
    fastest, hw = timed["fastest"], timed["hardware"]["name"]
    if fastest is not None:
        t = fastest["predicted_step"]
        print(
            f"fastest predicted on {hw} (what --layout auto takes): {fastest['description']}, "
            "step "
            f"{t['total_s']:.2f} s (compute {t['compute_s']:.2f}, exposed communication "
            f"{t['exposed_comm_s']:.2f}, bubble {t['bubble_s']:.2f})"
        )
    return 0


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan the memory of a training run: which parallel layouts fit, and which to use",
        description="Per-GPU memory (weights, grads, optimizer, activations) and traffic of a "
        "transformer under DP, ZeRO-1/2/3, TP and PP. See docs/planner.md.",
    )
    p.add_argument("--params", type=float, help="parameters, e.g. 70e9 (default: from shape)")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: micro x GPUs)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GiB per GPU (default 80)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--activation-checkpointing", action="store_true", help="full recompute")
    p.add_argument(
        "--no-flash-attention", action="store_true", help="attention stores its score matrix"
    )
    p.add_argument("--tied-embeddings", action="store_true", help="head shares the embedding")
    p.add_argument("--all", action="store_true", help="list every layout")
    p.add_argument("--json", dest="plan_json", action="store_true", help="one JSON object")


# What a command whose reader went away exits with: as if SIGPIPE had ended it (128 + 13), like
# the Unix tools it is piped with (`lockstep jobs | head`).
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The long-running commands are their own programs, with their own handling of errors.
    if argv and argv[0] == "agent":
        from nodeagent.cli import main as agent_main

        return agent_main(argv[1:]) or 0
    if argv and argv[0] == "up":
        _hand_over("portal.up", argv[1:])
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could not be handled
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # a socket or another pipe of the command's own: not its reader going away
        # Python would print a traceback, and another at exit when it flushes stdout: point
        # stdout at /dev/null first (the recipe of Python's signal module documentation).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports POLLERR on the
    write end of such a pipe)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lockstep",
        description=__doc__,
        epilog="Portal and token: --url/--token, else LOCKSTEP_URL/LOCKSTEP_TOKEN, else the "
        "config file (LOCKSTEP_CONFIG, default ~/.config/lockstep/config.toml). Exit codes: 0 "
        "ok, 1 job failed or not found, 2 bad input, 3 auth, 4 portal unreachable, 5 portal "
        "error or throttled, 141 the reader of its output went away (as SIGPIPE).",
    )
    parser.add_argument("--url", "--portal", dest="url", help="portal URL (env LOCKSTEP_URL)")
    parser.add_argument("--token", help="API token (env LOCKSTEP_TOKEN)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="run the whole platform locally (portal, scheduler, agents)")
    sub.add_parser("agent", help="run a node agent (see `lockstep agent --help`)")
    scheduler = sub.add_parser("scheduler", help="run the scheduler loop")
    scheduler.add_argument("--once", action="store_true")
    handlers = commands.add_commands(sub)
    _add_simulate(sub)
    _add_trace(sub)
    _add_plan(sub)
    args = parser.parse_args(argv)
    if args.cmd == "submit" and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.cmd == "scheduler":
        # run_scheduler calls the same run_forever; --skip-checks because this command never
        # ran Django's system checks.
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
        _hand_over("django", ["run_scheduler", "--skip-checks", *(["--once"] if args.once else [])])
    if args.cmd in handlers:
        return commands.run(handlers[args.cmd], args)
    return {"simulate": cmd_simulate, "trace": cmd_trace, "plan": cmd_plan}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
