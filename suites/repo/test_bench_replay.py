"""``dcp-harness bench replay``: a recorded ``bench step`` report's batches (megatron-core's stack or the harness's
runtime) regenerated, scheduled again and priced under its calibration. The reference is the GPU run itself: the
replay must regenerate the batches and schedules the GPUs trained (each arm's CP-size counts per run equal the
recorded ones)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.bench.replay import ReplayInputError, load_report, replay

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "reports" / "recorded"
DEFAULT4 = RECORDED / "bench_step_megatron_core.h200x4.json"


def _needs_upstream():
    from harness.upstream import megatron

    if not megatron.available():
        pytest.skip("megatron-core is not installed (its scheduler's arm)")


def test_the_replay_regenerates_the_batches_the_gpus_trained():
    _needs_upstream()
    report = load_report(DEFAULT4)
    got = replay(report, ("megatron-core",))
    cfg = report["config"]
    last = [b for b in got["batches"] if b["run"] == cfg["runs"]]  # the median run's figures are the arm's
    med = report["results"]["arms"]["megatron-core"]
    run = next(r for r in report["results"]["per_run"] if r["megatron-core"]["median_ms"] == med["median_ms"])
    k = report["results"]["per_run"].index(run) + 1
    counts: dict[str, int] = {}
    for b in got["batches"]:
        if b["run"] == k:
            for size, n in b["arms"]["megatron-core"]["sequences_by_cp"].items():
                counts[str(size)] = counts.get(str(size), 0) + n
    assert counts == {str(s): n for s, n in sorted(run["megatron-core"]["sequences_by_cp"].items(), key=lambda x: int(x[0]))}
    assert len(last) == cfg["iters"] and all(b["sequences"] > 0 for b in last)


def test_the_replay_of_a_runtime_report_regenerates_every_runs_schedules():
    """The harness runtime's 8-sequence report: per run (each its own calibrated cost), every arm's CP-size counts
    over the measured steps equal the recorded ones, and the measured ratios are the report's."""
    report = load_report(RECORDED / "bench_step.h200x4.sequences8.json")
    got = replay(report)
    for k, run in enumerate(report["results"]["runs"], start=1):
        for arm in report["config"]["arms"]:
            counts: dict[str, int] = {}
            for b in got["batches"]:
                if b["run"] == k:
                    for size, n in b["arms"][arm]["sequences_by_cp"].items():
                        counts[str(size)] = counts.get(str(size), 0) + n
            assert counts == run["arms"][arm]["cp_histogram"], (k, arm)
    assert abs(got["ratios"]["dcp:balanced vs thd:dp-balanced"]["measured"]
               - report["results"]["ratios"]["speedup_vs_static"]["median"]) < 1e-9


def test_balanced_with_the_stacks_capacity_is_predicted_ahead_of_megatron_cores_scheduler_on_the_recorded_batches():
    """Packed by max_seqlen_per_rank, balanced had measured 0.839x megatron-core's scheduler (the model put that
    schedule below 1 as well: ``suites/plan/test_microbatch_capacity.py``); the recorded run packs by the batch's
    tokens and measured 1.020x, and the replay of its batches predicts it within 2%."""
    _needs_upstream()
    got = replay(load_report(DEFAULT4), ("megatron-core", "balanced"))
    r = got["ratios"]["balanced vs megatron-core"]
    assert r["predicted"] >= 1.0 and r["measured"] >= 1.0 and abs(r["predicted"] / r["measured"] - 1) < 0.02, r
    assert got["arms"]["balanced"]["of_bound"] <= got["arms"]["megatron-core"]["of_bound"]


def test_the_command_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "replay.json"
    r = subprocess.run([sys.executable, "-m", "harness", "bench", "replay", "--arms", "static,balanced",
                        str(RECORDED / "bench_step_megatron_core.h200x2.megatron-batch.json"), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "balanced vs static: predicted" in r.stdout and "lower bound" in r.stdout
    d = json.loads(out.read_text())
    assert d["benchmark"] == "replay" and d["world"] == 2 and set(d["arms"]) == {"static", "balanced"}
    assert len(d["batches"]) == 18 and d["producer"]["command"]


def test_bad_reports_and_arms_are_refused_naming_them(tmp_path):
    curve = RECORDED / "bench_step_curve.h200x4.json"
    with pytest.raises(ReplayInputError, match=r"is not a 'dcp-harness bench step' report of either stack"):
        load_report(curve)
    with pytest.raises(ReplayInputError, match="cannot read"):
        load_report(tmp_path / "missing.json")
    no_cal = json.loads(DEFAULT4.read_text())
    no_cal["results"]["calibration"] = None
    (tmp_path / "nocal.json").write_text(json.dumps(no_cal))
    with pytest.raises(ReplayInputError, match="has no calibration"):
        load_report(tmp_path / "nocal.json")
    with pytest.raises(ReplayInputError, match=r"unknown arm\(s\) \['fast'\]; this report's arms are static"):
        replay(load_report(DEFAULT4), ("fast",))
    r = subprocess.run([sys.executable, "-m", "harness", "bench", "replay", str(curve)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "step_curve" in r.stderr, r.stderr


def test_a_non_finite_measurement_is_refused_naming_where_it_is(tmp_path):
    d = json.loads((RECORDED / "bench_step.h200x4.sequences8.json").read_text())
    d["results"]["runs"][2]["arms"]["dcp:megatron-dev"]["trimmed_mean_ms"] = float("nan")
    (tmp_path / "nan.json").write_text(json.dumps(d))
    with pytest.raises(ReplayInputError, match=r"results\.runs\[2\]\.arms\.dcp:megatron-dev\.trimmed_mean_ms is nan"):
        replay(load_report(tmp_path / "nan.json"))
