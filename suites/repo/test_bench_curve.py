"""``dcp-harness bench curve``: the speedup curve of several ``bench step`` reports (``harness.report.step_curve``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.report.step_curve import CurveInputError, load_curve

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "reports" / "recorded"


def _report(tmp_path, name, sequences, speedups, *, model="gpt-12l-h2048", world=4, benchmark="step", arm="dcp:balanced"):
    doc = {"benchmark": benchmark, "config": {"model": model}, "producer": {"git_rev": "abc1234"},
           "results": {"world": world, "device_name": "NVIDIA H200",
                       "global_batch": {"mode": f"sequences:{sequences}", "sequences_mean": float(sequences),
                                        "tokens_mean": 1000.0 * sequences},
                       "arms": {"thd:dp-balanced": {"mfu": 0.1, "trimmed_mean_ms": 100.0},
                                arm: {"mfu": 0.2, "trimmed_mean_ms": 80.0}},
                       "ratios": {"speedup_vs_static": {"median": sorted(speedups)[1], "per_run": speedups},
                                  "speedup_bound": {"median": 1.5}, "ours_vs_upstream": {"median": 1.01}}}}
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def test_the_curve_orders_points_by_sequences_and_writes_table_json_and_page(tmp_path, capsys):
    a = _report(tmp_path, "b.json", 32, [1.30, 1.34, 1.33])
    b = _report(tmp_path, "a.json", 8, [1.10, 1.12, 1.18])
    out = tmp_path / "curve.json"
    assert main(["bench", "curve", str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln.strip().startswith(("8 ", "32 "))]
    assert [ln.split()[0] for ln in lines] == ["8", "32"]  # by sequences, not by argument order
    assert "1.120" in lines[0] and "1.100 / 1.120 / 1.180" in lines[0] and "1.330" in lines[1]
    doc = json.loads(out.read_text())
    assert [p["sequences"] for p in doc["points"]] == [8.0, 32.0] and doc["points"][1]["speedup"] == 1.33
    page = out.with_suffix(".html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page and "a.json" in page


@pytest.mark.parametrize("bad, message", [
    (dict(model="gpt-9"), "has model 'gpt-9'"),
    (dict(world=2), "has world 2"),
    (dict(benchmark="attention"), "is not a 'dcp-harness bench step' report"),
    (dict(arm="dcp:other"), "has no arm 'dcp:balanced'"),
])
def test_a_point_that_does_not_belong_is_refused_naming_its_file(tmp_path, capsys, bad, message):
    good = _report(tmp_path, "good.json", 16, [1.2, 1.2, 1.2])
    other = _report(tmp_path, "other.json", 32, [1.3, 1.3, 1.3], **bad)
    assert main(["bench", "curve", str(good), str(other), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "other.json" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c.json").exists()
    with pytest.raises(CurveInputError, match="cannot read"):
        load_curve([tmp_path / "missing.json"])


def test_the_recorded_curve_reads_as_recorded():
    """The 4 x H200 records of 8, 16, 32 and 64 sequences a step (reports/recorded/README.md) read back as the
    figures the index quotes."""
    points = load_curve(sorted(RECORDED.glob("bench_step.h200x4.sequences*.json")))
    assert [p["sequences"] for p in points] == [8.0, 16.0, 32.0, 64.0]
    assert [round(p["speedup"], 3) for p in points] == [1.129, 1.227, 1.334, 1.342]
    assert [round(p["vs_upstream"], 3) for p in points] == [1.037, 1.026, 1.007, 0.972]
