"""One accessor for Lockstep's settings (the LOCKSTEP dict), with defaults."""

from django.conf import settings

DEFAULTS = {
    "AGENT_TOKEN": None,
    "CHECKPOINT_ROOT": "var/checkpoints",
    "MODEL_ROOT": "var/models",
    "HEARTBEAT_S": 1.0,
    "HEARTBEAT_TIMEOUT_S": 30.0,
    "SCHEDULER_TICK_S": 5.0,
    "RESTART_BACKOFF_S": 2.0,
    "RESTART_BACKOFF_MAX_S": 300.0,
    "START_TIMEOUT_S": 300.0,
    "STOP_GRACE_S": 60.0,
    "MASTER_PORT_BASE": 29400,
    "ALLOWED_DATASET_SCHEMES": ["synthetic", "file", "s3", "gs", "hf", "nfs"],
}


def lockstep_setting(name: str):
    return getattr(settings, "LOCKSTEP", {}).get(name, DEFAULTS[name])
