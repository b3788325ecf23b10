"""Memory planner (trainer/planner.py), its arithmetic: hand-computed formulas, ZeRO ordering,
ring traffic, the shapes it refuses, and estimates against memory measured in the reference
trainer. The layout search and step-time prediction are in tests/test_planner_layouts.py; the
`lockstep plan` CLI, POST /api/v1/plan/ and the submit page in tests/test_planner_api.py."""

import pytest

from tests.planner_helpers import HAND, HAND_PARAMS, LLAMA_70B, GiB
from trainer import planner
from trainer.planner import ClusterShape, ModelShape, PlanError, evaluate, plan

SBH = 100 * 2 * 1000  # HAND's s*b*h


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


# --- ZeRO ordering ------------------------------------------------------------------------


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


# --- shapes the planner refuses -----------------------------------------------------------


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
