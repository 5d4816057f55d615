"""The MoE routers' sequence-level balance loss under dynamic CP against converge's one-rank reference, which holds every
sequence whole on one rank: the counts of a sequence split over a CP block must be summed over that block."""

from __future__ import annotations

import pytest

from harness.apps import converge
from harness.train.trainer import TrainConfig

pytestmark = pytest.mark.usefixtures("shared_zygote")  # the jobs fork their ranks from one zygote

CFG = TrainConfig(model="tiny-moe", moe_aux_loss=1e-2, steps=2, layouts=("dcp",), max_seqlen_per_rank=256)


def test_case_id_names_the_balance_loss():
    assert converge.case_id(CFG, 4) == "converge__tiny_moe_aux0.01__w4__fp32"


@pytest.mark.parametrize("plant", [None, "moe-balance-counts-static-group"], ids=["clean", "static-group"])
def test_dynamic_cp_with_the_balance_loss_equals_the_one_rank_reference(plant, tmp_path):
    """Clean: within 1e-5 of the reference at both steps (the dcp run has blocks of more than one rank). Planted: the
    counts summed over the static group - each rank's own share of a split sequence - fail against the reference."""
    res = converge.run(CFG, world=4, golden="off", out_root=tmp_path, progress=lambda s: None, report=False,
                       plant=plant)
    failed = [c for c in res.checks if not c["pass"]]
    if plant is None:
        assert res.verdict == "PASS", failed
        assert any("micro-batches with a CP group > 1" in c["target"] and c["value"] > 0 for c in res.checks)
    else:
        assert res.verdict == "FAIL" and any("step-1 gradients" in c["target"] for c in failed), res.checks
