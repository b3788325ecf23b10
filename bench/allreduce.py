"""Ring all-reduce (trainer/ring.py) against the backend's own, for N = 2..8 processes.

Per rank it measures the bytes the ring sent, two ways: the ring's own counter (RingStats) and
the kernel's count of bytes this process wrote (/proc/self/io wchar, which includes gloo's TCP
sends and its message headers), the latter also for dist.all_reduce; and the time of each
(median over reps after a warm-up, each rep timed on the slowest rank). Writes
bench/results/allreduce.json and docs/figures/allreduce.png (needs matplotlib, the `bench`
extra). Results and what they mean: docs/allreduce.md.

    python bench/allreduce.py                 # gloo on CPU, N = 2..8, 1/16/64 MiB (~5 min)
    python bench/allreduce.py --quick         # N = 2..4, 1 MiB, into *-quick.json/png
    python bench/allreduce.py --plot-only     # redraw the figure from the JSON
    python bench/allreduce.py --gpu           # NCCL, one GPU per rank (needs >= N GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.ring import RingStats, ring_all_reduce  # noqa: E402

RESULTS = REPO / "bench" / "results" / "allreduce.json"
FIGURE = REPO / "docs" / "figures" / "allreduce.png"
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bytes_written() -> int | None:
    """Bytes this process (all its threads) has passed to write-like syscalls, sockets included."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def delta_written(fn, counter=bytes_written) -> int | None:
    before = counter()
    fn()
    after = counter()
    return None if before is None or after is None else after - before


