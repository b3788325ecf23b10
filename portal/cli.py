"""The `lockstep` command: run the platform (`up`, `agent`, `scheduler`) and use it (`submit`,
`jobs`, `status`, `cancel`, `logs`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_USAGE, EXIT_API, EXIT_UNREACHABLE = 2, 3, 4


def _django_setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()


def _client(args):
    import requests

    url = (args.portal or os.environ.get("LOCKSTEP_PORTAL") or "http://127.0.0.1:8000").rstrip("/")
    token = args.token or os.environ.get("LOCKSTEP_TOKEN")
    if not token:
        print("lockstep: no API token; pass --token or set LOCKSTEP_TOKEN", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"

    def call(method: str, path: str, **kwargs):
        try:
            response = session.request(method, url + path, timeout=30, **kwargs)
        except requests.ConnectionError:
            print(f"lockstep: cannot reach the portal at {url}", file=sys.stderr)
            sys.exit(EXIT_UNREACHABLE)
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = response.text
            print(
                f"lockstep: {response.status_code}: {json.dumps(body, indent=1)}", file=sys.stderr
            )
            sys.exit(EXIT_API)
        return response.json()

    return call


def cmd_submit(args) -> int:
    body = {
        "name": args.name,
        "team": args.team,
        "image": args.image,
        "command": args.command,
        "dataset": args.dataset,
        "gpus": args.gpus,
        "priority": args.priority,
        "max_restarts": args.max_restarts,
    }
    if not body["command"]:
        print("lockstep: give the command after --, e.g. -- python -m trainer", file=sys.stderr)
        return EXIT_USAGE
    job = _client(args)("POST", "/api/v1/jobs/", json=body)
    print(json.dumps(job, indent=1) if args.json else f"submitted job {job['id']} ({job['state']})")
    return 0


def cmd_jobs(args) -> int:
    data = _client(args)("GET", "/api/v1/jobs/", params={"limit": 200})
    if args.json:
        print(json.dumps(data["results"], indent=1))
        return 0
    print(f"{'ID':>5}  {'NAME':<24} {'TEAM':<12} {'STATE':<11} {'GPUS':>4}  REASON")
    for job in data["results"]:
        print(
            f"{job['id']:>5}  {job['name'][:24]:<24} {job['team'][:12]:<12} "
            f"{job['state']:<11} {job['gpus']:>4}  {job['reason'][:70]}"
        )
    return 0


def cmd_status(args) -> int:
    job = _client(args)("GET", f"/api/v1/jobs/{args.job}/")
    if args.json:
        print(json.dumps(job, indent=1))
        return 0
    print(f"job {job['id']} {job['name']}: {job['state']} - {job['reason']}")
    for attempt in job["attempts"]:
        ended = attempt["ended"]["reason"] if attempt["ended"] else "live"
        print(
            f"  attempt {attempt['number']} on {', '.join(attempt['nodes'])}: {attempt['state']}"
            f", resumed from step {attempt['resumed_from_step']}; {ended}"
        )
    return 0


def cmd_cancel(args) -> int:
    job = _client(args)("POST", f"/api/v1/jobs/{args.job}/cancel/")
    print(f"job {job['id']}: {job['state']}")
    return 0


def cmd_logs(args) -> int:
    data = _client(args)(
        "GET", f"/api/v1/jobs/{args.job}/logs/", params={"rank": args.rank, "tail": args.tail}
    )
    print("\n".join(data["lines"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "agent":
        from nodeagent.cli import main as agent_main

        return agent_main(argv[1:]) or 0
    if argv and argv[0] == "up":
        from portal.up import main as up_main

        return up_main(argv[1:])

    parser = argparse.ArgumentParser(prog="lockstep", description=__doc__)
    parser.add_argument("--portal", help="portal URL (env LOCKSTEP_PORTAL)")
    parser.add_argument("--token", help="API token (env LOCKSTEP_TOKEN)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="run the whole platform locally (portal, scheduler, agents)")
    sub.add_parser("agent", help="run a node agent (see `lockstep agent --help`)")
    scheduler = sub.add_parser("scheduler", help="run the scheduler loop")
    scheduler.add_argument("--once", action="store_true")
    submit = sub.add_parser("submit", help="submit a job: lockstep submit --team T -- CMD...")
    submit.add_argument("--name", required=True)
    submit.add_argument("--team", required=True)
    submit.add_argument("--gpus", type=int, required=True)
    submit.add_argument("--image", default="lockstep/trainer:latest")
    submit.add_argument("--dataset", default="synthetic://addition")
    submit.add_argument("--priority", default="normal")
    submit.add_argument("--max-restarts", type=int, default=3)
    submit.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("jobs", help="list jobs")
    for name in ("status", "cancel", "logs"):
        p = sub.add_parser(name, help=f"{name} of one job")
        p.add_argument("job", type=int)
        if name == "logs":
            p.add_argument("--rank", type=int, default=0)
            p.add_argument("--tail", type=int, default=100)
    args = parser.parse_args(argv)
    if args.cmd == "submit" and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.cmd == "scheduler":
        _django_setup()
        from jobs.scheduling.loop import run_forever

        run_forever(once=args.once)
        return 0
    return {
        "submit": cmd_submit,
        "jobs": cmd_jobs,
        "status": cmd_status,
        "cancel": cmd_cancel,
        "logs": cmd_logs,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
