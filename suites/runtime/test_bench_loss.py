"""``dcp-harness bench loss``: the whole head against chunked heads, side by side, its JSON and its refusals (the GPU
figures: ``reports/recorded/``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.bench import loss as bl


def test_a_cpu_run_alternates_the_arms_and_holds_every_chunk_to_the_whole_head(tmp_path):
    out = tmp_path / "loss.json"
    proc = subprocess.run([sys.executable, "-m", "harness", "bench", "loss", "--device", "cpu", "--tokens", "200",
                           "--hidden", "16", "--vocab", "300", "--chunks", "64,7", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [r["chunk"] for r in rows] == [0, 64, 7]  # the whole head first: every ratio's denominator
    assert all(len(r["times_ms"]) == 2 and r["ms"] > 0 for r in rows)
    assert rows[0]["time_ratio"] == 1.0 and rows[1]["logits_mib"] == 64 * 300 * 4 / 2**20
    assert all(r["peak_mib"] is None for r in rows)  # no allocator statistics on the CPU
    assert [c["pass"] for c in doc["checks"]] == [True, True] and "chunk 7: losses and gradients" in proc.stdout


def test_a_chunk_whose_gradients_drift_fails_its_check():
    """The agreement check can fail: a deviation past fp32's 1e-4 (and a NaN) is a FAIL line."""
    cfg = {"device": "cpu", "tokens": 64}
    rows = [{"chunk": 0}, {"chunk": 8, "loss_dev": 0.0, "dh_dev": 2e-4, "dw_dev": 0.0},
            {"chunk": 16, "loss_dev": float("nan"), "dh_dev": 0.0, "dw_dev": 0.0}]
    assert [c["pass"] for c in bl.checks_of({"config": cfg, "rows": rows})] == [False, False]


def test_the_cuda_targets_judge_memory_and_time_for_chunks_of_at_most_an_eighth():
    cfg = {"device": "cuda", "tokens": 64}
    ok = {"loss_dev": 0.0, "dh_dev": 0.0, "dw_dev": 0.0}
    rows = [{"chunk": 0}, {"chunk": 8, **ok, "memory_saved": 4.5, "time_ratio": 1.6},
            {"chunk": 32, **ok, "memory_saved": 1.5, "time_ratio": 1.1}]
    got = {c["target"]: c["pass"] for c in bl.checks_of({"config": cfg, "rows": rows})}
    assert got == {"chunk 8: losses and gradients within 0.05 of the whole head's": True,
                   "chunk 8: peak memory at most 1/4 of the whole head's": True,
                   "chunk 8: median time at most 1.5x the whole head's": False,
                   "chunk 32: losses and gradients within 0.05 of the whole head's": True}


@pytest.mark.parametrize("args, match", [(["--chunks", ","], "give one or more chunk sizes"),
                                          (["--chunks", "-3"], "-3"), (["--vocab", "1"], "two classes")])
def test_bad_options_are_one_line_and_exit_2(args, match, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "bench", "loss", "--device", "cpu", *args, "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and match in proc.stderr, proc.stderr
    assert not (tmp_path / "x.json").exists()
