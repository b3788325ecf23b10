"""Memory planner (trainer/planner.py), its layout search: enumerating dp x tp x pp x ZeRO
layouts, the recommendation, and the step-time model's fixed costs (trainer/step_time.py) behind
the fastest layout `--layout auto` takes (trainer/layout.py)."""

from dataclasses import replace

import pytest

from tests.planner_helpers import HAND, HAND_PARAMS, LLAMA_70B, GiB
from trainer import planner
from trainer import step_time as step_time_model
from trainer.layout import NEAR_TIE, choose
from trainer.planner import ClusterShape, ModelShape, evaluate, plan
from trainer.step_time import H100_NODE, step_time

# --- enumeration and recommendation -------------------------------------------------------


def test_layouts_keep_tp_inside_a_node_pp_dividing_layers_and_use_every_gpu():
    result = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=512, gpus_per_node=8))
    assert {lay.tp for lay in result.layouts} == {1, 2, 4, 8}
    assert {lay.pp for lay in result.layouts} == {1, 2, 4, 8, 16}  # divisors of 80 and 512
    assert all(lay.dp * lay.tp * lay.pp == 512 for lay in result.layouts)
    assert {lay.zero for lay in result.layouts} == {0, 1, 2, 3}


def test_the_search_evaluates_only_divisor_layouts_so_it_does_not_grow_with_the_cluster(
    monkeypatch,
):
    """The search walks divisors of the node size and the layer count, not GPU counts: a
    4,096-GPU cluster evaluates as many layouts as a 512-GPU one (its speed, in seconds, is
    bench/planner_speed.py's to measure, not a test's)."""
    evaluated = []
    real = planner.evaluate

    def counting(*args, **kwargs):
        evaluated.append(args[2:6])
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "evaluate", counting)
    counts = {}
    for gpus in (512, 4096):
        evaluated.clear()
        result = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=gpus))
        counts[gpus] = len(evaluated)
        assert len(set(evaluated)) == len(evaluated) == len(result.layouts)  # no repeats
    assert counts == {512: 80, 4096: 80}


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


# --- step time and the fastest layout -----------------------------------------------------


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
