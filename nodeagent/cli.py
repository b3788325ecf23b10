"""Command line of the node agent (`lockstep agent ...` / `python -m nodeagent ...`)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from nodeagent.agent import Agent, default_work_dir


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
        "--token",
        default=os.environ.get("LOCKSTEP_AGENT_TOKEN"),
        help="cluster agent token (default: $LOCKSTEP_AGENT_TOKEN)",
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
        help="start every worker as a fresh interpreter instead of forking it from a process "
        "that has torch imported already (warm start, the default; see nodeagent/zygote.py)",
    )
    parser.add_argument(
        "--leave-timeout-s",
        type=_non_negative_float,
        default=os.environ.get("LOCKSTEP_AGENT_LEAVE_TIMEOUT_S", "30"),
        help="on the first SIGTERM/SIGINT (a planned restart), how long to wait for the "
        "workers to checkpoint and exit before killing them (default: "
        "$LOCKSTEP_AGENT_LEAVE_TIMEOUT_S or 30); a second signal kills them at once",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.token:
        parser.error(
            "no agent token: pass --token or set LOCKSTEP_AGENT_TOKEN "
            "(the cluster agent token created in the portal)"
        )
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    work_dir = args.work_dir or default_work_dir(args.name)
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
    )
    agent.install_signal_handlers()
    return agent.run()
