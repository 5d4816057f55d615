"""``--gpu-part``: the GPU suite in parts that each fit one device call; every GPU test is in exactly one part."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.pytest_plugin import GPU_PARTS, gpu_part

ROOT = Path(__file__).resolve().parents[2]


PROBE = """
import pytest

from harness.pytest_plugin import gpu_part


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):  # before ``-m`` and ``--gpu-part`` keep their tests
    for item in items:
        if item.get_closest_marker("gpu"):
            params = getattr(getattr(item, "callspec", None), "params", {})
            print(f"PART {gpu_part(item.nodeid, params)} {item.nodeid}")
"""


def _collected(tmp_path, *args: str) -> list[str]:
    """The GPU suite's collected lines (``--collect-only -q``), with a probe plugin printing each test's part."""
    (tmp_path / "dcp_parts_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "dcp_parts_probe", "-m", "gpu", "suites/gpu", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout.splitlines()


def test_the_parts_split_the_gpu_suite_exactly(tmp_path):
    """Every GPU test has one part and every part has tests; ``--gpu-part`` keeps exactly one part's tests (checked
    for a part chosen by parameters; the rule by file is the unit test below's). One collection: the probe prints
    every GPU test's part before ``--gpu-part`` filters, and ``--collect-only`` lists what it kept."""
    part = "converge-4"
    lines = _collected(tmp_path, "--gpu-part", part)
    part_of = {nodeid: p for _, p, nodeid in (line.split(" ", 2) for line in lines if line.startswith("PART "))}
    kept = [line for line in lines if "::" in line and not line.startswith("PART ")]
    assert part_of and len(part_of) == sum(line.startswith("PART ") for line in lines)  # each test once
    assert set(part_of.values()) == set(GPU_PARTS), sorted(set(part_of.values()))  # none None, none empty
    assert sorted(kept) == sorted(t for t, p in part_of.items() if p == part), part


def test_a_test_goes_to_its_part_by_file_and_parameters():
    assert gpu_part("suites/gpu/test_gpu_te.py::test_x", {}) == "attention"
    assert gpu_part("suites/gpu/test_gpu_convergence.py::test_layouts_agree_in_bf16[tiny-gpt-4]",
                    {"nproc": 4, "model": "tiny-gpt"}) == "converge-4"
    assert gpu_part("suites/gpu/test_gpu_convergence.py::test_pipeline_of_two_stages_with_dynamic_cp_in_bf16[x]",
                    {"vpp": 2}) == "pipeline-vpp2"
    assert gpu_part("suites/gpu/test_gpu_replay.py::test_replay_pp2_cp2_bf16", {}) == "models"
    assert gpu_part("suites/plan/test_thd.py::test_x", {}) is None
