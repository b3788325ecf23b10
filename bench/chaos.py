"""Chaos benchmark: a real 4-rank training job on two local agents, with failures injected at a
fixed rate, and the platform's own account of what each one cost.

    .venv/bin/python bench/chaos.py             # the full run: 15 min of chaos (about 20 min)
    .venv/bin/python bench/chaos.py --quick     # a ~3 min smoke run (a few incidents)
    .venv/bin/python bench/chaos.py --replot bench/results/chaos-2026-11-29.json

What it does:

1. Freezes the platform's code: `git archive HEAD` into a fresh LOCKSTEP_VAR_DIR under
   var/bench-chaos-<stamp>/ (`--tree live` runs the working tree instead), so edits made in the
   checkout during a 20 minute run cannot change the code under test half-way.
2. Starts `lockstep up --agents 0 --no-demo-job` there (embedded redis, fresh SQLite, daphne,
   rq worker, scheduler) with fast-detection settings (LOCKSTEP_* below, recorded in the
   results), and starts the two agents `local-a` and `local-b` (2 CPU "GPUs" each) itself, with
   exactly the command line `lockstep up` would use. It does so because `lockstep up` shuts the
   whole platform down as soon as one of its children dies, so an agent crash cannot be
   injected under it; here the bench plays systemd and restarts a killed agent.
3. Calibrates: a short 4-rank job without checkpoints gives the median step time; the checkpoint
   interval is then `--checkpoint-target-s` (30 s) worth of steps (`--checkpoint-every` pins it).
4. Submits one 4-GPU job over REST (`python -m trainer --steps 10000000 --checkpoint-every N
   --checkpoint-interval-s 0`, max_restarts 100), lets it train failure-free for `--baseline-s`,
   then injects one failure every `--interval-s`, in rotation: worker SIGKILL, worker SIGSTOP
   (a hang), agent SIGKILL + restart after 5 s, agent SIGSTOP past the heartbeat timeout +
   SIGCONT. An injection waits until the job is stepping again (the wait is logged).
5. After `--duration-s` of chaos (counted from the job's first step) and the last recovery,
   reads the job's goodput, events and checkpoints from the REST API and every rank-0 metric
   file, cancels the job, stops every process it started (and checks none is left), and writes
   bench/results/chaos-<date>[-quick].json and the figures under docs/figures/.

Times are epoch seconds on this machine's clock, which the portal, the agents and the workers
share, so injection times and portal event times can be subtracted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.chaos_analysis import (  # noqa: E402
    analyse,
    compact_records,
    iso_epoch,
    median,
    report,
    strip_event,
)
from bench.chaos_cluster import (  # noqa: E402
    PLATFORM_DEFAULTS,
    PLATFORM_ENV,
    ROOT,
    Cluster,
    Monitor,
    agent_pid,
    free_port,
    last_step_before,
    log,
    my_pids,
    proc_cmdline,
    proc_environ,
    rank0_file,
    read_records,
    snapshot_source,
    submit,
    trainer_command,
    wait_state,
    worker_pids,
)
from bench.chaos_plot import plot  # noqa: E402

KINDS = ("worker-kill", "worker-stop", "agent-kill", "agent-stop")
RANK_ROTATION = (3, 2, 1, 0)  # which rank a worker fault hits, by incident number


def calibrate(cluster: Cluster, steps: int) -> dict:
    """A short 4-rank job without checkpoints: the failure-free step time."""
    log(f"calibration: a {steps}-step 4-rank job without checkpoints")
    job_id = submit(cluster, "chaos-calibration", trainer_command(steps, 0), max_restarts=0)
    job = wait_state(cluster, job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, 900)
    if job["state"] != "SUCCEEDED":
        raise RuntimeError(f"calibration job ended {job['state']}: {job['reason']}")
    records = read_records(rank0_file(cluster.var, job["attempts"][0]["id"]))
    steps_rec = [r for r in records if r.get("kind") == "step"]
    warm = steps_rec[len(steps_rec) // 5 :]  # skip the first fifth (warm-up, lazy inits)
    gaps = [b["time"] - a["time"] for a, b in zip(warm, warm[1:], strict=False)]
    result = {
        "job_id": job_id,
        "steps": steps,
        "median_step_time_s": median(r["step_time_s"] for r in warm),
        "median_step_interval_s": median(gaps),
        "p95_step_time_s": sorted(r["step_time_s"] for r in warm)[int(0.95 * len(warm)) - 1],
        "startup_s": (steps_rec[0]["time"] - iso_epoch(job["attempts"][0]["created_at"])),
    }
    log(
        "calibration: median step {:.1f} ms (interval between step records {:.1f} ms)".format(
            result["median_step_time_s"] * 1000, result["median_step_interval_s"] * 1000
        )
    )
    return result


def rank_node(var_dir: Path, pid: int) -> str:
    """The agent (node) a worker runs under, from its metrics path <work-dir>/attempt-N/..."""
    return Path(proc_environ(pid).get("LOCKSTEP_METRICS_PATH", "")).parent.parent.name


def pick_agent(spec: str, var_dir: Path, attempt_id: int) -> str:
    """`rank0`: the node that hosts rank 0; `other`: a node that does not; else a node name."""
    if spec not in ("rank0", "other"):
        return spec
    pids = worker_pids(var_dir, attempt_id)
    nodes = {rank: rank_node(var_dir, pid) for rank, pid in pids.items()}
    if spec == "rank0":
        return nodes[0]
    return next(n for n in sorted(set(nodes.values())) if n != nodes[0])


def inject(kind: str, number: int, seen: int, live: dict, cluster: Cluster, args) -> dict:
    """Inject failure number `number` (the `seen`-th of its kind) into the live attempt;
    returns what was done and when."""
    attempt_id = live["attempt_id"]
    record = {
        "n": number,
        "kind": kind,
        "attempt": live["attempt"],
        "attempt_id": attempt_id,
        "portal_last_step": live["last_step"],
    }
    if kind in ("worker-kill", "worker-stop"):
        # Kills take ranks 3, 1, ...; stops take ranks 2, 0, ...
        rank = RANK_ROTATION[(2 * seen + (kind == "worker-stop")) % len(RANK_ROTATION)]
        pids = worker_pids(cluster.var, attempt_id)
        if rank not in pids:
            raise RuntimeError(f"no live worker of rank {rank} in attempt {attempt_id}: {pids}")
        sig = signal.SIGKILL if kind == "worker-kill" else signal.SIGSTOP
        node = rank_node(cluster.var, pids[rank])
        record.update(rank=rank, pid=pids[rank], node=node)
        record["t"] = time.time()
        os.kill(pids[rank], sig)
        log(f"#{number} {kind}: rank {rank} pid {pids[rank]} on {node} ({sig.name})")
    else:
        victims = args.agent_victims.split(",")
        agent_faults = sum(1 for k in args.done_kinds if k.startswith("agent-"))
        spec = victims[agent_faults % len(victims)]
        name = pick_agent(spec, cluster.var, attempt_id)
        pid = agent_pid(cluster.var, name)
        if pid is None:
            raise RuntimeError(f"agent {name} not found")
        record.update(node=name, pid=pid, victim_spec=spec)
        if kind == "agent-kill":
            # Read what a supervisor would restart it with before it is gone.
            argv, env = proc_cmdline(pid), proc_environ(pid)
            cwd = os.readlink(f"/proc/{pid}/cwd")
            record["t"] = time.time()
            os.kill(pid, signal.SIGKILL)
            log(f"#{number} agent-kill: {name} ({spec}) pid {pid} SIGKILL")
            old = cluster.agents.get(name)
            if old is not None and old.pid == pid:
                old.wait(10)
            time.sleep(args.agent_restart_delay_s)
            cluster.agents[name] = cluster.spawn_agent(name, argv, env, cwd)
            record["restarted_at"] = time.time()
            record["new_pid"] = cluster.agents[name].pid
            log(f"#{number} agent-kill: {name} restarted as pid {record['new_pid']}")
        else:
            record["t"] = time.time()
            os.kill(pid, signal.SIGSTOP)
            log(
                f"#{number} agent-stop: {name} ({spec}) pid {pid} SIGSTOP "
                f"for {args.agent_freeze_s:.0f}s"
            )
            time.sleep(args.agent_freeze_s)
            os.kill(pid, signal.SIGCONT)
            record["resumed_at"] = time.time()
            log(f"#{number} agent-stop: {name} SIGCONT")
    args.done_kinds.append(kind)
    return record


def run_config(args, var_dir: Path, commit: str) -> dict:
    """The settings of this run as the results record them (`run` adds to it as it goes)."""
    return {
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "var_dir": str(var_dir),
        "code": {"tree": args.tree, "commit": commit},
        "platform_env": PLATFORM_ENV,
        "platform_defaults_kept": PLATFORM_DEFAULTS,
        "duration_s": args.duration_s,
        "baseline_s": args.baseline_s,
        "interval_s": args.interval_s,
        "min_tail_s": args.min_tail_s,
        "kinds": args.kinds.split(","),
        "worker_rank_rotation": list(RANK_ROTATION),
        "agent_victims": args.agent_victims.split(","),
        "agent_restart_delay_s": args.agent_restart_delay_s,
        "agent_freeze_s": args.agent_freeze_s,
        "cluster": "2 agents (local-a, local-b) x 2 CPU 'GPUs', one 4-rank gloo DDP job",
        "host": {"cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg()},
    }


def inject_failures(args, cluster: Cluster, monitor: Monitor, t0: float) -> list[dict]:
    """The chaos window from the job's first step `t0`: one injection every `--interval-s` after
    the baseline, none in the last `--min-tail-s`; returns once the window is over and the last
    incident has recovered (or `--recovery-grace-s` ran out)."""
    var_dir = cluster.var
    kinds = args.kinds.split(",")
    injections: list[dict] = []
    end = t0 + args.duration_s
    number = 0
    while True:
        scheduled = t0 + args.baseline_s + number * args.interval_s
        if scheduled > end - args.min_tail_s:
            break
        time.sleep(max(0.0, scheduled - time.time()))
        live = monitor.stepping(var_dir)
        while live is None and time.time() < end - args.min_tail_s:
            time.sleep(0.5)
            live = monitor.stepping(var_dir)
        if live is None:
            log("the job is not stepping; no more injections")
            break
        kind = kinds[number % len(kinds)]
        record = inject(kind, number, args.done_kinds.count(kind), live, cluster, args)
        record["scheduled"] = scheduled
        record["delay_s"] = round(record["t"] - scheduled, 2)
        record["step_at_injection"] = last_step_before(var_dir, live["attempt_id"], record["t"])
        injections.append(record)
        number += 1
    # Wait out the chaos window, then for the last incident's recovery.
    time.sleep(max(0.0, end - time.time()))
    if injections:
        last = injections[-1]
        deadline = time.time() + args.recovery_grace_s
        while time.time() < deadline:
            live = monitor.stepping(var_dir)
            if live and live["attempt"] > last["attempt"]:
                break
            time.sleep(1)
        time.sleep(10)  # a few steps of the recovered attempt for its goodput
    return injections


def run(args) -> dict:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    var_dir = (ROOT / "var" / f"bench-chaos-{stamp}{'-quick' if args.quick else ''}").resolve()
    var_dir.mkdir(parents=True)
    if args.tree == "head":
        src, commit = snapshot_source(var_dir)
    else:
        src = ROOT
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    (var_dir / "logs").mkdir(exist_ok=True)
    cluster = Cluster(var_dir, src, args.port or free_port(), live_tree=args.tree == "live")
    config = run_config(args, var_dir, commit)
    monitor = None
    result: dict = {"config": config}
    try:
        cluster.start()
        calibration = calibrate(cluster, args.calibration_steps)
        result["calibration"] = calibration
        every = args.checkpoint_every or max(
            10, round(args.checkpoint_target_s / calibration["median_step_interval_s"])
        )
        config["checkpoint_every_steps"] = every
        config["checkpoint_target_s"] = args.checkpoint_target_s
        command = trainer_command(args.steps, every)
        config["command"] = command
        config["max_restarts"] = 100
        log(f"checkpoint every {every} steps (~{args.checkpoint_target_s:.0f}s at the median step)")
        job_id = submit(cluster, "chaos", command, max_restarts=100)
        config["job_id"] = job_id
        monitor = Monitor(cluster, job_id)
        monitor.start()
        wait_state(cluster, job_id, {"RUNNING"}, 300)
        while not monitor.stepping(var_dir):
            time.sleep(0.5)
        t0 = time.time()
        config["t0"] = t0
        log(f"job {job_id} is training; failure-free baseline for {args.baseline_s:.0f}s")
        injections = inject_failures(args, cluster, monitor, t0)
        t_end = time.time()
        config["t_end"] = t_end
        log("chaos over; collecting results")
        monitor.halt.set()
        job = cluster.get(f"/api/v1/jobs/{job_id}/")
        events = cluster.events(job_id)
        checkpoints = cluster.get(f"/api/v1/jobs/{job_id}/checkpoints/")
        nodes = cluster.get("/api/v1/nodes/")["results"]
        with contextlib.suppress(RuntimeError):
            cluster.post(f"/api/v1/jobs/{job_id}/cancel/")
        files = {}
        for attempt in job["attempts"]:
            path = rank0_file(var_dir, attempt["id"])
            files[attempt["number"]] = read_records(path) if path else []
        result.update(
            injections=injections,
            job={k: v for k, v in job.items() if k != "attempts"},
            attempts=job["attempts"],
            checkpoints=checkpoints,
            nodes=nodes,
            monitor=monitor.samples,
        )
        result["events"] = [strip_event(e) for e in events]
        result["rank0"] = {n: compact_records(r) for n, r in files.items()}
        result["analysis"] = analyse(result)
    finally:
        if monitor:
            monitor.halt.set()
        log("stopping every process of this run")
        leftovers = cluster.stop()
        config["killed_leftovers"] = leftovers
        remaining = my_pids(var_dir)
        config["processes_left"] = remaining
        log(f"stopped ({len(leftovers)} leftover(s) SIGKILLed; {len(remaining)} remaining)")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~3 min smoke run (sets shorter times)")
    p.add_argument("--duration-s", type=float, default=900, help="chaos window incl. baseline")
    p.add_argument("--baseline-s", type=float, default=90, help="failure-free stretch first")
    p.add_argument("--interval-s", type=float, default=150, help="one injection every N s")
    p.add_argument("--min-tail-s", type=float, default=60, help="no injection this close to end")
    p.add_argument("--recovery-grace-s", type=float, default=300)
    p.add_argument("--kinds", default=",".join(KINDS), help="rotation of failure kinds")
    p.add_argument(
        "--agent-victims",
        default="other,rank0",
        help="agent faults in turn hit: other (a node without rank 0), rank0 (rank 0's node), "
        "or a node name (local-a, local-b)",
    )
    p.add_argument("--agent-restart-delay-s", type=float, default=5)
    p.add_argument("--agent-freeze-s", type=float, default=20, help="> heartbeat timeout + tick")
    p.add_argument("--checkpoint-target-s", type=float, default=30)
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0 = calibrate)")
    p.add_argument("--calibration-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=10_000_000)
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--tree",
        choices=("head", "live"),
        default="head",
        help="head: a git-archive snapshot of HEAD (default); live: the checkout",
    )
    p.add_argument("--out", type=Path, default=None, help="results JSON path")
    p.add_argument("--figures", type=Path, default=ROOT / "docs" / "figures")
    p.add_argument("--replot", type=Path, default=None, help="re-analyse and plot a results file")
    args = p.parse_args(argv)
    args.done_kinds = []
    if args.quick:
        args.duration_s, args.baseline_s, args.interval_s = 180, 20, 40
        args.min_tail_s, args.calibration_steps, args.checkpoint_target_s = 20, 150, 15
    tag = "-quick" if args.quick else ""
    if args.replot:
        result = json.loads(args.replot.read_text())
        result["analysis"] = analyse(result)
        args.replot.write_text(json.dumps(result, indent=1, default=str))
        out = args.replot
    else:
        result = run(args)
        out = args.out or ROOT / "bench" / "results" / f"chaos-{dt.date.today()}{tag}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
    if "analysis" not in result:
        log("no analysis (the run failed early)")
        return 1
    tag = "-quick" if "-quick" in out.name else ""
    figures = plot(result, args.figures, tag)
    print(report(result))
    log(f"results: {out}; figures: {', '.join(str(f) for f in figures)}")
    goals = result["analysis"]["summary"]["goals"]
    return 0 if all(goals.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
