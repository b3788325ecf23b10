"""`lockstep logs` and `lockstep events`: what a job's ranks printed and what happened to it,
each once or followed (--follow) until the job ends. Parsers in commands.add_commands."""

from __future__ import annotations

import json
import sys
import time

from lockstep_cli.client import END_STATES, EXIT_OK, outcome, portal_for
from lockstep_cli.output import emit, when


def cmd_logs(args) -> int:
    portal = portal_for(args)
    params = {"rank": args.rank, "tail": args.tail}
    if args.attempt:
        params["attempt"] = args.attempt
    data = portal.call("GET", f"/api/v1/jobs/{args.job}/logs/", params=params)
    lines = data["lines"]
    if args.follow and data.get("partial") and lines:
        lines = lines[:-1]  # an unfinished line: printed whole once the rest arrives
    for line in lines:
        print(line)
    if not args.follow:
        return EXIT_OK
    return _follow_logs(portal, args, data)


def _follow_logs(portal, args, data) -> int:
    """Print what the rank writes from here on, by cursor (nothing is re-read or skipped,
    however long the log), until the job ends; a restart prints a header line and goes on
    with the new attempt's log."""
    attempt, cursor = data["attempt"], data.get("cursor") or 0
    carry = data.get("partial") or ""

    def page(number) -> dict:
        params = {"rank": args.rank, "after": cursor}
        if number is not None:
            params["attempt"] = number
        return portal.call("GET", f"/api/v1/jobs/{args.job}/logs/", params=params)

    def emit(text: str) -> None:
        nonlocal carry
        *done, carry = (carry + text).split("\n")
        for line in done:
            print(line)

    while True:
        sys.stdout.flush()
        job = portal.call("GET", f"/api/v1/jobs/{args.job}/")
        data = page(args.attempt)
        if data["attempt"] != attempt and attempt is not None:
            # A new attempt: first the rest of the old one's log, then a header.
            while (old := page(attempt))["text"]:
                emit(old["text"])
                cursor = old["cursor"]
            if carry:
                print(carry)
                carry = ""
            print(f"--- attempt {data['attempt']}", file=sys.stderr)
            data = page(args.attempt)
        attempt = data["attempt"]
        while data["text"]:  # a page at a time until caught up
            emit(data["text"])
            cursor = data["cursor"]
            data = page(attempt)
        if job["state"] in END_STATES and not args.attempt:
            # The state was read before the logs: what the last attempt wrote is all printed.
            if carry:
                print(carry)
            print(f"job {args.job} {job['state']}", file=sys.stderr)
            return outcome(job)
        time.sleep(args.poll_s)


def _events_after(portal, job: int, since: int | None) -> list[dict]:
    """Every event of `job` after the event id `since` (all of them for None), page by page
    until an empty one (whatever the portal's page size): a week-long run has thousands of
    checkpoint events."""
    events: list[dict] = []
    while True:
        params = {} if since is None else {"since_id": since}
        page = portal.call("GET", f"/api/v1/jobs/{job}/events/", params=params)
        if not page:
            return events
        events += page
        since = page[-1]["id"]


def _print_events(events: list[dict], as_json: bool) -> None:
    for e in events:
        if as_json:
            print(json.dumps(e))  # --follow --json: one event per line
        else:
            # The node, unless the message names it already.
            node = f"[{e['node']}] " if e["node"] and e["node"] not in e["message"] else ""
            print(f"{when(e['created_at'])}  {e['kind']:<24}  {node}{e['message']}")


def cmd_events(args) -> int:
    """What happened to a job (starts, checkpoints, failures and why, preemptions, moves),
    oldest first: the last --tail, of the --kind prefixes; --follow until it ends."""
    portal = portal_for(args)
    kinds = tuple(k.strip() for k in (args.kind or "").split(",") if k.strip())

    def shown(events: list[dict]) -> list[dict]:
        return [e for e in events if not kinds or e["kind"].startswith(kinds)]

    events = _events_after(portal, args.job, None)
    last = events[-1]["id"] if events else None
    selected = shown(events)[-args.tail :] if args.tail > 0 else shown(events)
    if args.json and not args.follow:
        emit(selected)
        return EXIT_OK
    _print_events(selected, args.json)
    while args.follow:
        sys.stdout.flush()
        job = portal.call("GET", f"/api/v1/jobs/{args.job}/")
        new = _events_after(portal, args.job, last)
        last = new[-1]["id"] if new else last
        _print_events(shown(new), args.json)
        if job["state"] in END_STATES:
            # The state was read before the events: the ones up to its end are all printed.
            print(f"job {args.job} {job['state']}", file=sys.stderr)
            return outcome(job)
        time.sleep(args.poll_s)
    return EXIT_OK
