"""Pipeline chunks priced by their work (``ModelConfig.chunk_shares``): the planner and the pipeline report's
simulator give each model chunk its FLOPs - its layers under the runtime's split, the LM head and the MTP blocks
on the last chunk - instead of an even share, which priced a chunk holding only the embedding like one holding
layers and the head."""

from __future__ import annotations

import pytest

from harness.plan import Execution
from harness.plan.bounds import simulate
from harness.plan.cost import CostModel
from harness.plan.pipeline import model_split
from harness.report.pipeline_report import execution_of
from harness.runtime.model_config import MODELS, pipeline_shares
from harness.train.config import TrainConfig


def _per_token(h: int, heads: int, kv: int, ffn: int, gated: bool, L: int) -> int:
    """A dense block's forward FLOPs per token, written out from the layers' shapes."""
    d = h // heads
    qkv, proj = 2 * h * (heads + 2 * kv) * d, 2 * heads * d * h
    scores_values = 2 * 2 * h * L // 2  # QK^T and PV, 2 FLOPs a multiply-add, causal: half
    mlp = 2 * h * ffn * (3 if gated else 2)
    return qkv + proj + scores_values + mlp


def test_tiny_gpt_on_two_stages_prices_the_head_on_the_second():
    c = MODELS["tiny-gpt"]
    block = _per_token(c.hidden, c.heads, c.kv_heads, c.ffn, True, 64)
    head = 2 * c.hidden * c.vocab
    assert c.chunk_shares(2, 1, 64) == (block, block + head)
    assert pipeline_shares("tiny-gpt", 2, 1, 128) == c.chunk_shares(2, 1, 64)  # attention at half a rank


def test_chunks_that_hold_no_layer_cost_what_they_compute():
    """tiny-gpt (2 layers) over 2 x 2 chunks counts the embedding and the loss as slots: chunk 0 only embeds
    (no FLOPs), chunk 3 only runs the head."""
    c = MODELS["tiny-gpt"]
    assert model_split(2, 2, 2) == [[(0, 0), (1, 1)], [(0, 1), (2, 0)]]
    shares = c.chunk_shares(2, 2, 64)
    block = _per_token(c.hidden, c.heads, c.kv_heads, c.ffn, True, 64)
    assert shares == (0.0, block, block, 2 * c.hidden * c.vocab)


def test_mtp_blocks_and_their_logits_sit_on_the_last_chunk():
    plain, mtp = MODELS["tiny-gpt"], MODELS["tiny-gpt-mtp"]
    h = mtp.hidden
    block = _per_token(h, mtp.heads, mtp.kv_heads, mtp.ffn, True, 64)
    extra = 2 * (2 * h) * h + block + 2 * h * mtp.vocab  # combine 2E -> E, the block, its logits
    assert mtp.chunk_shares(2, 1, 64) == (plain.chunk_shares(2, 1, 64)[0], plain.chunk_shares(2, 1, 64)[1] + extra)


def test_moe_layers_weigh_top_k_experts_and_the_router():
    c = MODELS["tiny-moe"]
    dense = c.layer_flops(0, 64)
    assert c.moe_layers() == [1, 2]
    mlp = 2 * c.hidden * c.ffn * 3
    assert c.layer_flops(1, 64) == dense - mlp + c.top_k * mlp + 2 * c.hidden * c.experts


def test_the_planner_and_the_report_price_the_same_chunks():
    cfg = TrainConfig(model="tiny-hybrid", pp=2, vpp=2, max_seqlen_per_rank=128)
    planned, _ = cfg.execution_model(4)
    assert planned.chunk_shares == pipeline_shares("tiny-hybrid", 2, 2, 128)
    recorded = {**cfg.to_dict(), "chunk_shares": list(planned.chunk_shares)}  # as converge records the config
    assert execution_of(recorded) == planned
    assert execution_of(cfg.to_dict()).chunk_shares is None  # a result from before: planned with even shares
    assert TrainConfig().execution_model(4)[0].chunk_shares is None  # no pipeline, no shares


def test_a_heavier_last_stage_lengthens_the_simulated_pipeline():
    """The simulator sees the shares: one stage doing 0.58 of the work makes the step longer than the even
    split's 0.5 (the pipeline runs at its slowest stage's pace)."""
    from harness.plan.layout import Block, Schedule

    c = MODELS["tiny-gpt"]
    cost = CostModel.affine_quadratic(0.0, 1.0)
    s = Schedule.from_blocks([[Block(0, 1, (g,))] for g in range(8)], lengths=[64] * 8, n_ranks=1,
                             max_seqlen_per_rank=64, cost=cost)
    even = simulate(s, cost, Execution.pipeline(2)).step_time
    priced = simulate(s, cost, Execution.pipeline(2, chunk_shares=c.chunk_shares(2, 1, 32))).step_time
    heavy = max(c.chunk_shares(2, 1, 32)) / sum(c.chunk_shares(2, 1, 32))
    assert heavy > 0.55 and priced > even * 1.05


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_s_split_is_priced_chunk_by_chunk(model):
    c = MODELS[model]
    for pp, vpp in ((2, 1), (2, 2), (4, 1)):
        try:
            ranges = model_split(c.layers, pp, vpp)
        except ValueError:
            continue
        shares = c.chunk_shares(pp, vpp, 128)
        assert len(shares) == pp * vpp and sum(shares) > 0 and min(shares) >= 0
        for s, chunks in enumerate(ranges):  # a chunk with layers (or the head) costs something
            for v, (_, n) in enumerate(chunks):
                assert (shares[v * pp + s] > 0) == (n > 0 or v * pp + s == pp * vpp - 1)
