"""What the hollow-node harness (bench/hollow.py) measures beside the load it makes: the CPU
and memory of each process, the scheduler's passes as the leader records them, and the
database's size on disk."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path


class ProcessSampler(threading.Thread):
    """CPU and memory of each process of the portal under load, by kind, from /proc: the
    portal's own processes (`pids`: name -> pid, with their children; "portal-2" counts as
    "portal") and, found by name, the
    database server's (every `postgres` process, summed) and Redis's. Started at the steady
    state, stopped with the load; `result()` gives per kind the cores used (CPU seconds over
    wall seconds) and the largest resident memory seen (MB)."""

    TICK = 1.0
    BY_NAME = {"postgres": "postgres", "redis-server": "redis"}

    def __init__(self, pids: dict[str, int], *, postgres: bool):
        super().__init__(daemon=True)
        self.pids = pids
        # The machine's PostgreSQL serves others too: counted only when the portal uses it.
        self.by_name = {k: v for k, v in self.BY_NAME.items() if postgres or v != "postgres"}
        self.halt = threading.Event()
        self.cpu: dict[str, float] = {}  # kind -> CPU seconds at the first sample
        self.last: dict[str, float] = {}
        self.rss: Counter = Counter()
        self.began = self.ended = 0.0

    def _kinds(self) -> dict[int, str]:
        # "portal-2" is a portal: several processes of one kind are summed
        kinds = {pid: name.split("-")[0] for name, pid in self.pids.items()}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            parent = int(stat[stat.rindex(")") + 2 :].split()[1])
            if name in self.by_name:
                kinds[int(entry.name)] = self.by_name[name]
            elif parent in kinds and int(entry.name) not in kinds:
                kinds[int(entry.name)] = kinds[parent]
        return kinds

    def _sample(self) -> tuple[dict[str, float], Counter]:
        ticks = os.sysconf("SC_CLK_TCK")
        page = os.sysconf("SC_PAGE_SIZE")
        cpu: dict[str, float] = defaultdict(float)
        rss: Counter = Counter()
        for pid, kind in self._kinds().items():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
            # utime and stime, plus the children's it reaped (cutime, cstime): PostgreSQL
            # forks a backend per connection, and without a pool each lives one request,
            # too short for a sample to see it alive.
            cpu[kind] += sum(int(f) for f in fields[11:15]) / ticks
            rss[kind] += resident * page
        return cpu, rss

    def run(self) -> None:
        self.began = time.monotonic()
        self.cpu, _ = self._sample()
        while not self.halt.wait(self.TICK):
            cpu, rss = self._sample()
            self.last, self.ended = cpu, time.monotonic()
            for kind, held in rss.items():
                self.rss[kind] = max(self.rss[kind], held)

    def result(self) -> dict[str, dict]:
        wall = max(1e-9, self.ended - self.began)
        return {
            kind: {
                "cores": round((self.last[kind] - self.cpu.get(kind, 0.0)) / wall, 3),
                "rss_mb": round(self.rss[kind] / 2**20, 1),
            }
            for kind in sorted(self.last)
        }


class PassSampler(threading.Thread):
    """Every scheduler pass the leader records (its duration and queue length, left in the
    shared cache for /metrics: jobs.scheduling.loop.record_pass), read twice a second."""

    def __init__(self, stats):  # bench.hollow.Stats
        super().__init__(daemon=True)
        self.stats, self.halt = stats, threading.Event()

    def run(self) -> None:
        from django.core.cache import cache

        from jobs.scheduling.loop import LAST_PASS_KEY

        while not self.halt.wait(0.5):
            try:
                last = cache.get(LAST_PASS_KEY)
            except Exception:  # noqa: BLE001 (a missed sample is a missed sample)
                continue
            if last:
                with self.stats.lock:
                    self.stats.passes[last["at"]] = last


def machine_probe_s(rounds: int = 3) -> float:
    """Seconds one core takes for a fixed loop of pure Python (the best of `rounds`): this
    shared machine's speed drifts by 1.5-2x within a day, so every run carries it and runs are
    compared only at a like probe (docs/production.md)."""
    best = float("inf")
    for _ in range(rounds):
        began, total = time.perf_counter(), 0
        for i in range(5_000_000):
            total += i
        best = min(best, time.perf_counter() - began)
    return round(best, 3)


def database_bytes(url: str, sqlite_path: Path | None) -> int:
    """The cluster database's size: PostgreSQL's pg_database_size, or the SQLite pages in use."""
    if url.startswith("postgres"):
        import psycopg

        with psycopg.connect(url.replace("postgres://", "postgresql://", 1)) as conn:
            return conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
    if sqlite_path is None or not sqlite_path.exists():
        return 0
    import sqlite3

    # Pages in use as a reader sees the database, the WAL's committed frames included (the
    # files shrink whenever the WAL is checkpointed).
    with sqlite3.connect(f"file:{sqlite_path}?mode=ro", uri=True) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
    return (pages - free) * size


def metric_tiers(url: str) -> dict | None:
    """Rows and bytes on disk (indexes included, as the live run left them: no VACUUM) of
    each metric tier (jobs/metric_store.py): rank 0's kept partition, every rank's raw time
    partitions, the rollups. bench/metric_storage.project() takes it to the flagship's
    month. PostgreSQL only (SQLite has no partitions): None elsewhere."""
    if not url.startswith("postgres"):
        return None
    import psycopg

    from jobs import metric_store

    def tier(conn, table: str, *, partitioned: bool) -> dict:
        rows = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        if partitioned:  # the parent holds nothing itself: its partitions, each with indexes
            sql = "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree(%s)"
        else:
            sql = "SELECT pg_total_relation_size(%s)"
        size = int(conn.execute(sql, [table]).fetchone()[0] or 0)
        return {"rows": rows, "bytes": size, "bytes_per_row": round(size / max(1, rows), 1)}

    with psycopg.connect(url.replace("postgres://", "postgresql://", 1)) as conn:
        out = {
            "kept": tier(conn, metric_store.KEPT, partitioned=False),
            "raw": tier(conn, metric_store.RANKS, partitioned=True),
            "rollup": tier(conn, "jobs_metricrollup", partitioned=False),
        }
    out["rollup_table_bytes_per_row"] = out["rollup"]["bytes_per_row"]
    return out


def logged_errors(work: Path, keep: int = 20) -> dict[str, int]:
    """The errors the cluster's processes logged (their logs die with the run's folder): each
    error line, and for a traceback its last line (the exception), with how often it came."""
    counts: dict[str, int] = defaultdict(int)
    for log in sorted(work.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if " ERROR " in line or line.startswith("Traceback"):
                end = i + 1
                while end < len(lines) and (lines[end][:1].isspace() or lines[end] == ""):
                    end += 1
                last = lines[end] if line.startswith("Traceback") and end < len(lines) else ""
                counts[f"{log.stem}: {(last or line)[-300:]}"] += 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:keep])
