"""Memory planner (trainer/planner.py): hand-computed formulas, ZeRO ordering, ring traffic,
layout enumeration and recommendation, the `lockstep plan` CLI, POST /api/v1/plan/, the submit
page hint, and estimates against memory measured in the reference trainer."""

import json
import time
from dataclasses import replace

import pytest
from django.contrib.staticfiles import finders
from rest_framework.test import APIClient

from lockstep_cli.cli import main as cli_main
from trainer import planner
from trainer import step_time as step_time_model
from trainer.layout import NEAR_TIE, choose, runnable
from trainer.planner import ClusterShape, ModelShape, PlanError, evaluate, plan
from trainer.step_time import H100_NODE, step_time

GiB = planner.GiB

# A shape whose terms are easy by hand: 10 layers of 1e8 parameters, a 1000 x 1000 embedding
# and (untied) head, s*b*h = 100 * 2 * 1000 = 200,000.
HAND = {"layers": 10, "hidden": 1000, "heads": 10, "vocab": 1000, "seq": 100, "micro_batch": 2}
HAND_NON_BLOCK = 2 * 1000 * 1000 + 2 * 1000  # embedding + head + final LayerNorm
HAND_PARAMS = 10**9 + HAND_NON_BLOCK
SBH = 100 * 2 * 1000


def hand_model(**overrides) -> ModelShape:
    return ModelShape(**{**HAND, "params": HAND_PARAMS, **overrides})


# --- formulas -----------------------------------------------------------------------------


def test_derived_params_follow_the_gpt_formula():
    # L(12h^2 + 13h) + 2Vh + 2h with L=2, h=64, V=100: 2 * (49,152 + 832) + 12,800 + 128.
    shape = ModelShape(layers=2, hidden=64, heads=4, vocab=100, seq=32)
    assert shape.total_params == 99_968 + 12_928
    assert shape.params is None


def test_derived_params_match_the_reference_gpt_less_its_learned_positions():
    from trainer.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=4, n_embd=32)
    shape = ModelShape(layers=3, hidden=32, heads=4, vocab=50, seq=16, tied_embeddings=True)
    assert shape.total_params == GPT(cfg).num_params() - 16 * 32


def test_mixed_precision_adam_is_2_2_12_bytes_per_parameter_without_zero():
    layout = evaluate(hand_model(), ClusterShape(gpus=4), dp=4, tp=1, pp=1, zero=0)
    b = layout.per_gpu_bytes
    assert (b["weights"], b["grads"], b["optimizer"]) == (
        2 * HAND_PARAMS,
        2 * HAND_PARAMS,
        12 * HAND_PARAMS,
    )


def test_fp32_adam_is_4_4_8_and_sgd_keeps_one_moment():
    adam = evaluate(hand_model(dtype="fp32"), ClusterShape(gpus=1), dp=1, tp=1, pp=1, zero=0)
    sgd = evaluate(
        hand_model(dtype="fp32", optimizer="sgd"), ClusterShape(gpus=1), dp=1, tp=1, pp=1, zero=0
    )
    mixed_sgd = evaluate(
        hand_model(optimizer="sgd"), ClusterShape(gpus=1), dp=1, tp=1, pp=1, zero=0
    )
    assert [adam.per_gpu_bytes[k] for k in ("weights", "grads", "optimizer")] == [
        4 * HAND_PARAMS,
        4 * HAND_PARAMS,
        8 * HAND_PARAMS,
    ]
    assert sgd.per_gpu_bytes["optimizer"] == 4 * HAND_PARAMS
    assert mixed_sgd.per_gpu_bytes["optimizer"] == 8 * HAND_PARAMS  # fp32 master + momentum


