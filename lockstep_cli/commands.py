"""The `lockstep` commands that talk to a portal over the REST API: submit, jobs, status, wait,
cancel, checkpoints, models, tokens, and the parsers of all of them (`logs` and `events`, what a
job printed and what happened to it, are in job_output.py). Where the portal and token come
from, the output formats and the exit codes are described in the README ("The lockstep
command")."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lockstep_cli.client import (
    END_STATES,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Portal,
    outcome,
    portal_for,
)
from lockstep_cli.job_output import cmd_events, cmd_logs
from lockstep_cli.output import emit, size, table, when

SPEC_FIELDS = (
    "name",
    "team",
    "image",
    "image_pull_policy",
    "command",
    "dataset",
    "gpus",
    "min_gpus",
    "priority",
    "max_restarts",
    "checkpoint_interval_s",
    "time_limit_s",
    "env",
    "layout",
)
SPEC_DEFAULTS = {"image": "lockstep/trainer:latest", "dataset": "synthetic://addition"}


# --- submit ----------------------------------------------------------------------------------


def read_spec(path: str) -> dict:
    """A job spec file: JSON or YAML, an object of job fields (the portal's spec download)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(EXIT_USAGE, f"cannot read the spec {path}: {exc}") from exc
    try:
        spec = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CliError(EXIT_USAGE, f"{path} is neither JSON nor YAML: {exc}") from exc
    if not isinstance(spec, dict):
        raise CliError(EXIT_USAGE, f"{path}: a spec is a mapping of job fields")
    unknown = sorted(set(spec) - set(SPEC_FIELDS))
    if unknown:
        raise CliError(
            EXIT_USAGE,
            f"{path}: unknown field(s) {', '.join(unknown)}; a spec has {', '.join(SPEC_FIELDS)}",
        )
    return spec


def _env_pairs(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise CliError(EXIT_USAGE, f"--env {item!r}: give NAME=VALUE")
        env[name] = value
    return env


def job_body(args) -> dict:
    """The spec file's fields, overridden by the flags given, plus defaults for the image and
    dataset; the portal validates everything (and its field errors are printed)."""
    body = read_spec(args.file) if args.file else {}
    for field in SPEC_FIELDS:
        value = getattr(args, field, None)
        if field == "command":
            value = value or None
        if field == "env" and value:
            value = {**(body.get("env") or {}), **_env_pairs(value)}
        if value is not None:
            body[field] = value
    for field, default in SPEC_DEFAULTS.items():
        body.setdefault(field, default)
    if "command" not in body:
        raise CliError(
            EXIT_USAGE,
            "no command: give it after --, e.g. lockstep submit ... -- python -m trainer, "
            "or as `command:` in the spec",
        )
    return body


def cmd_submit(args) -> int:
    portal = portal_for(args)
    job = portal.call("POST", "/api/v1/jobs/", json=job_body(args))
    print(f"submitted job {job['id']} ({job['state']})", file=sys.stderr)
    if args.wait:
        job = wait_for_job(portal, job["id"], until_running=True, timeout=args.timeout)
    _show_job_line(args, job)
    return outcome(job) if args.wait else EXIT_OK


def _show_job_line(args, job: dict) -> None:
    if args.json:
        emit(job)
    else:
        reason = f": {job['reason']}" if job.get("reason") else ""
        print(f"job {job['id']} {job['name']} {job['state']}{reason}")


def wait_for_job(
    portal: Portal,
    job_id: int,
    *,
    until_running: bool,
    timeout: float | None,
    poll_s: float = 1.0,
    heartbeat_s: float = 30.0,
) -> dict:
    """Poll until the job runs (when until_running) or ends; each change of state or reason
    goes to stderr, and a 'still ...' line every heartbeat_s while nothing changes."""
    start = time.monotonic()
    last, last_line = None, start
    while True:
        job = portal.call("GET", f"/api/v1/jobs/{job_id}/")
        now = time.monotonic()
        seen = (job["state"], job.get("reason") or "")
        if seen != last:
            reason = f": {seen[1]}" if seen[1] else ""
            print(f"[{now - start:6.1f}s] job {job_id} {seen[0]}{reason}", file=sys.stderr)
            last, last_line = seen, now
        elif now - last_line >= heartbeat_s:
            print(f"[{now - start:6.1f}s] job {job_id} still {seen[0]}", file=sys.stderr)
            last_line = now
        if job["state"] in END_STATES or (until_running and job["state"] == "RUNNING"):
            return job
        if timeout is not None and now - start >= timeout:
            raise CliError(EXIT_FAILED, f"job {job_id} is still {job['state']} after {timeout:g} s")
        time.sleep(poll_s)


def cmd_wait(args) -> int:
    job = wait_for_job(
        portal_for(args), args.job, until_running=args.until == "running", timeout=args.timeout
    )
    _show_job_line(args, job)
    return outcome(job)


# --- reading jobs ----------------------------------------------------------------------------


def cmd_jobs(args) -> int:
    params = {"limit": args.limit}
    if args.state:
        params["state"] = args.state
    if args.team:
        params["team"] = args.team
    if args.mine or args.owner:
        params["owner"] = "@me" if args.mine else args.owner
    data = portal_for(args).call("GET", "/api/v1/jobs/", params=params)
    if args.json:
        emit(data["results"])
        return EXIT_OK
    table(
        [
            [
                j["id"],
                j["name"][:32],
                j["team"],
                j["state"],
                j["gpus"],
                j["priority"],
                when(j["submitted_at"]),
                (j["reason"] or "")[:60],
            ]
            for j in data["results"]
        ],
        ["ID", "NAME", "TEAM", "STATE", "GPUS", "PRIORITY", "SUBMITTED", "REASON"],
    )
    if data["count"] > len(data["results"]):
        print(f"({len(data['results'])} of {data['count']}; --limit for more)", file=sys.stderr)
    return EXIT_OK


def cmd_status(args) -> int:
    job = portal_for(args).call("GET", f"/api/v1/jobs/{args.job}/")
    if args.json:
        emit(job)
        return EXIT_OK
    rows = [
        ("job", f"{job['id']} {job['name']} (team {job['team']}, by {job['owner']})"),
        ("state", job["state"] + (f": {job['reason']}" if job["reason"] else "")),
        ("gpus", f"{job['gpus']}, priority {job['priority']}"),
        ("image", job["image"]),
        ("command", " ".join(job["command"])),
        ("submitted", when(job["submitted_at"])),
        ("restarts", f"{job['restart_count']} of {job['max_restarts']}"),
    ]
    if job.get("estimated_start_at"):
        # As squeue --start: when the scheduler expects it to start, and how far that holds.
        band = job.get("estimated_start_band")
        rows.insert(
            -1, ("est. start", when(job["estimated_start_at"]) + (f", {band}" if band else ""))
        )
    if job.get("progress"):
        rows.append(("progress", _progress_text(job["progress"])))
    if job.get("latest_checkpoint"):
        c = job["latest_checkpoint"]
        rows.append(("checkpoint", f"step {c['step']} (id {c['id']})"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for attempt in job["attempts"]:
        ended = attempt["ended"]["reason"] if attempt["ended"] else "live"
        print(
            f"  attempt {attempt['number']} on {', '.join(attempt['nodes']) or '-'}: "
            f"{attempt['state']}, from step {attempt['resumed_from_step']}, "
            f"last step {attempt['last_step']}; {ended}"
        )
    return EXIT_OK


def _progress_text(progress: dict) -> str:
    """ "step 309 of 2000 (15 %), 7.1 steps/s, ends about 06:11:20": Determined's progress bar
    in a line. The end is the pace's projection; a time limit that stops it first is said."""
    text = (
        f"step {progress['step']} of {progress['total_steps']} ({progress['fraction'] * 100:.0f} %)"
    )
    if progress.get("projected_end"):
        text += (
            f", {progress['steps_per_s']:.3g} steps/s, ends about {when(progress['projected_end'])}"
        )
        if progress.get("time_limit_end"):
            text += f"; its time limit stops it first, at {when(progress['time_limit_end'])}"
    else:
        text += ", pace not measured yet"
    return text


def cmd_cancel(args) -> int:
    job = portal_for(args).call("POST", f"/api/v1/jobs/{args.job}/cancel/")
    _show_job_line(args, job)
    return EXIT_OK


def cmd_checkpoints(args) -> int:
    rows = portal_for(args).call("GET", f"/api/v1/jobs/{args.job}/checkpoints/")
    if args.json:
        emit(rows)
        return EXIT_OK
    table(
        [
            [
                c["id"],
                c["step"],
                # The attempt's number (1, 2, ... as `status` shows); an older portal sends
                # only its id.
                c.get("attempt_number", c["attempt"]),
                size(c["bytes"]),
                "" if c["save_s"] is None else f"{c['save_s']:.2f}",
                when(c["created_at"]),
                c["path"],
            ]
            for c in rows
        ],
        ["ID", "STEP", "ATTEMPT", "SIZE", "SAVE_S", "CREATED", "PATH"],
    )
    return EXIT_OK


def cmd_models(args) -> int:
    portal = portal_for(args)
    if args.models_cmd == "register":
        version = portal.call(
            "POST",
            "/api/v1/models/",
            json={"name": args.name, "checkpoint": args.checkpoint, "notes": args.notes},
        )
        if args.json:
            emit(version)
        else:
            print(
                f"registered {version['name']} v{version['version']} from job {version['job']} "
                f"step {version['step']} (export {version['export_state']})"
            )
        return EXIT_OK
    data = portal.call("GET", "/api/v1/models/", params={"limit": args.limit})
    if args.json:
        emit(data["results"])
        return EXIT_OK
    table(
        [
            [
                m["id"],
                m["name"],
                f"v{m['version']}",
                m["job"],
                m["step"],
                m["export_state"],
                when(m["created_at"]),
            ]
            for m in data["results"]
        ],
        ["ID", "NAME", "VERSION", "JOB", "STEP", "EXPORT", "CREATED"],
    )
    return EXIT_OK


def cmd_tokens(args) -> int:
    """My API tokens: list, create (the secret is printed once), revoke."""
    portal = portal_for(args)
    if args.tokens_cmd == "create":
        days = None if args.never_expires else args.expires_days
        token = portal.call(
            "POST", "/api/v1/tokens/", json={"name": args.name, "expires_in_days": days}
        )
        if args.json:
            emit(token)
        else:
            expiry = (
                f"expires {when(token['expires_at'])}" if token["expires_at"] else "never expires"
            )
            print(token["token"])
            print(
                f"token {token['name']!r} (id {token['id']}, {expiry}): shown this once; "
                "store it now (e.g. LOCKSTEP_TOKEN)",
                file=sys.stderr,
            )
        return EXIT_OK
    if args.tokens_cmd == "revoke":
        portal.call("DELETE", f"/api/v1/tokens/{args.id}/")
        if not args.json:
            print(f"token {args.id} revoked")
        return EXIT_OK
    data = portal.call("GET", "/api/v1/tokens/", params={"limit": 200})
    if args.json:
        emit(data["results"])
        return EXIT_OK
    table(
        [
            [
                t["id"],
                t["name"],
                t["prefix"] + "...",
                t["state"],
                when(t["created_at"]),
                when(t["expires_at"]) if t["expires_at"] else "never",
                when(t["last_used_at"]) if t["last_used_at"] else "never",
            ]
            for t in data["results"]
        ],
        ["ID", "NAME", "TOKEN", "STATE", "CREATED", "EXPIRES", "LAST USED"],
    )
    return EXIT_OK


# --- the argument parsers --------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    # Also accepted after the subcommand (`lockstep jobs --json`); SUPPRESS keeps a value given
    # before it (`lockstep --json jobs`).
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON output")
    p.add_argument("--url", default=argparse.SUPPRESS, help="portal URL")
    p.add_argument("--token", default=argparse.SUPPRESS, help="API token")


def _username(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("give a username")
    return text.strip()


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("0 or more")
    return value


def add_commands(sub) -> dict:
    """Add the portal commands to the `lockstep` parser; returns {name: handler}."""
    p = sub.add_parser(
        "submit",
        help="submit a job from flags and/or a spec file",
        description="Submit a job. Fields come from a JSON/YAML spec (-f), overridden by flags; "
        "the command goes after --. Exit 2 with the portal's field errors on bad input.",
    )
    _common(p)
    p.add_argument("-f", "--file", help="job spec, JSON or YAML ('-' for stdin)")
    p.add_argument("--name")
    p.add_argument("--team")
    p.add_argument("--gpus", type=int)
    p.add_argument(
        "--min-gpus", type=int, help="elastic: may run on fewer GPUs (a divisor) when short"
    )
    p.add_argument("--image", help=f"default {SPEC_DEFAULTS['image']}")
    p.add_argument("--dataset", help=f"default {SPEC_DEFAULTS['dataset']}")
    p.add_argument(
        "--image-pull-policy",
        choices=["if-not-present", "always", "never"],
        help="when nodes pull the image (default if-not-present)",
    )
    p.add_argument("--priority", choices=["low", "normal", "high", "urgent"])
    p.add_argument("--max-restarts", type=int)
    p.add_argument("--checkpoint-interval-s", type=int)
    p.add_argument("--time-limit-s", type=int)
    p.add_argument(
        "--layout",
        choices=["auto", "flags"],
        help="reference trainer: auto (the planner picks dp/tp/pp per attempt, default) or "
        "flags (the command's --parallel/--tp/--pp)",
    )
    p.add_argument("--env", action="append", metavar="NAME=VALUE", help="repeatable")
    p.add_argument(
        "--wait", action="store_true", help="wait until it runs or ends; changes on stderr"
    )
    p.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM ARGS...")

    p = sub.add_parser("jobs", help="list jobs you may see")
    _common(p)
    p.add_argument("--state", help="comma-separated, e.g. queued,running")
    p.add_argument("--team")
    mine = p.add_mutually_exclusive_group()
    mine.add_argument("--mine", action="store_true", help="only the jobs you submitted")
    mine.add_argument("--owner", type=_username, help="only the jobs this user submitted")
    p.add_argument("--limit", type=int, default=50)

    for name, text in (
        ("status", "one job: state, reason, attempts"),
        ("cancel", "cancel a job"),
        ("checkpoints", "a job's committed checkpoints"),
    ):
        p = sub.add_parser(name, help=text)
        _common(p)
        p.add_argument("job", type=int)

    p = sub.add_parser("wait", help="wait for a job to end (or run); exit 1 if it failed")
    _common(p)
    p.add_argument("job", type=int)
    p.add_argument("--until", choices=["end", "running"], default="end")
    p.add_argument("--timeout", type=float)

    p = sub.add_parser("logs", help="a rank's log lines; --follow until the job ends")
    _common(p)
    p.add_argument("job", type=int)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--tail", type=int, default=100)
    p.add_argument("--attempt", type=int, help="default: the latest")
    p.add_argument("-F", "--follow", action="store_true", help="print new lines until it ends")
    p.add_argument("--poll-s", type=float, default=1.0, help=argparse.SUPPRESS)

    p = sub.add_parser(
        "events", help="what happened to a job, oldest first; --follow until it ends"
    )
    _common(p)
    p.add_argument("job", type=int)
    p.add_argument("--kind", help="comma-separated kind prefixes, e.g. attempt,node.strike")
    p.add_argument("--tail", type=_count, default=50, help="the last N (default 50; 0: all)")
    p.add_argument("-F", "--follow", action="store_true", help="print new events until it ends")
    p.add_argument("--poll-s", type=float, default=2.0, help=argparse.SUPPRESS)

    p = sub.add_parser("models", help="list model versions, or register one")
    _common(p)
    p.add_argument("--limit", type=int, default=50)
    models = p.add_subparsers(dest="models_cmd")
    r = models.add_parser("register", help="register a checkpoint as a model version")
    _common(r)
    r.add_argument("name")
    r.add_argument("--checkpoint", type=int, required=True, help="checkpoint id")
    r.add_argument("--notes", default="")

    p = sub.add_parser("tokens", help="your API tokens: list, create (shown once), revoke")
    _common(p)
    tokens = p.add_subparsers(dest="tokens_cmd")
    c = tokens.add_parser("create", help="create a token; its secret is printed once, on stdout")
    _common(c)
    c.add_argument("name", help="what it is for, e.g. 'sweeps'")
    c.add_argument("--expires-days", type=int, default=90, help="1-366 (default 90)")
    c.add_argument("--never-expires", action="store_true")
    r = tokens.add_parser("revoke", help="revoke a token: it stops working at once")
    _common(r)
    r.add_argument("id", type=int)
    return {
        "submit": cmd_submit,
        "jobs": cmd_jobs,
        "status": cmd_status,
        "wait": cmd_wait,
        "logs": cmd_logs,
        "events": cmd_events,
        "cancel": cmd_cancel,
        "checkpoints": cmd_checkpoints,
        "models": cmd_models,
        "tokens": cmd_tokens,
    }


def run(handler, args) -> int:
    try:
        return handler(args)
    except CliError as exc:
        print(f"lockstep: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
