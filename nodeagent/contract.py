"""The launch contract: the environment every rank starts with (docs/agent-protocol.md).

Built by the agent for both runtimes: a plain process inherits the agent's environment less
its secrets; a container inherits nothing of the agent's but the network settings an operator
configured, on top of its image's own environment.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Network settings an operator configures for the agent that workers need for NCCL/gloo.
# A plain process inherits them with the rest of the agent's environment; a container gets
# exactly these.
PASSTHROUGH_NETWORK_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# PyTorch's flight recorder: a ring of each rank's last 2,000 collectives, which NCCL and gloo
# both keep; its dump file and the pipe that asks for one are set per attempt
# (build_worker_env, FLIGHT_RECORDER_STEM).
FLIGHT_RECORDER_DEFAULTS = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_FR_BUFFER_SIZE": "2000",
}
# NCCL's watchdog: it dumps the ring on a collective timeout (and serves the pipe).
NCCL_DEBUG_DEFAULTS = {
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}
# `<stem><rank>` is a rank's dump, `<stem><rank>.pipe` the named pipe a byte is written to for
# one (nodeagent/flight_recorder.py); in the attempt's directory, which a container mounts.
FLIGHT_RECORDER_STEM = "nccl-trace-rank-"


def resolve_command(command: list[str]) -> list[str]:
    """Run `python ...` commands with the agent's own interpreter.

    The agent is started from the project's virtual environment; a bare `python` on PATH may be
    the system interpreter, without torch or the trainer installed, or another Python version.
    Using sys.executable makes `python -m trainer` import exactly what the agent can import.
    """
    argv = [str(part) for part in command]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


# $(NAME) in a command, and $$ for a literal $ (Kubernetes' rule for a container's command).
ENV_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_command(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """A rank's command with `$(NAME)` replaced by NAME's value in the rank's environment, so
    an unmodified script can be pointed at the platform's paths without a shell:
    `--output_dir $(LOCKSTEP_CHECKPOINT_DIR)`. `$$` is a literal `$` (so `$$(NAME)` stays
    `$(NAME)`), and a name the environment lacks is left as written, as Kubernetes does."""

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return [ENV_REFERENCE.sub(value, part) for part in argv]


# What a worker must not inherit from the agent: workers run users' code, and these hold the
# cluster agent token (which registers nodes), the agent's own settings, and, under
# `lockstep up`, the portal's database, Redis and Django settings.
PRIVATE_PREFIXES = ("LOCKSTEP_", "DJANGO_")
# What build_worker_env sets for each rank; nobody else may (a job's env, a node's env file).
CONTRACT_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "CUDA_VISIBLE_DEVICES",
    }
)
PRIVATE_NAMES = frozenset({"DATABASE_URL", "REDIS_URL"})
# Trainer settings an operator may set on a node's agent for every worker there.
WORKER_SETTINGS = frozenset({"LOCKSTEP_PG_TIMEOUT_S"})


def inheritable_env(base_env: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in base_env.items()
        if k in WORKER_SETTINGS or (not k.startswith(PRIVATE_PREFIXES) and k not in PRIVATE_NAMES)
    }


def build_worker_env(
    launch: Mapping[str, Any],
    rank: Mapping[str, Any],
    *,
    attempt_id: int,
    metrics_path: Path,
    gpu_kind: str,
    base_env: Mapping[str, str],
    node_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one worker: the agent's (less its own secrets and configuration, see
    `inheritable_env`), plus launch.env, plus the launch contract.

    Contract variables are applied last so a user's env cannot fake another rank's identity.
    """
    env = inheritable_env(base_env)
    env.update({str(k): str(v) for k, v in (launch.get("env") or {}).items()})
    # The node's own settings from its admin (--node-env-file: NCCL interfaces, HCAs) win
    # over a job's: they describe this machine, which the job cannot know.
    env.update(node_env or {})
    world_size = int(launch["world_size"])
    local_world_size = int(launch["local_world_size"])
    resume_from = launch.get("resume_from") or ""
    contract = {
        "RANK": rank["rank"],
        "LOCAL_RANK": rank["local_rank"],
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size,
        "GROUP_RANK": launch["group_rank"],
        "GROUP_WORLD_SIZE": launch["group_world_size"],
        "ROLE_RANK": rank["rank"],
        "ROLE_WORLD_SIZE": world_size,
        "ROLE_NAME": "default",
        "MASTER_ADDR": launch["master_addr"],
        "MASTER_PORT": launch["master_port"],
        "TORCHELASTIC_RUN_ID": launch["run_id"],
        "TORCHELASTIC_RESTART_COUNT": launch.get("restart_count", 0),
        "TORCHELASTIC_MAX_RESTARTS": launch.get("max_restarts", 0),
        "LOCKSTEP_JOB_ID": launch["job_id"],
        "LOCKSTEP_ATTEMPT": launch["attempt"],
        "LOCKSTEP_ATTEMPT_ID": attempt_id,
        "LOCKSTEP_CHECKPOINT_DIR": launch.get("checkpoint_dir") or "",
        "LOCKSTEP_RESUME_FROM": resume_from,
        "LOCKSTEP_DATASET": launch.get("dataset") or "",
        "LOCKSTEP_JOB_GPUS": launch.get("job_gpus") or world_size,
        # The reference trainer's layout setting (auto/flags); "" from an older portal.
        "LOCKSTEP_LAYOUT": launch.get("layout") or "",
        "LOCKSTEP_METRICS_PATH": metrics_path,
        "LOCKSTEP_DEVICE": gpu_kind,
    }
    env.update({k: str(v) for k, v in contract.items()})
    # Several ranks on one host each spawning a thread per core oversubscribes the CPU badly;
    # torchrun applies the same default.
    if local_world_size > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    # The flight recorder: on a hang (or NCCL's collective timeout) each rank dumps its last
    # collectives (what it entered, in which order, what completed) to a file in the attempt's
    # directory, which the agent reads into the hang's Event. A job's own values win.
    stem = str(Path(metrics_path).parent / FLIGHT_RECORDER_STEM)
    for name, value in {
        **FLIGHT_RECORDER_DEFAULTS,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": stem,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem,
    }.items():
        env.setdefault(name, value)
    if gpu_kind == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(rank["gpu_index"])
        for name, value in NCCL_DEBUG_DEFAULTS.items():
            env.setdefault(name, value)
    return env


def container_base_env(agent_env: Mapping[str, str]) -> dict[str, str]:
    """What a container's ranks take from the agent: the operator's network and trainer
    settings only. Everything else (the image's PATH, ...) comes from the image."""
    names = set(PASSTHROUGH_NETWORK_VARS) | WORKER_SETTINGS
    return {k: v for k, v in agent_env.items() if k in names or k.startswith("NCCL_")}


ENV_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def read_node_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (blank lines and # comments skipped) that an admin sets for every rank
    on this node, typically NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_GID_INDEX. Raises
    ValueError naming the line for anything else, and for names the launch contract owns."""
    env: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = ENV_LINE.match(line)
        if match is None:
            raise ValueError(f"{path}:{number}: not NAME=value: {raw!r}")
        name, value = match.groups()
        if name.startswith(PRIVATE_PREFIXES) or name in CONTRACT_NAMES:
            raise ValueError(f"{path}:{number}: {name} is set by the launch contract")
        env[name] = value
    return env
