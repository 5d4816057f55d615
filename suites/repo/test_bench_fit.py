"""``dcp-harness bench fit``: the cost model fitted to whole measured steps. The reference for the fitter is a known
cost model: steps priced by it (a synthetic "measurement") must give it back; on the recorded reports the held-out
validation is printed beside the calibrated model's."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.bench.fit import fit, fit_steps, steps_of
from harness.bench.replay import ReplayInputError, load_report
from harness.plan import simulate

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "reports" / "recorded"
EIGHT = RECORDED / "bench_step.h200x4.sequences8.json"


def test_steps_priced_by_a_known_model_give_it_back():
    steps = steps_of(load_report(EIGHT), "eight")
    base = steps[0]["cost"]
    known = replace(base, quadratic=base.quadratic * 0.5, per_microbatch=base.per_microbatch * 2,
                    cp_block=base.cp_block * 0.7, cp_comm=base.cp_comm * 1.5, linear=base.linear * 0.8)
    synthetic = [{**s, "ms": simulate(s["schedule"], known).step_time * 1e3 + 12.0} for s in steps]
    got = fit_steps(synthetic)
    assert got["rms_relative_error"] < 0.01, got
    from harness.bench.step.config import cost_model_from

    fitted = cost_model_from(got["cost_model"])
    worst = max(abs((simulate(s["schedule"], fitted).step_time * 1e3 + got["overhead_ms"]) / s["ms"] - 1)
                for s in synthetic)
    assert worst < 0.03, worst
    # the unfitted start (the reports' calibration) is far from it: the fit did the work
    start = max(abs((simulate(s["schedule"], s["cost"]).step_time * 1e3 + 12.0) / s["ms"] - 1) for s in synthetic)
    assert start > 5 * worst, (start, worst)


def test_the_command_fits_holds_each_report_out_and_writes_a_cost_model_bench_step_reads(tmp_path):
    from harness.bench.step.config import cost_model_from, load_cost_model

    out = tmp_path / "fit.json"
    r = subprocess.run([sys.executable, "-m", "harness", "bench", "fit", str(EIGHT),
                        str(RECORDED / "bench_step.h200x4.megatron-batch.json"), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "each report held out" in r.stdout and "mean |predicted / measured - 1|" in r.stdout
    assert "bench fit: holding out" in r.stderr and "(2 of 2)" in r.stderr  # progress of each fit
    d = json.loads(out.read_text())
    assert d["benchmark"] == "fit" and len(d["results"]["held_out"]) == 2
    cost = cost_model_from(load_cost_model(out))  # what bench step --cost-model reads
    assert cost.per_microbatch > 0 and cost.quadratic > 0


def test_bad_reports_are_refused_naming_them():
    with pytest.raises(ReplayInputError, match="fit reads the harness runtime's 'bench step' reports"):
        fit([RECORDED / "bench_step_megatron_core.h200x4.json"])
    with pytest.raises(ReplayInputError, match="a report is given twice"):
        fit([EIGHT, EIGHT])
    with pytest.raises(ReplayInputError, match=r"different worlds \(\[2, 4\] ranks\)"):
        fit([EIGHT, RECORDED / "bench_step.h200x2.megatron-batch.json"])


@pytest.mark.parametrize("damage", ["nan", "inf", "short"])
def test_a_damaged_measurement_is_refused_naming_where_it_is(tmp_path, damage):
    """A NaN or inf step time, or fewer step times than the config's steps, would silently bend the fit."""
    d = json.loads(EIGHT.read_text())
    steps = d["results"]["runs"][1]["arms"]["dcp:balanced"]["step_ms"]
    if damage == "short":
        steps.pop()
    else:
        steps[3] = float(damage)
    bad = tmp_path / "damaged.json"
    bad.write_text(json.dumps(d))
    where = r"results\.runs\[1\]\.arms\.dcp:balanced\.step_ms" + (r"\[3\] is (nan|inf)" if damage != "short" else
                                                                      r" holds 14 step times, not the 15")
    with pytest.raises(ReplayInputError, match=where):
        fit([bad])
