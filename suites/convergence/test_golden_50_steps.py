"""Convergence cases against their committed goldens (50 steps, fp32, gloo): the main job's 4-rank
tiny GPT and 2-rank hybrid, and 4-rank multi-token prediction and hybrid. Slow: 1.5-4 minutes each on
2 cores."""

from __future__ import annotations

import pytest

from harness.apps import converge
from harness.train.trainer import TrainConfig

pytestmark = pytest.mark.slow

CASES = [("tiny-gpt", 4, None, "converge__tiny_gpt__w4__fp32"),
         ("tiny-gpt-mtp", 4, None, "converge__tiny_gpt_mtp__w4__fp32"),
         ("tiny-hybrid", 4, None, "converge__tiny_hybrid__w4__fp32"),
         ("tiny-hybrid", 2, 512, "converge__tiny_hybrid__w2__m512__fp32"),
         ("tiny-gpt-mtp", 2, 512, "converge__tiny_gpt_mtp__w2__m512__fp32")]


@pytest.mark.parametrize("model, world, mslpr, case", CASES, ids=[c[3] for c in CASES])
def test_case_equals_its_golden(model, world, mslpr, case, tmp_path):
    kw = {"max_seqlen_per_rank": mslpr} if mslpr else {}
    res = converge.run(TrainConfig(model=model, steps=50, **kw), world=world, golden="require", out_root=tmp_path,
                       progress=lambda s: None, report=False)
    assert res.case_id == case
    assert res.verdict == "PASS", [c for c in res.checks if not c["pass"]]
    assert sum("golden" in c["target"] for c in res.checks) >= 3
    if model == "tiny-gpt-mtp":  # the MTP loss is compared with the golden's too, not only the total
        assert any("golden" in c["target"] and "MTP depth 1" in c["target"] for c in res.checks), [c["target"] for c in res.checks]
