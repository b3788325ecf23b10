"""The layout as a setting: `auto` picks a runnable layout that fits a per-rank memory limit
for a model that plain data parallelism does not fit, chooses again when the job comes back
on fewer ranks (an elastic shrink) and resumes there; and every launch writes the planner's
prediction beside what each rank measured, within the planner's published error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import test_trainer as base
from tests.test_trainer_elastic import gang, global_losses
from trainer.config import parse_args
from trainer.layout import ZERO_MODES, candidates, model_shape, resolve, runnable
from trainer.planner import ClusterShape, GiB, evaluate
from trainer.step_time import Hardware, optimizer_s

# docs/planner.md ("Per layout"): weights, gradients and optimizer state after a step, the
# largest rank against the planner's worst stage.
STATE_TOLERANCE = 0.10

SHAPE = ["--n-layer", "4", "--n-embd", "64", "--n-head", "4", "--block-size", "8",
         "--batch-size", "4", "--global-batch-size", "32", "--steps", "4",
         "--checkpoint-every", "2"]  # fmt: skip
# Between what ZeRO-1 over 4 ranks needs (2.7 MiB) and plain DDP's 4.0 MiB (the planner's
# figures for SHAPE; test_the_limit_sits_between_ddp_and_the_choice checks them).
LIMIT_GB = "0.0030"


def layout_records(run_dir: Path, world: int) -> list[dict]:
    rows = []
    for r in range(world):
        path = run_dir / f"rank-{r}.metrics.jsonl"
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return [row for row in rows if row["kind"] == "layout"]


def assert_within_prediction(records: list[dict]) -> None:
    """The largest rank's resident state against the planner's (worst stage) prediction."""
    predicted = records[0]["layout"]["predicted_resident_bytes"]
    for part in ("weights", "grads", "optimizer"):
        measured = max(r["measured_bytes"][part] for r in records)
        assert measured == pytest.approx(predicted[part], rel=STATE_TOLERANCE), (
            part,
            measured,
            predicted,
        )


def test_the_limit_sits_between_ddp_and_the_choice():
    cfg = parse_args([*SHAPE, "--layout", "auto"])
    model = model_shape(cfg, 13, 201_408, 32)
    cluster = ClusterShape(gpus=4, gpus_per_node=4, gpu_mem_gb=float(LIMIT_GB), overhead_bytes=0)
    assert not evaluate(model, cluster, dp=4, tp=1, pp=1, zero=0).fits
    best = candidates(model, cluster)[0]
    assert best.fits and runnable(best)
    # What the trainer cannot run is never offered: tp beside dp without FSDP, zero1 with pp.
    for lay in candidates(model, cluster):
        assert not (lay.tp > 1 and lay.dp > 1 and lay.zero < 2)
        assert not (lay.pp > 1 and lay.zero == 1)


def test_auto_fits_a_model_plain_data_parallelism_does_not_and_chooses_again_on_fewer_ranks(
    tmp_path,
):
    limit = {"LOCKSTEP_MEMORY_LIMIT_GB": LIMIT_GB}
    full = gang(tmp_path, "w4", 4, [*SHAPE, "--layout", "auto"], env=limit)
    log = (full / "rank0.log").read_text()
    assert "layout (auto)" in log and "plain data parallelism would need" in log, log[-3000:]
    records = layout_records(full, 4)
    assert len(records) == 4
    chosen = records[0]["layout"]
    assert chosen["how"] == "auto"
    assert chosen["predicted_bytes"]["total"] <= float(LIMIT_GB) * GiB
    assert chosen["mode"] == ZERO_MODES[chosen["zero"]]
    assert (chosen["pp"], chosen["tp"], chosen["zero"]) != (1, 1, 0)  # not plain DDP
    assert_within_prediction(records)

    # The job comes back on 2 of its 4 GPUs: the same limit, another choice, same batch.
    shrunk = gang(tmp_path, "w2", 2, [*SHAPE, "--layout", "auto"],
                  resume=tmp_path / "ckpt" / "step-000002", env=limit)  # fmt: skip
    again = layout_records(shrunk, 2)[0]["layout"]
    assert (again["dp"] * again["tp"] * again["pp"], again["global_batch"]) == (2, 32)
    assert again["predicted_bytes"]["total"] <= float(LIMIT_GB) * GiB
    assert again != chosen
    assert_within_prediction(layout_records(shrunk, 2))
    # The resumed curve continues the one the 4-rank run drew.
    before, after = global_losses(full, 4), global_losses(shrunk, 2)
    assert sorted(after) == [3, 4]
    for step in after:
        assert after[step] == pytest.approx(before[step], abs=1e-4), (step, before, after)


def test_auto_refuses_when_nothing_fits_and_flags_win_over_the_platform_default(tmp_path):
    env = base.trainer_env(tmp_path)
    env["LOCKSTEP_MEMORY_LIMIT_GB"] = "0.0001"
    env["LOCKSTEP_LAYOUT"] = "auto"
    proc = base.start([*SHAPE], env, tmp_path, "none")
    assert proc.wait(timeout=120) != 0
    out = (tmp_path / "none.log").read_text()
    assert "no layout of 1 ranks fits" in out, out[-2000:]
    # A command that names its layout keeps it, whatever the platform's default says.
    cfg = parse_args([*SHAPE, "--parallel", "fsdp"])
    assert cfg.parallel.layout == "flags"
    with pytest.raises(ValueError, match="--layout auto chooses"):
        parse_args([*SHAPE, "--layout", "auto", "--tp", "2"])


def test_flags_layouts_are_predicted_too():
    cfg = parse_args([*SHAPE, "--parallel", "fsdp", "--pp", "2"])
    _, choice = resolve(cfg, vocab=13, params=201_408, world_size=8, gpus_per_node=8,
                        device_type="cpu", batch=32, memory_bytes=GiB, how="flags")  # fmt: skip
    record = choice.record()
    assert (record["pp"], record["dp"], record["tp"], record["zero"]) == (2, 4, 1, 3)
    t = record["predicted_time"]
    assert t["total_s"] == pytest.approx(t["compute_s"] + t["exposed_comm_s"] + t["bubble_s"])
    # 1F1B on 2 stages with 32 / (4 x 4) = 2 micro-batches: the bubble is (pp-1)/m of the
    # matmuls (the compute less the optimizer's pass, which runs once after the pipeline).
    assert record["micro_batches"] == 2
    model = model_shape(cfg, 13, 201_408, 32)
    matmuls = t["compute_s"] - optimizer_s(model, choice.layout, choice.hardware)
    assert 0 < matmuls < t["compute_s"]
    assert t["bubble_s"] == pytest.approx(matmuls / 2)


def test_auto_sets_the_interleaved_schedule_when_the_planner_takes_it():
    """The reference GPT at 70B's shape on 64 H100s with a global batch of 32: the choice is
    a 2-stage pipeline of 4 micro-batches per replica and two stages per rank (the bubble
    halved for twice the pipeline messages), and the trainer's settings say so, so that the
    launch runs the schedule the prediction is for; a flags layout that names the schedule is
    predicted as interleaved too."""
    big = ["--n-layer", "80", "--n-embd", "8192", "--n-head", "64", "--block-size", "4096",
           "--batch-size", "1", "--precision", "bf16"]  # fmt: skip
    # A micro-batch count given for 1F1B (3 is no multiple of pp) does not apply: the layout
    # sets the micro-batches, so the interleaved config is valid.
    asked = parse_args([*big, "--layout", "auto", "--pp-microbatches", "3"])
    cfg, choice = resolve(asked, vocab=128256,
                          params=70 * 10**9, world_size=64, gpus_per_node=8,
                          device_type="cuda", batch=32, memory_bytes=80 * GiB,
                          how="auto")  # fmt: skip
    lay = choice.layout
    assert (lay.pp, lay.stages_per_rank, lay.micro_batches) == (2, 2, 4), lay.describe()
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.stages_per_rank) == (
        2,
        "interleaved",
        2,
    )
    assert choice.record()["stages_per_rank"] == 2 and cfg.parallel.pp_microbatches == 0
    assert "interleaved" in choice.describe()
    flags = parse_args([*big, "--parallel", "fsdp", "--tp", "4", "--pp", "2",
                        "--pp-schedule", "interleaved"])  # fmt: skip
    _, named = resolve(flags, vocab=128256, params=70 * 10**9, world_size=64, gpus_per_node=8,
                       device_type="cuda", batch=32, memory_bytes=80 * GiB,
                       how="flags")  # fmt: skip
    plain = parse_args([*big, "--parallel", "fsdp", "--tp", "4", "--pp", "2"])
    _, one = resolve(plain, vocab=128256, params=70 * 10**9, world_size=64, gpus_per_node=8,
                     device_type="cuda", batch=32, memory_bytes=80 * GiB,
                     how="flags")  # fmt: skip
    assert named.layout.stages_per_rank == 2 and one.layout.stages_per_rank == 1
    assert named.predicted.bubble_s == pytest.approx(one.predicted.bubble_s / 2)


@pytest.mark.parametrize(
    ("world", "flags"),
    [
        (4, ["--parallel", "fsdp", "--tp", "2"]),
        (4, ["--parallel", "ddp", "--pp", "2", "--pp-schedule", "interleaved"]),
    ],
    ids=["tp2-dp2-fsdp", "pp2x2-dp2-interleaved"],
)
def test_the_step_time_model_counts_the_collectives_the_trainer_issues(world, flags, tmp_path):
    """trainer/step_time.collective_calls against torch.profiler's gloo events of a real run
    (rank 0, per step: a 4-step run less a 2-step one): tensor parallelism's all-reduces,
    FSDP's gathers and reduce-scatters, pipeline messages (twice as many interleaved) and the
    step's own small all-reduces. The per-call cost of the model multiplies this count."""
    from bench.layouts import as_gloo_runs, count_collectives, predict

    counted = count_collectives(tmp_path, world, flags)
    unit = Hardware("unit", flops=1.0, intra_node_bw=1.0, inter_node_bw=1.0)
    model = as_gloo_runs(predict("test", world, flags, lambda w: unit)["calls"])
    assert counted == pytest.approx({k: float(v) for k, v in model.items() if v})


