"""The overlap bench's trace accounting (bench/overlap.py): the events of a torch.profiler
Chrome trace, interval arithmetic on them, and `analyze`, which splits each profiled step's
communication into the part hidden behind the main thread's compute and the part exposed. The
rules (what counts as communication, as compute, as a wait for the peer rank) are set out in
bench/overlap.py's docstring. Plain Python: no torch, so the accounting is testable on its own."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

# The record_function marks the benchmark puts around each step and its phases.
MARK = "overlap::"
STEP, PHASES = MARK + "step", ("forward", "backward", "optimizer")
# Events that are communication: ProcessGroupGloo names each collective's work "gloo:<op>".
COMM_PREFIXES = ("gloo:",)
# Operators on the main thread that launch or wait for communication: never compute.
COMM_OP_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:")
# Frames whose self time can be a Python-level wait for a collective (FSDP2's synchronous
# all-gather waits in Python, between its operators, inside these record_functions).
WAIT_FRAMES = ("FSDP::",)


class Ev(NamedTuple):
    """One complete event of a trace, times in microseconds."""

    name: str
    tid: int | str
    start: float
    end: float


Intervals = list[tuple[float, float]]


def union(iv: Iterable[tuple[float, float]]) -> Intervals:
    out: Intervals = []
    for a, b in sorted(iv):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(x: Intervals, y: Intervals) -> Intervals:
    """Of two unions (sorted, disjoint)."""
    out: Intervals = []
    i = j = 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: Intervals, y: Intervals) -> Intervals:
    """x minus y, both unions."""
    out: Intervals = []
    j = 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append((cur, y[k][0]))
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def length(iv: Intervals) -> float:
    return sum(b - a for a, b in iv)


def clip(iv: Intervals, lo: float, hi: float) -> Intervals:
    return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]


def self_intervals(events: Sequence[Ev]) -> list[tuple[Ev, Intervals]]:
    """Each event of one thread with its self time: its interval less its children's (the
    events nested in it). An operator's self time is the work it did itself: aten::addmm's
    matmul, not the aten::expand and aten::copy_ it calls."""
    ordered = sorted(events, key=lambda e: (e.start, -e.end))
    children: list[list[tuple[float, float]]] = [[] for _ in ordered]
    stack: list[int] = []
    for i, e in enumerate(ordered):
        while stack and ordered[stack[-1]].end <= e.start:
            stack.pop()
        # Events of one thread nest; one that crosses the end of the open one is not its child.
        if stack and e.end <= ordered[stack[-1]].end:
            children[stack[-1]].append((e.start, e.end))
        stack.append(i)
    return [
        (e, subtract([(e.start, e.end)], union(kids)))
        for e, kids in zip(ordered, children, strict=True)
    ]


def is_comm_op(name: str) -> bool:
    return name.startswith(COMM_OP_PREFIXES) or "wait" in name.lower()


def is_compute(name: str) -> bool:
    """Whether an event's self time on the main thread is compute."""
    return not (is_comm_op(name) or name.startswith(WAIT_FRAMES) or name.startswith(MARK))


def events_from_chrome_trace(path: Path | str) -> list[Ev]:
    """The complete ("X") events of a torch.profiler Chrome trace."""
    trace = json.loads(Path(path).read_text())
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start = float(e["ts"])
        out.append(Ev(e["name"], e.get("tid", 0), start, start + float(e["dur"])))
    return out


def _account(comm: Intervals, busy: Intervals, lo: float, hi: float) -> dict:
    c = clip(comm, lo, hi)
    hidden = length(intersect(c, clip(busy, lo, hi)))
    total = length(c)
    return {
        "comm_us": total,
        "hidden_us": hidden,
        "exposed_us": total - hidden,
        "share": hidden / total if total > 0 else None,
    }


def step_marks(events: Sequence[Ev]) -> list[Ev]:
    return sorted((e for e in events if e.name == STEP), key=lambda e: e.start)


def collectives_by_step(events: Sequence[Ev]) -> list[list[tuple[float, float]]]:
    """Per step, this rank's collectives (start, end) in the order they started."""
    comm = sorted((e.start, e.end) for e in events if e.name.startswith(COMM_PREFIXES))
    return [[c for c in comm if s.start <= c[0] < s.end] for s in step_marks(events)]