def test_zero_stages_shard_optimizer_then_grads_then_weights_over_dp():
    cluster = ClusterShape(gpus=4)
    by_stage = [evaluate(hand_model(), cluster, dp=4, tp=1, pp=1, zero=z) for z in range(4)]
    unit = 10**8  # one layer (1e8) is larger than the embedding (1e6)
    p = HAND_PARAMS
    assert by_stage[1].per_gpu_bytes["optimizer"] == 12 * p // 4
    assert by_stage[1].per_gpu_bytes["grads"] == 2 * p
    # The gradient of the unit being reduce-scattered is still whole.
    assert by_stage[2].per_gpu_bytes["grads"] == 2 * p // 4 + 2 * unit
    assert by_stage[2].per_gpu_bytes["weights"] == 2 * p
    # ZeRO-3 gathers the unit in use and prefetches the next.
    assert by_stage[3].per_gpu_bytes["weights"] == 2 * p // 4 + 2 * 2 * unit


def test_model_states_reproduce_the_zero_papers_7_5b_on_64_gpus_example():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, Adam, mixed precision, 64-way DP:
    # 120 GB replicated, 31.4 GB with ZeRO-1, 16.6 GB with ZeRO-2, 1.9 GB with ZeRO-3. The
    # planner adds a gradient bucket (ZeRO-2) and two gathered layers (ZeRO-3) to those.
    model = ModelShape(params=7_500_000_000, layers=32, hidden=4096, heads=32, vocab=32000, seq=8)
    unit_bytes = 2 * model.block_params / 32
    states = []
    for zero in range(4):
        b = evaluate(model, ClusterShape(gpus=64), dp=64, tp=1, pp=1, zero=zero).per_gpu_bytes
        states.append(b["weights"] + b["grads"] + b["optimizer"])
    assert states[0] / 1e9 == pytest.approx(120, abs=0.05)
    assert states[1] / 1e9 == pytest.approx(31.4, abs=0.05)
    assert (states[2] - unit_bytes) / 1e9 == pytest.approx(16.6, abs=0.05)
    assert (states[3] - 3 * unit_bytes) / 1e9 == pytest.approx(1.9, abs=0.05)


def test_activations_follow_korthikanti_without_and_with_checkpointing():
    model = hand_model(flash_attention=False)
    per_layer = SBH * (34 + 5 * 10 * 100 / 1000)  # 7.8 MB
    output_layer = 2 * SBH * 2 + 4 * 100 * 2 * 1000  # head inputs + fp32 log-probs
    token_ids = 8 * 100 * 2
    one = ClusterShape(gpus=1)
    full = evaluate(model, one, dp=1, tp=1, pp=1, zero=0)
    assert full.per_gpu_bytes["activations"] == 10 * per_layer + output_layer + token_ids
    ckpt = evaluate(
        hand_model(flash_attention=False, activation_checkpointing=True), one, 1, 1, 1, 0
    )
    # Each layer keeps its 16-bit input; backward recomputes one layer at a time.
    kept = 10 * 2 * SBH + per_layer
    assert ckpt.per_gpu_bytes["activations"] == kept + output_layer + token_ids
    flash = evaluate(hand_model(), one, dp=1, tp=1, pp=1, zero=0)
    assert flash.per_gpu_bytes["activations"] == 10 * SBH * 34 + output_layer + token_ids


def test_tensor_parallelism_divides_weights_and_activations_by_tp():
    model = hand_model()
    one = evaluate(model, ClusterShape(gpus=2), dp=2, tp=1, pp=1, zero=0).per_gpu_bytes
    two = evaluate(model, ClusterShape(gpus=2), dp=1, tp=2, pp=1, zero=0).per_gpu_bytes
    assert two["weights"] == one["weights"] // 2
    token_ids = 8 * 100 * 2  # every tensor-parallel rank reads the same tokens
    assert two["activations"] - token_ids == (one["activations"] - token_ids) // 2


