"""The scheduler pass and Python's garbage collector at the target's size: 512 nodes x 8 GPUs
filled by the real plan/apply, 10,000 jobs queued (bench/snapshot_read.py's database), and the
pass's two CPU phases, the snapshot read (with the leader's memos) and plan(), timed round by
round under three collector settings, in turn:

- `automatic`: Python's default thresholds, as every pass ran before;
- `paused`: the collector off for the pass and one full collection after it, off the pass's
  clock (what jobs/scheduling/loop.py does now; the collection's own time is reported);
- `frozen`: the objects alive after the first pass frozen out of collections, collector on.

Each round first changes `--churn` queued rows, as a busy cluster does between passes.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/pass_collector.py
    # --rounds 12; writes bench/results/pass-collector.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODES = ("automatic", "paused", "frozen")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--teams", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--churn", type=int, default=50)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pass-collector.json"))
    args = parser.parse_args()
    args.history_days = 0.0
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ.setdefault("LOCKSTEP_TEST_DB_NAME", f"pass_collector_{os.getpid()}")
    import django

    django.setup()
    from django.db import connection
    from django.utils import timezone

    from bench.snapshot_read import _churn, _fill
    from jobs.scheduling import reader
    from jobs.scheduling.policy import plan

    test_db = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        filled = _fill(args)
        usage, queue = reader.UsageMemo(), reader.QueueMemo()
        plan(reader.take_snapshot(timezone.now(), usage, queue))  # the term's first pass
        times = {mode: {"snapshot": [], "plan": [], "collect": []} for mode in MODES}
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 else MODES[::-1]
            for mode in order:
                _churn(args.churn)
                gc.collect()
                if mode == "frozen":
                    gc.freeze()
                if mode == "paused":
                    gc.disable()
                began = time.perf_counter()
                snapshot = reader.take_snapshot(timezone.now(), usage, queue)
                read = time.perf_counter()
                plan(snapshot)
                planned = time.perf_counter()
                gc.enable()
                if mode == "paused":
                    gc.collect()
                    times[mode]["collect"].append(round(time.perf_counter() - planned, 4))
                gc.unfreeze()
                times[mode]["snapshot"].append(round(read - began, 4))
                times[mode]["plan"].append(round(planned - read, 4))
    finally:
        connection.creation.destroy_test_db(test_db, verbosity=0)
    summary = {
        mode: {
            "snapshot_p50_s": statistics.median(t["snapshot"]),
            "plan_p50_s": statistics.median(t["plan"]),
            "pass_p50_s": statistics.median(
                a + b for a, b in zip(t["snapshot"], t["plan"], strict=True)
            ),
            "pass_max_s": max(a + b for a, b in zip(t["snapshot"], t["plan"], strict=True)),
            "collect_after_p50_s": statistics.median(t["collect"]) if t["collect"] else None,
        }
        for mode, t in times.items()
    }
    result = {
        **filled,
        "nodes": args.nodes,
        "rounds": args.rounds,
        "churn": args.churn,
        "summary": summary,
        "times_s": times,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
