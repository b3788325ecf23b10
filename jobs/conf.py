"""One accessor for Lockstep's settings (the LOCKSTEP dict), with defaults."""

from django.conf import settings

DEFAULTS = {
    "AGENT_TOKEN": None,
    "METRICS_TOKEN": None,
    "CHECKPOINT_ROOT": "var/checkpoints",
    "MODEL_ROOT": "var/models",
    "HEARTBEAT_S": 1.0,
    "HEARTBEAT_TIMEOUT_S": 30.0,
    "GPU_SAMPLE_S": 10.0,  # how often a node's telemetry is kept per rank for the job's charts
    "SCHEDULER_TICK_S": 5.0,
    "SCHEDULER_LEASE_S": 15.0,  # a standby scheduler takes over this long after the leader dies
    "RESTART_BACKOFF_S": 2.0,
    "RESTART_BACKOFF_MAX_S": 300.0,
    "START_TIMEOUT_S": 300.0,
    "STOP_GRACE_S": 60.0,
    "MASTER_PORT_BASE": 29400,
    "MASTER_PORT_SPAN": 3000,
    "HANG_MIN_S": 60.0,
    "HANG_STEP_FACTOR": 10.0,
    "STARTUP_PROGRESS_TIMEOUT_S": 600.0,
    "DUMP_WAIT_S": 5.0,
    "STRAGGLER_FACTOR": 1.5,
    "STRAGGLER_MIN_EXCESS_S": 0.01,
    "STRAGGLER_WINDOW_STEPS": 50,
    "STRAGGLER_CHECK_S": 30.0,
    "STRIKES_TO_CORDON": 3,
    "STRIKE_WINDOW_S": 86400.0,
    "EARLY_FAILURES_USER_ERROR": 3,
    "KEEP_CHECKPOINTS": 3,
    "DEFAULT_MTBF_S": 86400.0,
    "PREEMPTION_APPROVAL_DELAY_S": 300.0,
    "RECLAIM_BACKOFF_S": 300.0,
    "PREEMPT_EXEMPT_S": 600.0,
    "ELASTIC_GROW_AFTER_S": 600.0,
    "USAGE_HALF_LIFE_S": 86400.0,
    # A what-if over at most this many jobs runs in the request; larger ones on the rq worker.
    "WHATIF_INLINE_MAX_JOBS": 300,
    "ALLOWED_DATASET_SCHEMES": ["synthetic", "file", "s3", "gs", "hf", "nfs"],
}


def lockstep_setting(name: str):
    return getattr(settings, "LOCKSTEP", {}).get(name, DEFAULTS[name])
