"""Pure rules for failure detection: when a job counts as hung, which rank is a straggler, whether
moving a job off a straggler pays, and the checkpoint interval Young/Daly suggests. No I/O; the
scheduler loop feeds them."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from statistics import median


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def progress_timeout(step_times: list[float], *, minimum: float, factor: float) -> float:
    """Seconds without a step after which a running job is hung: max(minimum, factor x p95).

    Adapts to the job: a 30 s/step 70B job is not declared hung after a minute, and a 50 ms/step
    job is not left stuck for the 10 to 30 minutes of stock NCCL timeouts.
    """
    if not step_times:
        return minimum
    return max(minimum, factor * percentile(step_times, 0.95))


def find_stragglers(
    compute_by_rank: dict[int, list[float]], *, factor: float, min_excess: float
) -> list[tuple[int, float, float]]:
    """Ranks whose median compute time exceeds the rest of the gang's by `factor` (and by at
    least `min_excess` seconds, so noise on tiny steps is not flagged): (rank, own, others)."""
    medians = {rank: median(times) for rank, times in compute_by_rank.items() if times}
    flagged = []
    for rank, own in sorted(medians.items()):
        others = [m for r, m in medians.items() if r != rank]
        if not others:
            continue
        rest = median(others)
        if own > factor * rest and own - rest >= min_excess:
            flagged.append((rank, own, rest))
    return flagged


@dataclass(frozen=True)
class StragglerVerdict:
    """Whether to move a job off its straggler's node, and the arithmetic behind it."""

    move: bool
    excess_s: float  # the slow rank's extra time per step (its compute over the gang's)
    step_time_s: float  # the gang's step time now, at the slow rank's pace
    remaining_s: float  # the job's remaining run time, estimated at that pace
    slowdown_s: float  # what staying costs: remaining steps x excess
    restart_s: float  # what moving costs: a checkpoint-stop and a start elsewhere
    blocker: str = ""  # why it stays although moving would pay

    def text(self, node: str) -> str:
        sums = (
            f"staying costs ~{self.slowdown_s:.0f} s ({self.excess_s * 1000:.0f} ms on each "
            f"{self.step_time_s * 1000:.0f} ms step over the ~{self.remaining_s:.0f} s left) "
            f"against ~{self.restart_s:.0f} s for a restart"
        )
        if self.move:
            return f"{sums}: moving the job off {node}"
        return f"{sums}: keeping it" + (f" ({self.blocker})" if self.blocker else "")


def straggler_verdict(
    *,
    excess_s: float,
    step_time_s: float,
    remaining_s: float,
    restart_s: float,
    spare: bool,
    moves_left: bool,
) -> StragglerVerdict:
    """Under data parallelism every step waits for the slowest rank, so each remaining step
    costs `excess_s` more than it would without it: over `remaining_s` at the current pace,
    remaining_s / step_time_s steps. Moving costs one restart (its checkpoint-stop and start-up,
    as measured for this job). Move only when that pays, a node is free to move to, and the
    job was not moved off a straggler already (the slowness may be the rank's, not the node's:
    a second move would not help)."""
    step = max(step_time_s, 1e-6)
    slowdown = max(remaining_s, 0.0) * max(excess_s, 0.0) / step
    pays = slowdown > restart_s
    blocker = ""
    if pays and not spare:
        blocker = "no free node to move to"
    elif pays and not moves_left:
        blocker = "moved off a straggler before"
    return StragglerVerdict(
        move=pays and not blocker,
        excess_s=excess_s,
        step_time_s=step_time_s,
        remaining_s=remaining_s,
        slowdown_s=slowdown,
        restart_s=restart_s,
        blocker=blocker,
    )


