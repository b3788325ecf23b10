"""An attempt's layout beside what it measured: the job page's "Layout" table and the API's
`layout_report`. The trainer's `layout` record (trainer/layout.py) carries the prediction and
each rank's state bytes (jobs/actions/ingest.py keeps the largest); the step time measured is
the median of rank 0's step times, the first step (warm-up) left out.
"""

from __future__ import annotations

import statistics

from jobs.models import Attempt, MetricPoint

# Steps whose times are read for the median: the latest ones, so a long run costs no more.
STEP_SAMPLE = 200


def measured_step_s(attempt: Attempt) -> float | None:
    times = list(
        MetricPoint.objects.filter(
            job_id=attempt.job_id, attempt=attempt, rank=0, name="step_time_s"
        )
        .exclude(step__lte=attempt.resumed_from_step + 1)
        .order_by("-step")
        .values_list("value", flat=True)[:STEP_SAMPLE]
    )
    return statistics.median(times) if times else None


def text(value: float | None, unit: str) -> str:
    """A cell: bytes in KiB/MiB/GiB, seconds in ms or s, or a dash."""
    if value is None:
        return "—"
    if unit == "bytes":
        for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= scale:
                return f"{value / scale:,.2f} {name}"
        return f"{value:,.0f} B"
    return f"{value * 1000:,.1f} ms" if value < 10 else f"{value:,.1f} s"


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def report(attempt: Attempt) -> dict | None:
    """{"shape", "how", "reasons", "rows": [{"what", "predicted", "measured", "unit",
    "ratio"}]} or None when the attempt's trainer sent no layout (another script)."""
    chosen = (attempt.layout or {}).get("chosen")
    if not chosen:
        return None
    measured = attempt.layout.get("measured_max") or {}
    resident = chosen.get("predicted_resident_bytes") or {}
    peak = chosen.get("predicted_bytes") or {}
    times = chosen.get("predicted_time") or {}
    rows = []
    parts = (("weights", "weights"), ("grads", "gradients"), ("optimizer", "optimizer state"))
    for part, label in parts:
        rows.append(
            {
                "what": f"{label} per GPU, between steps",
                "predicted": resident.get(part),
                "measured": measured.get(part),
                "unit": "bytes",
            }
        )
    rows.append(
        {
            "what": "per GPU at the step's peak (with activations and overhead)",
            "predicted": peak.get("total"),
            # Only CUDA's allocator knows a peak; a CPU rank's activations are not measured.
            "measured": measured.get("cuda_peak_allocated"),
            "unit": "bytes",
        }
    )
    step = measured_step_s(attempt)
    rows.append(
        {"what": "step time", "predicted": times.get("total_s"), "measured": step, "unit": "s"}
    )
    for key, label in (
        ("compute_s", "compute"),
        ("exposed_comm_s", "exposed communication"),
        ("bubble_s", "pipeline bubble"),
    ):
        rows.append(
            {"what": f"of which {label}", "predicted": times.get(key), "measured": None,
             "unit": "s"}
        )  # fmt: skip
    for row in rows:
        row["ratio"] = _ratio(row["measured"], row["predicted"])
        row["predicted_text"] = text(row["predicted"], row["unit"])
        row["measured_text"] = text(row["measured"], row["unit"])
    shape = (
        f"pp {int(chosen.get('pp', 1))} × dp {int(chosen.get('dp', 1))} × "
        f"tp {int(chosen.get('tp', 1))}"
    )
    return {
        "attempt": attempt.number,
        "shape": shape,
        "mode": chosen.get("mode", ""),
        "schedule": _schedule(chosen),
        "how": chosen.get("how", ""),
        "micro_batches": chosen.get("micro_batches"),
        "hardware": chosen.get("hardware", ""),
        "reasons": chosen.get("reasons", []),
        "ranks_measured": attempt.layout.get("ranks", 0),
        "rows": rows,
    }


def _schedule(chosen: dict) -> str:
    """The pipeline schedule as the job page names it: "interleaved (2 stages per rank)"."""
    schedule = chosen.get("pp_schedule", "")
    stages = int(chosen.get("stages_per_rank") or 1)
    return f"{schedule} ({stages} stages per rank)" if schedule and stages > 1 else schedule
