"""Pipelines train the same model as one stage: bshd, thd and dcp under PP 2 (1F1B, AFAB, interleaved
VPP 2, schedules computed once or by every stage) equal the PP = 1 run of the same DP x CP domain
within 1e-5 at every step (fp32, gloo). Short runs; the 50-step goldens are the slow suite's."""

from __future__ import annotations

import json

import pytest

from harness.jobs.launch import run_on_ranks
from harness.train.trainer import train
from suites.computed_once import computed_once

pytestmark = pytest.mark.dist_cpu

BASE = {"steps": 3, "max_seqlen_per_rank": 512, "corpus": {"sequences_per_batch": 16}}
PIPELINES = {"pp2": {"pp": 2}, "pp2-vpp2": {"pp": 2, "vpp": 2},
             "pp2-afab-compute": {"pp": 2, "pipeline": "afab", "schedule_delivery": "compute"}}


def _rows(model: str, world: int, tmp_path_factory, name: str, **kw) -> dict:
    """One training run's rows, once per test session (the xdist workers share the references)."""
    cfg = {**BASE, "model": model, **kw}
    return computed_once(tmp_path_factory, f"pipeline-parity-{model}-{world}-{json.dumps(kw, sort_keys=True)}",
                         lambda: run_on_ranks(train, world_size=world, tmp_path=tmp_path_factory.mktemp(name),
                                              args=(cfg,), timeout_s=600)[0]["layouts"])


def _agree(got: dict, ref: dict, layouts=("bshd", "thd", "dcp")) -> None:
    assert set(got) == set(ref) == set(layouts)
    for layout in ref:
        for a, b in zip(got[layout], ref[layout], strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5, (layout, a["step"], a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (layout, a["step"])


@pytest.mark.parametrize("name", list(PIPELINES))
def test_tiny_gpt_pipelines_equal_one_stage(name, tmp_path_factory):
    ref = _rows("tiny-gpt", 2, tmp_path_factory, "ref")
    got = _rows("tiny-gpt", 4, tmp_path_factory, name, **PIPELINES[name])
    _agree(got, ref)
    if name == "pp2-vpp2":  # the interleaved schedule ran micro-batch counts aligned to its group
        assert all(r["microbatches"] % 2 == 0 for rows in got.values() for r in rows)
    timeline = got["dcp"][0]["timeline"]
    assert sorted(t["stage"] for t in timeline) == [0, 0, 1, 1]
    assert all(len(t["events"]) == 2 * len(t["cp_sizes"]) * (2 if name == "pp2-vpp2" else 1) for t in timeline)


def test_tiny_moe_pipeline_equals_one_stage(tmp_path_factory):
    """With the routers' sequence-level balance loss (the TP cases share its one-stage run)."""
    _agree(_rows("tiny-moe", 4, tmp_path_factory, "moe-pp", pp=2, moe_aux_loss=1e-2),
           _rows("tiny-moe", 2, tmp_path_factory, "moe-ref", moe_aux_loss=1e-2))


@pytest.mark.parametrize("model, kw", [("tiny-gpt-mtp", {"pp": 2, "vpp": 2}),
                                       ("tiny-gpt-mtp", {"pp": 2, "optimizer": "distributed"}),
                                       ("tiny-hybrid", {"pp": 2})],
                         ids=["mtp-pp2-vpp2", "mtp-pp2-dist-opt", "hybrid-pp2"])
def test_mtp_and_hybrid_pipelines_equal_one_stage(model, kw, tmp_path_factory):
    """The MTP block runs on the last stage (the trunk's output head, and a replica of the first stage's embedding:
    ``harness.train.shared_embedding``); the SSM mixers sit on both stages of "M*M-". Both still train exactly as
    one stage (the dynamic-CP layout here; bshd and thd under PP are the 50-step goldens' in the slow suite). Under the
    distributed optimiser the replica's gradient joins the first stage's before the reduce-scatter (Megatron-LM issue
    #844: combined after it, the copies add partial sums)."""
    got = _rows(model, 4, tmp_path_factory, model + "-" + "-".join(map(str, kw.values())), layouts=["dcp"], **kw)
    ref = _rows(model, 2, tmp_path_factory, model + "-ref", layouts=["dcp"])
    _agree(got, ref, layouts=("dcp",))
    if model == "tiny-gpt-mtp":
        for a, b in zip(got["dcp"], ref["dcp"], strict=True):
            assert abs(a["mtp_loss"][0] - b["mtp_loss"][0]) <= 1e-5, a["step"]


@pytest.mark.parametrize("optimizer", ["replicated", "distributed"])
def test_mtp_on_three_stages_with_a_middle_stage_between_the_embeddings_equals_one_stage(optimizer, tmp_path_factory):
    """3 stages of a 2-rank domain: the first embeds only, the middle runs layer 0 and holds no copy of the embedding
    (it joins the replica's gradient sum with zeros and receives the refreshed table into its unused copy), the
    last runs layer 1, the head and the MTP block on its replica."""
    got = _rows("tiny-gpt-mtp", 6, tmp_path_factory, f"mtp-pp3-{optimizer}", layouts=["dcp"], pp=3, optimizer=optimizer)
    ref = _rows("tiny-gpt-mtp", 2, tmp_path_factory, "tiny-gpt-mtp-ref", layouts=["dcp"])
    _agree(got, ref, layouts=("dcp",))
    assert sorted(t["stage"] for t in got["dcp"][0]["timeline"]) == [0, 0, 1, 1, 2, 2]
    for a, b in zip(got["dcp"], ref["dcp"], strict=True):
        assert abs(a["mtp_loss"][0] - b["mtp_loss"][0]) <= 1e-5, a["step"]


def test_fewer_micro_batches_than_stages_and_a_single_one(tmp_path_factory):
    """One short sequence a step: one micro-batch per step on a 2-stage pipeline (1F1B warm-up capped).
    (With two, the pipeline execution model prefers two micro-batches: they fill the pipeline.)"""
    kw = {"corpus": {"sequences_per_batch": 1, "lengths": "uniform:min=20,max=60"}, "layouts": ["dcp"]}
    got = _rows("tiny-gpt", 4, tmp_path_factory, "one", pp=2, **kw)
    ref = _rows("tiny-gpt", 2, tmp_path_factory, "one-ref", **kw)
    assert [r["microbatches"] for r in got["dcp"]] == [1, 1, 1]
    for a, b in zip(got["dcp"], ref["dcp"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5