def test_pipeline_first_stage_holds_pp_micro_batches_of_its_layers():
    # 1F1B: stage 1 of 2 keeps 2 micro-batches x 5 layers = all 10 layers' worth.
    model = hand_model(global_batch=8)
    layout = evaluate(model, ClusterShape(gpus=2), dp=1, tp=1, pp=2, zero=0)
    assert layout.peak_stage == "first"
    assert layout.per_gpu_bytes["activations"] == 2 * 5 * SBH * 34 + 2 * 8 * 100 * 2
    assert layout.per_gpu_bytes["weights"] == 2 * (10**9 // 2 + 1000 * 1000)
    assert layout.pipeline_bubble == pytest.approx(1 / 5)  # (pp-1)/(m+pp-1), m = 4


def test_interleaved_pipeline_keeps_more_activations_and_a_smaller_bubble():
    # 10 layers on 5 ranks, 2 stages of one layer each per rank, 10 micro-batches. 1F1B: the
    # first rank holds 5 micro-batches x 2 layers. Interleaved: torch's warm-up of
    # (V - 1) pp + 2 (pp - 1) = 13 chunks and one more, 14 chunks of one layer: 1 + (pp - 1) /
    # (V pp) = 1.4 times as much (Narayanan et al. 2021).
    model = hand_model(global_batch=20)
    plain = evaluate(model, ClusterShape(gpus=5), dp=1, tp=1, pp=5, zero=0)
    inter = evaluate(model, ClusterShape(gpus=5), dp=1, tp=1, pp=5, zero=0, stages_per_rank=2)
    token_ids = 8 * 100 * 2
    assert plain.per_gpu_bytes["activations"] == 5 * 2 * SBH * 34 + 5 * token_ids
    assert inter.per_gpu_bytes["activations"] == 14 * SBH * 34 + 7 * token_ids
    assert inter.per_gpu_bytes["weights"] == plain.per_gpu_bytes["weights"]
    assert plain.pipeline_bubble == pytest.approx(4 / 14, abs=1e-4)  # (pp-1)/(m+pp-1)
    assert inter.pipeline_bubble == pytest.approx(4 / 24, abs=1e-4)  # (pp-1)/(V m+pp-1)
    assert inter.comm_breakdown["pp"] == 2 * plain.comm_breakdown["pp"]
    assert inter.stages_per_rank == 2 and "interleaved x2" in inter.describe()
    with pytest.raises(PlanError) as e:
        evaluate(model, ClusterShape(gpus=2), dp=1, tp=1, pp=2, zero=0, stages_per_rank=2)
    assert e.value.field == "stages_per_rank"  # 2 x 2 stages do not split 10 layers


def test_auto_takes_the_interleaved_schedule_when_its_smaller_bubble_pays():
    # 70B in bf16 on 32 GPUs: the fastest fitting layouts are 4-stage pipelines, and with 16
    # micro-batches the 1F1B bubble is 3/19 of the step; interleaving halves it for twice the
    # pipeline messages over NVLink, and its 1.375x activations still fit.
    model, cluster = ModelShape(**LLAMA_70B, dtype="bf16"), ClusterShape(gpus=32)
    best, reasons = choose(model, cluster, H100_NODE)
    assert (best.pp, best.stages_per_rank) == (4, 2) and best.fits, best.describe()
    twin = evaluate(model, cluster, best.dp, best.tp, best.pp, best.zero)
    assert twin.fits
    fast, slow = (step_time(model, cluster, lay, H100_NODE).total_s for lay in (best, twin))
    assert fast * NEAR_TIE < slow  # beyond the tie rule, which prefers not interleaving
    assert best.per_gpu_bytes["activations"] > twin.per_gpu_bytes["activations"]
    assert "interleaved x2" in reasons[0]


def test_interleaved_last_rank_holds_its_warm_up_chunks_too():
    # The last rank warms up with (V - 1) pp chunks and holds one more: with a vocabulary large
    # enough for the head to make the last stage the peak, it keeps (2 - 1) x 5 + 1 = 6 chunks
    # of one layer (1F1B: one micro-batch of its 2 layers), plus the head's activations.
    model = hand_model(global_batch=20, vocab=200_000)
    cluster = ClusterShape(gpus=5)
    inter = evaluate(model, cluster, dp=1, tp=1, pp=5, zero=0, stages_per_rank=2)
    plain = evaluate(model, cluster, dp=1, tp=1, pp=5, zero=0)
    head = planner.output_activation_bytes(model)
    assert inter.peak_stage == plain.peak_stage == "last"
    assert plain.per_gpu_bytes["activations"] == round(2 * SBH * 34 + head)
    assert inter.per_gpu_bytes["activations"] == round(6 * SBH * 34 + head)


def test_fixed_costs_count_each_collective_the_rank_waits_on_and_its_peers():
    """trainer/step_time's waited_calls, waited_peers and fsdp_unit_calls by hand, on HAND:
    10 layers, micro-batches of 2, a global batch of 2 per GPU."""
    cases = {
        # tp4: (2 forward + 4 backward) x 10 layers x 4 micro-batches over 4 ranks, and the
        # step's 2 over all 4.
        (4, 1, 4, 1, 0): (240 + 2, (240 + 2) * 3, 0),
        # pp2: no collective inside the layers; the step's 2 over both ranks, the loss over
        # the stages and the tied embedding's gradient: 4, each with one peer.
        (2, 1, 1, 2, 0): (4, 4, 0),
        # ZeRO-3 on 4: 11 units gathered twice in the one micro-batch and reduce-scattered
        # once (33 FSDP unit calls), and the step's 2, each over 4 ranks.
        (4, 4, 1, 1, 3): (35, 105, 33),
        # DDP on 4: the gradients' 4 GB in 25 MiB buckets (77 all-reduces) and the step's 2.
        (4, 4, 1, 1, 0): (79, 237, 0),
        # pp2 x dp2 x tp2 FSDP: 6 TP all-reduces x 5 layers x 4 micro-batches (120, one peer
        # each); 6 units gathered m + 1 = 5 times and reduce-scattered once (36, one peer);
        # the step's 2 over all 8 (7 peers each); the loss and the tied gradient (one peer).
        (8, 2, 2, 2, 3): (120 + 36 + 2 + 2, 120 + 36 + 2 * 7 + 2, 36),
    }
    model = ModelShape(**{**HAND, "params": HAND_PARAMS})
    for (gpus, dp, tp, pp, zero), expected in cases.items():
        layout = evaluate(model, ClusterShape(gpus=gpus), dp, tp, pp, zero)
        got = (
            step_time_model.waited_calls(model, layout),
            step_time_model.waited_peers(model, layout),
            step_time_model.fsdp_unit_calls(model, layout),
        )
        assert got == expected, (layout.describe(), got)
        # Each count is what its fixed cost multiplies in the step's exposed communication.
        hw = replace(H100_NODE, call_s=0.0, peer_s=0.0, fsdp_unit_s=0.0)
        base = step_time(model, ClusterShape(gpus=gpus), layout, hw).exposed_comm_s
        for field, count in zip(("call_s", "peer_s", "fsdp_unit_s"), got, strict=True):
            one = step_time(model, ClusterShape(gpus=gpus), layout, replace(hw, **{field: 1.0}))
            assert one.exposed_comm_s - base == pytest.approx(count), (layout.describe(), field)


def test_total_adds_the_fixed_overhead_and_fragmentation_margin():
    b = evaluate(hand_model(), ClusterShape(gpus=1), 1, 1, 1, 0).per_gpu_bytes
    parts = b["weights"] + b["grads"] + b["optimizer"] + b["activations"]
    assert b["overhead"] == pytest.approx(2 * GiB + 0.10 * parts, abs=2)
    assert b["total"] == pytest.approx(parts + b["overhead"], abs=2)


# --- communication ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 512])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer(n):
    assert planner.ring_allreduce_bytes(1000.0, n) == pytest.approx(2 * (n - 1) / n * 1000)


def test_data_parallel_traffic_is_one_all_reduce_of_the_gradients_per_step():
    layout = evaluate(hand_model(), ClusterShape(gpus=8), dp=8, tp=1, pp=1, zero=0)
    grad_bytes = 2 * HAND_PARAMS
    assert layout.comm_breakdown == {"dp": round(2 * 7 / 8 * grad_bytes), "tp": 0, "pp": 0}
    zero1 = evaluate(hand_model(), ClusterShape(gpus=8), dp=8, tp=1, pp=1, zero=1)
    assert zero1.comm_bytes_per_step == layout.comm_bytes_per_step  # ZeRO-1 is free
    zero3 = evaluate(hand_model(), ClusterShape(gpus=8), dp=8, tp=1, pp=1, zero=3)
    assert zero3.comm_bytes_per_step == pytest.approx(1.5 * layout.comm_bytes_per_step, abs=2)


def test_tensor_and_pipeline_traffic_per_step():
    model = hand_model(global_batch=4)  # 4 sequences, micro-batch 2: 2 micro-batches
    tp = evaluate(model, ClusterShape(gpus=2), dp=1, tp=2, pp=1, zero=0)
    # 2 micro-batches x 10 layers x 4 all-reduces of s*b*h 16-bit values, 2(2-1)/2 of each.
    assert tp.comm_breakdown["tp"] == 2 * 10 * 4 * (2 * SBH)
    pp = evaluate(model, ClusterShape(gpus=2), dp=1, tp=1, pp=2, zero=0)
    assert pp.comm_breakdown["pp"] == 2 * 2 * (2 * SBH)  # activations forward, grads back


# --- enumeration and recommendation -------------------------------------------------------

LLAMA_70B = {
    "params": 70 * 10**9,
    "layers": 80,
    "hidden": 8192,
    "heads": 64,
    "vocab": 128256,
    "seq": 4096,
}


@pytest.mark.parametrize("gpus", [8, 64, 512, 4096])
def test_zero_stage_k_never_needs_more_memory_than_stage_k_minus_1(gpus):
    result = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=gpus))
    groups: dict[tuple, dict[int, planner.Layout]] = {}
    for layout in result.layouts:
        groups.setdefault((layout.dp, layout.tp, layout.pp), {})[layout.zero] = layout
    checked = 0
    for stages in groups.values():
        for k in range(1, 4):
            if k in stages:
                for part in ("weights", "grads", "optimizer", "total"):
                    assert stages[k].per_gpu_bytes[part] <= stages[k - 1].per_gpu_bytes[part]
                assert stages[k].comm_bytes_per_step >= stages[k - 1].comm_bytes_per_step
                checked += 1
    assert checked > 0


