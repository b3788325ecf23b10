"""Pure rules for failure detection: when a job counts as hung, which rank is a straggler, and
the checkpoint interval Young/Daly suggests. No I/O; the scheduler loop feeds them."""

from __future__ import annotations

import math
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


def young_daly_interval(save_stall_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal checkpoint interval: sqrt(2 x save stall x MTBF).

    Saving more often wastes time saving; less often wastes time recomputing after a failure.
    """
    return math.sqrt(2.0 * max(save_stall_s, 0.0) * max(mtbf_s, 0.0))