def closed_by_phase(comm: Sequence[Ev], windows: Sequence[Ev]) -> tuple[list[Ev], list]:
    """The collectives, each ended no later than the end of the innermost window (phase, else
    step) in which it started; and (collective, microseconds cut) for those shortened.

    Every mode here waits for a collective in the phase that started it (DDP's end-of-backward
    wait for all buckets, FSDP2's unit hooks and synchronous reduce-scatter, the clip's
    wait_tensor), so by the phase's end it is complete. Its trace event can close later: gloo
    completes the collective's future (which wakes the waiting main thread) before the worker
    thread ends the event, and on busy cores that worker may get a core again only
    milliseconds later. Without the cut such a tail would count as communication hidden behind
    the next phase's compute."""
    out, cut = [], []
    for e in comm:
        inside = [w for w in windows if w.start <= e.start < w.end]
        if inside:
            end = min(w.end for w in inside)
            if e.end > end:
                cut.append((e, e.end - end))
                e = e._replace(end=end)
        out.append(e)
    return out, cut


def peer_waits(own: list[tuple[float, float]], peers: list[list[tuple[float, float]]]) -> Intervals:
    """The part of each of this rank's collectives spent before the last rank joined it.

    Every rank runs the same collectives in the same order, so the i-th to start here is the
    i-th to start on each peer (the ranks share the host's clock). A collective cannot move
    data before every rank has entered it: from its start here to the latest start among the
    peers, this rank only waits for a slower rank (load imbalance, not the network)."""
    out = []
    for i, (a, b) in enumerate(own):
        last = max([a] + [p[i][0] for p in peers if i < len(p)])
        out.append((a, min(b, last)))
    return union(out)


def analyze(
    events: Sequence[Ev],
    gap_us: float = 100.0,
    peers: Sequence[Sequence[list[tuple[float, float]]]] = (),
) -> list[dict]:
    """Per profiled step (an `overlap::step` event): step length, communication time, and the
    parts of it hidden behind the main thread's compute and exposed, also per phase.

    The main thread is the one with the step marks; communication is every COMM_PREFIXES event
    on any thread. `peers`: each other rank's `collectives_by_step`, to split off the time a
    collective waited for a slower rank (`peer_wait_us`, and the exposed part of it). All times
    in microseconds."""
    steps = step_marks(events)
    if not steps:
        raise ValueError(f"no {STEP} events in the trace")
    tids = {e.tid for e in steps}
    if len(tids) != 1:
        raise ValueError(f"{STEP} events on several threads: {tids}")
    main = tids.pop()
    on_main = [e for e in events if e.tid == main]
    phase_marks = {p: [e for e in events if e.name == MARK + p] for p in PHASES}
    comm_events, cut = closed_by_phase(
        [e for e in events if e.name.startswith(COMM_PREFIXES)],
        [m for marks in phase_marks.values() for m in marks] + steps,
    )
    comm = union((e.start, e.end) for e in comm_events)
    comm_ops = union((e.start, e.end) for e in on_main if is_comm_op(e.name))
    work = union(iv for e, own in self_intervals(on_main) if is_compute(e.name) for iv in own)
    # Short gaps between two compute operators are the interpreter between ops: busy, unless
    # a communication operator is running there (a short synchronous collective is a wait).
    gaps = [(a[1], b[0]) for a, b in zip(work, work[1:], strict=False) if b[0] - a[1] < gap_us]
    busy = union(work + subtract(union(gaps), comm_ops))
    ordered = sorted(comm_events, key=lambda e: e.start)
    own = [[(e.start, e.end) for e in ordered if s.start <= e.start < s.end] for s in steps]
    out = []
    for k, s in enumerate(steps):
        row = {
            "step_us": s.end - s.start,
            "busy_us": length(clip(busy, s.start, s.end)),
            "collectives": sum(1 for e in comm_events if s.start <= e.start < s.end),
            "tail_cut_us": sum(c for e, c in cut if s.start <= e.start < s.end),
            "comm_sum_us": sum(
                min(e.end, s.end) - max(e.start, s.start)
                for e in comm_events
                if e.end > s.start and e.start < s.end
            ),
            **_account(comm, busy, s.start, s.end),
            "peer_wait_us": None,
            "exposed_peer_wait_us": None,
            "phases": {},
        }
        theirs = [p[k] for p in peers if k < len(p)]
        if theirs and all(len(t) == len(own[k]) for t in theirs):
            wait = clip(peer_waits(own[k], theirs), s.start, s.end)
            row["peer_wait_us"] = length(wait)
            row["exposed_peer_wait_us"] = length(subtract(wait, busy))
        for p, marks in phase_marks.items():
            inside = [m for m in marks if m.start >= s.start and m.end <= s.end]
            if inside:
                m = inside[0]
                row["phases"][p] = _account(comm, busy, m.start, m.end)
                row["phases"][p]["collectives"] = sum(
                    1 for e in comm_events if m.start <= e.start < m.end
                )
        out.append(row)
    return out
