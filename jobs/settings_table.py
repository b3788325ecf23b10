"""Lockstep's own settings, in one table: each name, its default, the environment variable it
is read from, and why it exists. portal/settings.py builds the LOCKSTEP dict from it,
jobs.conf.lockstep_setting() falls back to its defaults, and the simulator's estimates start
from them. No Django here: the pure scheduling modules read the defaults too."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    doc: str
    # Read from LOCKSTEP_<name> (or a file named by LOCKSTEP_<name>_FILE for a secret).
    env: bool = True
    secret: bool = False
    # A path under the var directory unless the environment says otherwise.
    under_var: bool = False


TABLE: tuple[Setting, ...] = (
    Setting("AGENT_TOKEN", None, "the cluster token agents register with", secret=True),
    Setting(
        "METRICS_TOKEN",
        None,
        "bearer token Prometheus scrapes /metrics with (staff users' API tokens work too)",
        secret=True,
    ),
    Setting(
        "CHECKPOINT_ROOT", "checkpoints", "shared storage every node can reach", under_var=True
    ),
    Setting("MODEL_ROOT", "models", "where exported model versions are written", under_var=True),
    Setting("HEARTBEAT_S", 1.0, "how often agents heartbeat"),
    Setting("HEARTBEAT_TIMEOUT_S", 30.0, "a node silent this long is down, its attempts lost"),
    Setting(
        "GPU_SAMPLE_S",
        10.0,
        "how often a node's GPU readings are kept per rank for the job page's history charts",
    ),
    Setting(
        "LIVE_RANKS_MAX",
        64,
        "a job of more ranks pushes only rank 0's metrics and logs live; its page fetches the "
        "other ranks' charts and logs from the server every LIVE_REFRESH_S",
    ),
    Setting(
        "LIVE_REFRESH_S",
        15.0,
        "how often the page of a job wider than LIVE_RANKS_MAX fetches its per-rank charts again",
    ),
    Setting(
        "METRIC_RAW_RETENTION_S",
        21600.0,
        "every rank's raw metric points are kept this long (rank 0's and the per-rank rollups "
        "for the job's life); older ones go by whole partition (jobs/metric_store.py)",
    ),
    Setting(
        "METRIC_RAW_PARTITION_S",
        3600.0,
        "the time span of one partition of every rank's raw metric points (PostgreSQL)",
    ),
    Setting("SCHEDULER_TICK_S", 5.0, "the scheduler's pass interval when nothing wakes it"),
    Setting(
        "ESTIMATE_INLINE_S",
        0.2,
        "start estimates that take longer than this move out of the scheduler's pass, into a "
        "process beside it",
    ),
    Setting(
        "REASON_WRITE_S",
        0.2,
        "a pass writes changed wait reasons for at most this long (the queue's head first); the "
        "rest are written by the next passes",
    ),
    Setting(
        "ESTIMATE_EVERY_S",
        15.0,
        "how often start estimates are refreshed once they run beside the pass (Slurm's "
        "backfill cycle: 30 s)",
    ),
    Setting(
        "SCHEDULER_LEASE_S", 15.0, "a standby scheduler takes over this long after the leader dies"
    ),
    Setting("RESTART_BACKOFF_S", 2.0, "first restart delay; it doubles per restart"),
    Setting("RESTART_BACKOFF_MAX_S", 300.0, "the restart delay's cap"),
    Setting("START_TIMEOUT_S", 300.0, "an attempt not up after this long fails"),
    Setting("STOP_GRACE_S", 60.0, "checkpoint-and-stop deadline before SIGKILL"),
    # The default port range ends below 32768, where Linux's ephemeral ports begin: a port in
    # that range can be held by any outgoing connection on the master node, and the attempt's
    # TCPStore then dies with EADDRINUSE before its first step.
    Setting("MASTER_PORT_BASE", 29400, "rendezvous ports are drawn from [BASE, BASE + SPAN)"),
    Setting("MASTER_PORT_SPAN", 3000, "see MASTER_PORT_BASE"),
    # Only what the cluster serves: a scheme no node can read would be accepted at submit and
    # fail at start, three times, as a "user error".
    Setting(
        "ALLOWED_DATASET_SCHEMES",
        ["synthetic", "file"],
        "dataset URI schemes the cluster serves, comma-separated; a job naming another is "
        "refused at submit",
    ),
    Setting(
        "DATASET_ROOTS",
        [],
        "shared-storage prefixes a file:// dataset must lie under, comma-separated (empty: any "
        "absolute path); containers get the dataset read-only at the same path",
    ),
    Setting(
        "ALLOW_PROCESS_NODES",
        True,
        "accept agents that run jobs as plain processes (no container engine: not isolated); "
        "False refuses their registration",
    ),
    Setting(
        "IMAGE_REGISTRIES",
        [],
        "registries a job's image may come from, comma-separated (empty: any; `docker.io` "
        "for names without a registry, `localhost` for local images)",
    ),
    # Failure detection (DESIGN.md section 8).
    Setting(
        "HANG_MIN_S", 60.0, "hung after max(HANG_MIN_S, HANG_STEP_FACTOR x p95 step) without a step"
    ),
    Setting("HANG_STEP_FACTOR", 10.0, "see HANG_MIN_S"),
    Setting(
        "STARTUP_PROGRESS_TIMEOUT_S",
        600.0,
        "time to the first step after every rank is up; for a script that reports no steps, "
        "time without output or CPU use",
    ),
    Setting(
        "ACTIVITY_MIN_CPU_S",
        1.0,
        "CPU seconds a rank must use (since its last counted activity) to count as activity",
    ),
    Setting("DUMP_WAIT_S", 5.0, "time given to ranks to dump their stacks before the kill"),
    Setting(
        "EXIT_GRACE_S",
        60.0,
        "once rank 0 has exited 0 (and no rank failed), the other ranks' time to exit; then the "
        "attempt has succeeded and they are stopped (a hang at exit is not a failure)",
    ),
    Setting("STRAGGLER_FACTOR", 1.5, "a rank this many times slower than the rest straggles"),
    Setting("STRAGGLER_MIN_EXCESS_S", 0.01, "and slower by at least this many seconds a step"),
    Setting("STRAGGLER_WINDOW_STEPS", 50, "steps the straggler medians are taken over"),
    Setting("STRAGGLER_CHECK_S", 30.0, "how often stragglers are looked for"),
    Setting(
        "STRAGGLER_MAX_MOVES",
        1,
        "times a job is moved off a straggler's node (the slowness may follow the rank)",
    ),
    Setting("STRIKES_TO_CORDON", 3, "strikes in the window that cordon a node"),
    Setting(
        "HEALTH_RECHECK_S",
        300.0,
        "how often a node held out of scheduling until a health check passes is asked for one",
    ),
    Setting(
        "HEALTH_SLOW_FACTOR",
        2.0,
        "a node whose health-check matmul is this many times the fleet's median fails the check",
    ),
    Setting("STRIKE_WINDOW_S", 86400.0, "the strike window"),
    Setting(
        "EARLY_FAILURES_USER_ERROR",
        3,
        "this many attempts in a row failing before any work (a step, a scalar, a save) end the "
        "job as a user error",
    ),
    Setting("KEEP_CHECKPOINTS", 3, "checkpoints retention keeps besides protected ones"),
    Setting("DEFAULT_MTBF_S", 86400.0, "failure rate assumed with no history (Young/Daly)"),
    # Scheduling (DESIGN.md section 6).
    Setting(
        "PREEMPTION_APPROVAL_DELAY_S",
        300.0,
        "priority preemptions approve themselves after this unless an admin decides first",
    ),
    Setting(
        "RECLAIM_BACKOFF_S",
        300.0,
        "a team whose borrowed GPUs were reclaimed waits this long before borrowing again",
    ),
    Setting(
        "PREEMPT_EXEMPT_S",
        600.0,
        "the least minimum run: a started job is protected for its start-up cost plus one "
        "checkpoint interval, never less than this; no priority or starvation claim takes a "
        "protected job, reclaims only when no other victim will do (the reclaim bound holds)",
    ),
    Setting(
        "RESTART_COST_S",
        120.0,
        "start-up cost assumed for a job that has not started before (then measured: attempt "
        "created to its first step); weighed against the gain of a preemption",
    ),
    Setting(
        "PREEMPT_MAX_PER_DAY",
        5,
        "safety stop: a job preempted this many times within a day is not preempted again, and "
        "admins get an alert (the policy would be in a preemption loop); 0 turns it off",
    ),
    Setting(
        "RECLAIM_HOLD_S",
        3600.0,
        "a job a reclaim stopped does not borrow again within this while another team's "
        "guaranteed job waits (that team would take the GPUs back at once)",
    ),
    Setting(
        "RECLAIM_GANG_EXEMPT_S",
        14400.0,
        "a gang of whole nodes beyond its team's quota (it runs on lent GPUs the cluster drained "
        "for) is not reclaimed before it has run this long; 0 turns it off",
    ),
    Setting(
        "AGED_BORROWED_FIRST",
        True,
        "a borrowed job that has waited three times its length goes first among the guaranteed "
        "work of its priority, so no heavy team's gang starves; False puts it after that work "
        "(before other borrowed work), so a team's quota comes back sooner, at some "
        "utilization (docs/scheduling.md, rule 1)",
    ),
    Setting(
        "QUOTA_BEFORE_DRAIN",
        False,
        "a job within its team's quota may start on the free GPUs of the nodes a borrowing job "
        "at the head of the queue is draining; with AGED_BORROWED_FIRST=false, a team's quota "
        "comes back within the bound far more often, at some utilization (docs/scheduling.md, "
        "rule 1)",
    ),
    Setting(
        "WAIT_FOR_ENDING_JOBS",
        False,
        "a job that would stop another for its GPUs waits instead for jobs whose time limits or "
        "stop deadlines free them within the stop grace anyway; fewer stops, but on the msft "
        "trace a few reclaims ran past their bound (docs/scheduling.md, rule 5; docs/thrash.md)",
    ),
    Setting(
        "ELASTIC_GROW_AFTER_S",
        600.0,
        "a shrunk elastic job grows back to its full size only after this long at the smaller one",
    ),
    Setting("USAGE_HALF_LIFE_S", 86400.0, "fair-share usage history halves every this long"),
    Setting(
        "WHATIF_INLINE_MAX_JOBS",
        300,
        "a what-if over at most this many jobs runs in the request; larger ones on the rq worker",
        env=False,
    ),
)

DEFAULTS: dict[str, Any] = {
    s.name: (str(Path("var") / s.default) if s.under_var else s.default) for s in TABLE
}


def env_name(setting: Setting) -> str:
    return f"LOCKSTEP_{setting.name}"


def read_settings(
    environ: Mapping[str, str], *, var_dir: Path, secret: Callable[[str], str | None]
) -> dict[str, Any]:
    """The LOCKSTEP dict: each setting from its environment variable, parsed as its default's
    type, else its default. `secret` reads NAME or the file NAME_FILE names."""
    values: dict[str, Any] = {}
    for s in TABLE:
        name = env_name(s)
        if s.secret:
            values[s.name] = secret(name)
        elif s.under_var:
            values[s.name] = environ.get(name, str(var_dir / s.default))
        elif s.env and name in environ and isinstance(s.default, bool):
            values[s.name] = environ[name].strip().lower() in ("1", "true", "yes", "on")
        elif s.env and name in environ and isinstance(s.default, list):
            values[s.name] = [item.strip() for item in environ[name].split(",") if item.strip()]
        elif s.env and name in environ:
            kind = type(s.default)
            try:
                values[s.name] = kind(environ[name])
            except ValueError:
                # Refused at start, by name: a traceback of float() names neither.
                raise ValueError(
                    f"{name}={environ[name]!r} is not a {kind.__name__} ({s.doc})"
                ) from None
        else:
            values[s.name] = s.default
    return values


def markdown() -> str:
    """docs/settings.md, made from the table (`python -m jobs.settings_table > docs/settings.md`;
    a test fails when the page and the table differ)."""
    rows = [
        "# Settings",
        "",
        "Lockstep's own settings, made from `jobs/settings_table.py` (`python -m",
        "jobs.settings_table > docs/settings.md`). Each is read once from its environment",
        "variable into the `LOCKSTEP` dict (portal/settings.py) and through",
        "`jobs.conf.lockstep_setting()`. Secrets may also come from a file named by `<VAR>_FILE`.",
        "",
        "| variable | default | what it is for |",
        "|---|---|---|",
    ]
    for s in TABLE:
        variable = f"`{env_name(s)}`" if s.env else f"`{s.name}` (settings only)"
        default = f"`var/{s.default}`" if s.under_var else f"`{s.default!r}`"
        rows.append(f"| {variable}{' (or `_FILE`)' if s.secret else ''} | {default} | {s.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
