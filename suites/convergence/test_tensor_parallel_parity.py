"""Tensor parallelism trains the same model as the unsplit run: bshd, thd and dcp with 2 TP ranks per position equal
the TP = 1 run of the same DP x CP domain (fp32, gloo), also with the distributed optimiser and under a pipeline with
multi-token prediction; and
``converge`` judges a TP run against its one-rank reference, which catches a TP bug every layout shares."""

from __future__ import annotations

import pytest

from harness.apps import converge
from harness.train.trainer import TrainConfig
from suites.convergence.test_pipeline_parity import _agree, _rows

pytestmark = [pytest.mark.dist_cpu, pytest.mark.usefixtures("shared_zygote")]


def test_case_id_and_the_case_a_tp_run_must_equal():
    cfg = TrainConfig(tp=2, max_seqlen_per_rank=512)
    assert converge.case_id(cfg, 4) == "converge__tiny_gpt__w4_tp2__m512__fp32"
    ref, world = converge.reference_case(cfg, 4)
    assert (ref.tp, world) == (1, 2) and converge.case_id(ref, world) == "converge__tiny_gpt__w2__m512__fp32"
    both, world = converge.reference_case(TrainConfig(tp=2, pp=2), 8)
    assert (both.tp, both.pp, world) == (1, 1, 2)


def test_tiny_gpt_with_two_tp_ranks_equals_the_unsplit_run(tmp_path_factory):
    _agree(_rows("tiny-gpt", 4, tmp_path_factory, "tp2", tp=2), _rows("tiny-gpt", 2, tmp_path_factory, "ref"))


def test_a_padded_vocabulary_trains_the_unpadded_model(tmp_path_factory):
    """256 ids padded to 400 rows (Megatron's make-vocab-size-divisible-by 100 x tp 2): the padding's rows zero, their
    logits masked; dcp against the TP = 1 run of the unpadded model."""
    got = _rows("tiny-gpt", 4, tmp_path_factory, "tp2-vocab400", layouts=["dcp"], tp=2, make_vocab_size_divisible_by=100)
    _agree(got, {"dcp": _rows("tiny-gpt", 2, tmp_path_factory, "ref")["dcp"]}, layouts=("dcp",))


def test_a_chunked_loss_head_trains_the_model_whose_logits_are_whole(tmp_path_factory):
    """The LM head and its loss over chunks of 48 tokens (``loss_chunk``: a partial last chunk in every micro-batch)
    of each TP rank's padded vocabulary shard (256 ids, 400 rows): dcp against the TP = 1 run that computes the whole
    logits."""
    got = _rows("tiny-gpt", 4, tmp_path_factory, "tp2-chunk48", layouts=["dcp"], tp=2, loss_chunk=48,
                make_vocab_size_divisible_by=100)
    _agree(got, {"dcp": _rows("tiny-gpt", 2, tmp_path_factory, "ref")["dcp"]}, layouts=("dcp",))


@pytest.mark.parametrize("kw", [{"cp_exchange": "ring"}, {"cp_exchange": "a2a"}, {"token_bucket": 16},
                                {"weights": "fused"}], ids=["ring", "a2a", "bucket16", "fused"])
def test_tensor_parallelism_with_the_ring_exchange_the_token_bucket_and_fused_weights(kw, tmp_path_factory):
    """The paths a TP run shares with the rest of the step: the ring K/V exchange of the blocks' local heads, the a2a
    exchange of their heads (each TP rank's 2 query heads over a 2-rank CP block, its one K/V head copied), padded
    micro-batches, the weight-gradient GEMM accumulating into a shard's ``.grad``; each against the TP = 1 run with
    the same option."""
    name = "-".join(f"{k}{v}" for k, v in kw.items())
    got = _rows("tiny-gpt", 4, tmp_path_factory, f"tp2-{name}", layouts=["dcp"], tp=2, **kw)
    _agree(got, _rows("tiny-gpt", 2, tmp_path_factory, f"ref-{name}", layouts=["dcp"], **kw), layouts=("dcp",))


