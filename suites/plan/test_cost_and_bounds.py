"""cp_min, cost models, the lower bound and the step-time simulation on hand-checked cases."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan import CostModel, PlanInputError, Schedule, cp_min, lower_bound, quality, schedule, simulate
from harness.plan.layout import Block


@pytest.mark.parametrize("L, expected", [(1, 1), (3072, 1), (3073, 2), (6144, 2), (6145, 4), (12288, 4),
                                         (12289, 8), (24576, 8), (49152, 16)])
def test_cp_min_table(L, expected):  # spec 2.1, mslpr 3072
    assert cp_min(L, 3072) == expected


@pytest.mark.parametrize("L, expected", [(100, 2), (3072, 2), (6145, 4)])
def test_cp_min_respects_min_cp(L, expected):
    assert cp_min(L, 3072, min_cp_size=2) == expected


@given(L=st.integers(1, 2**40), mslpr=st.integers(1, 2**20))
def test_cp_min_equals_upstream_float_formula(L, mslpr):
    """Upstream: max(1, 2 ** ceil(log2(L / mslpr))); ours is integer arithmetic."""
    assert cp_min(L, mslpr) == max(1, 2 ** math.ceil(math.log2(L / mslpr)))


def test_cp_min_rejects_empty_sequences():
    with pytest.raises(PlanInputError, match="must be positive, got 0"):
        cp_min(0, 1024)


def test_model_shape_cost_counts_training_flops():
    c = CostModel.from_model_shape(num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2)
    # forward per token: QKV 2*4*12 + out 2*4*4 + MLP 2*2*4*8 = 96+32+128 = 256; x3 for fwd+bwd
    assert c.linear == 3 * 256
    # forward attention 4*L^2*h halved by causality = 8 L^2; x3
    assert c.quadratic == 3 * 8
    gqa = CostModel.from_model_shape(num_layers=1, hidden_size=4, ffn_hidden_size=8, num_attention_heads=2,
                                     num_query_groups=1, cp_comm_flops_per_byte=10, gated_mlp=True)
    assert gqa.linear == 3 * (2 * 4 * (4 + 4) + 32 + 2 * 4 * 8 * 3)
    assert gqa.cp_comm == 3 * 1 * 2 * 2 * 2 * 10  # kv bytes per token x flops/byte
    with pytest.raises(PlanInputError, match="divisible"):
        CostModel.from_model_shape(num_layers=1, hidden_size=6, ffn_hidden_size=8, num_attention_heads=4)


def test_seq_cost_and_comm():
    c = CostModel(quadratic=1.0, linear=10.0, constant=4.0, cp_comm=2.0)
    assert c.seq_cost(10, 1) == 100 + 100 + 4
    assert c.seq_cost(10, 4) == 204 / 4 + 2 * 10 * 3 / 4
    with pytest.raises(PlanInputError, match="finite number >= 0"):
        CostModel(linear=-1.0)


def _sched(layout, lengths, n, **kw):
    return Schedule.from_blocks(layout, lengths=lengths, n_ranks=n, max_seqlen_per_rank=100, **kw)


def test_simulation_waits_for_the_slowest_member():
    # mb0: rank 0 runs 40 tokens (1600), rank 1 runs 10 (100); mb1: one block of both ranks, 20 tokens
    s = _sched([[Block(0, 1, (0,)), Block(1, 1, (1,))], [Block(0, 2, (2,))]], [(0, 40), (1, 10), (2, 20)], 2)
    sim = simulate(s)
    assert sim.step_time == 1600 + 200 and sim.waiting == [0.0, 1500.0] and sim.busy == [1800.0, 300.0]


def test_lower_bound_terms():
    c = CostModel(quadratic=0.0, linear=1.0, per_microbatch=5.0)
    # 300 tokens of rank-time / 2 ranks + 5 per micro-batch * ceil(300 / (2 * 100)) = 150 + 10
    assert lower_bound([100, 100, 100], n_ranks=2, max_seqlen_per_rank=100, cost=c) == 160
    assert lower_bound([100, 100, 100], n_ranks=2, max_seqlen_per_rank=100, cost=c, vpp_group=4) == 170
    # one sequence dominates when CP communication makes widening it costly:
    # area / N = 400^2 / 4 = 40000, but its best per-rank time is min(160000, 80000 + 20000, 40000 + 30000)
    c = CostModel(quadratic=1.0, cp_comm=100.0)
    assert lower_bound([400], n_ranks=4, max_seqlen_per_rank=400, cost=c) == 70000
    assert lower_bound([400, 1], n_ranks=4, max_seqlen_per_rank=100, cost=CostModel.megatron()) == (400**2 + 1) / 4
    assert lower_bound([], n_ranks=4, max_seqlen_per_rank=100) == 0.0


def test_a_fixed_cost_per_cp_block_is_simulated_and_bounded():
    """``cp_block`` is charged once per block of more than one rank, by the simulator and the bound:
    the 200-token sequence needs a CP-2 block (100 + 5 + 7), the others run at cp 1 (100 + 5)."""
    c = CostModel(quadratic=0.0, linear=1.0, per_microbatch=5.0, cp_block=7.0)
    assert (c.block_overhead(1), c.block_overhead(2), c.block_overhead(8)) == (5.0, 12.0, 12.0)
    s = _sched([[Block(0, 2, (0,))], [Block(0, 1, (1,)), Block(1, 1, (2,))]], [(0, 200), (1, 100), (2, 100)], 2)
    assert simulate(s, c).step_time == 112 + 105
    # area 400 / 2 + 5 x 2 micro-batches + 7 x (200 CP tokens / 100 per rank-block / 2 ranks) = 217: tight
    assert lower_bound([200, 100, 100], n_ranks=2, max_seqlen_per_rank=100, cost=c) == 217
    assert lower_bound([200], n_ranks=2, max_seqlen_per_rank=100, cost=c) == 112  # the sequence alone
    with pytest.raises(PlanInputError, match="cp_block"):
        CostModel(cp_block=-1.0)


def test_a_fixed_cost_per_sequence_is_paid_on_every_rank_of_its_group():
    """``per_sequence`` is not split across a block: the 200-token sequence at CP 2 costs each of its ranks
    100 + 9, each 100-token one 100 + 9 on its rank; the bound holds it too."""
    c = CostModel(quadratic=0.0, linear=1.0, per_sequence=9.0)
    assert c.seq_cost(200, 2) == 109 and c.seq_area(200, 2) == 218 and c.seq_cost(100, 1) == 109
    s = _sched([[Block(0, 2, (0,))], [Block(0, 1, (1,)), Block(1, 1, (2,))]], [(0, 200), (1, 100), (2, 100)], 2)
    assert simulate(s, c).step_time == 109 + 109
    assert lower_bound([200, 100, 100], n_ranks=2, max_seqlen_per_rank=100, cost=c) == 218  # area 436 / 2: tight
    with pytest.raises(PlanInputError, match="per_sequence"):
        CostModel(per_sequence=float("nan"))


def test_balanced_keeps_sequences_narrow_when_each_costs_every_rank_a_fixed_overhead():
    """megatron-core's step runs every sequence of a group as its own forward and backward on every rank of
    its CP group, ~40x the FLOPs of a 1K-token sequence each on 4 H200s: told so (``per_sequence``),
    ``balanced`` widens no sequence that fits one rank, and its step under that cost is no worse than the
    FLOP-only schedule's (it was 25% worse measured on megatron-core: 27 of 48 sequences at CP 2)."""
    from harness.data.workloads import sample
    from harness.plan.cost import gpt_benchmark_cost

    flops = gpt_benchmark_cost()
    heavy = replace(flops, per_sequence=40 * flops.seq_cost(1024, 1))
    widened = 0
    for seed in range(6):
        lengths = [min(x, 8192) for x in sample("lognormal:mean=1024,sigma=1.5,min=128,max=8192", 8, seed=seed)]
        kw = dict(n_ranks=4, max_seqlen_per_rank=2048, execution="synchronous")
        plain, told = schedule(lengths, cost=flops, **kw), schedule(lengths, cost=heavy, **kw)
        assert simulate(told, heavy).step_time <= simulate(plain, heavy).step_time * (1 + 1e-9)
        for mb in told.layout:
            for b in mb:
                assert all(b.size == cp_min(lengths[g], 2048) for g in b.gids), (seed, b)
        widened += sum(len(b.gids) for mb in plain.layout for b in mb
                       if any(b.size > cp_min(lengths[g], 2048) for g in b.gids))
    assert widened > 0  # the FLOP-only schedule does widen some: the cost term is what keeps them narrow


def test_quality_is_one_for_a_perfect_schedule():
    s = _sched([[Block(0, 1, (0,)), Block(1, 1, (1,))]], [(0, 50), (1, 50)], 2)
    assert quality(s) == 1.0


@pytest.mark.parametrize("field, value", [("quadratic", -1.0), ("linear", float("nan")), ("cp_comm", float("inf")),
                                          ("per_microbatch", "3")])
def test_cost_model_refuses_negative_nan_infinite_and_non_numbers(field, value):
    with pytest.raises(PlanInputError, match=rf"CostModel.{field} must be a finite number >= 0, got"):
        CostModel(**{field: value})
