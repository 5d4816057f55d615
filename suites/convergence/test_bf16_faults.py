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
