"""The agent-to-trainer path on a real NVIDIA GPU, without a portal.

Run on a GPU machine (`python bench/gpu_check.py --out DIR`). It drives the node agent's own
`WorkerSupervisor` and `Telemetry` exactly as the agent does, with launch documents shaped like
the portal's, and checks what CPU machines cannot:

1. `--gpu-kind auto` finds the GPU; a worker gets `CUDA_VISIBLE_DEVICES` and trains on cuda:0;
   the loss falls; DCP checkpoints are committed; NVML telemetry reports utilisation and memory.
2. A second attempt resumes from the latest committed checkpoint (model, optimizer, data
   position) and continues from that step.
3. SIGTERM (the agent's checkpoint-and-stop) makes the worker save at the next step boundary and
   exit 0 - the preemption path on a GPU.
4. A larger model (GPT-2 small shape) measures step time, throughput and the checkpoint save
   stall on the GPU: the inputs of the Young/Daly interval.
5. NVML's health readings (temperature, power) and the Xid watch (nodeagent/xid.py): it
   registers for the GPU's critical Xids, and a poll of a healthy GPU returns no event.

Everything is written to DIR/gpu_check.json; the script exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodeagent.supervisor import WorkerSupervisor  # noqa: E402
from nodeagent.telemetry import Telemetry  # noqa: E402
from trainer.checkpoint_layout import latest_committed  # noqa: E402


def launch_doc(job: int, attempt: int, command: list[str], ckpt: Path, resume: str = "") -> dict:
    return {
        "job_id": job,
        "attempt": attempt,
        "run_id": f"job-{job}-attempt-{attempt}",
        "world_size": 1,
        "local_world_size": 1,
        "group_rank": 0,
        "group_world_size": 1,
        "master_addr": "127.0.0.1",
        "master_port": 29555,
        "command": command,
        "checkpoint_dir": str(ckpt),
        "resume_from": resume,
        "ranks": [{"rank": 0, "local_rank": 0, "gpu_index": 0}],
    }


def run_attempt(
    sup: WorkerSupervisor,
    telemetry: Telemetry,
    attempt_id: int,
    launch: dict,
    *,
    stop_after_step: int | None = None,
    timeout_s: float = 240,
) -> dict:
    attempt = sup.launch(attempt_id, launch)
    worker = attempt.workers[0]
    samples, stopped_at, deadline = [], None, time.monotonic() + timeout_s
    while not sup.all_exited(attempt_id):
        sup.poll()
        samples.append(telemetry.read()[0])
        if stop_after_step is not None and stopped_at is None:
            records = read_records(worker.metrics_path)
            steps = [r["step"] for r in records if r["kind"] == "step"]
            if steps and steps[-1] >= stop_after_step:
                stopped_at = steps[-1]
                sup.stop(attempt_id, deadline_s=60)
        if time.monotonic() > deadline:
            sup.stop(attempt_id, deadline_s=0)
            sup.poll()
            break
        time.sleep(0.5)
    sup.poll()
    records = read_records(worker.metrics_path)
    return {
        "exit_code": worker.exit_code,
        "env_cuda_visible_devices": worker.env.get("CUDA_VISIBLE_DEVICES"),
        "records": records,
        "telemetry": samples,
        "stop_requested_after_step": stopped_at,
        "log_tail": worker.log_path.read_text(errors="replace")[-1500:],
    }


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def summarise(result: dict) -> dict:
    steps = [r for r in result["records"] if r["kind"] == "step"]
    saves = [r for r in result["records"] if r["kind"] == "checkpoint"]
    start = next((r for r in result["records"] if r["kind"] == "start"), {})
    end = next((r for r in result["records"] if r["kind"] == "end"), {})
    warm = steps[len(steps) // 5 :] or steps
    util = [s["util"] for s in result["telemetry"]]
    return {
        "exit_code": result["exit_code"],
        "cuda_visible_devices": result["env_cuda_visible_devices"],
        "device": start.get("device"),
        "resumed_from_step": start.get("resumed_from_step"),
        "first_step": steps[0]["step"] if steps else None,
        "last_step": steps[-1]["step"] if steps else None,
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "step_time_median_s": statistics.median(s["step_time_s"] for s in warm) if warm else None,
        "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in warm) if warm else None,
        "checkpoints": [
            {"step": c["step"], "bytes": c["bytes"], "save_s": c["save_s"]} for c in saves
        ],
        "end": end,
        "nvml_util_max": max(util) if util else None,
        "nvml_mem_used_max": max((s["mem_used"] for s in result["telemetry"]), default=None),
        "nvml_mem_total": result["telemetry"][0]["mem_total"] if result["telemetry"] else None,
        "stop_requested_after_step": result["stop_requested_after_step"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lockstep-gpu-check"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sup = WorkerSupervisor(args.work / "agent", gpu_kind="auto")
    telemetry = Telemetry(1, sup.gpu_kind)
    report: dict = {"gpu_kind": sup.gpu_kind, "checks": {}}
    small = ["python", "-m", "trainer", "--log-every", "50"]

    ckpt = args.work / "job-1"
    first = summarise(
        run_attempt(
            sup,
            telemetry,
            1,
            launch_doc(1, 1, [*small, "--steps", "600", "--checkpoint-every", "200"], ckpt),
        )
    )
    latest = latest_committed(ckpt)
    second = summarise(
        run_attempt(
            sup,
            telemetry,
            2,
            launch_doc(
                1, 2, [*small, "--steps", "900", "--checkpoint-every", "200"], ckpt, str(latest)
            ),
        )
    )
    stopped = summarise(
        run_attempt(
            sup,
            telemetry,
            3,
            launch_doc(
                2,
                1,
                [*small, "--steps", "100000", "--checkpoint-every", "100000"],
                args.work / "job-2",
            ),  # fmt: skip
            stop_after_step=300,
        )
    )
    big = summarise(
        run_attempt(
            sup,
            telemetry,
            4,
            launch_doc(
                3,
                1,
                [
                    *small,
                    "--steps",
                    "300",
                    "--checkpoint-every",
                    "100",
                    "--n-layer",
                    "12",
                    "--n-head",
                    "12",
                    "--n-embd",
                    "768",
                    "--block-size",
                    "256",
                    "--batch-size",
                    "32",
                ],
                args.work / "job-3",
            ),  # fmt: skip
            timeout_s=300,
        )
    )
    report["runs"] = {"train": first, "resume": second, "sigterm": stopped, "gpt2_small": big}
    checks = report["checks"]
    checks["auto_detects_cuda"] = sup.gpu_kind == "cuda"
    checks["worker_sees_its_gpu"] = first["cuda_visible_devices"] == "0"
    checks["trains_on_cuda"] = (first["device"] or "").startswith("cuda")
    checks["loss_falls"] = bool(
        first["loss_first"] and first["loss_last"] and first["loss_last"] < first["loss_first"] / 3
    )
    checks["checkpoints_committed"] = [c["step"] for c in first["checkpoints"]] == [200, 400, 600]
    checks["latest_is_600"] = latest is not None and latest.name.endswith("600")
    checks["resumes_from_600"] = second["resumed_from_step"] == 600 and second["first_step"] == 601
    checks["resume_finishes"] = second["exit_code"] == 0 and second["last_step"] == 900
    checks["nvml_reports_util_and_memory"] = bool(
        first["nvml_util_max"] and first["nvml_mem_total"]
    )
    stop_step = stopped["stop_requested_after_step"]
    checks["sigterm_saves_at_step_boundary_and_exits_0"] = (
        stopped["exit_code"] == 0
        and bool(stopped["checkpoints"])
        and stopped["checkpoints"][-1]["step"] == stopped["last_step"]
        and stop_step is not None
        and stopped["last_step"] >= stop_step
    )
    checks["gpt2_small_trains_and_saves"] = big["exit_code"] == 0 and len(big["checkpoints"]) == 3
    # Xid events (nodeagent/xid.py): the watch registers on the GPU, and a healthy GPU that has
    # just trained reports none (a poll returns at once, with nothing invented).
    xid = telemetry.xid
    report["xid"] = {
        "watched": xid.watched if xid is not None else None,
        "events": xid.poll() if xid is not None else None,
        "health_keys": sorted(k for r in telemetry.read() for k in r),
    }
    checks["xid_watch_registers"] = bool(xid is not None and xid.watched == [0])
    checks["xid_none_on_a_healthy_gpu"] = report["xid"]["events"] == []
    checks["nvml_health_readings"] = {"temp_c", "power_w"} <= set(report["xid"]["health_keys"])
    report["ok"] = all(checks.values())
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({"checks": checks, "ok": report["ok"]}, indent=2))
    for name, run in report["runs"].items():
        brief = {k: v for k, v in run.items() if k not in ("end",)}
        print(name, json.dumps(brief, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