def young_daly_interval(save_stall_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal checkpoint interval: sqrt(2 x save stall x MTBF).

    Saving more often wastes time saving; less often wastes time recomputing after a failure.
    """
    return math.sqrt(2.0 * max(save_stall_s, 0.0) * max(mtbf_s, 0.0))


_PY_SPY_FRAME = re.compile(r"^\s{4}(\S.*?) \((\S+?\.py):\d+\)\s*$")
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "([^"]+)", line \d+ in (\S+)')


def innermost_frame(stack: str) -> str | None:
    """`function (file)` of the innermost Python frame of a rank's main thread, from py-spy's
    dump (preferred: it is read from outside) or else faulthandler's; None if neither parses.
    Native frames (py-spy --native) are skipped: two ranks waiting in one collective may sit in
    different native calls (a poll, a futex) but in the same Python line."""
    lines = stack.splitlines()
    marker = next((i for i, line in enumerate(lines) if "read from outside (py-spy" in line), None)
    if marker is not None:
        threads = [i for i in range(marker, len(lines)) if lines[i].startswith("Thread ")]
        main = next(
            (i for i in threads if '"MainThread"' in lines[i]), threads[0] if threads else None
        )
        for line in lines[(main or marker) + 1 :]:
            if line.startswith("Thread ") or line.startswith("lockstep agent:"):
                break
            if found := _PY_SPY_FRAME.match(line):
                return f"{found.group(1)} ({found.group(2).rsplit('/', 1)[-1]})"
    current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    for line in lines[current + 1 :] if current is not None else ():
        if found := _FAULTHANDLER_FRAME.match(line):
            return f"{found.group(2)} ({found.group(1).rsplit('/', 1)[-1]})"
        if not line.startswith(" "):
            break
    return None


_PROCESS_STATE = re.compile(r"read from outside \(py-spy dump\), process state (\S)")
# Scheduler states that are a rank's own condition, not a wait on its peers.
STUCK_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "D": "stuck in the kernel"}


def odd_rank_out(stacks: dict[int, str]) -> tuple[int, str, str] | None:
    """The one rank that is not where the others are: (rank, where it is, where they are;
    '' when it is told apart by its process state).

    First by process state (read by the agent beside each stack): exactly one rank stopped or
    in uninterruptible sleep while the others are not is the culprit, whatever its stack says
    (a rank frozen inside its backward pass shows the same Python frame as its peers waiting
    there for its gradients). Else by stack: the one rank whose main thread is somewhere else
    than every other rank's, which all share one innermost frame (they wait in a collective
    that rank never joined). None unless at least two others agree and exactly one rank
    differs: with two ranks, or a split, there is no telling which side is wrong."""
    states = {
        rank: m.group(1) for rank, text in stacks.items() if (m := _PROCESS_STATE.search(text))
    }
    stuck = [rank for rank, state in states.items() if state in STUCK_STATES]
    if len(stuck) == 1 and len(states) >= 3:
        rank = stuck[0]
        return rank, STUCK_STATES[states[rank]], ""
    frames = {rank: innermost_frame(text) for rank, text in stacks.items()}
    frames = {rank: frame for rank, frame in frames.items() if frame}
    if len(frames) < 3:
        return None
    ((common, _),) = Counter(frames.values()).most_common(1)
    odd = [rank for rank, frame in frames.items() if frame != common]
    # With at least three frames, one odd rank leaves two or more agreeing on `common`.
    return (odd[0], frames[odd[0]], common) if len(odd) == 1 else None


# The agent's line per rank: its flight recorder's summary (nodeagent/flight_recorder.py).
_FLIGHT_LINE = re.compile(r"^lockstep agent: flight recorder of rank (\d+): (\{.*\})\s*$", re.M)


def flight_records(text: str) -> dict | None:
    """The last flight-recorder summary in a rank's log text, or None."""
    found = None
    for match in _FLIGHT_LINE.finditer(text):
        try:
            found = json.loads(match.group(2))
        except ValueError:
            continue
    return found if isinstance(found, dict) else None


def _collective(group: dict) -> str:
    last = group.get("last") or {}
    sizes = last.get("sizes")
    return f"{last.get('op') or 'a collective'}{f' of {sizes}' if sizes else ''}"


def flight_recorder_verdict(records: dict[int, dict]) -> tuple[int, str] | None:
    """The rank the flight recorders blame, and why in words; None if they do not single one
    out.

    Per process group, among the ranks whose recorders know it: the ranks that entered the
    group's latest collective (sequence number M) and wait in it, and the ranks behind (their
    last is below M). Exactly one rank behind while others wait is the one they wait for: it
    never joined. All at M but with different kinds or sizes at M is a mismatched collective,
    and the one rank that differs from the rest is named. Unlike the stacks, this needs no third
    rank to break a tie: the sequence numbers say who is behind. Groups are read in id order
    (the default group first); the first that names a rank decides."""
    groups: dict[str, dict[int, dict]] = {}
    for rank, record in records.items():
        for pg_id, group in (record.get("groups") or {}).items():
            if isinstance(group, dict) and isinstance(group.get("entered"), int):
                groups.setdefault(str(pg_id), {})[rank] = group
    for pg_id in sorted(groups, key=lambda g: (len(g), g)):
        by_rank = groups[pg_id]
        if len(by_rank) < 2:
            continue
        latest = max(g["entered"] for g in by_rank.values())
        waiting = sorted(
            r
            for r, g in by_rank.items()
            if g["entered"] == latest and g.get("completed", -1) < latest
        )
        behind = sorted(r for r, g in by_rank.items() if g["entered"] < latest)
        name = next((g.get("desc") for g in by_rank.values() if g.get("desc")), "") or pg_id
        if waiting and len(behind) == 1:
            rank = behind[0]
            mine, theirs = by_rank[rank], by_rank[waiting[0]]
            ranks = ", ".join(map(str, waiting))
            return rank, (
                f"never entered collective #{latest} ({_collective(theirs)}) of process group "
                f"{name} that rank(s) {ranks} wait in; its last was #{mine['entered']}"
            )
        if waiting and not behind and len(waiting) >= 2:
            kinds = {
                r: _collective(g)
                for r, g in by_rank.items()
                if (g.get("last") or {}).get("seq") == latest
            }
            counts = Counter(kinds.values())
            if len(counts) == 2:
                (common, _), (odd_kind, odd_count) = counts.most_common(2)
                # With two ranks there is no telling which of the two is wrong.
                if odd_count == 1 and len(kinds) >= 3:
                    rank = next(r for r, k in kinds.items() if k == odd_kind)
                    return rank, (
                        f"called {odd_kind} as collective #{latest} of process group {name} "
                        f"where the other rank(s) called {common} (a mismatched collective)"
                    )
    return None
