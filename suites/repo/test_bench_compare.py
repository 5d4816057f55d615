"""``dcp-harness bench compare``: the harness's runtime and megatron-core's step side by side
(``harness.report.step_stacks``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main
from harness.report.step_stacks import CompareInputError, load_rows

RECORDED = Path(__file__).resolve().parents[2] / "reports" / "recorded"


def _runtime(tmp_path, name="runtime.json", gpus=4, drop=None):
    arms = {"thd:dp-balanced": {"trimmed_mean_ms": 90.0, "mfu": 0.1}, "dcp:balanced": {"trimmed_mean_ms": 75.0, "mfu": 0.12},
            "dcp:megatron-dev": {"trimmed_mean_ms": 80.0, "mfu": 0.11}}
    arms.pop(drop, None)
    doc = {"benchmark": "step", "config": {"model": "gpt-12l-h2048", "global_batch": "megatron"},
           "producer": {"git_rev": "aaa1111"},
           "results": {"world": gpus, "device_name": "NVIDIA H200", "arms": arms,
                       "ratios": {"speedup_vs_static": {"median": 1.2}, "ours_vs_upstream": {"median": 1.07}}}}
    (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path / name


def _stack(tmp_path, name="stack.json", gpus=4):
    doc = {"benchmark": "step_megatron_core", "config": {"model": "gpt-12l-h2048", "global_batch": "megatron", "gpus": gpus},
           "producer": {"git_rev": "bbb2222"},
           "results": {"device": "NVIDIA H200", "gpus": gpus,
                       "arms": {"static": {"median_ms": 1500.0, "mfu": 0.004}, "megatron-core": {"median_ms": 500.0, "mfu": 0.012},
                                "balanced": {"median_ms": 450.0, "mfu": 0.014}},
                       "ratios": {"megatron-core dynamic CP vs static CP": {"median": 3.0},
                                  "balanced vs static CP": {"median": 3.3},
                                  "balanced vs megatron-core's scheduler": {"median": 1.1}}}}
    (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path / name


def test_both_stacks_of_one_workload_sit_side_by_side(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main(["bench", "compare", str(_stack(tmp_path)), str(_runtime(tmp_path)), "--out", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gpt-12l-h2048")]
    assert [ln.split()[3] for ln in lines] == ["harness", "megatron-core"]  # the runtime first, whatever the order
    assert lines[0].split()[4:11] == ["90.0", "80.0", "75.0", "1.125", "1.200", "1.070", "0.120"]
    assert lines[1].split()[4:11] == ["1500.0", "500.0", "450.0", "3.000", "3.300", "1.100", "0.014"]
    doc = json.loads(out.read_text())
    assert [r["stack"] for r in doc["rows"]] == ["harness", "megatron-core"]
    assert "<table" in out.with_suffix(".html").read_text()


def test_a_report_of_neither_stack_or_without_an_arm_is_refused_naming_it(tmp_path, capsys):
    other = tmp_path / "curve.json"
    other.write_text(json.dumps({"benchmark": "step_curve", "points": []}))
    assert main(["bench", "compare", str(other), "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "curve.json is not a 'dcp-harness bench step' report of either stack" in err and not (tmp_path / "c.json").exists()
    with pytest.raises(CompareInputError, match="has no arm 'dcp:megatron-dev'"):
        load_rows([_runtime(tmp_path, drop="dcp:megatron-dev")])


def test_the_recorded_reports_read_as_recorded():
    """Megatron's batch on 4 x H200: the harness's runtime 1.123x over static CP, megatron-core's step 3.030x with
    its own scheduler and 1.353x for balanced (calibrated cost) against it (reports/recorded/README.md)."""
    rows = load_rows([RECORDED / "bench_step.h200x4.megatron-batch.json",
                      RECORDED / "bench_step_megatron_core.h200x4.megatron-batch.json"])
    assert [(r["stack"], r["gpus"]) for r in rows] == [("harness", 4), ("megatron-core", 4)]
    assert round(rows[0]["balanced_vs_static"], 3) == 1.123
    assert round(rows[1]["upstream_vs_static"], 3) == 2.652 and round(rows[1]["balanced_vs_upstream"], 3) == 1.602


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    """``dcp-harness bench compare ... | head -1``: the reader closes the pipe after one line while the table (more
    than a pipe's buffer: 400 reports) is still being written; the command stops with 141 and no traceback, as a
    shell tool does."""
    import subprocess
    import sys

    reports = [str(_runtime(tmp_path, name=f"runtime-{i:03d}-{'x' * 150}.json")) for i in range(400)]
    cmd = [sys.executable, "-m", "harness", "bench", "compare", *reports, "--out", str(tmp_path / "cmp.json")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    first = p.stdout.readline()
    p.stdout.close()  # the reader leaves after one line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err and first.strip().startswith(b"model"), err[-2000:]