def test_zero_ordering_holds_even_for_a_one_layer_model_on_two_gpus():
    tiny = ModelShape(layers=1, hidden=64, heads=4, vocab=10, seq=8)
    totals = [
        evaluate(tiny, ClusterShape(gpus=2), dp=2, tp=1, pp=1, zero=z).per_gpu_bytes["total"]
        for z in range(4)
    ]
    assert totals == sorted(totals, reverse=True)


def test_layouts_keep_tp_inside_a_node_pp_dividing_layers_and_use_every_gpu():
    result = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=512, gpus_per_node=8))
    assert {lay.tp for lay in result.layouts} == {1, 2, 4, 8}
    assert {lay.pp for lay in result.layouts} == {1, 2, 4, 8, 16}  # divisors of 80 and 512
    assert all(lay.dp * lay.tp * lay.pp == 512 for lay in result.layouts)
    assert {lay.zero for lay in result.layouts} == {0, 1, 2, 3}


def test_4096_gpu_enumeration_is_well_under_a_second():
    started = time.perf_counter()
    result = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=4096))
    assert time.perf_counter() - started < 0.5
    assert len(result.layouts) == 80


def test_recommended_layout_fits_and_is_first_by_the_documented_rule():
    result = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=512))
    best = result.recommended
    assert best is not None and best.fits
    fitting = [lay for lay in result.layouts if lay.fits]
    assert best == min(fitting, key=planner.recommendation_key)
    assert best.per_gpu_bytes["total"] <= 80 * GiB
    assert any("2(N-1)/N" in reason for reason in result.reasons)


