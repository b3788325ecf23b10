"""Command line of the node agent (`lockstep agent ...` / `python -m nodeagent ...`)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from nodeagent import exclusive
from nodeagent.agent import Agent, default_work_dir
from nodeagent.contract import read_node_env


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def read_token_file(parser: argparse.ArgumentParser, path: Path) -> str:
    """The token in `path`, which must be readable by its owner only: a token file that other
    users (a job of the process runtime, say) can read is no secret."""
    try:
        mode = path.stat().st_mode
        token = path.read_text().strip()
    except OSError as exc:
        parser.error(f"cannot read the token file {path}: {exc.strerror}")
    if mode & 0o077:
        parser.error(f"the token file {path} is readable by others: chmod 600 {path}")
    if not token:
        parser.error(f"the token file {path} is empty")
    return token


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lockstep agent",
        description="Run the Lockstep node agent: register this node with the portal, then "
        "launch and supervise the workers the portal places on it.",
    )
    parser.add_argument(
        "--portal",
        default=os.environ.get("LOCKSTEP_PORTAL", "http://127.0.0.1:8000"),
        help="portal base URL (default: $LOCKSTEP_PORTAL or %(default)s)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=os.environ.get("LOCKSTEP_AGENT_TOKEN_FILE"),
        help="file holding the cluster agent token, readable by the agent only (default: "
        "$LOCKSTEP_AGENT_TOKEN_FILE); it only bootstraps the node, which then holds a token "
        "of its own",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("LOCKSTEP_AGENT_TOKEN"),
        help="the token itself (default: $LOCKSTEP_AGENT_TOKEN); prefer --token-file: a "
        "command line is visible to every process on the node",
    )
    parser.add_argument(
        "--runtime",
        choices=("auto", "container", "podman", "docker", "process"),
        default=os.environ.get("LOCKSTEP_AGENT_RUNTIME", "auto"),
        help="how jobs run: in their own image with a container engine (podman, else Docker), "
        "or as plain processes of the agent's user (not isolated); auto: a container engine "
        "where one works (default: $LOCKSTEP_AGENT_RUNTIME or auto)",
    )
    parser.add_argument(
        "--node-env-file",
        type=Path,
        default=os.environ.get("LOCKSTEP_AGENT_NODE_ENV_FILE"),
        help="KEY=VALUE lines set for every rank on this node, over the job's own env: "
        "NCCL_SOCKET_IFNAME, NCCL_IB_HCA and the like (docs/runtime.md)",
    )
    parser.add_argument(
        "--pull-policy",
        choices=("if-not-present", "always", "never"),
        default=os.environ.get("LOCKSTEP_AGENT_PULL_POLICY", "if-not-present"),
        help="when the container runtime pulls a job's image (default: if-not-present)",
    )
    parser.add_argument(
        "--gpus",
        type=_positive_int,
        required=True,
        help="GPU slots this node offers (CPU slots on a node without GPUs)",
    )
    parser.add_argument(
        "--name",
        default=socket.gethostname(),
        help="node name, unique in the cluster (default: the hostname)",
    )
    parser.add_argument("--rack", default="default", help="rack, for placement")
    parser.add_argument(
        "--address",
        default="127.0.0.1",
        help="address other nodes reach this one at (MASTER_ADDR when it hosts rank 0)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where worker logs and metrics go (default: var/agents/NAME)",
    )
    parser.add_argument(
        "--heartbeat-s",
        type=_positive_float,
        default=2.0,
        help="seconds between heartbeats; the portal may override it",
    )
    parser.add_argument(
        "--gpu-kind",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda if /dev/nvidia0 exists, else cpu",
    )
    parser.add_argument(
        "--cold-start",
        action="store_true",
        default=os.environ.get("LOCKSTEP_AGENT_COLD_START", "") not in ("", "0"),
        help="start every worker as a fresh interpreter (and, with a container engine, in a fresh "
        "container per attempt) instead of forking it from a process that has torch imported "
        "already (warm start, the default; see nodeagent/zygote.py, nodeagent/warm_container.py)",
    )
    parser.add_argument(
        "--leave-timeout-s",
        type=_non_negative_float,
        default=os.environ.get("LOCKSTEP_AGENT_LEAVE_TIMEOUT_S", "30"),
        help="on the first SIGTERM/SIGINT (a planned restart), how long to wait for the "
        "workers to checkpoint and exit before killing them (default: "
        "$LOCKSTEP_AGENT_LEAVE_TIMEOUT_S or 30); a second signal kills them at once",
    )
    parser.add_argument(
        "--health-check-s",
        type=_non_negative_float,
        default=os.environ.get("LOCKSTEP_AGENT_HEALTH_CHECK_S", "600"),
        help="run the node's full health check (disks, GPUs, a collective among as many "
        "processes as it has GPUs) when the agent starts and then every this many seconds "
        "while the node is idle; 0: only when the portal asks (default: "
        "$LOCKSTEP_AGENT_HEALTH_CHECK_S or 600). A quick check runs before every attempt",
    )
    parser.add_argument(
        "--stack-sample-s",
        type=_non_negative_float,
        default=os.environ.get("LOCKSTEP_AGENT_STACK_SAMPLE_S", "30"),
        help="while an attempt has reported no step, read its ranks' stacks from outside "
        "(py-spy) this often; a rank whose stack changed counts as active (default: "
        "$LOCKSTEP_AGENT_STACK_SAMPLE_S or 30; 0: never)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.token_file is not None:
        args.token = read_token_file(parser, args.token_file)
    if not args.token:
        parser.error(
            "no agent token: pass --token-file (or --token, or set LOCKSTEP_AGENT_TOKEN) "
            "with the cluster agent token created in the portal"
        )
    node_env = {}
    if args.node_env_file is not None:
        try:
            node_env = read_node_env(args.node_env_file)
        except OSError as exc:
            parser.error(f"cannot read the node env file {args.node_env_file}: {exc.strerror}")
        except ValueError as exc:
            parser.error(str(exc))
    # Nothing the agent starts may inherit it (process runtime; containers inherit nothing).
    os.environ.pop("LOCKSTEP_AGENT_TOKEN", None)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    work_dir = args.work_dir or default_work_dir(args.name)
    try:
        # Before anything touches the work dir: its start-up sweep would remove the live
        # agent's containers as stale (nodeagent/exclusive.py).
        work_lock = exclusive.hold(Path(work_dir) / "agent.lock", f"the agent of {args.name}")
    except exclusive.HeldElsewhere as exc:
        print(
            f"lockstep agent: another agent ({exc.holder.get('what', 'unknown')}, "
            f"{exc.describe()}) runs on the work dir {work_dir}; not starting a second one "
            "there, whose start would remove that agent's containers and take its node's "
            "registration. Stop it first, or give this agent a --work-dir of its own.",
            file=sys.stderr,
        )
        return exclusive.EXIT_WORK_DIR_HELD
    except OSError as exc:  # a work dir not ours, or a file system without flock
        print(f"lockstep agent: cannot lock the work dir {work_dir}: {exc}", file=sys.stderr)
        return exclusive.EXIT_WORK_DIR_HELD
    agent = Agent(
        args.portal,
        args.token,
        args.gpus,
        name=args.name,
        rack=args.rack,
        address=args.address,
        work_dir=work_dir,
        heartbeat_s=args.heartbeat_s,
        gpu_kind=args.gpu_kind,
        warm_start=not args.cold_start,
        leave_timeout_s=args.leave_timeout_s,
        runtime=args.runtime,
        pull_policy=args.pull_policy,
        node_env=node_env,
        health_check_s=args.health_check_s,
        stack_sample_s=args.stack_sample_s,
    )
    agent.install_signal_handlers()
    try:
        return agent.run()
    finally:
        os.close(work_lock)
