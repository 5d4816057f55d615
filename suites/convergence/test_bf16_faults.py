"""Every training fault of the catalogue that ``converge --plant`` can carry turns a bf16 run's verdict to FAIL, or stops
the job by its audit: what a GPU user's bf16 runs catch. Two of them (wrong RoPE offsets, zig-zag ``r + cp``) pass
bf16's own bands and are caught by the fp32 step 1 (``TrainConfig.fp32_probe``) only."""

from __future__ import annotations

import pytest

from harness.apps import converge
from harness.jobs.watchdog import JobFailure
from harness.train.config import TrainConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_zygote")]  # ~15 s a fault on 2 cores

FAULTS = ("rope-positions-per-rank", "labels-rolled-after-split", "loss-tokens-per-cp-rank", "loss-counts-padding",
          "padding-trained-on", "adam-eps-underflow", "grad-reduce-dp-only", "grad-reduce-wrong-scale",
          "reroute-drops-sequence", "reroute-misorders-sequences", "pack-without-cu-seqlens", "zigzag-r-plus-cp",
          "key-grads-overwritten", "weight-copy-never-refreshed", "wgrad-first-microbatch-only")
AUDITED = ("stale-cp-group", "module-keeps-cp-group", "destroyed-group-reused")
PROBE_ONLY = {"rope-positions-per-rank", "zigzag-r-plus-cp"}
CFG = TrainConfig(steps=2, dtype="bfloat16", layouts=("thd", "dcp"))


@pytest.mark.parametrize("fault", FAULTS)
def test_a_bf16_run_fails_with_the_fault_planted(fault, tmp_path):
    res = converge.run(CFG, world=4, out_root=str(tmp_path), progress=lambda s: None, report=False, golden="off", plant=fault)
    failed = [c["target"] for c in res.checks if not c["pass"]]
    assert res.verdict == "FAIL", failed
    if fault in PROBE_ONLY:  # the reason for the probe step: bf16's own checks pass these
        assert all("in fp32" in t for t in failed), failed


@pytest.mark.parametrize("fault", AUDITED)
def test_a_bf16_run_with_a_group_fault_stops_at_its_audit(fault, tmp_path):
    with pytest.raises(JobFailure, match="group audit"):
        converge.run(CFG, world=4, out_root=str(tmp_path), progress=lambda s: None, report=False, golden="off", plant=fault)


@pytest.mark.parametrize("fault, line", [("fp32-step-in-bf16", "in fp32 (step 1 run again in fp32)"),
                                         ("fp32-step-of-another-model", "in bf16 against its own fp32 step 1")])
def test_the_fp32_steps_own_faults_fail_a_bf16_run(fault, line, tmp_path):
    """The fp32 step is shared by the layouts and the reference: kept in bf16, its layout-vs-reference lines see bf16's
    rounding (~2e-3 against 1e-5); started from another seed (1 -> 2: both batches fit), the layouts and the reference
    agree, and only each run's bf16 step 1 against its own fp32 step 1 fails."""
    from dataclasses import replace

    cfg = replace(CFG, steps=1, layouts=("dcp",), corpus=replace(CFG.corpus, seed=1))
    res = converge.run(cfg, world=4, out_root=str(tmp_path), progress=lambda s: None, report=False, golden="off",
                       plant=fault)
    failed = [c["target"] for c in res.checks if not c["pass"]]
    assert res.verdict == "FAIL" and failed and all(line in t for t in failed), failed