def test_7b_on_one_node_uses_plain_data_parallel_with_zero_not_tensor_parallelism():
    seven_b = ModelShape(
        params=6_740_000_000, layers=32, hidden=4096, heads=32, vocab=32000, seq=4096
    )
    best = plan(seven_b, ClusterShape(gpus=8)).recommended
    assert best is not None
    assert (best.dp, best.tp, best.pp) == (8, 1, 1)
    assert best.zero >= 1  # 16 bytes per parameter (108 GB) cannot be replicated on 80 GiB


def test_70b_across_nodes_keeps_tensor_parallel_traffic_on_nvlink():
    for gpus in (64, 512, 4096):
        best = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=gpus)).recommended
        assert best is not None and best.tp == 8 and best.pp == 1


def test_nothing_fits_gives_no_recommendation_and_says_what_to_change():
    result = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=8, gpu_mem_gb=24))
    assert result.recommended is None
    assert not any(lay.fits for lay in result.layouts)
    assert any("activation checkpointing" in reason for reason in result.reasons)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"hidden": 100, "heads": 3}, "hidden"),
        ({"dtype": "fp8"}, "dtype"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"layers": 0}, "layers"),
        ({"params": 10}, "params"),  # fewer than the embeddings
        ({"global_batch": 3, "micro_batch": 2}, "global_batch"),
    ],
)
def test_bad_model_shapes_name_their_field(kwargs, field):
    with pytest.raises(PlanError) as raised:
        ModelShape(**{**HAND, **kwargs})
    assert raised.value.field == field


