"""Metric ingest cost: the portal CPU one agent heartbeat's step records take to store
(`jobs.actions.ingest.ingest_records`: raw points, dedupe against a resend, rollup buckets), for the
code as it is and for the code at a baseline git ref, interleaved in the same run, on SQLite
(the embedded default, a WAL file) and on PostgreSQL when DATABASE_URL is set.

Two heartbeat shapes, 1 s apart:
  toy    2 ranks x 20 steps x 4 metrics = 160 points: bench/overhead.py's tiny model at
         20 steps/s, the heartbeat whose cost showed up in that benchmark
  node   8 ranks x 1 step x 4 metrics = 32 points: an 8-GPU node whose ranks step once a
         second, what a large model's node sends

Each measurement is a child process on a fresh test database: one job and attempt, WARMUP
heartbeats, then HEARTBEATS timed ones, each in its own transaction (as do_heartbeat runs it);
process CPU time (user + system) and wall time per heartbeat. The child for the baseline runs
on `git archive REF` extracted to a temporary directory.

    .venv/bin/python bench/ingest.py [--ref a462a84] [--rounds 3] [--heartbeats 150]
    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/ingest.py
    # writes bench/results/ingest.json and docs/figures/ingest.png
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"toy": (2, 20), "node": (8, 1)}  # ranks, steps per rank per heartbeat
METRICS = ("loss", "tokens_per_s", "step_time_s", "compute_s")
WARMUP = 10


def child(shape: str, heartbeats: int) -> dict:
    """Runs in the tree whose code is measured (cwd), on a fresh test database."""
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction
    from django.utils import timezone

    from jobs.models import Attempt, MetricPoint
    from teams.actions import do_create_team
    from tests.heartbeats import submit

    try:
        from jobs.actions.ingest import ingest_records
    except ImportError:  # a ref from before jobs/actions.py became a package (e751ceb)
        from jobs.actions import ingest_records

    ranks, steps = SHAPES[shape]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        team = do_create_team("bench", quota=64)
        user = get_user_model().objects.create(username="bench")
        job = submit(team, user, gpus=ranks)  # through the real action, as the tests do
        attempt = Attempt.objects.create(
            job=job,
            number=1,
            state="running",
            master_addr="127.0.0.1",
            master_port=29400,
            created_at=timezone.now(),
            running_at=timezone.now(),
        )
        start = time.time()

        def records(beat: int) -> list[dict]:
            return [
                {
                    "kind": "step",
                    "rank": rank,
                    "step": step,
                    "time": start + step / steps,
                    "loss": 10.0 / (step + 1) + rank * 1e-3,
                    "tokens_per_s": 20_000.0 + rank,
                    "step_time_s": 1.0 / steps,
                    "compute_s": 0.8 / steps,
                }
                for step in range(beat * steps, (beat + 1) * steps)
                for rank in range(ranks)
            ]

        def heartbeat(beat: int) -> None:
            with transaction.atomic():
                locked = Attempt.objects.select_for_update().get(pk=attempt.pk)
                ingest_records(locked, records(beat), now=timezone.now())

        for beat in range(WARMUP):
            heartbeat(beat)
        cpu, wall = [], []
        for beat in range(WARMUP, WARMUP + heartbeats):
            c0, w0 = time.process_time(), time.perf_counter()
            heartbeat(beat)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        stored = MetricPoint.objects.filter(job=job).count()
        expected = (WARMUP + heartbeats) * ranks * steps * len(METRICS)
        assert stored == expected, (stored, expected)  # every point stored once
        return {
            "points_per_heartbeat": ranks * steps * len(METRICS),
            "cpu_ms_median": round(statistics.median(cpu) * 1000, 3),
            "cpu_ms_mean": round(statistics.fmean(cpu) * 1000, 3),
            "wall_ms_median": round(statistics.median(wall) * 1000, 3),
            "vendor": connection.vendor,
        }
    finally:
        connection.creation.destroy_test_db(
            connection.settings_dict["NAME"], verbosity=0, keepdb=False
        )


def extract(ref: str) -> tuple[str, Path]:
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", ref], capture_output=True, text=True, check=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", sha], capture_output=True, check=True
    ).stdout
    tmp = Path(tempfile.mkdtemp(prefix="lockstep-ingest-ref-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp, filter="data")
    return sha, tmp


def measure(tree: Path, shape: str, heartbeats: int, env: dict, tag: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", shape, str(heartbeats)],
        cwd=tree,
        env={**env, "LOCKSTEP_TEST_DB_NAME": f"ingest_bench_{tag}_{os.getpid()}"},
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"child failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def backends() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    # The embedded default: a SQLite file in WAL mode (its test database is a file beside it).
    sqlite_dir = Path(tempfile.mkdtemp(prefix="lockstep-ingest-sqlite-"))
    found = {"sqlite": {**env, "DATABASE_URL": f"sqlite:///{sqlite_dir}/portal.sqlite3"}}
    if os.environ.get("DATABASE_URL", "").startswith("postgres"):
        found["postgresql"] = {**env, "DATABASE_URL": os.environ["DATABASE_URL"]}
    return found


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted(summary)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    x = range(len(cells))
    width = 0.38
    base = [summary[c]["baseline_cpu_ms"] for c in cells]
    now = [summary[c]["current_cpu_ms"] for c in cells]
    ax.bar([i - width / 2 for i in x], base, width, label="baseline (model instances)")
    ax.bar([i + width / 2 for i in x], now, width, label="current (raw statements)")
    for i, c in enumerate(cells):
        ax.annotate(
            f"{summary[c]['speedup']:.1f}x",
            (i, max(base[i], now[i])),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_xticks(list(x), [c.replace("/", "\n") for c in cells])
    ax.set_ylabel("portal CPU ms per heartbeat (median)")
    ax.set_title("Metric ingest: CPU per agent heartbeat")
    ax.set_ylim(0, max(base + now) * 1.35)  # room for the labels and the legend
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]))))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--plot-only":  # redraw from the results file
        result = json.loads((ROOT / "bench" / "results" / "ingest.json").read_text())
        plot(result["summary"], ROOT / "docs" / "figures" / "ingest.png")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="a462a84", help="baseline git ref (default: a462a84)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--heartbeats", type=int, default=150)
    args = parser.parse_args()

    sha, ref_tree = extract(args.ref)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    runs = []
    try:
        for backend, env in backends().items():
            for shape in SHAPES:
                for number in range(args.rounds):
                    # Alternate which goes first, so drift in the machine's load hits both.
                    order = [("current", ROOT), ("baseline", ref_tree)]
                    for code, tree in order if number % 2 == 0 else order[::-1]:
                        result = measure(tree, shape, args.heartbeats, env, code)
                        runs.append(
                            {
                                "backend": backend,
                                "shape": shape,
                                "round": number,
                                "code": code,
                                **result,
                            }
                        )
                        print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(ref_tree, ignore_errors=True)

    summary = {}
    for backend in sorted({r["backend"] for r in runs}):
        for shape in SHAPES:
            cell = [r for r in runs if r["backend"] == backend and r["shape"] == shape]
            if not cell:
                continue

            def median(code, cell=cell):
                return statistics.median(r["cpu_ms_median"] for r in cell if r["code"] == code)

            points = cell[0]["points_per_heartbeat"]
            base, now = median("baseline"), median("current")
            summary[f"{backend}/{shape}"] = {
                "points_per_heartbeat": points,
                "baseline_cpu_ms": round(base, 2),
                "current_cpu_ms": round(now, 2),
                "speedup": round(base / now, 2),
                "points_per_cpu_s": {
                    "baseline": round(points / base * 1000),
                    "current": round(points / now * 1000),
                },
            }
            if shape == "node":
                # 512 nodes x 8 ranks stepping once a second: 512 such heartbeats a second.
                summary[f"{backend}/{shape}"]["portal_cores_for_512_nodes"] = {
                    "baseline": round(512 * base / 1000, 2),
                    "current": round(512 * now / 1000, 2),
                }
    result = {
        "benchmark": "metric ingest CPU per agent heartbeat (jobs.actions.ingest.ingest_records)",
        "commit": head,
        "baseline_ref": f"{args.ref} ({sha[:10]})",
        "rounds": args.rounds,
        "heartbeats_per_run": args.heartbeats,
        "warmup_heartbeats": WARMUP,
        "shapes": {k: {"ranks": r, "steps_per_rank": s} for k, (r, s) in SHAPES.items()},
        "cpu_count": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "summary": summary,
        "runs": runs,
    }
    out = ROOT / "bench" / "results" / "ingest.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(summary, ROOT / "docs" / "figures" / "ingest.png")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out} and docs/figures/ingest.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