def worker(rank: int, n: int, port: int, cfg: dict, out: str) -> None:
    torch.set_num_threads(1)
    gpu = cfg["gpu"]
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if gpu else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=300),
        device_id=device if gpu else None,
    )
    rows = [measure(rank, n, size_mib, device, cfg["reps"]) for size_mib in cfg["sizes_mib"]]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(rank: int, n: int, size_mib: float, device: torch.device, reps: int) -> dict:
    """One buffer size on every rank; the row is complete on rank 0 only."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        """Seconds until the slowest rank finished, all ranks starting together."""
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine.item())

    numel = int(size_mib * MIB) // 4
    source = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
    ring_buf = source.clone()
    backend_buf = source.clone()

    # Correctness at this size, and the warm-up (connections, allocator) for both.
    ring_all_reduce(ring_buf)
    dist.all_reduce(backend_buf)
    torch.testing.assert_close(ring_buf, backend_buf, rtol=1e-4, atol=1e-3)

    # Bytes: one call each, on this rank. No OS count for NCCL: its traffic does not pass
    # through this process's syscalls.
    count_os = bytes_written if device.type == "cpu" else (lambda: None)
    stats = RingStats()
    dist.barrier()
    sync()
    ring_os = delta_written(lambda: (ring_all_reduce(ring_buf, stats=stats), sync()), count_os)
    dist.barrier()
    sync()
    backend_os = delta_written(lambda: (dist.all_reduce(backend_buf), sync()), count_os)
    mine = [stats.bytes_sent, -1 if ring_os is None else ring_os]
    mine.append(-1 if backend_os is None else backend_os)
    per_rank = torch.tensor(mine, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(per_rank) for _ in range(n)]
    dist.all_gather(gathered, per_rank)

    reps = reps if size_mib <= 16 else max(3, reps - 2)
    ring_s, backend_s = [], []
    for _ in range(reps):
        # Interleaved, so drift in the host's load falls on both alike.
        ring_s.append(timed(lambda: ring_all_reduce(ring_buf)))
        backend_s.append(timed(lambda: dist.all_reduce(backend_buf)))

    buf = numel * 4
    counted = [int(g[0]) for g in gathered]
    os_ring = [int(g[1]) for g in gathered]
    os_backend = [int(g[2]) for g in gathered]
    return {
        "n": n,
        "size_mib": size_mib,
        "buffer_bytes": buf,
        "ideal_ratio": 2 * (n - 1) / n,
        "ring_bytes_sent": counted,
        "ring_ratio_min": min(counted) / buf,
        "ring_ratio_max": max(counted) / buf,
        "ring_os_bytes_written": os_ring if min(os_ring) >= 0 else None,
        "backend_os_bytes_written": os_backend if min(os_backend) >= 0 else None,
        "reps": reps,
        "ring_s": ring_s,
        "backend_s": backend_s,
        "ring_s_median": statistics.median(ring_s),
        "backend_s_median": statistics.median(backend_s),
    }


def run_n(n: int, cfg: dict, tmp: Path) -> list[dict]:
    out = tmp / f"n{n}.json"
    # One thread per rank, as torchrun sets for several processes: N ranks on a couple of
    # cores would otherwise each start a thread per core.
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(worker, args=(n, free_port(), cfg, str(out)), nprocs=n, join=True)
    return json.loads(out.read_text())


def print_table(rows: list[dict]) -> None:
    print(
        f"{'N':>2} {'MiB':>4} {'2(N-1)/N':>8} {'ring sent/buf':>15} {'os ring':>8} "
        f"{'os gloo':>8} {'ring ms':>9} {'backend ms':>10} {'ratio':>6}"
    )
    for r in rows:
        buf = r["buffer_bytes"]
        os_ring = r["ring_os_bytes_written"]
        os_back = r["backend_os_bytes_written"]
        print(
            f"{r['n']:>2} {r['size_mib']:>4g} {r['ideal_ratio']:>8.4f} "
            f"{r['ring_ratio_min']:>7.4f}-{r['ring_ratio_max']:<7.4f} "
            f"{max(os_ring) / buf if os_ring else float('nan'):>8.4f} "
            f"{max(os_back) / buf if os_back else float('nan'):>8.4f} "
            f"{r['ring_s_median'] * 1e3:>9.1f} {r['backend_s_median'] * 1e3:>10.1f} "
            f"{r['ring_s_median'] / r['backend_s_median']:>6.2f}"
        )


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no figure", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sizes = sorted({r["size_mib"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))

    fine = [n / 10 for n in range(int(min(ns)) * 10, int(max(ns)) * 10 + 1)]
    left.plot(fine, [2 * (x - 1) / x for x in fine], color="gray", lw=1, label="2(N-1)/N")
    # The ratio hardly depends on the buffer size (the table has each), so every size goes
    # into one series per measurement; max over ranks, which differ by a few bytes when N does
    # not divide the length.
    series = [
        ("ring, counted (RingStats)", lambda r: r["ring_bytes_sent"], "o", "tab:blue", 70),
        ("ring, OS-measured (wchar)", lambda r: r["ring_os_bytes_written"], "+", "black", 50),
        (
            f"{result['config']['backend']} all_reduce, OS-measured",
            lambda r: r["backend_os_bytes_written"],
            "x",
            "tab:orange",
            30,
        ),
    ]
    for label, get, marker, color, size in series:
        sel = [r for r in rows if get(r)]
        if not sel:
            continue
        left.scatter(
            [r["n"] for r in sel],
            [max(get(r)) / r["buffer_bytes"] for r in sel],
            marker=marker,
            s=size,
            label=label,
            **({"facecolors": "none", "edgecolors": color} if marker == "o" else {"color": color}),
        )
    left.axhline(2, color="gray", lw=0.8, ls=":")
    left.set_xticks(ns)
    left.set_xlabel("processes N")
    left.set_ylabel("bytes sent per rank / buffer bytes")
    left.set_title("Bytes each rank sends")
    left.set_ylim(0, 2.05)
    left.legend(fontsize=7, loc="lower right")
    left.grid(alpha=0.3)

    colors = ["tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for s, c in zip(sizes, colors, strict=False):
        sel = [r for r in rows if r["size_mib"] == s]
        xs = [r["n"] for r in sel]
        right.plot(
            xs, [r["ring_s_median"] * 1e3 for r in sel], "o-", color=c, label=f"ring {s:g} MiB"
        )
        right.plot(
            xs,
            [r["backend_s_median"] * 1e3 for r in sel],
            "s--",
            color=c,
            alpha=0.7,
            label=f"{result['config']['backend']} all_reduce {s:g} MiB",
        )
    right.set_yscale("log")
    right.set_xticks(ns)
    right.set_xlabel("processes N")
    right.set_ylabel("median time per all-reduce (ms, slowest rank)")
    cores = result["config"]["cpu_count"]
    right.set_title(
        f"Time ({result['config']['backend']}, {cores} cores: N > {cores} is oversubscribed)"
    )
    right.legend(fontsize=7)
    right.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="2,3,4,5,6,7,8", help="process counts, comma-separated")
    ap.add_argument("--sizes-mib", default="1,16,64", help="float32 buffer sizes in MiB")
    ap.add_argument("--reps", type=int, default=5, help="timed reps (buffers > 16 MiB: 2 fewer)")
    ap.add_argument("--quick", action="store_true", help="N = 2..4, 1 MiB, 3 reps")
    ap.add_argument("--gpu", action="store_true", help="NCCL, rank i on cuda:i")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--figure", type=Path, default=FIGURE)
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()

    if args.plot_only:
        return 0 if plot(json.loads(args.out.read_text()), args.figure) else 1
    if args.quick:
        args.ns, args.sizes_mib, args.reps = "2,3,4", "1", 3
        # A smoke run must not overwrite the full run's results.
        if args.out == RESULTS:
            args.out = RESULTS.with_stem("allreduce-quick")
        if args.figure == FIGURE:
            args.figure = FIGURE.with_stem("allreduce-quick")
    ns = [int(x) for x in args.ns.split(",")]
    sizes = [float(x) for x in args.sizes_mib.split(",")]
    if args.gpu:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < max(ns):
            # NCCL refuses two ranks on one GPU, so --gpu cannot fake N ranks on fewer GPUs.
            print(
                f"--gpu needs one CUDA device per rank: N up to {max(ns)} but this host has "
                f"{have} (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})."
                " Lower --ns or run without --gpu.",
                file=sys.stderr,
            )
            return 2

    cfg = {"gpu": args.gpu, "sizes_mib": sizes, "reps": args.reps}
    tmp = args.out.parent / ".allreduce-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.monotonic()
    started_utc = datetime.now(UTC).isoformat(timespec="seconds")
    for n in ns:
        t0 = time.monotonic()
        rows.extend(run_n(n, cfg, tmp))
        print(f"N={n}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()

    result = {
        "config": {
            "backend": "nccl" if args.gpu else "gloo",
            "dtype": "float32",
            "ns": ns,
            "sizes_mib": sizes,
            "reps": args.reps,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "started_utc": started_utc,
            "wall_s": round(time.monotonic() - started, 1),
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows)
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    if plot(result, args.figure):
        print(f"wrote {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
