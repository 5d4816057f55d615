"""The tiny MoE with expert parallelism trains the same model as without it: bshd, thd and dcp with EP
equal the run that keeps every expert on every rank, step for step, and the committed tiny-MoE golden
(the EP case's reference case). The runner's EP configuration: case id, execution model, bad input."""

from __future__ import annotations

import pytest

from harness.apps import converge
from harness.jobs.launch import run_on_ranks
from harness.parallel.expert_parallel import ExpertParallelError
from harness.train.layouts import LayoutError
from harness.train.trainer import TrainConfig, execution_line, train

EP = TrainConfig(model="tiny-moe", steps=50, expert_parallel=True)


def test_case_id_reference_and_execution_model():
    assert converge.case_id(EP, 4) == "converge__tiny_moe__w4_ep__fp32"
    ref, world = converge.reference_case(EP, 4)
    assert (ref.expert_parallel, world) == (False, 4)
    assert converge.case_id(ref, world) == "converge__tiny_moe__w4__fp32"  # the committed golden
    assert execution_line(EP, 4) == ("execution model: synchronous (MoE with expert parallelism over the 4-rank "
                                     "DP x CP domain)")
    assert execution_line(TrainConfig(), 4).startswith("execution model: independent (dense model")
    assert execution_line(TrainConfig(model="tiny-moe"), 4).startswith(
        "execution model: independent (MoE without expert parallelism")
    pipe = execution_line(TrainConfig(model="tiny-moe", pp=2, expert_parallel=True), 4)
    assert pipe.startswith("execution model: pipeline pp 2, 1f1b (2 stages") and "2-rank DP x CP domain" in pipe


@pytest.mark.parametrize("cfg, world, error, match", [
    (TrainConfig(expert_parallel=True), 4, LayoutError, r"expert parallelism needs an MoE model; 'tiny-gpt' has no"),
    (TrainConfig(model="tiny-moe", expert_parallel=True), 8, ExpertParallelError,
     r"'tiny-moe''s 4 experts over the 8-rank DP x CP domain: 4 is not a multiple of 8; use a domain"),
])
def test_expert_parallel_configs_the_world_cannot_run(cfg, world, error, match, tmp_path):
    with pytest.raises(error, match=match):
        converge.run(cfg, world=world, out_root=tmp_path, progress=lambda s: None, report=False)
    assert list(tmp_path.iterdir()) == []


def test_the_ep_case_writes_no_golden_of_its_own(tmp_path):
    with pytest.raises(LayoutError, match=r"non-expert-parallel case .* --model tiny-moe --world 4 --steps 50"):
        converge.run(EP, world=4, out_root=tmp_path, golden="update", progress=lambda s: None, report=False)


@pytest.mark.slow
@pytest.mark.dist_cpu
def test_expert_parallel_layouts_equal_the_run_without(tmp_path):
    """4 ranks (one expert each), 5 steps: every layout with EP within 1e-5 of the same layout without
    it, and of bshd with EP (the MoE rule's exact span is the first 20 steps)."""
    cfg = {"model": "tiny-moe", "steps": 5}
    got = {ep: run_on_ranks(train, world_size=4, tmp_path=tmp_path / str(ep), args=({**cfg, "expert_parallel": ep},),
                            timeout_s=900)[0]["layouts"] for ep in (False, True)}
    for layout in ("bshd", "thd", "dcp"):
        for a, b, ref in zip(got[True][layout], got[False][layout], got[True]["bshd"], strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["loss"] - ref["loss"]) <= 1e-5, (layout, a["step"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * b["grad_norm"], (layout, a["step"])
            assert a["microbatches"] == b["microbatches"] or layout == "dcp"


@pytest.mark.slow
def test_expert_parallel_equals_the_committed_tiny_moe_golden(tmp_path):
    res = converge.run(EP, world=4, golden="require", out_root=tmp_path, progress=lambda s: None, report=False)
    assert res.case_id == "converge__tiny_moe__w4_ep__fp32"
    assert res.config["golden"].endswith("converge__tiny_moe__w4__fp32.cpu.json")
    assert res.verdict == "PASS", [c for c in res.checks if not c["pass"]]
    assert sum("golden" in c["target"] for c in res.checks) >= 3