def test_the_tiny_moe_with_expert_tensor_parallelism_equals_the_unsplit_run(tmp_path_factory):
    """Every expert's FFN split over 2 TP ranks, the router replicated (reading the plain rows), dcp (bshd and thd: the
    dense TP cases): losses and gradient norms within 1e-5 of the TP = 1 run (its routes the same: the runs pass the
    loss rule's 1e-5)."""
    got = _rows("tiny-moe", 4, tmp_path_factory, "moe-tp2", layouts=["dcp"], tp=2, moe_aux_loss=1e-2)
    ref = _rows("tiny-moe", 2, tmp_path_factory, "moe-ref", moe_aux_loss=1e-2)
    _agree(got, {"dcp": ref["dcp"]}, layouts=("dcp",))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_the_hybrid_with_its_ssm_mixers_split_over_tp_equals_the_unsplit_run(sp, tmp_path_factory):
    """"M*M-" with 2 TP ranks: each mixer's heads split over TP (then over a CP block's ranks), its B / C projection
    and conv replicated with their gradients summed over TP, the gated norm's mean square summed over TP; with sequence
    parallelism its rows gathered in and reduce-scattered out. dcp against the TP = 1 run (the pipeline parity's)."""
    got = _rows("tiny-hybrid", 4, tmp_path_factory, "hybrid-tp2" + "-sp" * sp, layouts=["dcp"], tp=2,
                sequence_parallel=sp)
    _agree(got, _rows("tiny-hybrid", 2, tmp_path_factory, "tiny-hybrid-ref", layouts=["dcp"]), layouts=("dcp",))


def test_the_distributed_optimiser_with_tensor_parallelism_equals_the_unsplit_replicated_run(tmp_path_factory):
    """Each TP coordinate's DP x CP ranks shard its AdamW; the norm counts the split parameters' pieces over the TP
    group and the replicated ones once (``DistributedOptimizer.local_square_norm``). Buckets of 30,000 elements: split
    and replicated parameters share buckets and pieces."""
    got = _rows("tiny-gpt", 4, tmp_path_factory, "tp2-dist-opt", layouts=["dcp"], tp=2, optimizer="distributed",
                grad_bucket_elements=30_000)
    ref = _rows("tiny-gpt", 2, tmp_path_factory, "ref")
    _agree(got, {"dcp": ref["dcp"]}, layouts=("dcp",))


def test_mtp_under_a_pipeline_with_tensor_parallelism_equals_one_unsplit_rank(tmp_path_factory):
    """2 stages x 2 TP ranks: the MTP block (split) on the last stage, its embedding a replica of the first stage's,
    the pipeline's point-to-point links between ranks of one TP coordinate; the LM loss and the MTP depth's through the
    chunked head (96 tokens a chunk) against a reference whose logits are whole."""
    one = {"layouts": ["dcp"], "max_seqlen_per_rank": 1024}  # a domain of one rank holds the longest sequence
    got = _rows("tiny-gpt-mtp", 4, tmp_path_factory, "mtp-pp2-tp2", pp=2, tp=2, loss_chunk=96, **one)
    ref = _rows("tiny-gpt-mtp", 1, tmp_path_factory, "mtp-ref1", **one)
    _agree(got, ref, layouts=("dcp",))
    for a, b in zip(got["dcp"], ref["dcp"], strict=True):
        assert abs(a["mtp_loss"][0] - b["mtp_loss"][0]) <= 1e-5, a["step"]


def test_tensor_pipeline_and_dynamic_cp_at_once_equal_the_unsplit_run(tmp_path_factory):
    """8 ranks: 2 stages x a 2-rank DP x CP domain x 2 TP ranks, every layout."""
    _agree(_rows("tiny-gpt", 8, tmp_path_factory, "pp2-tp2", pp=2, tp=2), _rows("tiny-gpt", 2, tmp_path_factory, "ref"))


CFG = TrainConfig(tp=2, steps=2, layouts=("bshd", "dcp"), max_seqlen_per_rank=512)


