"""What the overlap bench (bench/overlap.py) sweeps: the settings (DDP bucket sizes, FSDP2
prefetch), the plan of model sizes, step counts and rounds, and which rounds count as clean
(run while other processes left the host's CPUs to the ranks)."""

from __future__ import annotations

from dataclasses import dataclass

WORLD = 2
VOCAB = 256  # a byte-level vocabulary, as a text file dataset has


# --- the settings swept ----------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One configuration of the sweep."""

    name: str
    mode: str  # ParallelArgs.mode: ddp, fsdp or fsdp-noreshard
    bucket_cap_mb: float = 25.0
    sync: bool = True  # False: DDP no_sync on every step, the compute-only baseline
    prefetch: int = 0  # explicit FSDP2 forward/backward prefetch depth; 0: FSDP2's implicit
    async_unshard: bool = False  # FSDPModule._set_unshard_async_op(True)

    @property
    def label(self) -> str:
        if self.mode == "ddp":
            return "ddp no sync" if not self.sync else f"ddp {self.bucket_cap_mb:g} MiB"
        how = "implicit" if self.prefetch == 0 else f"explicit {self.prefetch}"
        return f"{self.mode} {how}" + (" async" if self.async_unshard else "")


DDP_BUCKETS_MB = (0.05, 0.25, 1.0, 3.0, 6.0, 25.0)


def full_settings() -> list[Setting]:
    out = [Setting("ddp-nosync", "ddp", sync=False)]
    out += [Setting(f"ddp-{b:g}", "ddp", bucket_cap_mb=b) for b in DDP_BUCKETS_MB]
    for mode in ("fsdp", "fsdp-noreshard"):
        out.append(Setting(f"{mode}-implicit", mode))
        if mode == "fsdp":
            # Explicit prefetch alone: on CPU the prefetched all-gather still blocks.
            out.append(Setting(f"{mode}-explicit1", mode, prefetch=1))
        out.append(Setting(f"{mode}-implicit-async", mode, async_unshard=True))
        out.append(Setting(f"{mode}-explicit1-async", mode, prefetch=1, async_unshard=True))
        out.append(Setting(f"{mode}-explicit2-async", mode, prefetch=2, async_unshard=True))
    return out


def quick_settings() -> list[Setting]:
    keep = {"ddp-nosync", "ddp-1", "ddp-25", "fsdp-implicit", "fsdp-explicit1-async"}
    return [s for s in full_settings() if s.name in keep]


@dataclass(frozen=True)
class Plan:
    """Sizes and lengths of a run."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    block_size: int = 32
    batch_size: int = 16  # sequences per rank per step
    warmup: int = 3
    timed: int = 6  # unprofiled steps: the step time
    profiled: int = 3  # steps under the profiler: the overlap accounting
    rounds: int = 5  # every setting once per round, rounds interleaved against drift
    gap_us: float = 100.0
    trace_dir: str = ""  # keep each rank's Chrome trace here (empty: delete them)
    retry_s: float = 150.0  # at most this long for extra rounds of settings short of clean ones


# --- clean rounds ----------------------------------------------------------------------------


FOREIGN_MAX = 0.10  # a round run while other processes used more of the CPUs is left out


MIN_CLEAN = 2  # rounds per setting to run again for, on a host shared with other work


def n_clean(rows: list[dict], name: str) -> int:
    return sum(
        1 for r in rows if r["setting"] == name and r.get("foreign_cpu_share", 0) <= FOREIGN_MAX
    )


def clean_rows(raw: dict, name: str) -> tuple[list[dict], str]:
    """The setting's rounds run with the host to the ranks alone (all of them if none was),
    and "kept/run" (with "none clean" when it had to use them all)."""
    rows = [r for r in raw["rows"] if r["setting"] == name]
    clean = [r for r in rows if r.get("foreign_cpu_share", 0.0) <= FOREIGN_MAX]
    kept = f"{len(clean)}/{len(rows)}" if clean else f"0/{len(rows)}, used all"
    return clean or rows, kept
