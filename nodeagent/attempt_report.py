"""What the agent tells the portal about one attempt in a heartbeat: its ranks' states, the new
lines of their metrics files and logs, what their framework wrote (TensorBoard scalars, saves),
whether a stack dump has shipped, and its image pull. Built from the files on disk, which are
the buffer: nothing is acknowledged (and dropped) until the portal has accepted the beat."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.saves import SaveWatcher
from nodeagent.scalars import ScalarTail
from nodeagent.stack_sampler import StackSampler
from nodeagent.tail import LogTail, MetricsTail
from nodeagent.workers import RankWorker

Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]


@dataclass
class RankTails:
    worker: RankWorker
    metrics: MetricsTail
    log: LogTail


@dataclass
class Tracked:
    """What the agent remembers about an attempt besides its processes."""

    tails: list[RankTails] = field(default_factory=list)
    # What frameworks write on their own: TensorBoard scalars of this node's ranks, and (on the
    # gang's first node) saves under the attempt's checkpoint directory.
    scalars: ScalarTail | None = None
    saves: SaveWatcher | None = None
    # Set once a successful heartbeat carried the exit of every rank and the last of its data.
    exit_reported: bool = False
    # Whether the ranks' stacks change, read while the attempt has reported no step.
    stacks: StackSampler | None = None
    steps_seen: bool = False
    # Each rank's log size once a stack dump had settled: `dumped` is reported when the logs
    # shipped reach these offsets, so the dump is in the same heartbeat or an earlier one.
    dump_log_ends: dict[int, int] | None = None
    # Heartbeats in a row whose report of it failed (nodeagent/heartbeat_body.py).
    report_failures: int = 0
    # Its refusal by the node (`error` of kind "health") has raised a failed check to cordon
    # the node (nodeagent/heartbeat_body.py), once.
    health_told: bool = False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def attempt_report(
    supervisor: Any, attempt_id: int, tracked: Tracked, log: Log
) -> tuple[dict[str, Any], list[tuple[Any, Any]], bool]:
    """(the attempt's report, the acks to apply if the beat is accepted, whether it carries
    the attempt's exit and the last of its data)."""
    acks: list[tuple[Any, Any]] = []
    # Exit states are read before the files, so everything a dead worker wrote is in
    # the files by the time they are read.
    all_exited = supervisor.all_exited(attempt_id)
    ranks = supervisor.status(attempt_id)
    # Likewise the dump is settled (written) before the log sizes it must reach are read.
    dump_settled = supervisor.dump_settled(attempt_id)
    if dump_settled and tracked.dump_log_ends is None:
        tracked.dump_log_ends = {rt.worker.rank: _size(rt.log.path) for rt in tracked.tails}
    records: list[dict[str, Any]] = []
    logs = []
    drained = True
    dump_shipped = dump_settled
    for rt in tracked.tails:
        final = not rt.worker.alive
        new_records, metrics_end = rt.metrics.read(final=final)
        text, log_end = rt.log.read(final=final)
        records.extend(new_records)
        tracked.steps_seen = tracked.steps_seen or any(r.get("kind") == "step" for r in new_records)
        if text:
            logs.append({"rank": rt.worker.rank, "text": text})
        acks += [(rt.metrics, metrics_end), (rt.log, log_end)]
        drained = drained and rt.metrics.at_eof and rt.log.at_eof
        if dump_shipped and tracked.dump_log_ends is not None:
            # A UTF-8 character cut at the end (3 bytes at most) is held back for the
            # next read; it cannot be part of the dump, so it does not hold `dumped` up.
            target = tracked.dump_log_ends[rt.worker.rank]
            dump_shipped = log_end + 3 >= target
    # What frameworks wrote: a job's files, read as root. Nothing in them may stop the
    # heartbeat (which would lose the node): a failure is logged and skipped.
    for reader in (tracked.scalars, tracked.saves):
        if reader is None:
            continue
        try:
            if reader is tracked.scalars:
                reader.discover(lambda a=attempt_id: supervisor.rank_pids(a), final=all_exited)
            else:
                reader.scan(final=all_exited)
            found, count = reader.read()
        except Exception:
            log.exception("attempt %s: reading what its framework wrote", attempt_id)
            continue
        records.extend(found)
        acks.append((reader, count))
        drained = drained and reader.at_eof
    if tracked.stacks is not None and not tracked.steps_seen and not all_exited:
        # A step-less script: a rank whose stack moved since the last reading is active.
        changed = tracked.stacks.tick(lambda a=attempt_id: supervisor.live_host_pids(a))
        for entry in ranks:
            if entry["rank"] in changed:
                entry["stack_changed"] = True
    report: dict[str, Any] = {
        "attempt_id": attempt_id,
        "ranks": ranks,
        "records": records,
        "logs": logs,
    }
    if dump_shipped:
        report["dumped"] = True
    workers = supervisor.get(attempt_id)
    if workers is not None and workers.error:
        report["error"] = workers.error
    if workers is not None and workers.pull is not None:
        report["pull"] = {
            "image": workers.pull.image,
            "elapsed_s": round(workers.pull.elapsed(), 1),
            "detail": workers.pull.detail(),
        }
    if workers is not None and workers.image_digest:
        report["image"] = {"digest": workers.image_digest, "pull_s": workers.pull_s}
    return report, acks, all_exited and drained
