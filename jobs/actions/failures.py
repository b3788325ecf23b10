"""Which rank failed and why: exits recorded and blamed on the first rank to die, causes revised
by later reports, hangs (stacks first, then the end) and stragglers."""

from __future__ import annotations

import signal
from dataclasses import asdict
from datetime import datetime

from django.db import transaction

from jobs.actions.attempts import STRAGGLER_REASON, do_end_attempt
from jobs.actions.base import describe_exit, lock_job_for_stop, record_event, wake
from jobs.actions.node_health import do_hold_node
from jobs.actions.preemption import stop_to_requeue
from jobs.actions.strikes import node_strikes, strike_node
from jobs.conf import lockstep_setting
from jobs.event_kinds import EventKind
from jobs.health import (
    StragglerVerdict,
    flight_recorder_verdict,
    flight_records,
    odd_rank_out,
)
from jobs.models import (
    Allocation,
    Attempt,
    Event,
    Job,
    LogChunk,
    Node,
)
from jobs.queries import stopped_state, world_size

# Exits this close together are one event seen at slightly different moments (agents poll their
# workers every 0.25 s and report on their own heartbeats).
SIMULTANEOUS_EXITS_S = 1.0


# Exits that follow from a peer's death rather than cause one: a Python error (exit 1, what a
# broken collective raises) and SIGPIPE (a write to the socket of a peer that is gone, in a
# program that does not ignore the signal).
_CONSEQUENTIAL_EXITS = (1, -signal.SIGPIPE)


def _culprit(failed: list[Allocation]) -> Allocation:
    """The rank to blame among those that failed: among the first exits, one killed by a signal
    (SIGKILL, a segfault, the OOM killer) before one that exited with an error code, and either
    before an exit that a peer's death causes (exit 1, SIGPIPE): when a rank dies, the others'
    collectives break and they raise or take SIGPIPE a moment later, often within the same poll
    of their agent."""
    first = min(a.exited_at for a in failed)
    near = [a for a in failed if (a.exited_at - first).total_seconds() <= SIMULTANEOUS_EXITS_S]
    return min(
        near,
        key=lambda a: (a.exit_code in _CONSEQUENTIAL_EXITS, a.exit_code >= 0, a.exited_at, a.rank),
    )


# How long after a failed attempt ended the other nodes' reports of its exits may still change
# which rank it blames (a few heartbeats).
REVISE_CAUSE_S = 30.0


def _failure_reason(allocation: Allocation) -> str:
    return (
        f"rank {allocation.rank} on {allocation.node.name} exited with "
        f"{describe_exit(allocation.exit_code)}"
    )


def revise_cause(attempt: Attempt, node: Node, report: dict, *, now: datetime) -> None:
    """An attempt ends on the first report of a failed rank, so that the rest of the gang is
    stopped at once. That report may come from a rank that only exited because its peer on
    another node died (its collective broke) a moment earlier: when that node's report arrives
    just after, with the real cause, the attempt's reason (and the job's) name it instead, and
    an Event says so. Nothing else about the ended attempt changes."""
    if attempt.ended_at is None or (now - attempt.ended_at).total_seconds() > REVISE_CAUSE_S:
        return
    mine = {a.rank: a for a in attempt.allocations.filter(node=node, exit_code__isnull=True)}
    for item in report.get("ranks") or []:
        allocation = mine.get(item.get("rank"))
        if allocation is None or item.get("state") != "exited" or item.get("exit_code") is None:
            continue
        allocation.exit_code = int(item["exit_code"])
        allocation.exited_at = agent_time(item.get("exited_at"), now)
        allocation.save(update_fields=["exit_code", "exited_at"])
    # Exits after the attempt ended are the fencing's doing (its ranks killed), not a cause.
    failed = [
        a
        for a in attempt.allocations.select_related("node")
        if a.exit_code not in (None, 0)
        and a.exited_at is not None
        and a.exited_at <= attempt.ended_at
    ]
    if not failed or not attempt.end_reason.startswith("rank "):
        return  # a hang or a lost node: not an exit to re-attribute
    reason = _failure_reason(_culprit(failed))
    if reason == attempt.end_reason:
        return
    old = attempt.end_reason
    Attempt.objects.filter(pk=attempt.pk).update(end_reason=reason)
    job = Job.objects.select_for_update(no_key=True).get(pk=attempt.job_id)
    if job.reason.startswith(old):
        job.reason = reason + job.reason[len(old) :]
        job.save(update_fields=["reason"])
    record_event(
        EventKind.ATTEMPT_CAUSE_REVISED,
        f"attempt {attempt.number}: {reason} (first reported: {old})",
        job=job,
        attempt=attempt,
        node=node,
        team_id=job.team_id,
    )
    # After this heartbeat commits, in a transaction of its own: it writes rows that point at
    # the first node, whose own heartbeat may hold that node's lock while it waits for this
    # attempt's (a deadlock on PostgreSQL if done here).
    culprit_id, attempt_id = _culprit(failed).node_id, attempt.id
    transaction.on_commit(lambda: _move_strike(attempt_id, culprit_id, reason, now=now))