@pytest.mark.parametrize("plant", [None, "tp-input-grad-not-reduced"])
def test_converge_judges_a_tp_run_against_its_unsplit_reference(plant, tmp_path):
    """Clean: every reference line passes. Planted (the input's gradient never all-reduced over TP, in every
    layout): bshd and dcp still agree with each other - both run the bug - and only the one-rank reference, which has
    no TP, fails them."""
    res = converge.run(CFG, world=4, out_root=tmp_path, progress=lambda s: None, plant=plant, report=False)
    ref = [c for c in res.checks if "vs reference (1 rank: no CP, PP, TP or EP)" in c["target"]]
    assert ref and all(c["target"].startswith(("bshd (tp 2)", "dcp (tp 2)")) for c in ref)
    if plant is None:
        assert res.verdict == "PASS", [c["target"] for c in res.checks if not c["pass"]]
        return
    between = [c for c in res.checks if c["target"].startswith("dcp vs bshd")]
    assert between and all(c["pass"] for c in between)
    failed = [c["target"] for c in ref if not c["pass"]]
    assert any("step-1 gradients" in t for t in failed) and res.verdict == "FAIL", failed


# ------------------------------------------------------------------------------------------ sequence parallelism
def test_sequence_parallelism_equals_the_unsplit_run_every_layout(tmp_path_factory):
    """2 TP ranks with the blocks' token rows split over them (each sequence padded to a multiple of tp times its CP
    divisor, the split norms' gradients summed over TP) against the TP = 1 run, bshd, thd and dcp."""
    _agree(_rows("tiny-gpt", 4, tmp_path_factory, "tp2-sp", tp=2, sequence_parallel=True),
           _rows("tiny-gpt", 2, tmp_path_factory, "ref"))


def test_the_tiny_moe_under_sequence_parallelism_equals_the_unsplit_run(tmp_path_factory):
    """Each TP rank's router routes its half of the rows (the router marked for the TP sum of its gradient, the z-loss
    summed over TP, the balance loss's counts summed over TP and the CP block), the split experts run on both halves; dcp against the TP = 1 run, losses, gradient
    norms and the z-loss within 1e-5, and the routes - recorded by each TP rank for its own rows - the same."""
    got = _rows("tiny-moe", 4, tmp_path_factory, "moe-tp2-sp", layouts=["dcp"], tp=2, sequence_parallel=True,
                moe_aux_loss=1e-2)
    # bshd / thd: the dense SP cases above
    ref = {"dcp": _rows("tiny-moe", 2, tmp_path_factory, "moe-ref", moe_aux_loss=1e-2)["dcp"]}
    _agree(got, ref, layouts=("dcp",))
    for layout in ref:
        for a, b in zip(got[layout], ref[layout], strict=True):
            assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-5 * b["aux_loss"], (layout, a["step"])
            assert a["route_digest"] == b["route_digest"], (layout, a["step"])


def test_expert_parallelism_with_tensor_and_sequence_parallelism_equals_the_unsplit_run(tmp_path_factory):
    """The tiny MoE's 4 experts over each TP coordinate's 2-rank domain (2 a rank), every expert's FFN split over the 2
    TP ranks, the token rows split too: each TP rank dispatches its gathered rows to the experts' owners and the
    weighted partial outputs reduce-scatter back; the experts' gradient norm summed over the domain and TP. dcp (made
    for the synchronous model) against the TP = 1 run without EP, losses and gradient norms within 1e-5."""
    got = _rows("tiny-moe", 4, tmp_path_factory, "moe-ep-tp2-sp", layouts=["dcp"], tp=2, sequence_parallel=True,
                expert_parallel=True, moe_aux_loss=1e-2)
    _agree(got, {"dcp": _rows("tiny-moe", 2, tmp_path_factory, "moe-ref", moe_aux_loss=1e-2)["dcp"]}, layouts=("dcp",))


@pytest.mark.parametrize("kw", [{"optimizer": "distributed", "grad_bucket_elements": 30_000},
                                {"token_bucket": 16, "loss_chunk": 40}], ids=["dist-opt", "bucket16"])
