"""The main job's convergence case against its committed golden (50 steps, 4 ranks): slow."""

from __future__ import annotations

import pytest

from harness import converge
from harness.dist.train import TrainConfig

pytestmark = pytest.mark.slow


def test_converge__tiny_gpt__w4__s50__fp32(tmp_path):
    res = converge.run(TrainConfig(model="tiny-gpt", steps=50), world=4, golden="require", out_root=tmp_path,
                       progress=lambda s: None)
    assert res.case_id == "converge__tiny_gpt__w4__s50__fp32"
    assert res.verdict == "PASS", res.checks
    assert any("golden" in c["target"] for c in res.checks)