def _move_strike(attempt_id: int, culprit_id: int, reason: str, *, now: datetime) -> None:
    """The strike for an attempt's end follows a revised cause to the culprit's node: the
    node first blamed only saw its rank die of the broken collective. If that strike had
    cordoned the node automatically and the node is now under the limit, it is back up."""
    with transaction.atomic():
        strike = (
            Event.objects.filter(
                kind=EventKind.NODE_STRIKE, attempt_id=attempt_id, data__attempt_end=True
            )
            .order_by("-id")
            .first()
        )
        if strike is None or strike.node_id == culprit_id:
            return
        attempt = Attempt.objects.get(pk=attempt_id)
        first = Node.objects.select_for_update(no_key=True).get(pk=strike.node_id)
        record_event(
            EventKind.NODE_STRIKE_WITHDRAWN,
            f"strike on {first.name} withdrawn: job {attempt.job_id} attempt "
            f"{attempt.number} failed because of {reason}",
            node=first,
            attempt=attempt,
            data={"strike": strike.id},
        )
        last_cordon = (
            Event.objects.filter(node=first, kind=EventKind.NODE_CORDONED).order_by("-id").first()
        )
        # Cordoned now, or down with the cordon held for its return (nodes.hold_cordon).
        cordoned = first.state == Node.State.CORDONED or (
            first.state == Node.State.DOWN and first.held_state == Node.State.CORDONED
        )
        if (
            cordoned
            and last_cordon is not None
            and last_cordon.id > strike.id
            and last_cordon.data.get("automatic")
            and node_strikes(first, now) < lockstep_setting("STRIKES_TO_CORDON")
        ):
            if first.state == Node.State.DOWN:
                first.held_state = first.held_reason = ""
            else:
                first.state, first.state_reason = Node.State.UP, ""
            first.save(update_fields=["state", "state_reason", "held_state", "held_reason"])
            record_event(
                EventKind.NODE_UNCORDONED,
                f"node {first.name} uncordoned automatically: the strike that cordoned it "
                "was withdrawn",
                node=first,
                data={"automatic": True},
            )
            wake("node uncordoned")
        strike_node(
            Node.objects.select_for_update(no_key=True).get(pk=culprit_id),
            f"job {attempt.job_id} attempt {attempt.number}: {reason}",
            now=now,
            attempt=attempt,
        )


