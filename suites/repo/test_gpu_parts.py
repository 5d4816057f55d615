"""``--gpu-part``: the GPU suite in parts that each fit one device call; every GPU test is in exactly one part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.pytest_plugin import GPU_PARTS, gpu_part

ROOT = Path(__file__).resolve().parents[2]


def _collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          "suites/gpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_parts_split_the_gpu_suite_exactly():
    every = _collected()
    parts = {p: _collected("--gpu-part", p) for p in GPU_PARTS}
    assert all(parts.values()), {p: len(v) for p, v in parts.items()}
    assert sorted(t for v in parts.values() for t in v) == sorted(every)  # each test once, none left out


def test_a_test_goes_to_its_part_by_file_and_parameters():
    assert gpu_part("suites/gpu/test_gpu_te.py::test_x", {}) == "attention"
    assert gpu_part("suites/gpu/test_gpu_convergence.py::test_layouts_agree_in_bf16[tiny-gpt-4]",
                    {"nproc": 4, "model": "tiny-gpt"}) == "converge-4"
    assert gpu_part("suites/gpu/test_gpu_convergence.py::test_pipeline_of_two_stages_with_dynamic_cp_in_bf16[x]",
                    {"vpp": 2}) == "pipeline-vpp2"
    assert gpu_part("suites/gpu/test_gpu_replay.py::test_replay_pp2_cp2_bf16", {}) == "models"
    assert gpu_part("suites/plan/test_thd.py::test_x", {}) is None