def test_the_benchmark_recovers_the_fixed_costs_it_calibrates():
    """bench/layouts.fit_fixed_costs on runs made from known costs: the three calibration
    layouts' steps built by the model itself with 1.5 ms per call, 0.4 ms per peer and 2 ms
    per FSDP unit call come back as those figures; a cost the noise would drive below zero is
    dropped and the other two refitted; a run without a calibration layout is a clear error."""
    from bench.layouts import CALIBRATION, LAYOUTS, fit_fixed_costs, hardware, predict

    calibration = {
        "flops_per_rank_alone": 60e9,
        "optimizer_mem_bw_alone": 8e9,
        "gloo": {"4": {"bus_bw": 1e9, "hop_latency_s": 1e-3}},
    }
    truth = {"call_cpu_s": 1.5e-3, "peer_cpu_s": 0.4e-3, "fsdp_unit_cpu_s": 2e-3}
    flags = {label: (world, f) for label, world, f in LAYOUTS}

    def runs(costs: dict) -> list[dict]:
        out = []
        for label in CALIBRATION:
            world, f = flags[label]
            hw = lambda w, c=costs: hardware(calibration, w, 2, *c.values())  # noqa: E731
            step = predict(label, world, f, hw)["time"]["total_s"]
            out.append({"layout": label, "world": world, "flags": f, "measured_step_s": step})
        return out

    fitted = fit_fixed_costs(calibration, runs(truth), cores=2)
    assert fitted == pytest.approx(truth, rel=1e-6)
    # No per-peer cost at all, and the measurements a little under it: its fit would be
    # negative; it is dropped, and the others still come back close.
    skewed = runs({**truth, "peer_cpu_s": 0.0})
    skewed[0]["measured_step_s"] *= 0.99
    fitted = fit_fixed_costs(calibration, skewed, cores=2)
    assert fitted["peer_cpu_s"] == 0.0
    assert fitted["call_cpu_s"] == pytest.approx(truth["call_cpu_s"], rel=0.2)
    assert fitted["fsdp_unit_cpu_s"] == pytest.approx(truth["fsdp_unit_cpu_s"], rel=0.2)
    with pytest.raises(SystemExit, match="no 'tp4' layout"):
        fit_fixed_costs(calibration, runs(truth)[1:], cores=2)