def record_exits(
    attempt: Attempt, node: Node, exits: dict[int, tuple[int, datetime]], *, now: datetime
) -> None:
    """Apply reported rank exits (code, when the agent saw it) and end the attempt when the
    gang's fate is known. The first rank to die is blamed: the others usually die after it,
    of a broken collective."""
    allocations = list(attempt.allocations.select_related("node"))
    mine = {a.rank: a for a in allocations if a.node_id == node.id}
    for rank, (code, exited_at) in exits.items():
        allocation = mine.get(rank)
        if allocation is None or allocation.exit_code is not None:
            continue
        allocation.exit_code, allocation.exited_at = code, min(exited_at, now)
        allocation.save(update_fields=["exit_code", "exited_at"])
        record_event(
            EventKind.RANK_EXITED,
            f"rank {rank} on {node.name} ended with {describe_exit(code)}",
            job_id=attempt.job_id,
            attempt=attempt,
            node=node,
            data={"rank": rank, "exit_code": code},
        )
    codes = [a.exit_code for a in allocations]
    failed = [a for a in allocations if a.exit_code not in (None, 0)]
    if attempt.state == Attempt.State.STOPPING:
        if all(c is not None for c in codes):
            do_end_attempt(
                attempt,
                state=stopped_state(attempt.job),
                reason=attempt.end_reason or "stopped",
                now=now,
            )
    elif failed:
        first = _culprit(failed)
        do_end_attempt(
            attempt,
            state=Attempt.State.FAILED,
            now=now,
            failed_at=first.exited_at,
            blame_node=first.node,
            reason=_failure_reason(first),
        )
    elif all(c == 0 for c in codes):
        do_end_attempt(attempt, state=Attempt.State.SUCCEEDED, reason="all ranks exited 0", now=now)


@transaction.atomic
def do_end_finished_attempt(attempt: Attempt, *, lingering: list[int], now: datetime) -> Attempt:
    """Rank 0 exited 0, no rank failed, and `lingering` ranks were still running EXIT_GRACE_S
    later: the attempt has succeeded, and ending it stops them. An unmodified script's ranks
    can hang at exit once rank 0 (which hosts torch's TCP store) is gone, in
    destroy_process_group or the interpreter's teardown; judged a hang, a finished job would
    be restarted. As Kubeflow's PyTorchJob, the run succeeds when its rank 0 does."""
    attempt = Attempt.objects.select_for_update().get(pk=attempt.pk)
    if attempt.ended_at is not None:
        return attempt
    grace = lockstep_setting("EXIT_GRACE_S")
    ranks = ", ".join(map(str, lingering))
    return do_end_attempt(
        attempt,
        state=Attempt.State.SUCCEEDED,
        reason=f"rank 0 exited 0; rank(s) {ranks} still running {grace:.0f}s later were "
        "stopped (a hang at exit)",
        now=now,
        data={"lingering_ranks": lingering},
    )


def agent_time(value, now: datetime) -> datetime:
    """An agent's wall-clock timestamp, trusted only if plausible (clocks drift)."""
    # Compared as numbers first: fromtimestamp() raises on values out of the platform's range.
    if isinstance(value, int | float) and now.timestamp() - 3600 <= value <= now.timestamp():
        return datetime.fromtimestamp(value, now.tzinfo)
    return now


@transaction.atomic
def do_request_stack_dump(attempt: Attempt, *, reason: str, now: datetime) -> bool:
    """A hang was seen: ask the agents for every rank's stacks before the attempt is killed."""
    if not Attempt.objects.filter(
        pk=attempt.pk, ended_at__isnull=True, dump_requested_at__isnull=True
    ).update(dump_requested_at=now, end_reason=reason):
        return False
    record_event(
        EventKind.ATTEMPT_HANG_DETECTED,
        f"attempt {attempt.number}: {reason}; capturing stacks before restart",
        job_id=attempt.job_id,
        attempt=attempt,
        data={"last_step": attempt.last_step},
    )
    return True


# Where a stack dump starts in a rank's log: faulthandler's (the trainer's own, on SIGUSR1) and
# the agent's header over py-spy's reading from outside (nodeagent/stacks.py, MARKER).
STACK_MARKERS = ("Thread 0x", "Current thread", "lockstep agent: stacks of rank")


def logs_since(attempt: Attempt, since: datetime) -> dict[int, str]:
    """Per rank, the log text shipped since `since`."""
    by_rank: dict[int, list[str]] = {}
    for rank, text in LogChunk.objects.filter(attempt=attempt, created_at__gte=since).values_list(
        "rank", "text"
    ):
        by_rank.setdefault(rank, []).append(text)
    return {rank: "".join(parts) for rank, parts in sorted(by_rank.items())}


def stacks_in(logs: dict[int, str], *, limit: int = 20_000) -> dict[str, str]:
    """Per rank, the stack dumps in its log text."""
    stacks = {}
    for rank, text in logs.items():
        start = min((i for i in map(text.find, STACK_MARKERS) if i >= 0), default=-1)
        if start >= 0:
            stacks[str(rank)] = text[start:][:limit]
    return stacks