def test_a_gpu_count_that_is_not_whole_nodes_is_refused():
    with pytest.raises(PlanError) as raised:
        ClusterShape(gpus=12, gpus_per_node=8)
    assert raised.value.field == "gpus"


# --- CLI ----------------------------------------------------------------------------------

EXAMPLE_ARGS = [
    "plan",
    "--params",
    "70e9",
    "--layers",
    "80",
    "--hidden",
    "8192",
    "--heads",
    "64",
    "--vocab",
    "128256",
    "--seq",
    "4096",
    "--micro-batch",
    "1",
    "--gpus",
    "512",
    "--gpus-per-node",
    "8",
    "--gpu-mem-gb",
    "80",
]


def test_cli_json_prints_layouts_and_the_recommendation(capsys):
    assert cli_main([*EXAMPLE_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"layouts", "recommended"} <= set(out)
    assert out["model"]["params"] == 70 * 10**9
    for layout in out["layouts"]:
        assert {"dp", "tp", "pp", "zero", "per_gpu_bytes", "comm_bytes_per_step", "fits"} <= set(
            layout
        )
        assert layout["zero"] in (0, 1, 2, 3)
        parts = layout["per_gpu_bytes"]
        assert {"weights", "grads", "optimizer", "activations", "total"} <= set(parts)
        assert parts["total"] == pytest.approx(
            sum(parts[k] for k in ("weights", "grads", "optimizer", "activations", "overhead")),
            abs=5,
        )
    assert out["recommended"] in out["layouts"]


def test_cli_prints_a_table_with_the_recommendation(capsys):
    assert cli_main(EXAMPLE_ARGS) == 0
    out = capsys.readouterr().out
    assert "recommended: dp=64 tp=8 pp=1 ZeRO-1" in out
    assert "<- recommended" in out
    assert "fastest predicted on H100/H200" in out and "(what --layout auto takes)" in out


@pytest.mark.parametrize(
    "change, message",
    [
        (["--hidden", "8190"], "--hidden: 8190 is not divisible by heads"),
        (["--params", "1.5"], "--params: must be a whole number"),
        (["--gpus", "12"], "--gpus: 12 GPUs is not a whole number of 8-GPU nodes"),
        (["--micro-batch", "0"], "--micro-batch: must be a positive integer"),
    ],
)
def test_cli_bad_input_is_a_clear_message_and_exit_2(capsys, change, message):
    assert cli_main([*EXAMPLE_ARGS, *change]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_cli_unparseable_input_exits_2(capsys):
    with pytest.raises(SystemExit) as raised:
        cli_main([*EXAMPLE_ARGS, "--dtype", "fp8"])
    assert raised.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


# --- API and the submit page ---------------------------------------------------------------

API_BODY = {**LLAMA_70B, "micro_batch": 1, "gpus": 64, "gpus_per_node": 8, "gpu_mem_gb": 80}


@pytest.fixture
def api(make_team, make_user, token_for):
    user = make_user("pia", team=make_team("llm"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    return client


@pytest.mark.django_db
def test_api_plans_the_same_as_the_library(api):
    response = api.post("/api/v1/plan/", API_BODY, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    expected = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=64)).to_dict()
    # The API adds the step-time model's figures (test below) to the planner's own.
    assert body["recommended"].pop("predicted_step")["total_s"] > 0
    assert body["recommended"] == expected["recommended"]
    assert len(body["layouts"]) == len(expected["layouts"])


@pytest.mark.django_db
def test_api_adds_each_layouts_step_time_and_the_layout_auto_takes(api):
    """Beside the traffic-ordered recommendation, the step-time model's figures and the
    choice `--layout auto` makes (trainer/layout.choose) for the same shape."""
    body = api.post("/api/v1/plan/", API_BODY, format="json").json()
    model, cluster = ModelShape(**LLAMA_70B), ClusterShape(gpus=64)
    result = plan(model, cluster)
    for entry, layout in zip(body["layouts"], result.layouts, strict=True):
        expected = step_time(model, cluster, layout, H100_NODE)
        assert entry["predicted_step"]["total_s"] == pytest.approx(expected.total_s)
    best, reasons = choose(model, cluster, H100_NODE)
    fastest = body["fastest"]
    assert (fastest["dp"], fastest["tp"], fastest["pp"], fastest["zero"]) == (
        best.dp, best.tp, best.pp, best.zero,
    )  # fmt: skip
    assert body["fastest_reasons"] == reasons
    assert fastest["stages_per_rank"] == best.stages_per_rank
    assert fastest["description"] == best.describe()  # what the CLI and the submit page print
    assert body["hardware"]["name"] == H100_NODE.name
    # It is the fastest fitting runnable layout, up to the near-tie rule.
    fitting = [
        e["predicted_step"]["total_s"]
        for e, layout in zip(body["layouts"], result.layouts, strict=True)
        if layout.fits and runnable(layout)
    ]
    assert fastest["predicted_step"]["total_s"] <= NEAR_TIE * min(fitting)
    # Nothing fits on one GPU: no choice, and the reason.
    none = api.post("/api/v1/plan/", {**API_BODY, "gpus": 8}, format="json").json()
    assert none["fastest"] is None and "no layout of 8 ranks fits" in none["fastest_reasons"][0]


@pytest.mark.django_db
def test_api_accepts_params_written_as_a_float(api):
    response = api.post("/api/v1/plan/", {**API_BODY, "params": 7e10}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["model"]["params"] == 70 * 10**9


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden": 8190}, "hidden"),
        ({"gpus": 12}, "gpus"),
        ({"gpus": 0}, "gpus"),
        ({"dtype": "fp8"}, "dtype"),
        ({"layers": "many"}, "layers"),
        ({"params": 10}, "params"),
    ],
)
def test_api_bad_input_is_a_400_on_its_field(api, change, field):
    response = api.post("/api/v1/plan/", {**API_BODY, **change}, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert response.json()[field]


@pytest.mark.django_db
def test_api_missing_fields_are_each_named(api):
    response = api.post("/api/v1/plan/", {"gpus": 8}, format="json")
    assert response.status_code == 400
    assert {"layers", "hidden", "heads", "vocab", "seq"} <= set(response.json())


@pytest.mark.django_db
def test_api_needs_authentication():
    response = APIClient().post("/api/v1/plan/", API_BODY, format="json")
    assert response.status_code in (401, 403)


@pytest.mark.django_db
def test_submit_page_offers_the_model_shape_check(client, make_team, make_user):
    user = make_user("quinn", team=make_team("ml"))
    client.force_login(user)
    page = client.get("/jobs/new/").content.decode()
    assert 'id="planner"' in page and 'data-url="/api/v1/plan/"' in page
    assert "portal/planner.js" in page
    # The check lives outside the job form: its inputs are never submitted with the job.
    job_form_end = page.index("</form>")
    assert page.index('id="planner-form"') > job_form_end
    assert finders.find("portal/planner.js")


# --- estimates against the reference trainer ------------------------------------------------


def test_estimates_agree_with_memory_measured_in_the_reference_trainer():
    from trainer import planner_check

    rows = planner_check.compare()
    assert rows
    for row in rows:
        if row["part"] in ("weights", "grads", "optimizer"):
            assert abs(row["ratio"] - 1) <= planner_check.STATE_TOLERANCE, row
        else:
            assert abs(row["ratio"] - 1) <= planner_check.ACTIVATION_TOLERANCE, row


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_submit_page_shows_the_recommended_layout_in_the_browser(
    live_server, make_team, make_user, settings
):
    """planner.js in headless Chromium: the job's GPU count and the shape go to the API and the
    recommendation comes back into the page; a bad shape shows the API's field message."""
    import os
    import shutil
    from pathlib import Path

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    make_user("rio", team=make_team("vision"))
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(20_000)
            page.goto(f"{live_server.url}/login/")
            page.fill("input[name=username]", "rio")
            page.fill("input[name=password]", "pw-rio")
            page.click("main button[type=submit]")
            page.goto(f"{live_server.url}/jobs/new/")
            page.fill("#id_gpus", "8")
            page.click("#planner summary")
            page.fill("#plan-params", "6.74e9")
            page.click("#planner-check")
            fits = page.wait_for_selector("#planner-result .planner-fits")
            assert "dp=8 tp=1 pp=1 ZeRO-2" in fits.inner_text()
            fastest = page.wait_for_selector("#planner-result .planner-fastest").inner_text()
            assert "what layout auto takes" in fastest and "step" in fastest
            page.fill("#plan-hidden", "4100")  # not divisible by 32 heads
            page.click("#planner-check")
            error = page.wait_for_selector("#planner-result .errorlist li")
            assert "hidden" in error.inner_text() and "not divisible" in error.inner_text()
            # The job form itself is untouched and still submits on its own.
            assert page.input_value("#id_gpus") == "8"
        finally:
            browser.close()


def test_sharded_estimates_agree_with_the_trainers_zero1_and_fsdp_ranks():
    """Two gloo processes per mode: ZeroRedundancyOptimizer holds half the AdamW state on each
    rank, FSDP2 half of everything, as the planner's ZeRO-1 and ZeRO-3 say (less the transient
    gathered units, which a measurement between steps cannot see)."""
    from trainer import planner_check

    rows = planner_check.compare_sharded()
    assert {row["part"] for row in rows} == {"weights", "grads", "optimizer"}
    assert len(rows) == 6
    for row in rows:
        assert abs(row["ratio"] - 1) <= planner_check.SHARDED_TOLERANCE, row
        if "fsdp" in row["shape"] or row["part"] == "optimizer":
            # Sharded parts: the ranks together hold one copy, not two.
            assert row["all_ranks"] < 1.05 * 2 * row["estimated"]
            assert row["measured"] < 0.55 * row["all_ranks"]