def test_sequence_parallelism_with_the_distributed_optimiser_and_a_token_bucket(kw, tmp_path_factory):
    """The norms' TP sum before the distributed optimiser's reduce-scatter; micro-batches grown to a token bucket
    (its multiples kept a multiple of tp), with the chunked loss head on the rows the stack gathers for it. Each against
    the TP = 1 replicated run without a bucket, whose logits are whole."""
    name = "-".join(f"{k}{v}" for k, v in kw.items())
    got = _rows("tiny-gpt", 4, tmp_path_factory, f"tp2-sp-{name}", layouts=["dcp"], tp=2, sequence_parallel=True,
                **kw)
    ref = _rows("tiny-gpt", 2, tmp_path_factory, "ref")
    _agree(got, {"dcp": ref["dcp"]}, layouts=("dcp",))


def test_sequence_parallel_pipeline_and_dynamic_cp_at_once_equal_the_unsplit_run(tmp_path_factory):
    """8 ranks: 2 stages x a 2-rank DP x CP domain x 2 TP ranks, sequence-parallel, every layout; each stage hands
    the next its TP rank's share of the rows."""
    _agree(_rows("tiny-gpt", 8, tmp_path_factory, "pp2-tp2-sp", pp=2, tp=2, sequence_parallel=True),
           _rows("tiny-gpt", 2, tmp_path_factory, "ref"))


def test_mtp_under_a_pipeline_with_sequence_parallelism_equals_one_unsplit_rank(tmp_path_factory):
    """2 stages x 2 TP ranks, sequence-parallel: the MTP depth's block splits its rows as the trunk's does (its
    combine, on whole rows, replicated), the stages hand on their TP rank's share of the rows."""
    one = {"layouts": ["dcp"], "max_seqlen_per_rank": 1024}
    got = _rows("tiny-gpt-mtp", 4, tmp_path_factory, "mtp-pp2-tp2-sp", pp=2, tp=2, sequence_parallel=True, **one)
    ref = _rows("tiny-gpt-mtp", 1, tmp_path_factory, "mtp-ref1", **one)
    _agree(got, ref, layouts=("dcp",))
    for a, b in zip(got["dcp"], ref["dcp"], strict=True):
        assert abs(a["mtp_loss"][0] - b["mtp_loss"][0]) <= 1e-5, a["step"]


SP_CFG = TrainConfig(tp=2, sequence_parallel=True, steps=2, layouts=("bshd", "dcp"), max_seqlen_per_rank=512)


# the clean case is slow: the parity tests above hold a clean SP run to the TP = 1 run, the planted case the reference
# lines under SP, and the TP case above (clean) converge's whole-gradient lines of a TP run
@pytest.mark.parametrize("plant", [pytest.param(None, marks=pytest.mark.slow), "sp-gather-grad-reduce-scattered"])
def test_converge_judges_a_sequence_parallel_run_against_its_unsplit_reference(plant, tmp_path):
    """Planted (the stack exit's backward reduce-scatters the replicated gradient: every block's gradient doubled, in
    every layout and on every TP rank alike): bshd and dcp agree, the replicas agree, and the one-rank reference
    fails them."""
    res = converge.run(SP_CFG, world=4, out_root=tmp_path, progress=lambda s: None, plant=plant, report=False)
    assert converge.case_id(SP_CFG, 4) == "converge__tiny_gpt__w4_tp2_sp__m512__fp32"
    ref = [c for c in res.checks if "vs reference (1 rank: no CP, PP, TP or EP)" in c["target"]]
    assert ref and all(c["target"].startswith(("bshd (tp 2, sp)", "dcp (tp 2, sp)")) for c in ref)
    if plant is None:
        assert res.verdict == "PASS", [c["target"] for c in res.checks if not c["pass"]]
        return
    assert res.verdict == "FAIL"
    assert all(c["pass"] for c in res.checks if c["target"].startswith("dcp vs bshd"))
    assert any(not c["pass"] and "step-1 gradients" in c["target"] for c in ref)