def do_end_hung_attempt(attempt: Attempt, *, now: datetime) -> Attempt:
    logs = logs_since(attempt, attempt.dump_requested_at)
    stacks = stacks_in(logs)
    flights = {rank: found for rank, text in logs.items() if (found := flight_records(text))}
    reason = attempt.end_reason or "hung"
    # A rank that could not even dump its stacks (stopped, stuck in the kernel) is the likely
    # culprit: when such ranks sit on one node, that node takes the strike.
    silent = attempt.allocations.exclude(rank__in=[int(r) for r in stacks]).select_related("node")
    silent_nodes = {a.node for a in silent}
    blame = silent_nodes.pop() if stacks and len(silent_nodes) == 1 else None
    silent_ranks = sorted(a.rank for a in silent)
    if stacks and silent_ranks:
        reason += f"; no stacks from rank(s) {', '.join(map(str, silent_ranks))}"
    # Else the one rank the evidence singles out (jobs/health.py): stopped or stuck in the
    # kernel by its process state; else behind its peers by the flight recorders' sequence
    # numbers; else somewhere other than where all the others wait by its stacks.
    odd = flight = None
    if not silent_ranks:
        odd = odd_rank_out({int(rank): text for rank, text in stacks.items()})
        flight = flight_recorder_verdict(flights)
    extra: dict = {"flight_recorder": {str(r): f for r, f in flights.items()}} if flights else {}
    # odd[2] is empty when its process state named the rank, which outranks the recorders.
    if odd is not None and (not odd[2] or flight is None):
        rank, frame, common = odd
        blame = attempt.allocations.select_related("node").get(rank=rank).node
        reason += (
            f"; rank {rank} on {blame.name} is in {frame} while the other ranks wait in {common}"
            if common
            else f"; rank {rank} on {blame.name} is {frame} and the other ranks wait for it"
        )
        extra |= {"odd_rank": rank, "odd_frame": frame, "common_frame": common}
    elif flight is not None:
        rank, why = flight
        blame = attempt.allocations.select_related("node").get(rank=rank).node
        reason += f"; rank {rank} on {blame.name} {why} (flight recorders)"
        extra |= {"odd_rank": rank, "flight_verdict": why}
    return do_end_attempt(
        attempt,
        state=Attempt.State.FAILED,
        now=now,
        reason=f"{reason} (stacks from {len(stacks)} of {world_size(attempt)} ranks)",
        failed_at=attempt.last_progress_at or attempt.running_at,
        blame_node=blame,
        data={"stacks": stacks, "silent_ranks": silent_ranks, **extra},
    )


