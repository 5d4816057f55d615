"""Pipelines against the committed PP = 1 goldens (50 steps, fp32, gloo): PP 2 x 2 (4 processes, the
PP = 1 case on 2 ranks at 512 tokens per rank) and PP 2 x 4 (8 processes, the main job's 4-rank case),
with and without interleaving, tiny GPT and tiny MoE (the MoE rule as everywhere), and PP 2 x 2 of
multi-token prediction (the MTP block on the last stage) and of the hybrid SSM model. Slow: 1.5-4
minutes each on 2 cores."""

from __future__ import annotations

import pytest

from harness.apps import converge
from harness.train.trainer import TrainConfig

pytestmark = pytest.mark.slow

CASES = [("tiny-gpt", 4, 1), ("tiny-gpt", 4, 2), ("tiny-gpt", 8, 1), ("tiny-gpt", 8, 2),
         ("tiny-moe", 4, 1), ("tiny-moe", 8, 1), ("tiny-moe", 8, 2),
         ("tiny-gpt-mtp", 4, 2), ("tiny-hybrid", 4, 1)]


@pytest.mark.parametrize("model, world, vpp", CASES, ids=[f"{m}-w{w}-vpp{v}" for m, w, v in CASES])
def test_pipeline_equals_its_pp1_golden(model, world, vpp, tmp_path):
    cfg = TrainConfig(model=model, steps=50, pp=2, vpp=vpp, max_seqlen_per_rank=512 if world == 4 else 256)
    res = converge.run(cfg, world=world, golden="require", out_root=tmp_path, progress=lambda s: None, report=False)
    ref_cfg, ref_world = converge.reference_case(cfg, world)
    assert res.config["golden"].endswith(f"{converge.case_id(ref_cfg, ref_world)}.cpu.json")
    assert res.verdict == "PASS", [c for c in res.checks if not c["pass"]]
    assert sum("golden" in c["target"] for c in res.checks) >= 3