@transaction.atomic
def do_flag_straggler(
    attempt: Attempt,
    *,
    rank: int,
    node: Node,
    seconds: float,
    gang_seconds: float,
    window: int,
    now: datetime,
    verdict: StragglerVerdict | None = None,
    ranks: list[int] | None = None,
    node_ranks: int = 0,
) -> None:
    """Flag the straggling ranks of one node, `ranks` (default: `rank` alone), measured by
    `rank`, the slowest of them (`seconds` of compute a step against the gang's
    `gang_seconds`): one Event with the arithmetic of `verdict` and one strike on the node,
    whatever the number of its ranks (several slow ranks on one node are one slow node). When
    the verdict says moving pays, hold the node out of scheduling until a health check passes
    and checkpoint-stop the job, which is requeued (no restart used) and starts on other
    nodes. `node_ranks`: how many ranks of the attempt the node runs."""
    # The node before the attempt: the order a heartbeat takes them in (no deadlock with the
    # straggler's own node reporting at this moment).
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    attempt = Attempt.objects.select_for_update(no_key=True).get(pk=attempt.pk)
    ranks = sorted({rank, *(ranks or ())})
    if any(r in attempt.stragglers for r in ranks):
        return  # flagged already (a check that raced this one)
    attempt.stragglers = [*attempt.stragglers, *ranks]
    attempt.save(update_fields=["stragglers"])
    who = f"rank {rank}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    pace = (
        f"{seconds * 1000:.0f} ms/step of compute vs {gang_seconds * 1000:.0f} ms for the rest "
        f"of the gang (median, last {window} steps)"
    )
    if len(ranks) == 1:
        message = f"{who} on {node.name} is a straggler: {pace}"
    else:
        whole = len(ranks) >= node_ranks > 0
        message = (
            f"{who} on {node.name} are stragglers"
            + (f" (every rank on {node.name}: the node is slow, not a rank)" if whole else "")
            + f": rank {rank} at {pace}"
        )
    if verdict is not None:
        message += f"; {verdict.text(node.name)}"
    arithmetic = asdict(verdict) if verdict is not None else {}
    record_event(
        EventKind.ATTEMPT_STRAGGLER,
        message,
        job_id=attempt.job_id,
        attempt=attempt,
        node=node,
        data={
            "rank": rank,
            "ranks": ranks,
            "compute_s": seconds,
            "gang_compute_s": gang_seconds,
            **arithmetic,
            "moved": bool(verdict and verdict.move),
        },
    )
    strike_node(node, f"job {attempt.job_id}: {message}", now=now)
    if verdict is None or not verdict.move:
        return
    do_hold_node(
        node,
        reason=f"straggler: {who} of job {attempt.job_id} ran "
        f"{seconds / max(gang_seconds, 1e-9):.1f}x slower than its gang",
        data={"job": attempt.job_id, "rank": rank, "ranks": ranks},
        now=now,
        recheck_later=True,
    )
    job, live = lock_job_for_stop(attempt.job_id)
    if live is None or live.id != attempt.id or live.state == Attempt.State.STOPPING:
        return
    stop_to_requeue(
        job,
        live,
        why=f"{STRAGGLER_REASON} {node.name} ({who})",
        now=now,
        kind=EventKind.JOB_PREEMPTING,
        data={"straggler": rank, "stragglers": ranks, "node": node.name},
    )


def record_image(attempt: Attempt, node: Node, image: dict) -> None:
    """The image an attempt's container ran on a node (first report wins: every node of a
    gang runs the same tag, and the job page shows one digest per attempt)."""
    attempt.image_digest = str(image["digest"])[:128]
    attempt.pull_s = max(float(image["pull_s"]), attempt.pull_s or 0.0)
    attempt.save(update_fields=["image_digest", "pull_s"])
    pulled = f", pulled in {attempt.pull_s:.1f} s" if attempt.pull_s >= 0.05 else ""
    record_event(
        EventKind.ATTEMPT_IMAGE,
        f"attempt {attempt.number} runs {attempt.job.image} ({attempt.image_digest[:19]}){pulled}",
        job_id=attempt.job_id,
        attempt=attempt,
        node=node,
        data={"digest": attempt.image_digest, "pull_s": attempt.pull_s},
    )


def note_pull(attempt: Attempt, node: Node, pull: dict) -> None:
    """An image pull under way for the attempt: its time so far is kept (the start timeout
    counts from the end of the pull; goodput shows it), with an event when it begins."""
    first = attempt.pull_s is None
    attempt.pull_s = max(float(pull["elapsed_s"]), attempt.pull_s or 0.0)
    attempt.save(update_fields=["pull_s"])
    if first:
        record_event(
            EventKind.ATTEMPT_IMAGE_PULL,
            f"attempt {attempt.number}: pulling {pull['image']} on {node.name}",
            job_id=attempt.job_id,
            attempt=attempt,
            node=node,
            data={"image": pull["image"], "detail": pull.get("detail", "")},
        )


def fail_at_start(attempt: Attempt, node: Node, error: dict, *, now: datetime) -> None:
    """The node could not start the attempt at all (its image is missing or its pull was
    refused): the job fails at once with the agent's message. No strike (the node did nothing
    wrong) and no restart (every node would fail the same way)."""
    do_end_attempt(
        attempt,
        state=Attempt.State.FAILED,
        now=now,
        reason=f"{error['kind']} error on {node.name}: {error['message']}",
        data={"error": error["kind"]},
        final=True,
    )
